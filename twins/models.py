"""Small random-weight models in MLX format, generated deterministically from a seed.

The embedded `tiny` model (`switchyard serve --model tiny`, deploy/default_model.py) and every
family twin the tests build (fixtures/tiny_models.py adds the GGUF format). The parameters come
from mlx_lm's own model classes, so names and shapes are exactly what mlx_lm loads; each
family's config is shrunk (4-6 layers, hidden 256, 8 experts) but keeps its shape: sliding
windows, MoE, MLA, gated-delta layers, KV-shared layers, nested `text_config`. Every weight
matrix is scaled by 4: at the default init greedy decoding collapses into repeating one token,
which would make token-equality tests meaningless.

`mtp=True` (qwen3_5, qwen3_5_moe, qwen3_next) adds the multi-token-prediction head the
published checkpoints carry: `mtp.*` tensors drawn from mlx-vlm's own MTP drafter class, whose
splitter reads them back (worker/mtp.py). The qwen3_5 twins keep MLX's layout (the file says
format "mlx": the head's norms stored as applied, as an MLX conversion that kept the head
stores them); the qwen3_next twin is written in Hugging Face's layout as Qwen3-Next is
published (experts one by one, RMSNorm weights as offsets from 1, the conv kernel last, no
"mlx" format tag), so mlx-lm's and mlx-vlm's conversions of a real checkpoint are what read
it. mlx-lm's loader drops the head from the main model, as it does for the real ones.

`terse=True` (the attention archs whose layers write the residual only through `o_proj` and
`down_proj`: qwen3, qwen2, llama) makes a twin that ends its replies. A random model never picks
its end token, so an agent client's turn would only stop at the client's output limit. One
hidden dimension is made a constant (every embedding row carries TERSE_CONST there, and no layer
writes to it), so after the final norm it is positive at every position; the output head
(untied) reads that dimension only for the end-of-turn token, whose logit gains TERSE_END_GAIN
times it, and for the other control and markup tokens, which lose TERSE_MUTE times it (never
sampled: replies are plain text, without a stray `<think>` or `<tool_call>`). Under plain
sampling (temperature 1) a reply then ends after a few dozen tokens. It is lean (TERSE_SIZES):
agent clients send prompts of 20K tokens and more, and a CPU prefills them in seconds.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from switchyard.twins import tokenizer as tiny_tokenizer
from switchyard.twins.vision import VISION_ARCHS

TEXT_ARCHS = ("qwen3", "qwen3_next", "qwen2", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
              "gpt_oss", "gemma3_text", "gemma4_text", "glm4_moe", "deepseek_v3", "deepseek_v32",
              "deepseek_v41", "minimax", "mistral3")
# Vision-language twins (twins/vision.py) need the `vision` extra (mlx-vlm).
ARCHS = TEXT_ARCHS + VISION_ARCHS
WEIGHT_SCALE = 4.0

# Size knobs shared by all archs (keyword overrides of generate_tiny_model).
SIZES = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768,
              vocab_size=tiny_tokenizer.DEFAULT_VOCAB_SIZE, max_position_embeddings=32768)
_ARCH_CONFIG = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0,
              "tie_word_embeddings": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
              "tie_word_embeddings": True},
    # Untied, so the GGUF `output.weight` path is covered too.
    "llama": {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
              "tie_word_embeddings": False},
    # Qwen3-Next shape in miniature: 3 gated-delta (linear attention) layers per full-attention
    # layer, every layer a sparse MoE (8 experts, top 2) plus a shared expert.
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "rope_theta": 1000000.0,
                   "tie_word_embeddings": True, "full_attention_interval": 4,
                   "partial_rotary_factor": 0.25, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 64,
                   "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 8,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
                   "norm_topk_prob": True},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1000000.0,
                  "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 128,
                  "norm_topk_prob": True},
    # Qwen3.5: gated-delta layers with one full-attention layer in four; the text model's
    # config nests under text_config as published (see _NESTED).
    "qwen3_5": {"architectures": ["Qwen3_5ForConditionalGeneration"],
                "tie_word_embeddings": True, "full_attention_interval": 4,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4,
                "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10],
                                    "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}},
    "qwen3_5_moe": {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                    "tie_word_embeddings": False, "full_attention_interval": 4,
                    "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                    "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                    "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
                    "decoder_sparse_step": 1, "moe_intermediate_size": 128,
                    "shared_expert_intermediate_size": 256, "norm_topk_prob": True,
                    "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10],
                                        "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}},
    # gpt-oss: sliding-window (128, smaller than a KV page) and full layers alternate;
    # attention sinks; every layer a sparse MoE.
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "rope_theta": 150000,
                "sliding_window": 128, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 128, "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096},
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    # Gemma 3: one full layer per two (the real pattern is 1 in 6), window 128.
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64,
                    "sliding_window": 128, "sliding_window_pattern": 2,
                    "hidden_activation": "gelu_pytorch_tanh"},
    # Gemma 4: sliding and full layers, the last layers share the KV of earlier ones.
    "gemma4_text": {"architectures": ["Gemma4ForCausalLM"],
                    "num_kv_shared_layers": 2, "sliding_window": 128,
                    "sliding_window_pattern": 3, "global_head_dim": 64,
                    "hidden_size_per_layer_input": 16,
                    "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
                    # Untied: the scaled embedding (x sqrt(hidden)) as lm_head would saturate
                    # the soft cap and greedy decoding would repeat one token.
                    "tie_word_embeddings": False},
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "rope_theta": 1000000.0,
                 "tie_word_embeddings": False, "moe_intermediate_size": 128,
                 "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                 "n_routed_experts": 8, "routed_scaling_factor": 2.5, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "rope_scaling": None, "use_qk_norm": True,
                 "partial_rotary_factor": 0.5},
    # DeepSeek-V3 multi-head latent attention: mlx-lm caches the latent and the rope key.
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "num_key_value_heads": 4,
                    "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
                    "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "moe_intermediate_size": 128, "routed_scaling_factor": 2.5,
                    "rope_theta": 10000.0, "tie_word_embeddings": False},
    # DeepSeek-V3.2: MLA plus a sparse-attention indexer with its own key cache (CacheList).
    "deepseek_v32": {"architectures": ["DeepseekV32ForCausalLM"], "num_key_value_heads": 4,
                     "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
                     "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
                     "n_shared_experts": 1, "num_experts_per_tok": 2,
                     "first_k_dense_replace": 1, "moe_intermediate_size": 128,
                     "routed_scaling_factor": 2.5, "rope_theta": 10000.0,
                     "index_head_dim": 32, "index_n_heads": 4, "index_topk": 64,
                     "tie_word_embeddings": False},
    # DeepSeek-V4.1: a sliding window plus compressed KV groups and index keys in one
    # per-layer cache of its own (LayerCache), which cannot be cut per token.
    "deepseek_v41": {"architectures": ["DeepseekV41ForCausalLM"], "q_lora_rank": 96,
                     "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 64,
                     "moe_intermediate_size": 128, "n_routed_experts": 8,
                     "num_experts_per_tok": 2, "sliding_window": 128,
                     "compress_ratios": [0, 4, 0, 4], "index_n_heads": 4, "index_head_dim": 32,
                     "index_topk": 64, "hc_mult": 2, "candidate_topk_blocks": 16,
                     "candidate_block_size": 8},
    "minimax": {"architectures": ["MiniMaxM2ForCausalLM"], "rope_theta": 5000000.0,
                "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 0,
                "intermediate_size": 128, "rotary_dim": 32, "use_qk_norm": True,
                "scoring_func": "sigmoid", "tie_word_embeddings": False},
    # Mistral 3 / Ministral 3 as published: the ministral3 text model under text_config.
    "mistral3": {"architectures": ["Mistral3ForConditionalGeneration"],
                 "model_type_text": "ministral3", "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0,
                                     "factor": 16.0, "original_max_position_embeddings": 2048,
                                     "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "llama_4_scaling_beta": 0.1}},
}
# Families whose published checkpoints carry `mtp.*` tensors the twin can imitate; those of
# _HF_LAYOUT_MTP are written in Hugging Face's layout (the main model too).
MTP_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_HF_LAYOUT_MTP = ("qwen3_next",)
# RMSNorm weights Qwen3-Next's checkpoints store as offsets from 1 (mlx-lm adds the 1).
_HF_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight",
                    ".q_norm.weight", ".k_norm.weight", "norm_embedding.weight",
                    "norm_hidden.weight")
# Published with the text model's config under `text_config` (vision parts left out).
_NESTED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "mistral3": "ministral3"}


def tiny_config(arch: str = "qwen3", token_ids: dict[str, int] | None = None, **sizes) -> dict:
    """The config.json of a tiny model; `sizes` overrides keys of SIZES (or any config key)."""
    if arch not in TEXT_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    s = {**SIZES, **{k: v for k, v in sizes.items() if k in SIZES}}
    extra = {k: v for k, v in sizes.items() if k not in SIZES}
    ids = token_ids or {}
    config = {
        "model_type": arch,
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "intermediate_size": s["intermediate"],
        "vocab_size": s["vocab_size"],
        "max_position_embeddings": s["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
        "bos_token_id": ids.get("<|endoftext|>"),
        "eos_token_id": ids.get("<|im_end|>"),
        **_ARCH_CONFIG[arch],
        **extra,
    }
    if arch == "qwen2" and s["head_dim"] * s["heads"] != s["hidden"]:
        raise ValueError("qwen2 has no head_dim setting: head_dim * heads must equal hidden")
    config.pop("model_type_text", None)
    if arch == "gemma4_text":  # per-layer input embeddings over the same vocabulary
        config["vocab_size_per_layer_input"] = config["vocab_size"]
        if "layers" not in sizes:  # 4 own-KV layers (sliding and full) + 2 sharing KV
            config["num_hidden_layers"] = 6
    if arch in _NESTED:
        keep = ("model_type", "architectures", "tie_word_embeddings", "torch_dtype",
                "bos_token_id", "eos_token_id")
        text = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
        text["model_type"] = _NESTED[arch]
        config = {k: config[k] for k in keep} | {"text_config": text}
    return config


def make_weights(config: dict, seed: int) -> dict[str, mx.array]:
    """float32 parameters of a freshly initialised mlx_lm model, weight matrices scaled ×4.

    Reseeds MLX's global random generator (mlx_lm's layers draw their init from it)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        w = w.astype(mx.float32)
        # Matrices and stacked expert matrices; not the depthwise conv kernel (3-D, tiny).
        if w.ndim >= 2 and "conv1d" not in name:
            w = w * WEIGHT_SCALE
        elif name.endswith(".sinks"):  # attention sinks start at zero; give them a value
            w = mx.random.normal(w.shape)
        weights[name] = w
    mx.eval(weights)
    return weights


