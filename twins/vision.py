"""Tiny vision-language twins, built from mlx-vlm's own model classes (the `vision` extra).

Each family keeps its published shape in miniature: the vision tower, the projector and the
language model of mlx-vlm's class, a config laid out as the family publishes it, random weights
(matrices scaled like the text twins, twins/models.py), the tiny tokenizer with the
family's image tokens, a chat template that writes the family's image marker for an image part,
and the processor configs (preprocessor_config.json, processor_config.json) that mlx-vlm's
processor reads offline. Images are small: a Qwen-VL twin turns a 28x28 image into one token and
caps an image at 224x224 (64 tokens); the Gemma 3 twin resizes every image to 64x64, 16 tokens.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
from mlx.utils import tree_flatten

from switchyard.twins import tokenizer as tiny_tokenizer

VISION_ARCHS = ("qwen2_5_vl", "qwen3_vl", "gemma3")
WEIGHT_SCALE = 4.0
# Gemma multiplies its input embeddings by sqrt(hidden): scaled like the other matrices, they
# drown everything else and greedy decoding repeats one token.
_EMBED_SCALE = {"gemma3": 0.25}

_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                "<|video_pad|>")
_GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# CLIP's normalization, as Qwen-VL's preprocessor_config.json has it.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _qwen_processor(processor_class: str, patch_size: int) -> dict[str, dict]:
    image = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor_class,
             "patch_size": patch_size, "merge_size": 2, "temporal_patch_size": 2,
             "min_pixels": (patch_size * 2) ** 2, "max_pixels": (patch_size * 16) ** 2,
             "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
    return {"preprocessor_config.json": image,
            "video_preprocessor_config.json": {**image, "fps": 2.0, "min_frames": 4,
                                               "max_frames": 8},
            "processor_config.json": {"processor_class": processor_class}}


def _qwen2_5_vl(ids: dict[str, int], s: dict) -> dict:
    # Published with the text settings at the top level and the vision tower's nested.
    head_dim = s["hidden"] // s["heads"]
    half = head_dim // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    return {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
        "intermediate_size": s["intermediate"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab_size"], "max_position_embeddings": s["max_position_embeddings"],
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": section},
        "tie_word_embeddings": True, "torch_dtype": "float32",
        **_qwen_token_config(ids),
        "vision_config": {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 64,
                          "intermediate_size": 128, "out_hidden_size": s["hidden"],
                          "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                          "fullatt_block_indexes": [1], "in_channels": 3,
                          "tokens_per_second": 2},
    }


def _qwen3_vl(ids: dict[str, int], s: dict) -> dict:
    half = s["head_dim"] // 2
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]  # 24:20:20 shape
    return {
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
        "torch_dtype": "float32", "tie_word_embeddings": True, **_qwen_token_config(ids),
        "text_config": {
            "model_type": "qwen3_vl_text", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["intermediate"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"], "rms_norm_eps": 1e-6, "vocab_size": s["vocab_size"],
            "max_position_embeddings": s["max_position_embeddings"], "rope_theta": 5000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": section,
                             "mrope_interleaved": True},
            "tie_word_embeddings": True, "hidden_act": "silu"},
        # Deepstack: the first vision block's output is added to the first language layer's.
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 64,
                          "intermediate_size": 128, "out_hidden_size": s["hidden"],
                          "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0], "in_channels": 3,
                          "hidden_act": "gelu_pytorch_tanh"},
    }


def _qwen_token_config(ids: dict[str, int]) -> dict:
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "vision_token_id": ids["<|vision_pad|>"],
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}


def _gemma3(ids: dict[str, int], s: dict) -> dict:
    # 64x64 images, 8x8 patches of 8 pixels, pooled 2x2 into 16 tokens.
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "float32", "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "pad_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"]],
        "mm_tokens_per_image": 16,
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["intermediate"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"], "vocab_size": s["vocab_size"], "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": s["head_dim"], "sliding_window": 128,
            "sliding_window_pattern": 2, "rope_global_base_freq": 1000000.0,
            "rope_local_base_freq": 10000.0, "mm_tokens_per_image": 16,
            "max_position_embeddings": s["max_position_embeddings"]},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "patch_size": 8, "image_size": 64,
                          "num_channels": 3, "layer_norm_eps": 1e-6},
    }


def _gemma3_processor() -> dict[str, dict]:
    return {"preprocessor_config.json": {
                "image_processor_type": "Gemma3ImageProcessor",
                "processor_class": "Gemma3Processor", "size": {"height": 64, "width": 64},
                "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": True, "do_pan_and_scan": False},
            "processor_config.json": {"processor_class": "Gemma3Processor",
                                      "image_seq_length": 16}}


_FAMILIES = {
    # arch: (image tokens, the template's marker, config, processor configs, tokenizer keys)
    "qwen2_5_vl": (_QWEN_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>", _qwen2_5_vl,
                   lambda: _qwen_processor("Qwen2_5_VLProcessor", 14), {}),
    "qwen3_vl": (_QWEN_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>", _qwen3_vl,
                 lambda: _qwen_processor("Qwen3VLProcessor", 16), {}),
    "gemma3": (_GEMMA_TOKENS, "<start_of_image>", _gemma3, _gemma3_processor,
               {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
                "extra_special_tokens": {"boi_token": "<start_of_image>",
                                         "eoi_token": "<end_of_image>",
                                         "image_token": "<image_soft_token>"}}),
}


def vision_model_parts(arch: str, seed: int, sizes: dict):
    """(text files, special token ids, config, float32 weights) of a tiny vision twin; `sizes`
    are twins/models.py's size knobs, resolved."""
    tokens, marker, make_config, processor, tokenizer_keys = _FAMILIES[arch]
    files = tiny_tokenizer.tokenizer_files(sizes["vocab_size"], tokens, marker, tokenizer_keys)
    token_ids = tiny_tokenizer.token_ids(files["tokenizer.json"])
    config = make_config(token_ids, sizes)
    for name, data in processor().items():
        files[name] = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    return files, token_ids, config, make_vision_weights(config, seed)


def make_vision_weights(config: dict, seed: int) -> dict[str, mx.array]:
    """float32 parameters of a freshly initialised mlx-vlm model (its own names, as mlx-vlm
    saves and loads them), matrices scaled like the text twins'."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    family, _ = get_model_and_args(config)
    params = copy.deepcopy(config)
    model_config = family.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, family, params,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    model = family.Model(model_config)
    embed_scale = _EMBED_SCALE.get(config["model_type"], WEIGHT_SCALE)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        w = w.astype(mx.float32)
        if w.ndim >= 2 and mx.all(w == w.reshape(-1)[0]).item():
            # A matrix a class initialises constant (Gemma 3's projector: ones) would map every
            # normalised patch to the sum of its features, about zero: random instead.
            w = mx.random.normal(w.shape) / w.shape[0] ** 0.5
        if name == "language_model.model.embed_tokens.weight":
            w = w * embed_scale
        elif w.ndim >= 2 and not name.endswith("position_embedding.weight"):
            w = w * WEIGHT_SCALE
        weights[name] = w
    mx.eval(weights)
    return weights
