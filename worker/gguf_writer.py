"""Write a tiny model as GGUF with the `gguf` package, in llama.cpp's conventions.

F32 tensors keep the GGUF twin numerically identical to the MLX directory; Q8_0/Q4_0/Q4_1 exist to
test the quantized loading path. The tokenizer goes in as llama.cpp's "gpt2" (byte-level BPE) metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import quantize

from worker.gguf_loading import gguf_name, permute_qk

QUANT_TYPES = {name: gguf.GGMLQuantizationType[name] for name in ("F32", "Q8_0", "Q4_0", "Q4_1")}
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
}
GGUF_ARCHS = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}  # model_type -> GGUF arch


def write_gguf(
    path: Path,
    config: dict,
    weights: dict[str, mx.array],
    tokenizer_json: bytes,
    chat_template: str,
    quant: str = "F32",
) -> None:
    """Write `weights` (mlx_lm names) as a GGUF file at `path` (not atomic; callers rename)."""
    arch = GGUF_ARCHS.get(config["model_type"])
    if arch is None:
        raise ValueError(f"no GGUF writer for {config['model_type']}; supported: {', '.join(GGUF_ARCHS)}")
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_TYPES)}, got {quant!r}")
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    _add_model_metadata(writer, config, quant)
    _add_tokenizer_metadata(writer, tokenizer_json, chat_template)
    for name in sorted(weights):
        _add_tensor(writer, gguf_name(name), _to_gguf_layout(name, weights[name], config), quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_model_metadata(w: gguf.GGUFWriter, config: dict, quant: str) -> None:
    w.add_name(f"tiny-{config['model_type']}")
    w.add_file_type(_FILE_TYPES[quant])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])


def _add_tokenizer_metadata(w: gguf.GGUFWriter, tokenizer_json: bytes, chat_template: str) -> None:
    data = json.loads(tokenizer_json)
    vocab = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data["added_tokens"]}
    vocab.update({content: t["id"] for content, t in added.items()})
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [
        (gguf.TokenType.CONTROL if added[t]["special"] else gguf.TokenType.USER_DEFINED)
        if t in added else gguf.TokenType.NORMAL
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_eot_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)


def _to_gguf_layout(name: str, w: mx.array, config: dict) -> np.ndarray:
    """float32 numpy; llama's q/k rows permuted the way llama.cpp's converter does it."""
    if config["model_type"] == "llama":
        if name.endswith("q_proj.weight"):
            w = permute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = permute_qk(w, config["num_key_value_heads"])
    return np.array(w.astype(mx.float32))


def _add_tensor(w: gguf.GGUFWriter, name: str, a: np.ndarray, quant: str) -> None:
    # Norms, biases and rows not divisible into 32-blocks stay F32, as llama.cpp does.
    if quant == "F32" or a.ndim != 2 or a.shape[-1] % 32 != 0:
        w.add_tensor(name, a)
        return
    qtype = QUANT_TYPES[quant]
    w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
