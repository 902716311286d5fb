"""The residency order (docs/design/scheduling.md "Residency"): idle conversations leave memory
by what the gateway said of their reply's end (`ReplyEnded`): a side call first, then the end of
a turn, then no word, then a tool call; a slot feeding waiting siblings after the others of its
rank. The core with scripted worker and kvstore (tests/unit/test_scheduler_pages.py), events and
a clock, no sockets. Beside a running request, a newcomer waits rather than push out a
conversation whose tool call's result is due."""

import dataclasses

import pytest

from switchyard.proto.gateway_scheduler import ReplyEnded
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.requests import Slot
from switchyard.scheduler.residency import feeding, grace_s, keep_key, waited_for

from tests.unit.test_scheduler_memory import submit
from tests.unit.test_scheduler_pages import Group, P, conv
from tests.unit.test_scheduler_resident import holding, idle


def finish(g, rid, prompt, end=None, max_tokens=3):
    """Run one request to its end; the gateway then says how its reply ended."""
    g.submit(rid, prompt, max_tokens=max_tokens)
    g.run()
    if end is not None:
        g.do(ReplyEnded(rid, end))


def slot_of(g, rid):
    return next(s.index for s in g.core.slots if s.last_rid == rid)


def test_the_end_of_a_turn_and_a_side_call_leave_at_once_a_tool_call_stays_its_grace():
    """--slots 1 of four: the turn that ended and the side call go as soon as their pages are
    on disk (nobody comes back soon); the two tool calls stay for `tool_return_s`, past
    --release-after-s; then the least recently used of them goes and --slots stay."""
    g = Group(num_slots=4, resident_slots=1, release_after_s=10.0)
    g.core.config = dataclasses.replace(g.core.config, tool_return_s=60.0)
    prompts = {rid: conv(i, 2 * P + 7) for i, rid in enumerate(("tool1", "turn", "side",
                                                                  "tool2"))}
    for rid, end in (("tool1", "tool_calls"), ("turn", "stop"), ("side", "side_call"),
                     ("tool2", "tool_calls")):
        g.submit(rid, prompts[rid], max_tokens=3)
    g.run()
    for rid, end in (("tool1", "tool_calls"), ("turn", "stop"), ("side", "side_call"),
                     ("tool2", "tool_calls")):
        g.now += 1.0
        g.do(ReplyEnded(rid, end))
    idle(g, 2)
    kept = {g.core.slots[i].last_rid for i in holding(g)}
    assert kept == {"tool1", "tool2"}
    idle(g, 20)  # past --release-after-s: a tool call's conversation is still there
    assert {g.core.slots[i].last_rid for i in holding(g)} == {"tool1", "tool2"}
    idle(g, 45)
    assert {g.core.slots[i].last_rid for i in holding(g)} == {"tool2"}, "LRU of the two went"
    # The tool result comes back: its whole conversation is cached.
    g.submit("tool2'", prompts["tool2"] + g.reply("tool2") + [5, 6], max_tokens=1)
    g.run()
    assert g.finished("tool2'").num_cached_tokens >= len(prompts["tool2"]) + 2


def test_with_no_word_the_grace_is_release_after_s_as_before():
    g = Group(num_slots=2, resident_slots=1, release_after_s=10.0)
    g.submit("a", conv(1, P + 3), max_tokens=3)
    g.submit("b", conv(2, P + 3), max_tokens=3)
    g.run()
    idle(g, 3)
    assert len(holding(g)) == 2
    idle(g, 10)
    assert len(holding(g)) == 1


