"""Two-tier page caches replayed over a trace: LRU, and the offline optimum (Belady).

The model (the same for every policy here, page-granular like the server's pages):
- A unit is a whole page (P tokens, named by its chained id) or a tail (the partial page
  where a prompt ended), kept as the server keeps them (docs/design/kv-pages.md "KV pages").
- Requests run one after another in arrival order. A request walks its prompt's pages from
  the first: each unit found in memory is free, one found only on disk is restored (its
  tokens count in `bytes_restored`); the first unit found nowhere ends the walk (a page's KV
  needs every page before it), and every token from there to the end of what earlier
  prompts held is prefilled again: `tokens_reread`. Tokens no earlier prompt held are new,
  not counted.
- Afterwards the request's units are in memory; memory holds at most `memory_tokens`
  (shared pages once). Units leaving memory are written to disk if they are needed again
  and not there yet (`bytes_written`; write-back: the fewest writes that keep them), and
  disk holds at most `disk_tokens`.

LRU evicts the least recently used unit from each tier. The optimum evicts the unit whose
next use is furthest (Belady's MIN) from memory and from disk, and writes nothing that is
never used again. For one tier of equal-size units MIN is the least misses possible; for
two tiers jointly it is a heuristic, so `reread_bound` gives a true lower bound on
re-reads: MIN over one tier of memory + disk tokens, since any policy keeps at most that
many tokens in memory and on disk together (exact for whole pages; tails are smaller, so
the bound is within a page per request of exact).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from bench.residency_trace import Trace, synthesize

NEVER = 1 << 60


@dataclass(frozen=True)
class Unit:
    uid: bytes
    tokens: int
    end: int = 0  # where in its prompt it ends: deeper units go first on a tie


@dataclass
class Costs:
    tokens_reread: int = 0
    tokens_restored: int = 0
    tokens_written: int = 0
    disk_overshoot_tokens: int = 0  # the optimum only: see replay_optimal


def units_of(ids: list[int], page_size: int) -> tuple[list[Unit], Unit | None]:
    """A prompt's whole pages, chained like common/page_ids.py, and its tail (or None)."""
    pages, parent = [], b"\0" * 16
    for k in range(len(ids) // page_size):
        chunk = ids[k * page_size:(k + 1) * page_size]
        parent = hashlib.blake2b(parent + repr(chunk).encode(), digest_size=16).digest()
        pages.append(Unit(parent, page_size, (k + 1) * page_size))
    rest = ids[len(pages) * page_size:]
    tail = None
    if rest:
        tail = Unit(hashlib.blake2b(b"tail" + parent + repr(rest).encode(),
                                    digest_size=16).digest(), len(rest), len(ids))
    return pages, tail


@dataclass(frozen=True)
class Access:
    """What one request could take from the cache, in order, and what it leaves there."""

    wanted: list[Unit]  # the units earlier prompts made, in walk order
    shared: int  # tokens of the prompt earlier prompts held
    made: list[Unit]  # its own units, resident after it ran


def accesses(trace: Trace) -> list[Access]:
    p = trace.page_size
    prompts = synthesize(trace)
    seen: set[bytes] = set()
    tails: dict[bytes, list[Unit]] = {}  # the id of the page before a tail -> tails there
    tail_tokens: dict[bytes, tuple] = {}  # tail id -> its tokens
    out = []
    for r, ids in zip(trace.requests, prompts):
        pages, tail = units_of(ids, p)
        wanted = []
        for k, u in enumerate(pages):
            if u.uid not in seen:
                break
            wanted.append(u)
        k = len(wanted)
        before = wanted[-1].uid if wanted else b"\0" * 16
        # A tail extends the walk if this prompt continues its tokens (and is not already
        # covered by a whole page).
        best = None
        for t in tails.get(before, []):
            if tuple(ids[k * p:k * p + t.tokens]) == tail_tokens[t.uid] and \
                    (best is None or t.tokens > best.tokens):
                best = t
        if best is not None:
            wanted.append(best)
        out.append(Access(wanted, r.num_shared, pages + ([tail] if tail else [])))
        seen.update(u.uid for u in pages)
        if tail:
            parent = pages[-1].uid if pages else b"\0" * 16
            if tail.uid not in tail_tokens:
                tails.setdefault(parent, []).append(tail)
                tail_tokens[tail.uid] = tuple(ids[len(pages) * p:])
    return out


def next_uses(acc: list[Access]) -> list[dict[bytes, int]]:
    """For each request i, unit -> the next request after i that wants it (NEVER if none)."""
    upcoming: dict[bytes, int] = {}
    out: list[dict[bytes, int]] = [{} for _ in acc]
    for i in range(len(acc) - 1, -1, -1):
        out[i] = {u.uid: upcoming.get(u.uid, NEVER) for u in acc[i].made + acc[i].wanted}
        for u in acc[i].wanted:
            upcoming[u.uid] = i
    return out


class Tier:
    """Units held within a token budget, with each unit's last use and next use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.units: OrderedDict[bytes, int] = OrderedDict()  # uid -> tokens, LRU first
        self.used = 0
        self.next: dict[bytes, int] = {}
        self.end: dict[bytes, int] = {}

    def __contains__(self, uid: bytes) -> bool:
        return uid in self.units

    def touch(self, u: Unit, next_use: int) -> None:
        if u.uid in self.units:
            self.units.move_to_end(u.uid)
        else:
            self.units[u.uid] = u.tokens
            self.used += u.tokens
        self.next[u.uid] = next_use
        self.end[u.uid] = u.end

    def remove(self, uid: bytes) -> int:
        tokens = self.units.pop(uid)
        self.used -= tokens
        self.next.pop(uid, None)
        self.end.pop(uid, None)
        return tokens

    def victim(self, policy: str, pinned: set[bytes]) -> bytes | None:
        free = (uid for uid in self.units if uid not in pinned)
        if policy == "lru":
            return next(free, None)
        # Furthest next use; on a tie the deepest unit, since a page is worth nothing
        # without the pages before it (a child is never wanted without its parent).
        return max(free, key=lambda uid: (self.next[uid], self.end[uid]), default=None)


def replay(trace: Trace, policy: str, memory_tokens: int, disk_tokens: int) -> Costs:
    """LRU ("lru") or the offline optimum ("optimal") over both tiers."""
    if policy == "optimal":
        return replay_optimal(trace, memory_tokens, disk_tokens)
    acc = accesses(trace)
    mem, disk = Tier(memory_tokens), Tier(disk_tokens)
    costs = Costs()
    for a in acc:
        cached = 0
        for u in a.wanted:
            if u.uid in mem:
                mem.touch(u, 0)
            elif u.uid in disk:
                costs.tokens_restored += u.tokens
                disk.touch(u, 0)
            else:
                break
            cached += u.tokens
        costs.tokens_reread += max(0, a.shared - cached)
        pinned = {u.uid for u in a.made}
        for u in a.made:
            mem.touch(u, 0)
        while mem.used > mem.capacity:
            uid = mem.victim("lru", pinned)
            if uid is None:
                break  # one request larger than memory: it stays while it runs
            end = mem.end[uid]
            tokens = mem.remove(uid)
            if uid not in disk and tokens <= disk.capacity:
                while disk.used + tokens > disk.capacity:
                    disk.remove(disk.victim("lru", set()))
                disk.touch(Unit(uid, tokens, end), 0)
                costs.tokens_written += tokens
    return costs


def min_contents(acc: list[Access], capacity: int) -> list[set[bytes]]:
    """Belady's MIN over one tier of `capacity` tokens, with bypass: for each request, the
    units held when it arrives. Its priority (next use, then depth) does not depend on the
    capacity, so it is a stack algorithm: a smaller cache holds a subset of a larger one's
    units at every request (the inclusion property), which `replay_optimal` relies on."""
    nxt = next_uses(acc)
    tier = Tier(capacity)
    held = []
    for i, a in enumerate(acc):
        held.append(set(tier.units))
        for u in a.made:
            tier.touch(u, nxt[i][u.uid])
        for u in a.wanted:
            if u.uid in tier:
                tier.touch(u, nxt[i][u.uid])
        while tier.used > tier.capacity:
            tier.remove(tier.victim("optimal", set()))
    held.append(set(tier.units))
    return held


def replay_optimal(trace: Trace, memory_tokens: int, disk_tokens: int) -> Costs:
    """Memory holds what MIN holds with `memory_tokens`; memory and disk together what MIN
    holds with both budgets (disk counted apart from memory). Re-reads are then the fewest
    any policy can have (`reread_bound`), and restores plus re-reads the fewest memory
    misses (for whole pages; tails are smaller than pages, and for units of unequal sizes MIN
    is within a unit per eviction of optimal, not exact). A unit is written when it leaves memory but stays in the larger cache, unless
    its copy there was written before and kept since."""
    acc = accesses(trace)
    in_mem = min_contents(acc, memory_tokens)
    in_both = min_contents(acc, memory_tokens + disk_tokens)
    costs = Costs()
    on_disk: set[bytes] = set()
    tokens: dict[bytes, int] = {}
    last_wanted = {u.uid: i for i, a in enumerate(acc) for u in a.wanted}
    for i, a in enumerate(acc):
        cached = 0
        for u in a.wanted:
            if u.uid not in in_both[i]:
                break
            if u.uid not in in_mem[i]:
                costs.tokens_restored += u.tokens
            cached += u.tokens
        costs.tokens_reread += max(0, a.shared - cached)
        tokens.update((u.uid, u.tokens) for u in a.made)
        # Tails make units unequal, and then inclusion can fail by a unit: memory is taken
        # as MIN's within the larger cache, and disk may hold that much past its budget.
        over = sum(tokens[uid] for uid in in_mem[i + 1] - in_both[i + 1])
        costs.disk_overshoot_tokens = max(costs.disk_overshoot_tokens, over)
        on_disk &= in_both[i + 1]
        for uid in (in_both[i + 1] - in_mem[i + 1]) - on_disk:
            if last_wanted.get(uid, -1) <= i:
                continue  # held only because there was room: never read, never written
            costs.tokens_written += tokens[uid]
            on_disk.add(uid)
    return costs


def reread_bound(trace: Trace, memory_tokens: int, disk_tokens: int) -> int:
    """A lower bound on any policy's re-read tokens: MIN over one tier of both budgets (any
    policy keeps at most that many tokens in memory and on disk together)."""
    return replay_optimal(trace, memory_tokens + disk_tokens, 0).tokens_reread
