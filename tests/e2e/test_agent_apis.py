"""Agent-grade APIs end to end: the whole process group on the tiny qwen3 model, through the
official `openai` (Chat Completions, Responses) and `anthropic` (Messages) clients.

Random weights rarely write a tool call on their own, so calls are forced with tool_choice (the
gateway writes the call's opening into the prompt and parses opening + continuation; JSON the
model garbles is repaired to `{}`). Multi-turn sessions replay the whole history each turn, as
agents do: from the second turn on, the cached tokens must cover everything the server held
from the previous turn (its prompt + generated tokens), which only works because the gateway
renders its own earlier replies as the exact tokens it generated (prefix-stable rendering).
"""

from __future__ import annotations


import anthropic
import httpx
import openai
import pytest

from tests.helpers.calls import assert_forced_call

TIMEOUT_S = 180.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in (WEATHER, SEARCH)]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, SEARCH)]
SYSTEM = "You are a careful travel agent. Use the tools to answer."
QUESTION = "What is the weather in Paris, and what should I pack?"
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def client(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(group):
    with anthropic.Anthropic(base_url=group.url, api_key="none", timeout=TIMEOUT_S,
                             max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(tiny_qwen3):
    return tiny_qwen3.name


def messages_for(system: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]


# --- Chat Completions --------------------------------------------------------------------------


def test_chat_forced_tool_call(client, model_id):
    reply = client.chat.completions.create(
        model=model_id, messages=messages_for(SYSTEM), tools=[WEATHER, SEARCH],
        tool_choice=FORCE_WEATHER, max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert_forced_call(choice.finish_reason, call.function.arguments)
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_chat_streams_tool_call_deltas(client, model_id):
    plain = client.chat.completions.create(
        model=model_id, messages=messages_for(SYSTEM), tools=[WEATHER],
        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(
        model=model_id, messages=messages_for(SYSTEM), tools=[WEATHER],
        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert first <= 1  # announced with the first chunk after the role, before any argument
    assert calls[0].id and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert arguments == plain.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        plain.choices[0].finish_reason
    assert_forced_call(plain.choices[0].finish_reason, arguments)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_tools_auto_never_fails(client, model_id):
    """Whatever the random model writes with tools on offer (text, a malformed call), the
    answer is a 200 with text or calls."""
    reply = client.chat.completions.create(
        model=model_id, messages=messages_for(SYSTEM), tools=[WEATHER, SEARCH],
        max_tokens=48, temperature=1.0, seed=3)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


# --- Responses ---------------------------------------------------------------------------------


def test_responses_function_call_and_stream(client, model_id):
    response = client.responses.create(
        model=model_id, instructions=SYSTEM, input=QUESTION, tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "search_web"}, max_output_tokens=MAX_TOKENS,
        temperature=0)
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "search_web"
    assert_forced_call("tool_calls" if response.status == "completed" else "length",
                       call.arguments)
    assert response.usage.input_tokens > 0
    events = list(client.responses.create(
        model=model_id, instructions=SYSTEM, input=QUESTION, tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "search_web"}, max_output_tokens=MAX_TOKENS,
        temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == f"response.{response.status}"
    assert "response.function_call_arguments.delta" in types
    assert "response.output_item.done" in types
    assert events[-1].response.output[-1].arguments == call.arguments


def test_responses_text(client, model_id):
    response = client.responses.create(model=model_id, input="Say something.",
                                        max_output_tokens=8, temperature=0)
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens > 0


# --- Anthropic Messages ------------------------------------------------------------------------


def test_messages_tool_use_stream_and_count_tokens(claude):
    kwargs = dict(model="claude-local", max_tokens=MAX_TOKENS, system=SYSTEM,
                  messages=[{"role": "user", "content": QUESTION}], tools=ANTHROPIC_TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  # Messages sample at 1.0 by default, and these two runs must agree; this
                  # client has no temperature argument, so it goes in the body
                  extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert message.stop_reason in ("tool_use", "max_tokens") and message.model == "claude-local"
    tool_use = message.content[-1]
    assert tool_use.type == "tool_use" and tool_use.name == "get_weather"
    assert isinstance(tool_use.input, dict)
    counted = claude.messages.count_tokens(
        model="claude-local", system=SYSTEM, messages=kwargs["messages"],
        tools=ANTHROPIC_TOOLS, tool_choice=kwargs["tool_choice"])
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    names = []
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_message()
    assert names[0] == "message_start" and "message_stop" in names
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(names)
    assert final.content[-1].input == tool_use.input
    assert final.usage.output_tokens == usage.output_tokens


# --- multi-turn agent sessions: cached tokens cover the previous turn --------------------------


def check_turns(turns):
    """turns: (prompt_tokens, cached_tokens, completion_tokens) per request."""
    for (prompt, _, completion), (next_prompt, cached, _) in zip(turns, turns[1:]):
        # The server held prompt + generated tokens (all but the last one when max_tokens
        # stopped it); the next prompt must reuse all of that.
        assert cached >= prompt + completion - 1, turns
        assert cached < next_prompt


def test_chat_session_replay(client, model_id):
    messages = messages_for("Chat session. " + SYSTEM)
    turns = []
    for i in range(3):
        reply = client.chat.completions.create(
            model=model_id, messages=messages, tools=[WEATHER, SEARCH],
            tool_choice=FORCE_WEATHER, max_tokens=MAX_TOKENS, temperature=0)
        usage = reply.usage
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                      usage.completion_tokens))
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages += [message, {"role": "tool", "content": f"Sunny, {20 + i}C",
                               "tool_call_id": message["tool_calls"][0]["id"]}]
    check_turns(turns)


def test_responses_session_replay(client, model_id):
    items: list = [{"role": "user", "content": QUESTION}]
    turns = []
    for i in range(3):
        response = client.responses.create(
            model=model_id, instructions="Responses session. " + SYSTEM, input=items,
            tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=MAX_TOKENS, temperature=0, store=False)
        usage = response.usage
        turns.append((usage.input_tokens, usage.input_tokens_details.cached_tokens,
                      usage.output_tokens))
        call = response.output[-1]
        items += [call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id,
                   "output": f"Rain, {10 + i}C"}]
    check_turns(turns)


def test_messages_session_replay_with_billing_header(claude):
    messages = [{"role": "user", "content": QUESTION}]
    turns = []
    for i in range(3):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.{i}; "
                                           f"cch={i * 7919};"},
                  {"type": "text", "text": "Messages session. " + SYSTEM}]
        message = claude.messages.create(
            model="claude-local", max_tokens=MAX_TOKENS, system=system, messages=messages,
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
        usage = message.usage
        turns.append((usage.input_tokens + usage.cache_read_input_tokens,
                      usage.cache_read_input_tokens, usage.output_tokens))
        tool_use = message.content[-1]
        messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": tool_use.id,
                          "content": f"Windy, {5 + i}C"}]}]
    check_turns(turns)