TERSE_ARCHS = ("qwen3", "qwen2", "llama")
TERSE_DIM = 0  # the hidden dimension held constant
TERSE_CONST = 4.0
TERSE_END_GAIN = 15.0  # on TERSE_SIZES: replies of 2-70 tokens, median ~11 (30 ends them at once)
TERSE_MUTE = 40.0
# An agent client's first prompt is 20K-30K tokens, and on a CPU attention over that context is
# most of a twin's cost: the terse twin has one layer of two narrow heads, which prefills such a
# prompt about 7x faster than SIZES (bench: 12K tokens, 4.8 s against 35.9 s on 2 cores).
TERSE_SIZES = dict(layers=1, heads=2, kv_heads=1, head_dim=32)


def make_terse(weights: dict[str, mx.array], config: dict, token_ids: dict[str, int]) -> None:
    """Rewrite an untied twin's weights (in place) so that sampled replies end soon and carry no
    markup tokens (see the module docstring)."""
    d = TERSE_DIM
    embed = weights["model.embed_tokens.weight"]
    embed[:, d] = TERSE_CONST
    for name, w in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[d, :] = 0.0
        elif name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
            w[d] = 0.0
    head = weights["lm_head.weight"]
    head[:, d] = 0.0
    head[token_ids[tiny_tokenizer.EOS_TOKEN], d] = TERSE_END_GAIN
    for token in (*tiny_tokenizer.CONTROL_TOKENS, *tiny_tokenizer.MARKUP_TOKENS):
        if token != tiny_tokenizer.EOS_TOKEN:
            head[token_ids[token], d] = -TERSE_MUTE
    mx.eval(weights)


