"""SSE framing, response shapes, error mapping and disconnect handling (no sockets)."""

import asyncio
import json

import pytest

from switchyard.gateway.errors import APIError, from_failure
from switchyard.gateway.generation import Usage
from switchyard.gateway.output.parser import ReasoningDelta, TextDelta, ToolCallDone, ToolCallStart
from switchyard.gateway.api.responses import ChatFormat, CompletionFormat
from switchyard.gateway.output.tools import ToolCall
from switchyard.gateway.turn import TurnResult
from switchyard.gateway.streaming import (SSE_DONE, SSE_KEEPALIVE, ClientDisconnected,
                                          EventStreamResponse, sse_data, started,
                                          until_disconnect)
from switchyard.proto.gateway_scheduler import RequestFailed


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_sse_data_is_one_event_with_escaped_newlines():
    frame = sse_data({"text": "a\nb\n\nc", "emoji": "🦜"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2
    assert json.loads(frame[6:]) == {"text": "a\nb\n\nc", "emoji": "🦜"}
    assert "🦜".encode() in frame  # UTF-8, not \\u escapes
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert SSE_KEEPALIVE.startswith(b":")  # a comment: clients ignore it


@pytest.mark.parametrize("code,status,retry_after", [
    ("queue_full", 429, "3"), ("context_length_exceeded", 400, None),
    ("component_restarted", 503, "3"), ("scheduler_unavailable", 503, "3"),
    ("internal", 500, None), ("something_new", 500, None),
])
def test_failure_codes_map_to_statuses(code, status, retry_after):
    error = from_failure(RequestFailed("r", code, "msg", code != "internal", 2.2))
    assert error.status == status
    assert error.headers.get("Retry-After") == retry_after
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] == "msg"


def test_retry_after_is_at_least_one_second():
    failed = RequestFailed("r", "queue_full", "", True, 0.0)
    assert from_failure(failed).headers["Retry-After"] == "1"


def test_api_error_response():
    response = APIError(401, "no", type="authentication_error", code="invalid_api_key").response()
    assert response.status_code == 401
    assert json.loads(response.body) == {"error": {
        "message": "no", "type": "authentication_error", "param": None,
        "code": "invalid_api_key"}}


USAGE = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4)


def frames_json(frames):
    return [json.loads(f[6:]) for f in frames if f.startswith(b"data: {")]


def result(content="", reason="stop", calls=(), reasoning=""):
    return TurnResult(content, reasoning, list(calls), reason, None, USAGE)


def test_chat_shapes():
    fmt = ChatFormat("chatcmpl-1", "m", include_usage=True)
    (first,) = frames_json(fmt.head())
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None
    (text,) = frames_json(fmt.frames([TextDelta("hi")]))
    assert text["choices"][0]["delta"] == {"content": "hi"}
    (reasoning,) = frames_json(fmt.frames([ReasoningDelta("hmm")]))
    assert reasoning["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    call = ToolCall("call_1", "f", '{"a": 1}')
    start, done = frames_json(fmt.frames([ToolCallStart(0, "call_1", "f"), ToolCallDone(0, call)]))
    assert start["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": ""}}]
    assert done["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": '{"a": 1}'}}]
    tail = fmt.tail(result(reason="stop"))
    finish, usage = frames_json(tail)
    assert tail[-1] == SSE_DONE
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 13
    body = fmt.body(result("hello", "length"))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    body = fmt.body(result("\n", "tool_calls", [call], reasoning="r"))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == "r"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_chunks_carry_no_usage_key_unless_asked():
    (chunk,) = frames_json(ChatFormat("c", "m").frames([TextDelta("x")]))
    assert "usage" not in chunk
    finish, = frames_json(ChatFormat("c", "m").tail(result()))
    assert "usage" not in finish


def test_completion_shapes():
    fmt = CompletionFormat("cmpl-1", "m")
    assert fmt.head() == []
    (chunk,) = frames_json(fmt.frames([TextDelta("x")]))
    assert chunk["choices"][0]["text"] == "x"
    body = fmt.body(result("abc"))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"


def test_error_frames_are_openai_errors_then_done():
    frames = ChatFormat("c", "m").error_frames(APIError(500, "boom", code="internal"))
    assert frames_json(frames)[0]["error"]["message"] == "boom" and frames[-1] == SSE_DONE


class FakeClient:
    """ASGI receive/send that disconnects after `after` seconds."""

    def __init__(self, after=None):
        self.after = after
        self.sent = []

    async def receive(self):
        if self.after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)


@pytest.mark.anyio
async def test_until_disconnect_returns_the_result():
    async def work():
        return 42

    assert await until_disconnect(FakeClient().receive, work()) == 42


@pytest.mark.anyio
async def test_until_disconnect_cancels_the_work():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            cancelled.set()

    with pytest.raises(ClientDisconnected):
        await until_disconnect(FakeClient(after=0.01).receive, work())
    assert cancelled.is_set()


@pytest.mark.anyio
async def test_event_stream_sends_frames_then_ends():
    async def frames():
        yield b"data: 1\n\n"
        yield SSE_DONE

    closed = []
    client = FakeClient()
    await EventStreamResponse(frames(), on_close=closed.append)({}, client.receive,
                                                                 client.send)
    assert client.sent[0]["status"] == 200
    assert dict(client.sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert [m.get("body") for m in client.sent[1:]] == [b"data: 1\n\n", SSE_DONE, b""]
    assert closed == [False]


@pytest.mark.anyio
async def test_a_started_stream_fails_before_its_status_line_and_sends_no_empty_frame():
    async def failing():
        raise APIError(429, "full", code="queue_full")
        yield b""

    with pytest.raises(APIError):  # the handler still answers with its own status
        await started(failing())

    finalized = asyncio.Event()

    async def quiet():
        try:
            yield b""  # under way, with nothing to say yet
            yield b"data: 1\n\n"
        finally:
            finalized.set()

    client = FakeClient()
    await EventStreamResponse(await started(quiet()))({}, client.receive, client.send)
    assert [m.get("body") for m in client.sent[1:]] == [b"data: 1\n\n", b""]
    assert finalized.is_set()

    finalized.clear()
    stream = await started(quiet())
    await stream.aclose()  # before a frame was sent: its frames are closed all the same
    assert finalized.is_set()


@pytest.mark.anyio
async def test_event_stream_closes_its_frames_when_the_client_leaves():
    finalized = asyncio.Event()

    async def frames():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(10)
            yield b"never"
        finally:
            finalized.set()

    closed = []
    client = FakeClient(after=0.01)
    await EventStreamResponse(frames(), on_close=closed.append)({}, client.receive,
                                                                 client.send)
    assert finalized.is_set() and closed == [True]
    assert all(m.get("body") != b"never" for m in client.sent)


@pytest.mark.anyio
async def test_event_stream_treats_a_send_error_as_a_disconnect():
    finalized = asyncio.Event()

    async def frames():
        try:
            while True:
                yield b"data: x\n\n"
        finally:
            finalized.set()

    class Broken(FakeClient):
        async def send(self, message):
            if message["type"] == "http.response.body":
                raise OSError("connection reset")

    closed = []
    client = Broken()
    await EventStreamResponse(frames(), on_close=closed.append)({}, client.receive,
                                                                 client.send)
    assert finalized.is_set() and closed == [True]
