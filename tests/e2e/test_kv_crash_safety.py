"""Crash safety of the page store and eviction order under a small budget.

kill -9 the kvstore daemon while it writes, repeatedly: no partial or corrupt page is ever
restored, because a page is renamed into place only after fsync and every read is verified.
A planted corrupt page is a miss: removed, logged, and the output stays correct.
"""

from __future__ import annotations

import signal
import time

import httpx

import openai

from switchyard.kvstore.pages import decode_header
from switchyard.kvstore.store import PageStore, read_entries
from tests.e2e.test_kv_persistence import Conversation
from switchyard.testing.workload import text, wait_ready, wait_written
from switchyard.testing.group import ServerGroup

P = 256


def page_tokens(kv_dir) -> dict:
    """page file path -> its token ids, from the headers."""
    out = {}
    for entry in read_entries(kv_dir)[0]:
        with open(entry.path, "rb") as f:
            out[entry.path] = decode_header(f.read(65536)).token_ids
    return out


def test_kill_kvstore_while_writing_never_leaves_a_bad_page(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        model = client.models.list().data[0].id
        for round_ in range(3):
            # A long prompt: ~10 pages written through while we kill the daemon.
            messages = [{"role": "user", "content": text(500 + round_, 1000)}]
            started = time.monotonic()
            client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           temperature=0)
            old = group.kill("kvstore")
            new = group.wait_restarted("kvstore", old)
            wait_ready(group, "kvstore", new)
            print(f"round {round_}: {time.monotonic() - started:.1f}s")
        wait_written(group, 0, time.time())  # what the last kvstore was handed is on disk
        store = PageStore(group.kv_dir)
        pages = store.scan()
        assert store.num_corrupt_removed == 0
        assert not list(group.kv_dir.rglob("*.tmp")), "the daemon's scan removes leftovers"
        for info, tokens in zip(pages, page_tokens(group.kv_dir).values()):
            buf = bytearray(4 << 20)
            header = store.read_into(info.namespace, info.page_id, _tokens_of(store, info),
                                     memoryview(buf))
            assert header is not None, "every page on disk verifies"
        del tokens


def _tokens_of(store: PageStore, info) -> tuple:
    entry = store.get(info.page_id)
    with open(entry.path, "rb") as f:
        return decode_header(f.read(65536)).token_ids


