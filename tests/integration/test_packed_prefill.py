"""Packed prefill (docs/design/scheduling.md "Packed prefill"): several slots' chunks of one step as rows
of one forward pass leave every slot with the KV and recurrent state a pass per chunk leaves,
and the same greedy tokens after; families whose caches do not allow it keep a pass per chunk.
In process, two executors on one model: --packed-prefill on and off.

Equal to float32 rounding, not bit for bit: a packed row attends over the batch's columns, its
own plus masked ones up to the longest row, and the CPU attention kernel's sums over that axis
round differently with its length (the decode batch has the same property); tokens are equal."""

import mlx.core as mx
import pytest

from switchyard.twins.models import TEXT_ARCHS
from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.worker.cache_kinds import leaves
from switchyard.worker.executor import StepExecutor
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from switchyard.worker.kv_layout import is_attention_kv, kv_quant, token_arrays
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore

# Slot 0 and 1 hold a conversation already (different lengths), slot 2 starts empty; the
# step's chunks are near-equal in length, so all three share one pass, two of them padded.
HISTORY = {0: [20 + (i * 37) % 900 for i in range(45)], 1: [30 + (i * 11) % 700 for i in range(70)]}
CHUNKS = {0: list(range(300, 332)), 1: list(range(400, 428)), 2: list(range(500, 530))}
# Attention KV, recurrent states (hybrids) and deepseek_v32's compound cache; not rings.
PACKED_ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3", "minimax",
                "mistral3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32"]
UNPACKED_ARCHS = sorted(set(TEXT_ARCHS) - set(PACKED_ARCHS))


def _twins(model_dir, quant=None, context_per_read=None):
    loaded = load_model(str(model_dir), quant)
    return [StepExecutor(SlotStore(loaded.model, loaded.make_cache, 4, 1024), None, None,
                         packed_prefill=packed, context_per_read=context_per_read)
            for packed in (True, False)]


def _run_history(ex):
    ex.run(RunStep(0, prefills=tuple(PrefillChunk(s, 0, tuple(t)) for s, t in HISTORY.items())))


def _chunk_step(ex, step=1):
    chunks = tuple(PrefillChunk(s, len(HISTORY.get(s, ())), tuple(t)) for s, t in CHUNKS.items())
    return ex.run(RunStep(step, prefills=chunks))


def _close(u: mx.array, v: mx.array) -> bool:
    return u.shape == v.shape and mx.allclose(u.astype(mx.float32), v.astype(mx.float32),
                                              rtol=1e-4, atol=1e-4).item()


def _assert_same_kv(a: SlotStore, b: SlotStore, slot: int):
    assert a.tokens[slot] == b.tokens[slot]
    for x, y in zip(leaves(a.parked(slot)), leaves(b.parked(slot))):
        if type(x) is ArraysCache:
            assert type(y) is ArraysCache
            assert all(_close(u, v) for u, v in zip(x.cache, y.cache))
            continue
        assert is_attention_kv(x) and x.offset == y.offset == len(a.tokens[slot])
        for u, v in zip(token_arrays(x), token_arrays(y)):
            if u.dtype == mx.uint32:  # quantized values: a rounding may move one step
                assert mx.mean(u[..., :x.offset, :] != v[..., :y.offset, :]).item() < 1e-3
            else:
                assert _close(u[..., :x.offset, :], v[..., :y.offset, :])


def _greedy(ex, slots, n=6):
    """n batched greedy decode steps of `slots`, each fed token 7 first."""
    tokens = {s: 7 for s in slots}
    out = {s: [] for s in slots}
    for i in range(n):
        items = tuple(DecodeItem(s, len(ex.store.tokens[s]), tokens[s], SamplingParams(), i)
                      for s in slots)
        for sampled in ex.run(RunStep(10 + i, decodes=items)).sampled:
            out[sampled.slot].append(sampled.token_id)
            tokens[sampled.slot] = sampled.token_id
    return out


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_chunks_leave_the_kv_and_tokens_of_a_pass_each(tiny_model_dir, arch):
    packed, alone = _twins(tiny_model_dir(arch))
    assert packed.packed_prefill and not alone.packed_prefill
    for ex in (packed, alone):
        _run_history(ex)
    done_packed, done_alone = _chunk_step(packed), _chunk_step(alone)
    assert (done_packed.num_forward_passes, done_alone.num_forward_passes) == (1, 3)
    assert (done_packed.num_prefill_passes, done_alone.num_prefill_passes) == (1, 3)
    # Padding is not counted: both computed the chunks' tokens.
    assert done_packed.num_forward_tokens == done_alone.num_forward_tokens == 90
    assert done_packed.tokens_per_pass == 90.0 and done_alone.tokens_per_pass == 30.0
    for slot in CHUNKS:
        _assert_same_kv(packed.store, alone.store, slot)
    assert _greedy(packed, [0, 1, 2]) == _greedy(alone, [0, 1, 2])


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_chunks_of_quantized_kv_equal_a_pass_each(tiny_model_dir, bits):
    packed, alone = _twins(tiny_model_dir("qwen3"), kv_quant(bits, 64))
    for ex in (packed, alone):
        _run_history(ex)
    assert _chunk_step(packed).num_forward_passes == 1
    _chunk_step(alone)
    for slot in CHUNKS:
        _assert_same_kv(packed.store, alone.store, slot)
    assert _greedy(packed, [0, 1, 2]) == _greedy(alone, [0, 1, 2])


