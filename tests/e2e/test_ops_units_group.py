"""The rendered service units start a working group without the supervisor.

Each component is started exactly as its rendered launchd agent says (ProgramArguments,
EnvironmentVariables, WorkingDirectory, a bare PATH), the way launchd or systemd would start it
(the systemd unit's ExecStart is the same command line: tests/unit/test_ops_units.py). The four
find each other through the runtime directory, serve a chat request, keep their own pid files
for `switchyard status`, and stop cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai

from switchyard.deploy import launchd
from switchyard.deploy.runtime import read_pid_file
from switchyard.deploy.service_units import ROLES, unit_plan
from switchyard.common.settings import Settings
from switchyard.testing.group import free_port, short_tmp_dir
from tests.helpers.checkout import REPO_ROOT
from switchyard.testing.lifeline import lifeline


def test_units_start_a_working_group(tiny_qwen3):
    runtime_dir, kv_dir = short_tmp_dir("syu"), short_tmp_dir("syukv")
    port = free_port()
    settings = Settings(model=str(tiny_qwen3), port=port, slots=2, ctx=2048,
                        runtime_dir=str(runtime_dir), kv_dir=str(kv_dir),
                        cache_dir=str(runtime_dir / "cache"), log_format="json")
    plan = unit_plan(settings, home=str(runtime_dir))
    agents = {role: plistlib.loads(text.encode())
              for role, text in zip(ROLES, launchd.render(plan).values())}
    procs: dict[str, subprocess.Popen] = {}
    log_path = runtime_dir / "units.log"
    try:
        with open(log_path, "ab") as log:
            for role in ROLES:
                agent = agents[role]
                env = {"PATH": "/usr/bin:/bin"} | agent["EnvironmentVariables"]
                procs[role] = subprocess.Popen(agent["ProgramArguments"],
                                               cwd=agent["WorkingDirectory"], env=env,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                               start_new_session=True)
                # Each its own session, like a unit: on the lifeline, as a ServerGroup is.
                lifeline().hold(procs[role].pid, runtime_dir, 30.0,
                                [runtime_dir, kv_dir] if role == ROLES[0] else [])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), log_path.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("no healthy group\n" + log_path.read_text()[-3000:])

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4)
        assert reply.usage.completion_tokens > 0

        for role, proc in procs.items():  # standalone components keep their own pid files
            assert read_pid_file(runtime_dir / f"{role}.pid") == proc.pid
        done = subprocess.run([sys.executable, "-m", "switchyard.deploy.cli", "status", "--json",
                               "--runtime-dir", str(runtime_dir)], cwd=REPO_ROOT,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["components"]["supervisor"]["pid"] is None
        assert {r: report["components"][r]["pid"] for r in ROLES} == {
            r: p.pid for r, p in procs.items()}

        for role in reversed(ROLES):
            procs[role].send_signal(signal.SIGTERM)
        for role, proc in procs.items():
            assert proc.wait(30) == 0, f"{role}\n" + log_path.read_text()[-3000:]
        assert not list(runtime_dir.glob("*.pid"))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            lifeline().release(proc.pid)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(kv_dir, ignore_errors=True)
