"""KV pages out of a slot and back in: restored continuations are bit-identical."""

import mlx.core as mx
import numpy as np
import pytest
import structlog

from switchyard.proto.values import SamplingParams
from switchyard.worker.kv_layout import kv_quant
from switchyard.worker.model_loading import load_model
from switchyard.worker.page_io import PageLayout
from switchyard.worker.sampling import sample_rows
from switchyard.worker.slots import SlotError, SlotStore

P = 32


def _setup(model_dir, num_slots=2, quant=None):
    loaded = load_model(str(model_dir), quant)
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


# Every family's twin; sliding-window rings (gpt_oss, gemma: window 128) wrap within the prompt.
FAMILIES = ["qwen3", "qwen3_next", "qwen2", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
            "gpt_oss", "gemma3_text", "gemma4_text", "glm4_moe", "deepseek_v3", "deepseek_v32",
            "minimax", "mistral3"]
SNAPSHOT_FAMILIES = ["qwen3_next", "qwen3_5", "gpt_oss", "gemma3_text", "gemma4_text"]


@pytest.mark.parametrize("arch", FAMILIES)
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


@pytest.mark.parametrize("arch", ["qwen3", *SNAPSHOT_FAMILIES])
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


@pytest.mark.parametrize("reserve,stale,bits", [(0, False, 0), (5 * P, True, 0), (5 * P, True, 8)],
                         ids=["growing", "reserved-over-stale", "reserved-over-stale-q8"])
def test_restore_in_batches_continues_bit_identically(tiny_model_dir, reserve, stale, bits):
    """A restore loads batch after batch: into room the first batch reserved (here in a slot
    whose previous conversation left its buffers), or growing the slot (past KVCache.step)."""
    store, layout = _setup(tiny_model_dir("qwen3"), quant=kv_quant(bits, 64))
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


