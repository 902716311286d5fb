"""Idle slots' attention KV held as pages shared between slots (docs/design/kv-pages.md
"Shared pages in memory").

Sub-agents that branch off one system prompt each hold a copy of it in their slots: twenty
idle sub-agents sharing 17K tokens would hold 340K tokens of it. A shelved slot holds its KV as
page-sized pieces instead, keyed by the chain of tokens up to each page's end (a page's KV
depends on every token before it), and a piece another shelved slot holds already is taken from
that slot: the twenty hold the prompt once. Only per-token attention KV is shelved: a hybrid
slot's recurrent states and sliding-window rings (fixed in size, and existing at the slot's end
alone) stay as they are, in its cache list. Only where the tokens say all a page's KV depends
on (not in a vision store, whose images are not among the tokens).

mlx's attention reads one array per layer, so a slot used again (prefilled, decoded into,
batched) is first made whole: one contiguous cache of its tokens. A stage and a copy read a
shelved slot where it lies, leaving it shelved. Shelving and making whole go one layer at a time,
each layer's new arrays evaluated before the old ones go, so the two forms coexist for one
layer only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from switchyard.worker.cache_kinds import leaves
from switchyard.worker.kv_layout import is_attention_kv, set_token_arrays, token_arrays
from switchyard.worker.state_marks import copy_state

_STEP = 256  # mlx-lm's KVCache.step: a whole slot gets room for its next token


@dataclass
class _Piece:
    """One page's KV in every attention layer (each as kv_layout.token_arrays, [1, heads,
    page_size, x]), and how many shelved slots hold it."""

    layers: list[list[mx.array]]
    refs: int = 0


@dataclass
class Shelved:
    """A slot's KV while shelved: the chain keys of its full pages (pieces in the pool), its
    partial last page per attention layer, its token count, and its cache list with the
    attention layers emptied (the form to make it whole in; its state layers as they are)."""

    keys: list[bytes]
    tail: list[list[mx.array]]
    num_tokens: int
    shell: list = field(repr=False)
    pool: PagePool = field(repr=False)
    attention: list[int] = field(repr=False)  # which of the shell's leaves are attention KV

    def token_range(self, layer: int, start: int, end: int) -> list[mx.array]:
        """Attention layer `layer`'s (an index into the shell's leaves) arrays for tokens
        [start, end), read where they lie."""
        parts = _parts(self, self.attention.index(layer), start, end)
        if len(parts) == 1:
            return parts[0]
        return [mx.concatenate([p[j] for p in parts], axis=2) for j in range(len(parts[0]))]

    def copy(self, num_tokens: int, fresh: list) -> list:
        """`fresh` holding the first `num_tokens` of the slot, which stays shelved: its
        attention KV from the pieces, its state layers as the slot has them (at its end; a
        copy to the mark puts the mark's after: worker/slots.py `copy_prefix`)."""
        self.pool.whole(self, num_tokens, fresh)
        for src, dst in zip(leaves(self.shell), leaves(fresh)):
            if not is_attention_kv(src):
                copy_state(src, dst)
        return fresh


def chain_keys(tokens: list[int], page_size: int) -> list[bytes]:
    """The key of every full page of `tokens`: a digest of all tokens up to its end."""
    keys, digest = [], b""
    ids = np.asarray(tokens, dtype=np.int64)
    for end in range(page_size, len(tokens) + 1, page_size):
        digest = hashlib.blake2b(digest + ids[end - page_size:end].tobytes(),
                                 digest_size=16).digest()
        keys.append(digest)
    return keys


class PagePool:
    """The pieces shelved slots hold, each once."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._pieces: dict[bytes, _Piece] = {}

    @property
    def num_pieces(self) -> int:
        return len(self._pieces)

    def shelve(self, cache: list, tokens: list[int]) -> Shelved:
        """`cache` (holding `tokens`) as pieces, taking those already pooled; `cache`'s
        attention layers are emptied, layer by layer, as their pieces are made."""
        P = self.page_size
        keys = chain_keys(tokens, P)  # distinct: each digest covers all tokens before it
        made = {k: _Piece([]) for k in keys if k not in self._pieces}
        starts = [(page * P, made[k]) for page, k in enumerate(keys) if k in made]
        tail: list[list[mx.array]] = []
        full = len(keys) * P
        layers = leaves(cache)
        attention = [i for i, c in enumerate(layers) if is_attention_kv(c)]
        for layer in (layers[i] for i in attention):
            arrays = token_arrays(layer)
            for at, piece in starts:
                piece.layers.append([mx.contiguous(a[..., at:at + P, :]) for a in arrays])
            tail.append([mx.contiguous(a[..., full:len(tokens), :]) for a in arrays]
                        if full < len(tokens) else [])
            mx.eval([a for _, piece in starts for a in piece.layers[-1]] + tail[-1])
            layer.keys = layer.values = None  # the slot's own buffer goes now
            layer.offset = 0
        self._pieces.update(made)
        for k in keys:
            self._pieces[k].refs += 1
        return Shelved(keys, tail, len(tokens), cache, self, attention)

    def whole(self, shelved: Shelved, num_tokens: int, into: list | None = None) -> list:
        """A cache list whose attention layers hold the first `num_tokens` of `shelved`
        contiguously, with room for the next token (its state layers are the caller's: the
        shell's, or as `into` has them). Into `into` (a fresh cache list), a copy of its
        prefix: the slot stays shelved. Without, the slot itself is made whole: its hold on
        its pieces ends, and a piece no one else holds goes, layer by layer."""
        keep = into is not None
        cache = into if keep else shelved.shell
        alone = [] if keep else [self._pieces[k] for k in shelved.keys
                                 if self._pieces[k].refs == 1]
        capacity = -(-(num_tokens + 1) // _STEP) * _STEP
        layers = leaves(cache)
        for i, layer in enumerate(layers[j] for j in shelved.attention):
            if num_tokens:
                parts = _parts(shelved, i, 0, num_tokens)
                arrays = [mx.concatenate([p[j] for p in parts]
                                         + [_zeros(parts[0][j], capacity - num_tokens)], axis=2)
                          for j in range(len(parts[0]))]
                mx.eval(arrays)
                set_token_arrays(layer, arrays, num_tokens)
            for piece in alone:
                piece.layers[i] = []
            if not keep:
                shelved.tail[i] = []
        if not keep:
            self.drop(shelved)
        return cache

    def cut(self, shelved: Shelved, num_tokens: int) -> None:
        """The shelved slot keeps its first `num_tokens` only: its hold on the pieces past
        them ends (a piece no one else holds goes), and its partial last page is cut from
        the piece it starts."""
        full, rest = divmod(num_tokens, self.page_size)
        source = ([self._pieces[shelved.keys[full]].layers[i]
                   for i in range(len(shelved.attention))]
                  if full < len(shelved.keys) else shelved.tail)
        shelved.tail = [[mx.contiguous(a[..., :rest, :]) for a in arrays] if rest else []
                        for arrays in source]
        mx.eval([a for arrays in shelved.tail for a in arrays])
        self._unref(shelved.keys[full:])
        shelved.keys = shelved.keys[:full]
        shelved.num_tokens = num_tokens

    def drop(self, shelved: Shelved) -> None:
        """The shelved slot's hold on its pieces ends (it was made whole, or released)."""
        self._unref(shelved.keys)
        shelved.keys = []

    def _unref(self, keys: list[bytes]) -> None:
        """One hold less on each of these pieces; a piece no one holds goes."""
        for k in keys:
            piece = self._pieces[k]
            piece.refs -= 1
            if not piece.refs:
                del self._pieces[k]


def _parts(shelved: Shelved, layer: int, start: int, end: int) -> list[list[mx.array]]:
    """The pieces (and the tail) of the `layer`-th attention layer that cover tokens
    [start, end), each cut to that range."""
    pool = shelved.pool
    P = pool.page_size
    parts = []
    for page in range(start // P, -(-end // P)):
        at = page * P
        arrays = (pool._pieces[shelved.keys[page]].layers[layer] if page < len(shelved.keys)
                  else shelved.tail[layer])
        lo, hi = max(start, at) - at, min(end, at + P) - at
        parts.append(arrays if (lo, hi) == (0, arrays[0].shape[2])
                     else [a[..., lo:hi, :] for a in arrays])
    return parts


def _zeros(like: mx.array, num_tokens: int) -> mx.array:
    shape = list(like.shape)
    shape[2] = num_tokens
    return mx.zeros(shape, like.dtype)


class SlotCaches(dict):
    """The slots' own caches by slot (worker/slots.py): a shelved slot's entry is its `Shelved`
    form, made whole the moment anything but `peek` asks for it, so no path uses a shelved
    slot as a cache by mistake. With no pool (the store does not shelve) it is a plain dict."""

    def __init__(self, caches: dict[int, list], pool: PagePool | None):
        super().__init__(caches)
        self.pool = pool

    def shelve(self, slot: int, tokens: list[int]) -> None:
        value = super().__getitem__(slot)
        if self.pool is not None and tokens and not isinstance(value, Shelved):
            super().__setitem__(slot, self.pool.shelve(value, tokens))

    def is_shelved(self, slot: int) -> bool:
        return isinstance(super().__getitem__(slot), Shelved)

    def peek(self, slot: int):
        """The slot's cache, or its `Shelved` form, as it lies (for a read)."""
        return super().__getitem__(slot)

    def cut(self, slot: int, tokens: list[int]) -> None:
        """The slot shelved holding `tokens` (its first ones) only; the rest of its attention
        KV goes (docs/design/kv-pages.md "Cut slots")."""
        value = super().__getitem__(slot)
        if isinstance(value, Shelved):
            self.pool.cut(value, len(tokens))
        else:
            super().__setitem__(slot, self.pool.shelve(value, tokens))

    def whole(self, slot: int, num_tokens: int) -> list:
        """The shelved slot made whole holding its first `num_tokens` only."""
        cache = self.pool.whole(super().__getitem__(slot), num_tokens)
        super().__setitem__(slot, cache)
        return cache

    def __getitem__(self, slot: int) -> list:
        value = super().__getitem__(slot)
        return self.whole(slot, value.num_tokens) if isinstance(value, Shelved) else value

    def pop(self, slot: int) -> list:
        value = self[slot]
        super().pop(slot)
        return value

    def __setitem__(self, slot: int, value: list) -> None:
        old = super().get(slot)
        if isinstance(old, Shelved):
            self.pool.drop(old)
        super().__setitem__(slot, value)
