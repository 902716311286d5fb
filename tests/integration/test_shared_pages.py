"""Idle slots shelved as shared pages (worker/shared_pages.py; docs/design/kv-pages.md "Shared
pages in memory"): siblings hold their common prefix once, and whatever a shelved slot is used
for next (a decode, a cut-back, a copy, a stage, a batch) gives the same tokens, logits and
page bytes as the slot never shelved."""

import mlx.core as mx
import numpy as np
import pytest

from tests.integration.test_page_io import P, _continue, _prefill, _setup


def _siblings(store, prefix_pages=4, own=(9, 21, 40)):
    """Slots 0.. holding one shared prefix of `prefix_pages` pages and tokens of their own."""
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(5, 3000, prefix_pages * P)]
    prompts = [prefix + [int(t) for t in rng.integers(5, 3000, n)] for n in own]
    for slot, prompt in enumerate(prompts):
        _prefill(store, slot, prompt, 3 * P)
    return prompts


# Attention only; a hybrid (gated delta: recurrent states) and a sliding-window family (rings
# of 128, wrapped by these prompts), whose attention layers alone are shelved.
ATTENTION_ONLY, WITH_STATE = ["qwen3", "llama"], ["qwen3_5", "gpt_oss"]


def _store(tiny_model_dir, arch):
    store, layout = _setup(tiny_model_dir(arch), num_slots=4)
    assert store.share_pages(P)
    return store, layout


@pytest.fixture(params=ATTENTION_ONLY + WITH_STATE)
def store_layout(request, tiny_model_dir):
    return _store(tiny_model_dir, request.param)


@pytest.fixture(params=ATTENTION_ONLY)
def attention_store(request, tiny_model_dir):
    return _store(tiny_model_dir, request.param)


@pytest.fixture(params=WITH_STATE)
def state_store(request, tiny_model_dir):
    return _store(tiny_model_dir, request.param)


def test_siblings_hold_their_prefix_once_and_continue_as_if_never_shelved(store_layout):
    store, layout = store_layout
    prompts = _siblings(store)
    want = [_continue(store, s, 17, n=6) for s in range(3)]
    for s in range(3):  # back to the prompts, as the next turns would find them
        store.truncate(s, len(prompts[s]))
    per_token = store.kv_bytes_per_token()
    mx.synchronize()
    before = mx.get_active_memory()
    for s in range(3):
        store.shelve(s)
    pool = store._parked.pool
    # 4 shared pages, then each slot's own: 9 and 21 tokens are tails, 40 is a page and a tail.
    assert pool.num_pieces == 4 + 1
    mx.synchronize()
    # Two copies of the prefix are gone, and each slot's room to grow.
    assert before - mx.get_active_memory() >= 2 * 4 * P * per_token
    for s in range(3):
        got_tokens, got_logits = _continue(store, s, 17, n=6)
        assert got_tokens == want[s][0]
        assert np.array_equal(got_logits, want[s][1])
    assert pool.num_pieces == 0  # each slot whole again: no piece is held


def test_a_shelved_slot_stages_copies_and_cuts_back_where_it_lies(attention_store):
    store, layout = attention_store
    prompts = _siblings(store, own=(2 * P + 5, 3))
    staged = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(2)]
    layout.stage(store.stage_source(0), 2 * P, staged[0], with_state=False)
    layout.stage(store.stage_source(0), 6 * P, staged[1], with_state=False, num_tokens=5)
    store.shelve(0)
    store.shelve(1)
    for k, (start, count) in enumerate([(2 * P, 0), (6 * P, 5)]):
        again = np.zeros_like(staged[k])
        layout.stage(store.stage_source(0), start, again, with_state=False, num_tokens=count)
        assert np.array_equal(again, staged[k])
    assert store._parked.is_shelved(0)  # a read leaves it shelved

    store.copy_prefix(0, 2, 5 * P + 3)  # a sibling from a shelved slot: it stays shelved
    assert store._parked.is_shelved(0)
    store.truncate(0, 5 * P + 3)  # the shelved slot cut back: made whole, that much only
    assert not store._parked.is_shelved(0) and len(store.tokens[0]) == 5 * P + 3
    assert store._parked.is_shelved(1)
    a = _continue(store, 0, prompts[0][5 * P + 3], n=5)
    b = _continue(store, 2, prompts[0][5 * P + 3], n=5)
    assert a[0] == b[0] and np.array_equal(a[1], b[1])

    store.release(1)  # its pieces go with it
    assert store._parked.pool.num_pieces == 0


