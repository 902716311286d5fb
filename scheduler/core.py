"""The scheduler core: one step at a time, decode first. No I/O, no clocks.

The step's one idea: every decoding request gets its next token each step, and prefill chunks
fill what is left of the step's token budget, interactive before background and warm (nearly
resident) before cold. A request's prefix comes from its slot, another slot or disk pages;
only what none of them holds is prefilled. One step is in flight at a time.

The core is closed (docs/design/scheduling.md "The core and its shell"): the shell hands it
typed events with the current wall-clock time through `handle` (peer messages as they arrived,
and the events of `scheduler.events`) and gets one `Effects` back: the messages to send, routed
by type, the log lines and the finished requests. The shell never writes the core's state; the
status document takes the core's part from `snapshot`.

The core plans the step and applies what came back; the policies live in managers over the
shared state (`scheduler.core_state`):
- `RequestLifecycle` (request_lifecycle.py): submit, cancel, preempt, accept tokens, finish;
- `AdmissionManager` (admission_manager.py): who takes a slot, and whose slot it takes;
- `MemoryManager` (memory_manager.py): the KV budget and the resident slots;
- `DecodePlanner` (decode_plan.py): bursts, drafts, and the cost of decoding;
- `DiskManager` (disk_manager.py): restore reads and kvstore's answers;
- `PeerFetches` (peer_fetch.py): pages asked of other servers before a request is placed;
- prefill chunks (prefill_plan.py), page staging and eviction (page_cache.py).
"""

from __future__ import annotations

import dataclasses

from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    ReplyEnded,
    RequestFailed,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.scheduler_worker import (
    GrammarPrepared,
    PrepareGrammar,
    RunStep,
    SlotContents,
    StepDone,
    WorkerReady,
    WorkerStopping,
)
from switchyard.proto.scheduler_kvstore import (
    InventoryDescribed,
    PagesRead,
    PagesWritten,
    PeerPagesFetched,
)
from switchyard.scheduler.admission_manager import AdmissionManager
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core_snapshot import CoreSnapshot, snapshot
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.decode_plan import DecodePlanner
from switchyard.scheduler.disk_manager import DiskManager
from switchyard.scheduler.events import (
    Effects,
    Event,
    FailAll,
    GatewayRestarted,
    IndexOverdue,
    KvstoreRestarted,
    PlanStep,
    WorkerLost,
)
from switchyard.scheduler.memory_manager import MemoryManager
from switchyard.scheduler.peer_fetch import PeerFetches
from switchyard.scheduler.prefill_plan import plan_prefills, state_points
from switchyard.scheduler.request_lifecycle import RequestLifecycle
from switchyard.scheduler.requests import Slot
from switchyard.scheduler.restore import load_of


