"""A worker group of 2 ranks over the ring backend on loopback (docs/design/worker-groups.md "Worker groups").

Greedy output through the HTTP API equals the 1-rank answer (mlx_lm's own greedy tokens, as in
test_parity: the 1-rank server is held to those) for tensor parallelism (qwen3 and qwen3_moe
twins) and pipeline parallelism (qwen3_moe), also where drafts are verified; kill -9 of rank 1 restarts the whole local group
and the next turn succeeds with the same tokens; so does a rank 1 that stops answering without
closing its connection (SIGSTOP: a powered-off or frozen Mac), through rank 0's watchdog. One
group per (model, mode), shared by the module's checks: each start loads MLX in two worker
processes.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.e2e.test_parity import (
    MAX_TOKENS,
    assert_same_as_reference,
    greedy_reference,
    served_completion,
)
from switchyard.testing.group import ServerGroup, free_port_pair, stop_all

SHORT_TEXT = "The old mill stands by the river, and every morning the miller"
# Longer than one prefill chunk (--prefill-chunk 128 below): chunked prefill on every rank.
LONG_TEXT = " ".join(f"Line {i}: the {w} river runs past the {w} hill." for i, w in
                     enumerate(["north", "south", "east", "west"] * 4))
MODES = [("qwen3", "tensor"), ("qwen3_moe", "tensor"), ("qwen3_moe", "pipeline")]
# --group-timeout-s: long enough that no step or idle ping of a tiny model waits this long on
# a loaded CI machine (the longest step seen at load 10: 0.6 s), short enough for a test.
LIMIT_S = 8


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
                       str(free_port_pair()), "--prefill-chunk", "128",
                       "--group-timeout-s", str(LIMIT_S),
                       # every whole draft verified, whatever a pass costs (timings vary)
                       "--speculative", "suffix")).start()
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


def test_the_ranks_keep_the_same_verified_tokens(groups, reference, tiny_model_dir):
    """Speculative decoding in a group: rank 0 samples every verify position and shares the
    tokens, so every rank keeps the same ones (docs/design/speculative-decoding.md "Speculative decoding"). A
    prompt sent a second time is drafted from the first time's reply."""
    group = groups("qwen3", "tensor")
    model, tokenizer = reference(tiny_model_dir("qwen3"))
    prompt_ids = tokenizer.encode(LONG_TEXT + " Again:")
    expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
    served_completion(group, prompt_ids)
    reply = served_completion(group, prompt_ids)
    assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)
    [done] = [e for e in group.wait_events("request.finished", rid=reply.id, role="scheduler")
              if "num_accepted_tokens" in e]
    assert done["num_accepted_tokens"] > MAX_TOKENS // 2


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


def test_a_rank_that_stops_answering_restarts_the_group(groups, reference, tiny_model_dir):
    """SIGSTOP of rank 1 keeps its sockets open, so no collective fails: rank 0's next idle
    PING (or step) just waits. Its watchdog logs `group.peer_timeout` and exits 1, the
    supervisor SIGKILLs the stopped rank and starts both; without the watchdog the restart
    never comes (docs/design/worker-groups.md "Worker groups", "Failures")."""
    group = groups("qwen3", "tensor")
    model, tokenizer = reference(tiny_model_dir("qwen3"))
    first_ids = tokenizer.encode(SHORT_TEXT)
    first = greedy_reference(model, tokenizer, first_ids, MAX_TOKENS)
    assert_same_as_reference(served_completion(group, first_ids), tokenizer, first, MAX_TOKENS)
    assert not group.log_events("group.peer_timeout")  # never while the peer answers
    exits_before = len(group.log_events("component.exited"))
    lost_before = len(group.log_events("group.rank_lost"))

    rank0 = group.pid_of("worker")
    rank1 = group.kill("worker.1", signal.SIGSTOP)
    try:
        group.wait_restarted("worker", rank0, timeout_s=LIMIT_S + 60)
        group.wait_restarted("worker.1", rank1)
    except BaseException:
        _resume_if_ours(group, rank1)  # so the group can stop
        raise

    timeouts = group.log_events("group.peer_timeout")
    assert [(e["role"], e["rank"]) for e in timeouts] == [("worker", 0)]
    # Idle: the PING; or a step the scheduler sent after the reply (staging its pages).
    assert re.fullmatch(r"ping|(broadcast of )?step \d+", timeouts[0]["operation"])
    assert timeouts[0]["waited_s"] >= LIMIT_S and timeouts[0]["hosts"] == ["mac-a", "mac-b"]
    exits = [e for e in group.log_events("component.exited")[exits_before:]
             if e["role"] == "worker"]
    assert [e["exit_code"] for e in exits] == [1]
    lost = group.log_events("group.rank_lost")[lost_before:]
    assert [e["role"] for e in lost] == ["worker"]

    follow_ids = first_ids + first[:20] + tokenizer.encode(" Then the miller said")
    expected = greedy_reference(model, tokenizer, follow_ids, MAX_TOKENS)
    assert_same_as_reference(served_completion(group, follow_ids), tokenizer, expected,
                             MAX_TOKENS)


def _resume_if_ours(group: ServerGroup, pid: int) -> None:
    try:
        if os.getpgid(pid) == group.supervisor_pid:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
