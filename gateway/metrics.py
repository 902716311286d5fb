"""`GET /metrics`: the group in Prometheus text format.

Two sources, one registry per app:

- the gateway's own counters: HTTP requests by method, endpoint (the route's path template,
  `other` for unknown paths) and status, and their durations, counted by a middleware that
  reads the status the request's `request.finished` log line carries;
- a collector that reads the scheduler's `status.json` (rewritten every heartbeat) on each
  scrape: TTFT and step-time histograms, tokens by where their KV came from (reused, copied,
  restored, prefilled) and generated, draft tokens proposed and accepted, slot occupancy, queue depth, disk bytes and budget,
  evictions and thrash events, component restarts the scheduler saw.

The scheduler's counters start from zero when it restarts (Prometheus treats that as a counter
reset; `switchyard_scheduler_start_time_seconds` changes). When an API key is set, /metrics
requires it like /v1 does (`Authorization: Bearer KEY` in the scrape config); with several
keys, a tenant's key is shown the status as gateway/tenant_view.py cuts it (its own counters),
an operator key all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from switchyard.gateway.context import RECORD_SCOPE_KEY
from switchyard.gateway.tenant_view import status_for
from switchyard.common.endpoints import Endpoints
from switchyard.proto.base import PRIORITIES, ROLE_GATEWAY, ROLE_KVSTORE, ROLE_WORKER
from switchyard.common.settings import Settings
from switchyard.common.tenants import Tenant, Tenants
from switchyard.proto.status import (SLOT_STATES, TOKEN_KINDS, DiskStatus, KvMemoryStatus, Stats,
                                      Status, read_status)
from switchyard.proto.status import Histogram as HistogramStatus  # prometheus has a Histogram

PEER_ROLES = (ROLE_GATEWAY, ROLE_WORKER, ROLE_KVSTORE)
HTTP_BUCKETS_S = (0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 10.0, 30.0, 120.0, 600.0)
OTHER_ENDPOINT = "other"
# Methods outside this set count as "other": the label set stays bounded whatever a client
# sends (the method is counted before authentication).
KNOWN_METHODS = ("GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE")


# -- status.json -> metric families (pure) -------------------------------------------------------

def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(kind, name: str, doc: str, label: str,
              values: Iterable[tuple[str, float]]) -> Metric:
    family = kind(name, doc, labels=[label])
    for key, value in values:
        family.add_metric([str(key)], value)
    return family


def _histogram(name: str, doc: str, snap: HistogramStatus) -> HistogramMetricFamily:
    """From a scheduler histogram snapshot: bounds, per-bucket counts (last: above all)."""
    buckets, running = [], 0
    for bound, count in zip(snap.bounds, snap.counts):
        running += count
        buckets.append((repr(float(bound)), running))
    buckets.append(("+Inf", sum(snap.counts)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snap.sum)


def status_families(status: Status | None, now: float) -> list[Metric]:
    """Every metric that status.json gives; only `switchyard_status_up` when there is none."""
    families: list[Metric] = [_gauge(
        "switchyard_status_up", "1 when the scheduler's status.json could be read",
        0 if status is None else 1)]
    if status is None:
        return families
    families += [
        _gauge("switchyard_status_age_seconds", "age of the scheduler's status snapshot",
               max(0.0, now - status.at)),
        _gauge("switchyard_scheduler_start_time_seconds",
               "when the scheduler started (unix time); changes when it restarts",
               status.started_at),
        _labelled(GaugeMetricFamily, "switchyard_component_ready",
                  "1 when the scheduler has a ready worker / kvstore", "component",
                  [("worker", int(status.worker_ready)),
                   ("kvstore", int(status.kvstore_ready))]),
    ]
    families += _slot_families(status)
    families += _disk_families(status.disk)
    families += _kv_memory_families(status.kv_memory)
    families += _peer_families(status)
    families += _stats_families(status.stats)
    return families


def _peer_families(status: Status) -> list[Metric]:
    """Pages from the --peer servers (docs/design/kv-pages.md "Pages from a peer")."""
    if not status.peer_servers:
        return []
    peers = status.peer_servers
    return [_labelled(CounterMetricFamily, name, doc, "peer", [(p.url, value(p)) for p in peers])
            for name, doc, value in (
                ("switchyard_peer_pages", "KV pages fetched from a peer server",
                 lambda p: p.num_pages),
                ("switchyard_peer_bytes", "bytes of KV pages fetched from a peer server",
                 lambda p: p.num_bytes),
                ("switchyard_peer_fetch_seconds", "seconds spent waiting for a peer's pages",
                 lambda p: p.fetch_s),
                ("switchyard_peer_fetch_failures", "asks a peer refused, failed or did not "
                 "answer within --peer-fetch-timeout-s", lambda p: p.num_failures))]


def _kv_memory_families(kv: KvMemoryStatus | None) -> list[Metric]:
    """The KV slots hold against the worker's budget (docs/design/kv-pages.md "Memory plan")."""
    if kv is None:
        return []
    return [
        _gauge("switchyard_kv_held_tokens", "KV the slots may hold this step, in tokens "
               "(running requests' growth reserves and the decode batch included)",
               kv.held_tokens),
        _gauge("switchyard_kv_budget_tokens", "the worker's KV budget, in tokens",
               kv.budget_tokens),
        CounterMetricFamily("switchyard_kv_memory_preemptions", "running requests staged to "
                            "disk because their KV outgrew the budget",
                            value=kv.num_preempted),
        CounterMetricFamily("switchyard_kv_slot_cuts", "idle slots cut for memory: their "
                            "leading pages kept, the rest left to disk", value=kv.num_cut),
        CounterMetricFamily("switchyard_kv_cut_kept_tokens", "tokens cut slots kept in memory "
                            "that a whole release would have sent to disk",
                            value=kv.cut_kept_tokens),
    ]


