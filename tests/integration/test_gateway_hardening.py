"""Regression tests for the gateway's hardening findings (second pass): what an
abusive, careless or second-tenant client could do to the others. The real app under uvicorn
against the scripted fake scheduler of test_gateway (loopback, no API key)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from switchyard.gateway.prompting.prompts import fewest_tokens_per_message

from tests.integration.test_gateway import CHAT, JSON_TYPE, Finish, Tokens, assert_error
from tests.integration.test_gateway_security import (  # noqa: F401  (module-scoped fixtures)
    fake, make_settings, runtime_dir, served, serving, tokenizer)

POST_ROUTES = {"/v1/chat/completions": {},
               "/v1/completions": {"prompt": "hi"},
               "/v1/responses": {"input": "hi"},
               "/v1/messages": {"max_tokens": 4},
               "/v1/messages/count_tokens": {}}


@pytest.fixture
def http(served, fake):
    fake.received.clear()
    with httpx.Client(base_url=served[0], timeout=20) as client:
        yield client


def assert_api_error(response, path: str, status: int, code: str | None = None):
    """The error in the route's own format: Anthropic's under /v1/messages, else OpenAI's."""
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["message"]
        return body["error"]
    return assert_error(response, status, code)


# -- 4. raw-byte lone surrogates are a 400 on every POST route -----------------------------------

@pytest.mark.parametrize("path", sorted(POST_ROUTES))
def test_raw_encoded_surrogates_are_a_400(http, fake, path):
    fields = b"".join(b'"%s": %s, ' % (k.encode(), str(v).replace("'", '"').encode())
                      for k, v in POST_ROUTES[path].items())
    body = b'{' + fields + b'"messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}'
    if path == "/v1/completions":
        body = b'{"prompt": "hi \xed\xa0\x80"}'
    elif path == "/v1/responses":
        body = b'{"input": "hi \xed\xa0\x80"}'
    response = http.post(path, content=body, headers=JSON_TYPE)
    assert_api_error(response, path, 400, "invalid_json")
    assert fake.submits() == []
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


# -- 1. templates come from the model, never a request -------------------------------------------

def test_a_request_cannot_replace_the_chat_template(http, fake):
    bombs = ["{{ 'ab ' * 3000 }}", "{% for i in range(100000) %}{% for j in range(2000) %}x"
             "{% endfor %}{% endfor %}"]
    for bomb in bombs:
        response = http.post("/v1/chat/completions", json={
            **CHAT, "chat_template_kwargs": {"chat_template": bomb}})
        error = assert_error(response, 400, "invalid_value")
        assert error["param"] == "chat_template_kwargs.chat_template"
        response = http.post("/v1/chat/completions", json={**CHAT, "chat_template": bomb})
        assert_error(response, 400, "unsupported_parameter")
    response = http.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"note": "x" * 40_000}})
    assert_error(response, 400, "invalid_value")
    assert fake.submits() == []
    ok = http.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


# -- 5. the Responses store keeps what the model saw, within a byte bound ------------------------

def test_the_response_store_keeps_only_what_the_model_saw(http, served, fake):
    store = served[1].state.gateway.responses
    before = store.num_bytes
    reasoning = "r" * 30_000  # a reasoning item the template drops (before the last user turn)
    ids = []
    for i in range(30):
        reply = http.post("/v1/responses", json={"max_output_tokens": 4, "input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]},
            {"role": "user", "content": f"question {i}"}]})
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    assert store.num_bytes - before < 30 * 2_000  # the replies and questions, not 900 KB
    follow = http.post("/v1/responses", json={"max_output_tokens": 4, "input": "go on",
                                              "previous_response_id": ids[-1]})
    assert follow.status_code == 200, follow.text


# -- 6. a remembered turn is spliced only into its own conversation -----------------------------

