"""Tool calls, reasoning, Anthropic Messages, Responses and prefix-stable history through the
real gateway app (uvicorn) against a scripted fake scheduler, with the official clients.

The fake scheduler here also plays the KV: it reports as cached the longest prefix a new prompt
shares with an earlier prompt + its generated tokens (capped at prompt length - 1), so a
multi-turn session shows whether the gateway's rendering extends what the server holds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import structlog

from switchyard.gateway.api.anthropic_api import VOLATILE_SYSTEM_PREFIXES
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.proto.gateway_scheduler import RequestFinished, TokensGenerated
from switchyard.common.settings import Settings
from tests.integration.test_gateway import (Fail, FakeScheduler, Finish, Running, Sleep,
                                            Tokens, serving, wait_until)

API_KEY = "agent-key"
MODEL = "tiny-qwen3"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_web", "parameters": {"type": "object",
                                         "properties": {"query": {"type": "string"}}}}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather for a city",
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
                  "parameters": WEATHER_TOOL["function"]["parameters"]}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT = "<think>\nThe user greets me.\n</think>\n\nHello there!"


class KVScheduler(FakeScheduler):
    """A fake scheduler whose cached-token counts follow the sequences it has 'computed'."""

    def __init__(self, endpoint, reply_ids):
        super().__init__(endpoint, reply_ids)
        self.sequences: list[tuple[int, ...]] = []
        self.generated: dict[str, list[int]] = {}

    def _send(self, sock, message) -> None:
        if isinstance(message, TokensGenerated):
            self.generated.setdefault(message.rid, []).extend(message.token_ids)
        super()._send(sock, message)

    def _finish(self, sock, run: Running, reason: str) -> None:
        self._running.pop(run.submit.rid, None)
        prompt = run.submit.prompt_token_ids
        cached = 0
        for seq in self.sequences:
            n = 0
            for a, b in zip(seq, prompt):
                if a != b:
                    break
                n += 1
            cached = max(cached, min(n, len(prompt) - 1))
        self.sequences.append(prompt + tuple(self.generated.get(run.submit.rid, ())))
        self._send(sock, RequestFinished(run.submit.rid, reason, len(prompt), cached,
                                         run.generated))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    model_dir = generate_tiny_model(tmp_path_factory.mktemp("model") / MODEL, "qwen3")
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def settings():
    path = Path(tempfile.mkdtemp(prefix="sy-ga-", dir="/tmp"))
    yield Settings(model=f"/models/{MODEL}", runtime_dir=str(path), ctx=2048, page_size=16,
                   max_body_bytes=256 * 1024, default_max_tokens=64, api_key=API_KEY,
                   heartbeat_s=0.05, peer_timeout_s=2.0)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def scheduler(settings, tokenizer):
    fake = KVScheduler(Endpoints(ensure_runtime_dir(settings.runtime_path)).scheduler,
                       tokenizer.encode("Hello!", add_special_tokens=False))
    fake.start()
    fake.ready.wait(5)
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def base_url(settings, tokenizer, scheduler):
    with serving(settings, tokenizer) as url:
        yield url


@pytest.fixture
def fake(scheduler, base_url, tokenizer):
    scheduler.reply_ids = tokenizer.encode("Hello!", add_special_tokens=False)
    scheduler.script = scheduler.default_script
    scheduler.received.clear()
    wait_until(lambda: httpx.get(base_url + "/health").status_code == 200)
    return scheduler


def say(fake, tokenizer, *texts, finish="stop"):
    """Script the model's output: each text as its tokens, one event per token."""
    ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
    fake.script = lambda submit: [Tokens((t,)) for t in ids] + [Finish(finish)]
    return ids


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)


@pytest.fixture
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=10)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=10) as c:
        yield c


