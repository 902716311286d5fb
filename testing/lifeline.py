"""A test-only lifeline: the groups a test process starts die with it, however it dies.

A supervisor outlives whoever started it (right for users), so a test process killed with
SIGKILL (a CI timeout, kill -9, the OOM killer) would leave its groups running under PID 1.
The first `hold` in a process starts one small watcher process (`python -m
switchyard.testing.lifeline`, in a session of its own so a signal to the test's process group does
not reach it). The test process tells it over a pipe which groups it holds and releases. The
watcher waits for the test process to die: a pidfd of it turns readable (Linux), or the pipe,
whose write end only the test process holds, reads EOF. It then stops every group still held
the way `ServerGroup.stop` does: SIGTERM to the supervisor (and SIGCONT to its group), then,
after the group's grace period, SIGKILL to every pid file's process and the whole process
group; removes the group's shared-memory segments and its temp dirs, and exits. When the test process exits having stopped
its groups, the watcher exits at once (docs/design.md "Code conventions", Tests).
(deploy/lifeline.py ties a component to its supervisor; this ties a group to its test.)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path



# -- the test process's side ------------------------------------------------------------------


class Lifeline:
    """The test process's end: one watcher, a pipe to it, the groups it holds."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.held: dict[int, dict] = {}  # supervisor pid -> its hold message
        self._write_end = -1
        self._spawn()
        atexit.register(self.close)

    def hold(self, supervisor_pid: int, runtime_dir: Path, grace_s: float,
             remove: list[Path]) -> None:
        """Stop this group (grace_s between SIGTERM and SIGKILL; then delete `remove`) if
        this process dies before `release`."""
        message = {"hold": supervisor_pid, "runtime_dir": str(runtime_dir),
                   "grace_s": grace_s, "remove": [str(p) for p in remove]}
        self.held[supervisor_pid] = message
        self._send(message)

    def release(self, supervisor_pid: int) -> None:
        if self.held.pop(supervisor_pid, None) is not None:
            self._send({"release": supervisor_pid})

    def close(self) -> None:
        """At exit: EOF tells the watcher; it exits at once when nothing is held (waited for
        here, so it is reaped), else it stops what is held by itself."""
        if self._write_end < 0 or os.getpid() != self.owner:
            return
        os.close(self._write_end)
        self._write_end = -1
        if not self.held:
            try:
                self.watcher.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, message: dict) -> None:
        try:
            os.write(self._write_end, (json.dumps(message) + "\n").encode())
        except BrokenPipeError:  # the watcher was killed: a new one, told all that is held
            os.close(self._write_end)
            self._spawn()
            for held in self.held.values():
                os.write(self._write_end, (json.dumps(held) + "\n").encode())

    def _spawn(self) -> None:
        read_end, self._write_end = os.pipe()  # both non-inheritable (PEP 446)
        pidfd = _own_pidfd()
        pass_fds = [read_end] if pidfd is None else [read_end, pidfd]
        try:
            # stdout/stderr to /dev/null: a watcher holding an inherited pipe would keep a
            # caller's communicate() waiting after the test process is gone.
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "switchyard.testing.lifeline", str(read_end),
                 str(-1 if pidfd is None else pidfd)],
                pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read_end)
            if pidfd is not None:
                os.close(pidfd)


_lifeline: Lifeline | None = None
_lifeline_lock = threading.Lock()


def lifeline() -> Lifeline:
    """This process's lifeline (a forked child gets its own: its parent's may die first)."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None or _lifeline.owner != os.getpid():
            _lifeline = Lifeline()
        return _lifeline


def _own_pidfd() -> int | None:
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):  # not Linux >= 5.3: the pipe's EOF alone tells
        return None


# -- the watcher ------------------------------------------------------------------------------


def watch(read_end: int, pidfd: int) -> dict[int, dict]:
    """Read hold/release messages until the test process is gone; return what it held."""
    held: dict[int, dict] = {}
    poller = select.poll()
    poller.register(read_end, select.POLLIN)
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    pending = b""
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if pidfd in ready:  # gone: read what it sent, without waiting for EOF (a forked
            os.set_blocking(read_end, False)  # child of it may still hold the write end)
        try:
            data = os.read(read_end, 1 << 16)
        except BlockingIOError:
            data = b""
        if not data:  # EOF, or gone and every message read
            return held
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "hold" in message:
                held[message["hold"]] = message
            else:
                held.pop(message["release"], None)


# After SIGKILL, how long to wait for the group to be reaped (a PID 1 that never reaps
# would keep zombies in the group for ever).
REAP_WAIT_S = 10.0


def stop_groups(groups: dict[int, dict]) -> None:
    """SIGTERM each supervisor; SIGKILL what is left after its grace period; clean up."""
    for pgid in groups:
        _terminate(pgid)
    now = time.monotonic()
    deadline = {pgid: now + group["grace_s"] for pgid, group in groups.items()}
    killed: set[int] = set()
    waiting = [pgid for pgid in groups if _group_alive(pgid)]
    while waiting:
        time.sleep(0.1)
        now = time.monotonic()
        for pgid in waiting:
            if now >= deadline[pgid] and pgid not in killed:
                _kill_group(pgid, Path(groups[pgid]["runtime_dir"]))
                killed.add(pgid)
                deadline[pgid] = now + REAP_WAIT_S
        waiting = [pgid for pgid in waiting
                   if _group_alive(pgid) and not (pgid in killed and now >= deadline[pgid])]
    for group in groups.values():
        _remove_segments(Path(group["runtime_dir"]))
        for path in group["remove"]:
            shutil.rmtree(path, ignore_errors=True)


def _terminate(pgid: int) -> None:
    """SIGTERM the leader; SIGCONT the group (a member a test had stopped, like the soak's
    paused kvstore, could not act on its SIGTERM)."""
    try:
        if os.getpgid(pgid) == pgid:  # still the group's leader, not a reused pid
            os.kill(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_group(pgid: int, runtime_dir: Path) -> None:
    """SIGKILL every pid file's process that is still in the group, then the whole group."""
    from switchyard.deploy.runtime import read_pid_file

    for path in runtime_dir.glob("*.pid"):
        pid = read_pid_file(path)
        try:
            if pid is not None and os.getpgid(pid) == pgid:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_segments(runtime_dir: Path) -> None:
    """A worker stopped by SIGKILL leaves its segments behind (a clean stop unlinks them)."""
    from switchyard.common.endpoints import Endpoints
    from switchyard.proto.shm import remove_stale_segments

    endpoints = Endpoints(runtime_dir)
    remove_stale_segments(endpoints.shm_prefix, endpoints.shm_record)


def main() -> None:
    held = watch(int(sys.argv[1]), int(sys.argv[2]))
    if held:
        stop_groups(held)


if __name__ == "__main__":
    main()
