"""The real gateway app (uvicorn on a free port) against a scripted fake scheduler on ipc.

The fake scheduler is a zmq ROUTER in a thread: it answers Hello, sends GroupState every 50 ms
and plays a per-test script for each SubmitRequest. Happy paths go through the official
`openai` client; error cases through httpx, each followed by a check that the server still
serves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import structlog
import zmq

from switchyard.gateway.app import build_app
from switchyard.gateway.service import make_server
from switchyard.proto import codec
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.proto.base import PROTOCOL_VERSION, Hello
from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    GroupState,
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.common.settings import Settings
from switchyard.proto.sockets import bind_router

API_KEY = "sekret"
REPLY = "Hello 🦜 world! 日本語 ok."
KEEPALIVE_S = 0.2


# --- the scripted scheduler ------------------------------------------------------------------


@dataclass
class Tokens:
    token_ids: tuple[int, ...]


@dataclass
class Finish:
    reason: str = "stop"


@dataclass
class Fail:
    code: str
    retry_after_s: float = 0.0


@dataclass
class Sleep:
    seconds: float


@dataclass
class Restart:
    """Take a new boot id, as a restarted scheduler would."""


@dataclass
class Hold:
    """Generate nothing more until cancelled; then finish with "cancelled"."""


@dataclass
class Running:
    submit: SubmitRequest
    steps: deque
    wake: float = 0.0
    generated: int = 0
    holding: bool = False


class FakeScheduler(threading.Thread):
    def __init__(self, endpoint: str, reply_ids: list[int]) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.boot_id = "sched-1"
        self.worker_ready = True
        self.silent = False
        self.reply_ids = reply_ids
        self.script = self.default_script
        self.received: list = []
        self.ready = threading.Event()
        self._stop_flag = threading.Event()
        self._running: dict[str, Running] = {}
        self._peer: bytes | None = None

    def default_script(self, submit: SubmitRequest) -> list:
        return [Tokens((t,)) for t in self.reply_ids] + [Finish()]

    def submits(self) -> list[SubmitRequest]:
        return [m for m in self.received if isinstance(m, SubmitRequest)]

    def cancels(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, CancelRequest)]

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(5)

    def run(self) -> None:
        ctx = zmq.Context()
        sock = bind_router(ctx, self.endpoint)
        self.ready.set()
        next_state = 0.0
        try:
            while not self._stop_flag.is_set():
                if sock.poll(10):
                    self._on_frame(sock, *sock.recv_multipart())
                now = time.monotonic()
                if now >= next_state:
                    self._send(sock, GroupState(self.boot_id, self.worker_ready, True, 0,
                                                len(self._running)))
                    next_state = now + 0.05
                for rid in list(self._running):
                    self._advance(sock, self._running[rid], now)
        finally:
            sock.close(0)
            ctx.term()

    def _send(self, sock, message) -> None:
        if self._peer is None or self.silent:
            return
        try:
            sock.send_multipart([self._peer, codec.encode(message)])
        except zmq.ZMQError:  # the gateway is gone (ROUTER_MANDATORY)
            pass

    def _on_frame(self, sock, identity: bytes, frame: bytes) -> None:
        self._peer = identity
        message = codec.decode(frame)
        if self.silent:
            return
        self.received.append(message)
        if isinstance(message, Hello):
            self._send(sock, Hello(PROTOCOL_VERSION, self.boot_id, "scheduler", 1))
        elif isinstance(message, SubmitRequest):
            self._running[message.rid] = Running(message, deque(self.script(message)))
        elif isinstance(message, CancelRequest) and message.rid in self._running:
            self._finish(sock, self._running[message.rid], "cancelled")

    def _finish(self, sock, run: Running, reason: str) -> None:
        self._running.pop(run.submit.rid, None)
        self._send(sock, RequestFinished(run.submit.rid, reason, len(run.submit.prompt_token_ids),
                                         0, run.generated))

    def _advance(self, sock, run: Running, now: float) -> None:
        rid = run.submit.rid
        while run.steps and not run.holding and now >= run.wake and rid in self._running:
            step = run.steps.popleft()
            if isinstance(step, Tokens):
                run.generated += len(step.token_ids)
                self._send(sock, TokensGenerated(rid, step.token_ids))
            elif isinstance(step, Finish):
                self._finish(sock, run, step.reason)
            elif isinstance(step, Fail):
                self._running.pop(rid, None)
                self._send(sock, RequestFailed(rid, step.code, f"scripted {step.code}",
                                               step.code != "internal", step.retry_after_s))
            elif isinstance(step, Sleep):
                run.wake = now + step.seconds
            elif isinstance(step, Restart):
                self.boot_id += "+"
                self._running.clear()
            elif isinstance(step, Hold):
                run.holding = True


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    model_dir = generate_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3", "qwen3")
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def runtime_dir():
    path = Path(tempfile.mkdtemp(prefix="sy-gw-", dir="/tmp"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def settings(runtime_dir):
    return Settings(model="/models/tiny-qwen3", runtime_dir=str(runtime_dir), ctx=256,
                    page_size=16, max_body_bytes=64 * 1024, default_max_tokens=32,
                    api_key=API_KEY, heartbeat_s=0.05, peer_timeout_s=0.6,
                    background_model=("tiny-subagents",))


@pytest.fixture(scope="module")
def scheduler(settings, tokenizer):
    ensure_runtime_dir(settings.runtime_path)
    fake = FakeScheduler(Endpoints(settings.runtime_path).scheduler,
                         tokenizer.encode(REPLY, add_special_tokens=False))
    fake.start()
    fake.ready.wait(5)
    yield fake
    fake.stop()


@contextlib.contextmanager
def serving(settings, tokenizer):
    """The gateway app under uvicorn on a free port, in a thread; yields its base URL."""
    app = build_app(settings, tokenizer, boot_id="gw-test", keepalive_s=KEEPALIVE_S)
    server = make_server(app, "127.0.0.1", 0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_until(lambda: server.started and httpx.get(url + "/health").status_code == 200)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def base_url(settings, tokenizer, scheduler):
    with serving(settings, tokenizer) as url:
        yield url


@pytest.fixture
def fake(scheduler, base_url):
    """The scheduler, reset to its default script and healthy before each test."""
    scheduler.script = scheduler.default_script
    scheduler.worker_ready = True
    scheduler.silent = False
    scheduler.received.clear()
    wait_until(lambda: httpx.get(base_url + "/health").status_code == 200)
    return scheduler


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=10) as c:
        yield c


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def assert_serving(http):
    response = http.get("/v1/models")
    assert response.status_code == 200, response.text


def assert_error(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


CHAT = {"messages": [{"role": "user", "content": "Say hello"}]}
JSON_TYPE = {"content-type": "application/json"}


# --- happy paths through the openai client ----------------------------------------------------


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3"]
    assert client.models.retrieve("tiny-qwen3").id == "tiny-qwen3"


def test_chat_non_streamed(client, fake, tokenizer):
    reply = client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "Say hello"}]}],
        temperature=0.5, top_p=0.9, seed=7, max_tokens=10_000, user="u1")
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    (submit,) = fake.submits()
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
        add_generation_prompt=True, tokenize=False)
    assert list(submit.prompt_token_ids) == tokenizer.encode(expected, add_special_tokens=False)
    assert submit.max_tokens == 256 - len(submit.prompt_token_ids)  # clamped to the context
    assert submit.sampling.seed == 7 and submit.sampling.temperature == 0.5
    assert set(submit.stop_token_ids) == set(tokenizer.eos_token_ids)
    assert submit.priority == "interactive"
    assert reply.usage.prompt_tokens == len(submit.prompt_token_ids)
    assert reply.usage.completion_tokens == len(fake.reply_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_tools_reach_the_chat_template(client, fake, tokenizer):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    client.chat.completions.create(model="tiny-qwen3", messages=CHAT["messages"],
                                   tools=[tool], tool_choice="auto")
    prompt = tokenizer.decode(fake.submits()[0].prompt_token_ids)
    assert "get_weather" in prompt and "<tools>" in prompt


def test_chat_streamed_with_usage(client, fake):
    stream = client.chat.completions.create(
        model="tiny-qwen3", messages=CHAT["messages"], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "stop" and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(fake.reply_ids)
    assert len({c.id for c in chunks}) == 1
    assert fake.submits()[0].sampling.seed >= 0  # drawn by the gateway


def test_completions(client, fake, tokenizer):
    reply = client.completions.create(model="tiny-qwen3", prompt="Once upon", max_tokens=5)
    assert reply.choices[0].text == REPLY
    assert list(fake.submits()[0].prompt_token_ids) == tokenizer.encode("Once upon")
    assert fake.submits()[0].max_tokens == 5
    reply = client.completions.create(model="tiny-qwen3", prompt=[1, 2, 3], stream=True)
    assert "".join(c.choices[0].text for c in reply) == REPLY
    assert fake.submits()[1].prompt_token_ids == (1, 2, 3)
    assert fake.submits()[1].max_tokens == 32  # settings.default_max_tokens


def test_stop_string_cancels_and_reports_stop(client, fake):
    fake.script = lambda submit: [Tokens((t,)) for t in fake.reply_ids] + [Hold()]
    reply = client.chat.completions.create(model="tiny-qwen3", messages=CHAT["messages"],
                                           stop=["world", "never"])
    assert reply.choices[0].message.content == "Hello 🦜 "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(fake.reply_ids)  # the scheduler's count
    assert fake.cancels() == [fake.submits()[0].rid]
    stream = client.chat.completions.create(model="tiny-qwen3", messages=CHAT["messages"],
                                            stop="🦜", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_priority_header_and_field(http, fake):
    response = http.post("/v1/chat/completions", json=CHAT,
                         headers={"X-Switchyard-Priority": "background"})
    assert response.status_code == 200
    response = http.post("/v1/chat/completions", json={**CHAT, "priority": "background"})
    assert response.status_code == 200
    assert [s.priority for s in fake.submits()] == ["background", "background"]
    response = http.post("/v1/chat/completions", json=CHAT,
                         headers={"X-Switchyard-Priority": "urgent"})
    assert_error(response, 400, param="X-Switchyard-Priority")


def test_a_background_model_name_runs_at_background_priority(http, fake):
    """--background-model: an agent's sub-agents, which send no headers of their own, name
    the model by an alias that runs them in the background; a header or field still wins."""
    sub = {**CHAT, "model": "tiny-subagents"}
    assert http.post("/v1/chat/completions", json=sub).status_code == 200
    assert http.post("/v1/completions", json={"model": "tiny-subagents", "prompt": "Hi",
                                              "max_tokens": 2}).status_code == 200
    assert http.post("/v1/messages", json={"model": "tiny-subagents", "max_tokens": 4,
                                           "messages": CHAT["messages"]}).status_code == 200
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert http.post("/v1/chat/completions", json=sub,
                     headers={"X-Switchyard-Priority": "interactive"}).status_code == 200
    assert http.post("/v1/chat/completions",
                     json={**sub, "priority": "interactive"}).status_code == 200
    assert [s.priority for s in fake.submits()] == ["background"] * 3 + ["interactive"] * 3


def test_health(base_url, fake):
    response = httpx.get(base_url + "/health")  # no API key needed
    assert response.status_code == 200 and response.json()["status"] == "ok"
    fake.worker_ready = False
    wait_until(lambda: httpx.get(base_url + "/health").status_code == 503)
    assert httpx.get(base_url + "/health").json()["status"] == "starting"


# --- errors -----------------------------------------------------------------------------------


def bad_requests():
    long_prompt = " ".join(["word"] * 400)
    return [
        ("malformed json", {"content": b'{"messages": [', "headers": JSON_TYPE}, 400,
         "invalid_json", None),
        ("not an object", {"json": [1, 2]}, 400, "invalid_json", None),
        ("wrong type", {"json": {**CHAT, "temperature": "hot"}}, 400, None, "temperature"),
        ("out of range", {"json": {**CHAT, "top_p": 7}}, 400, None, "top_p"),
        ("n > 1", {"json": {**CHAT, "n": 2}}, 400, None, "n"),
        ("no messages", {"json": {"model": "tiny-qwen3"}}, 400, None, "messages"),
        ("too long", {"json": {"messages": [{"role": "user", "content": long_prompt}]}}, 400,
         "context_length_exceeded", None),
        ("unknown model", {"json": {**CHAT, "model": "gpt-4o"}}, 404, "model_not_found",
         "model"),
        ("body too large", {"content": b"{" + b" " * 70_000 + b"}", "headers": JSON_TYPE}, 413,
         "request_too_large", None),
    ]


@pytest.mark.parametrize("name,kwargs,status,code,param", bad_requests(),
                         ids=[b[0] for b in bad_requests()])
def test_bad_request(http, fake, name, kwargs, status, code, param):
    assert_error(http.post("/v1/chat/completions", **kwargs), status, code, param)
    assert fake.submits() == []
    assert_serving(http)


def test_bad_completion_token_ids(http, fake):
    response = http.post("/v1/completions", json={"prompt": [1, 10**9]})
    assert_error(response, 400, param="prompt")
    assert_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}, {"x-api-key": "nope"}])
def test_api_key_is_required(base_url, headers):
    response = httpx.post(base_url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert_error(response, 401, "invalid_api_key")
    assert httpx.get(base_url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404, "not_found")
    assert_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_serving(http)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code,status", [("queue_full", 429), ("context_length_exceeded", 400),
                                         ("internal", 500)])
def test_scheduler_failures(http, fake, code, status, stream):
    fake.script = lambda submit: [Fail(code, retry_after_s=2.0)]
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert_error(response, status, code if code != "internal" else None)
    assert (response.headers.get("Retry-After") == "2") == (code == "queue_full")
    assert_serving(http)


def test_failure_after_the_stream_started_is_an_error_event(http, fake):
    fake.script = lambda submit: [Tokens(tuple(fake.reply_ids[:3])), Sleep(2 * KEEPALIVE_S),
                                  Fail("internal")]
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert ": keepalive" in lines
    errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["code"] == "internal"
    assert lines[-1] == "data: [DONE]"


def test_keepalive_while_waiting_for_the_first_token(http, fake):
    fake.script = lambda submit: [Sleep(3 * KEEPALIVE_S)] + fake.default_script(submit)
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[0] == ": keepalive"
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                   if line.startswith("data: {"))
    assert text == REPLY


# --- restarts, silence, disconnects -----------------------------------------------------------


def test_scheduler_restart_fails_in_flight_with_503(http, fake):
    fake.script = lambda submit: [Tokens(tuple(fake.reply_ids[:2])), Sleep(0.1), Restart()]
    response = http.post("/v1/chat/completions", json=CHAT)
    assert_error(response, 503, "component_restarted")
    assert int(response.headers["Retry-After"]) >= 1
    fake.script = fake.default_script  # the gateway greets the new scheduler and goes on
    wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200)


def test_scheduler_process_restart_fails_in_flight_with_503(settings, tokenizer):
    """The scheduler process ends and a new one binds the same path: what the old one was
    running fails at once (retryable 503, not after peer_timeout_s); the gateway reconnects,
    says Hello, learns the new boot id and serves again."""
    runtime = Path(tempfile.mkdtemp(prefix="sy-gwr-", dir="/tmp"))
    endpoint = Endpoints(ensure_runtime_dir(runtime)).scheduler
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    old = FakeScheduler(endpoint, reply_ids)
    old.script = lambda submit: [Hold()]
    old.start()
    new = None
    own = dataclasses.replace(settings, runtime_dir=str(runtime), peer_timeout_s=30.0)
    try:
        with serving(own, tokenizer) as url, httpx.Client(
                base_url=url, headers={"x-api-key": API_KEY}, timeout=10) as http:
            holder = {}
            thread = threading.Thread(target=lambda: holder.update(
                response=http.post("/v1/chat/completions", json=CHAT)))
            thread.start()
            wait_until(lambda: old.submits())
            started = time.monotonic()
            old.stop()
            new = FakeScheduler(endpoint, reply_ids)
            new.boot_id = "sched-2"
            new.start()
            thread.join(5)
            assert time.monotonic() - started < 5  # well before peer_timeout_s: the dropped connection told us
            assert_error(holder["response"], 503)
            assert holder["response"].headers["Retry-After"]
            wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200)
    finally:
        old.stop()
        if new is not None:
            new.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def test_silent_scheduler_fails_requests_until_it_is_back(http, fake, base_url):
    fake.script = lambda submit: [Hold()]
    holder = {}
    thread = threading.Thread(target=lambda: holder.update(
        response=http.post("/v1/chat/completions", json=CHAT)))
    thread.start()
    wait_until(lambda: fake.submits())
    fake.silent = True
    thread.join(5)
    assert_error(holder["response"], 503, "scheduler_unavailable")
    assert "Retry-After" in holder["response"].headers
    assert_error(http.post("/v1/chat/completions", json=CHAT), 503)
    assert httpx.get(base_url + "/health").json()["status"] == "unavailable"
    fake.silent = False
    wait_until(lambda: httpx.get(base_url + "/health").status_code == 200)
    fake.script = fake.default_script
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_streaming_client_disconnect_cancels(http, fake):
    fake.script = lambda submit: [Tokens(tuple(fake.reply_ids[:2])), Hold()]
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    wait_until(lambda: fake.cancels() == [fake.submits()[0].rid], timeout=30)
    assert_serving(http)


def test_non_streaming_client_disconnect_cancels(base_url, fake):
    fake.script = lambda submit: [Hold()]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json={"prompt": "x"},
                   headers={"x-api-key": API_KEY}, timeout=0.5)
    wait_until(lambda: fake.cancels() == [fake.submits()[0].rid], timeout=30)


def test_request_log_has_fields_and_no_text(http, fake):
    with structlog.testing.capture_logs() as logs:
        rid = http.post("/v1/chat/completions", json={**CHAT, "stop": ["zzz"]}).json()["id"]
        # The line is written after the last byte of the response went out (so a previous
        # test's line may land here too: pick this request's by its id).
        mine = lambda: [e for e in logs  # noqa: E731
                        if e["event"] == "request.finished" and e.get("rid") == rid]
        wait_until(lambda: mine())
    (line,) = mine()
    assert line["status"] == 200 and line["endpoint"] == "POST /v1/chat/completions"
    assert line["num_generated_tokens"] == len(fake.reply_ids)
    assert line["rid"].startswith("chatcmpl-") and line["ttft_s"] >= 0
    assert all(word not in json.dumps(line, ensure_ascii=False)
               for word in ("Say hello", "Hello", "zzz"))


# --- the process --------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_service_serves_and_exits_0_on_signal(tmp_path_factory, tokenizer, sig):
    """`python -m switchyard.gateway` (gateway.service.run): serves, logs JSON lines, exits 0 on a signal."""
    from fixtures.tiny_models import generate_tiny_model

    model = generate_tiny_model(tmp_path_factory.mktemp("svc") / "tiny-svc", "qwen3")
    runtime = Path(tempfile.mkdtemp(prefix="sy-gws-", dir="/tmp"))
    fake = FakeScheduler(Endpoints(ensure_runtime_dir(runtime)).scheduler,
                         tokenizer.encode(REPLY, add_special_tokens=False))
    fake.start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(model), "--runtime-dir", str(runtime),
         "--port", str(port), "--log-format", "json", "--heartbeat-s", "0.05"],
        cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30)
        reply = httpx.post(url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "secret words"}]})
        assert reply.json()["choices"][0]["message"]["content"] == REPLY
        assert reply.json()["model"] == "tiny-svc"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
        fake.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    finished = [e for e in events if e["event"] == "request.finished"
                and e["endpoint"] == "POST /v1/chat/completions"]
    assert finished and finished[0]["role"] == "gateway" and finished[0]["status"] == 200
    assert "secret words" not in stderr and REPLY not in stderr
    assert events[-1]["event"] == "gateway.stopped"
