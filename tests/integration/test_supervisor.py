"""The supervisor with real processes: stand-in components that go through `deploy.cli run`'s
code path (parent watchdog, settings) but only wait for a stop signal. The whole group with the
real components is covered by tests/e2e through the same ServerGroup helper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchyard.deploy.runtime import pid_alive, read_pid_file, wait_gone
from switchyard.deploy.supervisor import ROLES
from switchyard.testing.group import ServerGroup, free_port, group_members, short_tmp_dir
from tests.helpers.standin import CRASH_EXIT_CODE

_REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN = ("tests.helpers.standin", "supervise")


def standin_group(tmp_path, env=None, extra=(), **kw) -> ServerGroup:
    # The stand-in is a test module: its processes find it through the checkout on PYTHONPATH.
    env = {"PYTHONPATH": str(_REPO_ROOT), **(env or {})}
    return ServerGroup(tmp_path, entry=STANDIN, wait_for="pids", env=env,
                       extra=extra, startup_timeout_s=30, stop_timeout_s=30, **kw)


def wait_until(predicate, timeout_s=15.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_children_start_in_order_with_pid_files(tmp_path):
    with standin_group(tmp_path) as group:
        pids = group.wait_components()
        assert read_pid_file(group.runtime_dir / "supervisor.pid") == group.supervisor_pid
        assert len(set(pids.values())) == len(ROLES)
        started = [e["role"] for e in group.log_events("component.started")]
        assert started == list(ROLES)
        wait_until(lambda: len(group.log_events("standin.started")) == len(ROLES),
                   what="every stand-in to log")
        standins = group.log_events("standin.started")
        assert {e["role"] for e in standins} == set(ROLES)
        assert {e["pid"] for e in standins} == set(pids.values())


def test_restart_on_crash_with_backoff(tmp_path):
    with standin_group(tmp_path, env={"STANDIN_CRASH": "worker:2"}) as group:
        wait_until(lambda: len(group.log_events("component.restarted")) >= 2,
                   what="two worker restarts")
        restarts = group.log_events("component.restarted")
        assert [(e["role"], e["exit_code"], e["num_restarts"]) for e in restarts[:2]] == [
            ("worker", CRASH_EXIT_CODE, 1), ("worker", CRASH_EXIT_CODE, 2)]
        exits = group.log_events("component.exited")
        assert [(e["role"], e["exit_code"]) for e in exits] == [
            ("worker", CRASH_EXIT_CODE)] * 2
        group.seen_pids.update(e["child_pid"] for e in exits)
        time.sleep(0.6)  # the third worker does not crash and stays
        new_pid = group.pid_of("worker")
        assert new_pid not in {e["child_pid"] for e in exits}
        assert len(group.log_events("component.restarted")) == 2
    # on exit ServerGroup asserts the crashed and the current workers are all gone


def test_a_worker_groups_local_ranks_restart_together(tmp_path):
    """kill -9 of rank 1: the supervisor stops rank 0 too (its collectives would fail) and
    starts both again; rank 0's stop is not counted as its crash."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]')
    with standin_group(tmp_path, extra=("--hostfile", str(hostfile)),
                       extra_roles=("worker.1", "kvstore.1")) as group:
        pids = group.wait_components()
        started = [e["role"] for e in group.log_events("component.started")]
        assert started == ["scheduler", "kvstore", "kvstore.1", "worker.1", "worker", "gateway"]
        group.kill("worker.1", signal.SIGKILL)
        new_rank0 = group.wait_restarted("worker", pids["worker"])
        new_rank1 = group.wait_restarted("worker.1", pids["worker.1"])
        assert not pid_alive(pids["worker"]) and {new_rank0, new_rank1}.isdisjoint(pids.values())
        lost = group.log_events("group.rank_lost")
        assert [(e["role"], e["restarting"]) for e in lost] == [
            ("worker.1", ["worker.1", "worker"])]
        assert [e["role"] for e in group.log_events("component.exited")] == ["worker.1"]
        assert group.pid_of("scheduler") == pids["scheduler"]  # the rest is left alone


def test_killed_component_is_restarted(tmp_path):
    with standin_group(tmp_path) as group:
        old = group.kill("kvstore", signal.SIGKILL)
        new = group.wait_restarted("kvstore", old)
        assert new != old and not pid_alive(old)
        event = group.log_events("component.restarted")[-1]
        assert (event["role"], event["exit_code"], event["child_pid"]) == (
            "kvstore", -signal.SIGKILL, new)


def test_gives_up_when_a_component_keeps_crashing(tmp_path):
    group = standin_group(tmp_path, env={"STANDIN_CRASH": "scheduler:100"})
    group.wait_for = "none"
    group.start()
    try:
        assert group.proc.wait(30) == 1
        gave_up = group.log_events("component.gave_up")
        assert [e["role"] for e in gave_up] == ["scheduler"]
        assert gave_up[0]["num_crashes"] == 4  # TEST_POLICY.max_crashes + 1
        assert group_members(group.supervisor_pid) == []
        assert sorted(p.name for p in group.runtime_dir.glob("*.pid")) == []
    finally:
        group.proc = None
        group._cleanup()


def test_a_component_refusing_to_start_ends_the_group_with_exit_2(tmp_path):
    group = standin_group(tmp_path, env={"STANDIN_REFUSE": "worker"})
    group.wait_for = "none"
    group.start()
    try:
        assert group.proc.wait(30) == 2
        assert [(e["role"], e["refused"]) for e in group.log_events("component.gave_up")] == [
            ("worker", True)]
        assert group.log_events("component.restarted") == []
        assert group_members(group.supervisor_pid) == []
        assert sorted(p.name for p in group.runtime_dir.glob("*.pid")) == []
    finally:
        group.proc = None
        group._cleanup()


