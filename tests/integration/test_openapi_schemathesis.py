"""schemathesis against the live gateway's own /openapi.json (the scripted fake scheduler of
test_gateway behind it): every check, a bounded number of generated requests per operation,
deterministic, valid requests (all accepted) and schema-violating ones (all refused). The spec
must tell the truth: what it allows is accepted, what it declares is answered, what it
forbids is refused.

JSON Schema cannot say that a named tool_choice must name one of `tools`, that a
previous_response_id must be one the server still keeps, nor that an image's bytes are an image;
each generated valid case is made to follow those rules before it is sent (the spec documents
them as 400s). The spec of a vision-language model (a tiny Qwen2.5-VL twin's directory behind
the same fake scheduler) takes image content in each API's shape, and is checked the same way."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the importorskip)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from switchyard.common.endpoints import Endpoints, ensure_runtime_dir  # noqa: E402
from switchyard.common.settings import Settings  # noqa: E402
from tests.helpers.openapi_rules import (MAX_IMAGES, PNG_BASE64, PNG_URL,  # noqa: E402
                                         follow_unstateable_rules)
from tests.integration.test_gateway import FakeScheduler, wait_until  # noqa: E402
from tests.integration.test_gateway_security import serving  # noqa: E402

MAX_EXAMPLES = 15  # per operation: bounded for CI
MAX_NEGATIVE_EXAMPLES = 10  # schema-violating requests per operation
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens")
MINIMAL = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
           "/v1/completions": {"prompt": "hi"},
           "/v1/responses": {"input": "hi"},
           "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
           "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    return load_tokenizer(generate_tiny_model(tmp_path_factory.mktemp("m") / "tiny-qwen3",
                                              "qwen3"))


@contextlib.contextmanager
def live(model: str, tokenizer):
    runtime = Path(tempfile.mkdtemp(prefix="sy-st-", dir="/tmp"))
    fake = FakeScheduler(Endpoints(ensure_runtime_dir(runtime)).scheduler,
                         tokenizer.encode("Hello world", add_special_tokens=False))
    fake.start()
    fake.ready.wait(5)
    # No key (the loopback default): the spec then declares no security either.
    settings_ = Settings(model=model, runtime_dir=str(runtime), ctx=32768,
                         page_size=16, max_body_bytes=256 * 1024, default_max_tokens=4,
                         heartbeat_s=0.05, peer_timeout_s=5.0, max_images=MAX_IMAGES)
    try:
        with serving(settings_, tokenizer) as (url, _):
            wait_until(lambda: httpx.get(url + "/health").status_code == 200)
            yield schemathesis.openapi.from_url(url + "/openapi.json")
    finally:
        fake.stop()
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def live_schema(tokenizer):
    with live("/models/tiny-qwen3", tokenizer) as schema:
        yield schema


@pytest.fixture(scope="module")
def live_vision_schema(tmp_path_factory):
    """A vision model's gateway: the tiny Qwen2.5-VL twin's directory (its processor configs
    size the images' placeholders), the fake scheduler behind it."""
    pytest.importorskip("mlx_vlm")
    from mlx_lm.utils import load_tokenizer

    from fixtures.tiny_models import generate_tiny_model

    model = generate_tiny_model(tmp_path_factory.mktemp("v") / "tiny-qwen2_5_vl", "qwen2_5_vl")
    with live(str(model), load_tokenizer(model)) as schema:
        yield schema


def test_the_published_spec_tells_the_truth(live_schema):
    check_positive(live_schema, lambda path: True)


def check_positive(schema, wanted) -> None:
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    checks = CHECKS.get_all()
    for operation in operations:
        if not wanted(operation.path):
            continue

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            follow_unstateable_rules(case.body)
            case.call_and_validate(checks=checks, timeout=30)

        run()


def test_schema_violating_requests_are_refused(live_schema):
    """Negative generation: every request the spec forbids is refused (no "schema-violating
    request accepted"), and none is a server error."""
    check_negative(live_schema, lambda path: True)


def check_negative(schema, wanted) -> None:
    checks = CHECKS.get_all()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST" or not wanted(operation.path):
            continue

        @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=MAX_NEGATIVE_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            case.call_and_validate(checks=checks, timeout=30)

        run()


# --- a vision model's spec ------------------------------------------------------------------------

IMAGE_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens")
_CALL = {"id": "call_1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
_A_TURNS = [
    {"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG_BASE64}}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                       "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "text", "text": "here"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG_BASE64}}]}]}]