def make_mtp_weights(config: dict, seed: int, hf_layout: bool = False) -> dict[str, mx.array]:
    """`mtp.*` tensors for a qwen3_5-family or qwen3_next config: the parameters of a freshly
    initialised mlx-vlm MTP drafter (its own class and its splitter's text config, so names
    and shapes are what it loads), matrices scaled like the main model's; `hf_layout`: as
    Hugging Face stores them (experts one by one, norms as offsets from 1). Reseeds MLX's
    generator."""
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model, ModelConfig

    text = get_mtp_splitter(source_config=config).read_text_config(config)
    mx.random.seed(seed)
    drafter = Model(ModelConfig.from_dict({"text_config": text}))
    weights = {}
    for name, w in tree_flatten(drafter.parameters()):
        w = w.astype(mx.float32)
        if w.ndim >= 2:
            w = w * WEIGHT_SCALE
        weights[f"mtp.{name}"] = w
    if hf_layout:
        weights = _hf_layout(weights)
    mx.eval(weights)
    return weights


def _hf_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's sanitize of Qwen3-Next undone: stacked experts split one by one, zero-centred
    norms, the conv kernel's axes as PyTorch has them."""
    out = {}
    for name, w in weights.items():
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}"] = w[e]
            continue
        if w.ndim == 1 and name.endswith(_HF_OFFSET_NORMS) and "linear_attn" not in name:
            w = w - 1.0
        elif "conv1d.weight" in name:
            w = w.moveaxis(2, 1)
        out[name] = w
    return out


