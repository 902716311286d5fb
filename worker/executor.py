"""Execute one step plan on the slots: batched decode first, then prefill chunks."""

from __future__ import annotations

import time

from proto.messages import RunStep, SampledToken, StepDone
from worker.sampling import sample_rows
from worker.slots import SlotStore


def run_step(store: SlotStore, step: RunStep) -> StepDone:
    started = time.perf_counter()
    sampled: tuple[SampledToken, ...] = ()
    if step.decodes:
        items = step.decodes
        logits = store.decode([d.slot for d in items], [d.position for d in items],
                              [d.token_id for d in items])
        tokens = sample_rows(logits, [d.sampling for d in items],
                             [d.sample_index for d in items])
        sampled = tuple(SampledToken(d.slot, t) for d, t in zip(items, tokens))
    for chunk in step.prefills:
        store.prefill(chunk.slot, chunk.start, list(chunk.token_ids))
    return StepDone(
        step=step.step, sampled=sampled,
        num_prefill_tokens=sum(len(c.token_ids) for c in step.prefills),
        num_decode_tokens=len(step.decodes), duration_s=time.perf_counter() - started)
