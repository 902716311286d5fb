"""How each GGUF architecture maps onto an mlx_lm model class (docs/design/models.md "GGUF").

Per architecture: llama.cpp's tensor names -> mlx_lm parameter names, its metadata -> an
mlx_lm config, and the inverse of whatever else llama.cpp's converter (convert_hf_to_gguf.py)
does to the tensors (row permutations, splits, stored transforms). worker.gguf_loading uses it;
fixtures.gguf_writer uses the inverse maps to write test files in llama.cpp's conventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from switchyard.worker.gguf_tensors import MlxTensor, dequantize_mlx
from switchyard.worker.errors import ModelLoadError

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
MOE_NAMES = {  # stacked experts: GGUF [E, out, in] is SwitchLinear's layout
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
GEMMA3_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GPT_OSS_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GLM4_MOE_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
QWEN3NEXT_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    # llama.cpp splits in_proj_qkvz into these two; qwen3next_to_mlx joins them back
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
}
DEEPSEEK2_NAMES = {
    "attn_q": "self_attn.q_proj",  # without a q LoRA (V2-Lite)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    # MLA's kv_b_proj, split per head by the converter exactly as mlx_lm splits it; older
    # files carry it whole, and mlx_lm's sanitize splits it
    "attn_k_b": "self_attn.embed_q",
    "attn_v_b": "self_attn.unembed_out",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
MINIMAX_M2_NAMES = {  # the converter stacks w1/w2/w3 per layer as gate/down/up experts
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
}
GEMMA4_NAMES = {  # Gemma 3's norms plus the per-layer input (2B/4B) modules
    **GEMMA3_NAMES,
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
GEMMA4_GLOBAL_NAMES = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                       "per_layer_model_proj": "model.per_layer_model_projection",
                       "per_layer_proj_norm": "model.per_layer_projection_norm"}
QWEN35_NAMES = {
    **{k: v for k, v in QWEN3NEXT_NAMES.items() if k not in ("ssm_ba",)},
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
_SUFFIXES = ("weight", "bias")


class Meta:
    """`{arch}.*` and general metadata of a GGUF file (common.gguf_file.GGUFFile)."""

    def __init__(self, file) -> None:
        self._file = file
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        return self._file.get(key, default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return value

    def a(self, key: str, default=None):  # an `{arch}.` key
        return self.get(f"{self.arch}.{key}", default) if default is not None else self.need(f"{self.arch}.{key}")


def dense_config(m: Meta) -> dict:
    hidden = m.a("embedding_length")
    heads = m.a("attention.head_count")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": m.a("block_count"),
        "intermediate_size": m.a("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": m.a("attention.head_count_kv", heads),
        "head_dim": m.a("attention.key_length", hidden // heads),
        "rms_norm_eps": m.a("attention.layer_norm_rms_epsilon"),
        "rope_theta": m.a("rope.freq_base", 10000.0),
        "max_position_embeddings": m.a("context_length"),
    }


def _moe_config(m: Meta) -> dict:
    return {
        "num_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises the top k
    }


def _gemma3_config(m: Meta) -> dict:
    # llama.cpp's gemma3 graph: every 6th layer global, local RoPE base 10000, queries scaled by
    # key_length**-0.5, except the 27B (62 layers): hidden / heads (its config's 168).
    scalar = m.a("attention.key_length")
    if m.a("block_count") == 62:
        scalar = m.a("embedding_length") // m.a("attention.head_count")
    return {
        "sliding_window": m.a("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
    }


def _gpt_oss_config(m: Meta) -> dict:
    layers = m.a("block_count")
    return {
        "num_local_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "intermediate_size": m.a("expert_feed_forward_length"),
        "sliding_window": m.a("attention.sliding_window"),
        # llama.cpp's gpt-oss graph: even layers sliding, odd layers full (swa pattern 2)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }


def _glm4_moe_config(m: Meta) -> dict:
    head_dim = m.a("attention.key_length")
    nextn = m.a("nextn_predict_layers", 0)
    return {
        # block_count includes the multi-token-prediction layers, which mlx_lm does not run
        "num_hidden_layers": m.a("block_count") - nextn,
        "n_routed_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "n_shared_experts": m.a("expert_shared_count"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "first_k_dense_replace": m.a("leading_dense_block_count"),
        "routed_scaling_factor": m.a("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.a("expert_weights_norm", True)),
        "n_group": m.a("expert_group_count", 1),
        "topk_group": m.a("expert_group_used_count", 1),
        "partial_rotary_factor": m.a("rope.dimension_count", head_dim) / head_dim,
    }


def _minimax_m2_config(m: Meta) -> dict:
    """MiniMax-M2: feed_forward_length is the expert size (its config's intermediate_size);
    RoPE (NeoX order, no q/k permutation) over the first rotary_dim of each head."""
    if m.a("expert_gating_func", 2) != 2:  # mlx_lm's minimax routes by sigmoid only
        raise ModelLoadError("GGUF minimax-m2 with softmax expert gating is not supported; "
                             "supported: sigmoid")
    return {
        "intermediate_size": m.a("expert_feed_forward_length"),
        "num_local_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "shared_intermediate_size": 0,
        "rotary_dim": m.a("rope.dimension_count"),
        "scoring_func": "sigmoid",
    }


def _per_layer(value, layer_types: list[str], kind: str):
    """A per-layer metadata array's value for layers of `kind` (or the scalar as it is)."""
    if not isinstance(value, list):
        return value
    picked = {v for v, t in zip(value, layer_types) if t == kind}
    return picked.pop() if len(picked) == 1 else value[layer_types.index(kind)]


def _gemma4_config(m: Meta) -> dict:
    """Gemma 4 as llama.cpp's converter writes it: key/value_length are the full-attention
    head size and the `_swa` ones the sliding layers', the sliding pattern a per-layer array,
    head_count_kv and feed_forward_length per-layer arrays where they differ."""
    if m.get(f"{m.arch}.expert_count"):
        raise ModelLoadError("GGUF gemma4 with experts (26B-A4B) is not supported; "
                             "supported: dense Gemma 4")
    layers = m.a("block_count")
    swa = list(m.a("attention.sliding_window_pattern"))
    types = ["sliding_attention" if s else "full_attention" for s in swa][:layers]
    head_swa = m.a("attention.key_length_swa")
    kv = m.a("attention.head_count_kv")
    ff = m.a("feed_forward_length")
    shared = m.a("attention.shared_kv_layers", 0)
    config = {
        "layer_types": types,
        "head_dim": head_swa,
        "global_head_dim": m.a("attention.key_length"),
        "num_key_value_heads": _per_layer(kv, types, "sliding_attention"),
        "intermediate_size": ff[0] if isinstance(ff, list) else ff,
        # the converter doubles feed_forward_length for the KV-shared layers only then
        "use_double_wide_mlp": isinstance(ff, list) and len(set(ff)) > 1,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": m.a("embedding_length_per_layer_input", 0),
        "sliding_window": m.a("attention.sliding_window"),
        "final_logit_softcapping": m.get(f"{m.arch}.final_logit_softcapping"),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": m.a("rope.freq_base")},
            "sliding_attention": {
                "rope_type": "default", "rope_theta": m.a("rope.freq_base_swa", 10000.0),
                "partial_rotary_factor": m.a("rope.dimension_count_swa", head_swa) / head_swa},
        },
    }
    if isinstance(kv, list) and "full_attention" in types:
        config["num_global_key_value_heads"] = _per_layer(kv, types, "full_attention")
    return config