@pytest.mark.parametrize("shelved_first", [False, True])
def test_a_cut_slot_keeps_its_front_and_continues_once_its_end_is_loaded(store_layout,
                                                                         shelved_first):
    """RunStep.cuts (docs/design/kv-pages.md "Cut slots"): the slot keeps its first pages,
    shelved; its end, staged before, loaded back after them, it continues as if never cut.
    With a recurrent state or a ring, the state at the cut is void: the tail brings it."""
    store, layout = store_layout
    prompts = _siblings(store, own=(2 * P + 5, 3))
    end = len(prompts[0])
    state = not store.trimmable
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(2)]  # a page, a tail
    for k, start in enumerate(range(5 * P, end, P)):
        last = start + P >= end
        layout.stage(store.state_at(0, end) if state and last else store.stage_source(0), start,
                     buffers[k], with_state=state and last, num_tokens=min(P, end - start) % P)
    want = _continue(store, 0, 17, n=6)
    store.truncate(0, end)
    if shelved_first:
        store.shelve(0)
        store.shelve(1)
    store.release(0, keep=5 * P)
    assert store._parked.is_shelved(0) and store.tokens[0] == prompts[0][:5 * P]
    # The prefix's 4 pieces (held by slot 1 too when shelved) and slot 0's own fifth page.
    assert store._parked.pool.num_pieces == 5
    cache = store.loaded(0, 5 * P, prompts[0][5 * P:])
    layout.load(cache, 5 * P, buffers, with_state=state, num_tokens=end - 5 * P)
    got = _continue(store, 0, 17, n=6)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_shelved_slots_join_a_decode_batch(store_layout):
    store, _ = store_layout
    prompts = _siblings(store)
    alone = []
    for s in range(3):
        alone.append(_continue(store, s, 17, n=4)[0])
        store.truncate(s, len(prompts[s]))
    for s in range(3):
        store.shelve(s)
    rows, tok = [[] for _ in range(3)], [17, 17, 17]
    for _ in range(4):
        logits = store.decode([0, 1, 2], [len(store.tokens[s]) for s in range(3)], tok)
        tok = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
        for row, t in zip(rows, tok):
            row.append(t)
    assert rows == alone


def test_a_shelved_slot_with_state_stages_copies_and_goes_back_to_its_mark(state_store):
    """A hybrid or window slot shelved: its pages staged with the state at its end and at its
    mark, a copy of it whole, and the slot cut back to its mark, all as if never shelved."""
    store, layout = state_store
    prompts = _siblings(store, own=(2 * P + 5, 3))
    n = len(prompts[0])
    ref = _continue(store, 0, 17, n=5)
    end = len(store.tokens[0])
    pages = [(6 * P, n - 6 * P), (6 * P, end - 6 * P)]  # the tail at the mark, at the end
    ends = [n, end]
    staged = []
    for (start, count), at in zip(pages, ends):
        staged.append(np.zeros(layout.buffer_bytes, np.uint8))
        layout.stage(store.state_at(0, at), start, staged[-1], with_state=True, num_tokens=count)
    store.shelve(0)
    store.shelve(1)
    for k, ((start, count), at) in enumerate(zip(pages, ends)):
        again = np.zeros_like(staged[k])
        layout.stage(store.state_at(0, at), start, again, with_state=True, num_tokens=count)
        assert np.array_equal(again, staged[k]), at
    assert store._parked.is_shelved(0)

    store.copy_prefix(0, 2, end)  # whole, with the state at its end: it stays shelved
    assert store._parked.is_shelved(0)
    whole = _continue(store, 2, 99, n=4)
    store.truncate(0, n)  # back to the mark: made whole there
    assert not store._parked.is_shelved(0)
    again = _continue(store, 0, 17, n=5)
    assert again[0] == ref[0] and np.array_equal(again[1], ref[1])
    store.truncate(0, end)
    assert _continue(store, 0, 99, n=4)[0] == whole[0]


def test_a_lone_slot_does_not_shelve(tiny_model_dir):
    store, _ = _setup(tiny_model_dir("qwen3"), num_slots=1)
    assert not store.share_pages(P)
