"""Load a GGUF file (llama.cpp's format) into an mlx_lm model.

mlx-lm has no GGUF loader. common.gguf_file memory-maps the file; worker.gguf_tensors turns each
tensor's blocks into MLX arrays (quantized blocks into MLX quantized weights, without loss where
the formats match); worker.gguf_archs maps llama.cpp's metadata and tensor names onto mlx_lm's
model classes, per architecture (docs/design/models.md "GGUF"). Anything it cannot map exactly (a tensor
type, an architecture, a tensor name, a RoPE scaling) is refused with one line naming what is
supported.
"""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from switchyard.worker.gguf_archs import (ARCHS, SUPPORTED_ARCHS, Arch, Meta, dense_config, mlx_name,
                               rope_scaling, unpermute_qk)
from switchyard.worker.gguf_tensors import (SUPPORTED_TYPES, MlxTensor, UnsupportedTensorType, convert,
                                 dequantize_mlx)
from switchyard.worker.errors import ModelLoadError
from switchyard.common.gguf_file import GGUFFile, GGUFFormatError

def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFFormatError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def check_supported(path: Path, reader, meta: Meta) -> Arch:
    """Refuse, in one line, what cannot be loaded: the architecture or any tensor type."""
    if meta.arch not in ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {meta.arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise ModelLoadError(f"{path}: GGUF tensor types {', '.join(bad)} are not supported; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
    try:
        rope_scaling(meta)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return ARCHS[meta.arch]


def gguf_config(meta: Meta, arch: Arch, tensors: dict[str, MlxTensor]) -> dict:
    """An mlx_lm/HF-style config from the file's metadata."""
    config = {"model_type": arch.model_type, **dense_config(meta), **arch.extra_config(meta),
              "vocab_size": tensors["token_embd.weight"].weight.shape[0],
              "tie_word_embeddings": "output.weight" not in tensors, "rope_scaling": rope_scaling(meta),
              "attention_bias": "blk.0.attn_q.bias" in tensors,
              "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}
    if arch.tensor_config is not None:
        config.update(arch.tensor_config(tensors, config))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = eos
    return config


def _read_tensors(path: Path, reader) -> dict[str, MlxTensor]:
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        try:
            out[t.name] = convert(t.tensor_type, t.data, shape)
        except UnsupportedTensorType as e:  # check_supported ran first; kept for safety
            raise ModelLoadError(f"{path}: GGUF tensor type {e} is not supported") from e
    return out


def gguf_weights(tensors: dict[str, MlxTensor], config: dict, arch: Arch) -> dict[str, MlxTensor]:
    n_layers = config["num_hidden_layers"]
    weights = {mlx_name(k, arch): v for k, v in tensors.items()
               if not (k.startswith("blk.") and int(k.split(".")[1]) >= n_layers)
               and k not in arch.config_tensors}
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for k, t in weights.items():
        proj = k.split(".")[-2]
        if arch.permuted_qk and proj in heads:
            n = heads[proj]
            t.weight = unpermute_qk(t.weight, n)
            t.scales = None if t.scales is None else unpermute_qk(t.scales, n)
            t.biases = None if t.biases is None else unpermute_qk(t.biases, n)
        if arch.norm_shift and k.endswith("norm.weight"):
            t.weight = t.weight.astype(mx.float32) - arch.norm_shift
    if arch.to_mlx is not None:
        arch.to_mlx(weights, config)
    return weights


def _quantize_modules(model: nn.Module, weights: dict[str, MlxTensor]) -> dict:
    """Turn every module whose weight came quantized into its quantized twin; returns the
    mlx-lm style "quantization" config (per-module entries where they differ)."""
    modules = dict(model.named_modules())
    for k, t in weights.items():  # no quantized twin for this module (or none at all): floats
        if t.quant is not None and not hasattr(modules.get(k[: -len(".weight")]), "to_quantized"):
            weights[k] = MlxTensor(dequantize_mlx(t))
    per_module = {k[: -len(".weight")]: t.quant for k, t in weights.items()
                  if t.quant is not None and k.endswith(".weight")}

    def predicate(path: str, module: nn.Module):
        q = per_module.get(path)
        return dict(q) if q is not None and hasattr(module, "to_quantized") else False

    nn.quantize(model, class_predicate=predicate)
    if not per_module:
        return {}
    common = Counter((q["group_size"], q["bits"], q["mode"]) for q in per_module.values())
    (group, bits, mode), _ = common.most_common(1)[0]
    return {"group_size": group, "bits": bits, "mode": mode, **per_module}


def _on_gpu() -> bool:
    return mx.default_device().type != mx.DeviceType.cpu


def _flat(weights: dict[str, MlxTensor]) -> dict[str, mx.array]:
    flat = {}
    for k, t in weights.items():
        flat[k] = t.weight
        base = k[: -len(".weight")]
        for name, a in (("scales", t.scales), ("biases", t.biases)):
            if a is not None:
                flat[f"{base}.{name}"] = a
    return flat


def _half_on_gpu(model: nn.Module) -> None:
    """On a GPU, float32/bfloat16 parameters (norms, routers, biases, affine scales) become
    float16, as in mlx-lm's own half-precision checkpoints: one float32 scale or norm would turn
    the activations and the KV cache float32, twice the memory (docs/design/models.md "GGUF"). Scales
    are float32 where the block formats' `d * sc` is exact; float16 rounds them by 2**-11."""
    if not _on_gpu():
        return
    keep = getattr(model, "cast_predicate", lambda path: True)  # mlx_lm's own exceptions (A_log)
    half = [(path, a.astype(mx.float16)) for path, a in tree_flatten(model.parameters())
            if a.dtype in (mx.float32, mx.bfloat16) and keep(path)]
    model.load_weights(half, strict=False)


def load_gguf(path: Path) -> tuple[nn.Module, dict]:
    reader = _open(path)
    meta = Meta(reader)
    arch = check_supported(path, reader, meta)
    tensors = _read_tensors(path, reader)
    try:
        config = gguf_config(meta, arch, tensors)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    weights = gguf_weights(tensors, config, arch)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    quantization = _quantize_modules(model, weights)
    if quantization:
        config["quantization"] = quantization
    flat = model.sanitize(_flat(weights))
    model.eval()
    try:
        model.load_weights(list(flat.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not match the {config['model_type']} model: {e}") from e
    _half_on_gpu(model)
    return model, config