def test_memory_short_a_side_call_leaves_before_an_older_tool_call():
    """The KV budget wants one idle conversation out for a newcomer: not the least recently
    used (a tool call, its result on the way) but the side call, then the end of a turn."""
    g = Group(num_slots=4, resident_slots=4, release_after_s=1000.0, kv_budget_tokens=2600)
    finish(g, "tool", conv(1, 600), "tool_calls")
    g.now += 5
    finish(g, "side", conv(2, 600), "side_call")
    g.now += 5
    finish(g, "turn", conv(3, 600), "stop")
    assert len(holding(g)) == 3
    finish(g, "new", conv(4, 600))
    left = {g.core.slots[i].last_rid for i in holding(g)}
    assert "side" not in left and "tool" in left, left
    finish(g, "new2", conv(5, 600))
    left = {g.core.slots[i].last_rid for i in holding(g)}
    assert "turn" not in left and "tool" in left, left


def test_placement_displaces_the_end_of_a_turn_before_an_older_tool_call():
    g = Group(num_slots=2)
    finish(g, "tool", conv(1, P + 9), "tool_calls")
    g.now += 5
    finish(g, "turn", conv(2, P + 9), "stop")
    finish(g, "new", conv(3, P + 9))
    assert g.core.slots[slot_of(g, "tool")].tokens, "the tool call's conversation stayed"
    assert slot_of(g, "new") != slot_of(g, "tool")


def test_a_word_for_a_slot_taken_since_is_not_its_new_request():
    """A ReplyEnded that arrives after the slot was taken by another request is dropped: the
    word belongs to the conversation it was said of."""
    g = Group(num_slots=1)
    finish(g, "a", conv(1, P + 3))
    finish(g, "b", conv(2, P + 3))  # takes the only slot
    g.do(ReplyEnded("a", "side_call"))
    assert g.core.slots[0].last_rid == "b" and g.core.slots[0].reply_end == ""
    g.do(ReplyEnded("b", "tool_calls"))
    assert g.core.slots[0].reply_end == "tool_calls"


def test_a_slot_feeding_waiting_siblings_stays_within_its_rank():
    """Pure: an idle slot whose first page begins a waiting request's context (and no running
    slot holds it) sorts after the other idle slots of its rank, never past a higher rank."""
    system, other = [b"s0", b"s1"], [b"o0"]
    a, b, c = Slot(0, [1] * 2 * P, page_ids=system), Slot(1, [2] * P, page_ids=other), \
        Slot(2, [3] * P, page_ids=[b"x0"])
    a.last_used, b.last_used, c.last_used = 1.0, 2.0, 3.0
    a.reply_end = b.reply_end = "tool_calls"
    c.reply_end = "stop"
    fed = feeding([a, b, c], {(a.root, b"s0")})
    assert fed == {0}
    order = sorted([a, b, c], key=lambda s: keep_key(s, fed))
    assert [s.index for s in order] == [2, 1, 0]
    running = Slot(3, [1] * P, rid="r", page_ids=[b"s0"])
    assert feeding([a, b, c, running], {(a.root, b"s0")}) == set(), "a running slot holds it"


def test_grace_by_the_word():
    cfg = CoreConfig(num_slots=1, ctx=1024, prefill_chunk=64, max_queue=1,
                     release_after_s=10.0, tool_return_s=60.0)
    words = {"side_call": 0.0, "stop": 0.0, "cancelled": 0.0, "": 10.0, "tool_calls": 60.0,
             "length": 10.0}
    assert {w: grace_s(Slot(0, reply_end=w), cfg) for w in words} == words


def test_a_slot_whose_next_turn_waits_is_kept_before_a_tool_call():
    """Pure: the slot whose last full page a waiting request's context holds is that
    conversation's, used next: it sorts after every other idle slot."""
    own, other = Slot(0, [1] * 2 * P, page_ids=[b"s0", b"a1"]), Slot(1, [2] * P, page_ids=[b"b0"])
    own.last_used, other.last_used = 1.0, 2.0
    own.reply_end, other.reply_end = "stop", "tool_calls"
    waiting = {(own.root, b"s0"): 5.0, (own.root, b"a1"): 5.0, (own.root, b"a2"): 5.0}
    back = waited_for([own, other], waiting)
    assert back == {0: 5.0}
    assert [s.index for s in sorted([own, other], key=lambda s: keep_key(s, (), back))] == [1, 0]


