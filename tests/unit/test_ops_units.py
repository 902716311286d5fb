"""launchd plists and systemd units: pure rendering from settings, checked with plistlib and
(where installed) `systemd-analyze verify`."""

from __future__ import annotations

import dataclasses
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.deploy import cli, launchd, systemd
from switchyard.deploy.service_units import (ROLES, UnitError, check_second_group, parse_env,
                                  program_arguments, settings_flags, unit_plan, write_key_file)
from switchyard.common.settings import Settings, read_api_key_file

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
AWKWARD_KEY = 'k e$y%"\\x'


def make_plan(tmp_path, suffix="", python="/venv/bin/python", **overrides):
    settings = Settings(**{"model": "/models/m", "port": 8123, "slots": 2,
                           "runtime_dir": str(tmp_path / "run"), "kv_dir": str(tmp_path / "kv"),
                           "cache_dir": str(tmp_path / "cache"), **overrides})
    return unit_plan(settings, label_suffix=suffix, python=python, home="/home/u",
                     openblas=OPENBLAS, linux=True, extra_env={"HF_HOME": "/data/hf"})


def parse_settings(argv: list[str]) -> Settings:
    """Settings from a `... run ROLE flags` command line, as the component will see them."""
    run_at = argv.index("run")
    return cli.from_namespace(cli.build_parser().parse_args(argv[run_at:]))


# -- shared ---------------------------------------------------------------------------------------

def key_file(tmp_path, key=AWKWARD_KEY) -> str:
    path = tmp_path / "key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)


def as_child(settings: Settings, role: str) -> Settings:
    """What a component of `role` is given: the key only for the gateway, which alone binds."""
    if role == "gateway":
        return settings
    return dataclasses.replace(settings, api_key="", api_key_file="", host="127.0.0.1",
                               port=Settings.port)


def test_flags_are_the_non_default_settings_and_round_trip(tmp_path):
    plan = make_plan(tmp_path, api_key_file=key_file(tmp_path), log_content=True, port=8123)
    flags = settings_flags(plan.settings)
    assert "--slots" in flags and "--ctx" not in flags and "--log-content" in flags
    for role in ROLES:
        argv = program_arguments(plan, role)
        assert argv[:5] == ["/venv/bin/python", "-m", "switchyard.deploy.cli", "run", role]
        child = parse_settings(argv)
        assert child == as_child(dataclasses.replace(plan.settings, api_key=AWKWARD_KEY), role)


def test_units_never_hold_the_api_key(tmp_path):
    """The key was in every unit's argv; now only a file path is, for
    the gateway alone (systemd: LoadCredential=), and `install` writes the file 0600."""
    plan = make_plan(tmp_path, api_key=AWKWARD_KEY)
    rendered = "\n".join([*launchd.render(plan).values(), *systemd.render(plan).values()])
    assert AWKWARD_KEY not in rendered and "api-key" in rendered
    assert plan.api_key_file == "/home/u/.config/switchyard/api-key"
    gateway = unit_sections(systemd.render(plan)["switchyard-gateway.service"])
    service = dict(gateway["Service"])
    assert service["LoadCredential"] == "api-key:/home/u/.config/switchyard/api-key"
    assert service["ExecStart"].endswith("--api-key-file %d/api-key")
    for role in ROLES:
        argv = program_arguments(plan, role)
        assert ("--api-key-file" in argv) == (role == "gateway")
        assert "--api-key" not in argv
    target = tmp_path / "cfg" / "api-key"
    write_key_file(target, AWKWARD_KEY)
    assert target.stat().st_mode & 0o777 == 0o600
    assert target.parent.stat().st_mode & 0o777 == 0o700
    assert read_api_key_file(str(target)) == AWKWARD_KEY


def test_label_suffix_needs_its_own_runtime_dir_and_a_clean_name(tmp_path):
    with pytest.raises(UnitError, match="runtime-dir"):
        check_second_group(Settings(), "b")
    check_second_group(Settings(runtime_dir="/tmp/b"), "b")
    with pytest.raises(UnitError, match="label-suffix"):
        make_plan(tmp_path, suffix="../evil")
    with pytest.raises(UnitError, match="NAME=VALUE"):
        parse_env(["novalue"])
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}


