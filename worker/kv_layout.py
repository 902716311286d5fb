"""The form attention KV takes in slots, batches, pages and plans: full precision or quantized.

With `--kv-bits B --kv-group-size G` every attention layer (mlx-lm `KVCache`) is an mlx-lm
`QuantizedKVCache(G, B)` from its first token: keys and values are each three arrays, the
packed values (uint32) and one scale and one bias per group of G elements of a head (in the
model's dtype), all `[batch, heads, tokens, ...]`. A token's quantized form depends on that
token alone, so pages, copies and batch rows move the packed arrays as they are, never
dequantized (docs/design.md "KV pages"). Unlike mlx_lm.generate there is no
`quantized_kv_start`: a page's bytes must not depend on where a conversation crossed a
threshold. Layers whose cache is not a `KVCache` (recurrent `ArraysCache` state, rotating
windows) keep their own, unquantized form.

mlx-lm has no batched quantized cache (its server decodes one sequence at a time when
`--kv-bits` is set); worker/batch_kv.py's `BatchQuantizedKV` is that batch, merged from and
extracted to per-slot caches like the full-precision one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from switchyard.worker.batch_kv import BatchQuantizedKV

KV_GROUP_SIZES = (32, 64, 128)


class KVQuantError(ValueError):
    """The model's attention heads cannot be quantized with the chosen group size."""


@dataclass(frozen=True)
class KVQuant:
    bits: int
    group_size: int
    rotated: bool = False  # keys (and queries) leave RoPE Hadamard-rotated: rotate_keys

    @property
    def tag(self) -> str:
        """The setting as it enters the page namespace and logs: `q8g64`, `q4g32-h`."""
        return f"q{self.bits}g{self.group_size}" + ("-h" if self.rotated else "")


def kv_quant(bits: int, group_size: int) -> KVQuant | None:
    """The quantization for `--kv-bits` (0: none) and `--kv-group-size`."""
    return KVQuant(bits, group_size) if bits else None


class QuantizedSlotCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache with the batch merge mlx-lm lacks."""

    @classmethod
    def merge(cls, caches: list) -> BatchQuantizedKV:
        return BatchQuantizedKV.merge(caches)


def apply_quant(cache: list, quant: KVQuant | None) -> list:
    """`cache` (fresh, from make_prompt_cache) with its KVCache layers quantized."""
    if quant is None:
        return cache
    return [QuantizedSlotCache(quant.group_size, quant.bits) if type(c) is KVCache else c
            for c in cache]


def check_quantizable(probe: list, quant: KVQuant | None) -> None:
    """Raise KVQuantError unless G divides every attention head dimension of `probe` (an
    unquantized cache that has seen a token)."""
    if quant is None:
        return
    dims = attention_head_dims(probe)
    bad = [d for d in dims if d % quant.group_size]
    if bad:
        fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in dims)]
        raise KVQuantError(
            f"--kv-group-size {quant.group_size} does not divide the attention head "
            f"dimension {bad[0]}; use " + (" or ".join(map(str, fits)) if fits
                                           else "no --kv-bits for this model"))


# --- rotated keys --------------------------------------------------------------------------

_HADAMARD: dict[tuple[int, mx.Dtype], mx.array] = {}


def hadamard(n: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The orthonormal n x n Hadamard matrix (Sylvester; n a power of two); symmetric, its
    own inverse."""
    key = (n, dtype)
    if key not in _HADAMARD:
        h = mx.array([[1.0]])
        while h.shape[0] < n:
            h = mx.concatenate([mx.concatenate([h, h], axis=1),
                                mx.concatenate([h, -h], axis=1)], axis=0)
        _HADAMARD[key] = (h / math.sqrt(n)).astype(dtype)
    return _HADAMARD[key]


class RotatedRoPE(nn.Module):
    """An attention layer's RoPE, followed by a Hadamard rotation of the head dimension.

    Attention takes queries and keys from the same RoPE and uses only their dot products,
    which an orthonormal rotation keeps: the layer computes what it did (to float rounding)
    while its cache holds rotated keys. Rotated, a key's few large channels (SmolLM2 has
    them after RoPE) spread over all channels, so a quantization group's scale is no longer
    set by one outlier: 4-bit keys in groups of 64 cost SmolLM2 +15% perplexity unrotated,
    about a third of that rotated (docs/design.md "Quantized KV"). Values are not touched."""

    def __init__(self, rope) -> None:
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        x = self.inner(x, *args, **kwargs)
        return x @ hadamard(x.shape[-1], x.dtype)


def rotate_keys(model: nn.Module, head_dims: list[int]) -> bool:
    """Give every module's `rope` the rotation (in place); False, and nothing changed, when a
    head dimension is not a power of two or no module has a rope."""
    if not head_dims or any(d & (d - 1) for d in head_dims):
        return False
    owners = [m for _, m in model.named_modules()
              if "rope" in m and not isinstance(m, RotatedRoPE)
              and not isinstance(m["rope"], RotatedRoPE)]
    for owner in owners:
        owner.rope = RotatedRoPE(owner.rope)
    return bool(owners)


def attention_head_dims(probe: list) -> list[int]:
    """The head dimensions of the attention KV layers of `probe` (a cache that saw a token)."""
    return sorted({a.shape[3] for c in probe if type(c) is KVCache for a in (c.keys, c.values)})


def is_attention_kv(c) -> bool:
    """A per-token attention cache that pages carry: KVCache, or its quantized form."""
    return type(c) is KVCache or isinstance(c, QuantizedKVCache)


def token_arrays(c) -> list[mx.array]:
    """The layer's arrays in payload order, each `[batch, heads, capacity, x]` with tokens on
    axis 2: keys, values; or key (packed, scales, biases) then value (packed, scales, biases)."""
    if isinstance(c, QuantizedKVCache):
        return [*c.keys, *c.values]
    return [c.keys, c.values]


def set_token_arrays(c, arrays: list[mx.array], offset: int) -> None:
    """Give the layer `arrays` (as token_arrays returns them) holding `offset` tokens."""
    if isinstance(c, QuantizedKVCache):
        half = len(arrays) // 2
        c.keys, c.values = tuple(arrays[:half]), tuple(arrays[half:])
    else:
        c.keys, c.values = arrays
    c.offset = offset


def copy_tokens(src, dst, num_tokens: int) -> None:
    """dst (fresh, same form) holds the first num_tokens of src, in arrays of its own."""
    if num_tokens:
        set_token_arrays(dst, [mx.contiguous(a[..., :num_tokens, :]) for a in token_arrays(src)],
                         num_tokens)


def kv_bytes_per_token(cache: list) -> int:
    """Bytes one token adds to the attention layers of `cache` (which has seen a token)."""
    return sum(a.shape[1] * a.shape[3] * a.dtype.size
               for c in cache if is_attention_kv(c) for a in token_arrays(c))
