"""The kinds of layer cache mlx-lm models use, and what paging needs to know of each.

- `KVCache` (full attention, MLA latents, indexer keys; or its quantized form, --kv-bits):
  grows per token; paged per token.
- `ArraysCache` (gated delta, SSM): a fixed-size state that exists only at the slot's end.
  mlx-lm replaces its arrays on every update and never writes into them, so a reference to
  them is a snapshot of the state.
- `RotatingKVCache` (sliding-window attention, optional `keep` sink tokens): a ring of the
  last `max_size` tokens. Like a recurrent state it is stored as a snapshot at a restore
  point, never per token (docs/design/kv-pages.md "Sliding-window layers, MLA and compound caches").
- `CacheList` (compound: DeepSeek-V3.2's attention + indexer): its members are paged as
  layers of their own.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

from switchyard.worker.kv_layout import is_attention_kv


def leaves(cache: list) -> list:
    """The layer caches of a cache list, members of a `CacheList` in order."""
    out = []
    for c in cache:
        out.extend(leaves(list(c.caches)) if type(c) is CacheList else [c])
    return out


def rewindable(cache: list) -> bool:
    """True when every layer can be cut back to any earlier token (all per-token KV)."""
    return all(is_attention_kv(c) for c in leaves(cache))


def packable(cache: list) -> bool:
    """True when several slots' prefill chunks can run as right-padded rows of one pass
    (docs/design/scheduling.md "Packed prefill"): every layer is per-token attention KV, whose batch
    (worker/batch_kv.py) writes each row at its own end and cuts each row's padding off, or a
    recurrent state, which mlx-lm's batch advances by each row's length alone (`lengths`,
    as in a verify pass). Rings are merged left-padded and cannot drop a row's padding."""
    return all(is_attention_kv(c) or type(c) is ArraysCache for c in leaves(cache))


def drops_last_token(cache: list) -> bool:
    """True when the token just fed can be undone (pipelined decode; docs/design.md "Hybrid
    models"): attention KV and rings with `trim(1)` (a ring's slot it wrote is rewritten by the
    next token, or is the oldest one the next chunk drops); a recurrent state by putting back
    the arrays `before_token` kept."""
    return all(is_attention_kv(c) or type(c) in (RotatingKVCache, ArraysCache)
               for c in leaves(cache))


def before_token(cache: list) -> list:
    """What `drop_last_token` needs to undo the token about to be fed: each recurrent layer's
    state arrays, by reference (free: mlx-lm replaces them, never writes into them), and None
    for the layers that trim."""
    return [(list(c.cache), c.left_padding, c.lengths) if type(c) is ArraysCache else None
            for c in leaves(cache)]


def drop_last_token(cache: list, saved: list) -> None:
    """Undo the one token fed since `before_token(cache)` returned `saved`."""
    for c, state in zip(leaves(cache), saved):
        if state is None:
            c.trim(1)
        else:
            c.cache, c.left_padding, c.lengths = list(state[0]), state[1], state[2]


# --- speculative decoding (docs/design/speculative-decoding.md "Speculative decoding") -------------------------------

def verifiable(cache: list) -> str:
    """Where a verify pass can undo the draft tokens a sequence rejects: "batched" when every
    layer is per-token attention KV (cut back per row, worker/batch_kv.py) or a recurrent
    state (a row that rejected tokens gets its state back and its kept tokens fed again);
    "alone" when there are sliding-window rings (mlx-lm's batched ring is filled in place,
    so only a lone sequence's ring is taken back); "" for any other kind."""
    layers = leaves(cache)
    if all(is_attention_kv(c) or type(c) is ArraysCache for c in layers):
        return "batched"
    if all(is_attention_kv(c) or type(c) in (RotatingKVCache, ArraysCache) for c in layers):
        return "alone"
    return ""


def before_verify(cache: list) -> list | None:
    """What `undo_verify` needs to take a verify pass back: each recurrent layer's state
    arrays and each ring's arrays and indexes, by reference. A verify pass feeds several
    tokens, which mlx-lm writes into a ring by concatenation, never in place, and into a
    recurrent state as new arrays, so the references stay as they were. None when every layer
    is attention KV (cutting it back undoes it)."""
    layers = leaves(cache)
    if all(is_attention_kv(c) or hasattr(c, "trim_rows") for c in layers):
        return None
    saved = []
    for c in layers:
        if type(c) is ArraysCache:
            saved.append((list(c.cache), c.left_padding, c.lengths))
        elif type(c) is RotatingKVCache:
            saved.append((c.keys, c.values, c.offset, c._idx))
        else:
            saved.append(None)
    return saved


