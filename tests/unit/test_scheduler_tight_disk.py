"""A disk smaller than memory (docs/design/kv-pages.md "A disk smaller than memory"), driven
without sockets or MLX: the core with scripted worker and kvstore
(tests/unit/test_scheduler_pages.py). Write-through puts every slot's pages on disk and the
disk's eviction then takes pages that resident slots hold: a slot so hit is never released from
memory as if its pages were on disk. With --kv-write-back (attention-only models) a slot's
pages are written as it leaves memory instead, and until then it counts as such a slot."""

import dataclasses

import pytest

from switchyard.proto.gateway_scheduler import ReplyEnded
from switchyard.proto.scheduler_worker import (
    RunStep,
    SlotContents,
    WorkerMayStop,
    WorkerStopping,
)
from switchyard.scheduler.events import PlanStep

from tests.unit.test_scheduler_pages import Group, P, conv, worker_ready

# Two idle slots of whole pages (64 tokens each: 256 of KV memory apiece as the worker counts
# it) fit; a newcomer of 64 tokens (256 more) fits once one of them leaves, one of 300 tokens
# (512) once both do.
BUDGET = 600


def two_idle_slots_on_a_small_disk(kv_budget_tokens, a_priority="interactive"):
    """A then B, each 4 whole pages, on a disk of 6 pages: B's pages took A's (the least
    recently used) while A stays in its slot. Returns the group and A's context."""
    g = Group(num_slots=3, budget_pages=6, kv_budget_tokens=kv_budget_tokens)
    g.turn("a", conv(1, 4 * P - 3), priority=a_priority)
    g.turn("b", conv(2, 4 * P - 3))
    a, b = g.core.slots[0], g.core.slots[1]
    assert len(a.tokens) == len(b.tokens) == 4 * P  # no tail: full pages only
    assert all(pid in g.disk for pid in b.page_ids)
    assert not all(pid in g.disk for pid in a.page_ids), "the disk let go of A's pages"
    return g, list(a.tokens)


def run_until_done(g, rid):
    """Plans a second apart, as the service's loop makes at least, until `rid` finishes."""
    for _ in range(30):
        g.run_steps(1)
        if rid in g.records:
            return g.finished(rid)
    raise AssertionError(f"{rid} did not finish")


def two_idle_slots_written_back(kv_budget_tokens):
    """A then B, each 4 whole pages, on a disk of 6 pages, attention-only: neither is written
    while it stays in memory. Returns the group and A's context."""
    g = Group(num_slots=3, budget_pages=6, kv_budget_tokens=kv_budget_tokens, write_back=True)
    assert g.core.config.writes_back
    g.turn("a", conv(1, 4 * P - 3))
    g.turn("b", conv(2, 4 * P - 3))
    assert not g.disk, "nothing written while the slots stay"
    assert not any(g.core.releasable(s) for s in g.core.slots[:2])
    return g, list(g.core.slots[0].tokens)


def test_written_back_a_slot_goes_to_disk_as_it_leaves_memory_and_comes_back_whole():
    """A newcomer needs one idle slot's room: A, the least recently used, is written, then
    leaves (the newcomer waits for the write), and B stays unwritten. A's next turn restores
    its whole context from the disk."""
    g, a_context = two_idle_slots_written_back(BUDGET)
    g.submit("c", conv(3, 4 * P - 3))
    run_until_done(g, "c")  # A is written, then leaves
    assert g.logs("request.waits_for_memory"), "the newcomer waited for A's write"
    a_pages = g.core.pages.chain(a_context)
    assert all(pid in g.disk for pid in a_pages), "A was written as it left"
    assert not any(pid in g.disk for pid in g.core.pages.chain(list(g.core.slots[1].tokens)))
    assert g.core.slots[1].last_rid == "b", "B stayed"
    g.submit("a2", a_context + conv(4, 20))
    run_until_done(g, "a2")  # C's slot is written and leaves for it
    assert g.records["a2"].num_reread_tokens == 0
    assert g.finished("a2").num_cached_tokens == len(a_context)


