"""Moving KV between slot caches and page buffers: the payload layout of a page.

A page payload is, for every attention layer (mlx-lm `KVCache`) in cache order, its keys then
its values for the page's tokens, `[n_kv_heads, page_size, head_dim]` each, in the cache dtype.
A restore point (hybrid models) appends every recurrent layer's state arrays (`ArraysCache`).
Only this module knows the layout; kvstore stores the bytes opaquely.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

_NP_DTYPES = {mx.float32: np.float32, mx.float16: np.float16}


class PageLayoutError(RuntimeError):
    """The model's cache cannot be paged (a cache class this layout does not know)."""


@dataclass(frozen=True)
class _Array:
    shape: tuple[int, ...]
    dtype: type

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class PageLayout:
    def __init__(self, cache: list, page_size: int):
        """`cache` must have seen at least one token, so every array exists."""
        self.page_size = page_size
        self.kv_layers: list[int] = []
        self.state_layers: list[int] = []
        self._kv: list[tuple[_Array, _Array]] = []
        self._state: list[list[_Array]] = []
        for i, c in enumerate(cache):
            if type(c) is KVCache:
                self.kv_layers.append(i)
                self._kv.append(tuple(
                    _Array((a.shape[1], page_size, a.shape[3]), _np_dtype(a))
                    for a in (c.keys, c.values)))
            elif type(c) is ArraysCache:
                self.state_layers.append(i)
                self._state.append([_Array(tuple(a.shape[1:]), _np_dtype(a)) for a in c.cache])
            else:
                raise PageLayoutError(f"{type(c).__name__} layers cannot be stored as pages")
        self.dtype_name = "+".join(sorted({np.dtype(k.dtype).name for k, _ in self._kv}))
        self.kv_bytes = sum(k.nbytes + v.nbytes for k, v in self._kv)
        self.state_bytes = sum(a.nbytes for arrays in self._state for a in arrays)

    @property
    def buffer_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    # --- slot -> buffer --------------------------------------------------------------------

    def payload_len(self, num_tokens: int, with_state: bool) -> int:
        per_token = self.kv_bytes // self.page_size
        return num_tokens * per_token + (self.state_bytes if with_state else 0)

    def stage(self, cache: list, start: int, out: np.ndarray, with_state: bool,
              num_tokens: int = 0) -> None:
        """Copy tokens [start, start + num_tokens) (a full page when 0), and the state when
        asked, into `out` (uint8)."""
        end = start + (num_tokens or self.page_size)
        arrays = []
        for i in self.kv_layers:
            arrays += [cache[i].keys[0, :, start:end, :], cache[i].values[0, :, start:end, :]]
        if with_state:
            arrays += [a[0] for i in self.state_layers for a in cache[i].cache]
        mx.eval(arrays)
        offset = 0
        for a in arrays:
            src = np.asarray(a)  # zero-copy view of the evaluated mx array
            dst = out[offset:offset + src.nbytes].view(src.dtype).reshape(src.shape)
            np.copyto(dst, src)
            offset += src.nbytes

    # --- buffers -> slot -------------------------------------------------------------------

    def load(self, cache: list, start: int, pages: list[np.ndarray], with_state: bool,
             num_tokens: int, reserve: int = 0) -> None:
        """Append `pages` (uint8 buffers) holding `num_tokens` tokens after the first `start`
        tokens of `cache`. All pages are full but the last, which may be a tail. `reserve`:
        tokens that will follow (later loads, the prefill after them), given room now."""
        last = num_tokens - (len(pages) - 1) * self.page_size
        counts = [self.page_size] * (len(pages) - 1) + [last]
        capacity = _round_up(start + num_tokens + reserve + 1, KVCache.step)
        for index, (k_spec, v_spec) in enumerate(self._kv):
            layer = self.kv_layers[index]
            parts_k, parts_v = [], []
            for buf, n in zip(pages, counts):
                offset = self._kv_offset(index, n)
                k, v = _resized(k_spec, n), _resized(v_spec, n)
                parts_k.append(_view(buf, offset, k))
                parts_v.append(_view(buf, offset + k.nbytes, v))
            cache[layer].keys = _assemble(cache[layer].keys, start, parts_k, capacity)
            cache[layer].values = _assemble(cache[layer].values, start, parts_v, capacity)
            cache[layer].offset = start + num_tokens
        if with_state:
            offset = self.payload_len(last, with_state=False)
            for layer, specs in zip(self.state_layers, self._state):
                arrays = []
                for spec in specs:
                    arrays.append(mx.array(_view(pages[-1], offset, spec))[None])
                    offset += spec.nbytes
                cache[layer].cache = arrays
        mx.eval([c.state for c in cache])

    def _kv_offset(self, index: int, num_tokens: int) -> int:
        """Byte offset of the index-th attention layer in a page of `num_tokens` tokens."""
        return sum(_resized(k, num_tokens).nbytes + _resized(v, num_tokens).nbytes
                   for k, v in self._kv[:index])


def copy_prefix(cache: list, num_tokens: int, fresh: list) -> list:
    """A new cache list holding the first `num_tokens` of `cache` (state only at its end)."""
    for src, dst in zip(cache, fresh):
        if type(src) is KVCache:
            if num_tokens:
                dst.keys = mx.contiguous(src.keys[..., :num_tokens, :])
                dst.values = mx.contiguous(src.values[..., :num_tokens, :])
            dst.offset = num_tokens
        else:
            # mlx arrays are immutable, so sharing them is a copy; the list itself is not.
            dst.cache = list(src.cache)
    return fresh


def _assemble(existing: mx.array | None, start: int, parts: list[np.ndarray],
              capacity: int) -> mx.array:
    """[1, heads, >= capacity, dim]: existing[:start], then the pages, then room to grow.

    Written into `existing` when it has the room (mlx updates a buffer nobody else holds in
    place), so each page is copied once, not the whole slot again for every batch of a
    restore (docs/design.md "Restores")."""
    new = [mx.array(part)[None] for part in parts]  # the one copy out of shared memory
    out = existing
    if existing is None or existing.shape[2] < capacity:
        out = mx.zeros((1, new[0].shape[1], capacity, new[0].shape[3]), new[0].dtype)
        if start:
            out[..., :start, :] = existing[..., :start, :]
    for part in new:
        out[..., start:start + part.shape[2], :] = part
        start += part.shape[2]
    return out


def _resized(spec: _Array, num_tokens: int) -> _Array:
    """The same KV array for a page of `num_tokens` tokens: [heads, num_tokens, dim]."""
    heads, _, dim = spec.shape
    return _Array((heads, num_tokens, dim), spec.dtype)


def _view(buf: np.ndarray, offset: int, spec: _Array) -> np.ndarray:
    return buf[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)


def _np_dtype(a: mx.array) -> type:
    if a.dtype not in _NP_DTYPES:
        raise PageLayoutError(f"KV dtype {a.dtype} cannot be stored as pages")
    return _NP_DTYPES[a.dtype]


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
