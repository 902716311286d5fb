"""Exact repeats on every model kind (docs/design/kv-pages.md "Exact repeats and state marks"):
a prompt sent again is served from cache up to its last token, from its slot, after a switch
and after a restart, also where the state exists only at the slot's end and at its mark
(hybrid and sliding-window models). The scripted worker of test_scheduler_pages checks every
cut, copy and stage against where it has the state."""

import pytest

from switchyard.proto.gateway_scheduler import CancelRequest
from switchyard.proto.scheduler_worker import RunStep
from switchyard.scheduler.events import PlanStep

from tests.unit.test_scheduler_pages import P, Group, conv


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_repeat_resumes_at_its_last_token_in_its_slot(trimmable):
    g = Group(num_slots=1, trimmable=trimmable)
    a = conv(1, 6 * P + 3)
    g.turn("a1", a)
    before = len(g.steps)
    g.turn("a2", a)
    assert g.finished("a2").num_cached_tokens == len(a) - 1
    assert g.prefilled_in(before) == 0
    assert g.reply("a2") == g.reply("a1")


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_repeat_after_a_switch_restores_its_prompts_tail(trimmable):
    g = Group(num_slots=1, trimmable=trimmable)
    a = conv(1, 6 * P + 3)
    g.turn("a1", a)
    g.submit("b1", conv(2, 3 * P + 5))  # takes the only slot
    g.run()
    before = len(g.steps)
    g.turn("a2", a)
    assert g.finished("a2").num_cached_tokens == len(a) - 1
    assert g.prefilled_in(before) == 0
    loads = [ld for s in g.steps[before:] for ld in s.loads]
    assert loads[-1].start + len(loads[-1].token_ids) == len(a) - 1
    assert loads[-1].with_state != trimmable
    # ...and once more in the slot it came back to: the restore left its state marked.
    g.turn("a3", a)
    assert g.finished("a3").num_cached_tokens == len(a) - 1


def test_a_hybrid_repeat_after_a_restart_restores_from_disk():
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 5 * P + 7)
    g.turn("a1", a)
    g.restart_core()
    g.turn("a2", a)
    assert g.finished("a2").num_cached_tokens == len(a) - 1


def test_a_hybrid_next_turn_after_a_repeat_still_resumes_in_its_slot():
    """The slot went back to its mark for the repeat; the next turn extends it."""
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 4 * P + 3)
    g.turn("a1", a)
    g.turn("a2", a)
    follow = a + g.reply("a2")[:-1] + [7, 8, 9]
    g.turn("a3", follow)
    assert g.finished("a3").num_cached_tokens == len(a) + len(g.reply("a2")) - 1


def test_without_marks_a_hybrid_repeat_rereads_its_last_partial_page():
    """A worker whose cache kind keeps no mark: the slot cannot go back, and the prompt's
    tail carries no state (the slot moved on before it was staged)."""
    g = Group(num_slots=1, trimmable=False, state_marks=False)
    a = conv(1, 4 * P + 3)
    g.turn("a1", a)
    g.turn("a2", a)
    assert g.finished("a2").num_cached_tokens < len(a) - 1


def test_hybrid_sub_agents_resume_at_their_branch_point_inside_a_page():
    """Sub-agents under a main session's system prompt that ends mid-page: the first one's
    prefill stops where it parts from the main session and stores the state there (a tail);
    the next ones restore to that token instead of re-reading from a page end, also after the
    main session's next turn passed the page (the tail is the first sub-agent's turn's)."""
    g = Group(num_slots=2, trimmable=False)
    system = conv(5, 3 * P + 5)  # ends inside a page; no snapshot interval (4 P) within
    g.turn("main", system + conv(6, 2 * P + 3))
    g.turn("sub1", system + conv(7, P + 1))
    assert g.finished("sub1").num_cached_tokens == 0  # nothing with a state under it yet
    g.turn("sub2", system + conv(8, P + 2))
    assert g.finished("sub2").num_cached_tokens == len(system)
    follow = system + conv(6, 2 * P + 3) + g.reply("main")[:-1] + [5, 6]
    g.turn("main2", follow)
    g.turn("sub3", system + conv(9, P + 3))
    assert g.finished("sub3").num_cached_tokens == len(system)


