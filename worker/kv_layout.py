"""The form attention KV takes in slots, batches, pages and plans: full precision or quantized.

With `--kv-bits B --kv-group-size G` every attention layer (mlx-lm `KVCache`) is an mlx-lm
`QuantizedKVCache(G, B)` from its first token: keys and values are each three arrays, the
packed values (uint32) and one scale and one bias per group of G elements of a head (in the
model's dtype), all `[batch, heads, tokens, ...]`. A token's quantized form depends on that
token alone, so pages, copies and batch rows move the packed arrays as they are, never
dequantized (docs/design/kv-pages.md "KV pages"). Unlike mlx_lm.generate there is no
`quantized_kv_start`: a page's bytes must not depend on where a conversation crossed a
threshold. Layers whose cache is not a `KVCache` (recurrent `ArraysCache` state, rotating
windows) keep their own, unquantized form.

mlx-lm has no batched quantized cache (its server decodes one sequence at a time when
`--kv-bits` is set); worker/batch_kv.py's `BatchQuantizedKV` is that batch, merged from and
extracted to per-slot caches like the full-precision one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import numpy as np

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from switchyard.worker.batch_kv import BatchQuantizedKV

KV_GROUP_SIZES = (32, 64, 128)
# `--kv-group-size 0`: the first of these that divides every head dimension. 4-bit keys need
# the finer groups: SmolLM2's perplexity on code is +5.6% at 64, +4.3% at 32 (centred keys).
PREFERRED_GROUP_SIZES = {8: (64, 32, 128), 4: (32, 64, 128)}


class KVQuantError(ValueError):
    """The model's attention heads cannot be quantized with the chosen group size."""


@dataclass(frozen=True)
class KVQuant:
    bits: int
    group_size: int
    rotated: bool = False  # keys (and queries) leave RoPE Hadamard-rotated: rotate_keys
    centre: str = ""  # digest of the mean subtracted from every key (center_keys), or ""

    @property
    def tag(self) -> str:
        """The setting as it enters the page namespace and logs: `q8g64`, `q4g32-h`,
        `q4g64-hc1a2b3c4d` (keys centred by the mean with that digest)."""
        return (f"q{self.bits}g{self.group_size}" + ("-h" if self.rotated else "")
                + (f"c{self.centre}" if self.centre else ""))


def kv_quant(bits: int, group_size: int = 0) -> KVQuant | None:
    """The quantization for `--kv-bits` (0: none) and `--kv-group-size` (0: chosen by
    `fit_group_size` once the head dimensions are known)."""
    return KVQuant(bits, group_size) if bits else None


def fit_group_size(probe: list, quant: KVQuant) -> KVQuant:
    """`quant` with its group size chosen when it is 0: the first preferred one for its bits
    that divides every attention head dimension of `probe` (check_quantizable refuses the
    model if none does)."""
    if quant.group_size:
        return quant
    dims = attention_head_dims(probe)
    preferred = PREFERRED_GROUP_SIZES[quant.bits]
    fits = [g for g in preferred if all(d % g == 0 for d in dims)]
    return dataclasses.replace(quant, group_size=(fits or preferred)[0])


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
    about a third of that rotated (docs/design/kv-pages.md "Quantized KV"). Values are not touched."""

    def __init__(self, rope) -> None:
        super().__init__()
        self.inner = rope
        # Subtracted from keys (center_keys): `[kv heads, 1, head dim]`. Keys are told from
        # queries by their head count (fewer, grouped-query attention). Underscored names are
        # not parameters of an MLX module.
        self._key_shift: mx.array | None = None
        self._sums: dict[int, tuple[mx.array, int]] | None = None  # calibrating: heads -> sum

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        x = self.inner(x, *args, **kwargs)
        x = x @ hadamard(x.shape[-1], x.dtype)
        if self._sums is not None and x.ndim == 4:
            total, count = self._sums.get(x.shape[1], (0, 0))
            self._sums[x.shape[1]] = (total + x.astype(mx.float32).sum(axis=(0, 2)),
                                      count + x.shape[0] * x.shape[2])
        if self._key_shift is not None and x.ndim == 4 and x.shape[1] == len(self._key_shift):
            x = x - self._key_shift
        return x


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


def center_keys(model: nn.Module, tokens: list[int]) -> str:
    """Subtract from every key its layer's mean key, measured on `tokens`; the mean's digest
    (for the KV form), or "" when nothing was centred.

    A vector subtracted from every key changes each query's scores by one constant, which
    softmax ignores, so attention is unchanged; what the mean removes is the part of the keys
    that is the same for every token, which per-token quantization groups cannot (SmolLM2's
    4-bit KV: docs/design/kv-pages.md "Quantized KV"). Only where keys have fewer heads than queries
    (told apart by that), and only if the model's output on `tokens` is unchanged: attention
    sinks or soft-capped scores would break the invariance, and then nothing is centred."""
    ropes = [m for _, m in model.named_modules() if isinstance(m, RotatedRoPE)]
    if not ropes:
        return ""
    inputs = mx.array(tokens)[None]
    for rope in ropes:
        rope._sums = {}
    try:
        plain = model(inputs)
        mx.eval(plain)
        shifts = [_key_mean(rope._sums) for rope in ropes]
        if any(shift is None for shift in shifts):
            return ""
        shifts = [shift.astype(mx.float16).astype(plain.dtype)  # fewer stray bits
                  for shift in shifts]
        for rope, shift in zip(ropes, shifts):
            rope._key_shift = shift
        if not _same_output(plain, model(inputs)):
            raise ValueError("centred keys change this model's output")
    except Exception:  # a model that cannot run without its cache, or is not invariant
        for rope in ropes:
            rope._key_shift = None
        return ""
    finally:
        for rope in ropes:
            rope._sums = None
    digest = hashlib.blake2b(digest_size=4)
    for shift in shifts:
        digest.update(np.asarray(shift.astype(mx.float32)).tobytes())
    return digest.hexdigest()


CALIBRATION_TOKENS = 512


def calibration_tokens(vocab_size: int) -> list[int]:
    """The fixed tokens the key means are measured on (seeded: the same on every start, so a
    model's pages keep their KV form)."""
    rng = np.random.default_rng(20261201)
    return [int(t) for t in rng.integers(0, vocab_size, CALIBRATION_TOKENS)]


def _key_mean(sums: dict[int, tuple[mx.array, int]]) -> mx.array | None:
    """The mean key `[kv heads, 1, dim]`: of the calls with the fewest heads, when queries
    (more heads) were seen too."""
    if len(sums) != 2:
        return None
    total, count = sums[min(sums)]
    return (total / count)[:, None, :]


def _same_output(want: mx.array, got: mx.array) -> bool:
    """Log-probabilities equal to the dtype's rounding (a broken invariance moves them by
    far more)."""
    tolerance = 1e-2 if want.dtype == mx.float32 else 0.25
    want, got = (x.astype(mx.float32) for x in (want, got))
    want = want - mx.logsumexp(want, axis=-1, keepdims=True)
    got = got - mx.logsumexp(got, axis=-1, keepdims=True)
    return float(mx.max(mx.abs(want - got)).item()) <= tolerance


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
