"""Splitting streamed model output into reasoning, text and tool calls, at any chunking."""

import json
import random

import pytest

from switchyard.gateway.output.parser import (Forced, OutputParser, ReasoningDelta, TextDelta, ToolCallDone,
                            ToolCallStart)
from switchyard.gateway.output.reasoning import ThinkSyntax, prompt_opens_reasoning
from switchyard.gateway.output.tools import HERMES
from switchyard.gateway.request.tools import parse_openai_tools

THINK = ThinkSyntax("<think>", "</think>")
TOOLS = parse_openai_tools([
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "search_web"}}])


def make(**kw):
    ids = iter(f"call_{i}" for i in range(100))
    kw.setdefault("think", THINK)
    kw.setdefault("syntax", HERMES)
    kw.setdefault("tools", TOOLS)
    return OutputParser(new_id=lambda: next(ids), **kw)


def run(parser, chunks, **finish):
    events = parser.start_events()
    for chunk in chunks:
        events += parser.push(chunk)
    return events + parser.finish(**finish)


def summary(events):
    """Adjacent deltas of one kind merged: the same for any chunking of the same output."""
    out = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind = type(event).__name__
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + event.text)
            else:
                out.append((kind, event.text))
        elif isinstance(event, ToolCallStart):
            out.append(("start", event.index, event.id, event.name))
        else:
            out.append(("done", event.index, event.call.name, json.loads(event.call.arguments)))
    return out


# Model-shaped outputs (Qwen3 style) and what they must give.
QWEN3_THINK_AND_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search_web", "arguments": {"query": "Paris 🦜"}}\n</tool_call>')
EXPECTED_THINK_AND_CALL = [
    ("ReasoningDelta", "The user wants the weather."),
    ("TextDelta", "Let me check."),
    ("start", 0, "call_0", "get_weather"), ("done", 0, "get_weather", {"city": "Paris"}),
    ("start", 1, "call_1", "search_web"), ("done", 1, "search_web", {"query": "Paris 🦜"}),
]


def test_reasoning_text_and_two_calls():
    parser = make()
    assert summary(run(parser, [QWEN3_THINK_AND_CALL])) == EXPECTED_THINK_AND_CALL
    assert parser.reasoning_text == "The user wants the weather."
    assert parser.content_text == "Let me check."
    assert [c.name for c in parser.calls] == ["get_weather", "search_web"]
    assert parser.num_malformed == 0


def chunked(text, rng, max_cuts=40):
    cuts = sorted({rng.randint(0, len(text)) for _ in range(rng.randint(0, max_cuts))})
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [None])]


def test_every_single_cut_gives_the_same_events():
    text = QWEN3_THINK_AND_CALL
    for i in range(len(text) + 1):
        assert summary(run(make(), [text[:i], text[i:]])) == EXPECTED_THINK_AND_CALL, i


@pytest.mark.parametrize("seed", range(300))
def test_any_chunking_gives_the_same_events(seed):
    rng = random.Random(seed)
    chunks = chunked(QWEN3_THINK_AND_CALL, rng)
    assert summary(run(make(), chunks)) == EXPECTED_THINK_AND_CALL


ALPHABET = list("ab <>/\n{}\":") + ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def test_random_text_never_loses_or_invents_characters_outside_calls():
    """Without a parsable call, every character comes out as text, once, at any chunking."""
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        parser = make(think=None)
        events = run(parser, chunked(text, rng, 10))
        if not parser.calls:
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text


def test_plain_text_passes_through_and_markers_mid_text_are_text():
    parser = make()
    text = "Hello <think> is just a tag here."
    assert summary(run(parser, [text])) == [("TextDelta", text)]
    assert make(syntax=None).push("a <tool_call> b") == [TextDelta("a <tool_call> b")]


def test_partial_marker_is_held_then_released():
    parser = make()
    assert parser.push("Hi <tool") == [TextDelta("Hi")]
    assert parser.push("box>") == [TextDelta(" <toolbox>")]


def test_whitespace_before_a_call_is_dropped_but_kept_elsewhere():
    parser = make()
    assert summary(run(parser, ["a \n", "\nb\n\n", CALL_TEXT, "\n\n"])) == [
        ("TextDelta", "a \n\nb"), ("start", 0, "call_0", "get_weather"),
        ("done", 0, "get_weather", {"city": "Paris"})]
    parser = make()
    assert summary(run(parser, ["end \n\n"])) == [("TextDelta", "end \n\n")]


