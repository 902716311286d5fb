"""Load a GGUF file (llama.cpp's format) into an mlx_lm model.

mlx-lm has no GGUF loader, but `mx.load(path, return_metadata=True)` reads the tensors: F32/F16
as they are (BF16 becomes F16), Q8_0/Q4_0/Q4_1 as MLX affine triplets with group size 32, and
Q2_K/Q4_K/Q6_K dequantized to F16. Other types fail inside mx.load. This module maps llama.cpp's
metadata and tensor names onto mlx_lm's qwen2, qwen3 and llama models.
"""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from worker.model_loading import ModelLoadError

# GGUF architecture -> mlx_lm model_type
SUPPORTED_ARCHS = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama"}
# Tensor types mx.load can read (see notes/mlx.md §4).
READABLE_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q4_K", "Q6_K", "I8", "I32"]

# llama.cpp tensor names -> mlx_lm module paths (inverse of gguf.get_tensor_name_map).
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SUFFIXES = ("weight", "bias", "scales", "biases")


def gguf_name(mlx_name: str) -> str:
    """mlx_lm parameter name -> GGUF tensor name (used by the writer)."""
    module, suffix = mlx_name.rsplit(".", 1)
    for gguf_mod, mlx_mod in GLOBAL_NAMES.items():
        if module == mlx_mod:
            return f"{gguf_mod}.{suffix}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    inverse = {v: k for k, v in BLOCK_NAMES.items()}
    if rest not in inverse:
        raise KeyError(f"no GGUF name for {mlx_name}")
    return f"blk.{layer}.{inverse[rest]}.{suffix}"


def mlx_name(name: str) -> str:
    """GGUF tensor name -> mlx_lm parameter name; unknown tensors are an error, not dropped,
    because silently ignoring one (say llama3's rope_freqs) would give a subtly wrong model."""
    module, suffix = name.rsplit(".", 1)
    if suffix in _SUFFIXES:
        if module in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[module]}.{suffix}"
        parts = module.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
            return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {name!r} has no counterpart in mlx_lm's model")


def permute_qk(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's converter reorders q/k rows of `llama` models for its interleaved RoPE
    (convert_hf_to_gguf.LlamaModel.permute, mlx_lm.gguf.permute_weights)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: mx.array, n_head: int) -> mx.array:
    """Inverse of permute_qk; works on packed quantized rows, scales and biases too, because
    quantization groups run along each row."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict]:
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:  # mx.load gives a bare RuntimeError; find out which type it could not read
        bad = _unreadable_types(path)
        if bad:
            raise ModelLoadError(
                f"{path}: GGUF tensor types {', '.join(bad)} cannot be loaded by MLX; "
                f"supported types: {', '.join(READABLE_TYPES)}"
            ) from e
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def _unreadable_types(path: Path) -> list[str]:
    import gguf  # only needed on this error path

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:
        return []
    types = {t.tensor_type.name for t in reader.tensors}
    return sorted(types - set(READABLE_TYPES))


def gguf_config(metadata: dict, arrays: dict[str, mx.array]) -> dict:
    """An mlx_lm/HF-style config from `{arch}.*` metadata."""
    arch = _scalar(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # its parameters are not mapped; the model would be wrong
        raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported; supported: none")
    hidden = _scalar(metadata, f"{arch}.embedding_length")
    heads = _scalar(metadata, f"{arch}.attention.head_count")
    config = {
        "model_type": SUPPORTED_ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(metadata, f"{arch}.block_count"),
        "intermediate_size": _scalar(metadata, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(metadata, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _scalar(metadata, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _scalar(metadata, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _scalar(metadata, f"{arch}.context_length"),
        "vocab_size": arrays["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in arrays,
    }
    if "tokenizer.ggml.eos_token_id" in metadata:
        config["eos_token_id"] = _scalar(metadata, "tokenizer.ggml.eos_token_id")
    return config


def gguf_weights(arrays: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    weights = {mlx_name(k): v for k, v in arrays.items()}
    if config["model_type"] == "llama":
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for k, v in weights.items():
            proj = k.split(".")[-2]
            if proj in heads:
                weights[k] = unpermute_qk(v, heads[proj])
    return weights


def _quantize_from_weights(model: nn.Module, weights: dict[str, mx.array]) -> Counter:
    """Turn every module whose weight came packed (it has .scales) into its quantized twin."""
    bits_seen: Counter = Counter()

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        bits = weights[f"{path}.weight"].shape[-1] * 32 // module.weight.shape[-1]
        bits_seen[bits] += 1
        return {"group_size": 32, "bits": bits}

    nn.quantize(model, group_size=32, bits=8, class_predicate=predicate)
    return bits_seen


def load_gguf(path: Path) -> tuple[nn.Module, dict]:
    arrays, metadata = read_gguf(path)
    config = gguf_config(metadata, arrays)
    weights = gguf_weights(arrays, config)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)
    bits = _quantize_from_weights(model, weights)
    if bits:
        config["quantization"] = {"group_size": 32, "bits": bits.most_common(1)[0][0]}
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not match the {config['model_type']} model: {e}") from e
    return model, config
