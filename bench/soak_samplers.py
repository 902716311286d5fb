"""bench/soak.py's samplers: page bytes on disk (kvstore paused for the walk) beside what the
scheduler counts, and the gateway's and scheduler's VmRSS, every 2 s; and the RSS growth
judged from them.

Not a benchmark itself: bench/soak.py runs the sampler over the faulted run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from switchyard.proto.status import DiskStatus, read_status
from switchyard.testing.group import ServerGroup


def page_bytes(kv_dir: Path) -> int:
    total = 0
    for path in kv_dir.rglob("*.page"):
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def page_bytes_at_one_instant(group: ServerGroup, kv_dir: Path) -> int:
    """Page bytes on disk as they were at one instant. Only kvstore writes or deletes page
    files, and it deletes what the scheduler evicts just before writing what made room for:
    a walk of the directory while it runs can count an evicted page and then the page written
    after it, one page more than was ever on disk (seen as +0.3-1.0 MB samples with the
    scheduler's own count under budget). So kvstore is stopped (SIGSTOP) for the walk, a
    few milliseconds; a rename is atomic, so it stops between whole pages."""
    try:
        pid = group.pid_of("kvstore")
    except (LookupError, ProcessLookupError, OSError):
        return page_bytes(kv_dir)  # restarting: it writes nothing until it has scanned
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return page_bytes(kv_dir)
    try:
        return page_bytes(kv_dir)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    def __init__(self, group: ServerGroup, kv_dir: Path):
        super().__init__(daemon=True, name="sampler")
        self.group, self.kv_dir = group, kv_dir
        self.disk: list[tuple[float, int]] = []
        # What the scheduler counts at each sample (status.json, written every few seconds):
        # tells an accounting error from files nothing accounts for.
        self.counted: list[DiskStatus | None] = []
        self.rss: dict[str, list[tuple[float, int, int]]] = {"gateway": [], "scheduler": []}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(2.0):
            now = time.monotonic()
            self.disk.append((now, page_bytes_at_one_instant(self.group, self.kv_dir)))
            status = read_status(self.group.runtime_dir / "status.json")
            self.counted.append(status.disk if status is not None else None)
            for role, samples in self.rss.items():
                try:
                    pid = self.group.pid_of(role)
                except (LookupError, ProcessLookupError, OSError):
                    continue
                kib = vm_rss_kib(pid)
                if kib:
                    samples.append((now, pid, kib))


WARM_UP_S = 30.0  # a process restarted in the second half is judged from this long after


def rss_growth(samples: list[tuple[float, int, int]], t0: float, t1: float):
    """Growth over the second half of [t0, t1], for the pid that lived longest in it. A pid
    first seen after the half began (killed and restarted there) is judged from WARM_UP_S
    after it was first seen: loading its tokenizer and first requests are not a leak."""
    mid = (t0 + t1) / 2
    first_seen: dict[int, float] = {}
    for t, pid, _ in samples:
        first_seen.setdefault(pid, t)
    by_pid: dict[int, list[int]] = {}
    for t, pid, kib in samples:
        start = mid if first_seen[pid] <= mid else first_seen[pid] + WARM_UP_S
        if t >= start:
            by_pid.setdefault(pid, []).append(kib)
    by_pid = {pid: series for pid, series in by_pid.items() if len(series) >= 4}
    if not by_pid:
        return None
    pid, series = max(by_pid.items(), key=lambda kv: len(kv[1]))
    # The median of the first and last few samples (allocator noise is not growth).
    k = max(1, min(3, len(series) // 4))
    first, last = sorted(series[:k])[k // 2], sorted(series[-k:])[k // 2]
    return pid, first, last, (last - first) / first, len(series)