def sse_events(response) -> list[tuple[str | None, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: {"):
            events.append((name, json.loads(line[6:])))
            name = None
    return events


USER = [{"role": "user", "content": "Weather in Paris?"}]


# --- chat completions --------------------------------------------------------------------------


def test_chat_tool_call_non_streamed(client, fake, tokenizer):
    say(fake, tokenizer, "Checking.\n", CALL_TEXT)
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert choice.message.content == "Checking."
    prompt = tokenizer.decode(fake.submits()[0].prompt_token_ids)
    assert "<tools>" in prompt and "get_weather" in prompt


def test_chat_tool_call_streamed_as_deltas(client, fake, tokenizer):
    say(fake, tokenizer, CALL_TEXT, "\n", CALL_TEXT.replace("Paris", "Oslo"))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER_TOOL], stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    starts = [tc for tc in calls if tc.id]
    assert [(tc.index, tc.function.name) for tc in starts] == [(0, "get_weather"),
                                                               (1, "get_weather")]
    arguments = {i: "".join(tc.function.arguments or "" for tc in calls if tc.index == i)
                 for i in (0, 1)}
    assert [json.loads(a)["city"] for a in arguments.values()] == ["Paris", "Oslo"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0
    assert not "".join(d.content or "" for d in deltas).strip()


def test_chat_reasoning_content(client, fake, tokenizer, http):
    say(fake, tokenizer, THINK_TEXT)
    reply = http.post("/v1/chat/completions", json={"messages": USER}).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets me."
    assert message["content"] == "Hello there!"
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("The user greets me.", "Hello there!")


def test_tool_choice_none_leaves_calls_as_text(client, fake, tokenizer):
    say(fake, tokenizer, CALL_TEXT)
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL],
                                           tool_choice="none")
    assert reply.choices[0].message.content == CALL_TEXT
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_malformed_call_is_text_with_a_count_only_log_line(client, fake, tokenizer):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {secret words}\n</tool_call>'
    say(fake, tokenizer, bad)
    with structlog.testing.capture_logs() as logs:
        reply = client.chat.completions.create(model=MODEL, messages=USER,
                                               tools=[WEATHER_TOOL])
        # A previous test's line may land in the capture too: pick this request's by its id.
        mine = lambda: [e for e in logs  # noqa: E731
                        if e["event"] == "request.finished" and e.get("rid") == reply.id]
        wait_until(lambda: mine())
    assert reply.choices[0].message.content == bad
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    (malformed,) = [e for e in logs if e["event"] == "tool_call.malformed"]
    assert malformed["num_malformed"] == 1
    assert "secret" not in json.dumps(logs, default=str)
    (finished,) = mine()
    assert finished["num_malformed_tool_calls"] == 1


@pytest.mark.parametrize("continuation,arguments", [
    ('{"city": "Oslo"}}\n', {"city": "Oslo"}),
    ("banana ]] {{", {}),  # the model's JSON is invalid: repaired to {}
])
def test_named_tool_choice_forces_the_call(client, fake, tokenizer, continuation, arguments):
    say(fake, tokenizer, continuation)
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER_TOOL, SEARCH_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == arguments
    assert reply.choices[0].finish_reason == "tool_calls"
    (submit,) = fake.submits()
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tokenizer.decode(submit.prompt_token_ids).endswith(
        "<|im_start|>assistant\n" + opening)
    end_id = tokenizer.encode("</tool_call>", add_special_tokens=False)
    assert end_id[0] in submit.stop_token_ids  # one call: generation ends at its end marker


def test_required_with_one_tool_is_named_and_streams_the_call_first(client, fake, tokenizer):
    say(fake, tokenizer, '{"city": "Rome"}}')
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="required", stream=True))
    first_call = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert first_call.choices[0].delta.tool_calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or ())
    assert json.loads(args) == {"city": "Rome"}


def test_parallel_tool_calls_false_stops_at_the_first_call(http, fake, tokenizer):
    say(fake, tokenizer, CALL_TEXT)
    body = {"messages": USER, "tools": [WEATHER_TOOL], "parallel_tool_calls": False}
    reply = http.post("/v1/chat/completions", json=body).json()
    assert len(reply["choices"][0]["message"]["tool_calls"]) == 1
    end_id = tokenizer.encode("</tool_call>", add_special_tokens=False)[0]
    assert end_id in fake.submits()[0].stop_token_ids


# --- prefix-stable history ---------------------------------------------------------------------


def tool_session(send, fake, tokenizer, turns=3):
    """Drive `send(history)` for `turns` forced tool calls, each answered by a tool result;
    returns the submits and the replies."""
    junk = ["}}} weird", ' "x" ] tokens', "\n\n{{ more"]
    for i in range(turns):
        say(fake, tokenizer, junk[i % len(junk)] + f" {i}")
        send(i)
    return fake.submits()


def test_chat_session_reuses_prompt_plus_generated_tokens(client, fake, tokenizer):
    messages = [{"role": "system", "content": "You are an agent."}] + USER

    def send(i):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                         "content": f"{18 + i}C"})
        usages.append(reply.usage)

    usages = []
    submits = tool_session(send, fake, tokenizer)
    check_reuse(submits, fake, [u.prompt_tokens_details.cached_tokens for u in usages])


def check_reuse(submits, fake, cached):
    """From the second turn on, the prompt starts with the previous prompt + generated tokens
    (and what was generated ended at the end marker, so it is all there), and the cached
    count covers exactly that."""
    for prev, cur, n in zip(submits, submits[1:], cached[1:]):
        held = prev.prompt_token_ids + tuple(fake.generated[prev.rid])
        assert cur.prompt_token_ids[:len(held)] == held
        assert n == len(held)


