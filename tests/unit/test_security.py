"""Regression tests for the local-security findings of issue 12 that need no server: the API
key off command lines, the runtime and KV directories (permissions, symlinks, FIFOs, a lock
against a second server), stale shared memory. Each test names its finding."""

from __future__ import annotations

import os
import stat

import pytest

from deploy.supervisor import child_env, component_command
from proto.settings import (API_KEY_ENV, Settings, SettingsError, read_api_key_file,
                            resolve_api_key)

KEY = "s3cret-key"


# -- 1. the API key is on no command line, and only the gateway gets it ----------------------

def test_api_key_is_on_no_child_command_line_and_only_the_gateway_gets_it():
    settings = Settings(model="/m", host="0.0.0.0", api_key=KEY)
    for role in ("scheduler", "kvstore", "worker", "gateway"):
        argv = component_command(role, settings)
        assert not any(KEY in arg for arg in argv), role
        env = child_env({"PATH": "/bin", API_KEY_ENV: "inherited"}, role, settings)
        assert env.get(API_KEY_ENV) == (KEY if role == "gateway" else None), role


def test_api_key_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    assert resolve_api_key({"api_key_file": str(path)}, env={})["api_key"] == KEY
    assert resolve_api_key({}, env={API_KEY_ENV: KEY})["api_key"] == KEY
    assert resolve_api_key({"api_key": "flag"}, env={API_KEY_ENV: KEY})["api_key"] == "flag"
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="readable by other users"):
        read_api_key_file(str(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(SettingsError):
        read_api_key_file(str(link))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SettingsError, match="not a regular file"):
        read_api_key_file(str(tmp_path / "fifo"))  # and does not hang
    # A key file is enough to bind off loopback.
    path.chmod(0o600)
    Settings(host="0.0.0.0", api_key_file=str(path)).validate()


# -- 3. the runtime dir check follows no symlink ------------------------------------------------

def test_a_symlink_at_the_runtime_dir_is_refused_and_its_target_left_alone(tmp_path, capsys):
    from deploy import cli
    from proto.endpoints import RuntimeDirError, ensure_runtime_dir

    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(RuntimeDirError, match="symbolic link"):
        ensure_runtime_dir(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # not chmodded through the link
    assert cli.main(["serve", "--runtime-dir", str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    # A real directory of ours is tightened to 0700.
    ensure_runtime_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