def test_written_back_a_slot_taken_over_is_written_first():
    """One slot: B, under the same system prompt as A, takes A's slot over, keeping the
    prompt and overwriting A's own tokens. Those are written first (B waits for that), so
    A's next turn restores its whole context, and B's reads only its own tokens."""
    g = Group(num_slots=1, budget_pages=12, kv_budget_tokens=BUDGET, write_back=True)
    assert g.core.config.writes_back
    system = conv(9, 2 * P)
    a = system + conv(1, 2 * P - 3)
    g.turn("a", a)
    assert not g.disk
    g.submit("b", system + conv(2, 2 * P - 3))
    assert run_until_done(g, "b").num_cached_tokens == 2 * P, "B kept the system prompt"
    assert all(pid in g.disk for pid in g.core.pages.chain(a)), "A was written first"
    g.submit("a2", a + g.reply("a") + conv(3, 5))
    run_until_done(g, "a2")
    assert g.records["a2"].num_reread_tokens == 0
    assert g.finished("a2").num_cached_tokens == len(a) + len(g.reply("a")) - 1


def test_write_back_is_asked_for_and_only_where_the_disk_is_smaller_than_memory():
    """Pages are written as they fill unless --kv-write-back asks otherwise, and even then on
    a disk as large as memory, and for a hybrid model (its state snapshots exist only as its
    slot passes them)."""
    config = Group(budget_pages=6, kv_budget_tokens=BUDGET).core.config
    assert not config.writes_back and config.write_back_unused == ""
    config = Group(budget_pages=6, kv_budget_tokens=BUDGET, write_back=True).core.config
    assert config.writes_back and config.write_back_unused == ""
    g = Group(num_slots=3, budget_pages=6, kv_budget_tokens=40, write_back=True)
    assert g.core.config.disk_holds_memory and not g.core.config.writes_back
    assert "the disk budget holds what memory does" in g.core.config.write_back_unused
    g.turn("a", conv(1, 4 * P - 3))
    assert all(pid in g.disk for pid in g.core.slots[0].page_ids)
    g = Group(budget_pages=6, kv_budget_tokens=BUDGET, trimmable=False, write_back=True)
    assert not g.core.config.writes_back, "a hybrid model writes through"
    assert "a hybrid model's state snapshots" in g.core.config.write_back_unused


def test_a_slot_whose_pages_the_disk_let_go_is_not_taken_for_on_disk():
    g, _ = two_idle_slots_on_a_small_disk(0)
    a, b = g.core.slots[0], g.core.slots[1]
    assert g.core.releasable(b)
    assert not g.core.releasable(a)
    assert a.num_persisted == sum(1 for _ in a.page_ids[:a.num_persisted]) < len(a.page_ids)
    assert all(pid in g.disk for pid in a.page_ids[:a.num_persisted])


def test_room_is_made_by_the_slot_whose_pages_are_on_disk():
    """A newcomer needs one idle slot's memory. A is the least recently used, but its pages
    are not on disk (B's took them): B goes, A stays, and A's next turn re-reads nothing."""
    g, a_context = two_idle_slots_on_a_small_disk(BUDGET)
    g.turn("c", conv(3, 4 * P - 3))
    assert g.core.slots[0].tokens == a_context, "A stayed in memory"
    assert not g.core.slots[1].tokens, "B left it"
    g.turn("a2", a_context + conv(4, 20))
    assert g.records["a2"].num_reread_tokens == 0
    assert g.finished("a2").num_cached_tokens == len(a_context)


def test_a_slot_that_must_leave_is_written_again_before_it_goes():
    """A newcomer needs both idle slots' memory: A's pages go back to disk before its KV
    leaves memory, and the newcomer waits for that rather than run past the budget."""
    g, _ = two_idle_slots_on_a_small_disk(BUDGET)
    a_pages = list(g.core.slots[0].page_ids)
    g.submit("c", conv(3, 300))
    released = False
    for _ in range(200):  # a plan each second, as the service's loop makes at least
        g.now += 1.0
        g.do(PlanStep())
        step = next((m for m in g.outbox if isinstance(m, RunStep)), None)
        if step is not None and step.prefills and not released:
            assert 0 in step.releases, "the newcomer waited for A's room"
        g.pump()
        if step is not None and 0 in step.releases and not released:
            # Staged by the step that released it (the worker stages before it releases),
            # written when it ended.
            assert all(pid in g.disk for pid in a_pages), "A left with its pages on disk"
            released = True
        if "c" in g.records:
            break
    assert released
    assert g.logs("request.waits_for_memory")
    assert g.finished("c").finish_reason == "length"


