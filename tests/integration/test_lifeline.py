"""The test-only lifeline (testing/lifeline.py): a group outlives the process that started
it only until that process dies. Each test runs a python child that starts what it holds, then
the child dies; what it held must be gone within a bounded wait."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from switchyard.deploy.runtime import pid_alive, wait_gone
from switchyard.deploy.supervisor import ROLES
from switchyard.common.endpoints import Endpoints
from switchyard.proto.shm import remove_stale_segments
from switchyard.testing.group import group_members
from tests.helpers.checkout import REPO_ROOT

# Longer than the lifeline's grace for a whole group (ServerGroup's stop_timeout_s), so a
# group that ignores its SIGTERM is still SIGKILLed within it.
BOUND_S = 90.0

GROUP_CHILD = """
import json, sys, time
from switchyard.testing.group import ServerGroup
from switchyard.testing.lifeline import lifeline
group = ServerGroup(sys.argv[1], slots=1, ctx=512).start()
print(json.dumps({"supervisor": group.supervisor_pid, "pids": sorted(group.seen_pids),
                  "runtime_dir": str(group.runtime_dir), "kv_dir": str(group.kv_dir),
                  "watcher": lifeline().watcher.pid}), flush=True)
time.sleep(600)
"""

# A leader that ignores SIGTERM and forks a member (same process group, SIGTERM ignored too).
LEADER = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
member = os.fork()
if member:
    print(member, flush=True)
time.sleep(600)
"""

# Two such groups, their member named in a pid file: one held, one held and then released.
# The child then exits without stopping either.
STUBBORN_CHILD = """
import json, os, subprocess, sys
from switchyard.testing.group import short_tmp_dir
from switchyard.testing.lifeline import lifeline
out = {}
for name in ("held", "released"):
    runtime_dir = short_tmp_dir("sylife")
    leader = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                              start_new_session=True)
    member = int(leader.stdout.readline())
    (runtime_dir / "worker.pid").write_text(f"{member}\\n")
    lifeline().hold(leader.pid, runtime_dir, 0.5, [runtime_dir])
    out[name] = {"pids": [leader.pid, member], "runtime_dir": str(runtime_dir)}
lifeline().release(out["released"]["pids"][0])
out["watcher"] = lifeline().watcher.pid
print(json.dumps(out), flush=True)
os._exit(0)  # no atexit, no stop: only the lifeline acts
"""


def run_child(code: str, *args: str, log: Path) -> tuple[subprocess.Popen, dict]:
    """Start `code` in a python child; return it and the JSON line it prints."""
    with open(log, "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO_ROOT,
                                 env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    line = child.stdout.readline()
    assert line, f"child printed nothing (exit {child.wait()}):\n{log.read_text()}"
    return child, json.loads(line)


def shm_segments(runtime_dir: str) -> list[str]:
    return glob.glob(f"/dev/shm/{glob.escape(Endpoints(Path(runtime_dir)).shm_prefix)}*")


def reap(pgid: int, runtime_dir: str, *dirs: str) -> None:
    """What a failing check leaves behind, cleaned up without the lifeline."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    endpoints = Endpoints(Path(runtime_dir))
    remove_stale_segments(endpoints.shm_prefix, endpoints.shm_record)
    for path in (runtime_dir, *dirs):
        shutil.rmtree(path, ignore_errors=True)


def test_a_group_is_stopped_when_its_starter_is_killed(tiny_model_dir, tmp_path):
    child, info = run_child(GROUP_CHILD, str(tiny_model_dir("qwen3")), log=tmp_path / "child.log")
    pgid = info["supervisor"]
    try:
        assert len(info["pids"]) == len(ROLES) and all(pid_alive(p) for p in info["pids"])
        if os.path.isdir("/dev/shm"):
            assert shm_segments(info["runtime_dir"]), "the worker made no segment to check"
        child.kill()
        child.wait()
        assert wait_gone([pgid, *info["pids"], info["watcher"]], BOUND_S) == []
        assert group_members(pgid) == []
        assert shm_segments(info["runtime_dir"]) == []
        assert not Path(info["runtime_dir"]).exists() and not Path(info["kv_dir"]).exists()
    finally:
        child.kill()
        child.wait()
        reap(pgid, info["runtime_dir"], info["kv_dir"])


def test_what_is_held_is_killed_after_the_grace_and_what_is_released_stays(tmp_path):
    child, info = run_child(STUBBORN_CHILD, LEADER, log=tmp_path / "child.log")
    held, released = info["held"], info["released"]
    try:
        assert child.wait() == 0
        assert wait_gone([*held["pids"], info["watcher"]], BOUND_S) == []
        assert not Path(held["runtime_dir"]).exists()
        assert all(pid_alive(p) for p in released["pids"])
        assert Path(released["runtime_dir"]).exists()
    finally:
        for group in (held, released):
            reap(group["pids"][0], group["runtime_dir"])
