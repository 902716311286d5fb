"""Moving KV between slot caches and page buffers: the payload layout of a page.

A page payload is, for every attention layer (mlx-lm `KVCache`) in cache order, its keys then
its values for the page's tokens, `[n_kv_heads, page_size, head_dim]` each, in the cache dtype;
with quantized KV each is its packed values, scales and biases (worker/kv_layout.py).
A restore point (hybrid models) appends every recurrent layer's state arrays (`ArraysCache`)
and every sliding-window layer's ring snapshot (`RotatingKVCache`, worker/cache_kinds.py).
Members of a `CacheList` count as layers of their own. Only this module knows the layout;
kvstore stores the bytes opaquely.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from switchyard.worker.cache_kinds import leaves, window_copy, window_restore, window_shapes, window_snapshot
from switchyard.worker.kv_layout import copy_tokens, is_attention_kv, set_token_arrays, token_arrays
from switchyard.worker.shared_pages import Shelved

_NP_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.uint32: np.uint32,
              mx.int32: np.int32}
_MX_DTYPES = {np_type: mx_type for mx_type, np_type in _NP_DTYPES.items()}

# Attention layers whose token arrays `PageLayout.load` allocated, with the arrays' data
# addresses: a load writes into these in place. The layer's own prefills keep them (mlx
# updates in place what no one else holds) unless they outgrow them (new arrays, new
# addresses); a copied prefix may share them, so `copy_prefix` forgets its source here.
_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        cache = leaves(cache)
        self.page_size = page_size
        self.kv_layers: list[int] = []
        self.state_layers: list[int] = []
        self._kv: list[tuple[_Array, ...]] = []  # per layer, as kv_layout.token_arrays
        self._state: list[list[_Array]] = []
        for i, c in enumerate(cache):
            if is_attention_kv(c):
                self.kv_layers.append(i)
                self._kv.append(tuple(
                    _Array((a.shape[1], page_size, a.shape[3]), _np_dtype(a))
                    for a in token_arrays(c)))
            elif type(c) is ArraysCache:
                self.state_layers.append(i)
                self._state.append([_Array(tuple(a.shape[1:]), _np_dtype(a)) for a in c.cache])
            elif type(c) is RotatingKVCache:
                self.state_layers.append(i)
                self._state.append([_Array(shape, _NP_DTYPES[_checked(dtype)])
                                    for shape, dtype in window_shapes(c)])
            else:
                raise PageLayoutError(f"{type(c).__name__} layers cannot be stored as pages")
        # Per token, in bytes: each attention array, and all arrays of the layers before a
        # layer (a page of n tokens holds layer i's arrays from n * _kv_before[i] on).
        self._kv_token_bytes = [tuple(a.nbytes // page_size for a in arrays)
                                for arrays in self._kv]
        self._kv_before = [sum(sum(t) for t in self._kv_token_bytes[:i])
                           for i in range(len(self._kv))]
        self.dtype_name = "+".join(sorted({np.dtype(a.dtype).name
                                           for arrays in self._kv for a in arrays}))
        self.kv_bytes = sum(a.nbytes for arrays in self._kv for a in arrays)
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
        if isinstance(cache, Shelved):  # read where its shared pages lie
            for i in self.kv_layers:
                arrays += [a[0] for a in cache.token_range(i, start, end)]
            layers = leaves(cache.shell)
        else:
            layers = leaves(cache)
            for i in self.kv_layers:
                arrays += [a[0, :, start:end, :] for a in token_arrays(layers[i])]
        if with_state:
            arrays += [a for i in self.state_layers for a in _state_arrays(layers[i])]
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
        cache = leaves(cache)
        last = num_tokens - (len(pages) - 1) * self.page_size
        counts = [self.page_size] * (len(pages) - 1) + [last]
        capacity = _round_up(start + num_tokens + reserve + 1, KVCache.step)
        for index, specs in enumerate(self._kv):
            layer = cache[self.kv_layers[index]]
            arrays = _writable(layer, specs, start, capacity)
            # One copy per byte: from the shared buffer straight into the slot's memory
            # (docs/design/kv-pages.md "Restores"). The numpy views are dropped before mlx uses the
            # arrays again: a view held on would stop mlx from updating them in place.
            targets = [np.asarray(a) for a in arrays]
            position = start
            for buf, n in zip(pages, counts):
                offset = n * self._kv_before[index]
                for spec, per_token, target in zip(specs, self._kv_token_bytes[index], targets):
                    size = n * per_token
                    heads, _, dim = spec.shape
                    np.copyto(target[0, :, position:position + n, :],
                              buf[offset:offset + size].view(spec.dtype).reshape(heads, n, dim))
                    offset += size
                position += n
            del targets
            set_token_arrays(layer, arrays, start + num_tokens)
            _OWN[layer] = _addresses(arrays)
        if with_state:
            offset = self.payload_len(last, with_state=False)
            for layer, specs in zip(self.state_layers, self._state):
                arrays = []
                for spec in specs:
                    arrays.append(mx.array(_view(pages[-1], offset, spec)))
                    offset += spec.nbytes
                if type(cache[layer]) is RotatingKVCache:
                    window_restore(cache[layer], arrays, start + num_tokens)
                else:
                    cache[layer].cache = [a[None] for a in arrays]
        mx.eval([c.state for c in cache])


def copy_prefix(cache: list, num_tokens: int, fresh: list) -> list:
    """A new cache list holding the first `num_tokens` of `cache` (state only at its end)."""
    for src, dst in zip(leaves(cache), leaves(fresh)):
        if is_attention_kv(src):
            copy_tokens(src, dst, num_tokens)
            _OWN.pop(src, None)  # the copy may share its buffers: never written in place again
        elif type(src) is RotatingKVCache:
            window_copy(src, dst)
        elif type(src) is ArraysCache:
            # mlx arrays are immutable, so sharing them is a copy; the list itself is not.
            dst.cache = list(src.cache)
        else:  # a kind without pages: a whole copy, every array a new object (some caches
            # write into their arrays in place)
            dst.__dict__.update(tree_map(
                lambda a: mx.contiguous(a) if isinstance(a, mx.array) else a, vars(src)))
    return fresh


def write_back_row(own, merged, row: int, start: int) -> None:
    """Row `row` of a packed pass's batch layer `merged` back into the slot's own layer `own`,
    which holds the row's first `start` tokens: attention KV gets only the tokens from `start`
    on, written into its buffer (grown in mlx-lm's steps of 256 when full), so the context is
    not copied back; a recurrent state takes the row's new state."""
    if not is_attention_kv(own):
        own.cache = merged.extract(row).cache
        return
    new = merged.row_tokens(row, start)
    end = start + new[0].shape[2]
    arrays = token_arrays(own) if own.keys is not None else None
    if arrays is None or arrays[0].shape[2] < end:
        capacity = (end + merged.step - 1) // merged.step * merged.step
        grown = [mx.zeros((1, a.shape[1], capacity, a.shape[3]), a.dtype) for a in new]
        if arrays is not None and start:
            for g, a in zip(grown, arrays):
                g[..., :start, :] = a[..., :start, :]
        arrays = grown
    for a, n in zip(arrays, new):
        a[..., start:end, :] = n
    set_token_arrays(own, arrays, end)


def _state_arrays(c) -> list[mx.array]:
    """A snapshot layer's arrays without the batch axis."""
    if type(c) is RotatingKVCache:
        return window_snapshot(c)
    return [a[0] for a in c.cache]


def _writable(layer, specs: tuple[_Array, ...], start: int, capacity: int) -> list[mx.array]:
    """The layer's token arrays, evaluated, with room for `capacity` tokens and its first
    `start` tokens in place, that `load` may write into through numpy.

    A slot's own arrays are kept when they have the room (a dropped slot keeps its buffers,
    worker/slots.py): memory the slot already has costs no page faults. Only arrays this
    module allocated and that the layer still holds qualify: of others (grown by a prefill,
    a batch row, a copied prefix) this module cannot tell whether another cache shares their
    buffer, so they are copied once into new arrays."""
    existing = token_arrays(layer) if layer.keys is not None else None
    if existing is not None and all(a.shape[2] >= capacity for a in existing) and \
            _OWN.get(layer) == _addresses(existing):
        return existing
    if not start:  # nothing to keep: freed first, mlx can hand the same memory back
        existing, layer.keys, layer.values = None, None, None
    fresh = [mx.zeros((1, s.shape[0], capacity, s.shape[2]), _MX_DTYPES[s.dtype]) for s in specs]
    mx.eval(fresh)
    if start:
        for old, new in zip(existing, fresh):
            np.copyto(np.asarray(new)[:, :, :start, :], np.asarray(old[:, :, :start, :]))
    return fresh


def _addresses(arrays: list[mx.array]) -> tuple[int, ...]:
    """Where the arrays' data lie (evaluates them)."""
    return tuple(np.asarray(a).__array_interface__["data"][0] for a in arrays)


def _view(buf: np.ndarray, offset: int, spec: _Array) -> np.ndarray:
    return buf[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)


def _np_dtype(a: mx.array) -> type:
    return _NP_DTYPES[_checked(a.dtype)]


def _checked(dtype: mx.Dtype) -> mx.Dtype:
    if dtype not in _NP_DTYPES:
        raise PageLayoutError(f"KV dtype {dtype} cannot be stored as pages")
    return dtype


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
