"""Placing a request that leaves the queue: its slot and where its prefix comes from.

`place` decides, with `scheduler.placement` scoring the options, and changes nothing; `apply`
commits the decision to the slot, the request and the page cache. The admission manager
(scheduler/admission_manager.py) owns the queue's order and calls them while it admits
(docs/design/scheduling.md "Scheduling").
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from switchyard.proto.scheduler_worker import CopyPrefix
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.conversation_threads import ConversationThreads
from switchyard.scheduler.page_cache import DiskPage, PageCache
from switchyard.scheduler.placement import Placement, Sources, choose_slot, usable_match
from switchyard.scheduler.requests import Request, Slot, common_prefix_len


@dataclass(frozen=True)
class Decision:
    """Where a request runs (`placement`), the disk pages it restores, and the token where it
    leaves the pages already on disk (a hybrid model snapshots its state there)."""

    placement: Placement
    restore_pages: tuple[DiskPage, ...] = ()
    branch_point: int | None = None
    chain: tuple[bytes, ...] = ()  # the context's full pages
    # A hybrid or window model's restore: its last page brings the state, so what the slot
    # keeps or copies is wanted for its attention KV only (CopyPrefix.state_follows).
    state_follows: bool = False


@dataclass(frozen=True)
class WaitForSibling:
    """The request waits in the queue, without a slot, while a running request prefills a
    prefix they share; it copies that prefix once the sibling's slot holds it."""

    sibling: str  # its rid
    shared: int  # tokens of the prefix they share (whole pages; any token on a hybrid model)
    # A hybrid model: the sibling's prefill is to stop there and keep its state (its branch
    # point: docs/design/kv-pages.md "Branch points"), for this request to copy or restore.
    branch_at: int = 0


def sibling_prefilling(req: Request, chain: list[bytes], have: int,
                       prefilling: Sequence[Request], slots: list[Slot], namespace: bytes,
                       cfg: CoreConfig) -> WaitForSibling | None:
    """A running request prefilling a prefix `req` (its context's page `chain`) shares
    beyond the `have` tokens a slot or the disk gives it already, and that will hold it
    no later than `req` would prefill it alone: its slot holds at least `have` tokens of it
    (six sub-agents arriving together under one system prompt prefill it once;
    the other five copy it). Prefilling beside it instead, each would get half of every
    step's chunk. Whole pages, on attention KV. A hybrid model's slot gives a prefix only
    where it has its recurrent state: the sibling's prefill stops where they part, to any
    token, and keeps its state there (its branch point, `branch_at`), unless it is to stop
    at another branch point first."""
    best: WaitForSibling | None = None
    for sibling in prefilling:
        if sibling.slot is None or (req.interactive and not sibling.interactive):
            continue  # a background sibling's prefill yields to interactive work
        num_shared = 0
        for mine, other in zip(chain, sibling.context_chain(namespace, cfg.page_size)):
            if mine != other:
                break
            num_shared += 1
        shared = num_shared * cfg.page_size
        held = len(slots[sibling.slot].tokens)
        if not cfg.trimmable:
            if not (req.images or sibling.images):  # (an image's tokens do not name it)
                shared += common_prefix_len(
                    req.feed[shared:min(req.num_context, shared + cfg.page_size)],
                    sibling.feed[shared:min(sibling.num_context, shared + cfg.page_size)])
            if held < sibling.branch_point != shared:
                continue  # its state is kept at another point ahead: not where they part
        if shared <= have or held >= shared:
            continue  # nothing more to gain, or a copy is there to take now
        if held >= have and (best is None or shared > best.shared):
            best = WaitForSibling(sibling.rid, shared, 0 if cfg.trimmable else shared)
    return best