def test_planted_corrupt_page_is_a_miss_and_output_stays_correct(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=16384) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        a, b = Conversation(client, 801), Conversation(client, 802)
        a.turn()
        a.add_tool_result(0, as_tool_call=True)
        reference = a.turn(max_tokens=16)  # served from memory
        b.turn()  # A now lives on disk only
        wait_written(group, a.prompt_tokens[-1] // P, time.time())
        prompt = _tokenizer(tiny_qwen3).apply_chat_template(
            a.messages, tools=[Conversation.TOOL], add_generation_prompt=True, tokenize=True)
        [target] = [path for path, tokens in page_tokens(group.kv_dir).items()
                    if list(tokens) == prompt[2 * P:3 * P]]  # A's third page
        raw = bytearray(target.read_bytes())
        raw[-100] ^= 0xFF  # flip a payload byte
        target.write_bytes(bytes(raw))
        again = a.turn(max_tokens=16)
        assert again == reference
        assert 2 * P <= a.cached_tokens[-1] < 3 * P, "pages before the bad one were restored"
        wait_written(group, a.prompt_tokens[-1] // P, time.time())
        # Removed, re-prefilled, and written through again: the file on disk is good now.
        assert target.read_bytes() != bytes(raw)
        assert read_entries(group.kv_dir)[1] == 0
        events = group.log_events("kv.corrupt_page")
        assert events and "checksum" in events[0]["reason"]


def _in_turn_on_a_small_budget(model_dir, seeds, extra=(), then=None):
    """Conversations under one system prompt, each sent once on one slot, with a disk budget
    of two of them (and one page more). Returns their prompts' pages (as token tuples), the
    shared ones, the pages on disk after the last, and the group's `kv.budget` line; `then`
    (the group, the client and the conversations) runs after, in the same group."""
    tok = _tokenizer(model_dir)
    system = text(900, 350)
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": text(seed, 500)}] for seed in seeds]
    prompts = [tok.apply_chat_template(m, tools=[Conversation.TOOL], add_generation_prompt=True,
                                       tokenize=True) for m in conversations]
    chains = [[tuple(p[i:i + P]) for i in range(0, len(p) // P * P, P)] for p in prompts]
    pages = [set(c) for c in chains]
    shared = set.intersection(*pages)
    assert shared, "the conversations share their system-prompt pages"
    budget = (len(pages[0] | pages[1]) + 1) * (P * 4096 + 2048)
    with ServerGroup(model_dir, slots=1, ctx=16384,
                     extra=["--kv-disk-budget", str(budget), *extra]) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        model = client.models.list().data[0].id
        for messages in conversations:
            client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           tools=[Conversation.TOOL], temperature=0)
            wait_written(group, 0, time.time())  # what it wrote landed before the next one
        on_disk = page_tokens(group.kv_dir)
        assert sum(p.stat().st_size for p in on_disk) <= budget, "never over budget"
        assert group.log_events("kv.evicted"), "the third conversation written needed room"
        # Every page here was used within the protection window: that is thrash, with advice.
        [thrash, *_] = group.log_events("kv.thrash")
        assert thrash["suggested_budget_bytes"] > budget
        [kv_budget] = group.log_events("kv.budget")
        if then is not None:
            then(group, client, conversations)
    stored = set(on_disk.values())
    assert shared <= stored, "the shared system prompt survives"
    kept_a = [page in stored for page in chains[0]]
    assert not all(kept_a), "the least recently used conversation lost pages"
    assert kept_a == sorted(kept_a, reverse=True), "...from its tail: what is kept is a prefix"
    return pages, shared, stored, kv_budget


def test_small_budget_evicts_least_recent_tail_and_keeps_system_prompt(tiny_qwen3):
    """The budget holds two conversations (and one page more); a third arrives. Each is
    written through as it fills."""
    pages, _, stored, kv_budget = _in_turn_on_a_small_budget(tiny_qwen3, (901, 902, 903))
    assert not kv_budget["writes_back"]
    assert pages[1] <= stored and pages[2] <= stored, "the two recent conversations are kept"


def test_small_budget_written_back_holds_what_left_memory_and_what_a_stop_leaves(tiny_qwen3):
    """The same budget with --kv-write-back: a slot's pages are written as it leaves memory
    (here, before the next conversation takes the only slot over), so each of four
    conversations writes the one before it; the fourth, still in memory, is not on disk. The
    worker is then asked to stop (SIGTERM, as `launchd restart worker` does): it runs on until
    the fourth is written, so its next turn, on the restarted worker, restores it whole."""
    def restart_worker(group, client, conversations):
        old = group.kill("worker", signal.SIGTERM)
        wait_ready(group, "worker", group.wait_restarted("worker", old))
        [stopping] = group.log_events("worker.stopping")
        assert stopping["num_slots_unwritten"] == 1
        assert group.log_events("worker.may_stop") and not group.log_events(
            "worker.stopped_unwritten")
        model = client.models.list().data[0].id
        again = client.chat.completions.create(model=model, messages=conversations[-1],
                                               max_tokens=1, tools=[Conversation.TOOL],
                                               temperature=0)
        usage.append(again.usage)

    usage = []
    pages, shared, stored, kv_budget = _in_turn_on_a_small_budget(
        tiny_qwen3, (901, 902, 903, 904), extra=["--kv-write-back"], then=restart_worker)
    assert kv_budget["writes_back"], "said at start"
    assert pages[1] <= stored and pages[2] <= stored, "the two written since are kept"
    assert not (pages[3] - shared) & stored, "the fourth, still in memory, is not written yet"
    [again] = usage
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1, \
        "written as the worker stopped (the prompt again: all but its last token)"


def _tokenizer(model_dir):
    from switchyard.common.tokenizer_loading import load_tokenizer

    return load_tokenizer(str(model_dir))


def test_unusable_page_directory_serves_without_persistence(tiny_qwen3, tmp_path):
    """An unwritable page directory: serving goes on, with a warning and a metric."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the page directory should be")
    with ServerGroup(tiny_qwen3, slots=1, ctx=4096, kv_dir=blocker / "kv") as group:
        client = openai.OpenAI(base_url=group.base_url, api_key="none")
        model = client.models.list().data[0].id
        for _ in range(2):
            resp = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text(5, 400)}], max_tokens=4)
            # Answered: a random twin may sample its end token before the limit ("stop").
            assert resp.choices[0].finish_reason in ("length", "stop")
            assert resp.usage.completion_tokens >= 1
        [warning] = group.log_events("kv.persistence_off")[:1]
        assert "unusable" in warning["error"]
        metrics = httpx.get(f"{group.url}/metrics").text
        assert "switchyard_kv_disk_writable 0.0" in metrics
