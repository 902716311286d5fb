"""The scheduler core: admission, placement, step plans, finishing. No I/O, no clocks.

The core is closed (docs/design/scheduling.md "Scheduling"): the shell hands it typed events with the
current wall-clock time through `handle` (peer messages as they arrived, and the events of
`scheduler.events`) and gets one `Effects` back: the messages to send, routed by type, the log
lines and the finished requests. The shell never writes the core's state; the status document
takes the core's part from `snapshot`. One step is in flight at a time.

Steps are decode-first: every decoding request gets its token each step, and prefill chunks
fill what is left of the per-step token budget, interactive before background and warm
(nearly resident) before cold (`scheduler.prefill_plan`). A request's prefix comes from its
slot, another slot, or disk pages (`scheduler.admission`, scored by `scheduler.placement`);
only what none of them holds is prefilled.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass

import msgspec

from switchyard.proto.messages import (
    CancelRequest,
    CopyPrefix,
    DecodeItem,
    DescribeInventory,
    GrammarPrepared,
    InventoryDescribed,
    PagesRead,
    PagesWritten,
    PrepareGrammar,
    ReleaseGrammar,
    RequestFailed,
    RequestFinished,
    RunStep,
    SlotContents,
    StepDone,
    SubmitRequest,
    TokensGenerated,
    WorkerReady,
)
from switchyard.proto.held_kv import held_tokens
from switchyard.proto.page_ids import chain_root
from switchyard.proto.speculation import num_accepted
from switchyard.proto.status import (DiskStatus, KvMemoryStatus, PrefillShareStatus,
                                     QueuedRequest, SlotState, SlotStatus, SpeculationStatus)
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
from switchyard.scheduler.admission import WaitForSibling, apply, place
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.conversation_threads import ConversationThreads
from switchyard.scheduler.fairness import (admission_key, interactive_now, oldest_waiting_s,
                                           preempts)
from switchyard.scheduler.kv_memory import holds, relieve, request_hold, room_for
from switchyard.scheduler.outbox import Outbox
from switchyard.scheduler.page_cache import PageCache
from switchyard.scheduler.prefill_plan import PrefillShare, plan_prefills, state_points
from switchyard.scheduler.proposer import Proposer, ProposerConfig
from switchyard.scheduler.requests import Request, Slot
from switchyard.scheduler.status_rows import RootTenants, conversation_label
from switchyard.scheduler.restore import DiskReads, load_of
from switchyard.scheduler.step_budget import PrefillBudget
from switchyard.scheduler.tenant_shares import TenantShares, running_by_tenant


@dataclass(frozen=True)
class CoreSnapshot:
    """The core's part of the status document (proto/status.py)."""

    slots: list[SlotStatus]
    queue: list[QueuedRequest]
    oldest_waiting_s: float
    disk: DiskStatus
    speculation: SpeculationStatus
    prefill_share: PrefillShareStatus | None = None
    kv_memory: KvMemoryStatus | None = None


@dataclass(frozen=True)
class FinishedRecord:
    """What the shell logs once per request (fields only, never text)."""

    rid: str
    priority: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_reused_tokens: int
    num_copied_tokens: int
    num_restored_tokens: int
    num_prefilled_tokens: int
    num_generated_tokens: int
    queue_s: float
    restore_s: float
    ttft_s: float | None
    duration_s: float
    # From the prefix in the slot to the first prefill chunk, and from there to the last
    # prompt token in; the tokens prefilled for other requests while it waited for chunks.
    prefill_wait_s: float = 0.0
    prefill_s: float = 0.0
    num_waited_tokens: int = 0
    # Speculative decoding: draft tokens verified for it, and how many it kept.
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    proposers: str = ""  # whose drafts: "suffix", "draft" (a draft model), "mtp", or several
    # Tokens it had in a slot before it gave the slot up (to memory or to a waiting request)
    # and had to prefill again: 0 while its pages reach the disk (docs/design/kv-pages.md "Memory plan").
    num_reread_tokens: int = 0
    tenant: str = ""  # its key's name with several keys
    conversation: str = ""  # the status's label of its conversation (never a page id)


