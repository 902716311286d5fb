"""A GGUF file's metadata and tensor index, read in one pass over a memory map.

`gguf.GGUFReader` builds numpy views for every element of every metadata array: for a 49K-token
vocabulary with its merges that is seconds of CPU on each start of the gateway and the worker
(and on the worker's first structured-output request, which builds the grammar engine's
vocabulary). This reader decodes the metadata with `struct` and maps tensors as GGUFReader does
(same dtypes and shapes: quantized blocks as uint8 rows, the float types as their numpy type),
using gguf's own type tables. Little-endian files only, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (scalars); 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {"B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32,
          "i": np.int32, "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64,
          "d": np.float64}


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands (truncated, big-endian, unknown value type)."""


class TensorInfo(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as stored: innermost dimension first
    data: np.ndarray  # a read-only view of the mapped file


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        except struct.error as exc:
            raise GGUFFormatError(f"truncated at byte {self.pos}") from exc
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"truncated string at byte {self.pos}")
        text = bytes(self.buf[self.pos:end]).decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALARS:
                dtype = np.dtype(_NUMPY[_SCALARS[item]]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"truncated array at byte {self.pos}")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.pos}")


class GGUFFile:
    """`metadata` (key -> Python value: numbers, strings, lists) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:  # missing, unreadable, empty
            raise GGUFFormatError(f"cannot map the file: {exc}") from exc
        cursor = _Cursor(memoryview(self._map))
        if bytes(self._map[:4]) != _MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        cursor.pos = 4
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (byte order or version unsupported)")
        num_tensors, num_kv = cursor.unpack("Q"), cursor.unpack("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
            infos.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, raw_type, offset in infos:
            try:
                kind = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFFormatError(f"tensor {name}: unknown type {raw_type}") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            np_dims = tuple(reversed(dims))
            block, type_size = GGML_QUANT_SIZES[kind]
            item = _FLOAT_TYPES.get(kind.name)
            if item is None:  # quantized blocks: uint8 rows, as GGUFReader gives them
                item, count = np.uint8, n_elems * type_size // block
                np_dims = quant_shape_to_byte_shape(np_dims, kind)
            else:
                count = n_elems
            at = start + offset
            nbytes = count * np.dtype(item).itemsize
            if at + nbytes > len(self._map):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file")
            data = self._map[at:at + nbytes].view(item).reshape(np_dims)
            self.tensors.append(TensorInfo(name, kind, dims, data))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


_FLOAT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}