@pytest.mark.parametrize("arch, bits", [("gpt_oss", 0), ("gemma3_text", 0), ("gemma3_text", 8)])
@pytest.mark.parametrize("next_turn", [1, 7])
def test_window_snapshot_after_decode_restores_exactly(tiny_model_dir, arch, bits, next_turn):
    """A turn ended after decoding (the ring has wrapped and rotated): restored, the next turn
    (one token or a chunk) gives the same logits as the slot that stayed in memory; also with
    the full-attention layers' KV quantized (--kv-bits 8) next to the unquantized rings."""
    store, layout = _setup(tiny_model_dir(arch), quant=kv_quant(bits, 64))
    prompt = [int(t) for t in np.random.default_rng(2).integers(5, 3000, 3 * P + 5)]
    _prefill(store, 0, prompt[:-1], P)
    _continue(store, 0, prompt[-1], n=2 * P + 3)  # past the window: the ring rotates
    held = list(store.tokens[0])
    full = len(held) // P
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(full + 1)]
    for k in range(full):
        layout.stage(store.parked(0), k * P, buffers[k], with_state=False)
    layout.stage(store.parked(0), full * P, buffers[full], with_state=True,
                 num_tokens=len(held) - full * P)
    turn = list(range(40, 40 + next_turn))
    if turn[:-1]:
        store.prefill(0, len(held), turn[:-1])
    ref_tokens, ref_logits = _continue(store, 0, turn[-1])

    cache = store.loaded(1, 0, held)
    layout.load(cache, 0, buffers, with_state=True, num_tokens=len(held))
    if turn[:-1]:
        store.prefill(1, len(held), turn[:-1])
    got_tokens, got_logits = _continue(store, 1, turn[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


def _address(a) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def _two_staged(model_dir, seed, length):
    """A 3-slot store and two random conversations x and y of `length` tokens; the first 4
    pages of each were prefilled in slot 0 and staged: buffers["x"], buffers["y"]."""
    store, layout = _setup(model_dir, num_slots=3)
    rng = np.random.default_rng(seed)
    x, y = ([int(t) for t in rng.integers(5, 3000, length)] for _ in range(2))
    buffers = {}
    for name, conv in (("x", x), ("y", y)):
        _prefill(store, 0, conv[:4 * P], P)
        buffers[name] = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(4)]
        for k in range(4):
            layout.stage(store.parked(0), k * P, buffers[name][k], with_state=False)
    return store, layout, x, y, buffers


def test_next_restore_writes_into_the_arrays_a_restore_allocated(tiny_model_dir):
    """One copy per byte and no new memory: a slot restored once (then prefilled in place)
    takes its next restore into the same arrays, and continues exactly."""
    store, layout, x, y, buffers = _two_staged(tiny_model_dir("qwen3"), seed=4,
                                               length=4 * P + 9)
    _prefill(store, 2, y[:4 * P], P)
    store.prefill(2, 4 * P, y[4 * P:-1])
    ref_tokens, ref_logits = _continue(store, 2, y[-1])

    layout.load(store.loaded(1, 0, x[:4 * P]), 0, buffers["x"], with_state=False,
                num_tokens=4 * P, reserve=2 * P)
    store.prefill(1, 4 * P, x[4 * P:-1])
    before = [_address(a) for c in store.parked(1) for a in (c.keys, c.values)]
    layout.load(store.loaded(1, 0, y[:4 * P]), 0, buffers["y"], with_state=False,
                num_tokens=4 * P)
    assert [_address(a) for c in store.parked(1) for a in (c.keys, c.values)] == before
    store.prefill(1, 4 * P, y[4 * P:-1])
    got_tokens, got_logits = _continue(store, 1, y[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


def test_restore_in_place_spares_a_prefix_copied_from_the_slot(tiny_model_dir):
    """A restore writes into the slot's own arrays in place; a prefix copied out of the slot
    may share them (a full array copies as itself), so a later restore must leave it be."""
    store, layout, x, y, buffers = _two_staged(tiny_model_dir("qwen3"), seed=3,
                                               length=8 * P + 1)
    _prefill(store, 2, x[:-1], P)
    ref_tokens, ref_logits = _continue(store, 2, x[-1])

    # x restored into slot 1 with room for exactly 8 pages, then prefilled to fill it.
    capacity = 8 * P
    assert capacity % 256 == 0  # KVCache.step: the load allocates exactly this
    layout.load(store.loaded(1, 0, x[:4 * P]), 0, buffers["x"], with_state=False,
                num_tokens=4 * P, reserve=capacity - 4 * P - 1)
    for s in range(4 * P, 8 * P, P):
        store.prefill(1, s, x[s:s + P])  # the slot's arrays are full now
    store.copy_prefix(1, 0, 8 * P)
    layout.load(store.loaded(1, 0, y[:4 * P]), 0, buffers["y"], with_state=False,
                num_tokens=4 * P)
    got_tokens, got_logits = _continue(store, 0, x[-1])
    assert got_tokens == ref_tokens
    assert np.array_equal(got_logits, ref_logits)


def test_whole_ring_copies_to_another_slot(tiny_model_dir):
    """A sliding-window slot cannot be cut back, but it can be copied whole."""
    store, _ = _setup(tiny_model_dir("gpt_oss"), num_slots=2)
    _prefill(store, 0, list(range(10, 10 + 5 * P)), P)  # 160 tokens: the 128-ring has wrapped
    _continue(store, 0, 3, n=5)
    store.copy_prefix(0, 1, len(store.tokens[0]))
    a, la = _continue(store, 0, 6)
    b, lb = _continue(store, 1, 6)
    assert a == b and np.array_equal(la, lb)
    with pytest.raises(SlotError):
        store.copy_prefix(0, 1, P)


def test_cache_kind_without_pages_still_serves_and_copies(tiny_model_dir):
    """A layer cache kind paging does not know (here mlx-lm's ChunkedKVCache): the start-up
    line says paging is off and why; slots still serve, are reused whole and copied."""
    from mlx_lm.models.cache import ChunkedKVCache
    from structlog.testing import capture_logs

    from switchyard.common.settings import Settings
    from switchyard.worker.service import page_layout

    loaded = load_model(str(tiny_model_dir("qwen3")))
    loaded.make_cache = lambda: [ChunkedKVCache(4096) for _ in loaded.model.layers]
    with capture_logs() as logs:
        layout, paging = page_layout(loaded, Settings(page_size=P), structlog.get_logger())
    assert layout is None
    assert paging.startswith("off: ChunkedKVCache layers cannot be stored as pages")
    assert logs[0]["event"] == "kv.paging_unsupported"

    store = SlotStore(loaded.model, loaded.make_cache, 2, 2048)
    assert not store.trimmable
    _prefill(store, 0, list(range(10, 10 + 3 * P)), P)
    store.copy_prefix(0, 1, 3 * P)
    a, la = _continue(store, 0, 6)
    b, lb = _continue(store, 1, 6)
    assert a == b and np.array_equal(la, lb)


def test_ring_slots_decode_batched_as_alone(tiny_model_dir):
    """Two sliding-window slots decoding in one batch (mlx-lm's BatchRotatingKVCache) give the
    tokens each gives alone, past the point where their rings wrap."""
    loaded = load_model(str(tiny_model_dir("gpt_oss")))
    prompts = [list(range(100, 190)), list(range(300, 420))]

    def run(batched: bool) -> list[list[int]]:
        store = SlotStore(loaded.model, loaded.make_cache, 2, 2048)
        out = []
        for slot, prompt in enumerate(prompts):
            store.prefill(slot, 0, prompt[:-1])
            out.append([prompt[-1]])
        for i in range(48):
            groups = [[0, 1]] if batched else [[0], [1]]
            for slots in groups:
                logits = store.decode(slots, [len(store.tokens[s]) for s in slots],
                                      [out[s][-1] for s in slots])
                for s, tok in zip(slots, sample_rows(logits, [SamplingParams()] * len(slots),
                                                     [i] * len(slots))):
                    out[s].append(tok)
        return out

    assert run(batched=True) == run(batched=False)
