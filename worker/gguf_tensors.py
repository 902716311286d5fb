"""GGUF tensor blocks -> MLX arrays: quantized blocks become MLX quantized weights.

Block formats whose groups are MLX groups are converted without loss (docs/design/models.md "GGUF"):
each 32-element group of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and each 32-element sub-block of Q4_K and
Q5_K is `scale * code + bias` with one scale and one bias, which is exactly MLX's affine format
(group 32, 4/5/8 bits); MXFP4 blocks are MLX's `mxfp4` (same e2m1 codes, same e8m0 scale byte).
Only the order of the codes inside a block differs, so codes are unpacked and re-packed.
Scales and biases are computed in float32, where `d * sub_scale` is exact.

Q6_K, Q3_K and Q2_K use sub-blocks of 16 elements, a group size MLX does not have (32/64/128):
they are dequantized with `gguf.quants.dequantize` and re-quantized to affine group 32 with two
more bits than the source codes (REQUANT_BITS), which keeps the added error a fraction of the
source's own quantization step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import Q4_K as _Q4K
from gguf.quants import dequantize

GROUP = 32
FLOAT_TYPES = ("F32", "F16", "BF16")
LOSSLESS_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "MXFP4")
REQUANT_BITS = {"Q6_K": 8, "Q3_K": 5, "Q2_K": 4}
SUPPORTED_TYPES = FLOAT_TYPES + LOSSLESS_TYPES + tuple(REQUANT_BITS)


class UnsupportedTensorType(Exception):
    pass


@dataclass
class MlxTensor:
    weight: mx.array  # float, or packed uint32 codes
    scales: mx.array | None = None
    biases: mx.array | None = None
    quant: dict | None = None  # {"group_size", "bits", "mode"} when quantized
    lossless: bool = True


def convert(qtype: T, data: np.ndarray, shape: tuple[int, ...]) -> MlxTensor:
    """One GGUF tensor -> MLX. `data` is the raw tensor as GGUFReader gives it; `shape` is the
    tensor's shape in numpy order (rows first, elements of a row last)."""
    name = qtype.name
    if name == "F32":
        return MlxTensor(mx.array(np.asarray(data, np.float32).reshape(shape)))
    if name == "F16":
        return MlxTensor(mx.array(np.asarray(data).view(np.float16).reshape(shape)))
    if name == "BF16":
        bits = mx.array(np.asarray(data).view(np.uint16).reshape(shape))
        return MlxTensor(bits.view(mx.bfloat16))
    if name not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(name)
    blocks = np.asarray(data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if name in REQUANT_BITS:
        return _requantize(qtype, data, shape, REQUANT_BITS[name])
    codes, scales, biases, bits = _DECODERS[name](blocks)
    rows = shape[:-1]
    if codes.dtype == np.uint32:  # already in MLX's packing
        packed = mx.array(codes.reshape(*rows, -1))
    else:
        packed = mx.array(pack(codes.reshape(-1, shape[-1]), bits).reshape(*rows, -1))
    if name == "MXFP4":
        return MlxTensor(packed, mx.array(scales.reshape(*rows, -1)), None,
                         {"group_size": GROUP, "bits": 4, "mode": "mxfp4"})
    return MlxTensor(packed, mx.array(scales.reshape(*rows, -1)),
                     mx.array(biases.reshape(*rows, -1)),
                     {"group_size": GROUP, "bits": bits, "mode": "affine"})


_CHUNK_BLOCKS = 1 << 16  # blocks re-quantized per step: bounds the float temporaries


def _requantize(qtype: T, data: np.ndarray, shape: tuple[int, ...], bits: int) -> MlxTensor:
    """Affine over each group's own [min, max]: the error is at most half a step. (mx.quantize
    instead keeps 0 exactly representable, which can widen the step.)"""
    blocks = np.asarray(data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    parts = []
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS]
        values = _q6_k_values(chunk) if qtype == T.Q6_K else mx.array(dequantize(chunk, qtype))
        part = _affine(values.astype(mx.float32).reshape(-1, GROUP), bits)
        mx.eval(part)
        parts.append(part)
    codes, scale, lo = (mx.concatenate(p) for p in zip(*parts))
    rows = shape[:-1]
    codes = codes.reshape(-1, shape[-1])
    if bits == 8:
        packed = codes.view(mx.uint32)
    elif bits == 4:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(mx.uint32)
    else:
        packed = mx.array(pack(np.array(codes), bits))
    return MlxTensor(packed.reshape(*rows, -1), scale.reshape(*rows, -1), lo.reshape(*rows, -1),
                     {"group_size": GROUP, "bits": bits, "mode": "affine"}, lossless=False)


def _affine(g: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = (hi - lo) / (2**bits - 1)
    scale = mx.where(scale == 0, 1.0, scale)
    codes = mx.clip(mx.round((g - lo) / scale), 0, 2**bits - 1).astype(mx.uint8)
    return codes, scale, lo


def _q6_k_values(b: np.ndarray) -> mx.array:
    """gguf.quants' Q6_K dequantization in MLX ops (numpy's is the slowest step of loading a
    Q4_K_M file, whose output matrix is Q6_K): [n, 256] float32."""
    n = len(b)
    x = mx.array(b)
    low = (x[:, :128].reshape(n, 2, 1, 64) >> mx.array([0, 4], mx.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (x[:, 128:192].reshape(n, 2, 1, 32) >> mx.array([0, 2, 4, 6], mx.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).astype(mx.float32) - 32
    sc = mx.array(np.ascontiguousarray(b[:, 192:208]).view(np.int8)).astype(mx.float32)
    d = mx.array(np.ascontiguousarray(b[:, 208:210]).view(np.float16)).astype(mx.float32)
    return ((d * sc).reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, 256)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, n] (uint8, < 2**bits) -> MLX's packing: one little-endian bit stream per row,
    element i at bits [i*bits, (i+1)*bits), read as uint32 words."""
    rows, n = codes.shape
    if bits in (4, 8):  # fast path, same layout
        if bits == 8:
            return np.ascontiguousarray(codes.astype(np.uint8)).view(np.uint32)
        c = codes.astype(np.uint8).reshape(rows, n // 2, 2)
        return np.ascontiguousarray(c[..., 0] | (c[..., 1] << 4)).view(np.uint32)
    # 8 codes fill exactly `bits` bytes: build them in a uint64, keep its low bytes
    c = codes.reshape(-1, 8)
    word = np.zeros(len(c), np.uint64)
    for i in range(8):  # column by column: numpy reduces over a short axis slowly
        word |= c[:, i].astype(np.uint64) << np.uint64(i * bits)
    return np.ascontiguousarray(word.view(np.uint8).reshape(-1, 8)[:, :bits]).reshape(rows, -1).view(np.uint32)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _packed_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, c] bytes whose low nibbles are the first c elements of a run and high nibbles the next
    c -> the same 2c codes in MLX's 4-bit packing (element 2j low, 2j+1 high), as uint32 words.
    Works on bytes directly: no per-element array (this is most of a Q4_K file's load time)."""
    even, odd = qs[:, 0::2], qs[:, 1::2]
    first = (even & 0x0F) | (odd << 4)
    second = (even >> 4) | (odd & 0xF0)
    return np.ascontiguousarray(np.concatenate([first, second], axis=1)).view(np.uint32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: element j in the low nibble of byte j, j+16 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes -> [n, 32] bits: element j is bit j of the little-endian uint32."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(b):
    d = _f16(b[:, :2])
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d, 8


def _q4_0(b):
    d = _f16(b[:, :2])
    return _packed_nibbles(b[:, 2:]), d, -8 * d, 4


def _q4_1(b):
    return _packed_nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 4


def _q5_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d, 5


def _q5_1(b):
    return _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4]), 5


def _k_scales(b):
    """Q4_K/Q5_K super-block header -> per-sub-block float32 scale and bias [n, 8]."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _Q4K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] codes: 4 chunks of 32 bytes, low nibbles then high nibbles."""
    q = qs.reshape(-1, 4, 32)
    return np.stack([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def _q4_k(b):
    scale, bias = _k_scales(b)
    return _packed_nibbles(b[:, 16:144].reshape(-1, 32)).reshape(len(b), -1), scale, bias, 4


def _q5_k(b):
    scale, bias = _k_scales(b)
    high = np.unpackbits(b[:, 16:48].reshape(-1, 1, 32), axis=1, bitorder="little")  # [n, j, i]
    codes = _k_low_nibbles(b[:, 48:176])
    codes |= high.reshape(-1, 256) << 4
    return codes, scale, bias, 5


def _mxfp4(b):
    return _packed_nibbles(b[:, 1:]), b[:, :1].copy(), None, 4


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "MXFP4": _mxfp4}


def dequantize_mlx(t: MlxTensor) -> mx.array:
    """The float values an MlxTensor stands for (for tests and checks)."""
    if t.quant is None:
        return t.weight.astype(mx.float32)
    q = t.quant
    return mx.dequantize(t.weight, t.scales, t.biases, group_size=q["group_size"], bits=q["bits"],
                         mode=q["mode"]).astype(mx.float32)