@pytest.mark.parametrize("kv_budget_tokens", [
    2000,  # the newcomer fits beside the running request only if A is written again and goes
    2100,  # ... only if B goes, its pages on disk (for now)
])
def test_beside_a_running_request_a_newcomer_waits_rather_than_send_a_slot_to_a_full_disk(
        kv_budget_tokens):
    """With a disk that took pages of resident slots (A's), a newcomer that needs an idle
    slot's room beside a running request waits for that request: the slot it would send to
    disk would lose its pages there under the newcomer's own (300 tokens on a disk of 96), and
    its conversation would re-read them. Done, the running request makes the room, and A's and
    B's next turns re-read nothing."""
    g = Group(num_slots=4, budget_pages=6, kv_budget_tokens=kv_budget_tokens)
    g.turn("a", conv(1, 4 * P - 3))
    g.turn("b", conv(2, 4 * P - 3))
    contexts = [list(g.core.slots[i].tokens) for i in (0, 1)]
    assert not g.core.releasable(g.core.slots[0]), "the disk let go of A's pages"
    assert g.newcomer_waits(3), "placed once the running request was done"
    assert g.logs("request.waits_for_memory"), "the newcomer waited for memory"
    assert [g.core.slots[i].tokens for i in (0, 1)] == contexts, "A and B stayed in memory"
    for i, context in enumerate(contexts):
        g.turn(f"next {i}", context + conv(5 + i, 20))
        assert g.records[f"next {i}"].num_reread_tokens == 0


def test_a_newcomer_waits_beside_a_long_reply_for_tool_return_s_at_most():
    """The same newcomer beside a reply of 100 steps: it waits `tool_return_s` (5 s here),
    then makes its room as it would alone (B, whose pages are on disk, goes) and runs beside
    the reply."""
    g = Group(num_slots=4, budget_pages=6, kv_budget_tokens=2100)
    g.core.config = dataclasses.replace(g.core.config, tool_return_s=5.0)
    g.turn("a", conv(1, 4 * P - 3))
    g.turn("b", conv(2, 4 * P - 3))
    g.submit("r", conv(3, 20), max_tokens=100)
    g.submit("c", conv(4, 300))
    submitted = g.now
    while g.core.requests["c"].slot is None:
        g.run_steps(1)
    assert g.now - submitted >= 5.0, "it waited for the running reply..."
    assert "r" in g.core.requests, "...not for all of it"
    g.run()
    assert len(g.reply("r")) == 100 and g.finished("c").finish_reason == "length"


def test_alone_a_newcomer_waits_for_a_tool_loop_whose_pages_the_disk_let_go():
    """Nothing runs, A's reply ended in a tool call and the disk let go of A's pages: a
    newcomer that needs A's room waits for A's next turn rather than send A out to be re-read
    (before, alone, it always made its room). A's turn, behind it in the queue, goes first and
    finds its whole context; the newcomer runs once A's turn is done."""
    g, a_context = two_idle_slots_on_a_small_disk(BUDGET)
    g.do(ReplyEnded("a", "tool_calls"))
    g.submit("c", conv(3, 300))
    g.run_steps(3)
    assert g.core.requests["c"].slot is None, "the newcomer waits"
    assert g.logs("request.waits_for_memory")[-1]["aside"]
    assert g.core.slots[0].tokens == a_context, "A stayed in memory"
    g.turn("a2", a_context + conv(4, 20))  # the tool's result
    assert g.records["a2"].num_reread_tokens == 0
    assert g.finished("a2").num_cached_tokens == len(a_context)
    assert "c" not in g.records, "A's turn went first"
    for _ in range(20):  # A's reply said nothing of its return: the newcomer makes its room
        g.run_steps(1)
    assert g.finished("c").finish_reason == "length"


