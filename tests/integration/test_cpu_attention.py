"""Attention on the CPU (worker/cpu_attention.py): a long pass's query rows split over CPU
streams, and a decode step's grouped heads folded onto their key heads, compute what MLX's one
call computes, for every mask form the model families pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from switchyard.worker import cpu_attention
from switchyard.worker.cpu_attention import query_splits, split_attention

WHOLE = mx.fast.scaled_dot_product_attention


@pytest.fixture(scope="module")
def streams():
    return tuple(mx.new_stream(mx.cpu) for _ in range(3))


def counted(calls):
    def whole(*args, **kwargs):
        calls.append(kwargs.get("stream"))
        return WHOLE(*args, **kwargs)
    return whole


def qkv(batch, heads, kv_heads, queries, keys, dim=32, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, queries, dim)),
            mx.random.normal((batch, kv_heads, keys, dim)),
            mx.random.normal((batch, kv_heads, keys, dim)))


@pytest.mark.parametrize("queries,keys,parts", [(150, 4250, 2), (300, 300, 2), (97, 700, 3),
                                                (64, 64, 3)])
def test_query_splits_cover_the_rows_in_parts_of_about_equal_work(queries, keys, parts):
    for causal in (True, False):
        cuts = query_splits(queries, keys, parts, causal)
        assert cuts[0] == 0 and cuts[-1] == queries and len(cuts) == parts + 1
        assert all(a < b for a, b in zip(cuts, cuts[1:]))
        work = [(b - a) * ((keys - queries + b) if causal else keys)
                for a, b in zip(cuts, cuts[1:])]
        # within one row's work of equal
        assert max(work) - min(work) <= 2 * keys, (causal, cuts, work)
    assert query_splits(1, 10, 2, True) == [0, 1]  # never more parts than rows


@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "additive", "shared"])
@pytest.mark.parametrize("queries,keys", [(96, 1500), (256, 256)])
def test_split_attention_equals_one_call(streams, mask_kind, queries, keys, monkeypatch):
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 1)
    q, k, v = qkv(2, 6, 2, queries, keys)
    if mask_kind == "causal":
        mask = "causal"
    elif mask_kind == "none":
        mask = None
    else:  # rows that see different key ranges, as the decode and packed batches' masks do
        rng = np.random.default_rng(1)
        allowed = rng.random((2, 1, queries, keys)) < 0.7
        allowed[..., 0] = True
        if mask_kind == "shared":
            allowed = allowed[:, :, :1]
        mask = mx.array(allowed) if mask_kind != "additive" else \
            mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))
    calls = []
    split = split_attention(counted(calls), streams, q, k, v, scale=0.17, mask=mask)
    one = WHOLE(q, k, v, scale=0.17, mask=mask)
    assert len(calls) == len(streams) and calls == list(streams)  # each part on its stream
    assert split.shape == one.shape
    np.testing.assert_allclose(np.array(split), np.array(one), rtol=0, atol=2e-6)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("queries", [1, 4, 7])  # a decode step, verify passes
def test_a_few_queries_fold_grouped_heads_and_compute_the_same(streams, mask_kind, queries):
    q, k, v = qkv(5, 9, 3, queries, 700)
    rng = np.random.default_rng(2)
    allowed = rng.random((5, 1, queries, 700)) < 0.8  # rows at their own ends, as a batch's
    allowed[..., 0] = True
    mask = {"none": None, "causal": "causal", "bool": mx.array(allowed),
            "additive": mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))}[mask_kind]
    calls = []
    out = split_attention(counted(calls), streams, q, k, v, scale=0.2, mask=mask)
    assert calls == []  # folded, not MLX's broadcasting call
    np.testing.assert_allclose(np.array(out), np.array(WHOLE(q, k, v, scale=0.2, mask=mask)),
                               rtol=0, atol=2e-6)


def test_short_passes_sinks_and_explicit_streams_take_one_call(streams):
    q, k, v = qkv(1, 4, 4, 200, 2000)
    for args, kwargs in [((q[:, :, :1], k, v), {"mask": None}),  # decode: one row
                         ((q[:, :, :16], k[:, :, :64], v[:, :, :64]), {"mask": "causal"}),
                         ((q, k, v), {"mask": "causal", "sinks": mx.zeros((4,))}),
                         ((q, k, v), {"mask": "causal", "stream": mx.cpu})]:
        calls = []
        out = split_attention(counted(calls), streams, *args, scale=0.2, **kwargs)
        assert len(calls) == 1
        np.testing.assert_array_equal(np.array(out), np.array(WHOLE(*args, scale=0.2, **kwargs)))


def test_a_model_prefills_the_same_with_split_attention(tiny_model_dir, monkeypatch):
    """A tiny twin's prefill over a context, through mlx-lm's own attention call, with the
    split installed as the worker installs it: the same logits and KV to float32 rounding."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(tiny_model_dir(arch="qwen3", fmt="mlx")))
    tokens = mx.array([[(7 * i) % 200 + 3 for i in range(900)]])

    def prefill():
        cache = make_prompt_cache(model)
        model(tokens[:, :600], cache=cache)
        logits = model(tokens[:, 600:], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        return logits, cache

    one, one_cache = prefill()
    calls = []
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 1)
    monkeypatch.setattr(cpu_attention, "_installed", {})
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted(calls))
    assert cpu_attention.use_cpu_attention(cores=2) == 2
    split, split_cache = prefill()
    assert calls and len(calls) % 2 == 0 and all(s is not None for s in calls)
    np.testing.assert_allclose(np.array(split), np.array(one), rtol=0, atol=1e-4)
    for a, b in zip(split_cache, one_cache):
        np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), atol=1e-5)
    assert (mx.argmax(split[0], -1) == mx.argmax(one[0], -1)).all().item()
