"""bench/soak.py's fault injector: every --fault-min..--fault-max seconds (seeded) a component
killed (-9), a page file corrupted, the page directories made unwritable (chattr +i) or the
page disk filled.

Not a benchmark itself: bench/soak.py runs it beside the agents of the faulted run.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import wait_ready

KILL_ROLES = ("gateway", "scheduler", "worker", "kvstore")


@dataclass
class Fault:
    kind: str
    detail: str
    started: float
    ended: float = 0.0


class Injector(threading.Thread):
    def __init__(self, group: ServerGroup, kv_dir: Path, rng: random.Random, args,
                 deadline: float, tmpfs: bool):
        super().__init__(daemon=True, name="injector")
        self.group, self.kv_dir, self.rng, self.args = group, kv_dir, rng, args
        self.deadline, self.tmpfs = deadline, tmpfs
        self.t0 = time.monotonic()
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.kinds = [k for k in ["kill", "kill", "kill", "corrupt", "readonly", "disk_full"]
                      if k in args.faults.split(",") and (k != "disk_full" or tmpfs)]
        self.roles = [r for r in KILL_ROLES if r in args.kill_roles.split(",")]

    def run(self) -> None:
        while not self.stop.is_set():
            wait = self.rng.uniform(self.args.fault_min, self.args.fault_max)
            if time.monotonic() + wait > self.deadline - 10 or self.stop.wait(wait):
                return
            kind = self.rng.choice(self.kinds)
            fault = Fault(kind, "", time.monotonic())
            try:
                getattr(self, f"_{kind}")(fault)
            except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            fault.ended = time.monotonic()
            self.faults.append(fault)
            print(f"  fault {fault.kind} {fault.detail} at {fault.started - self.t0:.0f}s "
                  f"({fault.ended - fault.started:.1f}s)",
                  flush=True)

    def _kill(self, fault: Fault) -> None:
        role = self.rng.choice(self.roles)
        fault.kind = f"kill {role}"
        old = self.group.kill(role)
        new = self.group.wait_restarted(role, old)
        wait_ready(self.group, role, new)
        fault.detail = f"pid {old} -> {new}"

    def _corrupt(self, fault: Fault) -> None:
        pages = sorted(self.kv_dir.rglob("*.page"))
        if not pages:
            fault.detail = "no page yet"
            return
        path = self.rng.choice(pages)
        # In place, never O_CREAT: a page evicted meanwhile must not come back as a file
        # nothing accounts for (it would count against the budget in the disk samples).
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fault.detail = "page evicted meanwhile"
            return
        try:
            at = os.fstat(fd).st_size - 100
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
        finally:
            os.close(fd)
        fault.detail = path.name[:12]

    def _hold(self) -> None:
        self.stop.wait(self.rng.uniform(10, 25))

    def _readonly(self, fault: Fault) -> None:
        dirs = [str(self.kv_dir)] + [str(p) for p in self.kv_dir.rglob("*") if p.is_dir()]
        subprocess.run(["chattr", "+i", *dirs], check=True, capture_output=True)
        try:
            self._hold()
        finally:
            subprocess.run(["chattr", "-i", *dirs], check=True, capture_output=True)
        fault.detail = f"{len(dirs)} dirs"

    def _disk_full(self, fault: Fault) -> None:
        filler = self.kv_dir / "filler.bin"
        chunk = b"\0" * (1 << 20)
        written = 0
        try:
            with open(filler, "wb") as f:
                while True:
                    try:
                        f.write(chunk)
                        f.flush()
                        written += len(chunk)
                    except OSError:
                        break
            self._hold()
        finally:
            filler.unlink(missing_ok=True)
        fault.detail = f"{written >> 20} MiB filler"

