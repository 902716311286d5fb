"""What stays in the worker's memory: the KV budget's policy, carried out on the core's slots.

Two limits: the KV the slots hold, with the running requests' reserves, stays within the
worker's budget (docs/design/kv-pages.md "Memory plan"; `scheduler.kv_memory` decides, this
manager marks slots to leave and preempts), and with --max-running past --slots at most
--slots conversations stay resident
(docs/design/scheduling.md "Running past the resident slots"). Which idle slot goes first,
and when, is the residency order (scheduler/residency.py, docs/design/scheduling.md
"Residency"): how its reply ended, as the gateway said. A slot leaves memory only once its
pages are on disk or on their way, so nothing leaves to be prefilled again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from switchyard.common.held_kv import SlotHold, held_tokens
from switchyard.proto.gateway_scheduler import ReplyEnded
from switchyard.proto.scheduler_worker import CutSlot
from switchyard.scheduler.admission import Decision
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.disk_copy import gaps_last
from switchyard.scheduler.kv_memory import holds, idle_hold, relieve, request_hold, room_for
from switchyard.scheduler.request_lifecycle import RequestLifecycle
from switchyard.scheduler.requests import Request, Slot
from switchyard.scheduler.residency import back_soon, feeding, grace_s, keep_key, waited_for
from switchyard.scheduler.tenant_shares import running_by_tenant


class MemoryManager:
    def __init__(self, state: CoreState, lifecycle: RequestLifecycle):
        self.state = state
        self.lifecycle = lifecycle

    def held_tokens(self) -> int:
        st = self.state
        return held_tokens(holds(st.slots, st.requests, st.config.page_size), st.config.ctx)

    def relieve(self, now: float) -> None:
        """When what the slots hold, with the running requests' reserves, outgrows the
        worker's KV budget: idle slots leave memory, then the newest or lowest-priority
        running requests are staged to disk (preempted: they resume by restoring their
        pages). Before the step's stages, so a yielding slot's tail is staged in this step
        and its slot released with it."""
        st = self.state
        budget = st.config.kv_budget_tokens
        if not budget:
            return
        running = running_by_tenant(st.running())
        relief = relieve(st.slots, st.requests, budget, st.config.ctx,
                         lambda r: (st.shares.usage(r.tenant, running),
                                    not st.interactive(r, now), r.arrived_at),
                         gaps_last(self._keep_key(now)), st.config.page_size, cut=self._cuts)
        held = self.held_tokens() if relief.preempt else 0
        for rid in relief.preempt:
            st.num_memory_preemptions += 1
            self.lifecycle.preempt(st.requests[rid], now, "memory", held_tokens=held,
                                   budget_tokens=budget)
        self._leave(relief.leave, relief.cut)

    def short_of(self, req: Request, now: float) -> bool:
        """Whether the request's KV would not fit the worker's budget beside what stays
        (what it may find in a slot does not change its hold), as `room_for` makes room.
        Slots already leaving count as gone: they go as soon as their pages are on their way."""
        st = self.state
        budget = st.config.kv_budget_tokens
        patient = self._patient(req, now, beside_running=bool(st.running()))
        hold = request_hold(req, 0)
        leaves = self._leaves(now, hold, -1) if patient else st.releasable
        return bool(budget) and room_for(
            hold, -1, st.slots, st.requests, budget, st.config.ctx,
            lambda s: s.leaving or leaves(s), page_size=st.config.page_size) is None

    def room_for(self, req: Request, decision: Decision, now: float) -> bool:
        """Whether the request's KV, placed as decided, fits the worker's budget, making room
        by releasing idle slots whose pages are on disk; logged once per wait when not."""
        st = self.state
        budget = st.config.kv_budget_tokens
        if not budget:
            return True
        p = decision.placement
        if self._displaces_unwritten(p.slot, p.displaced):
            return self._waits(req, budget)
        start = p.copied if p.copy_from is not None else p.reused
        hold = request_hold(req, start)
        beside_running = any(s.rid is not None and s.index != p.slot for s in st.slots)
        patient = self._patient(req, now, beside_running)
        req.waits_aside = not beside_running and self._waits_for_return(req, decision, hold, now)
        if req.waits_aside:
            return self._waits(req, budget)
        keep = self._keep_key(now)  # looks up every waiting request's pages: once
        room = room_for(hold, p.slot, st.slots, st.requests, budget, st.config.ctx,
                        self._leaves(now, hold, p.slot) if patient else st.releasable, keep,
                        st.config.page_size, cut=self._cuts, its_pages=req.context_chain(
                            st.pages.chain_namespace, st.config.page_size) if self._cuts else ())
        if not patient and any(s.disk_gap and s.free for s in st.slots):
            # Idle slots whose disk copy the disk took make room once written again: they
            # leave, and the request waits for them.
            again = room_for(hold, p.slot, st.slots, st.requests, budget, st.config.ctx,
                             self._rewritable, gaps_last(keep), st.config.page_size)
            wanted = [i for i in (again.leave if again else ())
                      if not st.releasable(st.slots[i])]
            self._leave(wanted, None)
            for index in wanted:
                st.slots[index].tail_wanted = True
            room = None if wanted else room
        if room is None:
            return self._waits(req, budget)
        req.waits_for_memory = False
        self._leave(room.leave, room.cut)
        return True

    def _displaces_unwritten(self, index: int, displaced: int) -> bool:
        """Whether a placement would overwrite tokens of idle slot `index` that a disk
        written back to (`CoreConfig.writes_back`) does not hold yet: the slot is written
        first (`Slot.disk_wanted`, as far as the disk takes it), and the request waits for
        that, as a slot leaving memory is written before it goes."""
        st = self.state
        slot = st.slots[index]
        if not st.config.writes_back or not displaced or st.releasable(slot):
            return False
        slot.disk_wanted = slot.tail_wanted = True
        return True

    def _waits(self, req: Request, budget: int) -> bool:
        """The request waits for memory (logged once per wait); False."""
        if not req.waits_for_memory:
            req.waits_for_memory = True
            self.state.outbox.log("request.waits_for_memory", rid=req.rid,
                                  num_context=req.num_context, budget_tokens=budget,
                                  held_tokens=self.held_tokens(), aside=req.waits_aside)
        return False

    def _waits_for_return(self, req: Request, decision: Decision, hold: SlotHold,
                          now: float) -> bool:
        """Whether a newcomer with nothing running beside it waits, for `tool_return_s` at
        most, for idle conversations expected back within their grace (a tool call's result,
        scheduler/residency.py `back_soon`) whose pages the disk does not hold, where they do
        not fit beside it: making its room would send them out to be re-read
        (docs/design/kv-pages.md "A disk smaller than memory"). Alone, the machine idles
        while it waits, so only for a re-read: a conversation whose pages are on disk leaves
        and is restored. The requests behind it are placed meanwhile, the conversation's next
        turn among them (`Request.waits_aside`). An interactive newcomer does not wait for a
        background conversation: it takes its memory, as it would a running one's. Nor does
        one that carries the conversation on itself (`carries_on`: a compaction of it)."""
        st, cfg = self.state, self.state.config
        if now - req.queued_at >= cfg.tool_return_s:
            return False
        p, interactive = decision.placement, st.interactive(req, now)
        due = [idle_hold(s, cfg.page_size) for s in st.slots
               if s.free and s.tokens and s.index != p.slot and not (interactive and s.background)
               and back_soon(s, now, cfg) and not st.pages.all_on_disk(s)
               and not carries_on(decision.chain, s, cfg.page_size)]
        return bool(due) and held_tokens([hold, *due], cfg.ctx) > cfg.kv_budget_tokens

    def _leave(self, leave: list[int], cut: tuple[int, int] | None) -> None:
        """The idle slots marked to leave memory; `cut`: (one of them, the tokens it keeps)."""
        for index in leave:
            self.state.slots[index].leaving = True
            self.state.slots[index].cut_to = 0
        if cut is not None:
            index, num_tokens = cut
            self.state.slots[index].cut_to = num_tokens

    @property
    def _cuts(self) -> bool:
        """Whether an idle slot may keep its front and let only its end leave (RunStep.cuts):
        where the worker can shelve it (a hybrid's state is void there until its restore's
        last page brings it: `Slot.stateless_end`), and the disk holds what memory does (on a
        smaller one the end, on disk alone, would be lost under the newcomer's own pages)."""
        cfg = self.state.config
        return cfg.shared_pages and cfg.disk_holds_memory

    def _patient(self, req: Request, now: float, beside_running: bool) -> bool:
        """Whether the newcomer waits for the running requests beside it rather than make
        its room as `_leaves` forbids: while any run, for at most `tool_return_s` (a long
        reply beside it does not keep it waiting longer)."""
        return beside_running and now - req.queued_at < self.state.config.tool_return_s

    def _leaves(self, now: float, hold: SlotHold, slot_index: int) -> Callable[[Slot], bool]:
        """Which idle slots may leave memory for a patient newcomer (`_patient`) that has
        `hold` in slot `slot_index`: beside running requests, which it can wait for instead
        (docs/design/kv-pages.md "A disk smaller than memory", docs/design/scheduling.md
        "Residency"):
        - none on a disk that took pages of resident slots (scheduler/disk_copy.py): it would
          lose the slot's pages again under the newcomer's own, and its conversation re-read
          them;
        - none on a disk smaller than memory where the newcomer fits once the requests running
          now have ended (`_fits_once_running_end`): the wait makes its room, where a slot sent
          out would hold the only copy of its pages on a disk that may let them go;
        - on a disk that holds what memory does, one whose pages are on disk, unless its
          conversation is expected back within its grace (a tool call's result,
          scheduler/residency.py `back_soon`): the newcomer waits seconds rather than
          the conversation restoring its context;
        - otherwise, one whose pages are on disk.
        An interactive newcomer still takes the memory of a background request
        (AdmissionManager.make_room asks `short_of`)."""
        st = self.state
        if any(s.disk_gap for s in st.slots):
            return _stays
        if st.config.disk_holds_memory:
            return lambda s: st.releasable(s) and not back_soon(s, now, st.config)
        if self._fits_once_running_end(hold, slot_index):
            return _stays
        return st.releasable

    def _fits_once_running_end(self, hold: SlotHold, slot_index: int) -> bool:
        """Whether a newcomer with `hold` in slot `slot_index` fits beside every idle slot
        that stays once the requests running now have ended: each is then an idle slot of its
        context and its reply's next growth, and the newcomer runs alone (no decode batch)."""
        st = self.state
        after = [hold]
        for s in st.slots:
            if s.index == slot_index:
                continue
            if s.rid is not None:
                running = request_hold(st.requests[s.rid], len(s.tokens))
                after.append(SlotHold(running.tokens + running.reserve))
            elif s.tokens and (not s.leaving or s.cut_to):
                after.append(idle_hold(s, st.config.page_size))
        return held_tokens(after, st.config.ctx) <= st.config.kv_budget_tokens

    def _rewritable(self, slot: Slot) -> bool:
        """Releasable now, or once written again (its disk copy was taken)."""
        return self.state.releasable(slot) or slot.disk_gap

    def reply_ended(self, msg: ReplyEnded) -> None:
        """The gateway's word on how a reply ended: kept by the idle slot that holds it (not
        by one a newer request took meanwhile), for the residency order."""
        for slot in self.state.slots:
            if slot.last_rid == msg.rid and slot.rid is None:
                slot.reply_end = msg.end

    def _keep_key(self, now: float) -> Callable[[Slot], tuple]:
        """Idle slots sorted by this leave memory first-to-last at `now`
        (scheduler/residency.py), with the slots whose conversation waits in the queue and
        those feeding waiting siblings known."""
        st = self.state
        if not st.waiting or not any(s.free and s.page_ids for s in st.slots):
            # No waiting request, or no idle slot to order: nothing to look up.
            return lambda slot: keep_key(slot, now=now)
        ns, P = st.pages.chain_namespace, st.config.page_size
        firsts, pages = set(), {}
        for req in sorted((st.requests[rid] for rid in st.waiting), key=lambda r: r.arrived_at):
            chain = req.context_chain(ns, P)
            if chain:
                firsts.add((req.root, chain[0]))
                for pid in chain:  # the page's first asker in the queue
                    pages.setdefault((req.root, pid), req.arrived_at)
        fed, back = feeding(st.slots, firsts), waited_for(st.slots, pages)
        return lambda slot: keep_key(slot, fed, back, now)

    def releases(self, now: float) -> tuple[list[int], list[CutSlot]]:
        """The slots whose KV leaves memory with this step: those the KV budget wants out,
        then, with --max-running past --slots, idle slots past --slots (running ones
        counted), those least worth keeping first (scheduler/residency.py: a side call, the
        end of a turn, no word, a tool call; the least recently used first within each), each
        once idle for its grace (none after the end of a turn, `release_after_s` with no
        word, `tool_return_s` after a tool call) and once all its tokens are on disk or on
        their way (its next turn restores them). The worker makes the step's copies first,
        so a slot copied from in this step may go too. And the slots the KV budget cuts
        (`RunStep.cuts`)."""
        st, cfg = self.state, self.state.config
        released, cuts = self._budget_releases()
        if not cfg.resident_slots or cfg.resident_slots >= len(st.slots):
            return released, cuts
        idle = sorted((s for s in st.slots if s.free and s.tokens), key=self._keep_key(now))
        excess = len(idle) - max(cfg.resident_slots - st.num_running, 0)
        for slot in idle:
            if len(released) >= excess:
                break
            if now - slot.last_used < grace_s(slot, cfg):
                continue
            if not st.releasable(slot):
                slot.tail_wanted = slot.disk_wanted = True  # staged, then released
                continue
            slot.replace(())
            released.append(slot.index)
        return released, cuts

    def shelves(self, released: list[int]) -> list[int]:
        """Idle slots the worker holds as shared pages from this step (docs/design/kv-pages.md
        "Shared pages in memory"): once the slots hold more than half the KV budget, or a
        request waits for memory, those whose first page another idle slot holds too
        (sub-agents between turns, conversations of one client), where the worker can. Each
        is made whole again, a copy of its tokens, when next used: with memory to spare, or
        alone, a slot stays as it is."""
        st = self.state
        budget = st.config.kv_budget_tokens
        if not st.config.shared_pages or not budget:
            return []
        short = any(st.requests[rid].waits_for_memory for rid in st.waiting)
        if not short and 2 * self.held_tokens() <= budget:
            return []
        idle = [s for s in st.slots if s.free and s.page_ids and not s.leaving
                and s.index not in released]
        firsts = Counter(s.page_ids[0] for s in idle)
        shelved = [s for s in idle if not s.shelved and firsts[s.page_ids[0]] > 1]
        for slot in shelved:
            slot.shelved = True
        return [s.index for s in shelved]

    def _budget_releases(self) -> tuple[list[int], list[CutSlot]]:
        """Idle slots the KV budget wants out (`Slot.leaving`), released as soon as their
        pages are on disk or on their way, grace or not; a slot placed meanwhile stays. A
        slot cut (`Slot.cut_to`) keeps its front, shelved: the second list."""
        released, cuts = [], []
        for slot in self.state.slots:
            if not slot.leaving:
                continue
            if not slot.free or not slot.tokens:
                slot.leaving, slot.cut_to = False, 0
            elif self.state.releasable(slot) and slot.cut_to:
                cuts.append(CutSlot(slot.index, slot.cut_to))
                self.state.num_cut += 1
                self.state.cut_kept_tokens += slot.cut_to
                slot.truncate(slot.cut_to, self.state.config.page_size,
                              state_follows=not self.state.config.trimmable)
                slot.leaving, slot.shelved, slot.cut_to = False, True, 0
            elif self.state.releasable(slot):
                slot.replace(())
                released.append(slot.index)
            else:
                slot.tail_wanted = True  # staged when a buffer is free, then released
        return released, cuts


def carries_on(chain: tuple[bytes, ...], slot: Slot, page_size: int) -> bool:
    """Whether a request whose context has the full pages `chain` holds every full page of
    the slot's last prompt: it carries that conversation on (a compaction of it, its last turn
    rewritten, a retry), so the conversation's own return is not to be waited for."""
    n = slot.turn.num_tokens // page_size if slot.turn is not None else 0
    return 0 < n <= len(chain) and tuple(chain[:n]) == tuple(slot.page_ids[:n])


def _stays(slot: Slot) -> bool:
    """No idle slot leaves (`MemoryManager._leaves` on a tight disk)."""
    return False
