"""Workload pieces shared by end-to-end tests and benchmarks: text of a given length,
waiting until a (restarted) group is ready to serve, and until a turn's pages are on disk."""

from __future__ import annotations

import json
import random
import time
import urllib.request

from switchyard.proto.status import Status, read_status
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


def wait_written(group: ServerGroup, num_pages: int, replied_at: float,
                 timeout_s: float = 60.0) -> Status:
    """Until `group` has at least `num_pages` pages on disk and none on their way (a peer
    serves only pages on its disk; a turn's pages are written through just after its reply),
    as a status written after the reply at `replied_at` (time.time()) says: one from before it
    may show no write yet of the prompt's tail, which is staged after the first token.
    Returns that status."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = read_status(group.runtime_dir / "status.json")
        if status is not None and status.at > replied_at \
                and status.disk.num_pages >= num_pages and not status.disk.num_writing:
            return status
        assert time.monotonic() < deadline, status.disk if status else None
        time.sleep(0.1)
