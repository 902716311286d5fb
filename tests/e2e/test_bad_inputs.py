"""Bad input through the whole group: a clear 4xx in OpenAI's error format, and the server keeps
serving (a good request succeeds after each bad one).

One group for the module, with a small context (512 tokens) so a too-long prompt is small, and a
small `--max-body-bytes` so a too-large body is too.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from switchyard.testing.group import ServerGroup

TIMEOUT_S = 180.0
CTX = 512
MAX_BODY_BYTES = 16_384
GOOD_CHAT = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 3,
             "temperature": 0}
LONG_TEXT = "word " * (CTX + 100)  # one token per "word" or more: past the context


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=2, ctx=CTX,
                     extra=["--max-body-bytes", str(MAX_BODY_BYTES)]) as group:
        yield group


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture
def still_serving(http):
    """After the test's bad request, a good one is served."""
    yield
    response = http.post("/v1/chat/completions", json=GOOD_CHAT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] > 0


def assert_error(response: httpx.Response, status: int, code: str | None = None,
                 param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def post_raw(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


# --- bodies that are not valid requests -------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("content", [b'{"messages": [', b"", b"not json", b"\xff\xfe{}",
                                     b'{"max_tokens": NaN}', b"[1, 2]"],
                         ids=["truncated", "empty", "text", "not utf-8", "nan", "array"])
def test_malformed_json_is_400(http, still_serving, path, content):
    error = assert_error(post_raw(http, path, content), 400, "invalid_json")
    assert error["type"] == "invalid_request_error"


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({"messages": 5}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "model": 7}, "model"),
    ({**CHAT, "stop": 3}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({**CHAT, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_field_of_wrong_type_is_400_naming_it(http, still_serving, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),  # not a token id of this model
], ids=lambda v: v if isinstance(v, str) else None)
def test_completion_field_of_wrong_type_is_400_naming_it(http, still_serving, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "temperature": 7}, "temperature"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_value_out_of_range_or_missing_is_400(http, still_serving, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


# --- the context ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("/v1/completions", {"prompt": LONG_TEXT}),
    ("/v1/completions", {"prompt": [1] * CTX}),  # exactly the context: no room for a token
], ids=["chat", "completion text", "completion ids"])
def test_prompt_longer_than_the_context_is_400(http, still_serving, path, body, stream):
    response = http.post(path, json={**body, "stream": stream})
    error = assert_error(response, 400, "context_length_exceeded")
    assert str(CTX) in error["message"]


def test_prompt_that_just_fits_is_served(http, still_serving):
    response = http.post("/v1/completions", json={"prompt": [1] * (CTX - 1), "max_tokens": 50,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == CTX - 1
    assert body["usage"]["completion_tokens"] <= 1  # clamped to what is left of the context


# --- model, size, method, route ---------------------------------------------------------------


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_unknown_model_is_404(http, still_serving, path, body):
    error = assert_error(http.post(path, json={**body, "model": "gpt-4o"}), 404,
                         "model_not_found", "model")
    assert "gpt-4o" in error["message"]


def test_unknown_model_card_is_404(http, still_serving):
    assert_error(http.get("/v1/models/gpt-4o"), 404, "model_not_found", "model")


def test_body_too_large_is_413(http, still_serving):
    padding = " " * MAX_BODY_BYTES
    content = b'{"messages": [{"role": "user", "content": "hi"}]' + padding.encode() + b"}"
    error = assert_error(post_raw(http, "/v1/chat/completions", content), 413,
                         "request_too_large")
    assert str(MAX_BODY_BYTES) in error["message"]


def test_body_too_large_without_content_length_is_413(http, still_serving):
    """A chunked body has no Content-Length: the limit must hold while reading it."""
    def chunks():
        yield b'{"prompt": "hi", "user": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "request_too_large")


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions"),
                                         ("PUT", "/v1/completions"),
                                         ("POST", "/v1/models"),
                                         ("DELETE", "/health")])
def test_wrong_method_is_405(http, still_serving, method, path):
    response = http.request(method, path)
    assert_error(response, 405, "method_not_allowed")
    assert response.headers.get("allow")


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v1/chat"),
                                         ("GET", "/"), ("POST", "/v2/chat/completions")])
def test_unknown_route_is_404(http, still_serving, method, path):
    assert_error(http.request(method, path), 404, "not_found")


# --- through the openai library ---------------------------------------------------------------


def test_openai_raises_bad_request_with_the_servers_message(client, http, still_serving):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       temperature=7)
    server_error = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 7,
    }).json()["error"]
    assert info.value.status_code == 400
    assert server_error["message"] in info.value.message
    assert info.value.param == "temperature"
    assert info.value.code == server_error["code"]
    assert info.value.body["message"] == server_error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_raises_context_length_exceeded(client, still_serving, stream):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=LONG_TEXT, max_tokens=5, stream=stream)
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {CTX} tokens" in info.value.message


def test_openai_raises_not_found_for_an_unknown_model(client, still_serving):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o",
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert "The model 'gpt-4o' does not exist" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_bad_requests_are_logged_with_their_status_and_nothing_crashed(server, http):
    post_raw(http, "/v1/chat/completions", b"{")
    http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    http.get("/v1/completions")
    post_raw(http, "/v1/completions", b" " * (MAX_BODY_BYTES + 1))
    assert http.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200

    def statuses() -> set[int]:
        return {e["status"] for e in server.log_events("request.finished")
                if e.get("role") == "gateway"}

    deadline = time.monotonic() + 30  # the log line is written just after the response
    while not {200, 400, 404, 405, 413} <= statuses() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {200, 400, 404, 405, 413} <= statuses()
    assert 500 not in statuses()
    assert not server.log_events("request.crashed")
    assert http.get("/health").json()["status"] == "ok"


# A 1x1 PNG: a real image, refused because this model is text-only.
PIXEL_PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4"
             "nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PIXEL_PNG}}]}], "max_tokens": 3},
     "messages[0].content[0].image_url.url"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": PIXEL_PNG}]}], "max_output_tokens": 3},
     "input[0].content[0].image_url"),
])
def test_image_to_a_text_only_model_is_400_naming_the_model(http, server, still_serving, path,
                                                            body, param):
    error = assert_error(http.post(path, json=body), 400, "images_not_supported", param)
    assert server.model.rsplit("/", 1)[-1] in error["message"]
    assert "text-only" in error["message"]


def test_image_to_a_text_only_model_is_400_in_anthropic_format(http, still_serving):
    response = http.post("/v1/messages", json={"model": "any", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PIXEL_PNG.split(",", 1)[1]}}]}]})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "text-only" in body["error"]["message"]