def _slot_families(status: Status) -> list[Metric]:
    slots, queue = status.slots, status.queue
    by_state = {state: 0 for state in SLOT_STATES}
    for slot in slots:
        by_state[slot.state] += 1
    by_priority = {p: 0 for p in PRIORITIES}
    for item in queue:
        by_priority[item.priority] = by_priority.get(item.priority, 0) + 1
    return [
        _gauge("switchyard_slots", "resident sequence slots", len(slots)),
        _labelled(GaugeMetricFamily, "switchyard_slots_by_state",
                  "slots by what they are doing", "state", by_state.items()),
        _labelled(GaugeMetricFamily, "switchyard_slot_tokens",
                  "tokens whose KV each slot holds", "slot",
                  [(s.slot, s.num_tokens) for s in slots]),
        _labelled(GaugeMetricFamily, "switchyard_queue_depth",
                  "requests waiting for a slot, by priority", "priority", by_priority.items()),
        _gauge("switchyard_queue_oldest_wait_seconds", "how long the oldest waiting request "
               "has waited", max((q.waiting_s for q in queue), default=0.0)),
        _gauge("switchyard_oldest_waiting_seconds", "age of the oldest request without its "
               "first token yet (queued, restoring or prefilling)", status.oldest_waiting_s),
    ]


def _disk_families(disk: DiskStatus) -> list[Metric]:
    return [
        _gauge("switchyard_kv_disk_bytes", "bytes of KV page files on disk", disk.bytes),
        _gauge("switchyard_kv_disk_budget_bytes", "the KV disk budget (--kv-disk-budget)",
               disk.budget_bytes),
        _gauge("switchyard_kv_disk_pages", "KV pages on disk", disk.num_pages),
        _gauge("switchyard_kv_pages_writing", "KV pages being written", disk.num_writing),
        _gauge("switchyard_kv_disk_writable", "0 while page writes are paused (disk errors)",
               int(disk.writable)),
        CounterMetricFamily("switchyard_kv_evicted_pages", "KV pages evicted from disk",
                            value=disk.num_evicted),
        CounterMetricFamily("switchyard_kv_thrash_events", "evictions that had to take pages "
                            "of recently active conversations (budget too small)",
                            value=disk.num_thrash),
    ]


def _stats_families(stats: Stats) -> list[Metric]:
    restarts = stats.restarts
    return [
        _labelled(CounterMetricFamily, "switchyard_requests_finished",
                  "requests finished, by finish reason", "reason",
                  sorted(stats.requests_finished.items())),
        _labelled(CounterMetricFamily, "switchyard_requests_failed",
                  "requests failed, by error code", "code",
                  sorted(stats.requests_failed.items())),
        _labelled(CounterMetricFamily, "switchyard_tokens",
                  "tokens of finished requests: prompt; its KV reused in the slot, copied "
                  "from another slot, restored from disk or prefilled; generated", "kind",
                  [(kind, getattr(stats.tokens, kind)) for kind in TOKEN_KINDS]),
        CounterMetricFamily("switchyard_steps", "worker steps run", value=stats.num_steps),
        _labelled(CounterMetricFamily, "switchyard_speculative_tokens",
                  "draft tokens of finished requests (speculative decoding): proposed and "
                  "verified, and accepted", "kind",
                  [("proposed", stats.tokens.draft_proposed),
                   ("accepted", stats.tokens.draft_accepted)]),
        _labelled(CounterMetricFamily, "switchyard_component_restarts",
                  "restarts of a component the scheduler saw (a new boot id)", "component",
                  [(role, restarts.get(role, 0)) for role in
                   (*PEER_ROLES, *sorted(set(restarts) - set(PEER_ROLES)))]),
        _histogram("switchyard_ttft_seconds", "time to first token, arrival to first token",
                   stats.ttft),
        _histogram("switchyard_step_seconds", "duration of one worker step", stats.step_time),
    ]