def test_without_prefix_stable_rendering_the_prefix_breaks(client, fake, tokenizer):
    messages = [{"role": "system", "content": "You are another agent."}] + USER

    def send(i):
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_headers={"X-Switchyard-Prefix-Stable": "off"}).parse()
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.extend([message, {"role": "tool", "content": "1C",
                                   "tool_call_id": message["tool_calls"][0]["id"]}])

    submits = tool_session(send, fake, tokenizer, turns=2)
    held = submits[0].prompt_token_ids + tuple(fake.generated[submits[0].rid])
    assert submits[1].prompt_token_ids[:len(held)] != held


# --- Anthropic Messages ------------------------------------------------------------------------


def test_messages_tool_use_and_usage(claude, fake, tokenizer):
    say(fake, tokenizer, THINK_TEXT.replace("Hello there!", "Let me look."), "\n", CALL_TEXT)
    message = claude.messages.create(
        model="claude-local-agent", max_tokens=100, system="You are terse.",
        messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[ANTHROPIC_TOOL],
        extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 20})  # not in this client
    assert message.model == "claude-local-agent" and message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "The user greets me."
    tool_use = message.content[2]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    assert tool_use.id.startswith("toolu_")
    (submit,) = fake.submits()
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        len(submit.prompt_token_ids)
    assert submit.sampling.top_k == 20 and submit.sampling.temperature == 0.3
    assert submit.max_tokens == 100


