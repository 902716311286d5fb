"""Quantized layers on the CPU backend: many-row products as dequantize + float32 BLAS.

MLX's CPU `quantized_matmul` is a plain loop: fine for decode (a few rows, bound by reading the
packed weights) but 15-17x slower than dequantizing the weight and calling BLAS once a product
has hundreds of rows (a prefill chunk: 512 rows of SmolLM2's 576x1536 projection took 0.61 s of
CPU against 0.036 s, and its tied 49152-row output projection 20 s against 1.4 s). Layers of a
model loaded on the CPU therefore take the dequantized path from MIN_ROWS rows up: the weight is
expanded in blocks of at most BLOCK_ELEMENTS values (a transient copy, never kept), each block
multiplied, the outputs joined. The result differs from `quantized_matmul` only in float32
rounding (the same weights, summed in another order). Decode keeps `quantized_matmul`.
On Metal nothing changes (docs/design/models.md "Models for tests and the default").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MIN_ROWS = 16
BLOCK_ELEMENTS = 1 << 24  # 64 MiB of float32 per dequantized block


def quantized_product(x: mx.array, module: nn.Module) -> mx.array:
    """`x @ W.T` for the quantized weight of `module` (a QuantizedLinear or the tied output
    projection of a QuantizedEmbedding)."""
    weight, scales, biases = module["weight"], module["scales"], module.get("biases")
    rows = x.size // x.shape[-1] if x.ndim else 0
    if rows < MIN_ROWS:
        return mx.quantized_matmul(x, weight, scales=scales, biases=biases, transpose=True,
                                   group_size=module.group_size, bits=module.bits,
                                   mode=module.mode)
    num_out = weight.shape[0]
    step = max(1, BLOCK_ELEMENTS // x.shape[-1])
    parts = []
    for start in range(0, num_out, step):
        end = min(num_out, start + step)
        block = mx.dequantize(weight[start:end], scales[start:end],
                              None if biases is None else biases[start:end],
                              group_size=module.group_size, bits=module.bits, mode=module.mode,
                              dtype=x.dtype)
        parts.append(x @ block.T)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


class CpuQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = quantized_product(x, self)
        return out + self["bias"] if "bias" in self else out


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_product(x, self)


def use_cpu_quantized_products(model: nn.Module) -> int:
    """Give the model's quantized linear and embedding layers the CPU path (in place, same
    parameters); returns how many layers changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = CpuQuantizedLinear
            changed += 1
        elif type(module) is nn.QuantizedEmbedding:
            module.__class__ = CpuQuantizedEmbedding
            changed += 1
    return changed