def test_of_slots_whose_next_turns_wait_the_one_served_last_goes_first():
    """Pure: twenty agents' turns queue while memory holds a few of their slots. Whatever the
    slots' recency, the slot whose turn arrived last (the queue serves it last) leaves
    first: letting go of the next one served would trade a restore now for one later."""
    a, b = Slot(0, [1] * P, page_ids=[b"a0"]), Slot(1, [2] * P, page_ids=[b"b0"])
    a.last_used, b.last_used = 2.0, 1.0  # a was used last: recency alone would keep it
    back = waited_for([a, b], {(a.root, b"a0"): 9.0, (b.root, b"b0"): 3.0})  # a's turn is later
    assert [s.index for s in sorted([a, b], key=lambda s: keep_key(s, (), back))] == [0, 1]


def test_a_conversation_copied_whole_to_go_on_elsewhere_leaves_its_old_slot_first():
    """The next turn took its prefix by copy into another slot (its own would have lost the
    reply it does not resend): the old slot's word is spent, nobody comes back to it."""
    g = Group(num_slots=2)
    prompt = conv(1, 2 * P + 5)
    finish(g, "a", prompt, "tool_calls")
    old = slot_of(g, "a")
    finish(g, "a2", prompt + [7, 8, 9])  # not its reply: the copy keeps the old slot whole
    assert slot_of(g, "a2") != old and g.records["a2"].num_copied_tokens >= len(prompt) - 1
    assert g.core.slots[old].reply_end == "superseded"
    assert keep_key(g.core.slots[old])[0] == 0, "it goes first, with the side calls"


@pytest.mark.parametrize("end, waits", [("tool_calls", True), ("stop", False)])
def test_beside_a_running_request_a_newcomer_waits_for_it_rather_than_push_out_a_tool_loop(
        end, waits):
    """A newcomer fits beside a running request only if idle A leaves memory (its pages are on
    a disk that holds what memory does). A's reply ended in a tool call: its result is back in
    seconds, so the newcomer waits for the running request instead, and A's next turn finds
    its context in memory. A turn that ended waits for a person: A goes, the newcomer runs."""
    g = Group(num_slots=3, kv_budget_tokens=2000)
    a_prompt = conv(1, 4 * P - 3)
    finish(g, "a", a_prompt, end)
    a_context = list(g.core.slots[0].tokens)
    assert g.core.releasable(g.core.slots[0]) and g.core.config.disk_holds_memory
    assert g.newcomer_waits(2) is waits
    assert (g.core.slots[0].tokens == a_context) is waits, "A stayed in memory"
    g.submit("a2", a_context + conv(4, 20), max_tokens=1)
    g.run()
    assert g.records["a2"].num_restored_tokens == (0 if waits else len(a_context))


def test_an_interactive_newcomer_takes_a_background_requests_memory_not_a_tool_loops():
    """As above, but the running request is a background one: the interactive newcomer does
    not wait for it; it takes its memory (the background request is staged and resumes
    later), and the tool loop still keeps its slot."""
    g = Group(num_slots=3, kv_budget_tokens=2000)
    g.core.config = dataclasses.replace(g.core.config, background_wait_s=1e6)
    finish(g, "a", conv(1, 4 * P - 3), "tool_calls")
    a_context = list(g.core.slots[0].tokens)
    submit(g, "bg", conv(2, 20), 30, priority="background")
    g.run_steps(3)
    submit(g, "fg", conv(3, 300), 4)
    g.run_steps(1)
    assert g.core.requests["fg"].slot is not None and "bg" in g.core.waiting
    assert [(f["rid"], f["reason"], f["for_rid"]) for f in g.logs("request.preempted")] == [
        ("bg", "memory", "fg")]
    g.run()
    assert len(g.reply("bg")) == 30 and g.core.slots[0].tokens == a_context