class SchedulerCore:
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
        self._copies: list[CopyPrefix] = []
        self.reads = DiskReads(self.pages)
        self._next_step = 0
        self._planned_at = 0.0
        self._done_at = 0.0
        self._unsent: dict[str, list[int]] = {}  # tokens of this step, sent once per request
        # Speculative decoding's drafts (docs/design/speculative-decoding.md "Speculative decoding").
        self.proposer = (Proposer(ProposerConfig(max_draft=config.num_draft_tokens,
                                                 always=config.always_draft,
                                                 draft_only=config.draft_only))
                         if config.num_draft_tokens > 0 else None)
        self.index_overdue = False  # kvstore's index is long overdue: place without it
        self.num_memory_preemptions = 0  # running requests staged to disk for memory
        self.shares = TenantShares()  # tenants' shares of queue, slots and prefill

    def handle(self, event: Event, now: float) -> Effects:
        """Apply one event; what it produced comes back as one `Effects`."""
        step = None
        match event:
            case PlanStep():
                step = self._plan_step(now)
            case SubmitRequest():
                self._submit(event, now)
            case CancelRequest():
                self._cancel(event.rid, now)
            case StepDone():
                self._step_done(event, now)
            case PagesRead():
                self._pages_read(event, now)
            case PagesWritten():
                self._pages_written(event, now)
            case WorkerReady():
                self._worker_ready(event)
            case GrammarPrepared():
                self._grammar_prepared(event, now)
            case InventoryDescribed():
                self._inventory(event, now)
            case KvstoreRestarted():
                self._kvstore_restarted()
            case WorkerLost():
                self.inflight = None
            case GatewayRestarted():
                self._abort_all(now)
            case FailAll():
                self._fail_all(event, now)
            case IndexOverdue():
                self.index_overdue = event.overdue
            case _:
                raise TypeError(f"not a scheduler event: {type(event).__name__}")
        return self.outbox.take(step)

    # --- views (read-only) -----------------------------------------------------------------

    @property
    def step_in_flight(self) -> bool:
        return self.inflight is not None

    def snapshot(self, now: float) -> CoreSnapshot:
        """The core's part of the status document. No prompt or output text."""
        slots = []
        for slot in self.slots:
            req = self.requests.get(slot.rid) if slot.rid else None
            slots.append(SlotStatus(
                slot=slot.index, num_tokens=len(slot.tokens),
                conversation=conversation_label(slot.page_ids[0]) if slot.page_ids else None,
                tenant=req.tenant if req else self.root_tenants.of(slot.root),
                last_used=slot.last_used or None, rid=slot.rid,
                priority=req.priority if req else None,
                state=self._state(req) if req else "idle",
                waiting_s=now - req.arrived_at if req and req.first_token_at is None
                else None))
        queue = [QueuedRequest(rid=rid, priority=self.requests[rid].priority,
                               waiting_s=now - self.requests[rid].arrived_at,
                               prompt_tokens=len(self.requests[rid].prompt),
                               tenant=self.requests[rid].tenant)
                 for rid in self.waiting]
        # Queued, restoring or prefilling: what a starving request shows as (issue 14).
        speculation = SpeculationStatus(
            mode=(self.config.speculation or "off") if self.proposer is not None else "off",
            max_draft_tokens=self.config.num_draft_tokens,
            proposers=self._proposer_kinds())
        share = None
        if self.prefill_share is not None:
            at, split = self.prefill_share
            share = PrefillShareStatus(decode_share=round(split.decode_share, 3),
                                       num_protected=split.num_protected,
                                       num_waiting=split.num_waiting, age_s=now - at)
        return CoreSnapshot(slots, queue, oldest_waiting_s(self.requests.values(), now),
                            self.pages.disk_status(), speculation, share, self._kv_memory())

    def _kv_memory(self) -> KvMemoryStatus | None:
        """The KV the slots hold against the worker's budget, in tokens (docs/design.md
        "Memory plan")."""
        budget = self.config.kv_budget_tokens
        if not budget:
            return None
        return KvMemoryStatus(
            held_tokens=held_tokens(holds(self.slots, self.requests), self.config.ctx),
            budget_tokens=budget, num_tokens=sum(len(s.tokens) for s in self.slots),
            num_running=self.num_running,
            num_resident=sum(1 for s in self.slots if s.tokens),
            num_preempted=self.num_memory_preemptions)

    def _proposer_kinds(self) -> str:
        """Whose drafts this group verifies: "suffix", the worker's drafter ("draft": a draft
        model, "mtp": MTP heads) or both."""
        if not self.config.drafter:
            return "suffix"
        return self.config.drafter if self.config.draft_only else f"suffix,{self.config.drafter}"

    def _state(self, req: Request) -> SlotState:
        if req.restoring:
            return "restoring"
        if self._remaining_prefill(req) > 0:
            return "prefilling"
        return "decoding"

    # --- events: gateway -------------------------------------------------------------------

    def _submit(self, msg: SubmitRequest, now: float) -> None:
        cfg = self.config
        if len(msg.prompt_token_ids) == 0:
            return self._reject(msg.rid, "invalid_request", "prompt is empty")
        if len(msg.prompt_token_ids) + 1 > cfg.ctx:
            return self._reject(msg.rid, "context_length_exceeded",
                                f"prompt has {len(msg.prompt_token_ids)} tokens; the context "
                                f"holds {cfg.ctx}")
        if msg.rid in self.requests:
            return self._reject(msg.rid, "invalid_request", "duplicate request id")
        self.shares.note(msg.tenant, msg.tenant_weight)
        refusal = self.shares.queue_refusal(msg.tenant, (self.requests[r] for r in self.waiting),
                                            {r.tenant for r in self.requests.values()},
                                            cfg.max_queue)
        if refusal is not None:
            self.outbox.send(RequestFailed(msg.rid, "queue_full", refusal, True,
                                           cfg.retry_after_s))
            return
        req = self.requests[msg.rid] = Request(
            rid=msg.rid, prompt=msg.prompt_token_ids, max_tokens=max(1, msg.max_tokens),
            sampling=msg.sampling, stop_token_ids=frozenset(msg.stop_token_ids),
            priority=msg.priority, arrived_at=now, images=msg.images,
            image_data={d.image_id: d for d in msg.image_data}, speculative=msg.speculative,
            root=chain_root(msg.cache_salt), tenant=msg.tenant)
        self.pages.note_root(req.root)
        self.root_tenants.note(req.root, msg.tenant)
        if self.proposer is not None and req.speculative:
            self.proposer.start(req.rid, req.feed, msg.cache_salt, tenant=msg.tenant)
        self.waiting.append(msg.rid)
        if msg.sampling.grammar:  # placed once the worker compiled it, off its steps
            req.grammar_ready = False
            self.outbox.send(PrepareGrammar(msg.rid, msg.sampling.grammar))

    def _reject(self, rid: str, code: str, message: str) -> None:
        self.outbox.send(RequestFailed(rid, code, message, False))

    def _cancel(self, rid: str, now: float) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.cancelled = True
        if not self._busy(req):
            self._finish(req, "cancelled", now)
        # else: finished when the step or page read it is part of comes back

    def _busy(self, req: Request) -> bool:
        in_step = self.inflight is not None and req.slot is not None
        return in_step or bool(req.reading)

    def _abort_all(self, now: float) -> None:
        """The gateway restarted: its requests have no one to answer to."""
        for req in list(self.requests.values()):
            self._finish(req, "cancelled", now, notify=False)

    def _fail_all(self, event: FailAll, now: float) -> None:
        rids = list(self.requests)
        self._abort_all(now)
        for rid in rids:
            self.outbox.send(RequestFailed(rid, event.code, event.message, True,
                                             event.retry_after_s))

    # --- events: worker --------------------------------------------------------------------

    def _step_done(self, done: StepDone, now: float) -> None:
        plan, self.inflight = self.inflight, None
        if plan is None or done.step != plan.step:
            return  # a stale reply from before a restart
        self._observe_step(done, plan, now)
        for load in plan.loads:
            self.slots[load.slot].tokens.extend(load.token_ids)
            self.pages.release(load.buffers)
        failed = {f.slot: f for f in done.failed}
        for chunk in plan.prefills:
            if chunk.slot not in failed:
                self.slots[chunk.slot].tokens.extend(chunk.token_ids)
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
                self._observe_draft(req, item.draft, tokens)
            elif item.slot in worker_drafts and req is not None:  # the worker drafter's
                self._observe_draft(req, worker_drafts[item.slot], tokens, self.config.drafter)
            for token in tokens:
                if slot.rid is None:
                    break  # finished (stop, length or cancelled) at an earlier token
                self._accept_token(self.requests[slot.rid], token, now)
            if self.proposer is not None and slot.rid is not None:
                self.proposer.extend(slot.rid)
        for failure in failed.values():
            rid = self.slots[failure.slot].rid
            if rid is not None:
                self._finish(self.requests[rid], "failed", now, notify=False)
                self.outbox.send(RequestFailed(rid, failure.code, failure.message, False))
        for slot in self.slots:
            self.pages.sync_slot(slot)
        if self.pages.staged:
            self.pages.staged_done(now, self._pinned)
        for req in [r for r in self.requests.values() if r.cancelled and not r.reading]:
            self._finish(req, "cancelled", now)
        # One message per request per step, however many tokens a burst produced.
        for rid, tokens in self._unsent.items():
            self.outbox.send(TokensGenerated(rid, tuple(tokens)))
        self._unsent.clear()

    def _observe_step(self, done: StepDone, plan: RunStep, now: float) -> None:
        """Feed the prefill budget. What a decoding stream sees is the whole cycle from one
        token to the next (worker compute, messages, this planning), not only the forward
        pass, so decode-only steps are measured as cycles here. A step that verified drafts
        is one pass, however many tokens it kept: its cycle is what a prefill chunk must not
        stretch (the budget counts the verified tokens' time, not the tokens kept)."""
        cycle = now - self._planned_at
        if now - self._planned_at < 1.0 and self._planned_at - self._done_at < 0.05:
            cycle = now - self._done_at  # planned right after the previous step: a full cycle
        self._done_at = now
        iterations = max(1, len(done.sampled) // max(1, done.num_decode_tokens))
        width = 1 + max([len(d.draft) for d in plan.decodes]
                        + [len(d.token_ids) for d in done.drafts], default=0)
        if width > 1:
            iterations = 1
        # (A step whose draft model caught rows up also prefilled: no measure of a pass.)
        if self.proposer is not None and plan.decodes and not plan.prefills \
                and not done.num_catch_up_tokens:
            # The verify pass alone: the draft model's passes are measured apart.
            self.proposer.observe_cost(len(plan.decodes),
                                       (done.decode_s - done.draft_s) / iterations, width)
            self.proposer.observe_trip(cycle - done.duration_s)
            if done.num_draft_passes:
                self.proposer.observe_draft_cost(len(plan.decodes),
                                                 done.draft_s / done.num_draft_passes)
        decode_cycle = cycle / iterations if done.num_prefill_tokens == 0 else 0.0
        self.budget.observe(done.num_decode_tokens, decode_cycle, done.num_prefill_tokens,
                            done.prefill_s, done.num_encoded_tokens, done.encode_s)

    def _worker_ready(self, msg: WorkerReady) -> None:
        """A worker (re)started, or greets a restarted scheduler: its shape and slots."""
        self.config = dataclasses.replace(self.config, trimmable=msg.trimmable,
                                          num_slots=msg.num_slots, ctx=msg.ctx,
                                          page_size=msg.page_size,
                                          speculation=msg.speculation,
                                          drafter=msg.drafter,
                                          kv_budget_tokens=msg.kv_budget_tokens)
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
        self._copies.clear()
        self.reads.clear()
        self.pages.worker_ready(namespace, shm_name, num_buffers, buffer_bytes, state_bytes)
        contents = {s.slot: s for s in slots}
        requeue = []
        for slot in self.slots:
            if slot.rid is not None:
                requeue.append(slot.rid)
                self._unplace(self.requests[slot.rid], release=False)  # a new pool
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
            self._finish(req, "failed", now, notify=False)
            self.outbox.send(RequestFailed(msg.rid, "invalid_grammar", msg.error, False))
            return
        req.grammar_ready = True
        if msg.compile_s >= 0.1:
            self.outbox.log("grammar.compiled", rid=msg.rid, compile_s=round(msg.compile_s, 3))

    # --- events: kvstore -------------------------------------------------------------------

    def _kvstore_restarted(self) -> None:
        """Reads sent to the old kvstore are lost: ask the new one again once it is attached.
        Writes are lost too: every slot's pages are checked against the new inventory again."""
        self.pages.kvstore_restarted()  # may send the writes in flight again...
        self._recheck_persisted()
        self.reads.lost(self.requests)
        attach = self.pages.attach_message()
        # ...after the new kvstore has the buffers they are in (messages of this event only).
        self.outbox.send_first(*([attach] if attach is not None else []), DescribeInventory())

    def _inventory(self, msg: InventoryDescribed, now: float) -> None:
        self.pages.kvstore_inventory(msg.pages, msg.writable, now, self._pinned, msg.error)
        self.index_overdue = False
        self.outbox.log("kvstore.inventory", **{
            "num_pages": len(msg.pages), "disk_bytes": self.pages.tree.total_bytes,
            "scan_s": round(msg.scan_s, 3), "writable": msg.writable, "error": msg.error})

    def _pages_read(self, msg: PagesRead, now: float) -> None:
        answer = self.reads.answered(msg, self.requests)
        if answer is None:
            return
        req, good, complete = answer
        last = good[-1][0].page_id if good else None
        if not complete and not self.config.trimmable and last not in self.pages.state_pages:
            # A hybrid slot is usable only up to a page that carries its state.
            self.pages.release([b for _, b in good])
            good = []
            self.slots[req.slot].truncate(0, self.config.page_size)
        req.loading = req.loading + good  # a batch not yet loaded stays first
        if req.cancelled and not self._busy(req):
            self._finish(req, "cancelled", now)
        self._issue_reads()  # the next batch is read while this one loads

    def _pages_written(self, msg: PagesWritten, now: float) -> None:
        self.pages.pages_written(msg, now)
        if msg.failed:
            self._recheck_persisted()

    def _recheck_persisted(self) -> None:
        """Pages a slot counted as on their way to disk may not have arrived: stage again,
        with the tail where an idle slot's turn ended."""
        for slot in self.slots:
            slot.num_persisted = 0
            slot.tail_wanted = slot.tail_wanted or slot.rid is None

    # --- planning --------------------------------------------------------------------------

    def _plan_step(self, now: float) -> RunStep | None:
        if self.inflight is not None:
            return None
        # Stage before admitting: staging reads a slot as the last step left it, before a new
        # request's copy, load or prefill overwrites it (write-back of a displaced tail, and of
        # the tail of a request that gave its slot up just now).
        self._make_room(now)
        self._relieve_memory(now)
        stages = self.pages.plan_stages(self.slots, self.config.trimmable, self._state_points,
                                        now)
        self._admit(now)
        self._issue_reads()
        running = [self.requests[s.rid] for s in self.slots if s.rid is not None]
        loading = [r for r in running if r.loading]
        loads = [load_of(r, self.config.trimmable) for r in loading]
        decodes, prefilling = [], []
        for req in running:
            if req.restoring or req in loading:
                continue  # its prefix is not (all) in the slot yet
            self._note_restore_done(req, now)
            remaining = self._remaining_prefill(req)
            if remaining == 0:
                decodes.append(self._decode_item(req))
            else:
                prefilling.append((req, remaining))
        decoding = [self.requests[self.slots[d.slot].rid] for d in decodes]
        prefills, share = plan_prefills(prefilling, decoding, self.slots, self.budget,
                                        self.config, now, self.shares)
        if share is not None and share.num_protected:
            self.prefill_share = (now, share)  # for status: the latest split with streams
        copies, self._copies = self._copies, []
        releases = self._releases(now)
        if not (stages or copies or releases or loads or decodes or prefills):
            return None
        # Nothing else waiting: let the worker decode a burst without coming back to us.
        # (A request's first token comes alone, so its prompt's tail is staged exactly.)
        first_tokens = any(not self.requests[self.slots[d.slot].rid].generated for d in decodes)
        burst = 1 if (prefills or loads or self.waiting or self.reads or first_tokens) \
            else self.budget.burst(self.config.decode_burst)
        drafted = self._with_drafts(decodes, burst)
        if drafted is not None:  # one verify pass (docs/design/speculative-decoding.md "Speculative decoding")
            decodes, burst = drafted, 1
        elif burst > 1:
            decodes = [self._with_burst(d, burst) for d in decodes]
        self.inflight = RunStep(self._next_step, tuple(prefills), tuple(decodes),
                                tuple(stages), tuple(copies), tuple(loads), burst,
                                tuple(releases))
        self._planned_at = now
        self._next_step += 1
        self.outbox.send(self.inflight)
        return self.inflight

    def _releases(self, now: float) -> list[int]:
        """Idle slots whose KV leaves memory. With --max-running past --slots, at most --slots
        conversations stay in memory, running ones counted: the least recently used idle
        slots go, each once idle for `release_after_s` (a reply that ended in a tool call is
        back with its result within seconds, and finds its slot) and once all its tokens are
        on disk or on their way (its next turn restores them; docs/design.md "Running past
        the resident slots"). The worker makes the step's copies first, so a slot copied from
        in this step may go too."""
        cfg = self.config
        released = self._memory_releases()
        if not cfg.resident_slots or cfg.resident_slots >= len(self.slots):
            return released
        idle = sorted((s for s in self.slots if s.free and s.tokens), key=lambda s: s.last_used)
        excess = len(idle) - max(cfg.resident_slots - self.num_running, 0)
        for slot in idle:
            if len(released) >= excess or now - slot.last_used < cfg.release_after_s:
                break
            if self.pages.enabled and not self.pages.all_on_disk(slot):
                slot.tail_wanted = True  # staged when a buffer is free, then released
                continue
            slot.replace(())
            released.append(slot.index)
        return released

    def _releasable(self, slot: Slot) -> bool:
        """Its KV can leave memory at no re-read: every token on disk or on its way (without
        a kvstore, at once)."""
        return not self.pages.enabled or self.pages.all_on_disk(slot)

    def _memory_releases(self) -> list[int]:
        """Idle slots the KV budget wants out (`Slot.leaving`), released as soon as their
        pages are on disk or on their way, grace or not; a slot placed meanwhile stays."""
        released = []
        for slot in self.slots:
            if not slot.leaving:
                continue
            if not slot.free or not slot.tokens:
                slot.leaving = False
            elif self._releasable(slot):
                slot.replace(())
                released.append(slot.index)
            else:
                slot.tail_wanted = True  # staged when a buffer is free, then released
        return released

    def _relieve_memory(self, now: float) -> None:
        """When what the slots hold, with the running requests' reserves, outgrows the
        worker's KV budget: idle slots leave memory, then the newest or lowest-priority
        running requests are staged to disk (preempted: they resume by restoring their
        pages). Before the step's stages, so a yielding slot's tail is staged in this step
        and its slot released with it (docs/design/kv-pages.md "Memory plan")."""
        budget = self.config.kv_budget_tokens
        if not budget:
            return
        running = running_by_tenant(self.requests[s.rid] for s in self.slots if s.rid)
        relief = relieve(self.slots, self.requests, budget, self.config.ctx,
                         lambda r: (self.shares.usage(r.tenant, running),
                                    not self._interactive(r, now), r.arrived_at))
        held = held_tokens(holds(self.slots, self.requests), self.config.ctx) \
            if relief.preempt else 0
        for rid in relief.preempt:
            self.num_memory_preemptions += 1
            self._preempt(self.requests[rid], now, "memory", held_tokens=held,
                          budget_tokens=budget)
        for index in relief.leave:
            self.slots[index].leaving = True

    def _interactive(self, req: Request, now: float) -> bool:
        return interactive_now(req, now, self.config.background_wait_s)

    def _state_points(self, slot: Slot) -> set[int]:
        req = self.requests.get(slot.rid) if slot.rid else None
        return state_points(slot, req, self._remaining_prefill(req) if req else 0,
                            self.config.page_size, self.config.state_interval)

    # --- admission -------------------------------------------------------------------------

    def _can_admit(self) -> bool:
        # Placed before kvstore's index is known, a request would miss every page on disk
        # (issue 12).
        return not self.config.wait_for_index or self.pages.kvstore_attached \
            or self.index_overdue

    def _admission_order(self, now: float) -> list[str]:
        """Each tenant's own order (scheduler.fairness), interleaved by their shares."""
        cfg = self.config
        own = sorted(self.waiting, key=lambda rid: admission_key(
            self.requests[rid], now, cfg.background_wait_s, cfg.num_slots))
        running = running_by_tenant(self.requests[s.rid] for s in self.slots if s.rid)
        return self.shares.admission_order(own, lambda rid: self.requests[rid].tenant, running)

    def _admit(self, now: float) -> None:
        if not self._can_admit():
            return
        for slot in self.slots:
            self.pages.sync_slot(slot)
        order = deque(self._admission_order(now))
        while order:
            req = self.requests[order.popleft()]
            if not req.grammar_ready:
                continue  # the worker is compiling its grammar (it never does in a step)
            decision = place(req, self.slots, self.pages, self.config, self._prefilling())
            if isinstance(decision, WaitForSibling):
                self._note_sibling_wait(req, decision)
                continue  # the requests behind it may still take a slot
            if decision is None:
                break
            if not self._room_for(req, decision):
                break  # admission keeps its order: placed when running requests give room
            copy = apply(req, decision, self.slots, self.pages,
                         self._pinned(placing=req), now, self.threads)
            self._note_resumed(req, decision)
            if copy is not None:
                self._copies.append(copy)
            self.waiting.remove(req.rid)
            if self._note_overtaken(req):  # one of them ranks higher from now on
                order = deque(rid for rid in self._admission_order(now) if rid in order)
            # In use from now: a request that waited long must not find the pages it runs on
            # the least recently used while it runs (docs/design/kv-pages.md "Disk eviction policy").
            self.pages.touch(req.context_chain(self.pages.chain_namespace,
                                               self.config.page_size), now)

    def _room_for(self, req: Request, decision) -> bool:
        """Whether the request's KV, placed as decided, fits the worker's budget, making room
        by releasing idle slots whose pages are on disk; logged once per wait when not."""
        budget = self.config.kv_budget_tokens
        if not budget:
            return True
        p = decision.placement
        start = p.copied if p.copy_from is not None else p.reused
        leave = room_for(request_hold(req, start), p.slot, self.slots, self.requests, budget,
                         self.config.ctx, self._releasable)
        if leave is None:
            if not req.waits_for_memory:
                req.waits_for_memory = True
                self.outbox.log("request.waits_for_memory", rid=req.rid,
                                num_context=req.num_context, budget_tokens=budget,
                                held_tokens=held_tokens(holds(self.slots, self.requests),
                                                        self.config.ctx))
            return False
        req.waits_for_memory = False
        for index in leave:
            self.slots[index].leaving = True
        return True

    def _note_resumed(self, req: Request, decision) -> None:
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
        self.outbox.log("request.resumed", rid=req.rid, num_held=req.held_when_preempted,
                        num_reused=p.reused if p.copy_from is None else 0,
                        num_copied=p.copied, num_restored=p.restored, num_reread=reread)
        req.held_when_preempted = 0

    def _prefilling(self) -> list[Request]:
        """Requests in slots whose context is not all there yet (prefill, restore, load)."""
        return [self.requests[s.rid] for s in self.slots
                if s.rid is not None and self._remaining_prefill(self.requests[s.rid]) > 0]

    def _prefilling_rids(self) -> set[str]:
        return {req.rid for req in self._prefilling()}

    def _note_sibling_wait(self, req: Request, wait: WaitForSibling) -> None:
        if req.waits_for != wait.sibling:
            req.waits_for = wait.sibling
            self.outbox.log("request.waits_for_sibling", rid=req.rid, sibling=wait.sibling,
                            num_shared_tokens=wait.shared)

    def _note_overtaken(self, placed: Request) -> bool:
        """Requests that gave their slot up before `placed` entered the queue were overtaken
        once more (the slicing bound, scheduler.fairness); True if that made one of them
        rank as waiting for its first token."""
        bound, promoted = self.config.num_slots, False
        for rid in self.waiting:
            req = self.requests[rid]
            if req.generated and req.queued_at < placed.queued_at:
                req.num_overtaken += 1
                promoted = promoted or req.num_overtaken == bound
        return promoted

    def _make_room(self, now: float) -> None:
        """Free the slots that requests waiting for one take from running requests: an
        interactive request the slot of a background one, a request waiting for its first
        token the slot of one past its quantum (scheduler.fairness, docs/design.md
        "Scheduling"). Runs before the step's stages, so a yielding slot's tail is staged
        before the newcomer's copy, load or prefill overwrites it: it resumes from its pages.
        A request with a free slot but no room for its KV takes the memory of such a request
        the same way (docs/design/kv-pages.md "Memory plan").
        """
        if not self.waiting or not self._can_admit():
            return
        free = sum(1 for s in self.slots if s.free)
        promised = Counter()  # slots this pass gives, by tenant (scheduler.tenant_shares)
        for rid in self._admission_order(now):
            req = self.requests[rid]
            if not req.grammar_ready or req.waits_for in self._prefilling_rids():
                continue  # not placed now: no slot is freed for it
            if free and not self._short_of_memory(req):
                free -= 1  # a free slot is there for it
                promised[req.tenant] += 1
                continue
            victim = self._victim(req, now, promised)
            if victim is not None and free:
                self.num_memory_preemptions += 1
                self._preempt(victim, now, "memory", for_rid=req.rid)
                break  # placed once there is room: nobody behind it is placed before
            if victim is None:
                break  # admission keeps its order: nobody behind it is placed either
            self._preempt(victim, now, "slot")
            promised[req.tenant] += 1

    def _short_of_memory(self, req: Request) -> bool:
        """Whether the request's KV would not fit the worker's budget beside what stays
        (scheduler.kv_memory; what it may find in a slot does not change its hold). Slots
        already leaving count as gone: they go as soon as their pages are on their way."""
        budget = self.config.kv_budget_tokens
        return bool(budget) and room_for(
            request_hold(req, 0), -1, self.slots, self.requests, budget, self.config.ctx,
            lambda s: s.leaving or self._releasable(s)) is None

    def _victim(self, waiter: Request, now: float, promised: Counter | None = None
                ) -> Request | None:
        """The running request whose slot `waiter` takes, if any: within its tenant by rank
        (scheduler.fairness), from another tenant only below its share (`promised`: slots
        given this pass, by tenant; scheduler.tenant_shares). The tenant furthest over its
        share first, then background before interactive, then the newest to arrive."""
        cfg = self.config
        running = [self.requests[s.rid] for s in self.slots if s.rid is not None]
        counts = running_by_tenant(running) + (promised or Counter())
        victims = [r for r in running
                   if (preempts(waiter, r, now, cfg.background_wait_s, cfg.slice_tokens,
                                cfg.num_slots) if r.tenant == waiter.tenant
                       else self.shares.takes_share(waiter.tenant, r.tenant, counts)
                       and not r.cancelled)]
        return max(victims, key=lambda r: (self.shares.usage(r.tenant, counts),
                                           not self._interactive(r, now), r.arrived_at),
                   default=None)

    def _preempt(self, victim: Request, now: float, reason: str, **fields) -> None:
        """Take a running request out of its slot; it waits in the queue again. `reason`:
        "slot" (a waiting request ranks above it) or "memory" (the KV budget).

        Nothing is lost: its full pages are written through and its slot's tail is staged
        next, so it resumes from its pages when placed again (in its old slot, if that still
        holds them), continuing its reply where it stopped."""
        victim.held_when_preempted = len(self.slots[victim.slot].tokens)
        self._vacate(victim, now)
        if victim.generated:
            victim.num_yields += 1
        victim.queued_at, victim.num_overtaken = now, 0
        self.waiting.append(victim.rid)
        self.outbox.log("request.preempted", **{"rid": victim.rid, "reason": reason,
                                                  "num_held": victim.held_when_preempted,
                                                  "num_generated": len(victim.generated),
                                                  "num_yields": victim.num_yields, **fields})

    def _vacate(self, req: Request, now: float) -> None:
        """Take a request that stops running (finished or preempted) out of its slot. The
        slot keeps its tokens: its tail is staged with the next step, its pages count as
        used now."""
        slot = self.slots[req.slot]
        slot.rid = None
        slot.tail_wanted = True
        self.pages.sync_slot(slot)
        self.pages.touch(slot.page_ids, now)
        self._unplace(req)

    def _unplace(self, req: Request, release: bool = True) -> None:
        """Take a request out of its slot. Buffers of a read in flight stay with that read
        (`pages_read` frees them); buffers read and not yet loaded are freed here."""
        if release and req.loading:
            self.pages.release([b for _, b in req.loading])
        req.reading, req.loading, req.restore_pages = [], [], []
        req.slot = None

    def _issue_reads(self) -> None:
        if not self.pages.enabled:
            return  # kvstore (re)starting: reads wait until it has attached the buffers
        for slot in self.slots:
            req = self.requests.get(slot.rid) if slot.rid else None
            # Read ahead while a batch loads; a hybrid slot takes its batches one at a time
            # (a miss may make the slot unusable below a page that carries its state).
            if req is not None and req.restore_pages and not req.reading \
                    and (self.config.trimmable or not req.loading):
                read = self.reads.issue(req)
                if read is not None:
                    self.outbox.send(read)

    def _note_restore_done(self, req: Request, now: float) -> None:
        if req.ready_at is None:
            req.ready_at = now
        if req.prefilled_at is None and self._remaining_prefill(req) == 0:
            req.prefilled_at = now
        if req.restore_started_at is not None:
            req.restore_s = now - req.restore_started_at
            req.restore_started_at = None
        if not req.cache_counted:
            req.cache_counted = True
            req.num_cached = min(len(self.slots[req.slot].tokens), len(req.prompt) - 1)
        if not req.prompt_tail_saved and self._remaining_prefill(req) == 0:
            req.prompt_tail_saved = True
            self.slots[req.slot].tail_wanted = True  # the prompt's tail, staged next step

    def _pinned(self, placing: Request | None = None) -> set[bytes]:
        """Pages eviction must leave: those requests are restoring, and those waiting
        requests will restore (docs/design/kv-pages.md "Disk eviction policy"). The request being
        placed (`placing`) pins only what it restores: the tails it passed go."""
        pinned = set()
        for req in self.requests.values():
            pinned.update(p.page_id for p in req.restore_pages)
            pinned.update(p.page_id for p, _ in req.reading + req.loading)
        ns, P = self.pages.chain_namespace, self.config.page_size
        waiting = [self.requests[rid] for rid in self.waiting]
        return pinned | self.pages.awaited(
            ((r.context_chain(ns, P), r.feed, r.num_context, r.images, r.root) for r in waiting
             if r is not placing), self.config.trimmable)

    def _remaining_prefill(self, req: Request) -> int:
        return req.num_context - len(self.slots[req.slot].tokens)

    def _decode_item(self, req: Request) -> DecodeItem:
        slot = self.slots[req.slot]
        return DecodeItem(slot=slot.index, position=len(slot.tokens), token_id=req.feed[-1],
                          sampling=req.sampling, sample_index=len(req.generated),
                          stop_token_ids=tuple(req.stop_token_ids))

    def _with_drafts(self, decodes: list[DecodeItem], burst: int) -> list[DecodeItem] | None:
        """This step's decodes with the proposer's drafts, or None when none was proposed
        (or the worker cannot verify them here: "alone" verifies only a lone sequence).
        A sequence's draft leaves room for the model's own next token within its
        max_tokens and the context; a request's first token comes alone (its prompt's tail
        is staged exactly). `burst`: the passes the step would run without drafts."""
        mode = self.config.speculation
        if self.proposer is None or not decodes or not mode or \
                (mode == "alone" and len(decodes) > 1):
            return None
        draft_model = bool(self.config.drafter)
        proposals, limits, rids = [], [], []
        for item in decodes:
            req = self.requests[self.slots[item.slot].rid]
            room = self.config.ctx - (item.position + 1)
            limit = min(req.max_tokens - len(req.generated), room)
            wants = bool(req.generated) and limit > 1 and req.speculative
            copied = wants and not (draft_model and self.config.draft_only)
            proposals.append(self.proposer.propose(req.rid, limit - 1) if copied else None)
            limits.append(min(limit - 1, self.config.num_draft_tokens) if wants else 0)
            rids.append(req.rid)
        if draft_model:  # the draft model's rows, or copied drafts (docs/design.md)
            width, asked = self.proposer.draft_plan(rids, proposals, limits, burst)
        else:
            width, asked = self.proposer.width(proposals, burst), [0] * len(decodes)
        if width == 1:
            return None
        out = []
        for item, proposal, k in zip(decodes, proposals, asked):
            if k:  # the worker's draft model drafts this row
                out.append(msgspec.structs.replace(item, draft_tokens=k, burst_limit=1 + k))
                continue
            draft = proposal.tokens[:width - 1] if proposal is not None else ()
            out.append(msgspec.structs.replace(item, draft=draft, burst_limit=1 + len(draft)))
        return out

    def _observe_draft(self, req: Request, draft: tuple[int, ...], tokens: list[int],
                       kind: str = "suffix") -> None:
        kept = num_accepted(draft, tokens)
        req.num_proposed += len(draft)
        req.num_accepted += kept
        req.proposers.add(kind)
        if kind != "suffix":  # the worker's drafter (a draft model, MTP heads)
            self.proposer.observe_draft(req.rid, len(draft), kept)
        else:
            self.proposer.observe(req.rid, len(draft), kept)

    def _with_burst(self, item: DecodeItem, burst: int) -> DecodeItem:
        req = self.requests[self.slots[item.slot].rid]
        room = self.config.ctx - (item.position + 1)  # tokens the slot can still take
        limit = min(burst, req.max_tokens - len(req.generated), room)
        return msgspec.structs.replace(item, burst_limit=max(1, limit))

    # --- finishing -------------------------------------------------------------------------

    def _accept_token(self, req: Request, token: int, now: float) -> None:
        if req.cancelled:
            return
        if req.first_token_at is None:
            req.first_token_at = now
        if token in req.stop_token_ids:
            return self._finish(req, "stop", now)
        req.add_token(token)
        self._unsent.setdefault(req.rid, []).append(token)
        context_full = len(req.feed) + 1 > self.config.ctx
        if len(req.generated) >= req.max_tokens or context_full:
            self._finish(req, "length", now)

    def _finish(self, req: Request, reason: str, now: float, notify: bool = True) -> None:
        if self.proposer is not None:
            self.proposer.finish(req.rid)  # its text stays to copy from
        if req.slot is not None:
            self._vacate(req, now)
        if req.rid in self.waiting:
            self.waiting.remove(req.rid)
        del self.requests[req.rid]
        if req.sampling.grammar:
            self.outbox.send(ReleaseGrammar(req.rid))
        started = req.admitted_at if req.admitted_at is not None else now
        num_prefilled = max(0, len(req.prompt) - req.num_cached) if req.admitted_at else 0
        self.outbox.finished(FinishedRecord(
            rid=req.rid, priority=req.priority, finish_reason=reason,
            num_prompt_tokens=len(req.prompt), num_cached_tokens=req.num_cached,
            num_reused_tokens=req.num_reused, num_copied_tokens=req.num_copied,
            num_restored_tokens=req.num_restored, num_prefilled_tokens=num_prefilled,
            num_generated_tokens=len(req.generated), queue_s=started - req.arrived_at,
            restore_s=req.restore_s,
            ttft_s=None if req.first_token_at is None else req.first_token_at - req.arrived_at,
            duration_s=now - req.arrived_at, num_proposed_tokens=req.num_proposed,
            num_accepted_tokens=req.num_accepted, proposers=",".join(sorted(req.proposers)),
            num_reread_tokens=req.num_reread, tenant=req.tenant,
            conversation=req.conversation, **_prefill_times(req)))
        unsent = self._unsent.pop(req.rid, None)
        if notify:
            if unsent:
                self.outbox.send(TokensGenerated(req.rid, tuple(unsent)))
            self.outbox.send(RequestFinished(req.rid, reason, len(req.prompt), req.num_cached,
                                               len(req.generated)))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.slots if s.rid is not None)


def _prefill_times(req: Request) -> dict:
    """Prefill wait and prefill time of a finished request (0 for a phase it never had)."""
    started = req.first_chunk_at or req.prefilled_at
    wait = started - req.ready_at if started is not None and req.ready_at is not None else 0.0
    took = (req.prefilled_at - req.first_chunk_at
            if req.prefilled_at is not None and req.first_chunk_at is not None else 0.0)
    return {"prefill_wait_s": wait, "prefill_s": took,
            "num_waited_tokens": req.num_waited_tokens}
