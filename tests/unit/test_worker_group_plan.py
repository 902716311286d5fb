"""Worker groups without sockets or MLX: the hostfile, which entries are this machine, the ring
hostfile and environment a rank gets, the step broadcast's framing, the supervisor's children
and the page namespace of a rank's share (docs/design/worker-groups.md "Worker groups")."""

import json

import numpy as np
import pytest

from switchyard.deploy.group_roles import rank_roles, restarted_together, serve_roles, split_role
from switchyard.deploy.supervisor import component_command
from switchyard.common.hostfile import (
    HostfileError,
    is_local,
    layout_tag,
    local_ranks,
    parse_hostfile,
    rank_environment,
    ring_hosts,
)
from switchyard.common.page_ids import kv_namespace
from switchyard.common.settings import Settings, SettingsError

TWO_MACS = json.dumps([{"ssh": "mac-a", "ips": ["10.0.0.1"]},
                       {"ssh": "mac-b", "ips": ["10.0.0.2", "10.0.1.2"]}])


def test_hostfile_list_form():
    hostfile = parse_hostfile(TWO_MACS)
    assert hostfile.size == 2 and hostfile.backend == "" and hostfile.envs == ()
    assert [(h.rank, h.ssh, h.ips) for h in hostfile.hosts] == [
        (0, "mac-a", ("10.0.0.1",)), (1, "mac-b", ("10.0.0.2", "10.0.1.2"))]


def test_hostfile_object_form_with_backend_and_envs():
    hostfile = parse_hostfile(json.dumps({
        "backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"],
        "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
                  {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]}]}))
    assert hostfile.backend == "jaccl" and hostfile.envs == ("MLX_METAL_FAST_SYNCH=1",)
    assert hostfile.hosts[1].rdma == ("rdma_en3", None)


@pytest.mark.parametrize("text,message", [
    ("{nope", "not JSON"),
    ("[]", "non-empty list"),
    ('{"hosts": []}', "non-empty list"),
    ('{"backend": "nccl2", "hosts": [{"ssh": "a", "ips": ["1.2.3.4"]}]}', "not one of"),
    ('{"envs": ["NOEQUALS"], "hosts": [{"ssh": "a", "ips": ["1.2.3.4"]}]}', "NAME=value"),
    ('[{"ssh": "a", "ips": "1.2.3.4"}]', '"ips" must be a list'),
    ('["a"]', "must be an object"),
])
def test_hostfile_errors_say_what_is_wrong(text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text)


def test_an_entry_is_local_when_one_of_its_ips_binds_here():
    hostfile = parse_hostfile(TWO_MACS)
    binds = {"10.0.1.2"}.__contains__
    assert not is_local(hostfile.hosts[0], binds)
    assert is_local(hostfile.hosts[1], binds)
    assert local_ranks(hostfile, binds) == [1]


def test_loopback_entries_are_always_local():
    hostfile = parse_hostfile(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]},
                                          {"ssh": "b", "ips": ["::1"]}]))
    assert local_ranks(hostfile, lambda ip: False) == [0, 1]


def test_ring_hosts_are_what_mlx_launch_writes():
    """One "ip:port" per ip, ports counted up from --dist-port across all ranks."""
    assert ring_hosts(parse_hostfile(TWO_MACS), 5520) == [
        ["10.0.0.1:5520"], ["10.0.0.2:5521", "10.0.1.2:5522"]]
    v6 = parse_hostfile(json.dumps([{"ssh": "a", "ips": ["fe80::1"]},
                                    {"ssh": "b", "ips": ["fe80::2"]}]))
    assert ring_hosts(v6, 7000) == [["[fe80::1]:7000"], ["[fe80::2]:7001"]]
    with pytest.raises(HostfileError, match="needs ips"):
        ring_hosts(parse_hostfile('[{"ssh": "a"}, {"ssh": "b", "ips": ["1.2.3.4"]}]'), 5520)


def test_rank_environment_for_the_ring_backend(tmp_path):
    hostfile = parse_hostfile(json.dumps({"envs": ["A=1"], "hosts": json.loads(TWO_MACS)}))
    env = rank_environment(hostfile, "ring", 1, 6000, tmp_path)
    assert env["MLX_RANK"] == "1" and env["A"] == "1"
    assert json.loads(open(env["MLX_HOSTFILE"]).read()) == [
        ["10.0.0.1:6000"], ["10.0.0.2:6001", "10.0.1.2:6002"]]


def test_the_mpi_backend_is_refused_clearly(tmp_path):
    with pytest.raises(HostfileError, match="mpirun"):
        rank_environment(parse_hostfile(TWO_MACS), "mpi", 0, 6000, tmp_path)


def test_rank_environment_for_jaccl_names_the_coordinator(tmp_path):
    env = rank_environment(parse_hostfile(TWO_MACS), "jaccl", 0, 6000, tmp_path)
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:6000"
    assert "MLX_IBV_DEVICES" in env