def place(req: Request, slots: list[Slot], pages: PageCache, cfg: CoreConfig,
          prefilling: Sequence[Request] = ()) -> Decision | WaitForSibling | None:
    """Where the request runs and where its prefix comes from; None: no slot is free, or the
    request waits for its own pages to land on disk; WaitForSibling: it waits for a running
    request prefilling their shared prefix (`prefilling`, those in slots still prefilling).
    The slots' page ids must be in sync with their tokens (`PageCache.sync_slot`).

    Costs O(pages) of the context, not O(tokens): the request's page chain grows as its
    pages fill, and slots are matched by page ids (docs/design/scheduling.md "Scheduling")."""
    if not any(s.free for s in slots):
        return None  # nothing to choose from: decided again when a slot frees
    feed, n, P = req.feed, req.num_context, cfg.page_size
    chain = req.context_chain(pages.chain_namespace, P)
    on_disk = pages.disk_prefix(chain, feed, n, cfg.trimmable, req.images, req.root)
    disk_tokens = on_disk[-1].start + on_disk[-1].num_tokens if on_disk else 0
    matches, shared_with, parts = {}, {}, 0
    for slot in slots:
        shared = slot.shared_prefix(chain, feed, n, P, req.images, req.root)
        m = usable_match(slot, shared, cfg.trimmable)
        if m:
            matches[slot.index] = m
        if shared and not cfg.trimmable:
            shared_with[slot.index] = shared
        # Where the context parts from another conversation's prompt (a sibling sub-agent
        # under a shared prefix); a slot's own reply, which a client may rewrite, is no branch.
        if shared < min(n, slot.turn.num_tokens if slot.turn else len(slot.tokens)):
            parts = max(parts, shared)
    # A conversation that comes back while its own pages are still on their way to disk
    # (its slot was taken meanwhile) waits for them instead of re-reading them, also where a
    # sibling's slot shares a few tokens more than the disk's whole pages; one that a slot
    # still holds is served from memory.
    best_match = max(matches.values(), default=0)
    pending_end = pages.writing_end(chain, feed, n, on_disk, req.images, req.root)
    if pending_end and (best_match <= max(P, disk_tokens) or pending_end > best_match):
        return None  # decided again when the writes land (PagesWritten)
    if prefilling:
        have = max(max(matches.values(), default=0), disk_tokens)
        waiting = sibling_prefilling(req, chain, have, prefilling, slots, pages.chain_namespace,
                                     cfg)
        if waiting is not None:
            return waiting
    sources = Sources(n, disk_tokens, matches, P, cfg.trimmable, shared_with)
    persisted = {s.index: pages.persisted_tokens(s, matches.get(s.index, 0))
                 for s in slots if s.free}
    placement = choose_slot(slots, sources, persisted)
    if placement is None:
        return None
    branch_point = None
    if not cfg.trimmable and pages.enabled:
        # Where this request leaves the pages already on disk (the end of a shared prefix,
        # say a system prompt), or the tokens a slot holds, is where its state is worth a
        # snapshot for the next one: a tail when it falls inside a page
        # (docs/design/kv-pages.md "Branch points").
        branch_point = max(pages.tree.longest_prefix(chain) * cfg.page_size, parts)
    restore = tuple(p for p in on_disk if p.start >= placement.restore_from) \
        if placement.restored else ()
    return Decision(placement, restore, branch_point, tuple(chain),
                    state_follows=not cfg.trimmable and bool(placement.restored))


def apply(req: Request, decision: Decision, slots: list[Slot], pages: PageCache,
          pinned: Set[bytes], now: float,
          threads: ConversationThreads | None = None) -> CopyPrefix | None:
    """Put the request in its slot as decided; the copy the worker makes first, if any.
    `pinned`: pages other requests will restore, never dropped here; `threads`: where its
    conversation's label comes from, at its first placement."""
    p, page_size = decision.placement, pages.page_size
    if decision.branch_point is not None:
        req.branch_point = decision.branch_point
    req.restore_pages = list(decision.restore_pages)
    # The turns this request continues are superseded, then the tails it passes that are
    # nobody's go (docs/design/kv-pages.md "KV pages"); its own turn is remembered from here.
    chain = list(decision.chain)
    turn = pages.anchor(chain, req.feed, len(req.prompt) - 1, req.images, req.root)
    continued, replied = pages.supersede(chain, req.feed, len(req.prompt) - 1, req.images,
                                         req.root)
    if threads is not None and not req.conversation:
        first = chain[0] if chain else turn.tail_id if turn is not None else req.rid.encode()
        req.conversation = threads.place(turn, continued, first, req.tenant)
    pages.drop_passed_tails(chain, set(pinned) | {page.page_id for page in decision.restore_pages},
                            req.root)
    if turn is not None:
        pages.turns.begin(turn)
    slot = slots[p.slot]
    copy = None
    if p.copy_from is not None:
        src = slots[p.copy_from]
        slot.replace(src.tokens[:p.copied], src.page_ids[:p.copied // page_size],
                     root=src.root)
        if src.rid is None and p.copied + page_size > len(src.tokens):
            src.reply_end = "superseded"  # its conversation goes on here: nobody comes back
        if src.state_mark <= p.copied:  # the worker copies the mark with the prefix
            slot.state_mark = src.state_mark
        copy = CopyPrefix(p.copy_from, p.slot, p.copied, decision.state_follows)
        slot.stateless_end = decision.state_follows and not src.has_state_at(p.copied)
    else:  # the worker trims to the first command's start
        slot.truncate(p.reused, page_size, decision.state_follows)
    # How long after its conversation's previous reply this turn came (Slot.return_gap).
    slot.return_gap = None if replied is None else max(0.0, req.arrived_at - replied)
    slot.rid, slot.last_used, slot.turn = req.rid, now, turn
    slot.shelved = False  # the worker makes it whole to use it
    slot.last_rid, slot.reply_end, slot.background = req.rid, "", not req.interactive
    slot.disk_wanted = slot.disk_tried = False  # it stays in memory
    if slot.root != req.root:  # it kept nothing (shared_prefix): the slot is this salt's now
        slot.truncate(0, page_size)
        slot.root = req.root
    slot.images = req.images  # the slot's kept tokens are this request's: so are its images
    slot.branch_tail_at = decision.branch_point or 0
    req.slot = p.slot
    if req.admitted_at is None:
        req.admitted_at = now
    req.placed_generated = len(req.generated)
    if req.generated:
        return copy  # resumed mid-reply: its prompt was counted where it got its first token
    # Accounting follows the latest placement before the first token (a worker restart
    # places a request again).
    req.num_reused = p.reused if p.copy_from is None else 0
    req.num_copied = p.copied
    req.num_restored = 0
    req.cache_counted = False
    req.restore_started_at = now if p.restored else None
    return copy
