"""What a router in front of several servers reads (docs/operations.md "Behind a router (SMG)").

SMG (Shepherd Model Gateway, SGLang's router) and routers like it read three things:
- `GET /v1/loads`: SGLang's load report, which its load-aware policies and `cache_aware`'s
  balance check act on. Under /v1, so it needs an API key when one is set (any tenant's);
  it shows machine-wide counts only, never a request, a conversation or a tenant's own figures.
- `GET /server_info` and `GET /model_info` (and their older `/get_` names): SGLang's discovery,
  from which the router learns the model's name (`served_model_name`: the name it routes by),
  its context window and how many requests run at once. Outside /v1, like /health: they say
  nothing /health and /v1/models do not already say, and never a filesystem path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from switchyard.gateway.context import Gateway, gateway_of
from switchyard.common.endpoints import Endpoints
from switchyard.proto.status import Status, read_status

LOADS_PATH = "/v1/loads"
THROUGHPUT_WINDOW_S = 10.0  # generated tokens per second over about this long


def server_version() -> str:
    try:
        return version("switchyard")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0"


@dataclass
class Throughput:
    """Generated tokens per second, from the status document's running total: the rate since a
    sample about THROUGHPUT_WINDOW_S old (a router polls every few seconds; the first poll
    and a restarted scheduler, whose total starts again, read 0)."""

    at: float = 0.0
    generated: int = 0
    rate: float = 0.0

    def update(self, now: float, generated: int) -> float:
        if generated < self.generated or self.at == 0.0:
            self.at, self.generated, self.rate = now, generated, 0.0
        elif now - self.at >= THROUGHPUT_WINDOW_S:
            self.rate = (generated - self.generated) / (now - self.at)
            self.at, self.generated = now, generated
        return self.rate


def max_running(gw: Gateway, status: Status | None) -> int:
    """Requests run at once: the worker's slots as the status lists them (--max-running 0
    lets the worker choose), else what the settings say."""
    listed = len(status.slots) if status is not None else 0
    return max(listed, gw.settings.worker_slots)


def load_snapshot(gw: Gateway, status: Status | None, throughput: Throughput,
                  now: float) -> dict[str, Any]:
    """One rank's load in SGLang's shape (SMG's `SchedulerLoadSnapshot`): the queue from the
    scheduler's heartbeat (GroupState), KV tokens and cache hits from its status document."""
    state = gw.client.status()
    used = budget = held = 0
    hit_rate = rate = 0.0
    if status is not None:
        if status.kv_memory is not None:
            used, held = status.kv_memory.num_tokens, status.kv_memory.held_tokens
            budget = status.kv_memory.budget_tokens
        tokens = status.stats.tokens
        if tokens.prompt:
            hit_rate = (tokens.reused + tokens.copied + tokens.restored) / tokens.prompt
        rate = throughput.update(now, tokens.generated)
    slots = max_running(gw, status)
    return {
        "dp_rank": 0,
        "num_running_reqs": state.num_running,
        "num_waiting_reqs": state.num_waiting,
        "num_total_reqs": state.num_running + state.num_waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": budget,
        # What the running and resident slots hold against the memory budget, reserves
        # for growth included: the memory pressure a router should balance on.
        "token_usage": round(min(1.0, held / budget), 4) if budget else 0.0,
        "gen_throughput": round(rate, 2),
        "cache_hit_rate": round(min(1.0, hit_rate), 4),
        "utilization": round(min(1.0, state.num_running / slots), 4) if slots else 0.0,
        "max_running_requests": slots,
    }


def server_info(gw: Gateway) -> dict[str, Any]:
    """SGLang's /server_info, the members SMG reads. `model_path` is the served name, never
    the path the server loaded the model from."""
    status = read_status(Endpoints(gw.settings.runtime_path).status_file)
    budget = status.kv_memory.budget_tokens if status and status.kv_memory else None
    return {
        "model_path": gw.model_id, "served_model_name": gw.model_id,
        "served_model_names": [gw.model_id, *gw.model_aliases],
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "is_embedding": False,
        "context_length": gw.settings.ctx, "max_total_tokens": budget,
        "max_running_requests": max_running(gw, status),
        "version": server_version(),
    }


def model_info(gw: Gateway) -> dict[str, Any]:
    """SGLang's /model_info, the members SMG reads."""
    return {"model_path": gw.model_id, "tokenizer_path": gw.model_id, "is_generation": True,
            "has_image_understanding": gw.images is not None}


def mount(app: Starlette) -> None:
    """Add GET /v1/loads, /server_info and /model_info (and their /get_ names) to `app`."""
    throughput = Throughput()

    async def loads(request: Request) -> Response:
        gw = gateway_of(request)
        now = time.time()
        status = read_status(Endpoints(gw.settings.runtime_path).status_file)
        return JSONResponse({
            "timestamp": datetime.fromtimestamp(now, timezone.utc).isoformat(),
            "version": server_version(), "dp_rank_count": 1,
            "loads": [load_snapshot(gw, status, throughput, now)],
        }, headers={"Cache-Control": "no-store"})

    async def get_server_info(request: Request) -> Response:
        return JSONResponse(server_info(gateway_of(request)))

    async def get_model_info(request: Request) -> Response:
        return JSONResponse(model_info(gateway_of(request)))

    app.router.routes.extend([
        Route(LOADS_PATH, loads, methods=["GET"]),
        *(Route(path, get_server_info, methods=["GET"])
          for path in ("/server_info", "/get_server_info")),
        *(Route(path, get_model_info, methods=["GET"])
          for path in ("/model_info", "/get_model_info")),
    ])
