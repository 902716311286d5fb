"""A group whose memory plan does not fit refuses to start, clearly, and leaves nothing
running (F7)."""

import subprocess
import sys

from tests.helpers.group import REPO_ROOT, short_tmp_dir


def test_serve_refuses_a_plan_that_does_not_fit(tiny_model_dir):
    runtime = short_tmp_dir("syrf")
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "serve", "--model", str(tiny_model_dir("qwen3")),
         "--slots", "64", "--ctx", "50000000", "--runtime-dir", str(runtime),
         "--kv-dir", str(runtime / "kv"), "--port", "18999", "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Lower --slots (now 64) or --ctx (now 50000000)" in out
    assert "worker.refused_to_start" in out