def undo_verify(cache: list, saved: list, rows: list[bool], cuts: list[int]) -> None:
    """Take a verify pass back for the rows marked in `rows`: recurrent layers and rings get
    back what `before_verify` kept (rings: a lone sequence only); attention layers cut each
    row back by cuts[row] tokens (a marked row: all it was fed; another: its padding)."""
    mask = mx.array(rows)
    for c, state in zip(leaves(cache), saved):
        if type(c) is ArraysCache:
            if all(rows):
                c.cache = list(state[0])
            else:  # the marked rows' state from before the pass, the others' from after it
                c.cache = [mx.where(mask.reshape(-1, *([1] * (new.ndim - 1))), old, new)
                           for old, new in zip(state[0], c.cache)]
        elif type(c) is RotatingKVCache:
            c.keys, c.values, c.offset, c._idx = state
        elif hasattr(c, "trim_rows"):
            c.trim_rows(cuts)
        else:
            c.trim(cuts[0])


# --- sliding windows -------------------------------------------------------------------------

def window_shapes(c: RotatingKVCache) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    """Snapshot arrays of a ring: keys and values padded to `max_size` tokens, and
    [write index, stored length] (int32)."""
    k, v = c.keys, c.values
    return [((k.shape[1], c.max_size, k.shape[3]), k.dtype),
            ((v.shape[1], c.max_size, v.shape[3]), v.dtype), ((2,), mx.int32)]


def window_snapshot(c: RotatingKVCache) -> list[mx.array]:
    """The ring as the next update would see it. A ring that grew past `max_size` (a prefill
    chunk keeps `max_size - 1 + chunk` tokens) is cut to its last `max_size` tokens, exactly
    as mlx-lm's next update cuts it, so a restored ring continues bit-identically."""
    keys, values, idx = c.keys, c.values, c._idx
    if keys.shape[2] > c.max_size:  # temporal order here (_idx == length after a chunk)
        keys = c._trim(keys.shape[2] - c.max_size, keys)
        values = c._trim(values.shape[2] - c.max_size, values)
        idx = c.max_size
    n = keys.shape[2]
    return [_padded(keys[0], c.max_size), _padded(values[0], c.max_size),
            mx.array([idx, n], dtype=mx.int32)]


def _padded(a: mx.array, length: int) -> mx.array:
    """[heads, n, dim] -> [heads, length, dim], zeros after the n stored tokens."""
    pad = length - a.shape[1]
    if not pad:
        return a
    return mx.concatenate([a, mx.zeros((a.shape[0], pad, a.shape[2]), a.dtype)], axis=1)


def window_restore(c: RotatingKVCache, arrays: list[mx.array], offset: int) -> None:
    """Set a ring from its snapshot; `offset` is the number of tokens it has seen."""
    keys, values, meta = arrays
    idx, n = (int(x) for x in meta.tolist())
    c.keys = mx.contiguous(keys[None, :, :n, :])
    c.values = mx.contiguous(values[None, :, :n, :])
    c.offset, c._idx = offset, idx


def window_copy(src: RotatingKVCache, dst: RotatingKVCache) -> None:
    """A copy of the whole ring (a ring cannot be cut back to an earlier token)."""
    if src.keys is not None:
        dst.keys, dst.values = mx.contiguous(src.keys), mx.contiguous(src.values)
    dst.offset, dst._idx, dst.keep, dst.max_size = src.offset, src._idx, src.keep, src.max_size


def window_bytes(c: RotatingKVCache, prefill_chunk: int) -> int:
    """Memory of a ring at its largest: a prefill chunk holds `max_size - 1 + chunk` tokens.
    It does not grow with the context."""
    per_token = sum(a.shape[1] * a.shape[3] * a.dtype.size for a in (c.keys, c.values))
    return per_token * (c.max_size - 1 + prefill_chunk)
