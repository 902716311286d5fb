"""The router's unit (SMG in front of several servers): pure rendering from its plan, checked
with plistlib and (where installed) `systemd-analyze verify`; `switchyard launchd|systemd
... --router` through `deploy.cli.main` without a service manager."""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess

import pytest

from switchyard.common.settings import Settings
from switchyard.deploy import cli, router_unit
from switchyard.deploy.router_unit import (FAILOVER_FLAGS, RouterPlan, launchd_files, router_plan,
                                           smg_arguments, systemd_files)
from switchyard.deploy.service_units import UnitError

URLS = ["http://10.0.0.1:8001", "http://10.0.0.2:8001"]


@pytest.fixture
def smg(tmp_path) -> str:
    exe = tmp_path / "venv" / "bin" / "smg"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return str(exe)


def make_plan(smg: str, **overrides) -> RouterPlan:
    settings = Settings(**{"port": 8000, **overrides.pop("settings", {})})
    return router_plan(settings, overrides.pop("urls", URLS), smg=smg, home="/home/u",
                       **overrides)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_smg_is_launched_in_front_of_every_server_with_the_failover_flags(smg):
    plan = make_plan(smg, model_aliases=["claude-sonnet-4-5=local"],
                     smg_args=["--policy", "round_robin"])
    argv = smg_arguments(plan)
    assert argv[:2] == [smg, "launch"]
    at = argv.index("--worker-urls")
    assert argv[at + 1: at + 3] == URLS and argv[at + 3].startswith("--")
    assert flag_value(argv, "--host") == "127.0.0.1" and flag_value(argv, "--port") == "8000"
    assert flag_value(argv, "--policy") == "cache_aware"
    # Switchyard's /health, probed often enough to take a dead server out in ~10 s, kept listed
    assert flag_value(argv, "--health-check-endpoint") == "/health"
    assert int(flag_value(argv, "--health-check-interval-secs")) <= 5
    assert "--no-remove-unhealthy-workers" in argv
    assert int(flag_value(argv, "--max-buffered-request-bytes")) >= 16 * 2**20
    assert int(flag_value(argv, "--retry-max-retries")) >= 1
    assert flag_value(argv, "--model-alias") == "claude-sonnet-4-5=local"
    assert argv[-2:] == ["--policy", "round_robin"]  # appended: SMG takes the later one
    assert argv[argv.index("--shutdown-grace-period-secs") + 1] == "20"


def test_launchd_agent(smg):
    plan = make_plan(smg, label_suffix="b", settings={"host": "0.0.0.0", "port": 9000})
    files = launchd_files(plan)
    assert list(files) == ["com.switchyard.router.b.plist"]
    agent = plistlib.loads(files["com.switchyard.router.b.plist"].encode())
    assert agent["Label"] == "com.switchyard.router.b"
    assert agent["ProgramArguments"] == smg_arguments(plan)
    assert flag_value(agent["ProgramArguments"], "--host") == "0.0.0.0"
    assert agent["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert agent["StandardOutPath"] == "/home/u/Library/Logs/switchyard-b/router.log"
    assert agent["EnvironmentVariables"] == {"HOME": "/home/u"}
    # launchd's SIGKILL comes after SMG's own grace period has passed
    assert agent["ExitTimeOut"] > int(flag_value(agent["ProgramArguments"],
                                                 "--shutdown-grace-period-secs")) + 5


def unit_sections(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current[key] = value
    return sections


def test_systemd_unit_stands_apart_from_the_servers_target(smg):
    plan = make_plan(smg, model_aliases=["a b=local"])
    files = systemd_files(plan)
    assert list(files) == ["switchyard-router.service"]
    unit = unit_sections(files["switchyard-router.service"])
    assert shlex.split(unit["Service"]["ExecStart"]) == smg_arguments(plan)
    assert "PartOf" not in unit["Unit"] and unit["Install"]["WantedBy"] == "default.target"
    assert unit["Service"]["Restart"] == "on-failure"
    assert int(unit["Service"]["TimeoutStopSec"]) > 25
    assert "2 servers" in unit["Unit"]["Description"]
    assert router_unit.systemd_install() == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "switchyard-router.service"]]


@pytest.mark.parametrize("urls,message", [
    ([], "--worker-url"), (["10.0.0.1:8001"], "http://HOST:PORT"),
    (["http://10.0.0.1"], "http://HOST:PORT"), (["http://10.0.0.1:8001/v1"], "http://HOST:PORT"),
    (["ftp://h:1"], "http://HOST:PORT"), (["http://u:p@h:1"], "http://HOST:PORT"),
])
def test_bad_worker_urls_are_refused(smg, urls, message):
    with pytest.raises(UnitError, match=message):
        make_plan(smg, urls=urls)


def test_only_the_address_of_the_servers_settings_applies(smg, tmp_path):
    with pytest.raises(UnitError, match="only --host and --port apply.*--slots"):
        make_plan(smg, settings={"slots": 2})
    with pytest.raises(UnitError, match="only --host and --port apply.*--api-key"):
        make_plan(smg, settings={"api_key": "sk-x"})
    with pytest.raises(UnitError, match="NAME=SERVED"):
        make_plan(smg, model_aliases=["local"])
    with pytest.raises(UnitError, match="no such file"):
        make_plan(str(tmp_path / "nope"))
    assert make_plan(smg, urls=["https://h:1/"]).worker_urls == ("https://h:1",)


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no launchctl or systemctl
    return home


def test_cli_renders_and_dry_runs_the_router(home, smg, tmp_path, capsys):
    flags = ["--router", "--smg", smg, "--worker-url", URLS[0], "--worker-url", URLS[1]]
    assert cli.main(["systemd", "render", *flags, "--dir", str(tmp_path / "out")]) == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["switchyard-router.service"]
    assert cli.main(["launchd", "install", "--dry-run", *flags, "--port", "8100"]) == 0
    out = capsys.readouterr().out
    agents = home / "Library" / "LaunchAgents"
    assert f"# ==> {agents}/com.switchyard.router.plist <==" in out
    assert f"would run: launchctl bootstrap gui/{os.getuid()} {agents}/com.switchyard.router.plist" in out
    assert "<string>8100</string>" in out and not agents.exists()
    assert cli.main(["systemd", "uninstall", "--router", "--dry-run"]) == 0
    assert "would run: systemctl --user disable --now switchyard-router.service" in \
        capsys.readouterr().out
    assert cli.main(["systemd", "restart", "router", "--dry-run"]) == 0
    assert "systemctl --user restart switchyard-router.service" in capsys.readouterr().out
    assert cli.main(["systemd", "install", *flags]) == 2
    assert "systemctl not found" in capsys.readouterr().err
    assert cli.main(["systemd", "render", "--router", "--smg", smg]) == 2
    assert "--worker-url" in capsys.readouterr().err


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(smg, tmp_path):
    out = tmp_path / "units"
    out.mkdir()
    for name, text in systemd_files(make_plan(smg)).items():
        (out / name).write_text(text)
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, out.iterdir())],
                          capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if str(out) in line]
    assert done.returncode == 0 and complaints == [], done.stdout + done.stderr

