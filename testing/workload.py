"""Workload pieces shared by end-to-end tests and benchmarks: text of a given length,
and waiting until a (restarted) group is ready to serve."""

from __future__ import annotations

import json
import random
import time
import urllib.request

from switchyard.proto.status import read_status
from switchyard.testing.group import ServerGroup

WORDS = ("alpha beta gamma delta ledger invoice shipment crate harbor tide signal route "
         "switch yard engine cargo manifest weather north south east west river bridge "
         "customs tariff quay crane berth pilot tug anchor").split()


def text(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def wait_ready(group: ServerGroup, role: str | None = None, pid: int | None = None,
               timeout_s: float = 120.0) -> None:
    """The scheduler's status shows worker and kvstore ready and, after a restart of `role`,
    the new `pid` connected (so the restart is known, not just about to be noticed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(group.runtime_dir / "status.json")
        if status is None:
            seen = False
        elif role == "scheduler":
            seen = status.pid == pid
        elif role is not None:
            seen = role in status.peers and status.peers[role].pid == pid
        else:
            seen = True
        if seen and status.worker_ready and status.kvstore_ready:
            try:
                with urllib.request.urlopen(f"{group.url}/health", timeout=5) as resp:
                    if json.loads(resp.read()).get("status") == "ok":
                        return
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"group not ready\n{group.log_tail()}")


