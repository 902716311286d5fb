"""A worker group of 2 ranks over the ring backend on loopback (docs/design.md "Worker groups").

Greedy output through the HTTP API equals the 1-rank answer (mlx_lm's own greedy tokens, as in
test_parity: the 1-rank server is held to those) for tensor parallelism (qwen3 and qwen3_moe
twins) and pipeline parallelism (qwen3_moe); kill -9 of rank 1 restarts the whole local group
and the next turn succeeds with the same tokens. One group per (model, mode), shared by the
module's checks: each start loads MLX in two worker processes.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.e2e.test_parity import (
    MAX_TOKENS,
    assert_same_as_reference,
    greedy_reference,
    served_completion,
)
from tests.helpers.group import ServerGroup, free_port_pair, stop_all

SHORT_TEXT = "The old mill stands by the river, and every morning the miller"
# Longer than one prefill chunk (--prefill-chunk 128 below): chunked prefill on every rank.
LONG_TEXT = " ".join(f"Line {i}: the {w} river runs past the {w} hill." for i, w in
                     enumerate(["north", "south", "east", "west"] * 4))
MODES = [("qwen3", "tensor"), ("qwen3_moe", "tensor"), ("qwen3_moe", "pipeline")]


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hosts") / "hosts.json"
    path.write_text(json.dumps([{"ssh": "mac-a", "ips": ["127.0.0.1"]},
                                {"ssh": "mac-b", "ips": ["127.0.0.1"]}]))
    return path


@pytest.fixture(scope="module")
def groups(tiny_model_dir, hostfile):
    """(arch, mode) -> running 2-rank ServerGroup, started on first use."""
    started: dict[tuple[str, str], ServerGroup] = {}

    def get(arch: str, mode: str) -> ServerGroup:
        if (arch, mode) not in started:
            started[arch, mode] = ServerGroup(
                tiny_model_dir(arch), slots=2, ctx=2048, extra_roles=("worker.1",),
                extra=("--hostfile", str(hostfile), "--parallel", mode, "--dist-port",
                       str(free_port_pair()), "--prefill-chunk", "128")).start()
        return started[arch, mode]

    yield get
    stop_all(started.values())


@pytest.fixture(scope="module")
def reference():
    from mlx_lm import load as mlx_load

    loaded = {}

    def get(path):
        if path not in loaded:
            loaded[path] = mlx_load(str(path))
        return loaded[path]

    return get


@pytest.mark.parametrize("arch,mode", MODES)
def test_group_greedy_tokens_equal_one_rank(groups, reference, tiny_model_dir, arch, mode):
    group = groups(arch, mode)
    model, tokenizer = reference(tiny_model_dir(arch))
    for text in (SHORT_TEXT, LONG_TEXT):
        prompt_ids = tokenizer.encode(text)
        expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
        assert len(expected) >= 10, "the reference stops too early to compare anything"
        reply = served_completion(group, prompt_ids)
        assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)
    ready = [e for e in group.log_events("worker.group_ready")]
    assert sorted(e["rank"] for e in ready) == [0, 1]
    assert {e["parallel"] for e in ready} == {mode}


def test_losing_a_rank_restarts_the_group_and_the_next_turn_succeeds(
        groups, reference, tiny_model_dir):
    group = groups("qwen3", "tensor")
    model, tokenizer = reference(tiny_model_dir("qwen3"))
    first_ids = tokenizer.encode(SHORT_TEXT)
    first = greedy_reference(model, tokenizer, first_ids, MAX_TOKENS)
    assert_same_as_reference(served_completion(group, first_ids), tokenizer, first, MAX_TOKENS)

    rank0 = group.pid_of("worker")
    group.kill("worker.1", signal.SIGKILL)
    group.wait_restarted("worker", rank0)  # the survivor is restarted with the lost rank
    group.wait_restarted("worker.1", -1)

    follow_ids = first_ids + first[:20] + tokenizer.encode(" Then the miller said")
    expected = greedy_reference(model, tokenizer, follow_ids, MAX_TOKENS)
    assert_same_as_reference(served_completion(group, follow_ids), tokenizer, expected,
                             MAX_TOKENS)
    lost = group.log_events("group.rank_lost")
    assert lost and lost[0]["role"] == "worker.1"