def test_within_a_word_the_conversation_next_expected_latest_leaves_first():
    """Pure: no word came for any of four conversations. Each is expected back as long after
    its reply as its last turn came after the one before (`expected_back`), and once past
    that, as long after now as it is overdue (`next_use`). At 10.0: d, on its first turn,
    replied at 1.0 (9 s silent: next at 19), a used at 9.0 with turns 8 s apart (due at 17),
    c 5 s overdue (next at 15), b due at 11. They leave in that order, though recency alone
    would keep a, used last."""
    a, b, c, d = (Slot(i, [i + 1] * P, page_ids=[bytes([i])]) for i in range(4))
    for slot, used, gap in ((a, 9.0, 8.0), (b, 5.0, 6.0), (c, 2.0, 3.0), (d, 1.0, None)):
        slot.last_used, slot.return_gap = used, gap
    order = [s.index for s in sorted([a, b, c, d], key=lambda s: keep_key(s, now=10.0))]
    assert order == [d.index, a.index, c.index, b.index]
    assert [s.index for s in sorted([a, b, c, d], key=keep_key)] == [3, 2, 1, 0], "no clock"


def test_a_conversation_due_back_in_an_hour_goes_before_one_seconds_late():
    """Pure: a job whose turns come an hour apart is not kept over a conversation a few
    seconds past its time: a long gap says its slot is not needed soon, whoever sends it."""
    job, chat = Slot(0, [1] * P, page_ids=[b"j"]), Slot(1, [2] * P, page_ids=[b"c"])
    job.last_used, job.return_gap = 100.0, 3600.0
    chat.last_used, chat.return_gap = 90.0, 5.0  # due at 95, 5 s late at 100
    order = sorted([job, chat], key=lambda s: keep_key(s, now=100.0))
    assert [s.index for s in order] == [job.index, chat.index]


def test_a_turn_notes_how_long_after_the_reply_before_it_came():
    """A conversation's next turn, sent 7 s after its reply, extends its slot: the slot keeps
    that gap (`Slot.return_gap`) until its next turn. A first turn, and a sub-agent that only
    shares the system prompt, keep none."""
    g = Group(num_slots=2)
    system = conv(1, 2 * P)
    finish(g, "a", system + conv(2, 20))
    slot = g.core.slots[slot_of(g, "a")]
    assert slot.return_gap is None, "a first turn"
    replied = slot.last_used
    g.now = replied + 7.0
    finish(g, "a2", list(slot.tokens) + conv(3, 20))
    assert g.core.slots[slot_of(g, "a2")].return_gap == pytest.approx(7.0)
    finish(g, "sub", system + conv(4, 20))
    assert g.core.slots[slot_of(g, "sub")].return_gap is None, "a sibling's first turn"


def test_a_turn_that_reads_its_context_again_still_notes_its_gap():
    """The gap is the turn's own, known from the turn it continues, not from a slot or a page
    it finds: A's slot went to B, whose pages took A's from a small disk, so A's next turn,
    sent 30 s after its reply, reads its whole context again, and its slot still notes the
    30 s (without it, a conversation that re-reads is ordered by recency alone, and twenty
    sub-agents taking turns on a small disk lose every turn the one next back)."""
    g = Group(num_slots=1, budget_pages=3)
    a = conv(1, 2 * P + 5)
    finish(g, "a", a)
    replied = g.core.slots[0].last_used
    finish(g, "b", conv(2, 2 * P + 5))
    g.now = replied + 30.0
    g.submit("a2", a + g.reply("a") + conv(3, 5), max_tokens=3)
    g.run()
    assert g.finished("a2").num_cached_tokens == 0, "it read its context again"
    assert g.core.slots[slot_of(g, "a2")].return_gap == pytest.approx(30.0)