def test_step_broadcast_framing_round_trips_through_a_sum_with_zeros():
    """What an all_sum computes when every other rank adds zeros: the sender's frame. A short
    payload fits the frame (one collective); a long one's rest follows."""
    from switchyard.worker.group import FRAME_BYTES, PING, STEP, decode_frame, encode_frame

    short = bytes(range(256)) * 3
    frame, rest = encode_frame(STEP, short)
    assert frame.shape == (FRAME_BYTES,) and rest == b""
    assert decode_frame(frame + np.zeros_like(frame)) == (STEP, len(short), short)
    long = bytes(range(256)) * 40
    frame, rest = encode_frame(STEP, long)
    kind, length, head = decode_frame(frame)
    assert (kind, length) == (STEP, len(long)) and head + rest == long
    assert decode_frame(encode_frame(PING, b"")[0]) == (PING, 0, b"")


def test_step_broadcast_framing_rejects_garbage():
    from switchyard.worker.group import GroupError, decode_frame, encode_frame

    with pytest.raises(ValueError):
        encode_frame(9, b"x")
    with pytest.raises(GroupError, match="out of step"):
        decode_frame(np.arange(64, dtype=np.uint8))


def _settings(tmp_path, **kw) -> Settings:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]},
                                {"ssh": "b", "ips": ["127.0.0.1"]},
                                {"ssh": "c", "ips": ["192.0.2.7"]}]))
    return Settings(hostfile=str(path), **kw)


def test_serve_starts_a_worker_for_every_local_entry(tmp_path):
    roles = serve_roles(_settings(tmp_path), can_bind=lambda ip: False)
    # ...and a kvstore for every local rank (docs/design/worker-groups.md "Pages per rank")
    assert roles == ("scheduler", "kvstore", "kvstore.1", "worker.1", "worker", "gateway")
    assert restarted_together(roles) == ("worker.1", "worker")
    assert serve_roles(Settings()) == ("scheduler", "kvstore", "worker", "gateway")
    assert restarted_together(serve_roles(Settings())) == ()


def test_serve_needs_rank_0_here(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "far", "ips": ["192.0.2.7"]},
                                {"ssh": "b", "ips": ["127.0.0.1"]}]))
    with pytest.raises(HostfileError, match="rank 0 .far. is not this machine"):
        serve_roles(Settings(hostfile=str(path)), can_bind=lambda ip: False)


def test_a_group_of_one_host_is_refused(tmp_path):
    path = tmp_path / "one.json"
    path.write_text('[{"ssh": "a", "ips": ["127.0.0.1"]}]')
    with pytest.raises(HostfileError, match="needs two or more"):
        serve_roles(Settings(hostfile=str(path)))


def test_a_rank_host_runs_that_rank_alone(tmp_path):
    assert rank_roles(_settings(tmp_path, rank=2)) == ("kvstore.2", "worker.2")
    with pytest.raises(HostfileError, match="--rank must be 1..2"):
        rank_roles(_settings(tmp_path, rank=0))


def test_rank_children_run_the_base_role_with_their_rank(tmp_path):
    settings = _settings(tmp_path)
    cmd = component_command("worker.1", settings)
    assert cmd[cmd.index("run") + 1] == "worker"
    assert cmd[cmd.index("--rank") + 1] == "1"
    assert split_role("kvstore.3") == ("kvstore", 3) and split_role("worker") == ("worker", 0)
    with pytest.raises(ValueError):
        split_role("gateway.x")


def test_group_settings_are_checked():
    with pytest.raises(SettingsError, match="--parallel"):
        Settings(parallel="sequence").validate()
    with pytest.raises(SettingsError, match="--backend"):
        Settings(backend="tcp").validate()
    with pytest.raises(SettingsError, match="--group-timeout-s"):
        Settings(group_timeout_s=0).validate()
    assert Settings(backend="ring", parallel="pipeline").validate()


def test_a_share_has_its_own_namespace_and_a_single_worker_keeps_its_own():
    base = ("fp", "qwen3", "float32", 1, 256)
    single = kv_namespace(*base)
    assert kv_namespace(*base, "", "") == single  # unchanged: existing pages keep matching
    tags = [layout_tag("tensor", 2, 0), layout_tag("tensor", 2, 1), layout_tag("pipeline", 2, 0)]
    assert tags == ["tp2r0", "tp2r1", "pp2r0"]
    spaces = {kv_namespace(*base, "", tag) for tag in tags}
    assert len(spaces) == 3 and single not in spaces


def test_a_rank_hosts_banner_names_its_rank_and_no_http():
    from switchyard.deploy.cli import banner

    text = banner(Settings(model="m", hostfile="/h.json", rank=1), False, ("worker.1",))
    assert text.splitlines()[0].endswith("rank 1 of a worker group")
    assert "HTTP" not in text and "local ranks: worker.1" in text
    served = banner(Settings(model="m", hostfile="/h.json"), False,
                    ("scheduler", "kvstore", "worker.1", "worker", "gateway"))
    assert "HTTP" in served and "local ranks: worker.1, worker" in served


def test_ranks_started_with_different_settings_are_named():
    from switchyard.worker.group import mismatch

    same = {"model": "f", "--slots": 2, "--ctx": 4096}
    assert mismatch([same, dict(same)], ["a", "b"]) == ""
    line = mismatch([same, dict(same, **{"--ctx": 32768})], ["mac-a", "mac-b"])
    assert "disagree on --ctx" in line
    assert "rank 0 (mac-a): --ctx 4096; rank 1 (mac-b): --ctx 32768" in line
