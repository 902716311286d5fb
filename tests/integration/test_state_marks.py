"""A slot's state mark (worker/state_marks.py; docs/design/kv-pages.md "Exact repeats and state
marks"): a hybrid or sliding-window slot that decoded past the end of its prompt's context
goes back there, copies it and stages its page with the state there, and each continues
bit-identically to the first continuation."""

import numpy as np
import pytest

from switchyard.worker.slots import SlotError
from tests.integration.test_page_io import P, _continue, _prefill, _setup

# Recurrent layers (gated delta) and sliding windows of 128 (wrapped by the decode below).
MARKED = ["qwen3_next", "qwen3_5", "gpt_oss", "gemma3_text", "gemma4_text"]


@pytest.mark.parametrize("arch", MARKED)
def test_a_slot_goes_back_to_its_mark_copies_it_and_stages_it(tiny_model_dir, arch):
    store, layout = _setup(tiny_model_dir(arch), num_slots=3)
    assert store.keeps_marks and not store.trimmable
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 3000, 3 * P + 11)]
    context = len(prompt) - 1
    _prefill(store, 0, prompt[:-1], P)  # the mark: where the last chunk ended
    ref_tokens, ref_logits = _continue(store, 0, prompt[-1], n=132)  # past the window
    assert len(store.tokens[0]) > context + 128

    # The prompt's tail, staged after the slot moved on: its tokens with the marked state.
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(4)]
    for k in range(3):
        layout.stage(store.parked(0), k * P, buffers[k], with_state=False)
    layout.stage(store.state_at(0, context), 3 * P, buffers[3], with_state=True,
                 num_tokens=context - 3 * P)
    with pytest.raises(SlotError):
        store.state_at(0, context + 1)  # no state kept there
    with pytest.raises(SlotError):
        store.truncate(0, context + 1)

    store.copy_prefix(0, 1, context)  # a sibling slot, at the mark
    store.truncate(0, context)  # the same prompt again, in its own slot
    cache = store.loaded(2, 0, prompt[:-1])  # ...and from its pages
    layout.load(cache, 0, buffers, with_state=True, num_tokens=context)
    store.mark(2)  # as the executor does after a load with state
    for slot in (0, 1, 2):
        got_tokens, got_logits = _continue(store, slot, prompt[-1], n=8)
        assert got_tokens == ref_tokens[:8], slot
        assert np.array_equal(got_logits, ref_logits), slot
    # Each slot decoded past its mark again and goes back once more.
    store.truncate(2, context)
    assert _continue(store, 2, prompt[-1], n=4)[0] == ref_tokens[:4]


def test_a_prefill_past_the_mark_moves_it(tiny_model_dir):
    """The next turn's chunk marks its own end; the old mark is gone with it."""
    store, _ = _setup(tiny_model_dir("qwen3_5"))
    _prefill(store, 0, list(range(10, 10 + 2 * P)), P)
    store.prefill(0, 2 * P, [7, 8, 9])
    _continue(store, 0, 11, n=3)
    store.truncate(0, 2 * P + 3)
    with pytest.raises(SlotError):
        store.truncate(0, 2 * P)
    store.truncate(0, 0)  # dropped whole: the mark goes with it
    with pytest.raises(SlotError):
        store.state_at(0, 2 * P + 3)


def test_attention_only_slots_keep_no_mark(tiny_model_dir):
    store, _ = _setup(tiny_model_dir("qwen3"))
    assert not store.keeps_marks and store.trimmable


@pytest.mark.parametrize("arch", MARKED)
def test_a_restore_takes_attention_kv_from_memory_and_the_state_from_its_last_page(
        tiny_model_dir, arch):
    """A hybrid or window restore needs its state only at its end (its last page carries it):
    the attention KV before it may come from memory, a sibling's slot copied where it has no
    state (`state_follows`) or the slot itself cut back there. Both continue bit-identically
    to the slot that prefilled it all."""
    store, layout = _setup(tiny_model_dir(arch), num_slots=3)
    prompt = [int(t) for t in np.random.default_rng(5).integers(5, 3000, 5 * P + 9)]
    context = len(prompt) - 1
    _prefill(store, 0, prompt[:-1], 2 * P)
    # Its last page and its tail, staged from where its state is: the end.
    pages = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(2)]
    layout.stage(store.parked(0), 4 * P, pages[0], with_state=False)
    layout.stage(store.state_at(0, context), 5 * P, pages[1], with_state=True,
                 num_tokens=context - 5 * P)
    ref_tokens, ref_logits = _continue(store, 0, prompt[-1], n=6)
    with pytest.raises(SlotError):
        store.copy_prefix(0, 1, 4 * P)  # no state there
    store.copy_prefix(0, 1, 4 * P, state_follows=True)
    _prefill(store, 2, prompt[:5 * P], 2 * P)  # a slot with state at 5P...
    for slot in (1, 2):  # ...cut back to 4P, the load bringing the state
        cache = store.loaded(slot, 4 * P, prompt[4 * P:context])
        layout.load(cache, 4 * P, pages, with_state=True, num_tokens=context - 4 * P)
        store.mark(slot)
        got_tokens, got_logits = _continue(store, slot, prompt[-1], n=6)
        assert got_tokens == ref_tokens, slot
        assert np.array_equal(got_logits, ref_logits), slot
