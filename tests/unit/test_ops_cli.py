"""`switchyard launchd|systemd ...` end to end through `deploy.cli.main`, with a recording
stand-in for launchctl/systemctl on PATH and HOME in a temporary directory."""

from __future__ import annotations

import os
import plistlib
import stat
from pathlib import Path

import pytest

from switchyard.deploy import cli
from switchyard.deploy.service_units import ROLES


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def fake_tool(tmp_path, monkeypatch, name: str, stdout: str = "") -> Path:
    """A `name` on PATH that appends its arguments to a log and prints `stdout`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{name}.calls"
    (tmp_path / f"{name}.out").write_text(stdout)
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\ncat "{tmp_path / f"{name}.out"}"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("manager,action", [
    ("launchd", ["install"]), ("launchd", ["uninstall"]), ("launchd", ["status"]),
    ("launchd", ["restart", "worker"]), ("systemd", ["install"]), ("systemd", ["status"]),
    ("systemd", ["restart", "gateway"]), ("systemd", ["uninstall"]),
])
def test_missing_service_manager_exits_2_with_a_clear_message(home, no_tools, capsys, manager,
                                                             action):
    assert cli.main([manager, *action]) == 2
    err = capsys.readouterr().err
    tool = {"launchd": "launchctl", "systemd": "systemctl"}[manager]
    assert f"{tool} not found" in err and "render" in err
    assert not (home / "Library").exists() and not (home / ".config").exists()


def test_render_prints_or_writes_everywhere(home, no_tools, tmp_path, capsys):
    assert cli.main(["launchd", "render", "--port", "8124"]) == 0
    out = capsys.readouterr().out
    assert out.count("# ==> com.switchyard.") == len(ROLES) and "<string>8124</string>" in out
    target = tmp_path / "out"
    assert cli.main(["systemd", "render", "--dir", str(target)]) == 0
    names = sorted(p.name for p in target.iterdir())
    assert names == sorted([*(f"switchyard-{r}.service" for r in ROLES), "switchyard.target"])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in target.iterdir())


def test_dry_run_installs_nothing(home, no_tools, capsys):
    assert cli.main(["launchd", "install", "--dry-run", "--slots", "2"]) == 0
    out = capsys.readouterr().out
    agents = home / "Library" / "LaunchAgents"
    assert f"# ==> {agents}/com.switchyard.gateway.plist <==" in out
    assert f"would run: launchctl bootstrap gui/{os.getuid()} {agents}/com.switchyard.worker.plist" in out
    assert not agents.exists()
    assert cli.main(["systemd", "restart", "all", "--dry-run"]) == 0
    assert "would run: systemctl --user restart switchyard.target" in capsys.readouterr().out


def test_bad_label_suffix_exits_2(home, no_tools, capsys):
    assert cli.main(["systemd", "render", "--label-suffix", "b"]) == 2
    assert "--runtime-dir" in capsys.readouterr().err


def test_launchd_install_status_restart_uninstall(home, tmp_path, monkeypatch, capsys):
    log = fake_tool(tmp_path, monkeypatch, "launchctl", stdout="gui/1/x = {\n\tstate = running\n"
                                                             "\tpid = 4242\n\truns = 1\n}\n")
    runtime = tmp_path / "run"
    assert cli.main(["launchd", "install", "--runtime-dir", str(runtime), "--label-suffix", "b",
                     "--port", "8125"]) == 0
    uid = os.getuid()
    agents = home / "Library" / "LaunchAgents"
    for role in ROLES:
        path = agents / f"com.switchyard.{role}.b.plist"
        agent = plistlib.loads(path.read_bytes())
        assert agent["Label"] == f"com.switchyard.{role}.b"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert f"bootstrap gui/{uid} {path}" in calls(log)
    assert (home / "Library" / "Logs" / "switchyard-b").is_dir()
    assert calls(log)[0] == f"bootout gui/{uid}/com.switchyard.scheduler.b"
    assert f"switchyard status --runtime-dir {runtime}" in capsys.readouterr().out

    assert cli.main(["launchd", "status", "--label-suffix", "b"]) == 0
    out = capsys.readouterr().out
    assert "com.switchyard.worker.b" in out and "running" in out and "4242" in out

    log.unlink()
    assert cli.main(["launchd", "restart", "worker", "--label-suffix", "b"]) == 0
    assert calls(log) == [f"kickstart -k gui/{uid}/com.switchyard.worker.b"]

    log.unlink()
    assert cli.main(["launchd", "uninstall", "--label-suffix", "b"]) == 0
    assert calls(log) == [f"bootout gui/{uid}/com.switchyard.{r}.b" for r in reversed(ROLES)]
    assert not list(agents.iterdir())


def test_systemd_install_status_restart_uninstall(home, tmp_path, monkeypatch, capsys):
    log = fake_tool(tmp_path, monkeypatch, "systemctl",
                    stdout="LoadState=loaded\nActiveState=active\nSubState=running\n"
                           "MainPID=77\nNRestarts=0\nExecMainStatus=0\n")
    assert cli.main(["systemd", "install", "--runtime-dir", str(tmp_path / "run")]) == 0
    units = home / ".config" / "systemd" / "user"
    names = sorted(p.name for p in units.iterdir())
    assert names == sorted([*(f"switchyard-{r}.service" for r in ROLES), "switchyard.target"])
    all_units = "switchyard.target " + " ".join(f"switchyard-{r}.service" for r in ROLES)
    assert calls(log) == ["--user daemon-reload", f"--user enable --now {all_units}"]
    capsys.readouterr()

    assert cli.main(["systemd", "status"]) == 0
    out = capsys.readouterr().out
    assert "switchyard-worker.service" in out and "active (running)" in out

    log.unlink()
    assert cli.main(["systemd", "restart", "worker"]) == 0
    assert calls(log) == ["--user restart switchyard-worker.service"]

    log.unlink()
    assert cli.main(["systemd", "uninstall"]) == 0
    assert calls(log) == [f"--user disable --now {all_units}", "--user daemon-reload"]
    assert not list(units.iterdir())


def test_failing_service_manager_exits_1(home, tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text("#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n")
    (bin_dir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert cli.main(["systemd", "restart", "worker"]) == 1
    assert "Failed to connect to bus" in capsys.readouterr().err
