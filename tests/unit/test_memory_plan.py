"""The memory plan (F7): every slot at full context is counted, and a plan that does not fit
refuses to start with a message naming what to lower."""

import dataclasses

import pytest
from switchyard.worker.memory_plan import MemoryPlanError, check_plan, make_plan

GIB = 2**30


def plan(slots=4, ctx=32768, limit=64 * GIB, page_buffers=0):
    return make_plan(runtime=100 << 20, weights=4 * GIB, kv_bytes_per_token=100_000,
                     recurrent_bytes_per_slot=0, num_slots=slots, ctx=ctx, prefill_chunk=512,
                     num_heads=32, hidden=4096, intermediate=12288, vocab=150_000,
                     page_buffers=page_buffers, limit=limit, headroom=GIB)


def test_every_slot_at_full_context_is_planned():
    one, four = plan(slots=1), plan(slots=4)
    assert four.slot_kv == 4 * one.slot_kv == 4 * 32768 * 100_000
    assert four.total > four.slot_kv + four.weights  # plus batch copy, activations, runtime


def test_a_plan_that_fits_passes():
    check_plan(plan(slots=1, ctx=8192), 1, 8192)


def test_a_plan_that_does_not_fit_refuses_and_names_the_settings():
    too_big = plan(slots=8, ctx=131072)
    with pytest.raises(MemoryPlanError) as err:
        check_plan(too_big, 8, 131072)
    message = str(err.value)
    assert "--slots (now 8)" in message and "--ctx (now 131072)" in message
    assert "memory plan:" in message and "slot_kv" in message
    with pytest.raises(MemoryPlanError, match=r"Lower --max-running \(now 8\) or --ctx"):
        check_plan(too_big, 2, 131072, max_running=8)


def test_refusal_suggests_quantized_kv_until_4_bits():
    too_big = plan(slots=8, ctx=131072)
    hints = []
    for bits in (0, 8, 4):
        with pytest.raises(MemoryPlanError) as err:
            check_plan(too_big, 8, 131072, kv_bits=bits)
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
    # Its KV for every slot at full context, and the batch copy beside it.
    assert with_draft.draft == GIB + 2 * 4 * 8192 * 10_000
    assert with_draft.total - base.total == with_draft.draft
    assert "draft " in with_draft.describe()
    too_big = dataclasses.replace(with_draft, limit=with_draft.total)
    with pytest.raises(MemoryPlanError, match="or use a smaller --draft-model"):
        check_plan(too_big, 4, 8192)


def test_max_running_zero_runs_as_many_as_the_plan_holds():
    from switchyard.worker.memory_plan import widest_running

    def plan_for(n):
        return plan(slots=n, ctx=8192)

    per_slot = plan_for(3).total - plan_for(2).total
    fits_six = dataclasses.replace(plan_for(6), limit=plan_for(6).total + GIB + per_slot // 2)

    def limited(n):
        return dataclasses.replace(plan_for(n), limit=fits_six.limit)

    assert widest_running(limited, 4, 16) == 6
    assert widest_running(limited, 4, 5) == 5, "never past the cap"
    assert widest_running(lambda n: dataclasses.replace(plan_for(n), limit=0), 4, 16) == 4, \
        "nothing fits: --slots, refused by check_plan with its advice"
