"""Persistent paged KV through the whole group: switching, restarts, disk use.

Conversations go through the official `openai` client exactly as an agent sends them: the
whole history every turn, the last assistant turn sometimes a tool call and sometimes text.
`usage.prompt_tokens_details.cached_tokens` says how much of each prompt was not prefilled.
"""

from __future__ import annotations

import json
import shutil
import time

import openai
import pytest

from switchyard.kvstore.store import read_entries
from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import text, wait_ready, wait_written

P = 256


def wait_pages(group: ServerGroup, conv: "Conversation") -> None:
    """Until the pages of `conv`'s last prompt are on disk, none on their way."""
    wait_written(group, conv.prompt_tokens[-1] // P, time.time())


class Conversation:
    """An agent conversation: system prompt, user task, then tool results turn after turn."""

    TOOL = {"type": "function", "function": {
        "name": "lookup", "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}

    def __init__(self, client: openai.OpenAI, seed: int, system_words: int = 250):
        self.client = client
        self.model = client.models.list().data[0].id
        self.seed = seed
        self.messages = [{"role": "system", "content": text(seed, system_words)},
                         {"role": "user", "content": text(seed + 1, 60)}]
        self.prompt_tokens: list[int] = []
        self.completion_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.replies: list[str] = []

    def turn(self, max_tokens: int = 8) -> str:
        resp = self.client.chat.completions.create(
            model=self.model, messages=self.messages, tools=[self.TOOL], max_tokens=max_tokens,
            temperature=0)
        self.prompt_tokens.append(resp.usage.prompt_tokens)
        self.completion_tokens.append(resp.usage.completion_tokens)
        self.cached_tokens.append(resp.usage.prompt_tokens_details.cached_tokens)
        reply = resp.choices[0].message.content or ""
        self.replies.append(reply)
        return reply

    def add_tool_result(self, turn: int, as_tool_call: bool, num_words: int = 350) -> None:
        """The agent's next move: the reply was a tool call or plain text, then a tool result."""
        call_id = f"call_{self.seed}_{turn}"
        if as_tool_call:
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": f"t{turn}"})}}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id,
                                  "content": text(self.seed * 100 + turn, num_words)})
        else:
            self.messages.append({"role": "assistant", "content": self.replies[-1]})
            self.messages.append({"role": "user",
                                  "content": text(self.seed * 100 + turn, num_words)})


def prefilled(conv: Conversation, i: int) -> int:
    return conv.prompt_tokens[i] - conv.cached_tokens[i]


def new_tokens(conv: Conversation, i: int) -> int:
    return conv.prompt_tokens[i] - conv.prompt_tokens[i - 1]


@pytest.fixture(scope="module")
def one_slot(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384) as group:
        yield group


def test_switching_turns_prefill_only_their_new_tokens(one_slot):
    """One slot, A and B alternating for 8 turns, each adding a ~1000-token tool result:
    after the first turn of each, a turn prefills only its new tokens plus at most one
    partial page, whether the last assistant turn was a tool call or plain text."""
    client = openai.OpenAI(base_url=one_slot.base_url, api_key="none")
    convs = {"A": Conversation(client, 11), "B": Conversation(client, 22)}
    for turn in range(8):
        conv = convs["AB"[turn % 2]]
        conv.turn()
        i = len(conv.prompt_tokens) - 1
        if i >= 1:
            assert new_tokens(conv, i) > 700
            assert prefilled(conv, i) <= new_tokens(conv, i) + P, (turn, conv.prompt_tokens,
                                                                   conv.cached_tokens)
        conv.add_tool_result(turn, as_tool_call=turn % 4 < 2)
    restored = [e["num_restored_tokens"]
                for e in one_slot.wait_events("request.finished", 8, role="scheduler")]
    assert sum(1 for r in restored if r > 0) >= 6, "every switch restores from disk"


def test_restored_output_equals_in_memory_output(one_slot):
    """Greedy output after a restore from disk equals the same request served from memory."""
    client = openai.OpenAI(base_url=one_slot.base_url, api_key="none")
    a, b = Conversation(client, 33), Conversation(client, 44)
    a.turn()
    a.add_tool_result(0, as_tool_call=True)
    in_memory = a.turn(max_tokens=24)  # resident: served from the slot
    a.messages_snapshot = list(a.messages)
    b.turn()  # displaces A: its pages are on disk only
    from_disk = a.turn(max_tokens=24)
    assert a.cached_tokens[-1] >= a.prompt_tokens[-1] - P
    assert from_disk == in_memory


def test_disk_use_is_linear_in_unique_tokens(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=2, ctx=16384) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        convs = [Conversation(client, s) for s in (51, 52, 53)]
        for turn in range(3):
            for conv in convs:
                conv.turn()
                conv.add_tool_result(turn, as_tool_call=True, num_words=250)
        wait_pages(group, convs[-1])  # the last write-through landed
        entries, bad = read_entries(group.kv_dir)
    kv_bytes_per_token = 4096
    # Every token sequence the server saw: each conversation's last prompt, and every reply
    # (this agent sends back a tool call of its own, not the model's reply, so each reply is
    # a branch of its own).
    unique_tokens = sum(c.prompt_tokens[-1] + sum(c.completion_tokens) for c in convs)
    assert bad == 0
    # Superseded prefixes take no extra space: each full page is stored once.
    full = [e for e in entries if e.num_tokens == P]
    full_bytes = sum(e.nbytes for e in full)
    assert len(full) <= unique_tokens // P
    assert full_bytes <= 1.1 * unique_tokens * kv_bytes_per_token + len(full) * 2048
    # Partial pages (tails) remain only at each conversation's frontier: where its last prompt
    # and turn ended, the one its last turn resumed from (dropped once a turn passes it), and
    # the end of a reply that crossed into a page of its own branch (evicted by age): a
    # constant per conversation, not a share of its length.
    tails = [e for e in entries if e.num_tokens < P]
    assert len(tails) <= 4 * len(convs)
    disk = full_bytes + sum(e.nbytes for e in tails)
    tail_allowance = 4 * len(convs) * (P * kv_bytes_per_token + 2048)
    assert disk <= 1.1 * unique_tokens * kv_bytes_per_token + len(full) * 2048 + tail_allowance


def test_restart_whole_group_then_next_turn_restores(tiny_qwen3, tmp_path):
    kv_dir = tmp_path / "kv"
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384, kv_dir=kv_dir) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        conv = Conversation(client, 61)
        conv.turn()
        conv.add_tool_result(0, as_tool_call=True)
        wait_pages(group, conv)
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384, kv_dir=kv_dir) as group:
        wait_ready(group)
        conv.client = openai.OpenAI(base_url=group.base_url, api_key="none")
        conv.turn()
        assert conv.cached_tokens[-1] >= conv.prompt_tokens[0] - P
        scan = group.log_events("kvstore.scanned")
        assert scan and scan[0]["num_pages"] >= conv.prompt_tokens[0] // P