IMAGE_BODIES = {
    "/v1/chat/completions": {"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}}]},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [
            {"type": "image_url", "image_url": PNG_URL}]}]},
    "/v1/responses": {"input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": PNG_URL, "detail": "auto"}]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": PNG_URL}]}]},
    "/v1/messages": {"max_tokens": 4, "messages": _A_TURNS},
    "/v1/messages/count_tokens": {"messages": _A_TURNS},
}


@pytest.mark.parametrize("path", IMAGE_ROUTES)
def test_a_vision_models_spec_takes_images_in_each_apis_shape(live_schema, live_vision_schema,
                                                              path):
    """Chat image_url parts (user, tool), Messages image blocks (user turns, tool results),
    Responses input_image (user messages, function call outputs): in the vision model's spec
    and accepted by its server; not in a text model's spec (whose server refuses them)."""
    import jsonschema

    body = IMAGE_BODIES[path]
    jsonschema.validate(body, _request_schema(live_vision_schema.raw_schema, path))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, _request_schema(live_schema.raw_schema, path))
    url = live_vision_schema.location.rsplit("/openapi.json", 1)[0]
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    text_url = live_schema.location.rsplit("/openapi.json", 1)[0]
    assert httpx.post(text_url + path, json=body, timeout=30).status_code == 400


def test_the_vision_models_spec_tells_the_truth(live_vision_schema):
    check_positive(live_vision_schema, lambda path: path in IMAGE_ROUTES)


def test_schema_violating_image_requests_are_refused(live_vision_schema):
    check_negative(live_vision_schema, lambda path: path in IMAGE_ROUTES)


def _request_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_optional_fields_given_null_are_declared_and_accepted(live_schema, path):
    """`priority: null`, `thinking: null` (and every other optional
    field) are read as absent, and the spec says they may be null."""
    import jsonschema

    url = live_schema.location.rsplit("/openapi.json", 1)[0]
    schema = _request_schema(live_schema.raw_schema, path)
    optional = [name for name in schema["properties"] if name not in schema["required"]]
    assert ("priority" in optional) == (path != "/v1/messages/count_tokens")
    assert ("thinking" in optional) == path.startswith("/v1/messages")
    for name in optional:
        body = {**MINIMAL[path], name: None}
        jsonschema.validate(body, schema)
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == 200, (name, response.text)


def test_semantic_400s_are_documented(live_schema):
    spec = live_schema.raw_schema
    for path in POST_ROUTES:
        documented = spec["paths"][path]["post"]["responses"]["400"]["description"]
        assert "tool_choice names a function that is not in tools" in documented
        assert "previous_response_id" in documented


def test_a_name_only_tool_with_thinking_and_one_assistant_message_is_no_server_error(
        live_schema):
    """The body schemathesis found a 500 with."""
    url = live_schema.location.rsplit("/openapi.json", 1)[0]
    for content in ("", "x", [{"type": "text", "text": "x"}],
                    [{"type": "thinking", "thinking": "t"}],
                    [{"type": "tool_use", "id": "t1", "name": "a", "input": {}}]):
        for choice in (None, {"type": "any"}, {"type": "tool", "name": "a"}):
            body = {"max_tokens": 4, "tools": [{"name": "a"}], "thinking": {"type": "enabled"},
                    "messages": [{"role": "assistant", "content": content}],
                    **({"tool_choice": choice} if choice else {})}
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                response = httpx.post(url + path, json=body, timeout=30)
                assert response.status_code == 200, (body, response.text)


def test_security_is_declared_only_with_a_key():
    from switchyard.gateway.api.openapi import openapi_spec

    assert "security" not in openapi_spec("m")
    spec = openapi_spec("m", api_key=True)
    assert spec["security"] and "securitySchemes" in spec["components"]
    assert spec["paths"]["/health"]["get"]["security"] == []