def test_messages_session_with_system_messages_between_turns(claude):
    """Claude Code's shape: a system message after the first user turn (its agent list), and
    another after each later one. Each is kept where it stands (this template writes system
    turns in place), so every turn re-reads only its new tokens."""
    messages = [{"role": "user", "content": QUESTION}]
    turns = []
    for i in range(3):
        messages.append({"role": "system", "output_config": {"effort": "high"},
                         "content": [{"type": "text", "text": f"Agent types now: explore-{i}",
                                      "cache_control": {"type": "ephemeral"}}]})
        message = claude.messages.create(
            model="claude-sonnet-4-6", max_tokens=MAX_TOKENS,
            system=[{"type": "text", "text": "Mid-system session. " + SYSTEM}],
            messages=messages, extra_body={"thinking": {"type": "adaptive"},
                                           "output_config": {"effort": "high"}})
        usage = message.usage
        turns.append((usage.input_tokens + usage.cache_read_input_tokens,
                      usage.cache_read_input_tokens, usage.output_tokens))
        messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]
                      or [{"type": "text", "text": ""}]},
                     {"role": "user", "content": f"And on day {i + 2}?"}]
    check_turns(turns)


# --- the effect of prefix-stable rendering -----------------------------------------------------


def agent_session(client, model_id, system: str, prefix_stable: bool, num_turns: int = 6):
    """A tool-using agent: each user question gets a forced tool call, the tool's result,
    then a free-text answer; returns (prompt_tokens, cached_tokens) per request."""
    headers = {"X-Switchyard-Prefix-Stable": "on" if prefix_stable else "off"}
    messages = messages_for(system)
    shares = []
    for turn in range(num_turns):
        forced = turn % 2 == 0
        reply = client.chat.completions.create(
            model=model_id, messages=messages, tools=[WEATHER, SEARCH],
            tool_choice=FORCE_WEATHER if forced else "none", max_tokens=24 if forced else 48,
            temperature=0,
            extra_headers=headers)
        usage = reply.usage
        shares.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if forced:
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": f"Paris: light rain, {12 + turn}C, wind 20 km/h."})
        else:
            messages.append({"role": "user", "content": f"Thanks. Now day {turn + 2}?"})
    return shares


def test_prefix_stable_rendering_effect(client, model_id, capsys):
    """The measurement: the same kind of session with and without prefix-stable rendering
    (per-request header), different system prompts so they share nothing."""
    with_it = agent_session(client, model_id, "Alpha desk. " + SYSTEM, True)
    without = agent_session(client, model_id, "Bravo desk. " + SYSTEM, False)

    def share(turns):
        later = turns[1:]
        return sum(c for _, c in later) / sum(p for p, _ in later)

    def prefilled(turns):
        later = turns[1:]
        return sum(p - c for p, c in later) / len(later)

    with capsys.disabled():
        print(f"\nprefix reuse per request (cached/prompt tokens), {len(with_it)}-request "
              "tool session (forced call, tool result, text answer, ...):")
        for name, turns in (("with", with_it), ("without", without)):
            per_turn = " ".join(f"{c}/{p}" for p, c in turns)
            print(f"  {name:8} prefix-stable: {per_turn}  -> requests 2+: {share(turns):.1%} "
                  f"reused, {prefilled(turns):.1f} tokens prefilled per request")
    assert share(with_it) > share(without)
    assert prefilled(with_it) < prefilled(without)
    for (p, _), (p2, c2) in zip(with_it, with_it[1:]):
        assert c2 >= p  # never less than the whole previous prompt
    assert share(with_it) > 0.85


def test_health_after_agent_traffic(group):
    assert httpx.get(group.url + "/health", timeout=TIMEOUT_S).status_code == 200
