"""Exact repeats on every model kind (docs/design/kv-pages.md "Exact repeats and state marks"):
a prompt sent again is served from cache up to its last token, from its slot, after a switch
and after a restart, also where the state exists only at the slot's end and at its mark
(hybrid and sliding-window models). The scripted worker of test_scheduler_pages checks every
cut, copy and stage against where it has the state."""

import pytest

from switchyard.proto.messages import InventoryDescribed, SlotContents
from switchyard.scheduler.core import SchedulerCore
from tests.unit.test_scheduler_pages import P, Group, conv, worker_ready


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_repeat_resumes_at_its_last_token_in_its_slot(trimmable):
    g = Group(num_slots=1, trimmable=trimmable)
    a = conv(1, 6 * P + 3)
    g.submit("a1", a)
    g.run()
    before = len(g.steps)
    g.submit("a2", a)
    g.run()
    assert g.finished("a2").num_cached_tokens == len(a) - 1
    assert g.prefilled_in(before) == 0
    assert g.reply("a2") == g.reply("a1")


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_repeat_after_a_switch_restores_its_prompts_tail(trimmable):
    g = Group(num_slots=1, trimmable=trimmable)
    a = conv(1, 6 * P + 3)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P + 5))  # takes the only slot
    g.run()
    before = len(g.steps)
    g.submit("a2", a)
    g.run()
    assert g.finished("a2").num_cached_tokens == len(a) - 1
    assert g.prefilled_in(before) == 0
    loads = [ld for s in g.steps[before:] for ld in s.loads]
    assert loads[-1].start + len(loads[-1].token_ids) == len(a) - 1
    assert loads[-1].with_state != trimmable
    # ...and once more in the slot it came back to: the restore left its state marked.
    g.submit("a3", a)
    g.run()
    assert g.finished("a3").num_cached_tokens == len(a) - 1


def test_a_hybrid_repeat_after_a_restart_restores_from_disk():
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 5 * P + 7)
    g.submit("a1", a)
    g.run()
    pages = tuple(g.disk.values())
    g.core = SchedulerCore(g.core.config)
    g.do(InventoryDescribed("kv", pages))
    g.do(worker_ready(g.core, slots=(SlotContents(0, ()),)))
    g.slots, g.marks = [[]], [0]
    g.submit("a2", a)
    g.run()
    assert g.finished("a2").num_cached_tokens == len(a) - 1


def test_a_hybrid_next_turn_after_a_repeat_still_resumes_in_its_slot():
    """The slot went back to its mark for the repeat; the next turn extends it."""
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 4 * P + 3)
    g.submit("a1", a)
    g.run()
    g.submit("a2", a)
    g.run()
    follow = a + g.reply("a2")[:-1] + [7, 8, 9]
    g.submit("a3", follow)
    g.run()
    assert g.finished("a3").num_cached_tokens == len(a) + len(g.reply("a2")) - 1


def test_without_marks_a_hybrid_repeat_rereads_its_last_partial_page():
    """A worker whose cache kind keeps no mark: the slot cannot go back, and the prompt's
    tail carries no state (the slot moved on before it was staged)."""
    g = Group(num_slots=1, trimmable=False, state_marks=False)
    a = conv(1, 4 * P + 3)
    g.submit("a1", a)
    g.run()
    g.submit("a2", a)
    g.run()
    assert g.finished("a2").num_cached_tokens < len(a) - 1
