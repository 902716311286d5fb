"""On the CPU backend, quantized matrices also keep a float32 copy, which forward passes use.

MLX's CPU quantized matmul dequantizes on the fly row by row: a pass over M rows costs about M
times a one-row pass, and even one row is slower than float32 sgemm with an optimized BLAS
(measured on the Q4_1 SmolLM2-135M, a loaded 2-core machine: one token 0.96 s quantized vs
0.54 s float32, nine tokens 6.5 s vs 1.2 s; one 1536x576 matrix at 512 rows 2.0 s vs 0.09 s).
A speculative verify pass, a batched decode and a prefill chunk are all many rows, so without
the copies the CPU would verify drafts at the price of decoding them one by one
(docs/design/speculative-decoding.md "Speculative decoding") and prefill at a crawl. Metal and CUDA have
multi-row quantized kernels: there nothing changes.

So on the CPU backend, when the copies fit the memory plan, each `QuantizedLinear` (and a
quantized embedding used as the output layer) keeps a float32 copy of its dequantized weight,
exact: the dequantized values are what the quantized kernel multiplies by (only the order of
float32 additions differs). The copies cost 4 bytes per weight, counted in the memory plan;
the quantized arrays stay (they are the model's parameters: fingerprint, sharding, sizes).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class _Copy:
    """Holds the float32 copy outside the module's parameters (a plain attribute)."""

    def __init__(self, weight: mx.array):
        self.weight = weight


class CopiedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        x = x @ self._float_copy.weight.T
        if "bias" in self:
            x = x + self["bias"]
        return x


class CopiedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return x @ self._float_copy.weight.T


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    """Quantized matrices without a copy yet (those the loader gave the CPU's block path,
    worker/cpu_quantized.py, included: with a copy they use it instead)."""
    return [m for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and not isinstance(m, (CopiedLinear, CopiedEmbedding))]


def wanted() -> bool:
    return mx.default_device() == mx.cpu


def copy_bytes(model: nn.Module) -> int:
    """Bytes the float32 copies would take: 4 per weight of every quantized matrix."""
    return sum(4 * m["scales"].shape[0] * m["scales"].shape[1] * m.group_size
               for m in quantized_modules(model))


def add_float_copies(model: nn.Module) -> int:
    """Give every quantized matrix its float32 copy; returns their bytes."""
    total = 0
    for m in quantized_modules(model):
        weight = mx.dequantize(m["weight"], m["scales"], m.get("biases"),
                               group_size=m.group_size, bits=m.bits, mode=m.mode)
        weight = weight.astype(mx.float32)
        mx.eval(weight)
        m._float_copy = _Copy(weight)
        m.__class__ = CopiedLinear if isinstance(m, nn.QuantizedLinear) else CopiedEmbedding
        total += weight.nbytes
    return total


def weight_bytes_read(model: nn.Module) -> int:
    """Bytes of weights one forward pass reads (an upper bound: a mixture of experts reads the
    experts its tokens pick): every parameter, except that a matrix with a float32 copy is
    read as its copy, not as its quantized arrays (docs/design/scheduling.md "Packed prefill")."""
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    for _, m in model.named_modules():
        if isinstance(m, (CopiedLinear, CopiedEmbedding)):
            total += m._float_copy.weight.nbytes - sum(
                m[k].nbytes for k in ("weight", "scales", "biases") if k in m)
    return total
