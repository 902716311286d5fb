"""Quantized KV (--kv-bits): pages carry the packed form and restore bit-identically; copies
and batch rows keep it exactly; a group size that does not fit is refused."""

import mlx.core as mx
import numpy as np
import pytest

from switchyard.proto.values import SamplingParams
from switchyard.worker.batch_kv import BatchQuantizedKV
from switchyard.worker.kv_layout import kv_quant, token_arrays
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.model_loading import load_model
from switchyard.worker.page_io import PageLayout
from switchyard.worker.sampling import sample_rows
from switchyard.worker.slots import SlotStore

P = 32


def _setup(model_dir, bits, num_slots=2):
    loaded = load_model(str(model_dir), kv_quant(bits, 64))
    store = SlotStore(loaded.model, loaded.make_cache, num_slots, 2048)
    probe = loaded.make_cache()
    loaded.model(mx.array([[1]]), cache=probe)
    return loaded, store, PageLayout(probe, P)


def _prefill(store, slot, tokens, start=0):
    for s in range(0, len(tokens), P):
        store.prefill(slot, start + s, tokens[s:s + P])


def _greedy(store, slots, first, n=10):
    """n greedy tokens per slot, decoded together; and the logits of the first step."""
    out, toks, first_logits = [[] for _ in slots], [first] * len(slots), None
    for i in range(n):
        logits = store.decode(slots, [len(store.tokens[s]) for s in slots], toks)
        if first_logits is None:
            first_logits = np.array(logits)
        toks = sample_rows(logits, [SamplingParams()] * len(slots), [i] * len(slots))
        for row, tok in zip(out, toks):
            row.append(tok)
    return out, first_logits


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_restored_quantized_pages_continue_bit_identically(tiny_model_dir, arch, bits):
    loaded, store, layout = _setup(tiny_model_dir(arch), bits)
    prompt = [int(t) for t in np.random.default_rng(2).integers(5, 3000, 3 * P + 9)]
    _prefill(store, 0, prompt[:-1])  # three full pages and a tail of 8
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(4)]
    for k in range(3):
        layout.stage(store.parked(0), k * P, buffers[k], with_state=False)
    layout.stage(store.parked(0), 3 * P, buffers[3], with_state=True, num_tokens=8)
    ref_tokens, ref_logits = _greedy(store, [0], prompt[-1])

    cache = store.loaded(1, 0, prompt[:-1])
    layout.load(cache, 0, buffers, with_state=True, num_tokens=3 * P + 8)
    got_tokens, got_logits = _greedy(store, [1], prompt[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


@pytest.mark.parametrize("bits", [8, 4])
def test_payload_is_the_packed_form(tiny_model_dir, bits):
    """A page holds packed values, scales and biases as the slot holds them, never
    dequantized, and is sized by the quantized bytes per token."""
    loaded, store, layout = _setup(tiny_model_dir("qwen3"), bits)
    assert layout.payload_len(P, with_state=False) == P * loaded.kv_bytes_per_token
    assert loaded.kv_bytes_per_token == 4 * 2 * 2 * (64 * bits // 8 + 4 + 4)  # f32 scale+bias
    _prefill(store, 0, list(range(1, 2 * P + 1)))
    buf = np.zeros(layout.buffer_bytes, np.uint8)
    layout.stage(store.parked(0), P, buf, with_state=False)
    offset = 0
    for a in token_arrays(store.parked(0)[0]):  # layer 0: K packed, scales, biases, then V
        held = np.array(a[0, :, P:2 * P, :])
        assert np.array_equal(buf[offset:offset + held.nbytes].view(held.dtype)
                              .reshape(held.shape), held)
        offset += held.nbytes
    assert np.array(token_arrays(store.parked(0)[0])[0]).dtype == np.uint32


def test_batch_rows_are_the_slots_exactly(tiny_model_dir):
    """Decoding slots together (their quantized KV merged into one batch) gives each slot the
    tokens it gets alone, and splitting the batch gives back each slot's arrays."""
    _, store, _ = _setup(tiny_model_dir("qwen3"), 8, num_slots=4)
    prompts = [list(range(10, 10 + 2 * P + 5)), list(range(500, 500 + P + 3))]
    for slot, prompt in enumerate(prompts):
        _prefill(store, slot, prompt)
        _prefill(store, slot + 2, prompt)
    together, _ = _greedy(store, [0, 1], 7)
    alone = [_greedy(store, [2], 7)[0][0], _greedy(store, [3], 7)[0][0]]
    assert together == alone
    parked = [store.parked(s)[0] for s in (0, 1)]
    batch = BatchQuantizedKV.merge(parked)
    for row, cache in enumerate(parked):
        back = batch.extract(row)
        assert back.offset == cache.offset
        for a, b in zip(token_arrays(back), token_arrays(cache)):
            assert np.array_equal(np.array(a), np.array(b[..., :cache.offset, :]))


def test_copied_quantized_prefix_continues_like_a_fresh_prefill(tiny_model_dir):
    _, store, _ = _setup(tiny_model_dir("qwen3"), 8, num_slots=3)
    shared = list(range(10, 10 + 3 * P))
    _prefill(store, 0, shared + [7, 8, 9])
    store.copy_prefix(0, 1, len(shared))
    store.prefill(1, len(shared), [4, 5])
    _prefill(store, 2, shared)
    store.prefill(2, len(shared), [4, 5])
    a, la = _greedy(store, [1], 6)
    b, lb = _greedy(store, [2], 6)
    assert a == b and np.array_equal(la, lb)


def test_group_size_that_does_not_divide_the_heads_is_refused(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="--kv-group-size 128 does not divide the "
                                             "attention head dimension 64; use 32 or 64"):
        load_model(str(tiny_model_dir("qwen3")), kv_quant(8, 128))


def test_quantized_kv_rotates_and_centres_keys_without_changing_attention(tiny_model_dir):
    """With --kv-bits every RoPE is followed by a Hadamard rotation of queries and keys, and
    keys lose their layer's mean key: the cache holds rotated, centred keys (what is
    quantized), attention gives what it gave (dot products are kept; a shift of every key
    moves a query's scores by a constant), and the KV form names both (pages of other keys
    never match)."""
    from mlx_lm.models.cache import make_prompt_cache

    from switchyard.worker.kv_layout import RotatedRoPE, hadamard

    h = hadamard(64)
    assert mx.allclose(h @ h, mx.eye(64), atol=1e-6)
    plain = load_model(str(tiny_model_dir("qwen3")))
    rotated = load_model(str(tiny_model_dir("qwen3")), kv_quant(8, 64))
    centre = rotated.kv_quant.centre
    assert rotated.kv_quant.rotated and len(centre) == 8
    assert rotated.kv_quant.tag == f"q8g64-hc{centre}"
    again = load_model(str(tiny_model_dir("qwen3")), kv_quant(4))
    assert again.kv_quant.centre == centre  # the same mean on every start: pages still match
    assert again.kv_quant.group_size == 32  # 4 bits: the finer groups, by default
    ropes = [m for _, m in rotated.model.named_modules() if isinstance(m, RotatedRoPE)]
    assert len(ropes) == len(rotated.model.layers)
    tokens = mx.array([[int(t) for t in np.random.default_rng(3).integers(5, 3000, 40)]])
    caches = [make_prompt_cache(plain.model), make_prompt_cache(rotated.model)]
    want = plain.model(tokens, cache=caches[0])
    got = rotated.model(tokens, cache=caches[1])  # float caches: only the rotation differs
    assert mx.allclose(got, want, atol=1e-3, rtol=1e-4)
    shift = rotated.model.layers[0].self_attn.rope._key_shift
    keys = caches[1][0].keys[..., :40, :] + shift
    assert mx.allclose(keys @ h, caches[0][0].keys[..., :40, :], atol=1e-4)
    assert float(mx.abs(shift).max()) > 0


def test_keys_are_not_centred_where_scores_are_not_shift_invariant(tiny_model_dir):
    """gpt-oss's attention sinks take part in the softmax without a key: shifting every key
    would change attention, which the check at load sees, so its keys are only rotated."""
    loaded = load_model(str(tiny_model_dir("gpt_oss")), kv_quant(8, 32))
    assert loaded.kv_quant.rotated and loaded.kv_quant.centre == ""