def test_alone_a_newcomer_waits_for_a_tool_loop_for_tool_return_s_at_most():
    """The same, and A's tool result never comes: the newcomer waits until A's grace
    (`tool_return_s` after its reply) is over, then makes its room as before (A written again
    as far as the disk takes it, then gone)."""
    g, _ = two_idle_slots_on_a_small_disk(BUDGET)
    g.core.config = dataclasses.replace(g.core.config, tool_return_s=30.0)
    g.do(ReplyEnded("a", "tool_calls"))
    g.submit("c", conv(3, 300))
    a_due_until = g.core.slots[0].last_used + 30.0
    assert a_due_until > g.now + 10
    while g.core.requests["c"].slot is None:
        g.run_steps(1)
    assert a_due_until <= g.now <= a_due_until + 5
    g.run()
    assert g.finished("c").finish_reason == "length"
    assert not g.core.slots[0].tokens or g.core.slots[0].last_rid == "c", "A left for it"


def test_alone_an_interactive_newcomer_does_not_wait_for_a_background_tool_loop():
    """A is a background job's tool loop: an interactive newcomer takes its room at once, as
    it would a running background request's; a background newcomer waits for it."""
    g, _ = two_idle_slots_on_a_small_disk(BUDGET, a_priority="background")
    g.do(ReplyEnded("a", "tool_calls"))
    g.submit("job", conv(3, 300), priority="background")
    g.run_steps(3)
    assert g.core.requests["job"].slot is None, "a background newcomer waits for A"
    g.submit("c", conv(4, 300))
    for _ in range(20):
        g.run_steps(1)
    assert g.finished("c").finish_reason == "length", "the interactive one did not wait"


def test_alone_a_newcomer_does_not_wait_for_the_tool_loop_it_carries_on():
    """A's reply ended in a tool call, and the next request holds A's whole last prompt with
    another end (a compaction of A, as Claude Code sends at the context limit): it is A's
    conversation going on, not a newcomer to wait aside for A's return, which would never
    come (it waited `tool_return_s`)."""
    g, a_context = two_idle_slots_on_a_small_disk(BUDGET)
    g.do(ReplyEnded("a", "tool_calls"))
    g.submit("compact", a_context[:3 * P] + conv(9, 300))  # it needs A's room and B's
    g.run_steps(3)
    assert not any(log["aside"] for log in g.logs("request.waits_for_memory"))
    assert g.core.requests["compact"].slot is not None, "placed at once"
    g.run()
    assert g.finished("compact").finish_reason == "length"
    assert g.finished("compact").num_cached_tokens >= 3 * P, "it took A's pages"


def test_beside_a_running_request_a_newcomer_that_fits_once_it_ends_waits():
    """A's pages are all on disk, but the disk is smaller than memory. A newcomer that needs
    A's room beside a running request, and fits beside A once that request has ended, waits
    for it rather than send A out (its pages would then be the only copy, on a disk that the
    newcomer's own pages would take them from). A's next turn finds its whole context in its
    slot."""
    g = Group(num_slots=4, budget_pages=6, kv_budget_tokens=2000)
    g.turn("a", conv(1, 4 * P - 3))
    a_context = list(g.core.slots[0].tokens)
    assert g.core.releasable(g.core.slots[0]), "A's pages are on disk"
    assert not g.core.config.disk_holds_memory
    assert g.newcomer_waits(3), "placed once the running request was done"
    assert g.core.slots[0].tokens == a_context, "A stayed in memory"
    g.turn("a2", a_context + conv(5, 20))
    assert g.records["a2"].num_reread_tokens == 0
    assert g.finished("a2").num_cached_tokens == len(a_context)


