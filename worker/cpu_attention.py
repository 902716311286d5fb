"""Attention on the CPU backend: long passes split over the cores, decode steps read the KV once.

MLX's CPU `scaled_dot_product_attention` is the unfused graph (scores, mask, softmax, values).
Two of its costs are the CPU's alone, and this module routes around them in the worker
(docs/design/models.md "Attention on the CPU"):
- **Its softmax runs on one thread** at about 12 ns an exponential: for 150 queries over 4.25K
  keys with SmolLM2's 9 heads, 0.09 s a layer, where both matrix products together take
  0.01 s (OpenBLAS, every core). Prefill at agent contexts is nearly all softmax, on one core.
  MLX runs each stream on a thread of its own, so a long pass's query rows are cut into one
  part per core, each on its own CPU stream over the keys it can see, and joined: prefill of
  600 tokens after 4.1K of context went from 47 to 67-72 tokens/s on this 2-core machine.
- **Grouped-query heads are broadcast**: a decode step reads each key head once per query
  head. A pass of a few queries (decode, a verify pass) folds the query heads onto their key
  head instead (decode steps of 8 and 20 rows at 4K of context, with the split: 0.78 of the
  time).
Each query row is computed as the single call computes it; under a causal mask a part ends
its keys at its last row's position (the keys after it are masked anyway), so its sums skip
masked zeros and may round differently, as any batch shape does. Passes too small to split
and without grouped heads keep the single call, as do attention sinks and Metal (fused
kernels; nothing is installed there).
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

# Parts are worth their cross-stream joins from this many score elements (queries x keys x
# heads) up: 16 queries over 4K keys with 16 heads.
MIN_SCORES = 1 << 20
MIN_QUERIES = 8

_installed: dict = {}  # the original function and the streams, once per process


def query_splits(num_queries: int, num_keys: int, parts: int, causal: bool) -> list[int]:
    """Row boundaries [0, ..., num_queries] cutting the queries into at most `parts` parts of
    about equal work. A part's work is its rows times the keys it reads: every key when not
    causal, else the keys up to its last row (the queries are the last rows of the keys)."""
    parts = max(1, min(parts, num_queries))
    if not causal:
        return [round(i * num_queries / parts) for i in range(parts + 1)]
    before = num_keys - num_queries  # keys before the first query (the context)

    def cuts_for(budget: float) -> list[int]:
        cuts, start = [0], 0
        while start < num_queries and len(cuts) <= parts:
            # the largest end with (end - start) * (before + end) <= budget, at least one row
            b = before + start
            end = start + int((-b + math.sqrt(b * b + 4 * budget)) / 2)
            while end > start + 1 and (end - start) * (before + end) > budget:
                end -= 1
            cuts.append(min(num_queries, max(end, start + 1)))
            start = cuts[-1]
        return cuts

    low, high = 0.0, float(num_queries) * num_keys
    for _ in range(40):  # the smallest budget whose greedy cuts end within `parts` parts
        middle = (low + high) / 2
        cuts = cuts_for(middle)
        if cuts[-1] == num_queries and len(cuts) <= parts + 1:
            high = middle
        else:
            low = middle
    return cuts_for(high)


def split_attention(whole, streams, queries, keys, values, *, scale, mask=None, sinks=None,
                    stream=None, **extra):
    """`whole` (MLX's `scaled_dot_product_attention`) with a short pass's grouped query heads
    folded onto their key heads, or a long pass's query rows split over `streams`; one call
    of `whole` where neither applies."""
    batch, heads, num_queries, _ = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[-2]
    causal = isinstance(mask, str) and mask == "causal"
    array = isinstance(mask, mx.array) and mask.ndim == 4
    if sinks is not None or stream is not None or extra or num_queries > num_keys or \
            not (causal or mask is None or array):
        return whole(queries, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream,
                     **extra)
    if num_queries < MIN_QUERIES and heads > kv_heads and heads % kv_heads == 0 and \
            (not array or mask.shape[1] == 1):
        return folded_attention(queries, keys, values, scale, mask)
    if len(streams) < 2 or num_queries < MIN_QUERIES or \
            batch * heads * num_queries * num_keys < MIN_SCORES:
        return whole(queries, keys, values, scale=scale, mask=mask)
    cuts = query_splits(num_queries, num_keys, len(streams), causal)
    out = []
    for part, (start, end) in enumerate(zip(cuts, cuts[1:])):
        k, v, m = keys, values, mask
        if causal:  # the keys up to this part's last row; the later ones are masked
            seen = num_keys - num_queries + end
            k, v = keys[:, :, :seen], values[:, :, :seen]
        elif array and mask.shape[-2] == num_queries:
            m = mask[..., start:end, :]
        out.append(whole(queries[:, :, start:end], k, v, scale=scale, mask=m,
                         stream=streams[part]))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def folded_attention(queries, keys, values, scale, mask):
    """A few queries per row (a decode step, a verify pass), grouped-query heads: the heads
    sharing a key head become that head's rows ([batch, kv_heads, group x queries, dim]), so
    the keys and values are read in place; MLX's unfused CPU path broadcasts them to every
    query head instead (0.65 of its time for 8 rows of 4K-token SmolLM2 KV). `mask`: None,
    "causal" (the queries are the last positions), or bool/additive [batch or 1, 1, queries
    or 1, keys]."""
    batch, heads, num_queries, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    grouped = (queries * scale).reshape(batch, kv_heads, group * num_queries, dim)
    scores = (grouped @ keys.swapaxes(-1, -2)).reshape(batch, kv_heads, group, num_queries,
                                                       num_keys)
    if isinstance(mask, str):  # causal: query i sees the keys up to its own position
        positions = mx.arange(num_keys - num_queries, num_keys)[:, None]
        mask = positions >= mx.arange(num_keys)[None] if num_queries > 1 else None
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[:, :, None]  # [batch or 1, 1, 1, queries or 1, keys]
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights.reshape(batch, kv_heads, group * num_queries, num_keys) @ values
    return out.reshape(batch, heads, num_queries, dim).astype(queries.dtype)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def use_cpu_attention(cores: int | None = None) -> int:
    """Route this process's `mx.fast.scaled_dot_product_attention` through `split_attention`
    when MLX runs on the CPU (every model family calls it, directly or through mlx-lm's
    `scaled_dot_product_attention`), long passes split over `cores` streams (all usable cores
    when None; 1: the folding of short passes alone). Returns the number of streams."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    if not _installed:
        cores = usable_cores() if cores is None else cores
        whole = mx.fast.scaled_dot_product_attention
        streams = tuple(mx.new_stream(mx.cpu) for _ in range(cores)) if cores > 1 else ()

        def attention(queries, keys, values, **kwargs):
            return split_attention(whole, streams, queries, keys, values, **kwargs)

        _installed.update(whole=whole, streams=streams)
        mx.fast.scaled_dot_product_attention = attention
    return len(_installed["streams"])
