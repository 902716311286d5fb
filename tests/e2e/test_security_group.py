"""The security findings of issue 12 that only the whole process group shows: the API key on
no process's command line and in the gateway's environment alone (1), a second server on the
same kv dir refused (8), shared memory of a SIGKILLed group removed at the next start (10)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from switchyard.proto.endpoints import Endpoints
from tests.helpers.group import ServerGroup, short_tmp_dir

KEY = "e2e-secret-key-7f3a"
LINUX = sys.platform.startswith("linux")


def proc_text(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_key_kv_lock_and_stale_shared_memory(tiny_qwen3):
    kv_dir = short_tmp_dir("sykv")
    group = ServerGroup(tiny_qwen3, slots=1, ctx=512, kv_dir=kv_dir,
                        env={"SWITCHYARD_API_KEY": KEY})
    with group:
        pids = {role: group.pid_of(role) for role in ("scheduler", "kvstore", "worker",
                                                      "gateway")}
        pids["supervisor"] = group.supervisor_pid
        for role, pid in pids.items():  # 1: in no argv; in the gateway's environment only
            assert KEY.encode() not in proc_text(pid, "cmdline"), role
            if role not in ("gateway", "supervisor"):
                assert KEY.encode() not in proc_text(pid, "environ"), role
        assert KEY.encode() in proc_text(pids["gateway"], "environ")
        assert httpx.get(group.base_url + "/models").status_code == 401
        client = openai.OpenAI(base_url=group.base_url, api_key=KEY, max_retries=0)
        assert client.models.list().data

        # 8: a second server on the same kv dir refuses, naming the first one's kvstore.
        second = ServerGroup(tiny_qwen3, slots=1, ctx=512, kv_dir=kv_dir, wait_for="none")
        second.start()
        try:
            assert second.proc.wait(120) == 2, second.log_tail()
            assert f"in use by process {pids['kvstore']}" in second.log_text()
        finally:
            second.stop(check=False)

        # 10: SIGKILL the whole group: its shared-memory segment is left behind ...
        prefix = Endpoints(group.runtime_dir).shm_prefix
        os.killpg(group.proc.pid, signal.SIGKILL)
        group.proc.wait()
        left = [p.name for p in Path("/dev/shm").glob(prefix + "*")]
        assert left, "the killed worker's segment should still exist"
        for pid_file in group.runtime_dir.glob("*.pid"):
            pid_file.unlink()
        group.proc = None
        # ... and the next start of the group removes it.
        group.start()
        now = {p.name for p in Path("/dev/shm").glob(prefix + "*")}
        assert not set(left) & now and len(now) == 1
        assert "worker.stale_shm_removed" in group.log_text()
    subprocess.run(["rm", "-rf", str(kv_dir)], check=False)