class StatusCollector(Collector):
    """Reads status.json on every scrape."""

    def __init__(self, read: Callable[[], Status | None],
                 clock: Callable[[], float] = time.time) -> None:
        self.read = read
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield from status_families(self.read(), self.clock())


# -- the gateway's own counters -------------------------------------------------------------

class _Collected(Collector):
    """Metric families collected already (one scrape's)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class GatewayMetrics:
    def __init__(self, read_status: Callable[[], Status | None]) -> None:
        self.read_status = read_status
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("switchyard_http_requests", "HTTP requests the gateway "
                                "answered, by method, endpoint and status",
                                ["method", "endpoint", "status"], registry=self.registry)
        self.duration = Histogram("switchyard_http_request_duration_seconds",
                                  "HTTP request durations (streams: until their end)",
                                  ["endpoint"], buckets=HTTP_BUCKETS_S, registry=self.registry)
        self.registry.register(StatusCollector(read_status))

    def observe(self, method: str, endpoint: str, status: int, duration_s: float) -> None:
        method = method if method in KNOWN_METHODS else OTHER_ENDPOINT
        self.requests.labels(method, endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(duration_s)

    def request_counts(self) -> list[dict]:
        """The HTTP request counters as plain rows (for the status endpoint)."""
        rows = []
        for metric in self.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    rows.append({**sample.labels, "count": int(sample.value)})
        return rows

    def exposition(self, view: Callable[[Status], Status] | None = None) -> bytes:
        """The text of a scrape; `view` cuts the status document for the scraping key."""
        if view is None:
            return generate_latest(self.registry)
        scoped = CollectorRegistry(auto_describe=False)
        scoped.register(_Collected([*self.requests.collect(), *self.duration.collect()]))

        def read() -> Status | None:
            status = self.read_status()
            return None if status is None else view(status)

        scoped.register(StatusCollector(read))
        return generate_latest(scoped)


def endpoint_of(scope: Scope, routes: Iterable) -> str:
    """The path template of the route that serves `scope` (bounded label values)."""
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return getattr(route, "path", OTHER_ENDPOINT)
    return OTHER_ENDPOINT


class RequestMetricsMiddleware:
    """Counts every HTTP request once, with the status its `request.finished` line logs."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        sent: list[int] = []

        async def note(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, note)
        finally:
            record = scope.get(RECORD_SCOPE_KEY)
            status = getattr(record, "status", None) or (sent[0] if sent else 500)
            app = scope.get("app")
            endpoint = endpoint_of(scope, app.routes if app is not None else ())
            self.metrics.observe(scope["method"], endpoint, status,
                                 time.monotonic() - started)


# -- the route ------------------------------------------------------------------------------

def key_tenant(headers, tenants: Tenants) -> Tenant | None:
    """Whose key the request gives (Bearer or x-api-key), as /v1 reads it; None: no key."""
    given = headers.get("x-api-key", "")
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    return tenants.match(given)


def authorized(headers, tenants: Tenants) -> bool:
    """The API key check of /v1, for routes outside it: any tenant's key (each is shown what
    gateway/tenant_view.py lets it see)."""
    return not tenants or key_tenant(headers, tenants) is not None


def unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "Incorrect or missing API key",
                                   "type": "authentication_error", "param": None,
                                   "code": "invalid_api_key"}}, status_code=401)


def mount(app: Starlette, settings: Settings, tenants: Tenants | None = None) -> GatewayMetrics:
    """Add GET /metrics and the request counting middleware to `app` (before it starts)."""
    if tenants is None:
        tenants = Tenants.from_settings(settings.api_key, settings.shared_prefix_tenants)
    status_file = Endpoints(settings.runtime_path).status_file
    metrics = GatewayMetrics(lambda: read_status(status_file))

    async def scrape(request: Request) -> Response:
        if not authorized(request.headers, tenants):
            return unauthorized()
        viewer = key_tenant(request.headers, tenants) if tenants else None
        view = None if tenants.sees_all(viewer) else (
            lambda status: status_for(status, viewer, tenants))
        return Response(metrics.exposition(view), media_type=CONTENT_TYPE_LATEST)

    app.router.routes.append(Route("/metrics", scrape, methods=["GET"]))
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.state.metrics = metrics
    return metrics