def _gemma4_tensor_config(tensors: dict, config: dict) -> dict:
    """What Gemma 4's metadata leaves to its tensors: the rotated share of the full-attention
    heads is the share of rope_freqs' factors that are 1 (the converter writes 1e30 for the
    unrotated pairs of its "proportional" RoPE), keys doubling as values where a full-attention
    layer has no attn_v, the per-layer vocabulary is the table's rows."""
    out = {}
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        f = freqs.weight.astype(mx.float32)
        out["rope_parameters"] = dict(config["rope_parameters"])
        out["rope_parameters"]["full_attention"] = {
            **config["rope_parameters"]["full_attention"],
            "partial_rotary_factor": float((f == 1.0).sum().item()) / f.size}
    # 26B/31B: full-attention layers use their keys as values and have no attn_v
    own_kv = range(config["num_hidden_layers"] - config["num_kv_shared_layers"])
    out["attention_k_eq_v"] = any(
        config["layer_types"][i] == "full_attention" and f"blk.{i}.attn_v.weight" not in tensors
        for i in own_kv)
    per_layer = tensors.get("per_layer_token_embd.weight")
    if per_layer is not None:
        out["vocab_size_per_layer_input"] = per_layer.weight.shape[0]
    return out


def _linear_attention_config(m: Meta) -> dict:
    """Gated-delta layers (Qwen3-Next, Qwen3.5) as llama.cpp's `ssm.*` keys describe them."""
    value_heads = m.a("ssm.time_step_rank")
    return {
        "full_attention_interval": m.a("full_attention_interval", 4),
        "linear_conv_kernel_dim": m.a("ssm.conv_kernel"),
        "linear_key_head_dim": m.a("ssm.state_size"),
        "linear_num_key_heads": m.a("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": m.a("ssm.inner_size") // value_heads,
    }


def _qwen_moe_config(m: Meta) -> dict:
    if m.get(f"{m.arch}.expert_count") is None:
        return {}
    return {
        "num_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "shared_expert_intermediate_size": m.a("expert_shared_feed_forward_length"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _qwen3next_config(m: Meta) -> dict:
    head_dim = m.a("attention.key_length")
    return {**_linear_attention_config(m), **_qwen_moe_config(m),
            "partial_rotary_factor": m.a("rope.dimension_count", head_dim) / head_dim}


def qkvz_rows(config: dict) -> mx.array:
    """Row order that turns llama.cpp's [q all heads; k ...; v ...; z ...] (attn_qkv stacked on
    attn_gate) back into Qwen3-Next's in_proj_qkvz, grouped per key head [q_h, k_h, v_h, z_h]."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vh = config["linear_num_value_heads"] // nk * config["linear_value_head_dim"]
    starts = (0, nk * dk, 2 * nk * dk, 2 * nk * dk + nk * vh)
    rows = []
    for h in range(nk):
        for start, size in zip(starts, (dk, dk, vh, vh)):
            rows.extend(range(start + h * size, start + (h + 1) * size))
    return mx.array(rows)


def _qwen3next_to_mlx(weights: dict[str, MlxTensor], config: dict) -> None:
    """Undo llama.cpp's Qwen3-Next converter: A_log was stored as -exp(A_log), the conv kernel
    squeezed, in_proj_qkvz split in two (its norms are stored as mlx_lm keeps them, 1 + w)."""
    rows = qkvz_rows(config)
    for qkv_key in [k for k in weights if k.endswith("linear_attn.in_proj_qkv.weight")]:
        base = qkv_key[: -len("in_proj_qkv.weight")]
        qkv, z = weights.pop(qkv_key), weights.pop(f"{base}in_proj_z.weight")
        if qkv.quant != z.quant:  # differently quantized halves: join them as floats
            qkv, z = MlxTensor(dequantize_mlx(qkv)), MlxTensor(dequantize_mlx(z))
        join = lambda a, b: None if a is None else mx.concatenate([a, b])[rows]  # noqa: E731
        weights[f"{base}in_proj_qkvz.weight"] = MlxTensor(
            join(qkv.weight, z.weight), join(qkv.scales, z.scales), join(qkv.biases, z.biases),
            qkv.quant, qkv.lossless and z.lossless)
    for k, t in weights.items():
        if k.endswith("linear_attn.A_log"):
            t.weight = mx.log(-t.weight.astype(mx.float32))
        elif k.endswith("linear_attn.conv1d.weight"):
            t.weight = t.weight[..., None]  # [channels, kernel] -> mlx's [channels, kernel, 1]


def _deepseek2_config(m: Meta) -> dict:
    rope_dim = m.a("rope.dimension_count")
    # Files since llama.cpp's MLA rework give the per-head sizes as key/value_length_mla
    # (key/value_length then describe the compressed cache); older ones as key/value_length.
    key_length = m.a("attention.key_length_mla", 0) or m.a("attention.key_length")
    value_length = m.a("attention.value_length_mla", 0) or m.a("attention.value_length")
    heads = m.a("attention.head_count")
    return {
        "num_key_value_heads": heads,
        "q_lora_rank": m.a("attention.q_lora_rank", 0) or None,
        "kv_lora_rank": m.a("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": value_length,
        "n_routed_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "n_shared_experts": m.a("expert_shared_count"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "first_k_dense_replace": m.a("leading_dense_block_count"),
        "routed_scaling_factor": m.a("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.a("expert_weights_norm", False)),
        "n_group": m.a("expert_group_count", 1),
        "topk_group": m.a("expert_group_used_count", 1),
        # gating 1 = softmax (V2), 2 = sigmoid (V3)
        "scoring_func": "sigmoid" if m.a("expert_gating_func", 1) == 2 else "softmax",
        "topk_method": "noaux_tc" if m.a("expert_gating_func", 1) == 2 else "greedy",
    }


def _qwen35_config(m: Meta) -> dict:
    head_dim = m.a("attention.key_length")
    sections = m.a("rope.dimension_sections", [11, 11, 10, 0])
    rope = {"type": "default", "mrope_section": list(sections)[:3],
            "rope_theta": m.a("rope.freq_base"),
            "partial_rotary_factor": m.a("rope.dimension_count", head_dim) / head_dim}
    return {**_linear_attention_config(m), **_qwen_moe_config(m), "rope_parameters": rope}


def v_heads_grouped(config: dict, head_dim: int) -> mx.array:
    """Index that turns llama.cpp's tiled value-head order [K0 K1 .. K0 K1 ..] (its Qwen3.5
    converter's `_reorder_v_heads`) back into HF's grouped order [G0_v0 .. G0_vr, G1_v0 ..]."""
    nk = config["linear_num_key_heads"]
    r = config["linear_num_value_heads"] // nk
    return mx.array([j * nk * head_dim + k * head_dim + d
                     for k in range(nk) for j in range(r) for d in range(head_dim)])


def _take_rows(t: MlxTensor, index: mx.array) -> MlxTensor:
    pick = lambda a: None if a is None else a[index]  # noqa: E731
    return MlxTensor(pick(t.weight), pick(t.scales), pick(t.biases), t.quant, t.lossless)


def _take_v_columns(t: MlxTensor, config: dict) -> MlxTensor:
    """out_proj's input columns, value heads back to grouped order. A quantized tensor keeps its
    codes when a head spans whole quantization groups (it does in every Qwen3.5 shape): words,
    scales and biases move per head; otherwise the float values are gathered."""
    dv = config["linear_value_head_dim"]
    if t.quant is None or dv % t.quant["group_size"] or dv * t.quant["bits"] % 32:
        return MlxTensor(mx.take(dequantize_mlx(t), v_heads_grouped(config, dv), axis=-1))
    words = v_heads_grouped(config, dv * t.quant["bits"] // 32)
    groups = v_heads_grouped(config, dv // t.quant["group_size"])
    pick = lambda a, i: None if a is None else mx.take(a, i, axis=-1)  # noqa: E731
    return MlxTensor(pick(t.weight, words), pick(t.scales, groups), pick(t.biases, groups),
                     t.quant, t.lossless)


def _qwen35_to_mlx(weights: dict[str, MlxTensor], config: dict) -> None:
    """Undo llama.cpp's Qwen3.5 converter: value heads back from tiled to grouped order (only
    when there are fewer key than value heads), then what qwen3next's converter also does."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if nk != nv:
        v_rows, one = v_heads_grouped(config, dv), v_heads_grouped(config, 1)
        qk = 2 * nk * dk
        for k in list(weights):
            t = weights[k]
            if k.endswith(("in_proj_qkv.weight", "linear_attn.conv1d.weight")):  # q, k, then v
                weights[k] = _take_rows(t, mx.concatenate([mx.arange(qk), v_rows + qk]))
            elif k.endswith("in_proj_z.weight"):
                weights[k] = _take_rows(t, v_rows)
            elif k.endswith(("in_proj_a.weight", "in_proj_b.weight", "linear_attn.A_log",
                             "linear_attn.dt_bias")):
                weights[k] = _take_rows(t, one)
            elif k.endswith("linear_attn.out_proj.weight"):
                weights[k] = _take_v_columns(t, config)
    for k, t in weights.items():
        if k.endswith("linear_attn.A_log"):
            t.weight = mx.log(-t.weight.astype(mx.float32))
        elif k.endswith("linear_attn.conv1d.weight"):
            t.weight = t.weight[..., None]


def _mistral3_config(m: Meta) -> dict:
    """Ministral 3 / Mistral 3 (llama layout, q/k permuted like llama): its RoPE settings live in
    mlx_lm's `rope_parameters`, with Llama-4 attention temperature scaling."""
    rope = rope_scaling(m) or {"rope_type": "default"}
    log_mul = m.get(f"{m.arch}.rope.scaling.yarn_log_multiplier")
    if log_mul is not None:  # this converter writes mscale_all_dim itself (DeepSeek's is x0.1)
        rope["mscale"] = rope["mscale_all_dim"] = log_mul
    rope["rope_theta"] = m.a("rope.freq_base", 10000.0)
    rope["llama_4_scaling_beta"] = m.a("attention.temperature_scale", 0.0)
    rope.setdefault("original_max_position_embeddings", m.a("context_length"))
    return {"rope_parameters": rope}


def rope_scaling(m: Meta) -> dict | None:
    """`{arch}.rope.scaling.*` -> mlx_lm's rope_scaling (HF's spelling), or a refusal."""
    kind = m.get(f"{m.arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = m.a("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": m.a("rope.scaling.original_context_length")}
        for key in ("beta_fast", "beta_slow"):
            value = m.get(f"{m.arch}.rope.scaling.yarn_{key}")
            if value is not None:
                out[key] = value
        log_mul = m.get(f"{m.arch}.rope.scaling.yarn_log_multiplier")
        if log_mul and m.arch == "deepseek2":  # its converter writes 0.1 * mscale_all_dim
            out["mscale"] = out["mscale_all_dim"] = log_mul / 0.1
        return out
    raise ModelLoadError(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear, yarn")


@dataclass(frozen=True)
class Arch:
    model_type: str
    block_names: dict = field(default_factory=lambda: BLOCK_NAMES)
    extra_config: Callable[[Meta], dict] = lambda m: {}
    permuted_qk: bool = False  # llama.cpp's converter reorders q/k rows for interleaved RoPE
    norm_shift: float = 0.0  # the converter stores norm weights + this (Gemma's 1 + w)
    params: dict = field(default_factory=dict)  # GGUF "x.weight" -> an mlx_lm parameter not named .weight
    to_mlx: Callable[[dict, dict], None] | None = None  # undoes the converter's other transforms
    prefix: str = ""  # of every mlx_lm parameter name (models wrapped for vision)
    global_names: dict = field(default_factory=dict)  # arch-specific GGUF globals -> mlx_lm modules
    tensor_config: Callable[[dict, dict], dict] | None = None  # config read from tensors
    config_tensors: tuple = ()  # GGUF tensors that only describe the config (not parameters)


# GGUF architecture -> how to build the mlx_lm model. Mistral's dense models are "llama" in GGUF.
ARCHS = {
    "llama": Arch("llama", permuted_qk=True),
    "mistral3": Arch("ministral3", extra_config=_mistral3_config, permuted_qk=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "qwen3moe": Arch("qwen3_moe", {**BLOCK_NAMES, **MOE_NAMES}, _moe_config),
    "gemma3": Arch("gemma3_text", {**BLOCK_NAMES, **GEMMA3_NAMES}, _gemma3_config, norm_shift=1.0),
    "glm4moe": Arch("glm4_moe", {**BLOCK_NAMES, **MOE_NAMES, **GLM4_MOE_NAMES}, _glm4_moe_config,
                    params={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}),
    "qwen3next": Arch("qwen3_next", {**BLOCK_NAMES, **MOE_NAMES, **QWEN3NEXT_NAMES},
                      _qwen3next_config, to_mlx=_qwen3next_to_mlx,
                      params={"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}),
    "deepseek2": Arch("deepseek_v3", {**BLOCK_NAMES, **MOE_NAMES, **DEEPSEEK2_NAMES},
                      _deepseek2_config,
                      params={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}),
    "qwen35": Arch("qwen3_5", {**BLOCK_NAMES, **QWEN35_NAMES}, _qwen35_config,
                   to_mlx=_qwen35_to_mlx, prefix="language_model.",
                   params={"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}),
    "qwen35moe": Arch("qwen3_5_moe", {**BLOCK_NAMES, **MOE_NAMES, **QWEN35_NAMES}, _qwen35_config,
                      to_mlx=_qwen35_to_mlx, prefix="language_model.",
                      params={"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}),
    "minimax-m2": Arch("minimax", {**BLOCK_NAMES, **MINIMAX_M2_NAMES}, _minimax_m2_config,
                       params={"exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"}),
    "gemma4": Arch("gemma4_text", {**BLOCK_NAMES, **GEMMA4_NAMES}, _gemma4_config,
                   params={"layer_output_scale.weight": "layer_scalar"},
                   global_names=GEMMA4_GLOBAL_NAMES, tensor_config=_gemma4_tensor_config,
                   config_tensors=("rope_freqs.weight",)),
    "gpt-oss": Arch("gpt_oss", {**BLOCK_NAMES, **GPT_OSS_NAMES}, _gpt_oss_config,
                    params={"attn_sinks.weight": "self_attn.sinks"}),
}
SUPPORTED_ARCHS = tuple(ARCHS)
GGUF_ARCH_OF = {spec.model_type: name for name, spec in ARCHS.items()}  # model_type -> GGUF arch


def gguf_name(mlx_name: str, model_type: str = "qwen3") -> str:
    """mlx_lm parameter name -> GGUF tensor name (used by the writer)."""
    arch = ARCHS[GGUF_ARCH_OF[model_type]]
    mlx_name = mlx_name.removeprefix(arch.prefix)
    module, suffix = mlx_name.rsplit(".", 1)
    for gguf_mod, mlx_mod in {**GLOBAL_NAMES, **arch.global_names}.items():
        if module == mlx_mod:
            return f"{gguf_mod}.{suffix}"
    arch = ARCHS[GGUF_ARCH_OF[model_type]]
    _, _, layer, rest = mlx_name.split(".", 3)  # model.layers.N.<rest>
    params = {v: k for k, v in arch.params.items()}
    if rest in params:
        return f"blk.{layer}.{params[rest]}"
    rest = rest.rsplit(".", 1)[0]
    inverse = {v: k for k, v in arch.block_names.items()}
    if rest not in inverse:
        raise KeyError(f"no GGUF name for {mlx_name}")
    return f"blk.{layer}.{inverse[rest]}.{suffix}"


def mlx_name(name: str, arch: Arch = ARCHS["qwen3"]) -> str:
    """GGUF tensor name -> mlx_lm parameter name; unknown tensors are an error, not dropped,
    because silently ignoring one (say llama3's rope_freqs) would give a subtly wrong model."""
    return arch.prefix + _mlx_name(name, arch)


def _mlx_name(name: str, arch: Arch) -> str:
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.params:
        return f"model.layers.{parts[1]}.{arch.params[parts[2]]}"
    module, suffix = name.rsplit(".", 1)
    if suffix in _SUFFIXES:
        names = {**GLOBAL_NAMES, **arch.global_names}
        if module in names:
            return f"{names[module]}.{suffix}"
        parts = module.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.block_names:
            return f"model.layers.{parts[1]}.{arch.block_names[parts[2]]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {name!r} has no counterpart in mlx_lm's {arch.model_type} model")


def permute_qk(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's converter reorders q/k rows of `llama` models for its interleaved RoPE
    (convert_hf_to_gguf.LlamaModel.permute, mlx_lm.gguf.permute_weights)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: mx.array, n_head: int) -> mx.array:
    """Inverse of permute_qk; works on packed quantized rows, scales and biases too, because
    quantization groups run along each row."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
