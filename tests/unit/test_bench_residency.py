"""bench/residency*.py: the trace format, LRU and the offline optimum on small traces with
hand-computed answers, and the core's replay (fast: tiny pages, tens of requests)."""

from __future__ import annotations

import random

import pytest

from switchyard.proto.scheduler_worker import CopyPrefix, PrefillChunk, RunStep
from switchyard.scheduler import residency

from bench.residency_core import ScriptedGroup, replay_core
from bench.residency_policies import replay, reread_bound
from bench.residency_trace import (Trace, TraceRequest, dumps, loads, reordered,
                                   shared_prefixes, synthesize)

P = 4


def trace_of(prompts: list[list[int]], name: str = "t") -> Trace:
    shared = shared_prefixes(prompts, P)
    return Trace(name, P, tuple(TraceRequest(i, float(i), len(p), s, 2, "tool_calls", "c")
                                for i, (p, s) in enumerate(zip(prompts, shared))))


def synthetic(seed: int = 1, steps: int = 40, convs: int = 5) -> Trace:
    rng = random.Random(seed)
    system = list(range(1000, 1010))
    held = {c: system + [5000 + c] for c in range(convs)}
    prompts = []
    for _ in range(steps):
        c = rng.randrange(convs)
        held[c] = held[c] + [rng.randrange(10**6, 10**7) for _ in range(rng.randrange(2, 9))]
        prompts.append(list(held[c]))
    return trace_of(prompts, "synthetic")


def test_the_trace_round_trips_and_holds_no_token_ids():
    t = synthetic()
    text = dumps(t)
    assert loads(text) == t
    assert "1000" not in text and "5000" not in text  # no token id of the prompts


def test_shared_prefixes_find_the_longest_earlier_prompt():
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 4, 5, 9]
    c = [1, 2, 3, 4, 5, 6, 8]
    assert shared_prefixes([a, b, c], P) == [None, (0, 5), (0, 6)]


def test_synthesized_prompts_share_what_the_trace_says():
    t = synthetic()
    again = synthesize(t)
    assert shared_prefixes(again, P) == [r.shared for r in t.requests]
    assert reordered(t, range(len(t.requests))) == t


def test_a_returning_conversation_after_an_interloper_hand_computed():
    """A (8 tokens), B (8 other tokens), A again (12): memory holds 8 tokens, no disk. LRU
    evicted A for B: A's 8 are re-read. The optimum keeps A and never keeps B (not wanted
    again): nothing re-read. With 8 tokens of disk LRU restores A's two pages instead, having
    written A (leaving for B) and then B (leaving for A's next turn): 16 tokens; the optimum
    writes nothing."""
    a, b = list(range(1, 9)), list(range(101, 109))
    t = trace_of([a, b, a + [9, 10, 11, 12]])
    assert replay(t, "lru", 8, 0).tokens_reread == 8
    assert replay(t, "optimal", 8, 0).tokens_reread == 0
    with_disk = replay(t, "lru", 8, 8)
    assert (with_disk.tokens_reread, with_disk.tokens_restored, with_disk.tokens_written) \
        == (0, 8, 16)
    assert replay(t, "optimal", 8, 8).tokens_written == 0


