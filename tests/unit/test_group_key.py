"""The worker group's key file (common/group_key.py): written 0600 and never over another file,
read back only when no other user can read it and its keys belong together; the settings
refuse a TCP scheduler address without one (docs/design/worker-groups.md "Pages per rank")."""

from __future__ import annotations

import json
import os
import stat

import pytest
import zmq

from switchyard.deploy.cli import main
from switchyard.common.group_key import read_group_key, write_group_key
from switchyard.common.settings import Settings, SettingsError


def test_a_new_key_file_is_private_and_reads_back(tmp_path):
    path = tmp_path / "group.key"
    os.umask(0o022)
    written = write_group_key(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_group_key(str(path)) == written
    assert zmq.curve_public(written.server_secret) == written.server_public
    assert zmq.curve_public(written.client_secret) == written.client_public
    assert written.server_public != written.client_public
    assert write_group_key(str(tmp_path / "other.key")) != written  # fresh keys every time


def test_an_existing_file_is_never_overwritten(tmp_path):
    path = tmp_path / "group.key"
    path.write_text("keep me")
    with pytest.raises(SettingsError, match="exists; not overwriting"):
        write_group_key(str(path))
    assert path.read_text() == "keep me"


def test_the_command_writes_a_key_and_refuses_to_overwrite_it(tmp_path, capsys):
    path = tmp_path / "group.key"
    assert main(["group-key", "--out", str(path)]) == 0
    first = path.read_text()
    assert main(["group-key", "--out", str(path)]) == 2
    assert path.read_text() == first
    assert "not overwriting" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_key_file_others_can_read_is_refused(tmp_path, mode):
    path = tmp_path / "group.key"
    write_group_key(str(path))
    path.chmod(mode)
    with pytest.raises(SettingsError, match=f"accessible to its group or other users: chmod 600 {path}"):
        read_group_key(str(path))


def test_a_missing_or_malformed_key_file_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="No such file"):
        read_group_key(str(tmp_path / "absent.key"))
    path, other_path = tmp_path / "group.key", tmp_path / "other.key"
    write_group_key(str(path))
    write_group_key(str(other_path))
    good, other = json.loads(path.read_text()), json.loads(other_path.read_text())
    for bad in ("not json", json.dumps({**good, "format": "x"}),
                json.dumps({k: v for k, v in good.items() if k != "client_secret"}),
                json.dumps({**good, "client_secret": other["client_secret"]}),
                json.dumps({**good, "server_secret": "short"})):
        path.write_text(bad)
        with pytest.raises(SettingsError, match="is not a group key file"):
            read_group_key(str(path))


def test_serve_and_rank_refuse_a_tcp_address_without_a_usable_key(tmp_path, capsys):
    address = "tcp://127.0.0.1:5510"
    with pytest.raises(SettingsError, match="needs --group-key-file: make one with "
                                            "`switchyard group-key --out PATH`"):
        Settings(scheduler_address=address).validate()
    key = tmp_path / "group.key"
    write_group_key(str(key))
    key.chmod(0o644)
    for command in ("serve", "rank"):
        assert main([command, "--scheduler-address", address]) == 2
        assert "needs --group-key-file" in capsys.readouterr().err
        assert main([command, "--scheduler-address", address, "--group-key-file", str(key)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"accessible to its group or other users: chmod 600 {key}")
        assert len(err.splitlines()) == 1


def test_the_key_file_path_reaches_children_but_never_its_contents(tmp_path):
    key = tmp_path / "group.key"
    written = write_group_key(str(key))
    args = Settings(group_key_file=str(key)).to_args("kvstore")
    assert args[args.index("--group-key-file") + 1] == str(key)
    assert not any(written.client_secret.decode() in a or written.server_secret.decode() in a
                   for a in args)


def test_a_rank_hosts_units_name_the_key_file_by_absolute_path(tmp_path, monkeypatch):
    from switchyard.deploy.service_units import program_arguments, unit_plan

    hosts = tmp_path / "hosts.json"  # rank 0 is another machine (documentation space)
    hosts.write_text(json.dumps([{"ssh": "a", "ips": ["192.0.2.7"]},
                                 {"ssh": "b", "ips": ["127.0.0.1"]}]))
    write_group_key(str(tmp_path / "group.key"))
    monkeypatch.chdir(tmp_path)
    settings = Settings(model="/models/m", hostfile=str(hosts), rank=1,
                        runtime_dir=str(tmp_path / "run"), kv_dir=str(tmp_path / "kv"),
                        cache_dir=str(tmp_path / "cache"),
                        scheduler_address="tcp://192.0.2.7:5510", group_key_file="group.key")
    plan = unit_plan(settings, python="/venv/bin/python", home="/home/u", linux=True)
    argv = program_arguments(plan, "kvstore.1")
    assert argv[argv.index("--group-key-file") + 1] == str(tmp_path / "group.key")
    assert argv[argv.index("--scheduler-address") + 1] == "tcp://192.0.2.7:5510"