def test_installed_script_is_used_when_the_venv_has_one(tmp_path):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "switchyard").write_text("#!/bin/sh\n")
    plan = make_plan(tmp_path, python=str(bin_dir / "python"))
    assert program_arguments(plan, "gateway")[:3] == [str(bin_dir / "switchyard"), "run",
                                                      "gateway"]
    assert "PYTHONPATH" not in dict(plan.env)


# -- launchd --------------------------------------------------------------------------------------

def test_launchd_plists(tmp_path):
    plan = make_plan(tmp_path, api_key_file=key_file(tmp_path))
    files = launchd.render(plan)
    assert list(files) == [f"com.switchyard.{role}.plist" for role in ROLES]
    for role in ROLES:
        agent = plistlib.loads(files[f"com.switchyard.{role}.plist"].encode())
        assert agent["Label"] == f"com.switchyard.{role}"
        assert agent["ProgramArguments"] == program_arguments(plan, role)
        assert parse_settings(agent["ProgramArguments"]) == as_child(
            dataclasses.replace(plan.settings, api_key=AWKWARD_KEY), role)
        assert agent["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
        assert agent["RunAtLoad"] is True
        assert isinstance(agent["ThrottleInterval"], int) and agent["ThrottleInterval"] >= 5
        assert agent["StandardOutPath"] == f"/home/u/Library/Logs/switchyard/{role}.log"
        assert agent["StandardErrorPath"] == agent["StandardOutPath"]
        assert agent["WorkingDirectory"] == plan.working_dir
        env = agent["EnvironmentVariables"]
        assert env["HOME"] == "/home/u" and env["HF_HOME"] == "/data/hf"
        assert "PYTHONPATH" not in env
        assert "LD_PRELOAD" not in env or role == "worker"


def test_launchd_label_suffix_keeps_two_groups_apart(tmp_path):
    a, b = launchd.render(make_plan(tmp_path / "a")), launchd.render(make_plan(tmp_path / "b",
                                                                               suffix="b"))
    assert not set(a) & set(b)
    agent = plistlib.loads(b["com.switchyard.worker.b.plist"].encode())
    assert agent["Label"] == "com.switchyard.worker.b"
    assert agent["StandardOutPath"] == "/home/u/Library/Logs/switchyard-b/worker.log"
    assert launchd.kickstart(501, "worker", "b") == [
        "launchctl", "kickstart", "-k", "gui/501/com.switchyard.worker.b"]
    assert launchd.bootstrap(501, Path("/p.plist")) == ["launchctl", "bootstrap", "gui/501",
                                                        "/p.plist"]


def test_launchd_template_placeholders_are_checked(tmp_path):
    plan = make_plan(tmp_path)
    bad = launchd.template("gateway").replace(b"@HOME@", b"@NOPE@")
    with pytest.raises(ValueError, match="@NOPE@"):
        launchd.render_one(plan, "gateway", bad)


def test_launchctl_print_is_parsed():
    text = """gui/501/com.switchyard.worker = {
	active count = 1
	path = /Users/u/Library/LaunchAgents/com.switchyard.worker.plist
	state = running
	program = /venv/bin/python
	environment = {
		PYTHONPATH => /src
	}
	runs = 3
	pid = 4242
	last exit code = 1
}
"""
    fields = launchd.parse_print(text)
    assert fields["state"] == "running" and fields["pid"] == "4242"
    assert fields["runs"] == "3" and fields["last exit code"] == "1"
    assert "PYTHONPATH => /src" not in fields


# -- systemd --------------------------------------------------------------------------------------

def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key, value))
    return sections


def unquote_exec(line: str) -> list[str]:
    """ExecStart= words back (shell-like double quotes; then systemd's %% and $$)."""
    return [w.replace("$$", "$").replace("%%", "%") for w in shlex.split(line)]


