"""The queue's side of a step: which waiting requests take a slot, and whose slot they take.

Before the step's stages, `make_room` frees the slots that waiting requests take from running
ones (scheduler.fairness within a tenant, scheduler.tenant_shares between tenants); after
them, `admit` places the waiting requests in that order, each where `scheduler.admission`
decides, as long as its KV fits the worker's budget. Admission keeps its order: a request that
cannot be placed holds back those behind it (docs/design/scheduling.md "Scheduling").
"""

from __future__ import annotations

from collections import Counter, deque
from hashlib import blake2b

from switchyard.scheduler.admission import Decision, WaitForSibling, apply, place
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.fairness import admission_key, preempts
from switchyard.scheduler.memory_manager import MemoryManager
from switchyard.scheduler.request_lifecycle import RequestLifecycle
from switchyard.scheduler.requests import Request
from switchyard.scheduler.tenant_shares import running_by_tenant


class AdmissionManager:
    def __init__(self, state: CoreState, lifecycle: RequestLifecycle, memory: MemoryManager):
        self.state = state
        self.lifecycle = lifecycle
        self.memory = memory

    def can_admit(self) -> bool:
        # Placed before kvstore's index is known, a request would miss every page on disk.
        st = self.state
        return not st.config.wait_for_index or st.pages.kvstore_attached or st.index_overdue

    def order(self, now: float) -> list[str]:
        """Each tenant's own order (scheduler.fairness), interleaved by their shares."""
        st, cfg = self.state, self.state.config
        own = sorted(st.waiting, key=lambda rid: admission_key(
            st.requests[rid], now, cfg.background_wait_s, cfg.num_slots))
        running = running_by_tenant(st.running())
        return st.shares.admission_order(own, lambda rid: st.requests[rid].tenant, running)

    def admit(self, now: float) -> None:
        st = self.state
        if not self.can_admit():
            return
        for slot in st.slots:
            st.pages.sync_slot(slot)
        order = deque(self.order(now))
        while order:
            req = st.requests[order.popleft()]
            if not req.grammar_ready or req.fetching:
                continue  # its grammar compiles, or its pages come from a peer
            decision = place(req, st.slots, st.pages, st.config, st.prefilling())
            if isinstance(decision, WaitForSibling):
                self._note_sibling_wait(req, decision)
                continue  # the requests behind it may still take a slot
            if decision is None:
                break
            if not self.memory.room_for(req, decision, now):
                if req.waits_aside:
                    continue  # the conversations it waits for may come back meanwhile
                break  # admission keeps its order: placed when running requests give room
            first = req.admitted_at is None
            copy = apply(req, decision, st.slots, st.pages, st.pinned(placing=req), now,
                         st.threads)
            if first:
                # What it shares with earlier requests, for the residency bench's traces (a
                # debug line; bench/residency_record.py): its full pages' ids hashed again.
                st.outbox.log("request.pages", rid=req.rid, arrived_at=req.arrived_at,
                              num_prompt_tokens=len(req.prompt),
                              pages=[blake2b(pid, digest_size=6).hexdigest()
                                     for pid in decision.chain])
            self._note_resumed(req, decision)
            if copy is not None:
                st.copies.append(copy)
            st.waiting.remove(req.rid)
            if self._note_overtaken(req):  # one of them ranks higher from now on
                order = deque(rid for rid in self.order(now) if rid in order)
            # In use from now: a request that waited long must not find the pages it runs on
            # the least recently used while it runs
            # (docs/design/kv-pages.md "Disk eviction policy").
            st.pages.touch(req.context_chain(st.pages.chain_namespace, st.config.page_size),
                           now)

    def make_room(self, now: float) -> None:
        """Free the slots that requests waiting for one take from running requests: an
        interactive request the slot of a background one, a request waiting for its first
        token the slot of one past its quantum (scheduler.fairness;
        docs/design/scheduling.md "Scheduling"). Runs before the step's stages, so a yielding
        slot's tail is staged before the newcomer's copy, load or prefill overwrites it: it
        resumes from its pages.
        A request with a free slot but no room for its KV takes the memory of such a request
        the same way (docs/design/kv-pages.md "Memory plan").
        """
        st = self.state
        if not st.waiting or not self.can_admit():
            return
        free = sum(1 for s in st.slots if s.free)
        promised = Counter()  # slots this pass gives, by tenant (scheduler.tenant_shares)
        for rid in self.order(now):
            req = st.requests[rid]
            if not req.grammar_ready or req.fetching \
                    or req.waits_for in {r.rid for r in st.prefilling()}:
                continue  # not placed now: no slot is freed for it
            if free and not self.memory.short_of(req, now):
                free -= 1  # a free slot is there for it
                promised[req.tenant] += 1
                continue
            victim = self._victim(req, now, promised)
            if victim is not None and free:
                st.num_memory_preemptions += 1
                self.lifecycle.preempt(victim, now, "memory", for_rid=req.rid)
                break  # placed once there is room: nobody behind it is placed before
            if victim is None:
                break  # admission keeps its order: nobody behind it is placed either
            self.lifecycle.preempt(victim, now, "slot")
            promised[req.tenant] += 1

    def _victim(self, waiter: Request, now: float, promised: Counter) -> Request | None:
        """The running request whose slot `waiter` takes, if any: within its tenant by rank
        (scheduler.fairness), from another tenant only below its share (`promised`: slots
        given this pass, by tenant; scheduler.tenant_shares). The tenant furthest over its
        share first, then background before interactive, then the newest to arrive."""
        st, cfg = self.state, self.state.config
        running = st.running()
        counts = running_by_tenant(running) + promised
        victims = [r for r in running
                   if (preempts(waiter, r, now, cfg.background_wait_s, cfg.slice_tokens,
                                cfg.num_slots) if r.tenant == waiter.tenant
                       else st.shares.takes_share(waiter.tenant, r.tenant, counts)
                       and not r.cancelled)]
        return max(victims, key=lambda r: (st.shares.usage(r.tenant, counts),
                                           not st.interactive(r, now), r.arrived_at),
                   default=None)

    def _note_resumed(self, req: Request, decision: Decision) -> None:
        """A request placed again after it gave its slot up: what of its slot's tokens it
        finds again (kept, copied, restored) and what it must prefill again (never, while
        its pages reach the disk)."""
        if not req.held_when_preempted:
            return
        p = decision.placement
        found = max(p.copied if p.copy_from is not None else p.reused,
                    p.restore_from + p.restored if p.restored else 0)
        reread = max(0, req.held_when_preempted - found)
        req.num_reread += reread
        self.state.outbox.log("request.resumed", rid=req.rid, num_held=req.held_when_preempted,
                              num_reused=p.reused if p.copy_from is None else 0,
                              num_copied=p.copied, num_restored=p.restored, num_reread=reread)
        req.held_when_preempted = 0

    def _note_sibling_wait(self, req: Request, wait: WaitForSibling) -> None:
        if wait.branch_at:  # a hybrid sibling keeps its state where they part
            sibling = self.state.requests[wait.sibling]
            sibling.branch_point = wait.branch_at
            self.state.slots[sibling.slot].branch_tail_at = wait.branch_at
        if req.waits_for != wait.sibling:
            req.waits_for = wait.sibling
            self.state.outbox.log("request.waits_for_sibling", rid=req.rid,
                                  sibling=wait.sibling, num_shared_tokens=wait.shared)

    def _note_overtaken(self, placed: Request) -> bool:
        """Requests that gave their slot up before `placed` entered the queue were overtaken
        once more (the slicing bound, scheduler.fairness); True if that made one of them
        rank as waiting for its first token."""
        st = self.state
        bound, promoted = st.config.num_slots, False
        for rid in st.waiting:
            req = st.requests[rid]
            if req.generated and req.queued_at < placed.queued_at:
                req.num_overtaken += 1
                promoted = promoted or req.num_overtaken == bound
        return promoted
