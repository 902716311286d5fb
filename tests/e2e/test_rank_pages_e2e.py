"""Pages per rank through whole 2-rank groups (ring backend on loopback): each rank's share of
every page goes to its own kvstore; restores read both (docs/design/worker-groups.md "Pages per rank"). A
tensor group (qwen3 twin, `--slots 1`) is shared by most checks; a pipeline group (qwen3_moe
twin: each rank holds its own layers' KV) proves a restore of layer shares."""

from __future__ import annotations

import json
import time

import openai
import pytest

from switchyard.kvstore.store import read_entries
from tests.e2e.test_worker_group import free_port_pair
from switchyard.testing.group import ServerGroup
from switchyard.proto.status import Status
from switchyard.testing.workload import text, wait_ready, wait_written

P = 256


def client_of(group: ServerGroup) -> openai.OpenAI:
    # A turn that waits this long is a hang (a page that never lands), not a slow machine.
    return openai.OpenAI(base_url=group.base_url, api_key="none", timeout=180, max_retries=0)


def written_through(group: ServerGroup) -> Status:
    """Status once no page is on its way to disk (every rank's write answered), written after
    the turn just answered."""
    return wait_written(group, 1, time.time())


class Conversation:
    def __init__(self, client: openai.OpenAI, seed: int):
        self.client = client
        self.model = client.models.list().data[0].id
        self.seed = seed
        self.messages = [{"role": "system", "content": text(seed, 200)},
                         {"role": "user", "content": text(seed + 1, 60)}]
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []

    def turn(self, max_tokens: int = 8) -> str:
        resp = self.client.chat.completions.create(
            model=self.model, messages=self.messages, max_tokens=max_tokens, temperature=0)
        self.prompt_tokens.append(resp.usage.prompt_tokens)
        self.cached_tokens.append(resp.usage.prompt_tokens_details.cached_tokens)
        reply = resp.choices[0].message.content or ""
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "user", "content": text(self.seed * 10 + len(self.messages),
                                                           300)}]
        return reply


def rank_group(model_dir, parallel: str, tmp_path_factory):
    hostfile = tmp_path_factory.mktemp("hosts") / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "rank0", "ips": ["127.0.0.1"]},
                                    {"ssh": "rank1", "ips": ["127.0.0.1"]}]))
    extra = ("--hostfile", str(hostfile), "--parallel", parallel, "--dist-port",
             str(free_port_pair()))
    return ServerGroup(model_dir, slots=1, ctx=8192, extra=extra, startup_timeout_s=300,
                       extra_roles=("worker.1", "kvstore.1"))


@pytest.fixture(scope="module")
def ranks2(tiny_qwen3, tmp_path_factory):
    with rank_group(tiny_qwen3, "tensor", tmp_path_factory) as group:
        wait_ready(group)
        yield group


def test_each_rank_writes_its_share_to_its_own_kvstore(ranks2):
    client = client_of(ranks2)
    Conversation(client, 5).turn()
    status = written_through(ranks2)
    rank0, bad0 = read_entries(ranks2.kv_dir)
    rank1, bad1 = read_entries(ranks2.kv_dir / "rank-1")
    assert bad0 == bad1 == 0 and rank0
    assert {e.path.name for e in rank0} == {e.path.name for e in rank1}  # same page ids
    assert [(r.rank, r.kvstore, r.kvstore_state) for r in status.ranks] == [
        (0, "kvstore", "ready"), (1, "kvstore.1", "ready")]


def restored_equals_in_memory(group: ServerGroup) -> None:
    client = client_of(group)
    a, b = Conversation(client, 31), Conversation(client, 42)
    a.turn()
    messages = list(a.messages)
    in_memory = a.turn(max_tokens=24)  # resident in the one slot
    a.messages = messages
    b.turn()  # takes the slot: A is on both ranks' disks only
    from_disk = a.turn(max_tokens=24)
    assert a.cached_tokens[-1] >= a.prompt_tokens[-1] - P, a.cached_tokens
    assert from_disk == in_memory


def test_restored_from_disk_continues_as_in_memory(ranks2):
    restored_equals_in_memory(ranks2)


def test_pipeline_layer_shares_restore_as_in_memory(tiny_model_dir, tmp_path_factory):
    with rank_group(tiny_model_dir("qwen3_moe"), "pipeline", tmp_path_factory) as group:
        wait_ready(group)
        restored_equals_in_memory(group)
        rank1, bad1 = read_entries(group.kv_dir / "rank-1")
        assert rank1 and bad1 == 0


def test_switching_re_reads_only_the_new_tokens(ranks2):
    """A/B/A on one slot: A's second turn restores all it had (cached = prompt - new)."""
    client = client_of(ranks2)
    a, b = Conversation(client, 51), Conversation(client, 62)
    a.turn()
    b.turn()
    a.turn()
    new = a.prompt_tokens[1] - a.prompt_tokens[0]
    assert a.cached_tokens[1] >= a.prompt_tokens[1] - new, (a.prompt_tokens, a.cached_tokens)


@pytest.mark.parametrize("role", ["worker.1", "kvstore.1"])
def test_kill_one_rank_then_next_turn_restores_from_pages(ranks2, role):
    client = client_of(ranks2)
    conv = Conversation(client, 70 + len(role))
    conv.turn()
    Conversation(client, 90 + len(role)).turn()  # takes the one slot: conv is on disk only
    written_through(ranks2)
    worker = ranks2.pid_of("worker")
    old = ranks2.kill(role)
    new = ranks2.wait_restarted(role, old, timeout_s=120)
    if role.startswith("worker"):  # the whole local worker group restarts, rank 0 included
        role, new = "worker", ranks2.wait_restarted("worker", worker, timeout_s=120)
    wait_ready(ranks2, role, new)  # the scheduler has seen the new process
    for _ in range(60):  # 503 until the gateway sees the group ready again
        try:
            conv.turn()
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
    assert len(conv.cached_tokens) == 2
    assert conv.cached_tokens[-1] > 0, (role, conv.cached_tokens)
    assert conv.cached_tokens[-1] >= conv.prompt_tokens[0] - P
