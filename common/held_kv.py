"""The KV memory slots hold, counted in tokens (docs/design/kv-pages.md "Memory plan").

The worker reports how many tokens of slot KV its memory holds (`WorkerReady.kv_budget_tokens`)
and sizes `--max-running 0` with `held_tokens`; the scheduler keeps what running requests and
resident conversations hold, plus a reserve for their growth, within that budget. One function
for both, so the number the worker planned is the number the scheduler keeps.

What is counted, per slot, is the memory its caches may have, not its tokens: mlx-lm's KVCache
and worker/batch_kv.py grow in steps of `CACHE_STEP` tokens, and a restore makes room for the
whole context and an eighth more at once (worker/executor.py), within --ctx. While several
slots decode together their rows are also held as one batch, each row as long as the longest
(batch_kv.py pads rows to the longest), next to the slots' own caches while it is merged. An
idle slot shelved as shared pages holds its tokens exactly, and a page several of them hold
counts once (docs/design/kv-pages.md "Shared pages in memory").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CACHE_STEP = 256  # mlx-lm's KVCache.step and BatchKV.step: caches grow this many tokens at a time


@dataclass(frozen=True)
class SlotHold:
    """One slot's KV as the scheduler sees it before a step."""

    tokens: int  # tokens it holds now
    # Tokens its request may add before the next look: the rest of its prefill or restore,
    # and its reply's growth (`growth_reserve`); 0 for an idle slot.
    reserve: int = 0
    # A running request's: running requests decode together, as rows of one batch once their
    # prefill is done (counted from the start, so a request placed never outgrows the room
    # it was placed in by joining the batch).
    running: bool = False
    # An idle slot the worker holds as shared pages (worker/shared_pages.py): the ids of its
    # full pages of `page_size` tokens, each counted once however many such slots hold it,
    # and its tokens exactly (no room to grow).
    pages: tuple[bytes, ...] = ()
    page_size: int = 0  # 0: held as one cache of its own


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def slot_capacity(num_tokens: int, ctx: int) -> int:
    """Tokens of KV memory a slot holding `num_tokens` may have: what a restore makes room for
    (the context and an eighth, within --ctx), rounded up to the cache's step."""
    if num_tokens <= 0:
        return 0
    return _round_up(min(num_tokens + num_tokens // 8, ctx) + 1, CACHE_STEP)


def held_tokens(holds: Iterable[SlotHold], ctx: int) -> int:
    """The KV memory, in tokens, that slots of these holds may take during the next step."""
    holds = list(holds)
    shelved = [h for h in holds if h.page_size]
    total = sum(slot_capacity(h.tokens + h.reserve, ctx) for h in holds if not h.page_size)
    if shelved:
        pages = {(pid, h.page_size) for h in shelved for pid in h.pages}
        total += sum(h.tokens - len(h.pages) * h.page_size for h in shelved)
        total += sum(size for _, size in pages)
    rows = [h.tokens + h.reserve for h in holds if h.running]
    if len(rows) > 1:  # a lone decoding slot runs on its own cache (worker/slots.py)
        total += len(rows) * _round_up(max(rows) + 1, CACHE_STEP)
    return total


def growth_reserve(remaining_prefill: int, remaining_tokens: int) -> int:
    """What a running request may add before the scheduler looks again: the rest of its
    prefill (or restore: room for it is made at once), and up to one cache step of reply (a
    step decodes at most a burst; the cache grows a step at a time)."""
    return max(0, remaining_prefill) + max(0, min(remaining_tokens, CACHE_STEP))


def running_that_fit(budget_tokens: int, request_tokens: int, ctx: int, most: int) -> int:
    """How many requests of `request_tokens` tokens each, decoding together with their
    reserve, fit in `budget_tokens`: at most `most`, at least 1."""
    hold = SlotHold(min(request_tokens, ctx), CACHE_STEP, running=True)
    for n in range(most, 1, -1):
        if held_tokens([hold] * n, ctx) <= budget_tokens:
            return n
    return 1
