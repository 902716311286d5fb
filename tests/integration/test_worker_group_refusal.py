"""A model mlx-lm cannot split the way --parallel asks is refused before any rank joins the
group: one line saying why and what to do, exit status 2, no restart loop
(docs/design/worker-groups.md "Worker groups")."""

import json
import subprocess
import sys
from importlib.metadata import version

from switchyard.testing.group import free_port, free_port_pair, short_tmp_dir
from tests.helpers.checkout import REPO_ROOT


MLX_LM = version("mlx-lm")


def _hostfile(directory) -> str:
    path = directory / "hosts.json"
    path.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]},
                                {"ssh": "b", "ips": ["127.0.0.1"]}]))
    return str(path)


def test_serve_refuses_pipeline_for_a_model_without_pipeline(tiny_model_dir):
    runtime = short_tmp_dir("sygr")
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "serve", "--model", str(tiny_model_dir("qwen3")),
         "--hostfile", _hostfile(runtime), "--parallel", "pipeline", "--slots", "2",
         "--ctx", "1024", "--runtime-dir", str(runtime), "--kv-dir", str(runtime / "kv"),
         "--port", str(free_port()), "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("switchyard worker:")]
    assert lines and set(lines) == {
        f"switchyard worker: qwen3 has no pipeline() in mlx-lm {MLX_LM}; use --parallel tensor"}
    assert "component.restarted" not in proc.stdout + proc.stderr
    assert not list(runtime.glob("*.pid"))


def test_a_worker_rank_refuses_a_model_without_shard_or_pipeline(tiny_model_dir):
    runtime = short_tmp_dir("sygr")
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "run", "worker",
         "--model", str(tiny_model_dir("gemma3_text")), "--hostfile", _hostfile(runtime),
         "--rank", "1", "--slots", "1", "--ctx", "1024", "--runtime-dir", str(runtime),
         "--kv-dir", str(runtime / "kv"), "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert lines == ["switchyard worker: gemma3_text has neither shard() nor pipeline() in "
                     f"mlx-lm {MLX_LM}: it cannot run as a worker group; serve it without "
                     "--hostfile"]


def test_a_group_of_one_broadcasts_and_shares_tokens_without_sockets():
    """The collectives' plumbing on a singleton group (no peers, no sockets)."""
    import mlx.core as mx

    from switchyard.common.hostfile import parse_hostfile
    from switchyard.worker.group import PING, STEP, RankGroup

    hostfile = parse_hostfile('[{"ssh": "a", "ips": ["127.0.0.1"]}]')
    group = RankGroup(mx.distributed.init(), hostfile, "tensor")
    assert (group.rank, group.size, group.host) == (0, 1, "a")
    assert group.broadcast_bytes(0, b"step bytes", STEP) == (STEP, b"step bytes")
    assert group.broadcast_bytes(0, b"long" * 3000, STEP) == (STEP, b"long" * 3000)
    assert group.broadcast_bytes(0, b"", PING) == (PING, b"")
    assert group.gather_bytes(b"mine") == [b"mine"]
    assert group.all_max(7) == 7
    assert group.share_tokens(mx.array([5, 9], dtype=mx.uint32)).tolist() == [5, 9]
    group.check_same({"--slots": 2})
    assert group.stats.take()[1] == 5 and group.stats.num_broadcasts == 0


def test_ranks_started_with_different_settings_refuse_alike(tiny_model_dir):
    """Rank 1 started by hand with another --ctx: both ranks form the group, compare, and
    refuse with the same line (exit 2) instead of diverging on the first step."""
    runtime = short_tmp_dir("sygr")
    hosts = _hostfile(runtime)
    port = str(free_port_pair())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "switchyard.deploy.cli", "run", "worker", "--model",
         str(tiny_model_dir("qwen3")), "--hostfile", hosts, "--rank", str(rank),
         "--dist-port", port, "--slots", "1", "--ctx", str(1024 * (rank + 1)),
         "--runtime-dir", str(runtime), "--kv-dir", str(runtime / "kv"), "--log-format", "json"],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for rank in (0, 1)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 2, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("switchyard worker:")]
        assert lines == ["switchyard worker: the worker group's ranks disagree on --ctx "
                         "(rank 0 (a): --ctx 1024; rank 1 (b): --ctx 2048); start every rank "
                         "with the same model and settings"]
