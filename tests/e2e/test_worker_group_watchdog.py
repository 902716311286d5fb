"""A worker group comes back after a peer that stops answering without closing its connection
(docs/design.md "Worker groups", "Failures").

SIGSTOP of rank 1 is that peer (power loss, a frozen Mac, a pulled cable): its process keeps
its sockets open, so no collective fails; rank 0's next idle PING (or step) just waits. Rank 0's
watchdog logs `group.peer_timeout` and exits 1, the supervisor SIGKILLs the stopped rank
(SIGKILL needs no cooperation) and starts both, and the next turn gets the reference's greedy
tokens. One 2-rank group with a short --group-timeout-s; without the watchdog rank 0 waits
forever and the restart never comes.
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
from tests.helpers.group import ServerGroup, free_port_pair

TEXT = "The old mill stands by the river, and every morning the miller"
# Long enough that no step or idle ping of a tiny model waits this long on a loaded CI machine,
# short enough to keep the module to tens of seconds.
LIMIT_S = 8


@pytest.fixture(scope="module")
def group(tiny_model_dir, tmp_path_factory):
    hostfile = tmp_path_factory.mktemp("hosts") / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "mac-a", "ips": ["127.0.0.1"]},
                                    {"ssh": "mac-b", "ips": ["127.0.0.1"]}]))
    with ServerGroup(tiny_model_dir("qwen3"), slots=1, ctx=1024, extra_roles=("worker.1",),
                     extra=("--hostfile", str(hostfile), "--dist-port", str(free_port_pair()),
                            "--group-timeout-s", str(LIMIT_S))) as running:
        yield running


def test_a_rank_that_stops_answering_restarts_the_group(group, tiny_model_dir):
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(tiny_model_dir("qwen3")))
    first_ids = tokenizer.encode(TEXT)
    first = greedy_reference(model, tokenizer, first_ids, MAX_TOKENS)
    assert_same_as_reference(served_completion(group, first_ids), tokenizer, first, MAX_TOKENS)
    assert not group.log_events("group.peer_timeout")  # never while the peer answers

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
    exits = [e for e in group.log_events("component.exited") if e["role"] == "worker"]
    assert [e["exit_code"] for e in exits] == [1]
    assert [e["role"] for e in group.log_events("group.rank_lost")] == ["worker"]

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
