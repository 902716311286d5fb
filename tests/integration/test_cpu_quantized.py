"""Quantized layers on the CPU: many-row products go through dequantize + BLAS with the same
result as MLX's quantized_matmul up to float32 rounding; few rows stay on quantized_matmul."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from switchyard.worker import cpu_quantized
from switchyard.worker.cpu_quantized import (MIN_ROWS, CpuQuantizedEmbedding, CpuQuantizedLinear,
                                             use_cpu_quantized_products)

MODES = [dict(bits=4, group_size=32), dict(bits=8, group_size=64),
         dict(bits=4, group_size=32, mode="mxfp4")]


def quantized_linear(in_dims, out_dims, bias, **quant):
    mx.random.seed(1)
    linear = nn.Linear(in_dims, out_dims, bias=bias)
    if bias:
        linear.bias = mx.random.normal((out_dims,))
    return nn.QuantizedLinear.from_linear(linear, **quant)


def close(a, b):
    scale = mx.abs(b).max().item()
    return mx.abs(a - b).max().item() <= 1e-5 * max(scale, 1.0)


@pytest.mark.parametrize("quant", MODES, ids=lambda q: q.get("mode", "affine") + str(q["bits"]))
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_quantized_matmul(quant, bias, monkeypatch):
    layer = quantized_linear(256, 96, bias, **quant)
    few = mx.random.normal((1, MIN_ROWS - 1, 256))
    many = mx.random.normal((2, 40, 256))
    want_few, want_many = layer(few), layer(many)
    use_cpu_quantized_products(layer)
    assert type(layer) is CpuQuantizedLinear
    assert mx.array_equal(layer(few), want_few)  # decode: the same kernel
    assert close(layer(many), want_many)
    monkeypatch.setattr(cpu_quantized, "BLOCK_ELEMENTS", 256 * 40)  # 3 blocks of 40 rows
    assert close(layer(many), want_many)


def test_tied_embedding_output_projection():
    mx.random.seed(2)
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(1000, 64), group_size=32,
                                                     bits=4)
    hidden = mx.random.normal((1, 50, 64))
    want = embedding.as_linear(hidden)
    tokens = mx.array([[3, 999]])
    looked_up = embedding(tokens)
    use_cpu_quantized_products(embedding)
    assert type(embedding) is CpuQuantizedEmbedding
    assert close(embedding.as_linear(hidden), want)
    assert mx.array_equal(embedding(tokens), looked_up)


def test_a_model_loaded_on_the_cpu_uses_it(tiny_model_dir, tmp_path):
    from mlx_lm.convert import convert

    from switchyard.worker.model_loading import load_model

    out = tmp_path / "q4"
    convert(str(tiny_model_dir("qwen3")), str(out), quantize=True, q_bits=4, q_group_size=32)
    model = load_model(str(out)).model
    kinds = {type(m) for _, m in model.named_modules()}
    assert CpuQuantizedLinear in kinds and nn.QuantizedLinear not in kinds