def test_one_conversation_never_renders_anothers_remembered_reply(http, fake, tokenizer):
    """Conversation B's reply "Done." came with private reasoning; A's history holds its own
    "Done.": A's prompt is what the template renders for A (prefix-stable on and off agree),
    and count_tokens tells A nothing about B."""
    secret = tokenizer.encode("<think>\nB's private plan: the launch code is 0000\n</think>\n\n"
                              "Done.", add_special_tokens=False)
    try:
        fake.script = lambda submit: [Tokens(tuple(secret)), Finish()]
        b = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "B: plan the launch"}]})
        assert b.json()["choices"][0]["message"]["content"] == "Done."
    finally:
        fake.script = fake.default_script
    own = [{"role": "user", "content": "B: plan the launch"},
           {"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]
    other = [{"role": "user", "content": "A: say done"},
             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]

    def count(messages, stable: bool) -> int:
        reply = http.post("/v1/messages/count_tokens", json={"messages": messages},
                          headers={"X-Switchyard-Prefix-Stable": "1" if stable else "0"})
        assert reply.status_code == 200, reply.text
        return reply.json()["input_tokens"]

    assert count(other, True) == count(other, False)  # A: no splice of B's reasoning
    assert count(own, True) > count(own, False)  # B itself still gets its exact tokens back
    fake.received.clear()
    http.post("/v1/chat/completions", json={"messages": other})
    (submit,) = fake.submits()
    assert "launch code" not in tokenizer.decode(list(submit.prompt_token_ids))


# -- 3. request size is judged on everything tokenized; abandoned work stops ---------------------

@pytest.fixture
def rendering(served):
    """The calls to the tokenizer's template and encoder while the test runs."""
    tokenizer = served[1].state.gateway.tokenizer
    calls = []
    real = tokenizer.apply_chat_template, tokenizer.encode
    tokenizer.apply_chat_template = lambda *a, **k: calls.append("render") or real[0](*a, **k)
    tokenizer.encode = lambda *a, **k: calls.append("encode") or real[1](*a, **k)
    try:
        yield calls
    finally:
        tokenizer.apply_chat_template, tokenizer.encode = real


def test_many_empty_messages_are_refused_before_tokenizing(http, served, fake, rendering):
    gateway = served[1].state.gateway
    ctx, per_message = gateway.settings.ctx, gateway.message_tokens
    assert per_message > 1  # ChatML: a message is at least its role markers
    many = {"messages": [{"role": "user", "content": ""}] * (ctx // per_message + 1)}
    for path in ("/v1/chat/completions", "/v1/messages/count_tokens"):
        response = http.post(path, json=many)
        error = assert_api_error(response, path, 400, "context_length_exceeded")
        assert f"at least {per_message} tokens" in error["message"]
    response = http.post("/v1/responses", json={"input": [many["messages"][0]] * (ctx + 1)})
    assert_error(response, 400, "context_length_exceeded")
    assert fake.submits() == [] and rendering == []


def test_the_fewest_tokens_a_message_costs_is_a_true_bound(tokenizer):
    """Alternating empty messages under the template cost at least `fewest_tokens_per_message`
    each, so refusing `ctx // that + 1` of them before rendering refuses nothing that fits."""
    per_message = fewest_tokens_per_message(tokenizer)
    for count in (1, 2, 7, 40):
        messages = [{"role": ("user", "assistant")[i % 2], "content": ""} for i in range(count)]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                             tokenize=False)
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= count * per_message


@pytest.mark.parametrize("where", ["tool", "tool_call", "count_tokens"])
def test_tools_and_calls_count_toward_the_context(http, served, fake, where, rendering):
    gateway = served[1].state.gateway
    big = "d" * (gateway.settings.ctx * gateway.max_token_chars() + 1)
    if where == "tool_call":
        body = {"messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": big}}]}, {"role": "tool", "tool_call_id": "c",
                                                    "content": "ok"}]}
    else:
        body = {**CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "description": big}}]}
    path = "/v1/chat/completions"
    if where == "count_tokens":
        path, body = "/v1/messages/count_tokens", {**CHAT, "tools": [
            {"name": "f", "description": big}]}
    response = http.post(path, json=body)
    assert_api_error(response, path, 400, "context_length_exceeded")
    assert fake.submits() == [] and rendering == []


