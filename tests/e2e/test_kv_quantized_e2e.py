"""Quantized KV (--kv-bits 8) through the whole group and the official client: switching turns
re-read only their new tokens, a restored turn continues exactly as in memory, pages and the
budget line count the quantized bytes, and pages of another setting never match."""

from __future__ import annotations

import shutil
import time

import openai
import pytest

from switchyard.kvstore.store import read_entries
from tests.e2e.test_kv_persistence import Conversation, new_tokens, prefilled
from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import wait_written

P = 256
KV8_BYTES_PER_TOKEN = 1152  # tiny qwen3: 4 layers x K,V x 2 heads x (64 B packed + 2 f32 / 64)


@pytest.fixture(scope="module")
def kv8(tiny_qwen3, tmp_path_factory):
    kv_dir = tmp_path_factory.mktemp("kv8")
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384, kv_dir=kv_dir,
                     extra=("--kv-bits", "8")) as group:
        yield group


def test_switching_turns_reread_only_new_tokens(kv8):
    """One slot, A/B/A/B: every switch restores the other conversation's quantized pages from
    disk and prefills only what the conversation added."""
    client = openai.OpenAI(base_url=kv8.base_url, api_key="none")
    convs = {"A": Conversation(client, 111), "B": Conversation(client, 122)}
    for turn in range(4):
        conv = convs["AB"[turn % 2]]
        conv.turn()
        i = len(conv.prompt_tokens) - 1
        if i >= 1:
            assert prefilled(conv, i) <= new_tokens(conv, i) + P, (conv.prompt_tokens,
                                                                   conv.cached_tokens)
        conv.add_tool_result(turn, as_tool_call=turn % 2 == 0)
    finished = kv8.wait_events("request.finished", 4, role="scheduler")
    assert [e["num_restored_tokens"] > 0 for e in finished] == [False, False, True, True]


def test_restored_turn_continues_as_in_memory(kv8):
    client = openai.OpenAI(base_url=kv8.base_url, api_key="none")
    a, b = Conversation(client, 133), Conversation(client, 144)
    a.turn()
    a.add_tool_result(0, as_tool_call=True)
    in_memory = a.turn(max_tokens=24)
    b.turn()  # displaces A: its quantized pages are on disk only
    from_disk = a.turn(max_tokens=24)
    assert a.cached_tokens[-1] >= a.prompt_tokens[-1] - P
    assert from_disk == in_memory


def test_pages_and_budget_count_quantized_bytes(kv8):
    budget = kv8.log_events("kv.budget")[0]
    assert (budget["kv_bits"], budget["kv_bytes_per_token"]) == (8, KV8_BYTES_PER_TOKEN)
    assert "bytes/token, 8-bit KV" in kv8.log_text()
    wait_written(kv8, 1, time.time())  # the last write-through landed
    entries, bad = read_entries(kv8.kv_dir)
    full = [e for e in entries if e.num_tokens == P]
    assert bad == 0 and full
    for e in full:  # the packed form: 0.28x of this float32 model's 4096 bytes per token
        assert P * KV8_BYTES_PER_TOKEN <= e.nbytes <= P * KV8_BYTES_PER_TOKEN + 4096


def test_pages_of_another_kv_setting_are_never_matched(kv8, tiny_qwen3, tmp_path):
    """The 8-bit pages (a copy: one kvstore per directory), full-precision KV: nothing
    restored from them."""
    messages = Conversation(openai.OpenAI(base_url=kv8.base_url, api_key="none"), 111).messages
    wait_written(kv8, 1, time.time())
    kv_dir = tmp_path / "kv"
    shutil.copytree(kv8.kv_dir, kv_dir, ignore=shutil.ignore_patterns("*.tmp"))
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384, kv_dir=kv_dir) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                              tools=[Conversation.TOOL])
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        wait_written(group, resp.usage.prompt_tokens // P, time.time())
    assert len({e.namespace for e in read_entries(kv_dir)[0]}) == 2
