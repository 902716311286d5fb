"""A non-Qwen chat format end to end: the tiny model with gpt-oss's harmony tokenizer and chat
template (fixtures/chat_formats.py), through the official `openai` client.

Random weights do not write a real harmony call, so this checks what the server does around
the model: the format is detected from the template, forced calls are written as harmony's
commentary-channel opening and come back as calls (streamed too), the harmony control tokens
reach the parser, and a resent history of calls and results re-renders through the template
(which needs the calls to name the results) as exactly the tokens the server holds. The parsers
themselves are tested on recorded outputs in tests/unit/test_chat_formats.py.
"""

from __future__ import annotations


import openai
import pytest

from fixtures.chat_formats import write_tokenizer
from tests.helpers.calls import assert_forced_call
from switchyard.testing.group import ServerGroup

TIMEOUT_S = 180.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    from fixtures.tiny_models import generate_tiny_model

    model = generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gpt-oss-format",
                                "qwen3")
    write_tokenizer(model, "gpt_oss")
    return model


@pytest.fixture(scope="module")
def client(harmony_model):
    with ServerGroup(harmony_model, slots=2, ctx=4096) as group, openai.OpenAI(
            base_url=group.base_url, api_key="none", timeout=TIMEOUT_S, max_retries=0) as c:
        yield c


def test_forced_call_comes_back_as_a_call(client):
    reply = client.chat.completions.create(
        model="tiny-gpt-oss-format", messages=MESSAGES, tools=[WEATHER, SEARCH],
        tool_choice=FORCE_WEATHER, max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_forced_call(choice.finish_reason, call.function.arguments)


def test_required_call_streams(client):
    stream = list(client.chat.completions.create(
        model="tiny-gpt-oss-format", messages=MESSAGES, tools=[SEARCH],
        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls and calls[0].function.name == "search_web"
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert_forced_call([c.choices[0].finish_reason for c in stream if c.choices][-1],
                       arguments)


def test_auto_tools_never_fail(client):
    reply = client.chat.completions.create(
        model="tiny-gpt-oss-format", messages=MESSAGES, tools=[WEATHER], max_tokens=MAX_TOKENS,
        temperature=0)
    message = reply.choices[0].message
    assert isinstance(message.content, str) or message.tool_calls


def test_session_replay_reuses_everything_the_server_held(client):
    messages = list(MESSAGES)
    turns = []
    for i in range(3):
        reply = client.chat.completions.create(
            model="tiny-gpt-oss-format", messages=messages, tools=[WEATHER, SEARCH],
            tool_choice=FORCE_WEATHER, max_tokens=MAX_TOKENS, temperature=0, seed=i)
        usage = reply.usage
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                      usage.completion_tokens))
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages += [message, {"role": "tool", "content": f"Sunny, {20 + i}C",
                               "tool_call_id": message["tool_calls"][0]["id"]}]
    for (prompt, _, completion), (next_prompt, cached, _) in zip(turns, turns[1:]):
        assert cached >= prompt + completion - 1, turns
        assert cached < next_prompt, turns


def test_system_messages_between_turns_join_the_user_side(client):
    """gpt-oss's template drops a system message after the first user turn: its text joins
    the user turn at its place (never the leading system block), so each turn still re-reads
    only its new tokens."""
    messages = list(MESSAGES)
    turns = []
    for i in range(3):
        messages.append({"role": "developer", "content": f"Reminder {i}: answer in Celsius."})
        reply = client.chat.completions.create(
            model="tiny-gpt-oss-format", messages=messages, max_tokens=MAX_TOKENS,
            temperature=0, seed=i)
        usage = reply.usage
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                      usage.completion_tokens))
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"And on day {i + 2}?"}]
    for (prompt, _, completion), (next_prompt, cached, _) in zip(turns, turns[1:]):
        assert cached >= prompt + completion - 1, turns
        assert cached < next_prompt, turns
    # The reminder reached the model (the template alone would drop it).
    bare = client.chat.completions.create(model="tiny-gpt-oss-format", messages=MESSAGES,
                                          max_tokens=1, temperature=0)
    assert turns[0][0] >= bare.usage.prompt_tokens + 8, (turns, bare.usage)
