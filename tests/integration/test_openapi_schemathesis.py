"""schemathesis against the live gateway's own /openapi.json (the scripted fake scheduler of
test_gateway behind it): every check, a bounded number of generated requests per operation,
deterministic, valid requests (all accepted) and schema-violating ones (all refused). The spec
must tell the truth: what it allows is accepted, what it declares is answered, what it
forbids is refused (issues 12 and 23).

JSON Schema cannot say that a named tool_choice must name one of `tools`, nor that a
previous_response_id must be one the server still keeps; each generated valid case is made to
follow those two rules before it is sent (the spec documents both as 400s)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the importorskip)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from switchyard.proto.endpoints import Endpoints, ensure_runtime_dir  # noqa: E402
from switchyard.proto.settings import Settings  # noqa: E402
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


@pytest.fixture(scope="module")
def live_schema(tokenizer):
    runtime = Path(tempfile.mkdtemp(prefix="sy-st-", dir="/tmp"))
    fake = FakeScheduler(Endpoints(ensure_runtime_dir(runtime)).scheduler,
                         tokenizer.encode("Hello world", add_special_tokens=False))
    fake.start()
    fake.ready.wait(5)
    # No key (the loopback default): the spec then declares no security either.
    settings_ = Settings(model="/models/tiny-qwen3", runtime_dir=str(runtime), ctx=32768,
                         page_size=16, max_body_bytes=256 * 1024, default_max_tokens=4,
                         heartbeat_s=0.05, peer_timeout_s=5.0)
    try:
        with serving(settings_, tokenizer) as (url, _):
            wait_until(lambda: httpx.get(url + "/health").status_code == 200)
            yield schemathesis.openapi.from_url(url + "/openapi.json")
    finally:
        fake.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def follow_unstateable_rules(body) -> None:
    if not isinstance(body, dict):
        return
    body.pop("previous_response_id", None)
    names = []
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom", "function"):
            continue  # a server tool: skipped, not callable
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        if isinstance(choice.get("function"), dict):
            choice["function"]["name"] = names[0]
        elif "name" in choice:
            choice["name"] = names[0]


def test_the_published_spec_tells_the_truth(live_schema):
    operations = [result.ok() for result in live_schema.get_all_operations()]
    assert len(operations) >= 8
    checks = CHECKS.get_all()
    for operation in operations:
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
    checks = CHECKS.get_all()
    for result in live_schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST":
            continue

        @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=MAX_NEGATIVE_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            case.call_and_validate(checks=checks, timeout=30)

        run()


def _request_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_optional_fields_given_null_are_declared_and_accepted(live_schema, path):
    """Issue 23, finding 11: `priority: null`, `thinking: null` (and every other optional
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
    """Issue 23, finding 11: the body schemathesis found a 500 with."""
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
