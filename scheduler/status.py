"""The status snapshot the scheduler rewrites every heartbeat (runtime_dir/status.json).

Read by `switchyard status`, the gateway's /metrics and /dashboard: one JSON document, plain
data, no text of prompts or outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scheduler.fairness import oldest_waiting_s

STATUS_VERSION = 1


def build_status(service, now: float) -> dict:
    core = service.core
    pages = core.pages
    slots = []
    for slot in core.slots:
        req = core.requests.get(slot.rid) if slot.rid else None
        slots.append({
            "slot": slot.index, "num_tokens": len(slot.tokens),
            "conversation": slot.page_ids[0].hex()[:12] if slot.page_ids else None,
            "last_used": slot.last_used or None, "rid": slot.rid,
            "priority": req.priority if req else None,
            "state": _state(core, req) if req else "idle",
            "waiting_s": now - req.arrived_at if req and req.first_token_at is None else None})
    queue = [{"rid": rid, "priority": core.requests[rid].priority,
              "waiting_s": now - core.requests[rid].arrived_at,
              "prompt_tokens": len(core.requests[rid].prompt)} for rid in core.waiting]
    return {
        "version": STATUS_VERSION, "at": now, "boot_id": service.boot_id,
        "pid": os.getpid(), "started_at": service.started_at,
        "worker_ready": service.worker_ready, "kvstore_ready": service.kvstore_ready,
        "peers": {role: {"boot_id": boot, "pid": service.peer_pid.get(role),
                         "last_seen": service.last_seen.get(role)}
                  for role, boot in service.peer_boot.items()},
        "slots": slots, "queue": queue,
        # Queued, restoring or prefilling: what a starving request shows as (issue 14).
        "oldest_waiting_s": oldest_waiting_s(core.requests.values(), now),
        "disk": {"bytes": pages.tree.total_bytes, "budget_bytes": pages.budget_bytes,
                 "num_pages": len(pages.tree), "writable": now >= pages.writes_paused_until,
                 "num_evicted": pages.num_evicted, "num_thrash": pages.num_thrash,
                 "num_writing": len(pages.writing)},
        "stats": service.stats.snapshot(),
    }


def _state(core, req) -> str:
    if req.restoring:
        return "restoring"
    if len(req.feed) - 1 > len(core.slots[req.slot].tokens):
        return "prefilling"
    return "decoding"


def write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, separators=(",", ":")))
    os.replace(tmp, path)


def read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
