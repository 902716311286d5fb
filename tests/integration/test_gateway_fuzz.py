"""Property test of request bodies, per endpoint, against the real app and a fake scheduler:
whatever the body, the answer is never a 500 or a crash, and every error is in the API's own
format (OpenAI's for chat, completions and responses; Anthropic's for messages).

Bodies are valid requests mutated at random (fields replaced by odd JSON values, removed,
nested items and blocks replaced), plus raw byte strings. Seeded: a failure names its seed.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import tempfile
import zlib
from pathlib import Path

import httpx
import pytest

from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.common.settings import Settings
from tests.integration.test_gateway import FakeScheduler, serving, wait_until

API_KEY = "fuzz"
NUM_BODIES = 200

ODD = [None, True, False, 0, -1, 1, 3, 0.5, -7.25, 1e300, 2**64, "", "x", "auto", "none",
       "required", "any", "tool", "function", "user", "assistant", "tool_use", "text",
       "message", "function_call", "<tool_call>", "\ud7ff🦜", [], [1], ["a"], [None], [{}],
       {}, {"type": "text"}, {"type": "function"}, {"name": "f"}, {"type": "text", "text": 5},
       {"role": "user", "content": "hi"}, {"type": "tool", "name": "get_weather"},
       {"type": "function", "function": {"name": "get_weather"}},
       {"type": "function", "name": "get_weather"}]

FUNCTION = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

VALID = {
    "/v1/chat/completions": {
        "model": "tiny-qwen3", "max_tokens": 8, "temperature": 0.7, "stream": False,
        "tools": [FUNCTION], "tool_choice": "auto", "parallel_tool_calls": True,
        "messages": [{"role": "system", "content": "sys"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]},
    "/v1/completions": {"model": "tiny-qwen3", "prompt": "Once", "max_tokens": 8,
                        "stop": ["x"], "stream": False},
    "/v1/responses": {
        "model": "tiny-qwen3", "instructions": "be brief", "max_output_tokens": 8,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
        "tool_choice": "auto", "stream": False,
        "input": [{"role": "user", "content": "hi"},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "more"}]}]},
    "/v1/messages": {
        "model": "claude", "max_tokens": 8, "stream": False, "system": [
            {"type": "text", "text": "x-anthropic-billing-header: a"},
            {"type": "text", "text": "sys"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "stop_sequences": ["zz"],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": ""},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "text", "text": "and?"}]}]},
}
VALID["/v1/messages/count_tokens"] = {k: v for k, v in VALID["/v1/messages"].items()
                                      if k not in ("max_tokens", "stream", "stop_sequences")}


def mutate(body, rng: random.Random, depth: int = 0):
    """A copy of a JSON value with a few random changes somewhere inside."""
    if isinstance(body, dict) and body and rng.random() < 0.8:
        body = dict(body)
        key = rng.choice(list(body))
        roll = rng.random()
        if roll < 0.2:
            del body[key]
        elif roll < 0.6 or depth > 3:
            body[key] = copy.deepcopy(rng.choice(ODD))
        else:
            body[key] = mutate(body[key], rng, depth + 1)
        if rng.random() < 0.1:
            body[rng.choice(["extra", "n", "stream", "priority", "tool_choice", "thinking",
                             "previous_response_id", "store", "top_k", "top_p"])] = \
                copy.deepcopy(rng.choice(ODD))
        return body
    if isinstance(body, list) and body and rng.random() < 0.8:
        body = list(body)
        i = rng.randrange(len(body))
        roll = rng.random()
        if roll < 0.2:
            del body[i]
        elif roll < 0.4:
            body.insert(i, copy.deepcopy(rng.choice(ODD)))
        else:
            body[i] = mutate(body[i], rng, depth + 1)
        return body
    return copy.deepcopy(rng.choice(ODD))


def bodies(path: str, seed: int):
    rng = random.Random(seed)
    for i in range(NUM_BODIES):
        if i % 25 == 0:
            raw = rng.choice([b"", b"{", b"[]", b"null", b'"x"', b"{\"messages\": [}",
                              bytes(rng.randrange(256) for _ in range(20))])
            yield i, {"content": raw, "headers": {"content-type": "application/json"}}
            continue
        body = VALID[path]
        for _ in range(rng.randint(1, 3)):
            body = mutate(body, rng)
        if isinstance(body, dict) and rng.random() < 0.3:
            body["stream"] = True
        yield i, {"json": body}


def check_error(path: str, response: httpx.Response) -> None:
    body = response.json()
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def check_stream(path: str, response: httpx.Response) -> None:
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines, "an empty stream"
    payloads = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    for payload in payloads:
        if path.startswith("/v1/messages"):
            assert payload["type"] != "error", payload
        else:
            assert "error" not in payload, payload
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert lines[-1] == "data: [DONE]"
    elif path == "/v1/messages":
        assert payloads[-1]["type"] == "message_stop"
    else:
        assert payloads[-1]["type"] in ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    return load_tokenizer(generate_tiny_model(tmp_path_factory.mktemp("m") / "tiny-qwen3",
                                              "qwen3"))


@pytest.fixture(scope="module")
def base_url(tokenizer):
    runtime = Path(tempfile.mkdtemp(prefix="sy-fz-", dir="/tmp"))
    settings = Settings(model="/models/tiny-qwen3", runtime_dir=str(runtime), ctx=1024,
                        page_size=16, max_body_bytes=64 * 1024, default_max_tokens=8,
                        api_key=API_KEY, heartbeat_s=0.05, peer_timeout_s=2.0)
    fake = FakeScheduler(Endpoints(ensure_runtime_dir(runtime)).scheduler,
                         tokenizer.encode("Hi <tool_call>\n{\"name\": \"get_weather\", "
                                          "\"arguments\": {}}\n</tool_call>",
                                          add_special_tokens=False))
    fake.start()
    fake.ready.wait(5)
    try:
        with serving(settings, tokenizer) as url:
            wait_until(lambda: httpx.get(url + "/health").status_code == 200)
            yield url
    finally:
        fake.stop()
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.mark.parametrize("path", list(VALID))
def test_random_bodies_never_give_a_500_and_errors_keep_the_api_format(base_url, path):
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=base_url, timeout=20,
                      headers={"Authorization": f"Bearer {API_KEY}",
                               "x-api-key": API_KEY}) as http:
        for i, request in bodies(path, seed=zlib.crc32(path.encode())):
            with http.stream("POST", path, **request) as response:
                status = response.status_code
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, (i, request, response.read())
                if status != 200:
                    response.read()
                    check_error(path, response)
                elif response.headers["content-type"].startswith("text/event-stream"):
                    check_stream(path, response)
                else:
                    response.read()
                    assert isinstance(response.json(), dict)
        assert http.get("/v1/models").status_code == 200  # still serving
    print(path, sorted(statuses.items()))
    assert statuses.get(200, 0) >= 10, statuses  # the mutations leave many requests valid
    assert statuses.get(400, 0) >= 50, statuses
