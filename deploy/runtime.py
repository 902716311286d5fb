"""Pid files and the claim on a runtime directory.

A group is found only through its runtime directory: `supervisor.pid` and one `<role>.pid` per
component (docs/design.md "Processes"). Nothing here looks processes up by name or command
line. One supervisor owns a runtime directory at a time: it holds an flock on `supervisor.lock`
(released by the kernel however the supervisor dies) and refuses to start while
`supervisor.pid` names a live process.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from switchyard.common.endpoints import Endpoints, ensure_runtime_dir

SUPERVISOR = "supervisor"


class GroupRunningError(RuntimeError):
    """Another group owns this runtime directory."""


def write_pid_file(path: Path, pid: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def read_pid_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def remove_pid_file(path: Path, pid: int) -> None:
    """Remove `path` if it still names `pid` (a newer owner's file is left alone)."""
    if read_pid_file(path) == pid:
        path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """True if `pid` is a running process (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"
    return True


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


class RuntimeDirClaim:
    """Exclusive ownership of a runtime directory by one supervisor process."""

    def __init__(self, endpoints: Endpoints, roles: tuple[str, ...],
                 stale_wait_s: float = 10.0) -> None:
        self.endpoints = endpoints
        self.roles = roles
        self.stale_wait_s = stale_wait_s
        self._lock_file = None

    @property
    def held(self) -> bool:
        return self._lock_file is not None

    def acquire(self) -> "RuntimeDirClaim":
        runtime_dir = ensure_runtime_dir(self.endpoints.runtime_dir)
        pid_file = self.endpoints.pid_file(SUPERVISOR)
        lock_file = open(runtime_dir / "supervisor.lock", "a+")
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise GroupRunningError(self._running_message(read_pid_file(pid_file))) from None
        try:
            other = read_pid_file(pid_file)
            if other is not None and other != os.getpid() and pid_alive(other):
                raise GroupRunningError(self._running_message(other) + (
                    f" If process {other} is not a Switchyard supervisor, delete {pid_file}."))
            self._check_stale_components()
            write_pid_file(pid_file, os.getpid())
        except BaseException:
            lock_file.close()
            raise
        self._lock_file = lock_file
        return self

    def release(self) -> None:
        if self._lock_file is None:
            return
        remove_pid_file(self.endpoints.pid_file(SUPERVISOR), os.getpid())
        self._lock_file.close()  # drops the flock
        self._lock_file = None

    def __enter__(self) -> "RuntimeDirClaim":
        return self if self.held else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _running_message(self, pid: int | None) -> str:
        who = f"supervisor pid {pid}" if pid else "its supervisor"
        return (f"another Switchyard group is running in {self.endpoints.runtime_dir} ({who}). "
                f"Stop it first (kill -TERM {pid or '<pid>'}), or give this one its own "
                f"--runtime-dir and --port.")

    def _check_stale_components(self) -> None:
        """Components of a group whose supervisor died exit on their own; wait for them."""
        stale = {}
        for role in self.roles:
            pid = read_pid_file(self.endpoints.pid_file(role))
            if pid is not None and pid != os.getpid() and pid_alive(pid):
                stale[pid] = role
        still = wait_gone(list(stale), self.stale_wait_s)
        if still:
            names = ", ".join(f"{stale[p]} pid {p}" for p in still)
            raise GroupRunningError(
                f"components of an earlier group in {self.endpoints.runtime_dir} are still "
                f"running ({names}). Stop them, or delete their pid files if those processes "
                f"are not Switchyard components.")