def test_a_packed_chunk_of_a_slot_in_the_decode_batch(tiny_model_dir):
    """Slots 0 and 1 decode as one batch; slot 1's next turn and slot 2's prompt then prefill
    packed while slot 0 keeps decoding: all three continue as with a pass per chunk."""
    packed, alone = _twins(tiny_model_dir("qwen3"))
    for ex in (packed, alone):
        _run_history(ex)
        _greedy(ex, [0, 1], n=2)
        chunks = (PrefillChunk(1, len(ex.store.tokens[1]), tuple(range(600, 620))),
                  PrefillChunk(2, 0, tuple(range(700, 718))))
        item = DecodeItem(0, len(ex.store.tokens[0]), 9, SamplingParams(), 2)
        done = ex.run(RunStep(20, decodes=(item,), prefills=chunks))
        # One decode pass, then one prefill pass packed or two alone.
        assert done.num_forward_passes == (2 if ex is packed else 3)
        assert done.num_prefill_passes == (1 if ex is packed else 2)
    for slot in (0, 1, 2):
        _assert_same_kv(packed.store, alone.store, slot)
    assert _greedy(packed, [0, 1, 2]) == _greedy(alone, [0, 1, 2])


def test_chunks_of_very_different_lengths_run_apart(tiny_model_dir):
    packed, _ = _twins(tiny_model_dir("qwen3"))
    chunks = (PrefillChunk(0, 0, tuple(range(100, 400))), PrefillChunk(1, 0, tuple(range(20, 40))),
              PrefillChunk(2, 0, tuple(range(50, 68))))
    done = packed.run(RunStep(0, prefills=chunks))
    assert done.num_forward_passes == 2  # the long chunk alone, the two short ones together
    assert done.num_forward_tokens == 338


@pytest.mark.parametrize("arch", UNPACKED_ARCHS)
def test_families_without_packing_run_a_pass_per_chunk(tiny_model_dir, arch):
    """Rings, recurrent states and compound caches: every chunk alone, as before."""
    packed, _ = _twins(tiny_model_dir(arch))
    assert not packed.store.packs_prefill and not packed.packed_prefill
    _run_history(packed)
    assert _chunk_step(packed).num_forward_passes == 3


def test_a_chunk_whose_context_costs_more_to_copy_than_the_reads_saved_runs_alone(
        tiny_model_dir):
    """With a bound of 50 context tokens per weight read saved, slot 0 (45 tokens of context)
    and slot 2 (none) share a pass; slot 1 (70 more) would cost more than the second read it
    saves."""
    packed, alone = _twins(tiny_model_dir("qwen3"), context_per_read=50)
    for ex in (packed, alone):
        _run_history(ex)
    assert _chunk_step(packed).num_prefill_passes == 2
    _chunk_step(alone)
    for slot in CHUNKS:
        _assert_same_kv(packed.store, alone.store, slot)


def test_the_copy_bound_is_measured_from_the_model(tiny_model_dir):
    """Weights read per pass over twice the KV bytes of a token (worker/cpu_weights.py,
    worker/prefill_packing.py): 0 until a slot holds KV, then fixed."""
    loaded = load_model(str(tiny_model_dir("qwen3")))
    ex = StepExecutor(SlotStore(loaded.model, loaded.make_cache, 2, 1024), None, None)
    assert ex.context_per_read() == 0
    _run_history(ex)
    weights = sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    assert ex.context_per_read() == weights // (2 * loaded.kv_bytes_per_token) > 100


def test_an_mtp_head_sees_each_packed_row_as_if_prefilled_alone(tiny_model_dir):
    """With a multi-token-prediction head (worker/mtp.py) every pass hands it the final hidden
    states: a packed row's, cut to its chunk, give the head the pairs a pass per chunk gives,
    so the drafts that follow are the same."""
    from switchyard.worker.mtp import load_mtp_drafter

    runs = []
    for packed in (True, False):
        loaded = load_model(str(tiny_model_dir("qwen3_5", mtp=True)))
        drafter = load_mtp_drafter(loaded.path, loaded.config, loaded.model)
        store = SlotStore(loaded.model, loaded.make_cache, 2, 1024)
        store.attach_mtp(drafter)
        ex = StepExecutor(store, None, None, drafter=drafter, packed_prefill=packed)
        done = ex.run(RunStep(1, prefills=(PrefillChunk(0, 0, tuple(range(20, 60))),
                                           PrefillChunk(1, 0, tuple(range(100, 138))))))
        assert done.num_prefill_passes == (1 if packed else 2)
        out, inputs = [], {0: 7, 1: 7}
        for i in range(4):
            items = tuple(DecodeItem(s, len(store.tokens[s]), inputs[s], SamplingParams(), i,
                                     burst_limit=4, draft_tokens=3) for s in (0, 1))
            done = ex.run(RunStep(2 + i, decodes=items))
            for t in done.sampled:
                inputs[t.slot] = t.token_id
            out.append(([t.token_id for t in done.sampled],
                        [d.token_ids for d in done.drafts]))
        runs.append(out)
    assert runs[0] == runs[1]
    assert any(drafts for _, drafts in runs[0])