def test_pages_of_another_model_are_never_matched(one_slot, tiny_model_dir, tmp_path):
    """Same page directory (a copy of the shared group's: one kvstore per directory), another
    model: nothing restored, the old pages kept apart."""
    prompt = [{"role": "user", "content": text(77, 200)}]
    client = openai.OpenAI(base_url=one_slot.base_url, api_key="none")
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=prompt, max_tokens=4)
    wait_written(one_slot, resp.usage.prompt_tokens // P, time.time())
    kv_dir = tmp_path / "kv"
    shutil.copytree(one_slot.kv_dir, kv_dir, ignore=shutil.ignore_patterns("*.tmp"))
    other = tiny_model_dir("qwen3", seed=1)
    with ServerGroup(other, slots=1, ctx=8192, kv_dir=kv_dir) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(model=model, messages=prompt, max_tokens=4)
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        wait_written(group, resp.usage.prompt_tokens // P, time.time())
        entries, _ = read_entries(kv_dir)
    assert len({e.namespace for e in entries}) == 2


# The tests below kill components of the shared group: they run last on it.
@pytest.mark.parametrize("role", ["scheduler", "worker", "kvstore", "gateway"])
def test_restart_one_component_then_next_turn_restores(one_slot, role):
    client = openai.OpenAI(base_url=one_slot.base_url, api_key="none")
    conv = Conversation(client, 70 + len(role))
    other = Conversation(client, 90 + len(role))
    conv.turn()
    conv.add_tool_result(0, as_tool_call=False)
    other.turn()  # conv is now on disk only
    wait_pages(one_slot, other)
    old = one_slot.kill(role)
    new = one_slot.wait_restarted(role, old)
    wait_ready(one_slot, role, new)
    for _ in range(30):  # the gateway may answer 503 until it reconnects
        try:
            conv.turn()
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
    assert conv.cached_tokens[-1] >= conv.prompt_tokens[0] - P, (role, conv.cached_tokens)


def test_budget_is_printed_in_tokens_and_conversations(one_slot):
    """The disk budget is told at start in terms a user can size."""
    budget = one_slot.log_events("kv.budget")[0]  # again after each worker restart
    assert budget["budget_tokens"] == budget["budget_bytes"] // budget["kv_bytes_per_token"]
    assert budget["budget_conversations"] > 0
    assert "conversations of 100,000 tokens" in one_slot.log_text()
