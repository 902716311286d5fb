"""The placement cost model, table-driven: where a request's prefix comes from and which slot
it displaces. Slots are described by their tokens; `disk` is the restorable prefix length."""

import pytest

from switchyard.scheduler.placement import Sources, choose_slot
from switchyard.scheduler.requests import Slot

P = 16
SYS = list(range(1, 1 + 4 * P))  # a 4-page system prompt
A = SYS + list(range(500, 500 + 3 * P))
B = SYS + list(range(700, 700 + 2 * P))


def slot(i, tokens, busy=False, last_used=0.0):
    s = Slot(i, list(tokens), rid="x" if busy else None, last_used=last_used)
    return s


def place(slots, context, disk=0, trimmable=True, persisted=None):
    matches = {}
    for s in slots:
        m = 0
        while m < min(len(s.tokens), len(context)) and s.tokens[m] == context[m]:
            m += 1
        if trimmable or m == len(s.tokens):
            matches[s.index] = m
    src = Sources(len(context), disk, matches, P, trimmable)
    return choose_slot(slots, src, persisted or {})


CASES = [
    # name, slots, context, disk, persisted -> (slot, reused, copied from, restored, prefill)
    ("empty slot first; the shared prefix is copied", [slot(0, A), slot(1, [])], B + [9],
     0, {}, (1, 0, 0, 0, 2 * P + 1)),
    ("continuation returns to its own slot", [slot(0, A), slot(1, B)], A + [5, 6], 0, {},
     (0, len(A), None, 0, 2)),
    ("shared prefix copied into the empty slot", [slot(0, A, busy=True), slot(1, [])],
     B + [9], 0, {}, (1, 0, 0, 0, 2 * P + 1)),
    ("restored from disk into the empty slot", [slot(0, []), slot(1, A, busy=True)],
     list(range(900, 900 + 6 * P)), 5 * P, {}, (0, 0, None, 5 * P, P)),
    ("disk beats a short resident match", [slot(0, A[:P])], A + [1], len(A), {},
     (0, P, None, len(A) - P, 1)),
    ("displace the conversation whose pages are on disk",
     [slot(0, list(range(2000, 2000 + 8 * P))), slot(1, list(range(3000, 3000 + 8 * P)))],
     list(range(5000, 5000 + P)), 0, {0: 8 * P, 1: 0}, (0, 0, None, 0, P)),
    ("a sibling's shared pages copied, the conversation's own restored",
     [slot(0, B + [8] * P, busy=True), slot(1, [])], A + [7], len(A), {},
     (1, 0, 0, len(A) - 4 * P, 1)),
    ("tie goes to the least recently used slot",
     [slot(0, [], last_used=5.0), slot(1, [], last_used=1.0)], list(range(40)), 0, {},
     (1, 0, None, 0, 40)),
]


@pytest.mark.parametrize("name, slots, context, disk, persisted, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_placement(name, slots, context, disk, persisted, expected):
    p = place(slots, context, disk, persisted=persisted)
    want_slot, reused, copied_from, restored, to_prefill = expected
    assert p.slot == want_slot
    assert p.to_prefill == to_prefill
    assert p.restored == restored
    if copied_from is None:
        assert p.copy_from is None and p.reused == reused
    else:
        assert p.copy_from == copied_from


def test_all_busy_means_wait():
    assert place([slot(0, A, busy=True)], B) is None


def test_hybrid_slot_reused_only_as_pure_extension_and_restored_from_page_end():
    s = slot(0, SYS + [42])
    p = place([s], SYS + [7, 8], disk=0, trimmable=False)
    assert p.reused == 0 and p.to_prefill == len(SYS) + 2
    p = place([slot(0, SYS)], SYS + list(range(100, 100 + 2 * P)), disk=len(SYS) + P,
              trimmable=False)
    assert p.restore_from == len(SYS) and p.restored == P
