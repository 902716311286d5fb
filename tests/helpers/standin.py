"""Stand-in components, for testing the supervisor before (and without) the real ones.

    python -m tests.helpers.standin supervise [settings flags]   a Supervisor whose children
                                                                 are stand-ins (fast backoff)
    python -m tests.helpers.standin child ROLE [settings flags]  one stand-in component

A stand-in child goes through `deploy.cli.run_component` exactly like a real component (parent
watchdog, settings resolution) but its service just waits for SIGTERM/SIGINT. Behaviour for a
test comes from environment variables:

    STANDIN_CRASH=worker:2       the worker exits with code 7 shortly after each of its first
                                 2 starts (counted in <runtime dir>/standin-worker.starts)
    STANDIN_IGNORE_TERM=gateway  the gateway ignores SIGTERM (the supervisor must SIGKILL it)
    STANDIN_REFUSE=worker        the worker refuses to start: exit code 2 at once
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from switchyard.deploy import cli, resolve
from switchyard.deploy.group_roles import serve_roles
from switchyard.deploy.restart_policy import RestartPolicy
from switchyard.deploy.runtime import GroupRunningError
from switchyard.deploy.supervisor import ROLES, Supervisor
from switchyard.proto.ids import new_boot_id
from switchyard.common.logs import configure_logging
from switchyard.common.settings import Settings, add_arguments, from_namespace

CRASH_EXIT_CODE = 7
REFUSE_EXIT_CODE = 2
TEST_POLICY = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.4, max_crashes=3, window_s=30.0,
                            stable_after_s=30.0)


def standin_command(role: str, settings: Settings) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.standin", "child", role, *settings.to_args()]


def _crash_budget(role: str) -> int:
    spec = os.environ.get("STANDIN_CRASH", "")
    for item in filter(None, spec.split(",")):
        name, _, count = item.partition(":")
        if name == role:
            return int(count or "1")
    return 0


def _count_start(settings: Settings, role: str) -> int:
    path = settings.runtime_path / f"standin-{role}.starts"
    num = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(num))
    return num


def fake_service(role: str):
    def run(settings: Settings) -> None:
        log = configure_logging(role, new_boot_id(), settings.log_level, settings.log_format)
        stop = []
        if role in os.environ.get("STANDIN_IGNORE_TERM", "").split(","):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
        signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
        if role in os.environ.get("STANDIN_REFUSE", "").split(","):
            log.error("standin.refused_to_start")
            sys.exit(REFUSE_EXIT_CODE)
        num_starts = _count_start(settings, role)
        log.info("standin.started", num_starts=num_starts)
        crash = num_starts <= _crash_budget(role)
        deadline = time.monotonic() + 0.3
        while not stop:
            if crash and time.monotonic() > deadline:
                log.info("standin.crashing")
                sys.exit(CRASH_EXIT_CODE)
            time.sleep(0.02)
        log.info("standin.stopped")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="standin")
    sub = parser.add_subparsers(dest="mode", required=True)
    sup = sub.add_parser("supervise")
    sup.add_argument("--stop-timeout", type=float, default=3.0)
    add_arguments(sup)
    child = sub.add_parser("child")
    child.add_argument("role", choices=ROLES + ("worker.1",))  # a worker group's rank 1
    add_arguments(child)
    args = parser.parse_args(argv)
    settings = resolve.with_concrete_paths(from_namespace(args))
    if args.mode == "child":
        return cli.run_component(args.role, settings, service=fake_service(args.role))
    configure_logging("supervisor", new_boot_id(), settings.log_level, settings.log_format)
    supervisor = Supervisor(settings, command_for=standin_command, policy=TEST_POLICY,
                            stop_timeout_s=args.stop_timeout, roles=serve_roles(settings))
    try:
        return supervisor.run()
    except GroupRunningError as exc:
        print(f"standin: error: {exc}", file=sys.stderr)
        return cli.EXIT_GROUP_RUNNING


if __name__ == "__main__":
    sys.exit(main())