def test_an_end_of_turn_written_again_leaves_before_a_tool_loop_on_disk():
    """A's turn ended and the disk let go of its pages; B's reply ended in a tool call and its
    pages are on disk. A newcomer with nothing beside it needs one slot's room: A is written
    again and goes, not B, whose result is due within seconds and would restore it all (the
    rank first: slots whose copy was taken go last within it). B's next turn finds its whole
    context in its slot."""
    g, _ = two_idle_slots_on_a_small_disk(BUDGET)
    g.do(ReplyEnded("a", "stop"))
    g.do(ReplyEnded("b", "tool_calls"))
    b_context = list(g.core.slots[1].tokens)
    g.submit("c", conv(3, 4 * P - 3))
    for _ in range(20):  # plans a second apart: A is written again, then leaves
        g.run_steps(1)
        if "c" in g.records:
            break
    assert g.finished("c").finish_reason == "length"
    assert g.core.slots[1].tokens == b_context, "B stayed in memory"
    assert g.core.slots[0].last_rid != "a" or not g.core.slots[0].tokens, "A left it"
    g.turn("b2", b_context + conv(4, 20))
    assert g.records["b2"].num_restored_tokens == 0
    assert g.finished("b2").num_cached_tokens == len(b_context)


def test_a_worker_stopping_is_written_first_and_places_nothing_meanwhile():
    """Written back, A and B idle and unwritten, R running: the worker is asked to stop. Its
    steps then only write: every slot's pages to their last token, R decoding no further, a
    newcomer not placed. Once kvstore has answered every write the worker may stop; after a
    new worker greets, A's next turn restores its whole context."""
    g = Group(num_slots=3, budget_pages=16, kv_budget_tokens=4 * BUDGET, write_back=True)
    assert g.core.config.writes_back
    g.turn("a", conv(1, 4 * P - 3))
    g.turn("b", conv(2, 3 * P + 5))  # a partial last page (a tail)
    a_context, b_context = list(g.core.slots[0].tokens), list(g.core.slots[1].tokens)
    g.submit("r", conv(3, 20), max_tokens=50)
    g.run_steps(3)
    assert not g.disk and "r" not in g.records, "nothing written yet; R runs"
    num_steps = len(g.steps)
    g.do(WorkerStopping())
    [stopping] = g.logs("worker.stopping")
    assert stopping["num_slots_unwritten"] == 3
    r_tokens = len(g.core.slots[2].tokens)
    g.submit("c", conv(4, 20))
    for _ in range(20):  # plans a second apart until the worker is told (it then stops)
        if any(isinstance(m, WorkerMayStop) for m in g.msgs):
            break
        g.run_steps(1)
    assert sum(isinstance(m, WorkerMayStop) for m in g.msgs) == 1
    for context in (a_context, b_context, list(g.core.slots[2].tokens)):
        assert all(pid in g.disk for pid in g.core.pages.chain(context))
    tail = len(b_context) % P
    assert tail and any(i.parent_id == g.core.pages.chain(b_context)[-1]
                        and i.num_tokens == tail for i in g.disk.values()), "B's tail too"
    assert not any(m.prefills or m.decodes for m in g.steps[num_steps:]), "stages alone"
    assert len(g.core.slots[2].tokens) == r_tokens and "c" not in g.records
    # a new worker, its slots empty: C runs, and A comes back from disk whole
    g.do(worker_ready(g.core, slots=tuple(SlotContents(i, ()) for i in range(3)),
                      kv_budget_tokens=4 * BUDGET))
    g.slots, g.marks = [[] for _ in range(3)], [0] * 3
    run_until_done(g, "c")
    g.submit("a2", a_context + conv(5, 10))
    assert run_until_done(g, "a2").num_cached_tokens == len(a_context)
    assert g.records["a2"].num_reread_tokens == 0


def test_a_worker_stopping_with_everything_on_disk_may_stop_at_once():
    g = Group(num_slots=1, budget_pages=12, kv_budget_tokens=BUDGET)  # written through
    g.turn("a", conv(1, 4 * P))  # whole pages, each written as it filled
    g.do(WorkerStopping())
    assert any(isinstance(m, WorkerMayStop) for m in g.outbox)
