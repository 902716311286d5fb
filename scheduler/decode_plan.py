"""A step's decodes: one token per decoding request, a burst of them when nothing else waits,
or one verify pass over the proposer's drafts (docs/design/speculative-decoding.md); and
what a step that came back says about the cost of decoding, for the prefill budget
(scheduler.step_budget) and the proposer.
"""

from __future__ import annotations

import msgspec

from switchyard.proto.scheduler_worker import DecodeItem, RunStep, StepDone
from switchyard.common.speculation import num_accepted
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.requests import Request


class DecodePlanner:
    def __init__(self, state: CoreState):
        self.state = state
        self.planned_at = 0.0  # when the step in flight was planned
        self.done_at = 0.0  # when the previous step came back

    def item(self, req: Request) -> DecodeItem:
        slot = self.state.slots[req.slot]
        return DecodeItem(slot=slot.index, position=len(slot.tokens), token_id=req.feed[-1],
                          sampling=req.sampling, sample_index=len(req.generated),
                          stop_token_ids=tuple(req.stop_token_ids))

    def widen(self, decodes: list[DecodeItem], burst: int) -> tuple[list[DecodeItem], int]:
        """The decodes with drafts to verify in one pass, or each with its limit of a
        `burst` of tokens; and the step's number of passes."""
        drafted = self._with_drafts(decodes, burst)
        if drafted is not None:
            return drafted, 1
        if burst > 1:
            return [self._with_burst(d, burst) for d in decodes], burst
        return decodes, burst

    def _with_drafts(self, decodes: list[DecodeItem], burst: int) -> list[DecodeItem] | None:
        """This step's decodes with the proposer's drafts, or None when none was proposed
        (or the worker cannot verify them here: "alone" verifies only a lone sequence).
        A sequence's draft leaves room for the model's own next token within its
        max_tokens and the context; a request's first token comes alone (its prompt's tail
        is staged exactly). `burst`: the passes the step would run without drafts."""
        st, cfg = self.state, self.state.config
        mode = cfg.speculation
        if st.proposer is None or not decodes or not mode or \
                (mode == "alone" and len(decodes) > 1):
            return None
        draft_model = bool(cfg.drafter)
        proposals, limits, rids = [], [], []
        for item in decodes:
            req = st.requests[st.slots[item.slot].rid]
            room = cfg.ctx - (item.position + 1)
            limit = min(req.max_tokens - len(req.generated), room)
            wants = bool(req.generated) and limit > 1 and req.speculative
            copied = wants and not (draft_model and cfg.draft_only)
            proposals.append(st.proposer.propose(req.rid, limit - 1) if copied else None)
            limits.append(min(limit - 1, cfg.num_draft_tokens) if wants else 0)
            rids.append(req.rid)
        # The draft model's rows, or copied drafts (docs/design/speculative-decoding.md).
        if draft_model:
            width, asked = st.proposer.draft_plan(rids, proposals, limits, burst)
        else:
            width, asked = st.proposer.width(proposals, burst), [0] * len(decodes)
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

    def _with_burst(self, item: DecodeItem, burst: int) -> DecodeItem:
        st = self.state
        req = st.requests[st.slots[item.slot].rid]
        room = st.config.ctx - (item.position + 1)  # tokens the slot can still take
        limit = min(burst, req.max_tokens - len(req.generated), room)
        return msgspec.structs.replace(item, burst_limit=max(1, limit))

    def observe_draft(self, req: Request, draft: tuple[int, ...], tokens: list[int],
                      kind: str = "suffix") -> None:
        """A verified draft: what the request kept of it, and the proposer's record."""
        proposer = self.state.proposer
        kept = num_accepted(draft, tokens)
        req.num_proposed += len(draft)
        req.num_accepted += kept
        req.proposers.add(kind)
        if kind != "suffix":  # the worker's drafter (a draft model, MTP heads)
            proposer.observe_draft(req.rid, len(draft), kept)
        else:
            proposer.observe(req.rid, len(draft), kept)

    def observe_step(self, done: StepDone, plan: RunStep, now: float) -> None:
        """Feed the prefill budget. What a decoding stream sees is the whole cycle from one
        token to the next (worker compute, messages, this planning), not only the forward
        pass, so decode-only steps are measured as cycles here. A step that verified drafts
        is one pass, however many tokens it kept: its cycle is what a prefill chunk must not
        stretch (the budget counts the verified tokens' time, not the tokens kept)."""
        proposer = self.state.proposer
        cycle = now - self.planned_at
        if now - self.planned_at < 1.0 and self.planned_at - self.done_at < 0.05:
            cycle = now - self.done_at  # planned right after the previous step: a full cycle
        self.done_at = now
        iterations = max(1, len(done.sampled) // max(1, done.num_decode_tokens))
        width = 1 + max([len(d.draft) for d in plan.decodes]
                        + [len(d.token_ids) for d in done.drafts], default=0)
        if width > 1:
            iterations = 1
        # (A step whose draft model caught rows up also prefilled: no measure of a pass.)
        if proposer is not None and plan.decodes and not plan.prefills \
                and not done.num_catch_up_tokens:
            # The verify pass alone: the draft model's passes are measured apart.
            proposer.observe_cost(len(plan.decodes),
                                  (done.decode_s - done.draft_s) / iterations, width)
            proposer.observe_trip(cycle - done.duration_s)
            if done.num_draft_passes:
                proposer.observe_draft_cost(len(plan.decodes),
                                            done.draft_s / done.num_draft_passes)
        decode_cycle = cycle / iterations if done.num_prefill_tokens == 0 else 0.0
        self.state.budget.observe(done.num_decode_tokens, decode_cycle,
                                  done.num_prefill_tokens, done.prefill_s,
                                  done.num_encoded_tokens, done.encode_s)