def test_a_tail_is_reused_where_the_next_prompt_continues_it():
    """6 tokens: a page and a tail of 2; the next prompt extends them: all 6 cached."""
    t = trace_of([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert t.requests[1].shared == (0, 6)
    assert replay(t, "lru", 100, 0).tokens_reread == 0


@pytest.mark.parametrize("times", [1, 1.5, 2, 4])
@pytest.mark.parametrize("disk", [0, 8, 32, 256])
def test_the_optimum_never_rereads_more_than_lru(times, disk):
    """Memory of at least the largest prompt (LRU keeps the running request whole, past a
    smaller budget, which no bound accounts for)."""
    t = synthetic()
    memory = int(times * max(r.prompt for r in t.requests))
    lru, best = replay(t, "lru", memory, disk), replay(t, "optimal", memory, disk)
    assert best.tokens_reread <= lru.tokens_reread
    assert best.tokens_reread == reread_bound(t, memory, disk)
    # Restores plus re-reads are memory misses, fewest under MIN over memory alone.
    assert best.tokens_reread + best.tokens_restored <= lru.tokens_reread + lru.tokens_restored


def test_the_core_replays_a_trace_and_keeps_what_fits():
    t = synthetic(steps=20)
    roomy = replay_core(t, memory_tokens=4096, disk_tokens=4096)
    assert roomy.requests == 20 and roomy.tokens_reread == 0
    assert sorted(roomy.order) == list(range(20))


def test_a_trace_is_read_from_the_servers_log():
    """The scheduler's request.pages and request.finished lines and the gateway's
    request.finished line make a trace: arrival order, pages shared with the latest request
    holding them (the whole prompt of the turn a request continues), the reply's length and
    end, conversations renamed in order."""
    from bench.residency_record import trace_from_log

    def at(s):
        return f"2026-12-05T08:00:{s:06.3f}Z"

    lines = [
        {"event": "request.pages", "role": "scheduler", "rid": "a", "timestamp": at(0),
         "num_prompt_tokens": 9, "pages": ["p1", "p2"]},
        {"event": "request.pages", "role": "scheduler", "rid": "b", "timestamp": at(1.5),
         "num_prompt_tokens": 13, "pages": ["p1", "p2", "p3"]},
        {"event": "request.pages", "role": "scheduler", "rid": "side", "timestamp": at(2),
         "num_prompt_tokens": 5, "pages": ["p1", "q2"]},
        {"event": "request.pages", "role": "scheduler", "rid": "lost", "timestamp": at(3),
         "num_prompt_tokens": 5, "pages": []},  # never finished: not in the trace
        {"event": "request.finished", "role": "scheduler", "rid": "a", "conversation": "xy",
         "num_generated_tokens": 3, "finish_reason": "stop"},
        {"event": "request.finished", "role": "scheduler", "rid": "b", "conversation": "xy",
         "num_generated_tokens": 4, "finish_reason": "stop"},
        {"event": "request.finished", "role": "scheduler", "rid": "side",
         "conversation": "zz", "num_generated_tokens": 1, "finish_reason": "stop"},
        {"event": "request.finished", "role": "gateway", "rid": "a", "reply_end": "tool_calls"},
        {"event": "request.finished", "role": "gateway", "rid": "side",
         "reply_end": "side_call"},
    ]
    t = trace_from_log(lines, "log", P)
    assert [(r.i, r.t, r.prompt, r.shared, r.reply, r.end, r.conv) for r in t.requests] == [
        (0, 0.0, 9, None, 3, "tool_calls", "c1"),
        (1, 1.5, 13, (0, 9), 4, "stop", "c1"),  # continues a: its whole prompt
        (2, 2.0, 5, (1, P), 1, "side_call", "c2"),
    ]
    assert loads(dumps(t)) == t


def test_the_core_told_how_replies_ended_keeps_the_tool_loop_in_memory():
    """A tool loop (A), then a turn that ends (B, more recent), then a newcomer (C) that
    needs one of their slots: told the words, the core lets B's go and A's next turn restores
    nothing; told nothing, it lets the least recently used go (A's, but for the pages that fit
    beside C: a cut), which A restores."""
    page = 16

    def conv(seed, n):
        return [seed * 100_000 + i for i in range(1, n + 1)]

    a, b, c = conv(1, 600), conv(2, 600), conv(3, 600)
    reqs = [("A", 0.0, a, "tool_calls"), ("A", 1.0, a + conv(4, 40), "tool_calls"),
            ("B", 2.0, b, "stop"), ("C", 3.0, c, "stop"),
            ("A", 6.0, a + conv(4, 40) + conv(5, 40), "stop")]
    prompts = [p for _, _, p, _ in reqs]
    shared = shared_prefixes(prompts, page)
    t = Trace("words", page, tuple(TraceRequest(i, at, len(p), shared[i], 8, end, name)
                                   for i, (name, at, p, end) in enumerate(reqs)))
    told = replay_core(t, memory_tokens=2000, disk_tokens=10_000)
    not_told = replay_core(t, memory_tokens=2000, disk_tokens=10_000, tell_ends=False)
    assert (told.tokens_reread, told.tokens_restored) == (0, 0)
    assert not_told.tokens_reread == 0 and not_told.tokens_restored > 0


def in_turn(rounds: int, page: int = 16) -> Trace:
    """Three conversations of 600 tokens taking turns, each turn 20 tokens more."""

    def conv(seed, n):
        return [seed * 100_000 + i for i in range(1, n + 1)]

    held = {k: conv(k, 600) for k in (1, 2, 3)}
    reqs = []
    for turn in range(rounds):
        for k in (1, 2, 3):
            held[k] = held[k] + conv(10 * turn + k + 10, 20)
            reqs.append((f"c{k}", 2.0 * len(reqs), list(held[k])))
    shared = shared_prefixes([p for _, _, p in reqs], page)
    return Trace("cycle", page, tuple(TraceRequest(i, at, len(p), shared[i], 8, "length", name)
                                      for i, (name, at, p) in enumerate(reqs)))


def test_the_core_expects_conversations_back_as_they_came(monkeypatch):
    """Three conversations in turn, memory for two. By recency alone the core lets go of the
    one that comes back next, every turn: each turn after the first round restores all but
    the front a cut keeps. Expecting each conversation back as long after its reply as its
    last turn came after the one before (`residency.expected_back`), it lets go of the one
    due latest from the second round on, and restores a fifth less; told the future
    (`optimal-slots`), it lets go of the one needed last, and restores about half. None
    re-reads anything (the disk holds all)."""
    t = in_turn(rounds=4)
    core = replay_core(t, memory_tokens=2000, disk_tokens=100_000)
    future = replay_core(t, memory_tokens=2000, disk_tokens=100_000, oracle=True)
    monkeypatch.setattr(residency, "expected_back", lambda slot: None)
    recency = replay_core(t, memory_tokens=2000, disk_tokens=100_000)
    assert recency.tokens_reread == core.tokens_reread == future.tokens_reread == 0
    assert recency.tokens_restored > 2 * 600
    assert core.tokens_restored <= 0.8 * recency.tokens_restored
    assert future.tokens_restored <= 0.6 * recency.tokens_restored
    assert future.tokens_restored <= core.tokens_restored


def test_the_scripted_worker_refuses_a_plan_that_starts_past_what_a_slot_holds():
    """As the worker does (worker/slots.py `truncate`): a core whose view of its slots went
    wrong fails the replay instead of counting figures from it."""
    g = ScriptedGroup(16, memory_tokens=1000, disk_tokens=1000, release_after_s=10.0)
    g._work(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(range(1, 33))),)))
    with pytest.raises(RuntimeError, match="slot 0 holds 32 tokens; the core planned a "
                                           "prefill at 40"):
        g._work(RunStep(1, prefills=(PrefillChunk(0, 40, (7,)),)))


