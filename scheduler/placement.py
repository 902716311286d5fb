"""Slot placement: which free slot a new request should run in.

Rules (DESIGN.md "Scheduling", F3):
- A slot whose whole content is a prefix of the request (or that is empty) displaces nothing;
  such slots always win over slots holding another conversation.
- Among them, the fewest tokens to prefill wins; ties go to the least recently used slot.
- Otherwise every free slot displaces someone; the cost is the tokens to prefill plus the value
  of what is lost (the resident tokens beyond the shared prefix), ties to the LRU slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.requests import Slot, common_prefix_len


@dataclass(frozen=True)
class Placement:
    slot: int
    reused: int  # tokens of the request already in the slot's KV
    to_prefill: int
    displaced: int  # resident tokens that will be dropped


def evaluate(slot: Slot, context: tuple[int, ...], trimmable: bool) -> Placement:
    """Cost of running a request whose KV must end up holding `context` in `slot`."""
    match = common_prefix_len(slot.tokens, context)
    if not trimmable and match < len(slot.tokens):
        # Recurrent state cannot be rewound: only a pure extension can reuse the slot.
        match = 0
    return Placement(slot.index, match, len(context) - match, len(slot.tokens) - match)


def choose_slot(slots: list[Slot], context: tuple[int, ...], trimmable: bool) -> Placement | None:
    options = [evaluate(s, context, trimmable) for s in slots if s.free]
    if not options:
        return None
    last_used = {s.index: s.last_used for s in slots}
    harmless = [p for p in options if p.displaced == 0]
    if harmless:
        return min(harmless, key=lambda p: (p.to_prefill, last_used[p.slot]))
    return min(options, key=lambda p: (p.to_prefill + p.displaced, last_used[p.slot]))