def test_messages_stream_event_lifecycle(claude, fake, tokenizer, http):
    say(fake, tokenizer, THINK_TEXT, "\n", CALL_TEXT)
    body = {"model": "m", "max_tokens": 50, "stream": True, "tools": [ANTHROPIC_TOOL],
            "messages": [{"role": "user", "content": "hi"}]}
    with http.stream("POST", "/v1/messages", json=body,
                     headers={"x-api-key": API_KEY}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    blocks = [data["content_block"]["type"] for name, data in events
              if name == "content_block_start"]
    assert blocks == ["thinking", "text", "tool_use"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] > 0
    # The official client accumulates the same message.
    with claude.messages.stream(model="m", max_tokens=50, tools=[ANTHROPIC_TOOL],
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "Hello there!"
    assert final.content[2].input == {"city": "Paris"}


def test_messages_stop_sequence_and_max_tokens(claude, fake, tokenizer):
    say(fake, tokenizer, "one two three four")
    message = claude.messages.create(model="m", max_tokens=20, stop_sequences=["three"],
                                     messages=[{"role": "user", "content": "count"}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "three"
    assert message.content[0].text == "one two "
    say(fake, tokenizer, "one two", finish="length")
    message = claude.messages.create(model="m", max_tokens=2,
                                     messages=[{"role": "user", "content": "count"}])
    assert message.stop_reason == "max_tokens"


def test_messages_session_with_tool_results_reuses_the_prefix(claude, fake, tokenizer):
    billing = "x-anthropic-billing-header: cc_version=1.0.{}; cch={};"
    messages = [{"role": "user", "content": "Weather in Paris, then Rome?"}]
    cached = []

    def send(i):
        system = [{"type": "text", "text": billing.format(i, 1000 + i)},
                  {"type": "text", "text": "You are an agent.", "cache_control":
                   {"type": "ephemeral"}}]
        message = claude.messages.create(
            model="claude-local-agent", max_tokens=30, system=system, messages=messages,
            tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"})
        cached.append(message.usage.cache_read_input_tokens)
        tool_use = message.content[-1]
        messages.append({"role": "assistant", "content": [b.model_dump() for b in
                                                          message.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_use.id, "content": f"{20 + i}C"}]})

    submits = tool_session(send, fake, tokenizer)
    check_reuse(submits, fake, cached)
    for submit in submits:
        assert "billing" not in tokenizer.decode(submit.prompt_token_ids)


def test_count_tokens(claude, fake, tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    counted = claude.messages.count_tokens(model="m", system="Be brief.", messages=messages,
                                           tools=[ANTHROPIC_TOOL])
    say(fake, tokenizer, "Sunny.")
    claude.messages.create(model="m", max_tokens=5, system="Be brief.", messages=messages,
                           tools=[ANTHROPIC_TOOL])
    assert counted.input_tokens == len(fake.submits()[0].prompt_token_ids)


@pytest.mark.parametrize("body,status,kind", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error"),
])
def test_messages_errors_use_anthropic_format(http, fake, body, status, kind):
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
    assert set(response.json()["error"]) == {"type", "message"}
    assert fake.submits() == []


def test_messages_auth_error_is_anthropic_format(base_url):
    response = httpx.post(base_url + "/v1/messages", json={}, headers={"x-api-key": "bad"})
    assert response.status_code == 401
    assert response.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect or missing API key"}}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="bad", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_billing_header_lines_are_removed():
    from switchyard.gateway.api.anthropic_api import parse_system

    assert VOLATILE_SYSTEM_PREFIXES == ("x-anthropic-billing-header:",)
    assert parse_system([{"type": "text", "text": "x-anthropic-billing-header: a=1;"},
                         {"type": "text", "text": "Rules."}]) == "Rules."
    assert parse_system("X-Anthropic-Billing-Header: v=2\nRules.") == "Rules."
    assert parse_system("Rules.\nx-anthropic-billing-header: later") == \
        "Rules.\nx-anthropic-billing-header: later"


# --- Responses ---------------------------------------------------------------------------------


def test_responses_text_and_usage(client, fake, tokenizer):
    say(fake, tokenizer, THINK_TEXT)
    response = client.responses.create(model=MODEL, input="Say hello",
                                        instructions="Be brief.", max_output_tokens=40)
    assert response.status == "completed"
    assert response.output_text == "Hello there!"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.input_tokens == len(fake.submits()[0].prompt_token_ids)
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert fake.submits()[0].max_tokens == 40
    assert "Be brief." in tokenizer.decode(fake.submits()[0].prompt_token_ids)


def test_responses_stream_lifecycle_with_function_call(client, fake, tokenizer):
    say(fake, tokenizer, "Looking.\n", CALL_TEXT)
    events = list(client.responses.create(model=MODEL, input="Weather?", stream=True,
                                          tools=[RESPONSES_TOOL]))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    call = final.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # The client's own accumulator agrees.
    say(fake, tokenizer, "Looking.\n", CALL_TEXT)
    with client.responses.stream(model=MODEL, input="Weather?", tools=[RESPONSES_TOOL]) as s:
        accumulated = s.get_final_response()
    assert accumulated.output[1].arguments == call.arguments


def test_responses_session_with_previous_response_id(client, fake, tokenizer):
    cached, previous = [], None
    items: list = [{"role": "user", "content": "Weather in Paris?"}]

    def send(i):
        nonlocal previous, items
        response = client.responses.create(
            model=MODEL, input=items, previous_response_id=previous, tools=[RESPONSES_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            instructions="You are an agent.")
        cached.append(response.usage.input_tokens_details.cached_tokens)
        call = response.output[-1]
        previous = response.id
        items = [{"type": "function_call_output", "call_id": call.call_id,
                  "output": f"{i}C"}]

    submits = tool_session(send, fake, tokenizer)
    check_reuse(submits, fake, cached)


def test_responses_full_input_replay_reuses_the_prefix(client, fake, tokenizer):
    items: list = [{"role": "user", "content": "Weather in Lima?"}]
    cached = []

    def send(i):
        response = client.responses.create(model=MODEL, input=items, tools=[RESPONSES_TOOL],
                                            tool_choice="required", store=False)
        cached.append(response.usage.input_tokens_details.cached_tokens)
        call = response.output[-1]
        items.extend([call.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": call.call_id,
                       "output": "warm"}])

    submits = tool_session(send, fake, tokenizer, turns=2)
    check_reuse(submits, fake, cached)


def test_unknown_previous_response_id_is_a_clear_400(client, fake):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_gone")
    error = info.value.body
    assert error["code"] == "previous_response_not_found"
    assert "full conversation" in error["message"] and error["param"] == "previous_response_id"


# --- OpenAPI, auth -----------------------------------------------------------------------------


def test_openapi_json(base_url):
    spec = httpx.get(base_url + "/openapi.json").json()  # no key needed
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/models", "/health"):
        assert path in spec["paths"]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
def test_openai_routes_need_the_key(base_url, path):
    response = httpx.post(base_url + path, json={})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


# --- failures in each API's format --------------------------------------------------------------


def test_failure_before_the_stream_keeps_its_status_in_anthropic_format(http, fake):
    fake.script = lambda submit: [Fail("queue_full", retry_after_s=2.0)]
    body = {"model": "m", "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 429 and response.headers["Retry-After"] == "2"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_failure_mid_stream_is_an_anthropic_error_event(http, fake, tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    fake.script = lambda submit: [Tokens(tuple(ids)), Sleep(0.3), Fail("internal")]
    body = {"model": "m", "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[0][0] == "message_start"
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "scripted internal"}})


def test_failure_mid_stream_is_response_failed(http, fake, tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    fake.script = lambda submit: [Tokens(tuple(ids)), Sleep(0.3), Fail("internal")]
    with http.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    name, failed = events[-1]
    assert name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "internal"


def test_responses_errors_use_openai_format(http, fake):
    response = http.post("/v1/responses", json={"input": [{"type": "item_reference",
                                                           "id": "x"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[0].type"
    assert http.post("/v1/responses", json={"input": "x", "model": "gpt-5"}).status_code == 404
