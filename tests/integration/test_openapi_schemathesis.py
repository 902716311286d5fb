"""schemathesis against the live gateway's own /openapi.json (the scripted fake scheduler of
test_gateway behind it): every check, a bounded number of generated requests per operation,
deterministic. The spec must tell the truth: what it allows is accepted, what it declares is
answered (issue 12).

JSON Schema cannot say that a named tool_choice must name one of `tools`, nor that a
previous_response_id must be one the server still keeps; each generated case is made to
follow those two rules before it is sent (the spec's descriptions state them)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the importorskip)
from schemathesis.checks import CHECKS  # noqa: E402

from switchyard.proto.endpoints import Endpoints, ensure_runtime_dir  # noqa: E402
from switchyard.proto.settings import Settings  # noqa: E402
from tests.integration.test_gateway import FakeScheduler, wait_until  # noqa: E402
from tests.integration.test_gateway_security import serving  # noqa: E402

MAX_EXAMPLES = 15  # per operation: bounded for CI


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
    for tool in body.get("tools") or ():
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


def test_security_is_declared_only_with_a_key():
    from switchyard.gateway.api.openapi import openapi_spec

    assert "security" not in openapi_spec("m")
    spec = openapi_spec("m", api_key=True)
    assert spec["security"] and "securitySchemes" in spec["components"]
    assert spec["paths"]["/health"]["get"]["security"] == []