class SchedulerCore(CoreState):
    """The core's state (`CoreState`, which the managers share) and the step."""

    def __init__(self, config: CoreConfig):
        super().__init__(config)
        self.lifecycle = RequestLifecycle(self)
        self.memory = MemoryManager(self, self.lifecycle)
        self.admission = AdmissionManager(self, self.lifecycle, self.memory)
        self.decode = DecodePlanner(self)
        self.disk = DiskManager(self, self.lifecycle)
        self.peers = PeerFetches(self)
        self._next_step = 0

    def handle(self, event: Event, now: float) -> Effects:
        """Apply one event; what it produced comes back as one `Effects`."""
        step = None
        match event:
            case PlanStep():
                step = self._plan_step(now)
            case SubmitRequest():
                self.lifecycle.submit(event, now)
            case CancelRequest():
                self.lifecycle.cancel(event.rid, now)
            case ReplyEnded():
                self.memory.reply_ended(event)
            case StepDone():
                self._step_done(event, now)
            case PagesRead():
                self.disk.pages_read(event, now)
            case PagesWritten():
                self.disk.pages_written(event, now)
            case WorkerReady():
                self._worker_ready(event)
            case GrammarPrepared():
                self._grammar_prepared(event, now)
            case WorkerStopping():
                self.disk.worker_stopping()
            case InventoryDescribed():
                self.disk.inventory(event, now)
            case PeerPagesFetched():
                self.peers.fetched(event, now)
            case KvstoreRestarted():
                self.peers.kvstore_restarted()
                self.disk.kvstore_restarted()
            case WorkerLost():
                self.inflight = None
                self.worker_stopping = False
            case GatewayRestarted():
                self.lifecycle.abort_all(now)
            case FailAll():
                self.lifecycle.fail_all(event, now)
            case IndexOverdue():
                self.index_overdue = event.overdue
            case _:
                raise TypeError(f"not a scheduler event: {type(event).__name__}")
        return self.outbox.take(step)

    def snapshot(self, now: float) -> CoreSnapshot:
        """The core's part of the status document. No prompt or output text."""
        return snapshot(self, now, self.peers.status())

    # --- the step --------------------------------------------------------------------------

    def _plan_step(self, now: float) -> RunStep | None:
        if self.inflight is not None:
            return None
        self.peers.expire(now)
        self.peers.ask(now)  # before admission: a request asked for is not placed yet
        # Stage before admitting: staging reads a slot as the last step left it, before a new
        # request's copy, load or prefill overwrites it (write-back of a displaced tail, and of
        # the tail of a request that gave its slot up just now).
        self.admission.make_room(now)
        self.memory.relieve(now)
        stages = self.pages.plan_stages(self.slots, self.config.trimmable, self._state_points,
                                        now, self.config.writes_back)
        if not self.worker_stopping:
            self.admission.admit(now)
        self.disk.issue_reads()
        running = [] if self.worker_stopping else self.running()  # stages alone, till it stops
        loading = [r for r in running if r.loading]
        loads = [load_of(r, self.config.trimmable) for r in loading]
        decodes, prefilling = [], []
        for req in running:
            if req.restoring or req in loading:
                continue  # its prefix is not (all) in the slot yet
            self.disk.note_restore_done(req, now)
            remaining = self.remaining_prefill(req)
            if remaining == 0:
                decodes.append(self.decode.item(req))
            else:
                prefilling.append((req, remaining))
        decoding = [self.requests[self.slots[d.slot].rid] for d in decodes]
        prefills, share = plan_prefills(prefilling, decoding, self.slots, self.budget,
                                        self.config, now, self.shares)
        if share is not None and share.num_protected:
            self.prefill_share = (now, share)  # for status: the latest split with streams
        copies, self.copies = self.copies, []
        releases, cuts = self.memory.releases(now)
        shelves = self.memory.shelves(releases)
        if not (stages or copies or releases or cuts or loads or decodes or prefills or shelves):
            return None
        # Nothing else waiting: let the worker decode a burst without coming back to us.
        # (A request's first token comes alone, so its prompt's tail is staged exactly.)
        first_tokens = any(not self.requests[self.slots[d.slot].rid].generated for d in decodes)
        burst = 1 if (prefills or loads or self.waiting or self.reads or first_tokens) \
            else self.budget.burst(self.config.decode_burst)
        decodes, burst = self.decode.widen(decodes, burst)
        self.inflight = RunStep(self._next_step, tuple(prefills), tuple(decodes),
                                tuple(stages), tuple(copies), tuple(loads), burst,
                                tuple(releases), tuple(shelves), tuple(cuts))
        self.decode.planned_at = now
        self._next_step += 1
        self.outbox.send(self.inflight)
        return self.inflight

    def _state_points(self, slot: Slot) -> set[int]:
        req = self.requests.get(slot.rid) if slot.rid else None
        return state_points(slot, req, self.remaining_prefill(req) if req else 0,
                            self.config.page_size, self.config.state_interval)

    def _step_done(self, done: StepDone, now: float) -> None:
        plan, self.inflight = self.inflight, None
        if plan is None or done.step != plan.step:
            return  # a stale reply from before a restart
        self.decode.observe_step(done, plan, now)
        marks = self.config.state_marks  # the worker's rule (worker/state_marks.py)
        for load in plan.loads:
            slot = self.slots[load.slot]
            slot.tokens.extend(load.token_ids)
            slot.stateless_end = not self.config.trimmable and not load.with_state
            if marks and load.with_state:
                slot.state_mark = len(slot.tokens)
            self.pages.release(load.buffers)
        failed = {f.slot: f for f in done.failed}
        for chunk in plan.prefills:
            if chunk.slot not in failed:
                slot = self.slots[chunk.slot]
                slot.tokens.extend(chunk.token_ids)
                slot.state_mark = len(slot.tokens) if marks else 0
        sampled: dict[int, list[int]] = {}
        for s in done.sampled:
            sampled.setdefault(s.slot, []).append(s.token_id)
        worker_drafts = {d.slot: tuple(d.token_ids) for d in done.drafts}
        for item in plan.decodes:
            slot = self.slots[item.slot]
            tokens = sampled.get(item.slot, [])
            # The worker fed the input and every sampled token but the last back in (of a
            # verify pass: the input and the accepted draft tokens, which equal them).
            slot.tokens.append(item.token_id)
            slot.tokens.extend(tokens[:-1])
            slot.last_used = now
            req = self.requests.get(slot.rid) if slot.rid is not None else None
            if item.draft and req is not None:
                self.decode.observe_draft(req, item.draft, tokens)
            elif item.slot in worker_drafts and req is not None:  # the worker drafter's
                self.decode.observe_draft(req, worker_drafts[item.slot], tokens,
                                          self.config.drafter)
            for token in tokens:
                if slot.rid is None:
                    break  # finished (stop, length or cancelled) at an earlier token
                self.lifecycle.accept_token(self.requests[slot.rid], token, now)
            if self.proposer is not None and slot.rid is not None:
                self.proposer.extend(slot.rid)
        for failure in failed.values():
            rid = self.slots[failure.slot].rid
            if rid is not None:
                self.lifecycle.finish(self.requests[rid], "failed", now, notify=False)
                self.outbox.send(RequestFailed(rid, failure.code, failure.message, False))
        for slot in self.slots:
            self.pages.sync_slot(slot)
        if self.pages.staged:
            self.pages.staged_done(now, self.pinned)
        for req in [r for r in self.requests.values() if r.cancelled and not r.reading]:
            self.lifecycle.finish(req, "cancelled", now)
        # One message per request per step, however many tokens a burst produced.
        for rid, tokens in self.unsent.items():
            self.outbox.send(TokensGenerated(rid, tuple(tokens)))
        self.unsent.clear()

    # --- the worker ------------------------------------------------------------------------

    def _worker_ready(self, msg: WorkerReady) -> None:
        """A worker (re)started, or greets a restarted scheduler: its shape and slots."""
        self.worker_stopping = False
        self.config = dataclasses.replace(self.config, trimmable=msg.trimmable,
                                          state_marks=msg.state_marks and not msg.trimmable,
                                          shared_pages=msg.shared_pages,
                                          num_slots=msg.num_slots, ctx=msg.ctx,
                                          page_size=msg.page_size,
                                          speculation=msg.speculation,
                                          drafter=msg.drafter,
                                          kv_budget_tokens=msg.kv_budget_tokens,
                                          kv_bytes_per_token=msg.kv_bytes_per_token)
        if self.proposer is not None and msg.drafter:
            self.proposer.use_draft_model(msg.draft_cost)
        self.pages.page_size = msg.page_size
        self._worker_restarted(msg.slots, msg.namespace, msg.shm_name, msg.num_buffers,
                               msg.buffer_bytes, msg.state_bytes)

    def _worker_restarted(self, slots: tuple[SlotContents, ...], namespace: bytes = b"",
                          shm_name: str = "", num_buffers: int = 0, buffer_bytes: int = 0,
                          state_bytes: int = 0) -> None:
        """The worker's slot memory is what it reports; requests in slots start over there."""
        self.inflight = None
        self.copies.clear()
        self.reads.clear()
        self.pages.worker_ready(namespace, shm_name, num_buffers, buffer_bytes, state_bytes)
        contents = {s.slot: s for s in slots}
        requeue = []
        for slot in self.slots:
            if slot.rid is not None:
                requeue.append(slot.rid)
                self.unplace(self.requests[slot.rid], release=False)  # a new pool
                slot.rid = None
        self.waiting.extendleft(reversed(requeue))
        for req in self.requests.values():  # the new worker compiles them again
            if req.sampling.grammar:
                req.grammar_ready = False
                self.outbox.send(PrepareGrammar(req.rid, req.sampling.grammar))
        if len(self.slots) != self.config.num_slots:
            self.slots = [Slot(i) for i in range(self.config.num_slots)]
        for slot in self.slots:
            held = contents.get(slot.index)
            slot.replace(held.token_ids if held else (), (), held.images if held else ())
            self.pages.sync_slot(slot)  # the memory plan asks at once whether it can leave

    def _grammar_prepared(self, msg: GrammarPrepared, now: float) -> None:
        req = self.requests.get(msg.rid)
        if req is None or req.grammar_ready:
            return
        if msg.error:  # the gateway checked it: only the worker's own limits could refuse it
            self.lifecycle.finish(req, "failed", now, notify=False)
            self.outbox.send(RequestFailed(msg.rid, "invalid_grammar", msg.error, False))
            return
        req.grammar_ready = True
        if msg.compile_s >= 0.1:
            self.outbox.log("grammar.compiled", rid=msg.rid, compile_s=round(msg.compile_s, 3))
