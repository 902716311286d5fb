"""The status snapshot the scheduler rewrites every heartbeat (runtime_dir/status.json).

Read by `switchyard status`, the gateway's /metrics and /dashboard: one JSON document, plain
data, no text of prompts or outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATUS_VERSION = 1


def build_status(service, now: float) -> dict:
    snapshot = service.core.snapshot(now)
    return {
        "version": STATUS_VERSION, "at": now, "boot_id": service.boot_id,
        "pid": os.getpid(), "started_at": service.started_at,
        "worker_ready": service.worker_ready, "kvstore_ready": service.kvstore_ready,
        "peers": {role: {"boot_id": boot, "pid": service.peer_pid.get(role),
                         "last_seen": service.last_seen.get(role)}
                  for role, boot in service.peer_boot.items()},
        **snapshot,  # slots, queue, oldest_waiting_s, disk
        # A worker group: every rank, its pool and its kvstore (docs/design.md "Pages per rank").
        "ranks": service.stores.rank_status(now, service.last_seen,
                                            service.settings.peer_timeout_s),
        "stats": service.stats.snapshot(),
    }


def write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, separators=(",", ":")))
    os.replace(tmp, path)


def read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
