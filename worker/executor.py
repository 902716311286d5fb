"""Execute one step plan: stage pages out, copy and load pages in, decode, then prefill.

Staging runs first so that it reads what the previous step left in a slot, before this
step's copies, loads or prefills truncate it. Decode runs before prefill: a running sequence
never waits for a neighbour's chunk to get its token computed. The step's prefill chunks
run packed, several slots' chunks as rows of one forward pass, where the model's caches allow
it (docs/design/scheduling.md "Packed prefill").
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

import msgspec

from switchyard.proto.scheduler_worker import (
    DecodeItem,
    PrefillChunk,
    RunStep,
    SampledToken,
    SlotDraft,
    SlotFailure,
    StepDone,
)
from switchyard.proto.shm import PageBufferPool
from switchyard.worker.cache_kinds import before_token, drop_last_token
from switchyard.worker.constraints import ConstraintEngine
from switchyard.worker.drafters import Drafter, DraftRow
from switchyard.worker.errors import ImageInputError
from switchyard.worker.page_io import PageLayout
from switchyard.worker.cpu_weights import weight_bytes_read
from switchyard.worker.prefill_packing import context_per_weight_read, pack_groups
from switchyard.worker.sampling import sample_lazy
from switchyard.worker.slots import SlotStore
from switchyard.common.speculation import verified


class StepExecutor:
    def __init__(self, store: SlotStore, layout: PageLayout | None,
                 pool: PageBufferPool | None, constraints: ConstraintEngine | None = None,
                 share_tokens=None, drafter: Drafter | None = None,
                 packed_prefill: bool = True, context_per_read: int | None = None):
        self.store = store
        # Several slots' prefill chunks in one forward pass (--packed-prefill), where the
        # store's caches allow it, as long as copying the rows' contexts costs less than the
        # weight reads saved: `context_per_read` tokens of context per read (None: measured
        # from the model once a slot holds KV; a worker group's ranks are given one figure,
        # as they must pack alike).
        self.packed_prefill = packed_prefill and store.packs_prefill
        self._context_per_read = context_per_read
        # Drafts made in the worker (worker/drafters.py: a draft model), for the rows that
        # ask for them (DecodeItem.draft_tokens).
        self.drafter = drafter
        self._drafts: list[SlotDraft] = []  # this step's drafter drafts, as verified
        self._from_drafter: set[int] = set()  # slots whose draft the drafter made this step
        self.layout = layout
        self.pool = pool
        self.constraints = constraints
        # A worker group: rank 0's sampled tokens to every rank, lazily (worker/group.py).
        self.share_tokens = share_tokens or (lambda tokens: tokens)
        # In a group every rank must feed the same rows: rank 0 alone knows the grammars, so
        # there a draft the grammar rejects is not cut short; the mask rejects it instead.
        self.cut_drafts = share_tokens is None

    def _buffer(self, index: int):
        return self.pool.array(index, "uint8", self.pool.buffer_bytes)

    def run(self, step: RunStep) -> StepDone:
        started = time.perf_counter()
        store = self.store
        for slot in step.shelves:
            store.shelve(slot)
        for stage in step.stages:
            end = stage.start + (stage.num_tokens or self.layout.page_size)
            # The state at the page's end: the slot's own, or its mark's (worker/state_marks.py).
            cache = (store.state_at(stage.slot, end) if stage.with_state
                     else store.stage_source(stage.slot))
            self.layout.stage(cache, stage.start, self._buffer(stage.buffer), stage.with_state,
                              stage.num_tokens)
        for copy in step.copies:
            store.copy_prefix(copy.src_slot, copy.dst_slot, copy.num_tokens, copy.state_follows)
        for slot in step.releases:
            store.release(slot)
            if self.drafter is not None:
                self.drafter.release(slot)
        for cut in step.cuts:  # the drafter's KV is never paged: it keeps the slot's
            store.release(cut.slot, keep=cut.num_tokens)
        load_started = time.perf_counter()
        if self.drafter is not None:  # a slot starting over: its drafter state goes with it
            for slot in {x.slot for x in (*step.loads, *step.prefills) if x.start == 0}:
                self.drafter.release(slot)
        for load in step.loads:
            cache = store.loaded(load.slot, load.start, list(load.token_ids), load.images)
            # Room for the context and an eighth more, within --ctx: a conversation that
            # grows turn by turn re-allocates its slot rarely (docs/design/kv-pages.md "Restores").
            end = load.start + len(load.token_ids)
            reserve = min(store.ctx - end, load.reserve + (end + load.reserve) // 8)
            self.layout.load(cache, load.start, [self._buffer(b) for b in load.buffers],
                             load.with_state, len(load.token_ids), max(0, reserve))
            if load.with_state:  # where a repeat of this context resumes
                store.mark(load.slot)
        decode_started = time.perf_counter()
        self._drafts, self._from_drafter = [], set()
        decodes = self._drafted(step.decodes)
        sampled = self._decode(step, decodes) if decodes else ()
        draft_s, draft_passes = self.drafter.take_stats() if self.drafter else (0.0, 0)
        caught_up = getattr(self.drafter, "take_catch_up_tokens", lambda: 0)()
        prefill_started = time.perf_counter()
        decode_passes, decode_pass_tokens = store.take_pass_stats()
        failed = self._prefill(step.prefills)
        done = time.perf_counter()
        encode_s, num_encoded = store.take_encode_stats()
        prefill_passes, prefill_pass_tokens = store.take_pass_stats()
        return StepDone(
            step=step.step, sampled=sampled,
            num_prefill_tokens=sum(len(c.token_ids) for c in step.prefills),
            num_decode_tokens=len(step.decodes), duration_s=done - started,
            num_verified_tokens=sum(len(d.draft) for d in step.decodes)
            + sum(len(d.token_ids) for d in self._drafts),
            drafts=tuple(self._drafts), draft_s=draft_s, num_draft_passes=draft_passes,
            num_catch_up_tokens=caught_up,
            decode_s=prefill_started - decode_started,
            prefill_s=done - prefill_started - encode_s, load_s=decode_started - load_started,
            encode_s=encode_s, num_encoded_tokens=num_encoded, failed=tuple(failed),
            num_forward_passes=decode_passes + prefill_passes,
            num_forward_tokens=decode_pass_tokens + prefill_pass_tokens,
            num_prefill_passes=prefill_passes)

    def _prefill(self, chunks: tuple[PrefillChunk, ...]) -> list[SlotFailure]:
        """Run the step's chunks: packed in groups of near-equal length (worker/
        prefill_packing.py), each group one pass; a group of one, and every chunk where
        packing is off, alone. Returns the chunks that failed (their slots as before)."""
        if self.packed_prefill and len(chunks) > 1:
            groups = pack_groups([len(c.token_ids) for c in chunks], [c.start for c in chunks],
                                 self.context_per_read())
        else:
            groups = [[i] for i in range(len(chunks))]
        failed = []
        for group in groups:
            if len(group) > 1:
                self.store.prefill_packed([chunks[i] for i in group])
                continue
            chunk = chunks[group[0]]
            try:
                self.store.prefill_chunk(chunk)
            except ImageInputError as exc:  # raised before the chunk touched its slot
                failed.append(SlotFailure(chunk.slot, "invalid_image", str(exc)))
        return failed

    def context_per_read(self) -> int:
        """Context tokens whose copy into a packed batch costs the bytes of one weight read
        (worker/prefill_packing.py); 0 while no slot holds KV (every context is then 0)."""
        if self._context_per_read is None:
            kv_bytes = self.store.kv_bytes_per_token()
            if kv_bytes is None:
                return 0
            self._context_per_read = context_per_weight_read(
                weight_bytes_read(self.store.model), kv_bytes)
        return self._context_per_read

    def _drafted(self, decodes: tuple[DecodeItem, ...]) -> tuple[DecodeItem, ...]:
        """The step's decodes, those that ask the drafter for a draft given one (
        docs/design/speculative-decoding.md "Speculative decoding": drafts made in the worker)."""
        wanted = [i for i, d in enumerate(decodes)
                  if d.draft_tokens and not d.draft and d.burst_limit > 1]
        if self.drafter is None or not wanted:
            return decodes
        tokens = self.store.tokens
        rows = [DraftRow(d.slot, tokens[d.slot][:d.position] + [d.token_id],
                         min(d.draft_tokens, d.burst_limit - 1), d.stop_token_ids)
                for d in (decodes[i] for i in wanted)]
        out = list(decodes)
        for i, draft in zip(wanted, self.drafter.propose(rows)):
            out[i] = msgspec.structs.replace(out[i], draft=draft)
        self._from_drafter = {decodes[i].slot for i in wanted}
        return tuple(out)

    def _decode(self, step: RunStep, decodes: tuple[DecodeItem, ...]) -> tuple[SampledToken, ...]:
        """Batched decode iterations; a sequence drops out at a stop token or its limit."""
        constrained = self._sync_constraints(decodes)
        if any(d.draft for d in decodes):
            return self._verify(decodes, constrained)
        if len(decodes) == 1 and step.num_decode_steps > 1 and self.store.drops_last_token:
            return self._decode_pipelined(decodes[0], step.num_decode_steps, constrained)
        active = [[d, d.position, d.token_id, 0] for d in decodes]  # item, pos, input, n
        sampled = []
        for _ in range(step.num_decode_steps):
            if not active:
                break
            slots = [a[0].slot for a in active]
            logits = self.store.decode(slots, [a[1] for a in active], [a[2] for a in active])
            if constrained:
                logits = self._masked(logits, slots)
            tokens = self.share_tokens(sample_lazy(
                logits, [a[0].sampling for a in active],
                [a[0].sample_index + a[3] for a in active])).tolist()
            still = []
            for entry, token in zip(active, tokens):
                item = entry[0]
                sampled.append(SampledToken(item.slot, token))
                if constrained:
                    self.constraints.accept(item.slot, token)
                entry[1:] = [entry[1] + 1, token, entry[3] + 1]
                if entry[3] < item.burst_limit and token not in item.stop_token_ids:
                    still.append(entry)
            active = still
        return tuple(sampled)

    def _sync_constraints(self, decodes: tuple[DecodeItem, ...]) -> bool:
        """Bring each constrained row's matcher to its request's generated tokens."""
        if self.constraints is None:
            return False
        constrained = False
        for item in decodes:
            def history(item=item) -> list[int]:
                # The slot holds prompt + generated[:-1]; the last generated is the input.
                n = item.sample_index
                if n == 0:
                    return []
                earlier = self.store.tokens[item.slot][item.position - (n - 1):item.position]
                return earlier + [item.token_id]
            constrained |= self.constraints.sync(item.slot, item.sampling, item.sample_index,
                                                 item.token_id, history)
        return constrained

    def _masked(self, logits: mx.array, slots: list[int]) -> mx.array:
        """Mask the logits of constrained rows. The masks are computed on the CPU while the
        forward pass runs (it is queued first), not after it."""
        mx.async_eval(logits)
        allowed = self.constraints.masks(slots, logits.shape[-1])
        if allowed is None:
            return logits
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _decode_pipelined(self, item, num_steps: int, constrained: bool = False
                          ) -> tuple[SampledToken, ...]:
        """One sequence, several tokens: queue token i+1's forward pass before reading token
        i, so graph building overlaps compute (as mlx_lm.generate does). When the sequence
        stops, the one speculative token fed past the stop is undone: attention layers trim
        it, recurrent layers get back the state arrays they held before it
        (docs/design/kv-pages.md "Hybrid models").

        A constrained sequence queues token i+1's forward pass the same way, but samples it
        only after token i is read and its matcher advanced: the mask is computed while that
        forward pass runs."""
        store = self.store
        store.truncate(item.slot, item.position)
        cache = store.parked(item.slot)

        hiddens = []  # final hidden states per fed token, for an MTP drafter

        def logits_of(token: mx.array) -> mx.array:
            logits = store.forward(token[:, None], cache)[:, -1, :]
            if store.mtp is not None:
                hiddens.append(store.last_hidden)
            return logits

        def sample(logits: mx.array, index: int) -> mx.array:
            if constrained:
                logits = self._masked(logits, [item.slot])
            return self.share_tokens(
                sample_lazy(logits, [item.sampling], [item.sample_index + index]))

        fed = [item.token_id]
        y = sample(logits_of(mx.array([item.token_id])), 0)
        mx.async_eval(y)
        sampled, saved = [], None
        for i in range(num_steps):
            last = i + 1 >= min(num_steps, item.burst_limit)
            following = None
            if not last:  # a constrained sequence queues only the logits: sampled below
                saved = before_token(cache)
                following = logits_of(y) if constrained else sample(logits_of(y), i + 1)
                mx.async_eval(following)
            token = y.item()
            sampled.append(SampledToken(item.slot, token))
            if constrained:
                self.constraints.accept(item.slot, token)
            if token in item.stop_token_ids or last:
                if following is not None:
                    mx.eval(following)
                    drop_last_token(cache, saved)  # the speculative input past the stop
                break
            fed.append(token)
            y = sample(following, i + 1) if constrained else following
        store.record(item.slot, fed,
                     mx.concatenate(hiddens[:len(fed)], axis=1) if hiddens else None)
        return tuple(sampled)

    def _verify(self, items: tuple[DecodeItem, ...], constrained: bool
                ) -> tuple[SampledToken, ...]:
        """One forward pass that checks every sequence's draft (docs/design.md "Speculative
        decoding"): row = input token + draft; the model's token at each position is sampled
        as a plain decode would sample it (same filters, mask and key), and each sequence
        keeps its draft up to the first disagreement plus the model's own next token
        (common/speculation.py). Rejected tokens leave the slots' caches."""
        drafts = []
        for item in items:
            draft = list(item.draft[:max(0, item.burst_limit - 1)])
            if constrained and self.cut_drafts:  # cut before a token the grammar rejects
                draft = draft[:self.constraints.draft_prefix(item.slot, draft)]
            drafts.append(draft)
        rows = [[item.token_id, *draft] for item, draft in zip(items, drafts)]
        slots = [item.slot for item in items]
        logits = self.store.verify(slots, [item.position for item in items], rows)
        width, vocab = logits.shape[1], logits.shape[-1]
        picked = [r * width + j for r, row in enumerate(rows) for j in range(len(row))]
        flat = logits.reshape(-1, vocab)
        if len(picked) < flat.shape[0]:
            flat = mx.take(flat, mx.array(picked), axis=0)
        if constrained:  # the masks are computed while the forward pass runs
            mx.async_eval(flat)
            masks = [m for item, draft in zip(items, drafts)
                     for m in self.constraints.draft_masks(item.slot, draft, vocab)]
            if any(m is not None for m in masks):
                allowed = np.ones((len(masks), vocab), dtype=bool)
                for i, m in enumerate(masks):
                    if m is not None:
                        allowed[i] = m
                flat = mx.where(mx.array(allowed), flat, mx.array(-mx.inf, dtype=flat.dtype))
        params = [item.sampling for item, row in zip(items, rows) for _ in row]
        indexes = [item.sample_index + j for item, row in zip(items, rows)
                   for j in range(len(row))]
        targets = self.share_tokens(sample_lazy(flat, params, indexes)).tolist()
        sampled, kept, start = [], [], 0
        for item, draft, row in zip(items, drafts, rows):
            emitted = verified(draft, targets[start:start + len(row)], item.stop_token_ids,
                               item.burst_limit)
            start += len(row)
            kept.append(len(emitted))  # the input and the accepted draft tokens
            for token in emitted:
                sampled.append(SampledToken(item.slot, token))
                if constrained:
                    self.constraints.accept(item.slot, token)
        self.store.keep(slots, rows, kept)
        if self.drafter is not None:
            for item, draft, k in zip(items, drafts, kept):
                # The drafter's state past what the slot kept goes (rejected tokens).
                self.drafter.cut(item.slot, item.position + k)
                if item.slot in self._from_drafter and draft:
                    self._drafts.append(SlotDraft(item.slot, tuple(draft)))
        return tuple(sampled)