def write_tiny_mlx(out: Path, arch: str = "qwen3", seed: int = 0, **sizes) -> Path:
    """Write a tiny MLX model directory to `out` and return it.

    Same arguments give byte-identical files. The directory appears atomically (written under
    a temporary name, then renamed); an existing `out` is an error, so racing writers cannot mix.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    files, token_ids, config, weights = tiny_model_parts(arch, seed, **sizes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    hf = sizes.get("mtp") and arch in _HF_LAYOUT_MTP
    try:
        _write_mlx_dir(tmp, config, weights, files, token_ids, "pt" if hf else "mlx")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_model_parts(arch: str = "qwen3", seed: int = 0, mtp: bool = False,
                     terse: bool = False, **sizes):
    """(tokenizer files, special token ids, config, float32 weights) of a tiny model; `mtp`:
    with the family's multi-token-prediction head (MTP_ARCHS); `terse`: a twin whose sampled
    replies end after a few dozen tokens (TERSE_ARCHS, make_terse)."""
    if mtp and arch not in MTP_ARCHS:
        raise ValueError(f"no MTP head for {arch!r}; supported: {', '.join(MTP_ARCHS)}")
    if terse and arch not in TERSE_ARCHS:
        raise ValueError(f"no terse twin of {arch!r}; supported: {', '.join(TERSE_ARCHS)}")
    if terse:  # the output head reads the constant dimension: it must not be the embedding
        sizes = {**TERSE_SIZES, **sizes, "tie_word_embeddings": False}
    if arch in VISION_ARCHS:
        from switchyard.twins.vision import vision_model_parts

        return vision_model_parts(arch, seed, {**SIZES, **sizes})
    files = tiny_tokenizer.tokenizer_files()
    token_ids = tiny_tokenizer.token_ids(files["tokenizer.json"])
    config = tiny_config(arch, token_ids, **sizes)
    if mtp:  # as published: one MTP layer, sharing the main model's embeddings
        config.get("text_config", config).update(mtp_num_hidden_layers=1,
                                                 mtp_use_dedicated_embeddings=False)
    num_tokens = max(token_ids.values()) + 1
    # Larger is fine: unused rows, as in Qwen's vocabularies.
    if config.get("text_config", config)["vocab_size"] < num_tokens:
        raise ValueError(f"vocab_size must be at least the tokenizer's {num_tokens}")
    weights = make_weights(config, seed)
    if terse:
        make_terse(weights, config, token_ids)
    if mtp:
        hf = arch in _HF_LAYOUT_MTP
        weights = (_hf_layout(weights) if hf else weights) | make_mtp_weights(config, seed + 1, hf)
    return files, token_ids, config, weights


def _write_mlx_dir(d: Path, config: dict, weights: dict, files: dict[str, bytes], ids: dict,
                   fmt: str = "mlx") -> None:
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": fmt})
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    texts = {
        "config.json": _json(config),
        "generation_config.json": _json(generation),
        **files,
    }
    for name, data in texts.items():
        (d / name).write_bytes(data)


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