def test_unclosed_reasoning_at_the_end_is_reasoning():
    parser = make()
    assert summary(run(parser, ["<think>\nstill thinking"])) == [
        ("ReasoningDelta", "still thinking")]
    assert parser.content_text == ""


def test_prompt_that_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", THINK)
    parser = make(start_in_reasoning=True)
    assert summary(run(parser, ["plan\n</think>\n\nanswer"])) == [
        ("ReasoningDelta", "plan"), ("TextDelta", "answer")]


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_malformed_call_is_text_and_counted():
    parser = make()
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>'
    events = run(parser, [text])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
    assert parser.calls == [] and parser.num_malformed == 1


def test_call_cut_short_is_text():
    parser = make()
    events = run(parser, ['<tool_call>\n{"name": "get_weather", "argu'])
    assert summary(events) == [("TextDelta", '<tool_call>\n{"name": "get_weather", "argu')]
    assert parser.num_malformed == 1


def test_no_parallel_calls_stops_after_the_first():
    parser = make(parallel=False)
    events = parser.push(QWEN3_THINK_AND_CALL)
    assert parser.stop_requested
    assert [e.call.name for e in events if isinstance(e, ToolCallDone)] == ["get_weather"]
    assert parser.push("more") == [] and parser.finish() == []


def test_forced_named_call_is_announced_first_and_repaired():
    forced = Forced(opening='\n{"name": "get_weather", "arguments": ', name="get_weather")
    parser = make(forced=forced, parallel=False)
    assert parser.start_events() == [ToolCallStart(0, "call_0", "get_weather")]
    events = parser.push("gibberish ]] and more")
    assert events == []
    events = parser.finish()
    assert summary(events) == [("done", 0, "get_weather", {})]
    assert parser.num_repaired == 1 and parser.calls[0].id == "call_0"


def test_forced_named_call_closed_by_stop_token():
    forced = Forced(opening='\n{"name": "get_weather", "arguments": ', name="get_weather")
    parser = make(forced=forced, parallel=False)
    events = run(parser, ['{"city": "Oslo"}', "}\n"], closed_by_stop=True)
    assert summary(events) == [("start", 0, "call_0", "get_weather"),
                               ("done", 0, "get_weather", {"city": "Oslo"})]
    assert parser.num_repaired == 0


def test_a_forced_call_cut_by_the_token_limit_is_incomplete_not_repaired():
    """The model wrote digits until max_tokens; the call is returned as
    far as it was written, incomplete, never as `{}` presented as complete."""
    forced = Forced(opening='\n{"name": "get_weather", "arguments": ', name="get_weather")
    parser = make(forced=forced, parallel=False)
    events = run(parser, ['{"path": "a.py", "line": 12', "34567"], truncated=True)
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    assert done.call.arguments == '{"path": "a.py", "line": 1234567'
    assert not done.call.complete and parser.truncated_call and parser.num_repaired == 0
    assert done.call.input == {"path": "a.py"}  # members written in full only
    # `required` with several tools: the model was writing the name as well.
    parser = make(forced=Forced(opening='\n{"name": "', name=None))
    events = run(parser, ['search_web", "arguments": {"query": "q', 'uic'], truncated=True)
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    assert (done.call.name, done.call.arguments) == ("search_web", '{"query": "quic')
    assert not done.call.complete and done.call.input == {}
    # Cut by the limit after the call closed: a complete call, as before.
    parser = make(forced=forced, parallel=False)
    events = run(parser, ['{"city": "Oslo"}}\n</tool_call>'], truncated=True)
    assert parser.calls[0].complete and not parser.truncated_call


def test_forced_call_with_its_end_marker_in_the_text():
    forced = Forced(opening='\n{"name": "', name=None)
    parser = make(forced=forced)
    assert parser.start_events() == []  # the name is the model's to choose
    events = run(parser, ['search_web", "arguments": {"query": "q"}}\n</tool_call>', "\nbye"])
    assert summary(events) == [("start", 0, "call_0", "search_web"),
                               ("done", 0, "search_web", {"query": "q"}),
                               ("TextDelta", "bye")]


def test_call_without_end_marker_runs_to_the_end():
    from switchyard.gateway.output.tools import ToolSyntax, _parse_json

    syntax = ToolSyntax("json_tools", "[TOOL_CALLS]", "", _parse_json)
    parser = make(syntax=syntax)
    events = run(parser, ['[TOOL_CALLS]{"name": "get_weather", ', '"arguments": {}}'])
    assert summary(events) == [("start", 0, "call_0", "get_weather"),
                               ("done", 0, "get_weather", {})]
