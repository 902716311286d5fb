"""Fields current agent clients send (docs/clients.md "Agent clients"): each is honoured, mapped or
ignored by design, and an unknown top-level field is accepted and logged once by name."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from switchyard.gateway.request.wire import decoding
from switchyard.gateway.api.anthropic_api import parse_messages_request
from switchyard.gateway.api.responses_api import ResponsesFormat, parse_responses_request
from switchyard.gateway.api.openai_request import parse_chat_request
from switchyard.gateway.errors import APIError
from switchyard.gateway.generation import Usage
from switchyard.gateway.output.tools import ToolCall
from switchyard.gateway.request.response_store import ResponseStore
from switchyard.gateway.turn import TurnResult

FN = {"type": "function", "name": "exec_command", "description": "Run a command",
      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
             "tools": [SPAWN]}


def anthropic(**fields):
    body = {"model": "claude-sonnet-4-6", "max_tokens": 32000,
            "messages": [{"role": "user", "content": "hi"}]} | fields
    return parse_messages_request(body).chat


def responses(**fields):
    return parse_responses_request({"model": "m", "input": "hi"} | fields, ResponseStore(4))


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(*args, **kwargs)
    return caught.value


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(decoding, "_noted", set())


# --- Anthropic Messages ------------------------------------------------------------------------


def test_system_messages_inside_messages_are_kept_where_they_stand():
    chat = anthropic(system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                             {"type": "text", "text": "You are Claude Code.",
                              "cache_control": {"type": "ephemeral"}}],
                     messages=[
                         {"role": "user", "content": [{"type": "text", "text": "List files"}]},
                         {"role": "system", "output_config": {"effort": "low"},
                          "content": [{"type": "text", "text": "Agent types: explore",
                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": "Sure."},
                         {"role": "system", "content": "Reminder"}])
    assert chat.messages == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "List files"},
        {"role": "system", "content": "Agent types: explore"},
        {"role": "assistant", "content": "Sure."},
        {"role": "system", "content": "Reminder"}]
    error = refused(anthropic, messages=[{"role": "system", "content": 5}])
    assert error.param == "messages[0].content"
    error = refused(anthropic, messages=[{"role": "tool", "content": "x"}])
    assert "must be 'user', 'assistant' or 'system'" in error.message


@pytest.mark.parametrize("thinking, kwargs", [
    ({"type": "adaptive"}, {}),
    ({"type": "enabled", "budget_tokens": 4096}, {"enable_thinking": True}),
    ({"type": "disabled"}, {"enable_thinking": False}),
])
def test_thinking_types(thinking, kwargs):
    assert anthropic(thinking=thinking).template_kwargs == kwargs


def test_thinking_of_another_type_is_a_400_naming_the_three():
    error = refused(anthropic, thinking={"type": "sometimes"})
    assert error.param == "thinking.type" and "'adaptive'" in error.message
    assert refused(anthropic, thinking={"type": "enabled", "budget_tokens": "many"}).param \
        == "thinking.budget_tokens"


@pytest.mark.parametrize("effort, mapped", [("low", "low"), ("medium", "medium"),
                                            ("high", "high"), ("max", "high")])
def test_output_config_effort_is_the_templates_reasoning_effort(effort, mapped):
    chat = anthropic(thinking={"type": "adaptive"}, output_config={"effort": effort})
    assert chat.template_kwargs == {"reasoning_effort": mapped}


def test_an_effort_this_server_does_not_know_is_logged_not_refused():
    with capture_logs() as logs:
        chat = anthropic(output_config={"effort": "ludicrous"})
    assert chat.template_kwargs == {}
    assert [e["field"] for e in logs] == ["output_config.effort=ludicrous"]


def thought(text):
    return {"role": "assistant", "content": [{"type": "thinking", "thinking": text,
                                              "signature": "sig"},
                                             {"type": "text", "text": "ok"}]}


def test_clear_thinking_keeps_the_last_turns_thinking():
    history = [{"role": "user", "content": "a"}, thought("one"), {"role": "user", "content": "b"},
               thought("two"), {"role": "user", "content": "c"}]
    keep_one = {"edits": [{"type": "clear_thinking_20251015",
                           "keep": {"type": "thinking_turns", "value": 1}}]}
    chat = anthropic(messages=history, context_management=keep_one)
    assert [m.get("reasoning_content") for m in chat.messages if m["role"] == "assistant"] \
        == [None, "two"]
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    chat = anthropic(messages=history, context_management=keep_all)
    assert [m.get("reasoning_content") for m in chat.messages if m["role"] == "assistant"] \
        == ["one", "two"]


def test_other_context_edits_are_accepted_and_logged():
    with capture_logs() as logs:
        anthropic(context_management={"edits": [{"type": "clear_tool_uses_20250919",
                                                 "trigger": {"type": "input_tokens",
                                                             "value": 30000}}]})
    assert [e["field"] for e in logs] == [
        "context_management.edits[].type=clear_tool_uses_20250919"]
    assert refused(anthropic, context_management={"edits": [{"keep": "all"}]}).param \
        == "context_management.edits[0]"


def test_metadata_and_unknown_fields():
    with capture_logs() as logs:
        for _ in range(3):
            anthropic(metadata={"user_id": '{"device_id": "d", "session_id": "s"}'},
                      speed="fast", diagnostics={"x": 1})
    assert sorted(e["field"] for e in logs) == ["messages.diagnostics", "messages.speed"]
    assert refused(anthropic, metadata="user").param == "metadata"  # known: still checked


def test_noted_names_are_bounded(monkeypatch):
    monkeypatch.setattr(decoding, "MAX_NOTED_NAMES", 3)
    with capture_logs() as logs:
        anthropic(**{f"junk{i}": 1 for i in range(10)})
    assert len(logs) == 3


# --- Responses ---------------------------------------------------------------------------------


def test_namespace_functions_are_offered_as_functions_and_called_with_their_namespace():
    parsed = responses(tools=[FN, NAMESPACE, {"type": "web_search",
                                              "external_web_access": False}])
    assert [t["function"]["name"] for t in parsed.chat.tools] == ["exec_command",
                                                                   "spawn_agent"]
    assert parsed.namespaces == {"spawn_agent": "multi_agent_v1"}
    result = TurnResult("", "", [ToolCall("c1", "spawn_agent", "{}"),
                                 ToolCall("c2", "exec_command", "{}")], "tool_calls", None,
                        Usage(10, 2, 0))
    spawn, run = ResponsesFormat("resp_1", "m", parsed).output_items(result)
    assert spawn["namespace"] == "multi_agent_v1" and spawn["name"] == "spawn_agent"
    assert "namespace" not in run


def test_built_in_tools_are_left_out_and_logged_and_refused_when_forced():
    with capture_logs() as logs:
        parsed = responses(tools=[{"type": "web_search"}, FN])
    assert [t["function"]["name"] for t in parsed.chat.tools] == ["exec_command"]
    assert [e["field"] for e in logs] == ["responses.tools[].type=web_search"]
    error = refused(responses, tools=[{"type": "web_search"}, FN],
                    tool_choice={"type": "web_search"})
    assert error.param == "tool_choice" and "web_search" in error.message


def test_a_function_offered_twice_is_a_400():
    error = refused(responses, tools=[SPAWN, NAMESPACE])
    assert error.param == "tools[1].tools[0].name"


def test_codex_fields_are_accepted():
    with capture_logs() as logs:
        parsed = responses(
            input=[{"type": "message", "role": "developer",
                    "content": [{"type": "input_text", "text": "Be careful."}]},
                   {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}]}],
            tools=[FN], tool_choice="auto", parallel_tool_calls=True,
            reasoning={"summary": "auto", "effort": "high"}, store=False,
            include=["reasoning.encrypted_content"], prompt_cache_key="0191-abc",
            client_metadata={"session_id": "s"})
    assert not logs
    assert parsed.chat.messages == [{"role": "system", "content": "Be careful."},
                                    {"role": "user", "content": "hi"}]
    assert parsed.chat.template_kwargs == {"reasoning_effort": "high"}
    assert parsed.store is False
    assert refused(responses, include="all").param == "include"


# --- Chat Completions --------------------------------------------------------------------------


def test_chat_fields_agents_send():
    with capture_logs() as logs:
        chat = parse_chat_request({
            "model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": "hi"}],
            "reasoning_effort": "low", "max_completion_tokens": 64,
            "stream": True, "stream_options": {"include_usage": True},
            "parallel_tool_calls": False, "prompt_cache_key": "k", "store": False})
    assert not logs
    assert chat.messages[0]["role"] == "system"
    assert chat.template_kwargs == {"reasoning_effort": "low"}
    assert chat.options.max_tokens == 64 and chat.options.include_usage
    # The template's own variable, when a client sets it, wins.
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                               "reasoning_effort": "low",
                               "chat_template_kwargs": {"reasoning_effort": "medium"}})
    assert chat.template_kwargs == {"reasoning_effort": "medium"}
    with capture_logs() as logs:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                            "functions": [{"name": "f"}]})
    assert [e["field"] for e in logs] == ["chat.completions.functions"]


# --- Reasoning effort, the same in every API ---------------------------------------------------


@pytest.mark.parametrize("parse, field, path", [
    (lambda e: anthropic(output_config={"effort": e}), "output_config", "output_config.effort"),
    (lambda e: responses(reasoning={"effort": e}).chat, "reasoning", "reasoning.effort"),
    (lambda e: parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                                   "reasoning_effort": e}), None, "reasoning_effort"),
])
def test_each_api_decodes_reasoning_effort_as_the_template_takes_it(parse, field, path):
    assert parse("minimal").template_kwargs == {"reasoning_effort": "low"}
    assert parse("xhigh").template_kwargs == {"reasoning_effort": "high"}
    with capture_logs() as logs:
        assert parse("none").template_kwargs == {}
        assert parse("ludicrous").template_kwargs == {}
    assert [e["field"] for e in logs] == [f"{path}=ludicrous"]
    assert refused(parse, 5).param == path
