"""What a router in front of several servers sends and reads (gateway/router_api.py), against
the gateway with a fake scheduler: SGLang's integer `priority` on every API, `/v1/loads` in
SMG's shape, and the discovery documents."""

from __future__ import annotations

import os
import time

import httpx
import msgspec
import pytest

from switchyard.gateway.request.wire.common import INT32_MAX, INT32_MIN
from switchyard.gateway.router_api import Throughput
from switchyard.common.endpoints import Endpoints
from switchyard.proto.status import KvMemoryStatus, write_status
from tests.integration.test_gateway import (API_KEY, CHAT, Hold, Tokens,  # noqa: F401
                                            base_url, fake, http, runtime_dir, scheduler,
                                            settings, tokenizer)
from tests.unit.test_ops_status import snapshot

# SMG's WorkerLoadResponse and SchedulerLoadSnapshot (lightseekorg/smg,
# crates/protocols/src/worker.rs): every member, so a missing one is caught here.
LOAD_RESPONSE_KEYS = {"timestamp", "version", "dp_rank_count", "loads"}
SNAPSHOT_KEYS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                 "num_used_tokens", "max_total_num_tokens", "token_usage", "gen_throughput",
                 "cache_hit_rate", "utilization", "max_running_requests"}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    "/v1/messages": {"max_tokens": 4, **CHAT},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_an_integer_priority_is_a_class_on_every_api(http, fake, path):
    """SGLang's and vLLM's integer: lower runs first; 0 and below interactive, above 0
    background (SMG always sends one)."""
    for value in (0, -7, INT32_MIN, 1, 5.0, INT32_MAX, "background", "interactive"):
        response = http.post(path, json={**BODIES[path], "priority": value})
        assert response.status_code == 200, (value, response.text)
    assert [s.priority for s in fake.submits()] == \
        ["interactive"] * 3 + ["background"] * 4 + ["interactive"]


@pytest.mark.parametrize("path", list(BODIES))
def test_a_priority_out_of_range_or_of_another_kind_is_a_400(http, fake, path):
    for value in (INT32_MAX + 1, INT32_MIN - 1, 1.5, "urgent", True, [1]):
        response = http.post(path, json={**BODIES[path], "priority": value})
        assert response.status_code == 400, (value, response.text)
        assert "'priority'" in response.json()["error"]["message"]  # Anthropic's has no param
    assert not fake.submits()


def test_loads_answer_in_smgs_shape(http, fake, settings):
    body = http.get("/v1/loads").json()
    assert set(body) == LOAD_RESPONSE_KEYS and body["dp_rank_count"] == 1
    (load,) = body["loads"]
    assert set(load) == SNAPSHOT_KEYS
    assert all(isinstance(load[k], int) for k in SNAPSHOT_KEYS if k.startswith(("num_", "max_")))
    assert load["max_running_requests"] >= settings.slots


def test_loads_read_the_queue_kv_tokens_and_cache_hits(http, fake, settings):
    status = msgspec.structs.replace(snapshot(time.time()), kv_memory=KvMemoryStatus(
        held_tokens=3000, budget_tokens=12000, num_tokens=2500, num_running=1,
        num_resident=1, num_preempted=0))
    path = Endpoints(settings.runtime_path).status_file
    write_status(path, status)
    try:
        (load,) = http.get("/v1/loads").json()["loads"]
    finally:
        os.unlink(path)
    assert (load["num_used_tokens"], load["max_total_num_tokens"]) == (2500, 12000)
    assert load["token_usage"] == 0.25
    assert load["cache_hit_rate"] == 0.45  # 90 of the 200 prompt tokens reused
    assert load["num_waiting_reqs"] == 0 and load["num_running_reqs"] == 0


def test_loads_count_what_runs(base_url, http, fake):
    fake.script = lambda submit: [Tokens(tuple(fake.reply_ids[:2])), Hold()]
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=10) as other:
        with other.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the response
            next(lines)
            deadline = time.monotonic() + 30
            while http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            load = http.get("/v1/loads").json()["loads"][0]
            assert load["num_total_reqs"] == 1 and load["utilization"] > 0


def test_loads_need_a_key_and_discovery_does_not(base_url, fake):
    assert httpx.get(base_url + "/v1/loads").status_code == 401
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(base_url + path).json()
        assert info["served_model_name"] == info["model_path"] == "tiny-qwen3"
        assert info["context_length"] == 256 and info["dp_size"] == 1
        assert not info["model_path"].startswith("/")  # never where the model lies
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(base_url + path).json()
        assert info["model_path"] == "tiny-qwen3" and info["is_generation"] is True


def test_throughput_is_a_rate_over_a_window():
    rate = Throughput()
    assert rate.update(100.0, 50) == 0.0  # the first sample
    assert rate.update(105.0, 100) == 0.0  # too soon: the window is not full
    assert rate.update(110.0, 250) == 20.0
    assert rate.update(111.0, 10) == 0.0  # a restarted scheduler counts from 0
