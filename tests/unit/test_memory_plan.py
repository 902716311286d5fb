"""The memory plan (docs/design/kv-pages.md "Memory plan"): what the worker needs whatever it
serves, the KV budget left for what slots hold, and a refusal naming what to lower when one
request at full context does not fit."""

import dataclasses

import pytest
from switchyard.common.held_kv import SlotHold, held_tokens, running_that_fit, slot_capacity
from switchyard.worker.memory_plan import (PLANNED_REQUEST_TOKENS, MemoryPlanError, check_plan,
                                           make_plan, widest_running)

GIB = 2**30


def plan(slots=4, ctx=32768, limit=64 * GIB, page_buffers=0, kv_memory=0):
    return make_plan(runtime=100 << 20, weights=4 * GIB, kv_bytes_per_token=100_000,
                     recurrent_bytes_per_slot=0, num_slots=slots, ctx=ctx, prefill_chunk=512,
                     num_heads=32, hidden=4096, intermediate=12288, vocab=150_000,
                     page_buffers=page_buffers, limit=limit, headroom=GIB, kv_memory=kv_memory)


def test_the_kv_budget_is_what_the_fixed_part_leaves():
    p = plan()
    assert p.fixed > p.weights + p.runtime  # plus activations
    assert p.kv_budget == 64 * GIB - GIB - p.fixed
    assert p.kv_budget_tokens == p.kv_budget // 100_000
    # Slots no longer count at full context: four slots leave the same budget, less their
    # decode logits.
    assert plan(slots=1).kv_budget - p.kv_budget == 3 * 150_000 * 4 * 2
    # --kv-memory caps it.
    assert plan(kv_memory=8 * GIB).kv_budget == 8 * GIB


def test_one_request_at_full_context_must_fit():
    p = plan(ctx=8192)
    assert p.full_request == slot_capacity(8192, 8192) * 100_000
    check_plan(p, 1, 8192)
    too_long = plan(ctx=1_000_000)  # 100 GB of KV for one request
    with pytest.raises(MemoryPlanError) as err:
        check_plan(too_long, 4, 1_000_000)
    message = str(err.value)
    assert "one request at full context" in message and "Lower --ctx (now 1000000)" in message
    assert "memory plan:" in message and "kv_budget" in message


def test_weights_alone_that_do_not_fit_are_refused():
    small = plan(ctx=8192, limit=4 * GIB)  # 4 GiB of weights, 1 GiB headroom
    assert small.kv_budget == 0
    with pytest.raises(MemoryPlanError, match=r"but 3\.0 GiB is available"):
        check_plan(small, 4, 8192)


def test_a_kv_memory_below_one_full_request_is_refused_by_name():
    with pytest.raises(MemoryPlanError, match=r"--kv-memory 1\.0 GiB holds less than one "
                                              r"request at full context"):
        check_plan(plan(ctx=32768, kv_memory=GIB), 4, 32768)


def test_refusal_suggests_quantized_kv_until_4_bits():
    too_big = plan(ctx=1_000_000)
    hints = []
    for bits in (0, 8, 4):
        with pytest.raises(MemoryPlanError) as err:
            check_plan(too_big, 8, 1_000_000, kv_bits=bits)
        hints.append(str(err.value))
    assert "quantize KV with --kv-bits 8" in hints[0]
    assert "--kv-bits (now 8)" in hints[1]
    assert "--kv-bits" not in hints[2]


def test_a_draft_model_counts_its_weights_and_its_kv_per_slot():
    base = plan(slots=4, ctx=8192)
    with_draft = make_plan(runtime=100 << 20, weights=4 * GIB, kv_bytes_per_token=100_000,
                           recurrent_bytes_per_slot=0, num_slots=4, ctx=8192,
                           prefill_chunk=512, num_heads=32, hidden=4096, intermediate=12288,
                           vocab=150_000, page_buffers=0, limit=64 * GIB, headroom=GIB,
                           draft_weights=GIB, draft_kv_bytes_per_token=10_000)
    # Its KV for every slot at full context (never paged), and the batch copy beside it.
    assert with_draft.draft == GIB + 2 * 4 * 8192 * 10_000
    assert with_draft.fixed - base.fixed == with_draft.draft
    assert "draft " in with_draft.describe()
    too_big = dataclasses.replace(with_draft, limit=with_draft.fixed + GIB)
    with pytest.raises(MemoryPlanError, match=r"or --slots \(now 4\), or use a smaller "
                                              r"--draft-model"):
        check_plan(too_big, 4, 8192)


def test_max_running_zero_runs_as_many_as_fit_at_the_planned_size():
    """Sized by what requests of a planned size hold, decoding together, not by --ctx."""
    def limited(kv_memory, ctx=65536):
        return lambda n: plan(slots=n, ctx=ctx, kv_memory=kv_memory)

    six = held_tokens([SlotHold(PLANNED_REQUEST_TOKENS, 256, True)] * 6, 65536)
    assert widest_running(limited(six * 100_000), 4, 32) == 6
    assert widest_running(limited(six * 100_000), 4, 5) == 5, "never past the cap"
    # --ctx does not enter it (the budget needs only to hold one request at full context):
    # the same at 8K as at 64K, where the old plan (every slot at full context, with its
    # batch copy) held not one.
    assert widest_running(limited(six * 100_000, ctx=8192), 4, 32) == 6
    assert six // (2 * 65536) == 0
    # Nothing fits past --slots: --slots (a plan that does not fit is refused by check_plan).
    assert widest_running(lambda n: dataclasses.replace(plan(slots=n), limit=0), 4, 16) == 4


def test_held_tokens_count_capacity_reserve_and_the_decode_batch():
    ctx = 32768
    assert held_tokens([], ctx) == 0
    one = held_tokens([SlotHold(4000)], ctx)
    assert one == slot_capacity(4000, ctx) and 4000 + 4000 // 8 < one <= 4000 + 4000 // 8 + 256
    # A running request's reserve counts as if held.
    assert held_tokens([SlotHold(4000, 1000)], ctx) == slot_capacity(5000, ctx)
    # A lone running request decodes on its own cache; two or more are also rows of one
    # batch, each as long as the longest.
    assert held_tokens([SlotHold(4000, 0, True)], ctx) == one
    pair = held_tokens([SlotHold(4000, 0, True), SlotHold(1000, 0, True)], ctx)
    assert pair == one + slot_capacity(1000, ctx) + 2 * 4096
    # Capacity never exceeds the context (a restore makes room within --ctx).
    assert slot_capacity(ctx, ctx) == ctx + 256


def test_running_that_fit():
    ctx = 32768
    per_pair = held_tokens([SlotHold(8192, 256, True)] * 2, ctx)
    assert running_that_fit(per_pair, 8192, ctx, 32) == 2
    assert running_that_fit(per_pair - 1, 8192, ctx, 32) == 1
    assert running_that_fit(10**12, 8192, ctx, 32) == 32
