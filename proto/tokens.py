"""`TokenIds`: an immutable run of token ids, packed as uint32.

Prompts are 50K-150K tokens. As a msgpack array every id would be one Python int to build
and one to parse (milliseconds per message); packed, a token list crosses the wire as one
msgpack `ext` value and is copied once, never parsed (docs/design.md "Protocol"). Inside a
process it is an ordinary read-only sequence of ints: len, indexing, slicing (a `TokenIds`),
iteration, `+`, and equality with tuples and lists of the same ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import overload

_TYPECODE = "I"
if array(_TYPECODE).itemsize != 4:  # the wire form is 4 bytes a token on every platform
    _TYPECODE = "L"
if array(_TYPECODE).itemsize != 4:
    raise ImportError("this platform has no 4-byte unsigned array type")


class TokenIds(Sequence[int]):
    __slots__ = ("_ids",)

    def __init__(self, ids: Iterable[int] = ()):
        if isinstance(ids, TokenIds):
            self._ids = ids._ids  # immutable: sharing is safe
        else:  # a copy, also of an array: the caller may change theirs
            try:
                self._ids = array(_TYPECODE, ids)
            except OverflowError:
                raise ValueError("token ids must be in [0, 2**32)") from None

    @staticmethod
    def frombytes(data: bytes | bytearray | memoryview) -> TokenIds:
        """From the wire form: native-order uint32s (the wire never leaves the machine)."""
        if len(data) % 4:
            raise ValueError(f"token ids: {len(data)} bytes is not a whole number of uint32")
        ids = array(_TYPECODE)
        ids.frombytes(data)
        return _wrap(ids)

    def tobytes(self) -> bytes:
        return self._ids.tobytes()

    def view(self) -> memoryview:
        """The packed ids as read-only bytes, without a copy (what the codec sends)."""
        return memoryview(self._ids).cast("B").toreadonly()

    def tolist(self) -> list[int]:
        return self._ids.tolist()

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return _wrap(self._ids[index])
        return self._ids[index]

    def __iter__(self):
        return iter(self._ids)

    def __contains__(self, token) -> bool:
        return token in self._ids

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenIds):
            return self._ids == other._ids
        if isinstance(other, (tuple, list)):
            return len(other) == len(self._ids) and self._ids.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._ids))  # equal to a tuple of the same ids, so the same hash

    def __add__(self, other: Sequence[int]) -> TokenIds:
        if not isinstance(other, Sequence):
            return NotImplemented
        return _wrap(self._ids + as_token_ids(other)._ids)

    def __radd__(self, other: Sequence[int]) -> TokenIds:
        if not isinstance(other, Sequence):
            return NotImplemented
        return _wrap(as_token_ids(other)._ids + self._ids)

    def __array__(self, dtype=None, copy=None):
        """numpy sees the packed ids without a copy (page hashing: `common.page_ids`)."""
        import numpy as np

        arr = np.frombuffer(self._ids, dtype=np.uint32)
        arr.flags.writeable = False
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        n = len(self._ids)
        if n <= 16:
            return f"TokenIds({self._ids.tolist()})"
        head = ", ".join(map(str, self._ids[:8]))
        tail = ", ".join(map(str, self._ids[-4:]))
        return f"TokenIds([{head}, ..., {tail}], {n} tokens)"


def _wrap(ids: array) -> TokenIds:
    """A `TokenIds` that takes `ids` over (no copy): only for arrays nobody else holds."""
    out = TokenIds.__new__(TokenIds)
    out._ids = ids
    return out


def as_token_ids(ids: Iterable[int]) -> TokenIds:
    """`ids` itself when it is a `TokenIds` already, else a packed copy."""
    return ids if isinstance(ids, TokenIds) else TokenIds(ids)
