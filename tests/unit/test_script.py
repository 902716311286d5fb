"""Scripted replies: the file format (common/script.py) and what of a request the rules read
(gateway/request/scripted.py), without sockets or a model."""

from __future__ import annotations

import json

import pytest

from switchyard.gateway.output.tools import HERMES
from switchyard.gateway.request.model import ChatRequest, Options
from switchyard.gateway.request.scripted import reply_text, request_texts, scripted_rule
from switchyard.common.script import ScriptError, load_script, parse_script

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("Bash", "Agent")]


def chat(*messages, tools=TOOLS) -> ChatRequest:
    return ChatRequest(list(messages), Options(), tools=tools)


def test_the_first_rule_that_holds_replies():
    script = parse_script({"rules": [
        {"when": {"last": ["3 a\\.txt", "4 b"], "tools": ["Bash"]}, "say": "total 7"},
        {"when": {"system": "sub-agent", "last": "count"}, "calls": [
            {"name": "Bash", "arguments": {"command": "wc -l a.txt"}}]},
        {"when": {"last": "count"}, "say": "main"},
    ]})
    assert script.reply("You are a sub-agent", "count a.txt", ["Bash"]).number == 2
    assert script.reply("You are the main agent", "count a.txt", []).number == 3
    assert script.reply("", "3 a.txt\n4 b.txt", ["Bash", "Agent"]).number == 1
    assert script.reply("", "3 a.txt\n4 b.txt", ["Agent"]) is None  # Bash not offered
    assert script.reply("", "3 a.txt", ["Bash"]) is None  # every regex of a list must hold


def test_system_messages_anywhere_belong_to_the_system_prompt_not_the_last_turn():
    request = chat({"role": "system", "content": "You are Claude Code."},
                   {"role": "user", "content": "Count the lines of a.txt"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "Bash", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "3 a.txt"},
                   {"role": "user", "content": [{"type": "text", "text": "go on"}]},
                   {"role": "system", "content": "Available agent types: general-purpose"})
    system, last, tools = request_texts(request)
    assert system == "You are Claude Code.\nAvailable agent types: general-purpose"
    assert last == "3 a.txt\ngo on"  # after the last assistant message: results, then text
    assert tools == ["Bash", "Agent"]
    script = parse_script({"rules": [{"when": {"last": "Count the lines"}, "say": "no"},
                                     {"when": {"last": "^3 a.txt"}, "say": "yes"}]})
    assert scripted_rule(script, request).say == "yes"
    assert scripted_rule(None, request) is None


def test_the_reply_is_the_text_then_each_call_in_the_models_own_syntax():
    rule = parse_script({"rules": [{"say": "Counting.", "calls": [
        {"name": "Bash", "arguments": {"command": "wc -l a.txt"}},
        {"name": "Bash", "arguments": {"command": "wc -l b.txt"}}]}]}).rules[0]
    assert reply_text(rule, HERMES) == (
        'Counting.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "wc -l a.txt"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "Bash", "arguments": {"command": "wc -l b.txt"}}\n'
        '</tool_call>')


@pytest.mark.parametrize("script, says", [
    ([], "must be an object"),
    ({"rules": [{"say": "x"}], "extra": 1}, "unknown top-level key 'extra'"),
    ({"rules": [{"when": {"last": "("}, "say": "x"}]}, "rule 1: 'when.last' '(' is not a valid regex"),
    ({"rules": [{"say": "x"}, {"when": {"system": "[a-"}, "say": "x"}]},
     "rule 2: 'when.system' '[a-' is not a valid regex"),
    ({"rules": [{"calls": [{"arguments": {}}]}]}, "rule 1: call 1: has no 'name'"),
    ({"rules": [{"calls": [{"name": "Bash", "arguments": "ls"}]}]},
     "rule 1: call 1 (Bash): 'arguments' must be an object"),
    ({"rules": [{"when": {"last": "x"}}]}, "rule 1: says nothing"),
    ({"rules": [{"when": {"lats": "x"}, "say": "x"}]}, "rule 1: 'when': unknown key 'lats'"),
    ({"rules": [{"say": 3}]}, "rule 1: 'say' must be a string"),
    ({"rules": [{"when": {"tools": "Bash"}, "say": "x"}]}, "rule 1: 'when.tools' must be a list"),
])
def test_a_bad_script_is_one_line_naming_the_rule(tmp_path, script, says):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    with pytest.raises(ScriptError) as caught:
        load_script(path)
    message = str(caught.value)
    assert message.startswith(f"--script {path}: ") and says in message
    assert "\n" not in message


def test_a_file_that_is_not_json_or_not_there_is_one_line(tmp_path):
    path = tmp_path / "script.json"
    path.write_text('{"rules": [')
    with pytest.raises(ScriptError, match="not valid JSON"):
        load_script(path)
    with pytest.raises(ScriptError, match="cannot read it"):
        load_script(tmp_path / "missing.json")
