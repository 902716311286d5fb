"""A slot's state mark: its recurrent states and sliding-window rings where its last prefill
or restore ended (docs/design/kv-pages.md "Exact repeats and state marks").

A model with such layers cannot cut a slot back to an earlier token: its state exists only at
the slot's end. The mark keeps one earlier state per slot, the one where the prompt's context
ended (a request's last prefill chunk, or the restore that brought its whole context back),
since that is where a retried or repeated request resumes. With the mark, the slot can be cut
back to it (`SlotStore.truncate`), copied there, and its page staged with that state after the slot
moved on (the prompt's tail, written after the first token). Attention KV needs no mark: it is
cut per token.

Cost: a recurrent layer's arrays by reference (mlx-lm replaces them on every update, never
writes into them); a ring as new array objects sharing its buffers, copied once when the next
decode token writes into the ring in place. So one more state per slot at most (a ring as a
prefill chunk left it), which the memory plan counts (worker/service.py `plan_inputs`).
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from switchyard.worker.cache_kinds import leaves, window_copy
from switchyard.worker.kv_layout import is_attention_kv


def markable(cache: list) -> bool:
    """Whether a slot of this cache form keeps a mark: it has state layers (attention-only
    slots are cut per token) and every layer is attention KV, a recurrent state or a ring."""
    layers = leaves(cache)
    return (any(not is_attention_kv(c) for c in layers)
            and all(is_attention_kv(c) or type(c) in (ArraysCache, RotatingKVCache)
                    for c in layers))


def take(cache: list) -> list:
    """The state layers of `cache` as they are now, one entry per layer (None for attention
    KV): layer caches of their own, which nothing else writes into."""
    return [None if is_attention_kv(c) else copy_state(c, _empty_like(c)) for c in leaves(cache)]


def put(mark: list, cache: list) -> None:
    """Set the state layers of `cache` to the marked ones (the mark stays usable)."""
    for saved, c in zip(mark, leaves(cache)):
        if saved is not None:
            copy_state(saved, c)


def with_state(cache: list, mark: list) -> list:
    """The layers of `cache` with the marked state layers in place of its own (to stage a
    page that ends at the mark)."""
    return [c if saved is None else saved for c, saved in zip(leaves(cache), mark)]


def copy_state(src, dst):
    """Copy a state layer's contents into `dst` and return it: a recurrent state's arrays
    (immutable, shared), a ring's arrays as new objects."""
    if type(src) is RotatingKVCache:
        window_copy(src, dst)
    else:
        dst.cache = list(src.cache)
    return dst


def _empty_like(c):
    if type(c) is RotatingKVCache:
        return RotatingKVCache(c.max_size, c.keep)
    return ArraysCache(len(c.cache))
