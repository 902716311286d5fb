"""A request's life in the core: submitted, queued, preempted back to the queue, its tokens
accepted, finished (stop, length, cancelled, failed) and recorded once.

Every way a request ends goes through `finish`, so the slot, the queue, the grammar, the
unsent tokens and the `FinishedRecord` are settled in one place
(docs/design/scheduling.md "Scheduling").
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.proto.scheduler_worker import PrepareGrammar, ReleaseGrammar
from switchyard.proto.gateway_scheduler import (
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.common.page_ids import chain_root
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.events import FailAll
from switchyard.scheduler.requests import Request


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
    # and had to prefill again: 0 while its pages reach the disk
    # (docs/design/kv-pages.md "Memory plan").
    num_reread_tokens: int = 0
    tenant: str = ""  # its key's name with several keys
    conversation: str = ""  # the status's label of its conversation (never a page id)


class RequestLifecycle:
    def __init__(self, state: CoreState):
        self.state = state

    # --- from the gateway ------------------------------------------------------------------

    def submit(self, msg: SubmitRequest, now: float) -> None:
        st, cfg = self.state, self.state.config
        if len(msg.prompt_token_ids) == 0:
            return self._reject(msg.rid, "invalid_request", "prompt is empty")
        if len(msg.prompt_token_ids) + 1 > cfg.ctx:
            return self._reject(msg.rid, "context_length_exceeded",
                                f"prompt has {len(msg.prompt_token_ids)} tokens; the context "
                                f"holds {cfg.ctx}")
        if msg.rid in st.requests:
            return self._reject(msg.rid, "invalid_request", "duplicate request id")
        st.shares.note(msg.tenant, msg.tenant_weight)
        refusal = st.shares.queue_refusal(msg.tenant, (st.requests[r] for r in st.waiting),
                                          {r.tenant for r in st.requests.values()},
                                          cfg.max_queue)
        if refusal is not None:
            st.outbox.send(RequestFailed(msg.rid, "queue_full", refusal, True,
                                         cfg.retry_after_s))
            return
        req = st.requests[msg.rid] = Request(
            rid=msg.rid, prompt=msg.prompt_token_ids, max_tokens=max(1, msg.max_tokens),
            sampling=msg.sampling, stop_token_ids=frozenset(msg.stop_token_ids),
            priority=msg.priority, arrived_at=now, images=msg.images,
            image_data={d.image_id: d for d in msg.image_data}, speculative=msg.speculative,
            root=chain_root(msg.cache_salt), tenant=msg.tenant)
        st.pages.note_root(req.root)
        st.root_tenants.note(req.root, msg.tenant)
        if st.proposer is not None and req.speculative:
            st.proposer.start(req.rid, req.feed, msg.cache_salt, tenant=msg.tenant)
        st.waiting.append(msg.rid)
        if msg.sampling.grammar:  # placed once the worker compiled it, off its steps
            req.grammar_ready = False
            st.outbox.send(PrepareGrammar(msg.rid, msg.sampling.grammar))

    def _reject(self, rid: str, code: str, message: str) -> None:
        self.state.outbox.send(RequestFailed(rid, code, message, False))

    def cancel(self, rid: str, now: float) -> None:
        req = self.state.requests.get(rid)
        if req is None:
            return
        req.cancelled = True
        if not self.state.busy(req):
            self.finish(req, "cancelled", now)
        # else: finished when the step or page read it is part of comes back

    def abort_all(self, now: float) -> None:
        """The gateway restarted: its requests have no one to answer to."""
        for req in list(self.state.requests.values()):
            self.finish(req, "cancelled", now, notify=False)

    def fail_all(self, event: FailAll, now: float) -> None:
        rids = list(self.state.requests)
        self.abort_all(now)
        for rid in rids:
            self.state.outbox.send(RequestFailed(rid, event.code, event.message, True,
                                                 event.retry_after_s))

    # --- running ---------------------------------------------------------------------------

    def preempt(self, victim: Request, now: float, reason: str, **fields) -> None:
        """Take a running request out of its slot; it waits in the queue again. `reason`:
        "slot" (a waiting request ranks above it) or "memory" (the KV budget).

        Nothing is lost: its full pages are written through and its slot's tail is staged
        next, so it resumes from its pages when placed again (in its old slot, if that still
        holds them), continuing its reply where it stopped."""
        st = self.state
        victim.held_when_preempted = len(st.slots[victim.slot].tokens)
        st.vacate(victim, now)
        if victim.generated:
            victim.num_yields += 1
        victim.queued_at, victim.num_overtaken = now, 0
        st.waiting.append(victim.rid)
        st.outbox.log("request.preempted", **{"rid": victim.rid, "reason": reason,
                                                "num_held": victim.held_when_preempted,
                                                "num_generated": len(victim.generated),
                                                "num_yields": victim.num_yields, **fields})

    def accept_token(self, req: Request, token: int, now: float) -> None:
        if req.cancelled:
            return
        if req.first_token_at is None:
            req.first_token_at = now
        if token in req.stop_token_ids:
            return self.finish(req, "stop", now)
        req.add_token(token)
        self.state.unsent.setdefault(req.rid, []).append(token)
        context_full = len(req.feed) + 1 > self.state.config.ctx
        if len(req.generated) >= req.max_tokens or context_full:
            self.finish(req, "length", now)

    def finish(self, req: Request, reason: str, now: float, notify: bool = True) -> None:
        st = self.state
        if st.proposer is not None:
            st.proposer.finish(req.rid)  # its text stays to copy from
        if req.slot is not None:
            st.vacate(req, now)
        if req.rid in st.waiting:
            st.waiting.remove(req.rid)
        del st.requests[req.rid]
        if req.sampling.grammar:
            st.outbox.send(ReleaseGrammar(req.rid))
        st.outbox.finished(_record(req, reason, now))
        unsent = st.unsent.pop(req.rid, None)
        if notify:
            if unsent:
                st.outbox.send(TokensGenerated(req.rid, tuple(unsent)))
            st.outbox.send(RequestFinished(req.rid, reason, len(req.prompt), req.num_cached,
                                           len(req.generated)))


def _record(req: Request, reason: str, now: float) -> FinishedRecord:
    started = req.admitted_at if req.admitted_at is not None else now
    num_prefilled = max(0, len(req.prompt) - req.num_cached) if req.admitted_at else 0
    return FinishedRecord(
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
        conversation=req.conversation, **_prefill_times(req))


def _prefill_times(req: Request) -> dict:
    """Prefill wait and prefill time of a finished request (0 for a phase it never had)."""
    started = req.first_chunk_at or req.prefilled_at
    wait = started - req.ready_at if started is not None and req.ready_at is not None else 0.0
    took = (req.prefilled_at - req.first_chunk_at
            if req.prefilled_at is not None and req.first_chunk_at is not None else 0.0)
    return {"prefill_wait_s": wait, "prefill_s": took,
            "num_waited_tokens": req.num_waited_tokens}