def test_a_rewritten_reply_is_no_branch_point():
    """A next turn whose history rewrote the reply parts from its own slot inside the reply:
    no state tail is stored there (clients that rewrite every reply would write one per turn)."""
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 3 * P + 5)
    g.turn("a1", a)
    tails = {i.page_id for i in g.disk.values() if i.num_tokens < P}
    g.turn("a2", a + g.reply("a1")[:2] + [9, 9, 9])
    new = [i.num_tokens for i in g.disk.values() if i.num_tokens < P and i.page_id not in tails]
    assert len(a) + 2 not in [3 * P + n for n in new]


def test_hybrid_sub_agents_arriving_together_take_the_shared_prompt_from_the_first():
    """Two sub-agents sent together under a system prompt no slot or page holds yet: the
    second waits while the first prefills it, the first's prefill stops where they part,
    inside a page, and keeps its state there; the second takes the prompt from it (a copy at
    its mark, or the tail it stores) and prefills only its own part (before, a hybrid
    sibling never waited, and each prefilled the whole prompt)."""
    g = Group(num_slots=2, trimmable=False)
    system = conv(5, 3 * P + 5)
    g.submit("sub1", system + conv(7, P + 1))
    g.submit("sub2", system + conv(8, P + 2))
    g.run()
    assert g.logs("request.waits_for_sibling")[0]["num_shared_tokens"] == len(system)
    assert g.finished("sub2").num_cached_tokens == len(system)
    assert g.records["sub2"].num_reread_tokens == 0


def _restore_cut_short(g, prompt):
    """Send `prompt` (its conversation on disk, its slot taken) and cancel it once its
    restore's first batch, loaded without the state, is in the slot."""
    g.submit("cut short", prompt)
    for _ in range(50):
        g.now += 1.0
        g.do(PlanStep())
        loaded = any(isinstance(m, RunStep) and m.loads for m in g.outbox)
        g.pump()
        if loaded:
            break
    slot = g.core.slots[0]
    assert slot.stateless_end and len(slot.tokens) > 0, "a batch without the state is in"
    g.do(CancelRequest("cut short"))
    g.run()


def test_a_hybrid_restore_cancelled_midway_leaves_no_end_without_its_state():
    """A hybrid restore loads its batches' attention KV, and only its last page brings the
    recurrent state. Cancelled in between (its client left), the slot's end has no state: it
    goes back to its mark, so no snapshot is staged there and no request continues from
    there. Before, the core staged the slot's tail with a state it did not have, and a
    request sharing those tokens reused them on a state that was not theirs (the scripted
    worker of test_scheduler_pages refuses both)."""
    g = Group(num_slots=1, trimmable=False, num_buffers=4)
    a = conv(1, 12 * P + 5)
    g.turn("a1", a)
    g.turn("b", conv(2, 3 * P + 1))  # takes the only slot
    follow = a + g.reply("a1")[:-1] + [7, 8, 9]
    _restore_cut_short(g, follow)
    assert g.core.slots[0].tokens == [] and not g.core.slots[0].stateless_end
    g.core.pages.forget(list(g.disk))  # and the disk has lost A's pages meanwhile
    g.disk.clear()
    again = g.turn("again", follow)
    assert again.num_cached_tokens == 0  # prefilled from its start: nothing stateless reused


def test_a_hybrid_restore_takes_the_attention_kv_a_sibling_holds_and_only_its_own_pages():
    """Two sub-agents under a system prompt, one slot each, then a third conversation takes
    B's slot. B comes back: its restore needs the state only at its end, so it copies the
    system prompt's attention KV from A's slot (where A has no state) and restores only its
    own pages, the last with the state. Before, it restored every page of its context."""
    g = Group(num_slots=2, trimmable=False)
    system = conv(5, 4 * P)
    a, b = system + conv(6, 2 * P + 3), system + conv(7, 2 * P + 5)
    g.turn("a", a)
    g.turn("b", b)
    g.turn("a2", a + g.reply("a")[:-1] + [9])
    g.turn("other", conv(8, 3 * P + 1))  # takes B's slot, the least recently used
    follow = b + g.reply("b")[:-1] + [4, 5]
    back = g.turn("b2", follow)
    record = g.records["b2"]
    assert back.num_cached_tokens == len(follow) - 2 and record.num_reread_tokens == 0
    assert 0 < record.num_restored_tokens <= len(follow) - len(system)
    copies = [c for s in g.steps for c in s.copies if c.state_follows]
    assert copies and copies[-1].num_tokens >= len(system) - P
