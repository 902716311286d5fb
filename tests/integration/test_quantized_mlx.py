"""MLX quantized checkpoints as mlx-lm writes them load in the worker exactly as mlx_lm loads them.

Each variant is made from the tiny qwen3 twin by mlx-lm's own converter (`mlx_lm.convert`):
affine 4-bit group 64, affine 8-bit group 32, the mixed 3/6-bit recipe and mxfp4. The worker's
loader (which also moves half-precision parameters to float32 on the CPU) must decode the same
greedy tokens as `mlx_lm.load` + `generate_step`. Serving one of them end to end:
tests/e2e/test_quantized_serving.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step

from switchyard.worker.model_loading import load_model

VARIANTS = {
    "affine4-g64": (dict(q_bits=4, q_group_size=64), {4}),
    "affine8-g32": (dict(q_bits=8, q_group_size=32), {8}),
    "mixed-3-6": (dict(quant_predicate="mixed_3_6"), {3, 6}),
    "mxfp4": (dict(q_mode="mxfp4"), {4}),
}
PROMPT = list(range(100, 160))


def greedy(model, n=24):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("name", VARIANTS)
def test_mlx_lm_quantized_checkpoint_loads_as_mlx_lm_loads_it(tmp_path, tiny_model_dir, name):
    kw, bits = VARIANTS[name]
    out = tmp_path / name
    convert(str(tiny_model_dir("qwen3")), str(out), quantize=True, **kw)
    assert "quantization" in json.loads((out / "config.json").read_text())
    loaded = load_model(str(out))
    quantized = [m for _, m in loaded.model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert len(quantized) >= 4 * 7
    assert {m.bits for m in quantized} == bits
    assert {m.mode for m in quantized} == {"mxfp4" if name == "mxfp4" else "affine"}
    reference, _ = mlx_load(str(out))
    tokens = greedy(loaded.model)
    assert len(set(tokens)) > 5
    assert tokens == greedy(reference)
