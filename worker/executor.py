"""Execute one step plan: stage pages out, copy and load pages in, decode, then prefill.

Staging runs first so that it reads what the previous step left in a slot, before this
step's copies, loads or prefills truncate it. Decode runs before prefill: a running sequence
never waits for a neighbour's chunk to get its token computed (F6).
"""

from __future__ import annotations

import time

from proto.messages import RunStep, SampledToken, StepDone
from proto.shm import PageBufferPool
from worker.page_io import PageLayout
from worker.sampling import sample_rows
from worker.slots import SlotStore


class StepExecutor:
    def __init__(self, store: SlotStore, layout: PageLayout | None,
                 pool: PageBufferPool | None):
        self.store = store
        self.layout = layout
        self.pool = pool

    def _buffer(self, index: int):
        return self.pool.array(index, "uint8", self.pool.buffer_bytes)

    def run(self, step: RunStep) -> StepDone:
        started = time.perf_counter()
        store = self.store
        for stage in step.stages:
            self.layout.stage(store.parked(stage.slot), stage.start, self._buffer(stage.buffer),
                              stage.with_state, stage.num_tokens)
        for copy in step.copies:
            store.copy_prefix(copy.src_slot, copy.dst_slot, copy.num_tokens)
        for load in step.loads:
            cache = store.loaded(load.slot, load.start, list(load.token_ids))
            self.layout.load(cache, load.start, [self._buffer(b) for b in load.buffers],
                             load.with_state, len(load.token_ids))
        sampled: tuple[SampledToken, ...] = ()
        decode_started = time.perf_counter()
        if step.decodes:
            items = step.decodes
            logits = store.decode([d.slot for d in items], [d.position for d in items],
                                  [d.token_id for d in items])
            tokens = sample_rows(logits, [d.sampling for d in items],
                                 [d.sample_index for d in items])
            sampled = tuple(SampledToken(d.slot, t) for d, t in zip(items, tokens))
        prefill_started = time.perf_counter()
        for chunk in step.prefills:
            store.prefill(chunk.slot, chunk.start, list(chunk.token_ids))
        done = time.perf_counter()
        return StepDone(
            step=step.step, sampled=sampled,
            num_prefill_tokens=sum(len(c.token_ids) for c in step.prefills),
            num_decode_tokens=len(step.decodes), duration_s=done - started,
            decode_s=prefill_started - decode_started, prefill_s=done - prefill_started)
