"""Attention KV of several slots decoded together, each row at its own length.

mlx-lm's BatchKVCache left-pads its rows so that they all end at one column and every row
writes the same columns each step. Speculative decoding breaks that: one forward pass verifies
a different number of tokens per row and each row keeps its own accepted prefix
(docs/design/speculative-decoding.md "Speculative decoding"). So here rows are left-aligned and each has its own
end: a step writes row r's new tokens at [end_r, end_r + n) and the mask lets each query see
its own row's columns up to itself; a row cut back (rejected draft tokens, or the padding of a
shorter row) just moves its end. Nothing is ever shifted. Columns past a row's end, up to the
longest row, are junk the mask hides (as the left padding of mlx-lm's batch is); they are
dropped when the batch is split back into slots.

`BatchKV` holds full-precision KV (keys and values arrays [B, heads, capacity, dim]);
`BatchQuantizedKV` holds mlx-lm's quantized form (--kv-bits: packed values, scales and biases
per K and V, worker/kv_layout.py), quantized as each token is written. A row's tokens depend on
that row alone, so a row extracted is bit-identical to the slot's own cache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache


class BatchKV(_BaseCache):
    step = 256

    def __init__(self, ends: list[int], row_type: type = KVCache):
        self.row_type = row_type  # what a row is when the batch is split (the slots' kind)
        self.ends = list(ends)  # tokens each row holds
        self.offset = mx.array(self.ends)  # each row's next position (RoPE)
        self.keys = None
        self.values = None

    # --- the forms -------------------------------------------------------------------------

    def _parts(self, arrays) -> tuple[mx.array, ...]:
        return (arrays,)

    def _joined(self, parts: tuple[mx.array, ...]):
        return parts[0]

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return (x,)

    def _empty_like(self, parts, rows: int, capacity: int) -> tuple[mx.array, ...]:
        return tuple(mx.zeros((rows, a.shape[1], capacity, a.shape[3]), a.dtype) for a in parts)

    def _row_cache(self):
        return self.row_type()

    # --- the cache interface models use ----------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        new_k, new_v = self._encode(keys), self._encode(values)
        longest = max(self.ends) + n
        if self.keys is None or longest > self._capacity():
            self._grow(new_k, new_v, longest)
        k_parts, v_parts = self._parts(self.keys), self._parts(self.values)
        if len(set(self.ends)) == 1:
            e = self.ends[0]
            for ours, new in zip(k_parts + v_parts, new_k + new_v):
                ours[..., e:e + n, :] = new
        else:
            for row, e in enumerate(self.ends):
                for ours, new in zip(k_parts + v_parts, new_k + new_v):
                    ours[row:row + 1, :, e:e + n, :] = new[row:row + 1]
        self.ends = [e + n for e in self.ends]
        self.offset = self.offset + n
        used = max(self.ends)
        return (self._joined(tuple(a[..., :used, :] for a in k_parts)),
                self._joined(tuple(a[..., :used, :] for a in v_parts)))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs) -> mx.array:
        """[rows, 1, N, columns]: query j of row r sees its row's columns up to its own."""
        columns = mx.arange(max(self.ends) + N)
        positions = mx.array(self.ends)[:, None] + mx.arange(N)[None]  # [rows, N]
        mask = columns[None, None, :] <= positions[..., None]
        if window_size is not None:
            mask = mask & (columns[None, None, :] > positions[..., None] - window_size)
        return mask[:, None]

    def _capacity(self) -> int:
        return self._parts(self.keys)[0].shape[2]

    def _grow(self, new_k, new_v, longest: int) -> None:
        capacity = (longest + self.step - 1) // self.step * self.step
        rows = len(self.ends)
        if self.keys is None:
            self.keys = self._joined(self._empty_like(new_k, rows, capacity))
            self.values = self._joined(self._empty_like(new_v, rows, capacity))
            return
        used = max(self.ends)

        def grown(arrays):
            parts = self._parts(arrays)
            room = self._empty_like(parts, rows, capacity - used)
            return self._joined(tuple(mx.concatenate([a[..., :used, :], r], axis=2)
                                      for a, r in zip(parts, room)))

        self.keys, self.values = grown(self.keys), grown(self.values)

    # --- rows ------------------------------------------------------------------------------

    def trim(self, n: int) -> int:
        """Cut every row back by n tokens."""
        self.trim_rows([n] * len(self.ends))
        return n

    def trim_rows(self, counts: list[int]) -> None:
        """Cut row r back by counts[r] tokens (rejected draft tokens, a shorter row's padding)."""
        self.ends = [max(0, e - c) for e, c in zip(self.ends, counts)]
        self.offset = mx.array(self.ends)

    @property
    def lag(self) -> int:
        """Junk columns the shortest row carries: the longest row's end minus its own."""
        return max(self.ends) - min(self.ends)

    def row_tokens(self, idx: int, start: int) -> list[mx.array]:
        """Row idx's tokens from `start` to its end, [1, heads, n, x] each, in payload order
        (keys' arrays, then values'; worker/kv_layout.py `token_arrays`)."""
        end = self.ends[idx]
        return [a[idx:idx + 1, :, start:end, :]
                for a in (*self._parts(self.keys), *self._parts(self.values))]

    def extract(self, idx: int):
        cache = self._row_cache()
        end = self.ends[idx]
        if self.keys is not None and end:
            keys = tuple(mx.contiguous(a[idx:idx + 1, :, :end, :]) for a in self._parts(self.keys))
            values = tuple(mx.contiguous(a[idx:idx + 1, :, :end, :])
                           for a in self._parts(self.values))
            cache.keys, cache.values = self._joined(keys), self._joined(values)
            cache.offset = end
        return cache

    @classmethod
    def merge(cls, caches: list) -> "BatchKV":
        """Rows left-aligned, each slot's tokens copied once."""
        batch = cls._for(caches)
        filled = [c for c in caches if c.keys is not None and c.offset]
        if not filled:
            return batch
        longest = max(batch.ends)
        capacity = (longest + cls.step) // cls.step * cls.step  # room for the next tokens

        def rows(pick) -> tuple[mx.array, ...]:
            sample = batch._parts(pick(filled[0]))
            merged = batch._empty_like(sample, len(caches), capacity)
            for i, c in enumerate(caches):
                if c.keys is None or not c.offset:
                    continue
                for out, a in zip(merged, batch._parts(pick(c))):
                    out[i:i + 1, :, :c.offset, :] = a[..., :c.offset, :]
            return batch._joined(merged)

        batch.keys = rows(lambda c: c.keys)
        batch.values = rows(lambda c: c.values)
        return batch

    def regroup(self, picks: list) -> "BatchKV":
        """A batch whose row i is this batch's row `picks[i]` (an int) or the slot cache
        `picks[i]` (a row joining, of this batch's kind). Each part is one concatenation of
        runs of this batch's rows and the joining caches, so every row is copied once; split
        and merged again, each row was copied out, zero-filled and copied back in (rows join
        and leave the decode batch at every agent's turn: docs/design/scheduling.md "The decode batch")."""
        ends = [self.ends[p] if isinstance(p, int) else (p.offset if p.keys is not None else 0)
                for p in picks]
        batch = self._with_ends(ends)
        longest = max(ends, default=0)
        if not longest:
            return batch
        # As `merge` makes it: room for the longest row and its next tokens, no wider (a
        # batch kept at the width of a long row that left would hold more than the memory
        # plan counts, common/held_kv.py).
        capacity = (longest + self.step) // self.step * self.step
        have = min(capacity, self._capacity()) if self.keys is not None else 0
        batch.keys = self._joined(self._regrouped(picks, capacity, have, lambda c: c.keys,
                                                  self._parts(self.keys)))
        batch.values = self._joined(self._regrouped(picks, capacity, have, lambda c: c.values,
                                                    self._parts(self.values)))
        return batch

    def _regrouped(self, picks: list, capacity: int, have: int, pick, ours) -> tuple:
        """`regroup`'s arrays for keys or values (`pick` takes them from a joining cache,
        `ours` are this batch's), `capacity` columns wide."""
        runs: list[list] = []  # [first row, last row] of consecutive rows of ours, or a cache
        for p in picks:
            if isinstance(p, int) and runs and isinstance(runs[-1], list) \
                    and runs[-1][1] == p - 1:
                runs[-1][1] = p
            else:
                runs.append([p, p] if isinstance(p, int) else p)
        out = []
        for k, sample in enumerate(ours):
            pieces = []
            for run in runs:
                if isinstance(run, list):
                    piece = sample[run[0]:run[1] + 1, :, :have]
                    width = have
                else:
                    if run.keys is None or not run.offset:  # an empty slot joining
                        pieces.append(mx.zeros((1, sample.shape[1], capacity, sample.shape[3]),
                                               sample.dtype))
                        continue
                    piece = self._parts(pick(run))[k][..., :run.offset, :]
                    width = run.offset
                if width < capacity:
                    piece = mx.concatenate([piece, mx.zeros(
                        (piece.shape[0], piece.shape[1], capacity - width, piece.shape[3]),
                        piece.dtype)], axis=2)
                pieces.append(piece)
            out.append(mx.concatenate(pieces, axis=0) if len(pieces) > 1 else
                       mx.contiguous(pieces[0]))
        return tuple(out)

    def _with_ends(self, ends: list[int]) -> "BatchKV":
        """An empty batch of this kind with these rows."""
        return type(self)(ends, self.row_type)

    @classmethod
    def _for(cls, caches: list) -> "BatchKV":
        return cls([c.offset if c.keys is not None else 0 for c in caches], type(caches[0]))

    # --- the rest of the cache interface ---------------------------------------------------

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset = v

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max(self.ends)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self._parts(self.keys), *self._parts(self.values)))


class BatchQuantizedKV(BatchKV):
    """Quantized KV (mlx-lm's QuantizedKVCache form); `bits` and `group_size` make mlx-lm's
    attention take its quantized path."""

    def __init__(self, ends: list[int], group_size: int, bits: int,
                 row_type: type = QuantizedKVCache):
        super().__init__(ends, row_type)
        self.group_size, self.bits = group_size, bits

    def _parts(self, arrays) -> tuple[mx.array, ...]:
        return tuple(arrays)

    def _joined(self, parts: tuple[mx.array, ...]):
        return tuple(parts)

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _row_cache(self):
        return self.row_type(self.group_size, self.bits)

    def _with_ends(self, ends: list[int]) -> "BatchQuantizedKV":
        return type(self)(ends, self.group_size, self.bits, self.row_type)

    @classmethod
    def _for(cls, caches: list[QuantizedKVCache]) -> "BatchQuantizedKV":
        first = caches[0]
        return cls([c.offset if c.keys is not None else 0 for c in caches], first.group_size,
                   first.bits, type(first))