def test_reasoning_and_tools_choose_the_large_lane(served, monkeypatch):
    import asyncio

    from types import SimpleNamespace

    from switchyard.gateway import driver
    from switchyard.gateway.context import LARGE_PROMPT_CHARS, RequestContext
    from switchyard.gateway.prompting.prompts import chat_chars
    from switchyard.gateway.request.model import ChatRequest, Options

    sizes = []
    gateway = served[1].state.gateway
    monkeypatch.setattr(type(gateway), "run_tokenizer",
                        lambda self, *a, size=0, **k: sizes.append(size) or asyncio.sleep(0))
    reasoning = {"role": "assistant", "content": "", "reasoning_content": "r" * LARGE_PROMPT_CHARS}
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}, reasoning],
                       options=Options())

    class FakeRequest:
        headers: dict = {}
        app = served[1]
        scope: dict = {}
        method, url = "POST", SimpleNamespace(path="/v1/chat/completions")
        receive = stream = None

    ctx = RequestContext.of(FakeRequest())
    asyncio.run(driver.plan_chat(ctx, chat))
    assert sizes == [chat_chars(chat)] and sizes[0] > LARGE_PROMPT_CHARS


def test_tokenizing_is_abandoned_when_the_client_leaves(served, fake):
    """A request queued on the tokenizer lane whose client closes its connection is never
    tokenized, and ends logged as disconnected (not as its 400 or 200)."""
    import socket
    import threading

    import structlog

    from tests.integration.test_gateway import wait_until

    gateway = served[1].state.gateway
    release, started = threading.Event(), threading.Event()
    ran = []
    gateway.executor.submit(lambda: (started.set(), release.wait(30)))
    started.wait(5)
    body = b'{"messages": [{"role": "user", "content": "leave"}]}'
    port = int(served[0].rsplit(":", 1)[1])
    real, real_submit = gateway.tokenizer.encode, gateway.executor.submit
    queued = threading.Event()  # the request's tokenizing job waits for the lane
    try:
        gateway.tokenizer.encode = lambda *a, **k: ran.append(1) or real(*a, **k)
        gateway.executor.submit = lambda *a, **k: (queued.set(), real_submit(*a, **k))[1]
        with structlog.testing.capture_logs() as logs:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                assert queued.wait(30)
            wait_until(lambda: any(e.get("event") == "request.finished"
                                   and e.get("disconnected") for e in logs), timeout=30)
            release.set()
            real_submit(lambda: None).result(30)  # the lane ran (or dropped) the queued job
    finally:
        release.set()
        gateway.executor.submit = real_submit
        gateway.tokenizer.encode = real
    (finished,) = [e for e in logs if e.get("event") == "request.finished"]
    assert finished["status"] == 499 and finished["disconnected"]
    assert ran == [] and fake.submits() == []


# -- 9. at --max-connections: each API's error format, Retry-After, a share for other clients ----

@contextlib.contextmanager
def streams_held_at_the_limit(tokenizer, headers: dict[str, str] | None = None, **settings):
    """A gateway at `--max-connections 3` whose fake scheduler never answers (`Hold`), with
    the two streams one client may hold open already held (`headers`: whose). Yields (url,
    app, scheduler, leave): `leave()` makes those clients leave (their requests are
    cancelled); it runs on exit too."""
    from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
    from tests.integration.test_gateway import FakeScheduler, Hold, wait_until

    own_dir = Path(tempfile.mkdtemp(prefix="sy-cap-", dir="/tmp"))
    scheduler = FakeScheduler(Endpoints(ensure_runtime_dir(own_dir)).scheduler, [1])
    scheduler.script = lambda submit: [Hold()]
    scheduler.start()
    scheduler.ready.wait(5)
    settings = make_settings(own_dir, max_connections=3, read_timeout_s=60.0, **settings)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, own_dir, ignore_errors=True)
        stack.callback(scheduler.stop)
        url, app = stack.enter_context(serving(settings, tokenizer))
        held = []

        def hold():
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                    "POST", url + "/v1/chat/completions", timeout=60, headers=headers,
                    json={**CHAT, "stream": True}) as response:
                held.append(response)
                for _ in response.iter_bytes():
                    pass

        def leave():
            # A stream's headers come with its first event or the first keepalive (5 s, Hold
            # sends nothing): the clients can leave once they have them.
            wait_until(lambda: len(held) == 2, timeout=30)
            for response in held:
                response.close()
            for thread in threads:
                thread.join(30)

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(scheduler.submits()) == 2)
        stack.callback(leave)
        yield url, app, scheduler, leave


