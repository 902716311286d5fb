"""The process group: start the four components, restart the one that crashes, stop them all.

    supervisor = Supervisor(settings)        # settings fully resolved (model, directories)
    exit_code = supervisor.run()             # blocks until SIGTERM/SIGINT/SIGHUP, or give-up

Children start in order scheduler, kvstore, worker, gateway, each as
`python -m switchyard.deploy.cli run ROLE <settings flags>` (the command is injectable for tests); with
`--hostfile`, a worker rank per local hostfile entry (`worker.R`, deploy.group_roles), and the
local worker ranks are restarted together when one exits. Each
child's pid goes to `<runtime dir>/<role>.pid`, the supervisor's to `supervisor.pid`. A child
that exits on its own is restarted after a backoff (`RestartPolicy`); one that crashes too often
ends the group with exit code 1, one that refuses to start (exit code 2) with exit code 2. On a
stop signal the children get SIGTERM in reverse order, SIGKILL after `stop_timeout_s`, and the pid files are removed. Children know their supervisor by
SWITCHYARD_PARENT_PID and exit if it dies (deploy.lifeline). Only the supervisor's own child pids
are ever signalled. The API key reaches the gateway alone, in its environment
($SWITCHYARD_API_KEY), never on a command line (docs/design/security.md "Security").
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from switchyard.deploy.group_roles import restarted_together, split_role
from switchyard.deploy.lifeline import PARENT_ENV
from switchyard.deploy.restart_policy import GiveUp, RestartPolicy, RestartTracker
from switchyard.deploy.runtime import RuntimeDirClaim, remove_pid_file, write_pid_file
from switchyard.common.endpoints import Endpoints
from switchyard.common.settings import API_KEY_ENV, Settings

ROLES = ("scheduler", "kvstore", "worker", "gateway")  # start order; stop order is reversed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

CommandFor = Callable[[str, Settings], list[str]]


def component_command(role: str, settings: Settings) -> list[str]:
    """`run ROLE`; a worker group's `worker.R` (`kvstore.R`) runs `run worker (kvstore) --rank
    R`."""
    base, rank = split_role(role)
    if settings.hostfile:
        settings = dataclasses.replace(settings, rank=rank)
    return [sys.executable, "-m", "switchyard.deploy.cli", "run", base, *settings.to_args(base)]


def child_env(base: dict[str, str], role: str, settings: Settings) -> dict[str, str]:
    """`base` with the API key for the gateway and without it for everyone else."""
    env = {k: v for k, v in base.items() if k != API_KEY_ENV}
    if role == "gateway" and settings.api_key:
        env[API_KEY_ENV] = settings.api_key
    return env


@dataclass
class _Child:
    role: str
    tracker: RestartTracker
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    last_exit_code: int | None = None
    past_pids: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, settings: Settings, *, command_for: CommandFor = component_command,
                 roles: tuple[str, ...] = ROLES, policy: RestartPolicy = RestartPolicy(),
                 stop_timeout_s: float = 10.0, poll_s: float = 0.1,
                 claim: RuntimeDirClaim | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.endpoints = Endpoints(settings.runtime_path)
        self.command_for = command_for
        self.roles = roles
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self._claim = claim
        self._env = dict(os.environ if env is None else env) | {PARENT_ENV: str(os.getpid())}
        self._children = [_Child(role, RestartTracker(policy)) for role in roles]
        # A worker group's ranks on this machine: when one exits, the others' collectives
        # fail, so they are restarted together (docs/design/worker-groups.md "Worker groups").
        self._together = restarted_together(roles)
        self._stop_signal: int | None = None
        self._log = structlog.get_logger()

    # -- public ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the group until a stop signal (returns 0) or a give-up (returns 1, or 2 when a
        component refused to start: bad settings).

        Raises deploy.runtime.GroupRunningError if another group owns the runtime directory.
        """
        own_claim = self._claim is None
        claim = self._claim or RuntimeDirClaim(self.endpoints, self.roles).acquire()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for child in self._children:
                if self._stop_signal is None:
                    self._start(child)
            self._log.info("group.started", runtime_dir=str(self.endpoints.runtime_dir),
                           pids=self.pids())
            code = self._supervise()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if own_claim:
                claim.release()
        self._log.info("group.stopped", exit_code=code,
                       signal=signal.Signals(self._stop_signal).name if self._stop_signal else None)
        return code

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum

    def pids(self) -> dict[str, int]:
        return {c.role: c.proc.pid for c in self._children if c.proc is not None}

    # -- internals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame) -> None:
        self.request_stop(signum)

    def _start(self, child: _Child) -> None:
        cmd = self.command_for(child.role, self.settings)
        child.proc = subprocess.Popen(cmd, env=child_env(self._env, child.role, self.settings),
                                      stdin=subprocess.DEVNULL)
        child.started_at = time.monotonic()
        child.restart_at = None
        child.past_pids.append(child.proc.pid)
        write_pid_file(self.endpoints.pid_file(child.role), child.proc.pid)
        self._log.info("component.started", role=child.role, child_pid=child.proc.pid)

    def _supervise(self) -> int:
        while self._stop_signal is None:
            now = time.monotonic()
            for child in self._children:
                if child.proc is not None:
                    code = child.proc.poll()
                    if code is not None and self._stop_signal is None:
                        give_up = self._on_exit(child, code, now)
                        if give_up is not None:
                            return 2 if give_up.refused else 1
                elif child.restart_at is not None and now >= child.restart_at:
                    self._start(child)
                    self._log.warning("component.restarted", role=child.role,
                                      child_pid=child.proc.pid,
                                      exit_code=child.last_exit_code,
                                      num_restarts=child.tracker.num_restarts)
            time.sleep(self.poll_s)
        self._log.info("group.stopping", signal=signal.Signals(self._stop_signal).name)
        return 0

    def _on_exit(self, child: _Child, code: int, now: float) -> GiveUp | None:
        """Handle an unexpected exit: schedule a restart, or say why the group gives up."""
        pid = child.proc.pid
        child.proc = None
        child.last_exit_code = code
        remove_pid_file(self.endpoints.pid_file(child.role), pid)
        decision = child.tracker.on_exit(child.started_at, now, code)
        self._log.warning("component.exited", role=child.role, child_pid=pid, exit_code=code,
                          ran_s=round(now - child.started_at, 3))
        if isinstance(decision, GiveUp):
            self._log.error("component.gave_up", role=child.role, exit_code=code,
                            num_crashes=decision.num_crashes, window_s=decision.window_s,
                            refused=decision.refused)
            return decision
        child.restart_at = now + decision.delay_s
        if child.role in self._together:
            self._restart_group(child)
        return None

    def _restart_group(self, lost: _Child) -> None:
        """Stop the other worker ranks now and start them with `lost` (their exits are not
        their crashes)."""
        for other in self._children:
            if other is lost or other.role not in self._together:
                continue
            if other.proc is not None:
                pid = other.proc.pid
                other.proc.kill()  # blocked in a collective: a stop signal would wait for it
                other.proc.wait()
                remove_pid_file(self.endpoints.pid_file(other.role), pid)
                other.proc = None
                other.last_exit_code = None
            other.restart_at = lost.restart_at if other.restart_at is None else min(
                other.restart_at, lost.restart_at)
        self._log.warning("group.rank_lost", role=lost.role, exit_code=lost.last_exit_code,
                          restarting=list(self._together))

    def _stop_all(self) -> None:
        for child in reversed(self._children):
            proc = child.proc
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self._log.warning("component.killed", role=child.role, child_pid=proc.pid,
                                      timeout_s=self.stop_timeout_s)
                    proc.kill()
                    proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                self._log.warning("component.stopped", role=child.role, child_pid=proc.pid,
                                  exit_code=proc.returncode)
            remove_pid_file(self.endpoints.pid_file(child.role), proc.pid)
            child.proc = None