def test_systemd_units(tmp_path):
    plan = make_plan(tmp_path, api_key_file=key_file(tmp_path), model="/models/my model")
    files = systemd.render(plan)
    assert list(files) == [*(f"switchyard-{role}.service" for role in ROLES),
                           "switchyard.target"]
    for role in ROLES:
        unit = unit_sections(files[f"switchyard-{role}.service"])
        service = dict(unit["Service"])
        assert dict(unit["Unit"])["PartOf"] == "switchyard.target"
        assert dict(unit["Install"])["WantedBy"] == "switchyard.target"
        assert service["Restart"] == "on-failure" and float(service["RestartSec"]) > 0
        assert service["RestartPreventExitStatus"] == "2 3"
        argv = unquote_exec(service["ExecStart"])
        assert argv == program_arguments(plan, role, "%d/api-key")
        assert ("LoadCredential" in service) == (role == "gateway")
        env = [v for k, v in unit["Service"] if k == "Environment"]
        assert "HF_HOME=/data/hf" in env
        assert (f"LD_PRELOAD={OPENBLAS}" in env) == (role == "worker")
        assert ("OPENBLAS_THREAD_TIMEOUT=4" in env) == (role == "worker")
    target = unit_sections(files["switchyard.target"])
    assert dict(target["Unit"])["Wants"].split() == [f"switchyard-{r}.service" for r in ROLES]
    assert dict(target["Install"])["WantedBy"] == "default.target"


def test_systemd_names_with_a_suffix(tmp_path):
    files = systemd.render(make_plan(tmp_path, suffix="b"))
    assert set(files) == {*(f"switchyard-b-{r}.service" for r in ROLES), "switchyard-b.target"}
    worker = unit_sections(files["switchyard-b-worker.service"])
    assert dict(worker["Unit"])["PartOf"] == "switchyard-b.target"
    assert "switchyard-b-scheduler.service" in dict(worker["Unit"])["After"]
    assert systemd.units_dir("/home/u", {}) == Path("/home/u/.config/systemd/user")
    assert systemd.units_dir("/home/u", {"XDG_CONFIG_HOME": "/c"}) == Path("/c/systemd/user")


def test_systemd_quoting():
    assert systemd.quote("/plain/path-1.0") == "/plain/path-1.0"
    assert systemd.quote("50%") == "50%%"
    assert systemd.quote("a b") == '"a b"'
    assert systemd.quote('$HOME "x"') == '"$$HOME \\"x\\""'
    assert systemd.quote("A=$x y", expands_variables=False) == '"A=$x y"'


def test_systemctl_show_is_parsed():
    fields = systemd.parse_show("ActiveState=active\nSubState=running\nMainPID=77\nNRestarts=2\n")
    from switchyard.deploy.service_cli import systemd_row

    assert systemd_row("switchyard-worker.service", fields) == [
        "switchyard-worker.service", "active (running)", "77", "2", "-"]


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def verify(directory: Path) -> str:
    """`systemd-analyze verify` on every unit in `directory`; its complaints (it exits 0 even
    for unknown keys or bad values, so its output is what counts)."""
    units = sorted(str(p) for p in directory.iterdir())
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", *units], capture_output=True, text=True,
                          timeout=60)
    output = done.stdout + done.stderr
    complaints = [line for line in output.splitlines() if str(directory) in line]
    if done.returncode != 0:
        complaints.append(f"exit {done.returncode}: {output.strip()}")
    return "\n".join(complaints)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    # The real interpreter, so that ExecStart's program exists, as verify checks.
    plan = unit_plan(Settings(runtime_dir=str(tmp_path / "run"), api_key=AWKWARD_KEY),
                     python=sys.executable, home=str(tmp_path), openblas=OPENBLAS, linux=True)
    good = tmp_path / "good"
    good.mkdir()
    for name, text in systemd.render(plan).items():
        (good / name).write_text(text)
    assert verify(good) == ""
    # ... and verify would notice a broken unit.
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, text in systemd.render(plan).items():
        (bad / name).write_text(text.replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in verify(bad)
