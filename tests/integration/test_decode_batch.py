"""The decode batch as rows join and leave (worker/slots.py `_regroup`, BatchKV.regroup).

Agents' requests join the batch when their prefill ends and leave it when their reply does;
the rows that stay are moved within the batch, not split out and merged again. The same
sequence of steps with the batch rebuilt at every change must give the same logits and leave
the same KV in every slot, bit for bit: regrouping only copies rows.
"""

import mlx.core as mx
import numpy as np
import pytest

from switchyard.worker.kv_layout import kv_quant, token_arrays
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore

P = 32
# (slots decoding together) per step: rows leave, join, change order, and a sibling in the
# batch is copied from (None: copy slot 3's first 40 tokens into slot 6, then prefill it).
STEPS = [(0, 1, 2, 3), (0, 1, 2, 3), (0, 2, 3), (0, 2, 3, 4), (4, 0, 3), None,
         (0, 3, 4, 6), (3, 6), (5, 0, 3, 6, 1)]


def _run(model_dir, bits, regroup: bool):
    loaded = load_model(str(model_dir), kv_quant(bits, 64) if bits else None)
    store = SlotStore(loaded.model, loaded.make_cache, 8, 2048)
    if not regroup:
        store._regroupable = lambda slots: False
    for slot in range(6):
        prompt = [(31 * slot + 7 * i) % 500 + 10 for i in range(P + 5 * slot + 3)]
        for s in range(0, len(prompt), P):
            store.prefill(slot, s, prompt[s:s + P])
    logits, regrouped = [], 0
    for step in STEPS:
        if step is None:
            store.copy_prefix(3, 6, 40)
            store.prefill(6, 40, [11, 12, 13])
            continue
        before = store._batch
        out = store.decode(list(step), [len(store.tokens[s]) for s in step],
                           [(5 * s + len(store.tokens[s])) % 400 + 20 for s in step])
        regrouped += before is not None and store._batch is not before
        logits.append(np.array(out))
    store._unbatch()
    kv = {s: [np.array(a) for a in token_arrays(store.parked(s)[0])] for s in range(7)}
    return logits, kv, store.tokens, regrouped


@pytest.mark.parametrize("bits", [None, 8])
def test_rows_joining_and_leaving_give_what_a_rebuilt_batch_gives(tiny_model_dir, bits):
    model_dir = tiny_model_dir("qwen3")
    logits, kv, tokens, regrouped = _run(model_dir, bits, regroup=True)
    logits_rebuilt, kv_rebuilt, tokens_rebuilt, _ = _run(model_dir, bits, regroup=False)
    assert regrouped >= 4, "the batch changed by regrouping, not by rebuilding"
    assert tokens == tokens_rebuilt
    for ours, theirs in zip(logits, logits_rebuilt):
        assert np.array_equal(ours, theirs)
    for slot in kv:
        for ours, theirs in zip(kv[slot], kv_rebuilt[slot]):
            assert np.array_equal(ours, theirs[..., :ours.shape[2], :]), slot


def test_a_regrouped_row_is_the_slot_it_came_from(tiny_model_dir):
    """Rows kept, reordered and joined come out of the batch as the caches that went in."""
    from mlx_lm.models.cache import KVCache

    from switchyard.worker.batch_kv import BatchKV

    caches = []
    for n in (5, 300, 17, 64):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
        caches.append(c)
    batch = BatchKV.merge(caches[:3])
    again = batch.regroup([2, caches[3], 0])
    assert again.ends == [17, 64, 5]
    for row, cache in enumerate([caches[2], caches[3], caches[0]]):
        back = again.extract(row)
        assert np.array_equal(np.array(back.keys), np.array(cache.keys[..., :cache.offset, :]))
        assert np.array_equal(np.array(back.values),
                              np.array(cache.values[..., :cache.offset, :]))


def test_the_batch_changes_one_layer_at_a_time_and_keeps_nothing_old(tiny_model_dir):
    """worker/slots.py `_layer_by_layer` (docs/design/kv-pages.md "Memory plan"): while the
    batch is merged, regrouped and split, both forms of at most one layer exist, and
    afterwards only the new form does (a row taken out lazily kept the whole old batch
    alive: 3.07 layers more at its peak)."""
    loaded = load_model(str(tiny_model_dir("qwen3")), None)
    store = SlotStore(loaded.model, loaded.make_cache, 4, 4096)
    for slot in range(4):
        prompt = [(31 * slot + 7 * i) % 500 + 10 for i in range(1500)]
        for s in range(0, len(prompt), 500):
            store.prefill(slot, s, prompt[s:s + 500])
    kv = sum(a.nbytes for s in range(4) for c in store.parked(s) for a in token_arrays(c))
    layer = kv / len(store.parked(0))

    def change(step):
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        if step is None:
            store._unbatch()
        else:
            mx.eval(store.decode(list(step), [len(store.tokens[s]) for s in step],
                                 [20] * len(step)))
        return mx.get_peak_memory() - before, mx.get_active_memory() - before

    # One layer in both forms: the batch's layer is a little wider than the slots' (room for
    # the next tokens), and the step's activations come on top.
    for step in [(0, 1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (1, 3), None]:
        peak, kept = change(step)
        assert peak < 1.5 * layer, (step, peak / layer)
        assert abs(kept) < 0.1 * layer, (step, kept / layer)
