"""What the scheduler core knows, shared by the core and its managers. No I/O, no clocks.

The slots, the requests and their queue, the step in flight, the page cache and the outbox
every message goes through, with the questions each manager asks of them. The managers
(scheduler/request_lifecycle.py, admission_manager.py, memory_manager.py, decode_plan.py,
disk_manager.py) change this state; `SchedulerCore` is this state plus the step.
"""

from __future__ import annotations

from collections import deque

from switchyard.proto.scheduler_worker import CopyPrefix, RunStep
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.conversation_threads import ConversationThreads
from switchyard.scheduler.fairness import interactive_now
from switchyard.scheduler.outbox import Outbox
from switchyard.scheduler.page_cache import PageCache
from switchyard.scheduler.prefill_plan import PrefillShare
from switchyard.scheduler.proposer import Proposer, ProposerConfig
from switchyard.scheduler.requests import Request, Slot
from switchyard.scheduler.restore import DiskReads
from switchyard.scheduler.status_rows import RootTenants
from switchyard.scheduler.step_budget import PrefillBudget
from switchyard.scheduler.tenant_shares import TenantShares


class CoreState:
    def __init__(self, config: CoreConfig):
        self.config = config
        self.slots = [Slot(i) for i in range(config.num_slots)]
        self.requests: dict[str, Request] = {}
        self.waiting: deque[str] = deque()
        self.inflight: RunStep | None = None
        self.outbox = Outbox()
        self.root_tenants = RootTenants()  # whose an idle slot's text is, for the status
        self.threads = ConversationThreads()  # recent requests' conversations, for the status
        self.pages = PageCache(config.page_size, config.disk_budget_bytes,
                               config.protect_window_s, self.outbox)
        self.budget = PrefillBudget(config.prefill_chunk, config.decode_share)
        self.prefill_share: tuple[float, PrefillShare] | None = None
        self.copies: list[CopyPrefix] = []  # slot-to-slot copies for the next step
        self.reads = DiskReads(self.pages)
        self.unsent: dict[str, list[int]] = {}  # tokens of this step, sent once per request
        # Speculative decoding's drafts (docs/design/speculative-decoding.md).
        self.proposer = (Proposer(ProposerConfig(max_draft=config.num_draft_tokens,
                                                 always=config.always_draft,
                                                 draft_only=config.draft_only))
                         if config.num_draft_tokens > 0 else None)
        self.index_overdue = False  # kvstore's index is long overdue: place without it
        self.worker_stopping = False  # written back before it stops: nothing new is placed
        self.num_memory_preemptions = 0  # running requests staged to disk for memory
        self.num_cut = self.cut_kept_tokens = 0  # idle slots cut for memory, tokens they kept
        self.shares = TenantShares()  # tenants' shares of queue, slots and prefill

    @property
    def step_in_flight(self) -> bool:
        return self.inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.slots if s.rid is not None)

    def running(self) -> list[Request]:
        """The requests in slots, in slot order."""
        return [self.requests[s.rid] for s in self.slots if s.rid is not None]

    def remaining_prefill(self, req: Request) -> int:
        return req.num_context - len(self.slots[req.slot].tokens)

    def prefilling(self) -> list[Request]:
        """Requests in slots whose context is not all there yet (prefill, restore, load)."""
        return [r for r in self.running() if self.remaining_prefill(r) > 0]

    def interactive(self, req: Request, now: float) -> bool:
        return interactive_now(req, now, self.config.background_wait_s)

    def busy(self, req: Request) -> bool:
        """Part of the step in flight or of a page read: it finishes when that comes back."""
        in_step = self.inflight is not None and req.slot is not None
        return in_step or bool(req.reading)

    def releasable(self, slot: Slot) -> bool:
        """Its KV can leave memory: every token on disk or on its way (without a kvstore, at
        once), or, where a tight disk let go of some, written again as far as the disk took
        them (`Slot.disk_tried`: the rest is re-read; scheduler/disk_copy.py)."""
        return not self.pages.enabled or slot.disk_tried or self.pages.all_on_disk(slot)

    def pinned(self, placing: Request | None = None) -> set[bytes]:
        """Pages eviction must leave: those requests are restoring, and those waiting
        requests will restore (docs/design/kv-pages.md "Disk eviction policy"), first those
        of contexts no slot holds: a context a slot holds is restored only if that slot
        leaves memory first. The request being placed (`placing`) pins only what it
        restores: the tails it passed go."""
        pinned = set()
        for req in self.requests.values():
            pinned.update(p.page_id for p in req.restore_pages)
            pinned.update(p.page_id for p, _ in req.reading + req.loading)
        ns, P = self.pages.chain_namespace, self.config.page_size
        held = {(s.root, s.page_ids[-1]) for s in self.slots if s.page_ids}

        def held_by_a_slot(context: tuple) -> bool:
            chain, *_, root = context
            return bool(chain) and (root, chain[-1]) in held

        contexts = [(r.context_chain(ns, P), r.feed, r.num_context, r.images, r.root)
                    for r in (self.requests[rid] for rid in self.waiting) if r is not placing]
        contexts.sort(key=held_by_a_slot)  # stable: oldest first within each
        return pinned | self.pages.awaited(contexts, self.config.trimmable)

    def vacate(self, req: Request, now: float) -> None:
        """Take a request that stops running (finished or preempted) out of its slot. The
        slot keeps its tokens: its tail is staged with the next step, its pages count as
        used now, and its turn as replied now (when its conversation's next turn comes is
        measured from here: scheduler/residency.py `expected_back`)."""
        slot = self.slots[req.slot]
        if slot.stateless_end:  # its restore left before the last page brought the state
            slot.truncate(slot.state_mark, self.config.page_size)
        slot.rid = None
        slot.tail_wanted = True
        self.pages.sync_slot(slot)
        self.pages.touch(slot.page_ids, now)
        if slot.turn is not None:
            self.pages.turns.replied(slot.turn, now)
        self.unplace(req)

    def unplace(self, req: Request, release: bool = True) -> None:
        """Take a request out of its slot. Buffers of a read in flight stay with that read
        (`pages_read` frees them); buffers read and not yet loaded are freed here."""
        if release and req.loading:
            self.pages.release([b for _, b in req.loading])
        req.reading, req.loading, req.restore_pages = [], [], []
        req.slot = None