def test_sigterm_stops_all_children_and_escalates_to_sigkill(tmp_path):
    runtime_dir = short_tmp_dir()
    group = standin_group(tmp_path, env={"STANDIN_IGNORE_TERM": "gateway"},
                          extra=("--stop-timeout", "1"), runtime_dir=runtime_dir)
    try:
        with group:
            pids = group.wait_components()
            wait_until(lambda: len(group.log_events("standin.started")) == len(ROLES),
                       what="every stand-in to set its signal handlers")
        # ServerGroup.stop checked: exit code 0, every pid gone, the group empty, no pid files
        assert not any(pid_alive(p) for p in pids.values())
        assert [e["role"] for e in group.log_events("component.killed")] == ["gateway"]
        assert group.log_events("group.stopped")[0]["exit_code"] == 0
    finally:
        import shutil
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_supervisor_sigkill_leaves_no_orphans(tmp_path):
    group = standin_group(tmp_path).start()
    try:
        pids = group.wait_components()
        os.kill(group.supervisor_pid, signal.SIGKILL)
        group.proc.wait(10)
        assert wait_gone(list(pids.values()), 10.0) == []
        assert group_members(group.supervisor_pid) == []
        # the stale pid files do not stop a new group in the same runtime dir
        with standin_group(tmp_path, runtime_dir=group.runtime_dir) as second:
            assert second.pid_of("worker") not in pids.values()
    finally:
        group.stop(check=False)


def test_parent_watchdog_without_pdeathsig(tmp_path):
    """The getppid() watchdog alone ends a child whose parent is gone."""
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import os, sys, time; from switchyard.deploy.lifeline import watch_parent; "
            "watch_parent(os.getppid(), interval_s=0.05, grace_s=1, use_pdeathsig=False); "
            "print(os.getpid(), flush=True); time.sleep(60)'], stdout=sys.stdout)\n"
            "time.sleep(1.0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=_REPO_ROOT, capture_output=True,
                         text=True, timeout=30, start_new_session=True,
                         env=os.environ | {"PYTHONPATH": str(_REPO_ROOT)})
    child = int(out.stdout.split()[0])
    assert wait_gone([child], 5.0) == []


def test_refuses_a_second_group_in_the_same_runtime_dir(tmp_path):
    with standin_group(tmp_path) as group:
        pids = group.wait_components()
        before = {p.name: p.read_text() for p in group.runtime_dir.glob("*.pid")}
        out = subprocess.run(
            [sys.executable, "-m", "switchyard.deploy.cli", "serve", "--model", str(tmp_path),
             "--port", str(free_port()), "--runtime-dir", str(group.runtime_dir)],
            cwd=_REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 3, out.stderr
        assert "another Switchyard group is running" in out.stderr
        assert str(group.supervisor_pid) in out.stderr
        assert {p.name: p.read_text() for p in group.runtime_dir.glob("*.pid")} == before
        assert all(pid_alive(p) for p in pids.values())


def test_refuses_when_supervisor_pid_file_names_a_live_process(tmp_path):
    runtime_dir = short_tmp_dir()
    try:
        (runtime_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")
        out = subprocess.run(
            [sys.executable, "-m", "switchyard.deploy.cli", "serve", "--model", str(tmp_path),
             "--runtime-dir", str(runtime_dir)],
            cwd=_REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 3
        assert f"supervisor pid {os.getpid()}" in out.stderr
        assert read_pid_file(runtime_dir / "supervisor.pid") == os.getpid()
    finally:
        import shutil
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_two_groups_side_by_side(tmp_path):
    with standin_group(tmp_path) as first, standin_group(tmp_path) as second:
        a, b = first.wait_components(), second.wait_components()
        assert first.runtime_dir != second.runtime_dir and first.port != second.port
        assert not set(a.values()) & set(b.values())
        second_pids = b
    assert wait_gone(list(second_pids.values()), 5.0) == []


def test_stray_process_naming_the_runtime_dir_is_never_signalled(tmp_path):
    runtime_dir = short_tmp_dir()
    marker = tmp_path / "stray-signalled"
    stray_code = ("import signal, sys, time, pathlib\n"
                  "def hit(sig, frame):\n"
                  "    pathlib.Path(sys.argv[1]).write_text(str(sig))\n"
                  "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
                  "    signal.signal(s, hit)\n"
                  "time.sleep(120)\n")
    # its command line names the runtime dir, a pid file and every role
    stray = subprocess.Popen([sys.executable, "-c", stray_code, str(marker),
                              str(runtime_dir), str(runtime_dir / "worker.pid"),
                              "switchyard.deploy.cli", "run", *ROLES], start_new_session=True)
    try:
        with standin_group(tmp_path, runtime_dir=runtime_dir) as group:
            old = group.kill("worker", signal.SIGKILL)
            group.wait_restarted("worker", old)
            assert stray.pid not in group.wait_components().values()
        time.sleep(0.3)
        assert stray.poll() is None, "the stray process was killed"
        assert not marker.exists(), f"the stray process got signal {marker.read_text()}"
    finally:
        stray.kill()
        stray.wait()
        import shutil
        shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "--slots must be at least 1"),
    (["--kv-disk-budget", "lots"], "not a size"),
])
def test_bad_settings_exit_2(argv, message):
    out = subprocess.run([sys.executable, "-m", "switchyard.deploy.cli", "serve", *argv], cwd=_REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
