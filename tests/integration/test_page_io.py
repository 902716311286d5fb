"""KV pages out of a slot and back in: restored continuations are bit-identical."""

import mlx.core as mx
import numpy as np
import pytest

from proto.messages import SamplingParams
from worker.model_loading import load_model
from worker.page_io import PageLayout
from worker.sampling import sample_rows
from worker.slots import SlotStore

P = 32


def _setup(model_dir, num_slots=2):
    loaded = load_model(str(model_dir))
    store = SlotStore(loaded.model, loaded.make_cache, num_slots, 2048)
    probe = loaded.make_cache()
    loaded.model(mx.array([[1]]), cache=probe)
    return store, PageLayout(probe, P)


def _prefill(store, slot, tokens, chunk):
    for s in range(0, len(tokens), chunk):
        store.prefill(slot, s, tokens[s:s + chunk])


def _continue(store, slot, first, n=12):
    """Greedy decode n tokens; returns (tokens, logits of the first step)."""
    out, tok, first_logits = [], first, None
    for i in range(n):
        logits = store.decode([slot], [len(store.tokens[slot])], [tok])
        if first_logits is None:
            first_logits = np.array(logits)
        tok = sample_rows(logits, [SamplingParams()], [i])[0]
        out.append(tok)
    return out, first_logits


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_restored_pages_continue_bit_identically(tiny_model_dir, arch):
    store, layout = _setup(tiny_model_dir(arch))
    prompt = [int(t) for t in np.random.default_rng(0).integers(5, 3000, 4 * P + 9)]
    # Reference: prefill 4 pages, then the rest, in memory (same chunk split as the restore).
    _prefill(store, 0, prompt[:4 * P], P)
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(4)]
    for k in range(4):
        # Hybrid state exists only at the slot's end: stage the last page with it.
        layout.stage(store.parked(0), k * P, buffers[k], with_state=(k == 3))
    store.prefill(0, 4 * P, prompt[4 * P:-1])
    ref_tokens, ref_logits = _continue(store, 0, prompt[-1])

    cache = store.loaded(1, 0, prompt[:4 * P])
    layout.load(cache, 0, buffers, with_state=bool(layout.state_layers), num_tokens=4 * P)
    store.prefill(1, 4 * P, prompt[4 * P:-1])
    got_tokens, got_logits = _continue(store, 1, prompt[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


def test_copy_prefix_then_diverge(tiny_model_dir):
    store, _ = _setup(tiny_model_dir("qwen3"), num_slots=3)
    shared = list(range(10, 10 + 3 * P))
    _prefill(store, 0, shared + [7, 8, 9], P)
    store.copy_prefix(0, 1, len(shared))
    assert store.tokens[1] == shared
    store.prefill(1, len(shared), [4, 5])
    _prefill(store, 2, shared + [4, 5], P)
    a, la = _continue(store, 1, 6)
    b, lb = _continue(store, 2, 6)
    assert a == b and np.array_equal(la, lb)


def test_stage_reads_slot_as_left_by_previous_step(tiny_model_dir):
    store, layout = _setup(tiny_model_dir("qwen3"))
    _prefill(store, 0, list(range(1, 2 * P + 1)), P)
    buf = np.zeros(layout.buffer_bytes, np.uint8)
    layout.stage(store.parked(0), P, buf, with_state=False)
    keys = np.array(store.parked(0)[0].keys[0, :, P:2 * P, :])
    shape = keys.shape
    assert np.array_equal(buf[:keys.nbytes].view(np.float32).reshape(shape), keys)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_tail_page_restores_exactly_where_the_turn_ended(tiny_model_dir, arch):
    store, layout = _setup(tiny_model_dir(arch))
    prompt = [int(t) for t in np.random.default_rng(1).integers(5, 3000, 2 * P + 11)]
    _prefill(store, 0, prompt[:-1], P)  # a turn ended 2 pages + 10 tokens in
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(3)]
    layout.stage(store.parked(0), 0, buffers[0], with_state=False)
    layout.stage(store.parked(0), P, buffers[1], with_state=False)
    layout.stage(store.parked(0), 2 * P, buffers[2], with_state=True, num_tokens=10)
    ref_tokens, ref_logits = _continue(store, 0, prompt[-1])

    cache = store.loaded(1, 0, prompt[:-1])
    layout.load(cache, 0, buffers, with_state=True, num_tokens=2 * P + 10)
    got_tokens, got_logits = _continue(store, 1, prompt[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


@pytest.mark.parametrize("reserve,stale", [(0, False), (5 * P, True)],
                         ids=["growing", "reserved-over-stale"])
def test_restore_in_batches_continues_bit_identically(tiny_model_dir, reserve, stale):
    """A restore loads batch after batch: into room the first batch reserved (here in a slot
    whose previous conversation left its buffers), or growing the slot (past KVCache.step)."""
    store, layout = _setup(tiny_model_dir("qwen3"))
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(5, 3000, 10 * P + 9)]
    _prefill(store, 0, prompt[:10 * P], P)
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(10)]
    for k in range(10):
        layout.stage(store.parked(0), k * P, buffers[k], with_state=False)
    store.prefill(0, 10 * P, prompt[10 * P:-1])
    ref_tokens, ref_logits = _continue(store, 0, prompt[-1])

    if stale:
        _prefill(store, 1, [int(t) for t in rng.integers(5, 3000, 12 * P)], P)
    for start in (0, 5 * P):
        cache = store.loaded(1, start, prompt[start:start + 5 * P])
        layout.load(cache, start, buffers[start // P:start // P + 5], with_state=False,
                    num_tokens=5 * P, reserve=reserve if start == 0 else 0)
        for b in buffers[start // P:start // P + 5]:
            b[:] = 0  # back to the pool after its step: the slot must not refer to it
    store.prefill(1, 10 * P, prompt[10 * P:-1])
    got_tokens, got_logits = _continue(store, 1, prompt[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)