def test_the_scripted_hybrid_worker_refuses_a_command_where_a_slot_has_no_state():
    """A hybrid slot has its recurrent state at its end and at its mark (where its last
    prefill ended), nowhere else: a prefill, copy or stage with its state starting between
    them fails the replay, as the worker would refuse it."""
    g = ScriptedGroup(16, memory_tokens=1000, disk_tokens=1000, release_after_s=10.0,
                      hybrid=True)
    g._work(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(range(1, 33))),)))
    g._work(RunStep(1, prefills=(PrefillChunk(0, 32, tuple(range(40, 48))),)))
    with pytest.raises(RuntimeError, match="slot 0 has no state at 32"):
        g._work(RunStep(2, prefills=(PrefillChunk(0, 32, (7,)),)))  # the mark moved on
    with pytest.raises(RuntimeError, match="the core planned a copy there"):
        g._work(RunStep(3, copies=(CopyPrefix(0, 1, 16),)))
    g._work(RunStep(4, copies=(CopyPrefix(0, 1, 40),)))  # its end: the state is there
    assert g.slots[1] == list(range(1, 33)) + list(range(40, 48))


def test_the_core_on_a_hybrid_model_plans_within_its_rules_and_restores_what_attention_does():
    """The core on a hybrid model's worker (`switchyard-hybrid`): every step it plans passes
    the scripted worker's state rules. It cuts slots, and copies and keeps attention KV where
    no state is, a restore's last page bringing the state: on three conversations taking
    turns in memory for two it restores what the attention-only core does, and with room for
    all it re-reads no more than the shared system prompt where a conversation's first turn
    branches off it inside a page (no state there yet)."""
    t = synthetic(steps=30)
    roomy = replay_core(t, memory_tokens=4096, disk_tokens=4096, hybrid=True)
    assert roomy.requests == 30 and roomy.tokens_reread <= 5 * 10
    cycle = in_turn(rounds=3)
    attention = replay_core(cycle, memory_tokens=2000, disk_tokens=100_000)
    hybrid = replay_core(cycle, memory_tokens=2000, disk_tokens=100_000, hybrid=True)
    assert attention.tokens_reread == hybrid.tokens_reread == 0
    assert hybrid.tokens_restored == attention.tokens_restored > 0


def test_a_disk_smaller_than_memory_written_back_holds_what_memory_does_not():
    """The same three conversations, memory for two and a disk for about two: written
    through, the disk holds copies of what memory holds, and a conversation that leaves
    finds its pages gone from it; written back (--kv-write-back: each slot written as it
    leaves memory), the disk holds the one memory does not, and almost nothing is read
    again."""
    t = in_turn(rounds=4)
    back = replay_core(t, memory_tokens=2000, disk_tokens=1500, write_back=True)
    through = replay_core(t, memory_tokens=2000, disk_tokens=1500)
    assert through.tokens_reread > 600, "written through, a conversation is read again"
    assert back.tokens_reread <= 0.05 * through.tokens_reread
    assert max(back.peak_memory_tokens, through.peak_memory_tokens) <= 2000
