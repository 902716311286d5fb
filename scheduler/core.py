"""The scheduler core: admission, placement, step plans, finishing. No I/O, no clocks.

The shell feeds it events (submit, cancel, step done, peer restarts) with the current time and
sends what it returns. One step is in flight at a time: `plan_step` returns the next `RunStep`
and `step_done` applies its result. Steps are decode-first: every decoding request gets its
token each step, and prefill chunks fill what is left of the per-step token budget, warm
(nearly resident) requests before cold ones, interactive before background.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from proto.messages import (
    DecodeItem,
    PrefillChunk,
    RequestFailed,
    RequestFinished,
    RunStep,
    SlotContents,
    StepDone,
    SubmitRequest,
    TokensGenerated,
)
from scheduler.placement import choose_slot
from scheduler.requests import Request, Slot


@dataclass(frozen=True)
class CoreConfig:
    num_slots: int
    ctx: int
    prefill_chunk: int
    max_queue: int
    trimmable: bool = True
    retry_after_s: float = 1.0


@dataclass(frozen=True)
class FinishedRecord:
    """What the shell logs once per request (fields only, never text)."""

    rid: str
    priority: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_prefilled_tokens: int
    num_generated_tokens: int
    queue_s: float
    ttft_s: float | None
    duration_s: float


Outgoing = TokensGenerated | RequestFinished | RequestFailed


class SchedulerCore:
    def __init__(self, config: CoreConfig):
        self.config = config
        self.slots = [Slot(i) for i in range(config.num_slots)]
        self.requests: dict[str, Request] = {}
        self.waiting: deque[str] = deque()
        self.inflight: RunStep | None = None
        self.finished: list[FinishedRecord] = []
        self._next_step = 0

    # --- events ----------------------------------------------------------------------------

    def submit(self, msg: SubmitRequest, now: float) -> list[Outgoing]:
        cfg = self.config
        if len(msg.prompt_token_ids) == 0:
            return [RequestFailed(msg.rid, "invalid_request", "prompt is empty", False)]
        if len(msg.prompt_token_ids) + 1 > cfg.ctx:
            return [RequestFailed(
                msg.rid, "context_length_exceeded",
                f"prompt has {len(msg.prompt_token_ids)} tokens; the context holds {cfg.ctx}",
                False)]
        if len(self.waiting) >= cfg.max_queue:
            return [RequestFailed(msg.rid, "queue_full",
                                  f"{len(self.waiting)} requests are waiting; try again shortly",
                                  True, cfg.retry_after_s)]
        if msg.rid in self.requests:
            return [RequestFailed(msg.rid, "invalid_request", "duplicate request id", False)]
        self.requests[msg.rid] = Request(
            rid=msg.rid, prompt=tuple(msg.prompt_token_ids), max_tokens=max(1, msg.max_tokens),
            sampling=msg.sampling, stop_token_ids=frozenset(msg.stop_token_ids),
            priority=msg.priority, arrived_at=now)
        self.waiting.append(msg.rid)
        return []

    def cancel(self, rid: str, now: float) -> list[Outgoing]:
        req = self.requests.get(rid)
        if req is None:
            return []
        req.cancelled = True
        if self.inflight is None or req.slot is None:
            return [self._finish(req, "cancelled", now)]
        return []  # finished when the in-flight step comes back

    def step_done(self, done: StepDone, now: float) -> list[Outgoing]:
        plan, self.inflight = self.inflight, None
        if plan is None or done.step != plan.step:
            return []  # a stale reply from before a restart
        for chunk in plan.prefills:
            self.slots[chunk.slot].tokens.extend(chunk.token_ids)
        sampled = {s.slot: s.token_id for s in done.sampled}
        out: list[Outgoing] = []
        for item in plan.decodes:
            slot = self.slots[item.slot]
            slot.tokens.append(item.token_id)
            slot.last_used = now
            if slot.rid is not None and item.slot in sampled:
                out += self._accept_token(self.requests[slot.rid], sampled[item.slot], now)
        for req in [r for r in self.requests.values() if r.cancelled]:
            out.append(self._finish(req, "cancelled", now))
        return out

    def worker_restarted(self, slots: tuple[SlotContents, ...] = ()) -> None:
        """The worker's slot memory is what it reports; requests in slots start over there."""
        self.inflight = None
        contents = {s.slot: list(s.token_ids) for s in slots}
        requeue = []
        for slot in self.slots:
            slot.tokens = contents.get(slot.index, [])
            if slot.rid is not None:
                requeue.append(slot.rid)
                self.requests[slot.rid].slot = None
                slot.rid = None
        self.waiting.extendleft(reversed(requeue))

    def abort_all(self, now: float) -> list[Outgoing]:
        """The gateway restarted: its requests have no one to answer to."""
        out = [self._finish(req, "cancelled", now) for req in list(self.requests.values())]
        self.inflight = None
        return out

    # --- planning --------------------------------------------------------------------------

    def plan_step(self, now: float) -> RunStep | None:
        if self.inflight is not None:
            return None
        self._admit(now)
        running = [self.requests[s.rid] for s in self.slots if s.rid is not None]
        decodes, prefilling = [], []
        for req in running:
            remaining = self._remaining_prefill(req)
            if remaining == 0:
                decodes.append(self._decode_item(req))
            else:
                prefilling.append((req, remaining))
        prefills = []
        budget = self.config.prefill_chunk
        prefilling.sort(key=lambda rr: (not rr[0].interactive, rr[1], rr[0].arrived_at))
        for req, remaining in prefilling:
            if budget <= 0:
                break
            start = len(self.slots[req.slot].tokens)
            n = min(remaining, budget)
            prefills.append(PrefillChunk(req.slot, start, req.feed[start:start + n]))
            budget -= n
        if not decodes and not prefills:
            return None
        self.inflight = RunStep(self._next_step, tuple(prefills), tuple(decodes))
        self._next_step += 1
        return self.inflight

    def _admit(self, now: float) -> None:
        order = sorted(self.waiting, key=lambda rid: not self.requests[rid].interactive)
        for rid in order:
            req = self.requests[rid]
            context = req.feed[:-1]
            placement = choose_slot(self.slots, context, self.config.trimmable)
            if placement is None:
                break
            slot = self.slots[placement.slot]
            # The worker trims to the first command's start; mirror that now.
            del slot.tokens[placement.reused:]
            slot.rid, slot.last_used = rid, now
            req.slot = placement.slot
            if req.admitted_at is None:
                req.admitted_at = now
                req.num_cached = min(placement.reused, len(req.prompt) - 1)
            self.waiting.remove(rid)

    def _remaining_prefill(self, req: Request) -> int:
        return len(req.feed) - 1 - len(self.slots[req.slot].tokens)

    def _decode_item(self, req: Request) -> DecodeItem:
        slot = self.slots[req.slot]
        return DecodeItem(slot=slot.index, position=len(slot.tokens), token_id=req.feed[-1],
                          sampling=req.sampling, sample_index=len(req.generated))

    # --- finishing -------------------------------------------------------------------------

    def _accept_token(self, req: Request, token: int, now: float) -> list[Outgoing]:
        if req.cancelled:
            return []
        if req.first_token_at is None:
            req.first_token_at = now
        if token in req.stop_token_ids:
            return [self._finish(req, "stop", now)]
        req.generated.append(token)
        out: list[Outgoing] = [TokensGenerated(req.rid, (token,))]
        context_full = len(req.feed) + 1 > self.config.ctx
        if len(req.generated) >= req.max_tokens or context_full:
            out.append(self._finish(req, "length", now))
        return out

    def _finish(self, req: Request, reason: str, now: float) -> RequestFinished:
        if req.slot is not None:
            self.slots[req.slot].rid = None
        if req.rid in self.waiting:
            self.waiting.remove(req.rid)
        del self.requests[req.rid]
        started = req.admitted_at if req.admitted_at is not None else now
        self.finished.append(FinishedRecord(
            rid=req.rid, priority=req.priority, finish_reason=reason,
            num_prompt_tokens=len(req.prompt), num_cached_tokens=req.num_cached,
            num_prefilled_tokens=len(req.prompt) - req.num_cached if req.admitted_at else 0,
            num_generated_tokens=len(req.generated), queue_s=started - req.arrived_at,
            ttft_s=None if req.first_token_at is None else req.first_token_at - req.arrived_at,
            duration_s=now - req.arrived_at))
        return RequestFinished(req.rid, reason, len(req.prompt), req.num_cached,
                               len(req.generated))

    # --- views -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.slots if s.rid is not None)
