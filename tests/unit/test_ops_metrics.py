"""/metrics families from a status snapshot, the request counting middleware, the dashboard's
routes and the API key on them (in-process: starlette's TestClient, no sockets)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from switchyard.gateway import dashboard, metrics
from switchyard.gateway.app import RequestLogMiddleware
from switchyard.common.settings import Settings
from switchyard.proto.status import (
    STATUS_VERSION,
    DiskStatus,
    QueuedRequest,
    SlotStatus,
    Status,
    write_status,
)
from switchyard.scheduler.stats import SchedulerStats

API_KEY = "sekret"


def record(**kw):
    fields = dict(finish_reason="stop", num_prompt_tokens=100, num_reused_tokens=0,
                  num_copied_tokens=0, num_restored_tokens=0, num_prefilled_tokens=100,
                  num_generated_tokens=5, num_cached_tokens=0, ttft_s=0.2, priority="interactive",
                  num_proposed_tokens=0, num_accepted_tokens=0)
    return SimpleNamespace(**(fields | kw))


def snapshot(now: float) -> Status:
    stats = SchedulerStats()
    stats.request_finished(record(), now)
    stats.request_finished(record(num_reused_tokens=60, num_restored_tokens=32,
                                  num_prefilled_tokens=8, ttft_s=0.03,
                                  num_proposed_tokens=40, num_accepted_tokens=31), now)
    stats.request_finished(record(finish_reason="length", ttft_s=7.0), now)
    stats.request_failed("queue_full")
    for duration in (0.004, 0.02, 0.02):
        stats.step_done(duration)
    stats.restarts["worker"] += 2
    return Status(
        version=STATUS_VERSION, at=now - 2.0, boot_id="b" * 16, pid=1, started_at=now - 60,
        worker_ready=True, kvstore_ready=False, peers={},
        slots=[SlotStatus(slot=0, num_tokens=321, conversation="abc", last_used=now,
                          rid="r1", priority="interactive", state="decoding", waiting_s=None),
               SlotStatus(slot=1, num_tokens=0, conversation=None, last_used=None,
                          rid=None, priority=None, state="idle", waiting_s=None),
               SlotStatus(slot=2, num_tokens=50, conversation="def", last_used=now,
                          rid="r2", priority="background", state="prefilling", waiting_s=7.5)],
        queue=[QueuedRequest(rid="r3", priority="background", waiting_s=4.5, prompt_tokens=9)],
        oldest_waiting_s=7.5,  # a request prefilling in its slot
        disk=DiskStatus(bytes=1000, budget_bytes=5000, num_pages=3, writable=True,
                        num_evicted=4, num_thrash=1, num_writing=0),
        ranks=[],
        stats=stats.snapshot(),
    )


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def exposition(status: Status | None, now: float) -> str:
    registry = metrics.CollectorRegistry()
    registry.register(metrics.StatusCollector(lambda: status, clock=lambda: now))
    return metrics.generate_latest(registry).decode()


def test_families_from_a_snapshot():
    now = time.time()
    got = samples(exposition(snapshot(now), now))
    assert got[("switchyard_status_up", ())] == 1
    assert got[("switchyard_status_age_seconds", ())] == pytest.approx(2.0)
    tokens = {kind: got[("switchyard_tokens_total", (("kind", kind),))]
              for kind in metrics.TOKEN_KINDS}
    assert tokens == {"prompt": 300, "reused": 60, "copied": 0, "restored": 32,
                      "prefilled": 208, "generated": 15}
    assert got[("switchyard_speculative_tokens_total", (("kind", "proposed"),))] == 40
    assert got[("switchyard_speculative_tokens_total", (("kind", "accepted"),))] == 31
    assert got[("switchyard_requests_finished_total", (("reason", "stop"),))] == 2
    assert got[("switchyard_requests_finished_total", (("reason", "length"),))] == 1
    assert got[("switchyard_requests_failed_total", (("code", "queue_full"),))] == 1
    # Histograms are cumulative, with +Inf = count.
    assert got[("switchyard_ttft_seconds_bucket", (("le", "0.05"),))] == 1
    assert got[("switchyard_ttft_seconds_bucket", (("le", "0.25"),))] == 2
    assert got[("switchyard_ttft_seconds_bucket", (("le", "5.0"),))] == 2
    assert got[("switchyard_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("switchyard_ttft_seconds_count", ())] == 3
    assert got[("switchyard_ttft_seconds_sum", ())] == pytest.approx(7.23)
    assert got[("switchyard_step_seconds_count", ())] == 3
    assert got[("switchyard_steps_total", ())] == 3
    assert got[("switchyard_slots", ())] == 3
    assert got[("switchyard_slots_by_state", (("state", "decoding"),))] == 1
    assert got[("switchyard_slots_by_state", (("state", "restoring"),))] == 0
    assert got[("switchyard_slot_tokens", (("slot", "0"),))] == 321
    assert got[("switchyard_queue_depth", (("priority", "background"),))] == 1
    assert got[("switchyard_queue_depth", (("priority", "interactive"),))] == 0
    assert got[("switchyard_queue_oldest_wait_seconds", ())] == 4.5
    assert got[("switchyard_oldest_waiting_seconds", ())] == 7.5
    assert got[("switchyard_kv_disk_bytes", ())] == 1000
    assert got[("switchyard_kv_disk_budget_bytes", ())] == 5000
    assert got[("switchyard_kv_evicted_pages_total", ())] == 4
    assert got[("switchyard_kv_thrash_events_total", ())] == 1
    assert got[("switchyard_component_restarts_total", (("component", "worker"),))] == 2
    assert got[("switchyard_component_restarts_total", (("component", "gateway"),))] == 0
    assert got[("switchyard_component_ready", (("component", "kvstore"),))] == 0
    assert ("switchyard_kv_held_tokens", ()) not in got, "no budget counted in this snapshot"


def test_the_kv_memory_against_its_budget():
    from switchyard.proto.status import KvMemoryStatus

    now = time.time()
    with_kv = msgspec.structs.replace(snapshot(now), kv_memory=KvMemoryStatus(
        held_tokens=9000, budget_tokens=12000, num_tokens=7000, num_running=3,
        num_resident=4, num_preempted=2, num_cut=3, cut_kept_tokens=4608))
    got = samples(exposition(with_kv, now))
    assert got[("switchyard_kv_held_tokens", ())] == 9000
    assert got[("switchyard_kv_slot_cuts_total", ())] == 3
    assert got[("switchyard_kv_cut_kept_tokens_total", ())] == 4608
    assert got[("switchyard_kv_budget_tokens", ())] == 12000
    assert got[("switchyard_kv_memory_preemptions_total", ())] == 2


def test_no_status_file_is_status_up_0():
    got = samples(exposition(None, time.time()))
    assert got == {("switchyard_status_up", ()): 0}


def make_app(tmp_path, api_key: str = "") -> Starlette:
    """What gateway.app.build_app does, without a tokenizer or scheduler: the real logging
    middleware (API key on /v1), a /v1 route and the observability routes."""

    async def models(request):
        return JSONResponse({"data": []})

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/models/{model:path}", models)],
                    middleware=[Middleware(RequestLogMiddleware, api_key=api_key)])
    settings = Settings(runtime_dir=str(tmp_path), api_key=api_key)
    metrics.mount(app, settings)
    dashboard.mount(app, settings)
    return app


def test_requests_are_counted_by_route_and_status(tmp_path):
    client = TestClient(make_app(tmp_path))
    client.get("/v1/models")
    client.get("/v1/models/a/b")
    client.get("/v1/models/c")
    client.post("/v1/models")  # 405
    client.get("/nope/12345")  # 404: one label value for every unknown path
    got = samples(client.get("/metrics").text)
    key = "switchyard_http_requests_total"
    assert got[(key, (("endpoint", "/v1/models"), ("method", "GET"), ("status", "200")))] == 1
    assert got[(key, (("endpoint", "/v1/models/{model:path}"), ("method", "GET"),
                      ("status", "200")))] == 2
    assert got[(key, (("endpoint", "/v1/models"), ("method", "POST"), ("status", "405")))] == 1
    assert got[(key, (("endpoint", "other"), ("method", "GET"), ("status", "404")))] == 1
    assert got[("switchyard_http_request_duration_seconds_count",
                (("endpoint", "/v1/models"),))] == 2
    assert got[("switchyard_status_up", ())] == 0
    # The scrape itself is counted once it is done.
    got = samples(client.get("/metrics").text)
    assert got[(key, (("endpoint", "/metrics"), ("method", "GET"), ("status", "200")))] == 1


def external_urls(text: str) -> set[str]:
    return set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[a-z]{2,}[^\s\"')]*", text))


def test_dashboard_page_and_assets(tmp_path):
    client = TestClient(make_app(tmp_path))
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'src="/dashboard/dashboard.js"' in page.text
    assert external_urls(page.text) == set()  # nothing from a CDN
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        asset = client.get(f"/dashboard/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert external_urls(asset.text) <= {"http://www.w3.org/2000/svg"}  # a namespace
    assert client.get("/dashboard/..%2Fmetrics.py").status_code == 404
    assert client.get("/dashboard/metrics.py").status_code == 404


def test_status_endpoint(tmp_path):
    client = TestClient(make_app(tmp_path))
    missing = client.get("/v1/switchyard/status")
    assert missing.status_code == 503 and missing.json()["error"]["code"] == "status_unavailable"
    now = time.time()
    write_status(tmp_path / "status.json", snapshot(now))
    client.get("/v1/models")
    body = client.get("/v1/switchyard/status").json()
    # The page's script reads the document's JSON field names (gateway/static/dashboard.js).
    assert body["slots"][0]["conversation"] == "abc" and body["age_s"] >= 2.0
    assert body["stats"]["tokens"]["reused"] == 60 and body["disk"]["budget_bytes"] == 5000
    assert body["stats"]["recent_requests"][1]["cause"] == "reused"
    assert {"method": "GET", "endpoint": "/v1/models", "status": "200",
            "count": 1} in body["gateway"]["http_requests"]


def test_api_key_guards_status_and_metrics_not_the_page(tmp_path):
    write_status(tmp_path / "status.json", snapshot(time.time()))
    client = TestClient(make_app(tmp_path, api_key=API_KEY))
    assert client.get("/v1/switchyard/status").status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    assert client.get("/v1/switchyard/status", headers=bearer).status_code == 200
    assert client.get("/metrics", headers={"x-api-key": API_KEY}).status_code == 200
    assert client.get("/dashboard").status_code == 200  # static; its data needs the key
