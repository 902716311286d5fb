"""The memory plan (docs/design/kv-pages.md "Memory plan"): what the worker needs whatever it
serves, and the KV budget left for what slots hold, planned and checked at start.

The fixed part counts weights, the largest step's activations, recurrent state and
sliding-window rings (fixed per slot), shared page buffers, a vision tower's and a draft
model's needs. What is left of the device limit minus headroom (or `--kv-memory`, if less) is
the KV budget: the scheduler keeps the KV that running requests and resident conversations
hold, plus a reserve for their growth, within it (common/held_kv.py), staging the newest
running request to disk when it runs short. KV is counted in the form the slots hold it: with
--kv-bits, packed values plus scales and biases (kv_bytes_per_token is measured on the
quantized cache). The worker refuses to start, saying which setting to lower, if one request
at full context does not fit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from switchyard.common.held_kv import SlotHold, held_tokens, running_that_fit
from switchyard.common.settings import format_size

# --max-running 0 plans for requests of this many tokens (or --ctx, if less): the agent
# traffic's sub-agents held 4-6.5K tokens each; one that outgrows it is staged to disk, never
# failed.
PLANNED_REQUEST_TOKENS = 8192


class MemoryPlanError(RuntimeError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    runtime: int  # the process before any slot: interpreter, MLX, libraries, model code
    weights: int
    recurrent: int
    activations: int
    page_buffers: int
    limit: int
    headroom: int
    kv_bytes_per_token: int  # of the slots' growing KV (attention, or a cache paging cannot see)
    ctx: int
    # A vision-language model: the encoder's kept features and its activations for the
    # largest image (worker/vision/memory.py); its weights are in `weights`.
    vision: int = 0
    # A draft model (--draft-model): its weights and its own KV for every slot at full
    # context, with its batch copy (worker/draft_model.py; never paged). An MTP head
    # (worker/mtp.py): its weights and its KV per slot.
    draft: int = 0
    kv_memory: int = 0  # --kv-memory: the most the KV budget may be (0: what is left)

    @property
    def fixed(self) -> int:
        """Everything but the KV that slots hold."""
        return (self.runtime + self.weights + self.recurrent + self.activations
                + self.page_buffers + self.vision + self.draft)

    @property
    def available(self) -> int:
        return self.limit - self.headroom

    @property
    def kv_budget(self) -> int:
        """Bytes for the KV that slots hold."""
        left = max(0, self.available - self.fixed)
        return min(left, self.kv_memory) if self.kv_memory else left

    @property
    def kv_budget_tokens(self) -> int:
        """The budget in tokens of slot KV; 0 when the slots' KV does not grow with tokens
        (nothing to count)."""
        return self.kv_budget // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

    @property
    def full_request(self) -> int:
        """Bytes of KV one request at full context may hold."""
        return held_tokens([SlotHold(self.ctx)], self.ctx) * self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        return self.fixed <= self.available and self.kv_budget >= self.full_request

    def as_fields(self) -> dict[str, int]:
        return {"runtime": self.runtime, "weights": self.weights, "recurrent": self.recurrent,
                "activations": self.activations, "page_buffers": self.page_buffers,
                "vision": self.vision, "draft": self.draft, "fixed": self.fixed,
                "kv_budget": self.kv_budget, "kv_budget_tokens": self.kv_budget_tokens,
                "full_request": self.full_request, "limit": self.limit,
                "headroom": self.headroom}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:,}" if k == "kv_budget_tokens" else f"{k} {format_size(v)}"
                          for k, v in self.as_fields().items())
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
              draft_kv_bytes_per_token: int = 0, draft_batched: bool = True,
              kv_memory: int = 0) -> MemoryPlan:
    """`draft_*`: a drafter in the worker, a draft model (whose slots are also merged into a
    batch, `draft_batched`) or an MTP head (worker/mtp.py: its KV stays per slot)."""
    # CPU attention materialises the scores of one layer: chunk x context x heads (float32),
    # next to the chunk's MLP activations and the decode logits of every slot.
    scores = prefill_chunk * ctx * num_heads * 4
    mlp = prefill_chunk * (3 * intermediate + 4 * hidden) * 4
    activations = scores + mlp + num_slots * vocab * 4 * 2
    draft_kv = num_slots * ctx * draft_kv_bytes_per_token
    draft = (draft_weights + draft_kv * (2 if num_slots > 1 and draft_batched else 1)
             if draft_weights else 0)
    return MemoryPlan(runtime=runtime, weights=weights,
                      recurrent=num_slots * recurrent_bytes_per_slot, activations=activations,
                      page_buffers=page_buffers, limit=limit, headroom=headroom,
                      kv_bytes_per_token=kv_bytes_per_token, ctx=ctx, vision=vision,
                      draft=draft, kv_memory=kv_memory)


def widest_running(plan_for: Callable[[int], MemoryPlan], slots: int, most: int) -> int:
    """--max-running 0: the most requests, at most `most` and at least `slots`, that fit the
    KV budget at a planned size (PLANNED_REQUEST_TOKENS, or --ctx if less) while they decode
    together (`plan_for(n)`: the plan with n slots; its fixed part grows a little per slot)."""
    for n in range(most, slots, -1):
        plan = plan_for(n)
        if not plan.fits:
            continue
        if not plan.kv_bytes_per_token or running_that_fit(
                plan.kv_budget_tokens, PLANNED_REQUEST_TOKENS, plan.ctx, n) >= n:
            return n
    return slots


def check_plan(plan: MemoryPlan, num_slots: int, ctx: int, kv_bits: int = 0,
               max_running: int = 0) -> None:
    """Refuse a plan where one request at full context does not fit. `num_slots`: --slots;
    `max_running`: --max-running, where it holds more slots (their fixed state counts)."""
    if plan.fits:
        return
    if plan.kv_memory and plan.kv_memory < plan.full_request:
        raise MemoryPlanError(
            f"--kv-memory {format_size(plan.kv_memory)} holds less than one request at full "
            f"context ({format_size(plan.full_request)} of KV at --ctx {ctx}). Raise "
            f"--kv-memory or lower --ctx (now {ctx}). " + plan.describe())
    need = plan.fixed + plan.full_request
    per_slot = plan.recurrent or plan.draft
    raise MemoryPlanError(
        f"the memory plan needs {format_size(need)} (weights, activations and buffers "
        f"{format_size(plan.fixed)}, and one request at full context "
        f"{format_size(plan.full_request)}) but {format_size(plan.available)} is available "
        f"({format_size(plan.limit)} device limit minus {format_size(plan.headroom)} "
        f"headroom); {format_size(need - plan.available)} too much. Lower --ctx (now {ctx}) "
        f"or --prefill-chunk"
        + ((f", or --max-running (now {max_running})" if max_running > num_slots else
            f", or --slots (now {num_slots})") if per_slot else "")
        + (", or use a smaller --draft-model" if plan.draft else "")
        + (f", or --kv-bits (now {kv_bits}). " if kv_bits == 8 else
           ". " if kv_bits else "; or quantize KV with --kv-bits 8. ")
        + plan.describe())
