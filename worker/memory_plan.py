"""The memory plan (docs/design.md, F7): every slot at full context, planned and checked at start.

The plan counts weights, slot KV at full context, the batch copy used while several slots
decode together, recurrent state, the largest step's activations, and shared page buffers.
KV is counted in the form the slots hold it: with --kv-bits, packed values plus scales and
biases (kv_bytes_per_token is measured on the quantized cache; docs/design.md "Memory plan").
If it does not fit in the device limit minus headroom, the worker refuses to start and says
which setting to lower.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from switchyard.proto.settings import format_size


class MemoryPlanError(RuntimeError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    runtime: int  # the process before any slot: interpreter, MLX, libraries, model code
    weights: int
    slot_kv: int
    batch_kv: int
    recurrent: int
    activations: int
    page_buffers: int
    limit: int
    headroom: int
    # A vision-language model: the encoder's kept features and its activations for the
    # largest image (worker/vision/memory.py); its weights are in `weights`.
    vision: int = 0
    # A draft model (--draft-model): its weights and its own KV for every slot at full
    # context, with its batch copy (worker/draft_model.py; never paged). An MTP head
    # (worker/mtp.py): its weights and its KV per slot.
    draft: int = 0

    @property
    def total(self) -> int:
        return (self.runtime + self.weights + self.slot_kv + self.batch_kv + self.recurrent
                + self.activations + self.page_buffers + self.vision + self.draft)

    def as_fields(self) -> dict[str, int]:
        return {"runtime": self.runtime, "weights": self.weights, "slot_kv": self.slot_kv, "batch_kv": self.batch_kv,
                "recurrent": self.recurrent, "activations": self.activations,
                "page_buffers": self.page_buffers, "vision": self.vision, "draft": self.draft,
                "total": self.total,
                "limit": self.limit, "headroom": self.headroom}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in self.as_fields().items())
        return f"memory plan: {parts}"


def device_memory_limit() -> int:
    """Bytes the model may use: Metal's recommended working set on Macs, RAM elsewhere."""
    import mlx.core as mx

    if sys.platform == "darwin" and mx.metal.is_available():
        info = mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size") or info["memory_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident memory so far (its peak, which at start is its size)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def make_plan(*, runtime: int, weights: int, kv_bytes_per_token: int,
              recurrent_bytes_per_slot: int,
              num_slots: int, ctx: int, prefill_chunk: int, num_heads: int,
              hidden: int, intermediate: int, vocab: int, page_buffers: int,
              limit: int, headroom: int, vision: int = 0, draft_weights: int = 0,
              draft_kv_bytes_per_token: int = 0, draft_batched: bool = True) -> MemoryPlan:
    """`draft_*`: a drafter in the worker, a draft model (whose slots are also merged into a
    batch, `draft_batched`) or an MTP head (worker/mtp.py: its KV stays per slot)."""
    slot_kv = num_slots * ctx * kv_bytes_per_token
    # While several slots decode together their KV is also held as one merged batch.
    batch_kv = slot_kv if num_slots > 1 else 0
    # CPU attention materialises the scores of one layer: chunk x context x heads (float32),
    # next to the chunk's MLP activations and the decode logits of every slot.
    scores = prefill_chunk * ctx * num_heads * 4
    mlp = prefill_chunk * (3 * intermediate + 4 * hidden) * 4
    activations = scores + mlp + num_slots * vocab * 4 * 2
    draft_kv = num_slots * ctx * draft_kv_bytes_per_token
    draft = (draft_weights + draft_kv * (2 if num_slots > 1 and draft_batched else 1)
             if draft_weights else 0)
    return MemoryPlan(draft=draft,runtime=runtime, weights=weights, slot_kv=slot_kv, batch_kv=batch_kv,
                      recurrent=num_slots * recurrent_bytes_per_slot, activations=activations,
                      page_buffers=page_buffers, limit=limit, headroom=headroom, vision=vision)


def widest_running(plan_for: Callable[[int], MemoryPlan], slots: int, most: int) -> int:
    """--max-running 0: the most requests, at most `most` and at least `slots`, whose slots
    the memory plan holds at full context (`plan_for(n)`: the plan with n slots)."""
    for n in range(most, slots, -1):
        plan = plan_for(n)
        if plan.total <= plan.limit - plan.headroom:
            return n
    return slots


def check_plan(plan: MemoryPlan, num_slots: int, ctx: int, kv_bits: int = 0,
               max_running: int = 0) -> None:
    """`num_slots`: --slots; `max_running`: --max-running, where it holds more slots."""
    available = plan.limit - plan.headroom
    if plan.total <= available:
        return
    over = plan.total - available
    raise MemoryPlanError(
        f"the memory plan needs {format_size(plan.total)} but {format_size(available)} is "
        f"available ({format_size(plan.limit)} device limit minus "
        f"{format_size(plan.headroom)} headroom); {format_size(over)} too much. "
        + (f"Lower --max-running (now {max_running}) " if max_running > num_slots else
           f"Lower --slots (now {num_slots}) ")
        + f"or --ctx (now {ctx}), or --prefill-chunk"
        + (", or use a smaller --draft-model" if plan.draft else "")
        + (f", or --kv-bits (now {kv_bits}). " if kv_bits == 8 else
           ". " if kv_bits else "; or quantize KV with --kv-bits 8. ")
        + plan.describe())
