"""Regression tests for the gateway's local-security findings: what a web page, a slow or sloppy
client, or a reader of the status snapshot could do. The real app under uvicorn against the
scripted fake scheduler of test_gateway (loopback, no API key: the default, and the case a
browser can reach). Raw sockets where the point is the connection itself."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from switchyard.gateway.app import build_app
from switchyard.gateway.service import make_server
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.common.settings import Settings
from tests.integration.test_gateway import (CHAT, JSON_TYPE, REPLY, FakeScheduler, assert_error,
                                            wait_until)

READ_TIMEOUT_S = 1.0
CTX = 256


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    return load_tokenizer(generate_tiny_model(tmp_path_factory.mktemp("m") / "tiny-qwen3",
                                              "qwen3"))


@pytest.fixture(scope="module")
def runtime_dir():
    path = Path(tempfile.mkdtemp(prefix="sy-sec-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_settings(runtime_dir, **overrides) -> Settings:
    return Settings(**{"model": "/models/tiny-qwen3", "runtime_dir": str(runtime_dir),
                       "ctx": CTX, "page_size": 16, "max_body_bytes": 64 * 1024,
                       "default_max_tokens": 8, "heartbeat_s": 0.05, "peer_timeout_s": 2.0,
                       "read_timeout_s": READ_TIMEOUT_S, **overrides})


@pytest.fixture(scope="module")
def fake(runtime_dir, tokenizer):
    scheduler = FakeScheduler(Endpoints(ensure_runtime_dir(runtime_dir)).scheduler,
                              tokenizer.encode(REPLY, add_special_tokens=False))
    scheduler.start()
    scheduler.ready.wait(5)
    yield scheduler
    scheduler.stop()


@contextlib.contextmanager
def serving(settings, tokenizer):
    """The app under uvicorn on a free port; yields (base URL, app)."""
    app = build_app(settings, tokenizer, boot_id="gw-sec", keepalive_s=0.2)
    server = make_server(app, "127.0.0.1", 0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_until(lambda: server.started and httpx.get(url + "/health").status_code == 200)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def served(runtime_dir, tokenizer, fake):
    with serving(make_settings(runtime_dir), tokenizer) as pair:
        yield pair


@pytest.fixture
def http(served, fake):
    fake.received.clear()
    with httpx.Client(base_url=served[0], timeout=20) as client:
        yield client


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- 4. Host, Origin and Content-Type: what a web page cannot do --------------------------------

def test_a_rebinding_host_is_refused(http, fake):
    response = http.post("/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"})
    assert_error(response, 403, "host_not_allowed")
    response = http.get("/v1/switchyard/status", headers={"Host": "evil.example:8000"})
    assert response.status_code == 403
    for host in ("localhost", "127.0.0.1:1234", "[::1]:80"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert fake.submits() == []


def test_a_cross_origin_browser_request_is_refused(http, served, fake):
    response = http.post("/v1/chat/completions", json=CHAT,
                         headers={"Origin": "https://evil.example"})
    assert_error(response, 403, "origin_not_allowed")
    response = http.post("/v1/messages", json={"max_tokens": 4, **CHAT},
                         headers={"Origin": "null"})
    assert response.status_code == 403 and response.json()["type"] == "error"  # Anthropic's
    assert fake.submits() == []
    same_origin = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": served[0]})
    assert same_origin.status_code == 200, same_origin.text


def test_only_json_bodies_are_acted_on(http, fake):
    body = json.dumps(CHAT)
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        response = http.post("/v1/chat/completions", content=body, headers=headers)
        assert_error(response, 415, "unsupported_media_type")
    response = http.post("/v1/messages", content=json.dumps({"max_tokens": 4, **CHAT}),
                         headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["type"] == "error"
    assert fake.submits() == []
    ok = http.post("/v1/chat/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_allowed_origins_and_hosts_are_configurable():
    from switchyard.gateway.guard import GuardPolicy

    def scope(headers, method="POST"):
        return {"type": "http", "method": method, "path": "/v1/chat/completions",
                "scheme": "http", "headers": [(k.encode(), v.encode()) for k, v in headers]}

    json_type = ("content-type", "application/json")
    policy = GuardPolicy.from_settings(Settings(allowed_origins="https://app.example",
                                                allowed_hosts="box.lan"))
    assert policy.check(scope([("host", "box.lan:8000"), json_type])) is None
    assert policy.check(scope([("host", "127.0.0.1"), ("origin", "https://app.example"),
                               json_type])) is None
    assert policy.check(scope([("host", "127.0.0.1"), ("origin", "https://b.example"),
                               json_type])).code == "origin_not_allowed"
    # A wildcard bind (which requires a key) answers any Host unless --allowed-hosts says.
    wide = GuardPolicy.from_settings(Settings(host="0.0.0.0", api_key="k"))
    assert wide.check(scope([("host", "10.0.0.5:8000"), json_type])) is None


# -- 5. slowloris: a deadline for the request head and the body; a connection limit ----------

def test_a_connection_that_never_finishes_its_headers_is_closed(served):
    with socket.create_connection(("127.0.0.1", port_of(served[0]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ")
        sock.settimeout(30 * READ_TIMEOUT_S)  # a bound for a hang, not a timing check
        assert sock.recv(1024) == b""  # closed by the server, before any answer


def test_a_body_that_never_arrives_gets_a_408(served):
    with socket.create_connection(("127.0.0.1", port_of(served[0]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
        sock.settimeout(30 * READ_TIMEOUT_S)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply


def test_idle_connections_at_the_limit_make_room(tmp_path_factory, tokenizer):
    """Connections that send nothing never keep a request out: at --max-connections the
    longest idle one is closed (busy ones: test_gateway_hardening)."""
    own_dir = Path(tempfile.mkdtemp(prefix="sy-lim-", dir="/tmp"))  # its own fake scheduler
    scheduler = FakeScheduler(Endpoints(ensure_runtime_dir(own_dir)).scheduler, [1])
    scheduler.start()
    scheduler.ready.wait(5)
    settings = make_settings(own_dir, max_connections=3, read_timeout_s=60.0)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, own_dir, ignore_errors=True)
        stack.callback(scheduler.stop)
        url, _ = stack.enter_context(serving(settings, tokenizer))
        idle = [socket.create_connection(("127.0.0.1", port_of(url))) for _ in range(3)]
        try:
            for _ in range(3):
                response = httpx.get(url + "/v1/models", timeout=20)
                assert response.status_code == 200, response.text
        finally:
            for sock in idle:
                sock.close()


# -- 6. the chat-template opening cache is bounded ----------------------------------------------

def test_junk_template_kwargs_do_not_grow_the_opening_cache(tokenizer):
    from switchyard.gateway.prompting import history

    for i in range(3 * history.MAX_OPENINGS):
        history.generation_opening(tokenizer, {"junk": "x" * 10_000, "i": i})
    assert len(history._openings) <= history.MAX_OPENINGS
    assert all(isinstance(key, bytes) and len(key) == 16 for key in history._openings)


# -- 7. metrics labels stay bounded whatever method a client sends -----------------------------

def test_unknown_methods_are_counted_as_other(http):
    for i in range(20):
        http.request(f"BREW{i}", "/v1/nothing")
    text = http.get("/metrics").text
    assert "BREW" not in text
    assert 'method="other",status="404"' in text or 'method="other"' in text


# -- 9. a prompt too long for the context is refused before tokenizing; big ones on their lane -

def test_an_overlong_prompt_is_refused_before_tokenizing(http, served, fake):
    gateway = served[1].state.gateway
    text = "a" * (CTX * gateway.max_token_chars() + 1)
    response = http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": text}]})
    error = assert_error(response, 400, "context_length_exceeded")
    # the character bound, a lower bound on the tokens, not a token count
    assert f"resulted in at least {CTX + 1} tokens" in error["message"]
    response = http.post("/v1/completions", json={"prompt": text})
    assert_error(response, 400, "context_length_exceeded")
    assert fake.submits() == []


def test_large_prompts_tokenize_on_their_own_lane(served):
    import asyncio

    from switchyard.gateway.context import LARGE_PROMPT_CHARS

    gateway = served[1].state.gateway

    def where(tokenizer):
        return threading.current_thread().name, tokenizer is gateway.tokenizer

    async def both():
        return (await gateway.run_tokenizer(where, gateway.tokenizer, size=10),
                await gateway.run_tokenizer(where, gateway.tokenizer, size=LARGE_PROMPT_CHARS))

    small, large = asyncio.run(both())
    assert small[0].startswith("tokenizer_") and small[1]
    assert large[0].startswith("tokenizer-large") and not large[1]  # its own copy


# -- 11. a lone surrogate is a 400 in the API's format; library logs go through structlog -------

def test_a_lone_surrogate_is_a_400(http, fake):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    assert_error(http.post("/v1/chat/completions", content=body, headers=JSON_TYPE), 400,
                 "invalid_json")
    body = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\udfff"}]}'
    response = http.post("/v1/messages", content=body, headers=JSON_TYPE)
    assert response.status_code == 400 and response.json()["type"] == "error"
    pair = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'  # a valid pair
    assert http.post("/v1/chat/completions", content=pair, headers=JSON_TYPE).status_code == 200


# -- 12. status snapshots never show a Responses id ----------------------------------------------

def test_the_scheduler_never_sees_the_response_id(http, fake):
    reply = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
    assert reply.status_code == 200, reply.text
    (submit,) = fake.submits()
    response_id = reply.json()["id"]
    assert response_id.removeprefix("resp_") not in submit.rid


# -- logit_bias reaches the worker (it was ignored) ---------------------------------------------

def test_logit_bias_is_passed_on_and_checked(http, fake, tokenizer):
    body = {**CHAT, "logit_bias": {"5": 100, "17": -100.0}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"5": 1}}
                     ).status_code == 200
    chat, completion = fake.submits()
    assert chat.sampling.logit_bias == ((5, 100.0), (17, -100.0))
    assert completion.sampling.logit_bias == ((5, 1.0),)
    for bad in ({"x": 1}, {"5": 101}, {"5": "1"}, {str(len(tokenizer)): 1}, [1]):
        assert_error(http.post("/v1/chat/completions", json={**CHAT, "logit_bias": bad}),
                     400, param="logit_bias")


def test_a_content_part_type_that_is_not_a_string_is_a_400(http, fake):
    """Found by schemathesis: {"type": {}} in a content part was a 500 (unhashable)."""
    body = {"messages": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400)
    body = {"input": [{"type": "reasoning", "summary": [{"type": {}, "text": ""}]}]}
    assert_error(http.post("/v1/responses", json=body), 400)