def test_requests_beyond_the_limit_get_a_503_in_their_apis_format(tokenizer):
    from tests.integration.test_gateway import wait_until

    with streams_held_at_the_limit(tokenizer) as (url, app, scheduler, leave):
        limits = app.state.connection_limits
        assert limits.per_client == 2  # one of 3 kept for other clients
        response = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=20)
        error = assert_error(response, 503, "overloaded")
        assert "other clients" in error["message"]
        assert response.headers["retry-after"] == "1"
        assert response.headers["connection"] == "close"
        response = httpx.post(url + "/v1/messages", json={"max_tokens": 4, **CHAT}, timeout=20)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "overloaded_error"
        try:  # another client host (loopback aliases: Linux routes all of 127/8 here)
            other = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=other, timeout=20) as client:
                response = client.get(url + "/v1/models")
            assert response.status_code == 200, response.text
        except httpx.ConnectError:
            pass  # no 127.0.0.2 on this machine (macOS): the share is not reachable
        leave()  # the clients leave: their requests are cancelled
        wait_until(lambda: not limits.requests)  # every request ended, its share returned
        assert httpx.get(url + "/v1/models").status_code == 200


def test_one_keys_requests_leave_another_key_its_share_of_the_connections(tokenizer):
    """Every local tenant comes from 127.0.0.1: with several keys the share kept for others
    is per key, so one key holding all it may does not refuse another key's request. The
    scheduler learns each request's tenant and weight, never its key."""
    from switchyard.common.tenants import resolved_keys

    keys = resolved_keys("alice sk-alice-1\nbob,weight=3 sk-bob-2\n")
    bob, alice = {"Authorization": "Bearer sk-bob-2"}, {"Authorization": "Bearer sk-alice-1"}
    with streams_held_at_the_limit(tokenizer, bob, api_key=keys) as (url, _, scheduler, _):
        response = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=bob, timeout=20)
        assert "other clients" in assert_error(response, 503, "overloaded")["message"]
        response = httpx.get(url + "/v1/models", headers=alice, timeout=20)
        assert response.status_code == 200, response.text
        submits = scheduler.submits()
        assert {(s.tenant, s.tenant_weight) for s in submits} == {("bob", 3.0)}
        assert all("sk-bob" not in repr(s) for s in submits)


# -- 2. grammars: checked off the event loop, within a bound; guided_choice bounded -------------

def pattern_bomb(num_patterns: int) -> dict:
    return {"type": "object", "additionalProperties": False, "patternProperties": {
        f"^p{i}_[a-z]+[0-9]*$": {"type": "integer"} for i in range(num_patterns)}}


def test_a_schema_bomb_is_refused_while_the_server_keeps_answering(http, served, fake):
    import threading

    outcome = {}

    def bomb():
        with httpx.Client(base_url=served[0], timeout=60) as client:
            outcome["response"] = client.post("/v1/chat/completions", json={
                **CHAT, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "b", "schema": pattern_bomb(450)}}})

    thread = threading.Thread(target=bomb)
    thread.start()
    answered_meanwhile = 0
    while thread.is_alive():
        if http.get("/health").status_code == 200 and thread.is_alive():
            answered_meanwhile += 1
    thread.join()
    error = assert_error(outcome["response"], 400, "invalid_grammar")
    assert "too complex" in error["message"]
    assert answered_meanwhile > 0 and fake.submits() == []
    response = http.post("/v1/chat/completions", json={
        **CHAT, "guided_choice": [str(i) for i in range(2_000)]})
    assert_error(response, 400, "invalid_value")
    ok = http.post("/v1/chat/completions", json={**CHAT, "guided_choice": ["a", "b"]})
    assert ok.status_code == 200 and fake.submits()[-1].sampling.grammar
