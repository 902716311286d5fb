"""`ServerGroup`: one whole Switchyard process group for a test, cleaned up without orphans.

    with ServerGroup(model_dir, slots=4, ctx=4096) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        ...
        old = group.kill("worker", signal.SIGKILL)
        group.wait_restarted("worker", old)

It picks a free port and a short runtime dir (ipc paths must stay under 100 bytes), starts
`python -m switchyard.deploy.cli serve --model M --port P --runtime-dir R --kv-dir K --slots N --ctx C
--log-format json ...extra` in a new session (so its process group is its own) with stdout and
stderr going to a log file, and waits for `GET /health` to answer 200. On exit it SIGTERMs the
supervisor and asserts that every component pid it saw is gone and no process is left in the
group. Processes are found only through the group's pid files and process-group membership.
Until then the group hangs on this process's lifeline (testing/lifeline.py): if this
process dies first, however it dies, a watcher stops the group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from switchyard.deploy.runtime import pid_alive, read_pid_file, wait_gone
from switchyard.deploy.supervisor import ROLES
from switchyard.testing.lifeline import lifeline

SERVE = ("switchyard.deploy.cli", "serve")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 free (a 2-rank worker group's ring listens on one per rank)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def short_tmp_dir(prefix: str = "sy") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def group_members(pgid: int) -> list[int]:
    """Pids of live processes in process group `pgid` (Linux: /proc; elsewhere: ps)."""
    if sys.platform.startswith("linux"):
        members = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members.append(int(entry.name))
        return members
    out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True, text=True)
    return [int(pid) for pid, group, state in (line.split()[:3] for line in out.stdout.splitlines())
            if int(group) == pgid and not state.startswith("Z")]


class ServerGroup:
    def __init__(self, model: str | Path | None, *, slots: int = 4, ctx: int = 4096,
                 extra: tuple[str, ...] | list[str] = (), port: int | None = None,
                 runtime_dir: str | Path | None = None, kv_dir: str | Path | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 120.0,
                 stop_timeout_s: float = 60.0, entry: tuple[str, ...] = SERVE,
                 wait_for: str = "health", extra_roles: tuple[str, ...] = ()) -> None:
        """`model` None: no --model (the default model, fetched into the user's cache dir);
        `entry`: the module (and subcommand) run with `python -m`; `wait_for`: "health"
        (GET /health, then every pid file), "pids" (every pid file) or "none"."""
        self.model = str(model) if model is not None else ""
        self.port = port or free_port()
        self._own_runtime_dir = runtime_dir is None
        self._own_kv_dir = kv_dir is None
        self.runtime_dir = Path(runtime_dir) if runtime_dir else short_tmp_dir("sy")
        self.kv_dir = Path(kv_dir) if kv_dir else short_tmp_dir("sykv")
        self.log_path = self.runtime_dir / "group.log"
        self.args = [*(("--model", self.model) if model is not None else ()),
                     "--port", str(self.port),
                     "--runtime-dir", str(self.runtime_dir), "--kv-dir", str(self.kv_dir),
                     "--slots", str(slots), "--ctx", str(ctx), "--log-format", "json",
                     # As many run at once as stay resident, unless a test says otherwise:
                     # tests of queueing and preemption need the contention of --slots.
                     *(() if "--max-running" in extra else ("--max-running", str(slots))),
                     *extra]
        self.entry = entry
        self.wait_for = wait_for
        self.roles = (*ROLES, *extra_roles)  # a worker group's "worker.1", ...
        self.env = env or {}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.seen_pids: set[int] = set()
        self.exit_code: int | None = None

    # -- addresses and logs ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Root of the HTTP server (anthropic clients take this as base_url)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI-style base URL: `openai.OpenAI(base_url=group.base_url, api_key="none")`."""
        return f"{self.url}/v1"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_lines: int = 60) -> str:
        """The log's last lines, each request's line left out: under traffic they would
        hide the component exits and tracebacks a failure message is for."""
        lines = [line for line in self.log_text().splitlines()
                 if '"event": "request.finished"' not in line]
        return "\n".join(lines[-num_lines:])

    def log_events(self, event: str | None = None) -> list[dict]:
        """JSON log lines (other lines, like the start banner, are skipped)."""
        events = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if event is None or record.get("event") == event:
                    events.append(record)
        return events

    def wait_events(self, event: str, at_least: int = 1, timeout_s: float = 30.0,
                    **fields) -> list[dict]:
        """The `event` lines whose fields equal `fields`, once there are `at_least` of them
        (or whatever there is after `timeout_s`). A service logs a request just after its
        reply, and the log reaches the file through the supervisor, so a test that has its
        reply may not have the line yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.log_events(event)
                     if all(e.get(k) == v for k, v in fields.items())]
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    # -- processes ---------------------------------------------------------------------------

    @property
    def supervisor_pid(self) -> int:
        assert self.proc is not None, "group not started"
        return self.proc.pid

    def pid_of(self, role: str) -> int:
        """The pid in `<runtime dir>/<role>.pid`, checked to be a live member of this group."""
        pid = read_pid_file(self.runtime_dir / f"{role}.pid")
        if pid is None:
            raise LookupError(f"no pid file for {role} in {self.runtime_dir}")
        if not pid_alive(pid) or os.getpgid(pid) != self.supervisor_pid:
            raise LookupError(f"{role} pid {pid} is not a live member of this group")
        self.seen_pids.add(pid)
        return pid

    def kill(self, role: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pid_of(role)
        os.kill(pid, sig)
        return pid

    def wait_restarted(self, role: str, old_pid: int, timeout_s: float = 60.0) -> int:
        """Wait for the supervisor to replace `old_pid`; return the new pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_running()
            try:
                pid = self.pid_of(role)
            except (LookupError, ProcessLookupError):
                pid = None
            if pid is not None and pid != old_pid:
                return pid
            time.sleep(0.05)
        raise AssertionError(f"{role} was not restarted within {timeout_s}s\n{self.log_tail()}")

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            self._check_running()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"GET {self.url}/health not 200 within "
                             f"{timeout_s or self.startup_timeout_s}s\n{self.log_tail()}")

    def wait_components(self, timeout_s: float | None = None) -> dict[str, int]:
        """Wait until every role has a pid file naming a live member of the group."""
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            self._check_running()
            try:
                return {role: self.pid_of(role) for role in self.roles}
            except (LookupError, ProcessLookupError):
                time.sleep(0.05)
        raise AssertionError(f"components did not all start\n{self.log_tail()}")

    # -- lifetime ----------------------------------------------------------------------------

    def start(self) -> "ServerGroup":
        env = dict(os.environ) | self.env
        cmd = [sys.executable, "-m", *self.entry, *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            owned = [d for d, own in ((self.runtime_dir, self._own_runtime_dir),
                                      (self.kv_dir, self._own_kv_dir)) if own]
            lifeline().hold(self.proc.pid, self.runtime_dir, self.stop_timeout_s, owned)
            if self.wait_for == "health":
                self.wait_healthy()
            if self.wait_for in ("health", "pids"):
                self.wait_components()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def stop(self, check: bool = True) -> None:
        """SIGTERM the supervisor; assert it exits 0 and leaves no process behind."""
        self.begin_stop()
        self.finish_stop(check)

    def begin_stop(self) -> None:
        """SIGTERM the supervisor (several groups stop at once: stop_all), having noted every
        component's pid to check that it is gone."""
        if self.proc is None:
            return
        for role in self.roles:
            try:
                self.pid_of(role)
            except (LookupError, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finish_stop(self, check: bool = True) -> None:
        """After begin_stop: wait for the supervisor; assert it exited 0 and left nothing."""
        if self.proc is None:
            return
        problems = []
        if self.proc.poll() is None:
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                problems.append(f"supervisor did not exit within {self.stop_timeout_s}s")
                self._kill_group()
        self.exit_code = self.proc.returncode
        if self.exit_code != 0:
            problems.append(f"supervisor exit code {self.exit_code}")
        left = wait_gone(sorted(self.seen_pids), 10.0)
        if left:
            problems.append(f"component pids still alive: {left}")
        members = group_members(self.proc.pid)
        if members:
            problems.append(f"processes left in the group: {members}")
            self._kill_group()
        pid_files = sorted(p.name for p in self.runtime_dir.glob("*.pid"))
        if pid_files:
            problems.append(f"pid files left: {pid_files}")
        log_tail = self.log_tail()
        lifeline().release(self.proc.pid)
        self.proc = None
        if problems and check:
            raise AssertionError("; ".join(problems) + f"\n{log_tail}")
        self._cleanup()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group is ours: start_new_session
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {self.proc.returncode}\n"
                                 f"{self.log_tail()}")

    def _cleanup(self) -> None:
        if self._own_kv_dir:
            shutil.rmtree(self.kv_dir, ignore_errors=True)
        if self._own_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> "ServerGroup":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def peer_pair(model: str | Path, *, slots: int = 2, ctx: int = 2048,
              extra: tuple[str, ...] = ()) -> list[ServerGroup]:
    """Two groups (not started) on free ports, each the other's `--peer`
    (docs/design/kv-pages.md "Pages from a peer"), both with `extra`."""
    ports = [free_port(), free_port()]
    return [ServerGroup(model, slots=slots, ctx=ctx, port=port,
                        extra=(*extra, "--peer", f"http://127.0.0.1:{other}"))
            for port, other in zip(ports, reversed(ports))]


def start_all(groups) -> None:
    """Start every group side by side (each start is mostly waiting); raise the first error
    once all tried."""
    import threading

    errors: list[BaseException] = []

    def start(group: ServerGroup) -> None:
        try:
            group.start()
        except BaseException as exc:  # noqa: BLE001 - reported below, after all tried
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(g,)) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def stop_all(groups) -> None:
    """Stop every group, then report every group that did not stop cleanly (one failing stop
    must not leave the others running)."""
    groups = list(groups)
    for group in groups:
        group.begin_stop()
    errors = []
    for group in groups:
        try:
            group.finish_stop()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, "\n".join(errors)
