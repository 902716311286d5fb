"""GGUF as published: every tensor type and architecture worker.gguf_loading reads.

Block-level checks build blocks from known values (fixtures.gguf_blocks lays out K-quant fields
byte by byte; gguf.quants.quantize cannot) and compare what the loader makes of them against
`gguf.quants.dequantize`: bit-exact for the types converted without loss, within half a step of
the MLX target format for the re-quantized ones. File-level checks write the tiny twins as GGUF
(F32 twins must decode exactly as their MLX models; quantized ones must load every tensor as the
file's own values and decode).
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from fixtures import gguf_blocks, gguf_writer
from switchyard.twins import tokenizer as tiny_tokenizer
from switchyard.twins.models import make_weights, tiny_config
from switchyard.worker import gguf_archs, gguf_loading
from switchyard.worker.gguf_tensors import LOSSLESS_TYPES, REQUANT_BITS, MlxTensor, convert, dequantize_mlx
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.model_loading import load_model

RNG = np.random.default_rng(7)
PROMPT = list(range(100, 140))


def known_blocks(qtype: T, n: int) -> np.ndarray:
    """n blocks' raw bytes from explicitly chosen fields (K-quants) or values (the rest)."""
    r = RNG
    if qtype == T.Q4_K or qtype == T.Q5_K:
        pack = gguf_blocks.pack_q4_k if qtype == T.Q4_K else gguf_blocks.pack_q5_k
        levels = 16 if qtype == T.Q4_K else 32
        return pack(r.uniform(1e-3, 1e-2, n), r.uniform(1e-3, 1e-2, n), r.integers(0, 64, (n, 8)),
                    r.integers(0, 64, (n, 8)), r.integers(0, levels, (n, 256)))
    if qtype == T.Q6_K:
        return gguf_blocks.pack_q6_k(r.uniform(1e-3, 1e-2, n), r.integers(-128, 128, (n, 16)),
                                     r.integers(-32, 32, (n, 256)))
    if qtype == T.Q3_K:
        return gguf_blocks.pack_q3_k(r.uniform(1e-3, 1e-2, n), r.integers(-32, 32, (n, 16)),
                                     r.integers(-4, 4, (n, 256)))
    if qtype == T.Q2_K:
        return gguf_blocks.pack_q2_k(r.uniform(1e-3, 1e-2, n), r.uniform(1e-3, 1e-2, n),
                                     r.integers(0, 16, (n, 16)), r.integers(0, 16, (n, 16)),
                                     r.integers(0, 4, (n, 256)))
    values = r.normal(size=(n, gguf.GGML_QUANT_SIZES[qtype][0])).astype(np.float32)
    return quantize(values, qtype)


def test_k_quant_blocks_hold_the_fields_they_were_built_from():
    """The block builders are right by construction, not only by agreeing with the loader."""
    d, dmin = np.array([0.5]), np.array([0.25])
    sc, mn = np.arange(8)[None] * 7 + 1, np.arange(8)[None] * 5
    codes = (np.arange(256)[None] * 5) % 16
    want = (d * sc)[:, :, None] * codes.reshape(1, 8, 32) - (dmin * mn)[:, :, None]
    got = dequantize(gguf_blocks.pack_q4_k(d, dmin, sc, mn, codes), T.Q4_K)
    np.testing.assert_array_equal(got.reshape(1, 8, 32), want)
    scales, q = (np.arange(16)[None] - 8) * 3, (np.arange(256)[None] * 3) % 8 - 4
    got = dequantize(gguf_blocks.pack_q3_k(d, scales, q), T.Q3_K)
    np.testing.assert_array_equal(got, (0.5 * np.repeat(scales, 16, axis=1) * q))
    q6 = (np.arange(256)[None] * 7) % 64 - 32
    got = dequantize(gguf_blocks.pack_q6_k(d, scales, q6), T.Q6_K)
    np.testing.assert_array_equal(got, (0.5 * np.repeat(scales, 16, axis=1) * q6))


@pytest.mark.parametrize("name", LOSSLESS_TYPES)
def test_lossless_types_convert_bit_exactly(name):
    qtype = T[name]
    rows, cols = 6, 512
    raw = known_blocks(qtype, rows * cols // gguf.GGML_QUANT_SIZES[qtype][0]).reshape(rows, -1)
    t = convert(qtype, raw, (rows, cols))
    assert t.lossless and t.quant["group_size"] == 32
    assert t.quant["mode"] == ("mxfp4" if name == "MXFP4" else "affine")
    assert t.quant["bits"] == {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(name, 4)
    np.testing.assert_array_equal(np.array(dequantize_mlx(t)), dequantize(raw, qtype))


@pytest.mark.parametrize("name", sorted(REQUANT_BITS))
def test_requantized_types_stay_within_half_a_step_of_the_target(name):
    qtype, bits = T[name], REQUANT_BITS[name]
    rows, cols = 6, 512
    raw = known_blocks(qtype, rows * cols // 256).reshape(rows, -1)
    t = convert(qtype, raw, (rows, cols))
    assert not t.lossless and t.quant == {"group_size": 32, "bits": bits, "mode": "affine"}
    ref = dequantize(raw, qtype).reshape(rows, -1, 32)
    err = np.abs(np.array(dequantize_mlx(t)).reshape(rows, -1, 32) - ref).max(axis=-1)
    half_step = (ref.max(axis=-1) - ref.min(axis=-1)) / (2 ** bits - 1) / 2
    assert np.all(err <= half_step * 1.01 + 1e-7)
    assert err.max() > 0  # 16-element sub-blocks really are not representable exactly


def test_float_types_load_as_stored():
    x = RNG.normal(size=(4, 64)).astype(np.float32)
    assert np.array_equal(np.array(convert(T.F32, x, x.shape).weight), x)
    f16 = convert(T.F16, x.astype(np.float16), x.shape).weight
    assert f16.dtype == mx.float16 and np.array_equal(np.array(f16), x.astype(np.float16))
    bf = convert(T.BF16, quantize(x, T.BF16), x.shape).weight
    assert bf.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(bf.astype(mx.float32)), dequantize(quantize(x, T.BF16), T.BF16))


# Architectures whose twins the tiny-model generator may not have yet: configs built here.
def arch_config(model_type: str, **sizes) -> dict:
    ids = tiny_tokenizer.token_ids(tiny_tokenizer.tokenizer_files()["tokenizer.json"])
    if model_type in ("qwen3", "qwen2", "llama", "qwen3_next", "minimax", "gemma4_text"):
        return tiny_config(model_type, ids, **sizes)
    config = tiny_config("qwen3", ids, **sizes)
    if model_type == "qwen3_moe":
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif model_type == "gemma3_text":
        config.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                      sliding_window=64, sliding_window_pattern=6, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=64, num_hidden_layers=6, rope_theta=1000000.0)
    elif model_type == "glm4_moe":
        config.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                      moe_intermediate_size=256, first_k_dense_replace=1, n_group=1,
                      topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                      use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                      rope_scaling=None, tie_word_embeddings=False)
    elif model_type == "deepseek_v3":
        config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                      num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, moe_intermediate_size=256, first_k_dense_replace=1,
                      kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32,
                      qk_nope_head_dim=64, v_head_dim=64, n_group=1, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
    elif model_type == "ministral3":  # yarn RoPE and Llama-4 attention scaling, as published
        config.update(model_type="ministral3", architectures=["Ministral3ForCausalLM"],
                      tie_word_embeddings=False, max_position_embeddings=32768,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0,
                                       "factor": 16.0, "original_max_position_embeddings": 256,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                       "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        # two value heads per key head: llama.cpp reorders them, the loader must undo it
        config.update(model_type=model_type, linear_num_value_heads=4, linear_num_key_heads=2,
                      linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                      full_attention_interval=4,
                      rope_parameters={"type": "default", "mrope_section": [11, 11, 10],
                                       "rope_theta": 1000000.0, "partial_rotary_factor": 0.25})
        if model_type == "qwen3_5_moe":
            config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                          shared_expert_intermediate_size=256, decoder_sparse_step=1,
                          norm_topk_prob=True)
    elif model_type == "gpt_oss":
        config.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                      num_local_experts=4, num_experts_per_tok=2, intermediate_size=256,
                      sliding_window=128, rope_theta=150000.0, tie_word_embeddings=False,
                      layer_types=["sliding_attention", "full_attention"] * (config["num_hidden_layers"] // 2))
    return config


def write_twin(tmp_path, model_type: str, quant: str, **sizes):
    """(path of the GGUF file, the float32 weights it was written from, config)."""
    config = arch_config(model_type, **sizes)
    weights = make_weights(config, seed=1)
    files = tiny_tokenizer.tokenizer_files()
    path = tmp_path / f"{model_type}-{quant}.gguf"
    gguf_writer.write_gguf(path, config, weights, files["tokenizer.json"], "{{ messages }}", quant)
    return path, weights, config


def greedy(model, n=24):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def reference_model(config, weights):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    model.eval()
    return model


ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", "glm4_moe", "qwen3_next",
         "deepseek_v3", "qwen3_5", "qwen3_5_moe", "ministral3", "minimax", "gemma4_text")


@pytest.mark.parametrize("model_type", ARCHS)
def test_f32_twin_of_each_arch_decodes_as_its_mlx_model(tmp_path, model_type):
    path, weights, config = write_twin(tmp_path, model_type, "F32")
    loaded = load_model(str(path))
    assert loaded.model_type == model_type
    assert greedy(loaded.model) == greedy(reference_model(config, weights))


def test_f32_gemma4_twin_in_the_large_models_shape_decodes_as_its_mlx_model(tmp_path):
    """Gemma 4 26B/31B: full-attention layers with keys as values (no attn_v) and their own KV
    head count, double-wide MLPs in the KV-shared layers: per-layer metadata arrays."""
    path, weights, config = write_twin(tmp_path, "gemma4_text", "F32", attention_k_eq_v=True,
                                       num_global_key_value_heads=1, use_double_wide_mlp=True)
    loaded = load_model(str(path))
    assert loaded.config["attention_k_eq_v"] and loaded.config["num_global_key_value_heads"] == 1
    assert loaded.config["use_double_wide_mlp"]
    assert greedy(loaded.model) == greedy(reference_model(config, weights))


def file_values(path) -> dict[str, tuple[str, np.ndarray]]:
    """tensor name -> (type, float values as gguf-py dequantizes them, numpy shape)."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        out[t.name] = (t.tensor_type.name, dequantize(np.asarray(t.data), t.tensor_type).reshape(shape))
    return out


@pytest.mark.parametrize("model_type, quant", [
    ("llama", "Q4_K_M"), ("qwen3", "Q5_K_M"), ("qwen3_moe", "Q4_K_M"), ("gemma3_text", "Q6_K"),
    ("qwen2", "Q3_K"), ("qwen3", "Q2_K"), ("qwen3_moe", "MXFP4"), ("llama", "BF16"),
    ("gpt_oss", "MXFP4"), ("gpt_oss", "Q4_K_M"), ("glm4_moe", "Q4_K_M"), ("qwen3_next", "Q4_K_M"),
    ("deepseek_v3", "Q4_K_M"), ("qwen3_5", "Q4_K_M"), ("qwen3_5_moe", "Q5_K_M"),
    ("ministral3", "Q4_K_M"), ("minimax", "Q4_K_M"), ("gemma4_text", "Q4_K_M"),
])
def test_quantized_twin_loads_the_files_own_values(tmp_path, model_type, quant):
    """Every loaded weight dequantizes to the file's values (as gguf-py reads them): exactly for
    lossless types, within half a step of the target format for re-quantized ones."""
    # two layers (gemma3's six: its first global layer is the sixth; qwen3_next's four: its
    # first attention layer is the fourth): the checks are per tensor
    layers = {"gemma3_text": 6, "gemma4_text": 6, "qwen3_next": 4, "qwen3_5": 4, "qwen3_5_moe": 4}.get(model_type, 2)
    path, _, config = write_twin(tmp_path, model_type, quant, layers=layers)
    loaded = load_model(str(path))
    params = dict(tree_flatten(loaded.model.parameters()))
    arch = gguf_archs.ARCHS[gguf.GGUFReader(str(path)).get_field("general.architecture").contents()]
    values = file_values(path)
    types = {gguf_archs.mlx_name(name, arch): kind for name, (kind, _) in values.items()
             if name not in arch.config_tensors}
    # The file's values, put through the loader's renames and converter inverses as floats.
    want_all = gguf_loading.gguf_weights(
        {name: MlxTensor(mx.array(v)) for name, (_, v) in values.items()}, loaded.config, arch)
    for key, ref in want_all.items():
        kind = types.get(key) or types[key.replace("in_proj_qkvz", "in_proj_qkv")]
        base = key[: -len(".weight")]
        if f"{base}.scales" in params:
            q = loaded.config["quantization"][base]
            got = mx.dequantize(params[key], params[f"{base}.scales"], params.get(f"{base}.biases"),
                                group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
        else:
            got = params[key]
        got, want = np.array(got.astype(mx.float32)), np.array(ref.weight.astype(mx.float32))
        if kind in REQUANT_BITS:
            g = want.reshape(-1, 32)
            bound = (g.max(-1) - g.min(-1)) / (2 ** REQUANT_BITS[kind] - 1) / 2 * 1.01 + 1e-6
            assert np.all(np.abs(got.reshape(-1, 32) - g).max(-1) <= bound), key
        else:
            np.testing.assert_array_equal(got, want, err_msg=key)
    assert set(want_all) == {k for k in params if not k.endswith((".scales", ".biases"))}
    if model_type.startswith("qwen3_5"):  # reordered columns kept their quantized codes
        assert "language_model.model.layers.0.linear_attn.out_proj.scales" in params
    types = set(types.values())
    expected = set(gguf_writer.QUANT_TYPES[quant]) | {"F32"}
    assert expected <= types | {"F32"} and len(types) >= 2
    tokens = greedy(loaded.model)
    assert len(tokens) == 24 and len(set(tokens)) > 5


def test_unsupported_arch_and_tensor_type_are_refused_in_one_line(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(ModelLoadError, match=r"'mamba' is not supported; supported: llama, mistral3, qwen2"):
        load_model(str(tmp_path / "m.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "qwen3")
    size = gguf.GGML_QUANT_SIZES[T.IQ4_XS][1]
    w.add_tensor("token_embd.weight", np.zeros((4, size), np.uint8), raw_dtype=T.IQ4_XS)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path / "iq.gguf"))
    assert "\n" not in str(e.value)
    assert "IQ4_XS are not supported; supported: F32, F16, BF16, Q8_0" in str(e.value)
    assert "Q4_K, Q5_K, MXFP4, Q6_K, Q3_K, Q2_K" in str(e.value)


@pytest.mark.parametrize("quant", ["Q4_K_M", "BF16", "F16", "Q8_0"])
def test_metadata_and_tensors_read_as_gguf_py_reads_them(tmp_path, quant):
    """common.gguf_file (the fast reader) against gguf-py's GGUFReader: every metadata value
    (the vocabulary and merges included) and every tensor's type, shape, dtype and bytes."""
    from switchyard.common.gguf_file import GGUFFile

    path, _, _ = write_twin(tmp_path, "qwen3", quant)
    fast, reference = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fast.metadata == fields
    assert len(fast.metadata["tokenizer.ggml.tokens"]) > 100
    assert [(t.name, t.tensor_type, t.shape) for t in fast.tensors] == [
        (t.name, t.tensor_type, tuple(t.shape.tolist())) for t in reference.tensors]
    for mine, theirs in zip(fast.tensors, reference.tensors):
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_truncated_or_foreign_file_is_refused_in_one_line(tmp_path):
    path, _, _ = write_twin(tmp_path, "qwen3", "Q8_0")
    data = path.read_bytes()
    for name, cut in (("head.gguf", data[:5000]), ("tail.gguf", data[:-100]),
                      ("foreign.gguf", b"PK\x03\x04" + data[4:])):
        (tmp_path / name).write_bytes(cut)
        with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
            load_model(str(tmp_path / name))
        assert "\n" not in str(e.value)


def test_minimax_m2_with_softmax_gating_is_refused(tmp_path):
    """mlx_lm's minimax routes experts by sigmoid only: a softmax-gated file (which llama.cpp's
    converter writes for `scoring_func: softmax`) must not load as a subtly different model."""
    path, _, _ = write_twin(tmp_path, "minimax", "F32", layers=1, scoring_func="softmax")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    assert "\n" not in str(e.value)
    assert "minimax-m2 with softmax expert gating is not supported; supported: sigmoid" in str(e.value)


def test_gemma4_with_experts_is_refused(tmp_path):
    """The 26B-A4B's fused experts and stored router scales are not mapped: refused, not guessed."""
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma4")
    w.add_embedding_length(32)
    w.add_head_count(1)
    w.add_block_count(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(128)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(ModelLoadError, match=r"g\.gguf: GGUF gemma4 with experts \(26B-A4B\) is not "
                                             r"supported; supported: dense Gemma 4$"):
        load_model(str(tmp_path / "g.gguf"))


@pytest.mark.parametrize("model_type", ARCHS)
def test_tensor_names_are_llama_cpps(model_type):
    """Our GGUF names are the ones gguf-py's own map gives for the HF names (which mlx_lm's
    parameter names are, stacked experts aside): the writer and loader cannot agree on a
    private spelling."""
    config = arch_config(model_type)
    arch_name = gguf_archs.GGUF_ARCH_OF[model_type]
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    tensor_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name in gguf_writer._converter_tensors(make_weights(config, seed=0), config):
        if name == "rope_freqs":  # generated by the converter (Gemma 4), no HF counterpart
            assert gguf.MODEL_TENSOR.ROPE_FREQS in gguf.MODEL_TENSORS[arch]
            continue
        hf = name.removeprefix("language_model.").replace("mlp.switch_mlp.", "mlp.experts.")
        for proj, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):  # MiniMax
            hf = hf.replace(f"block_sparse_moe.switch_mlp.{proj}", f"block_sparse_moe.experts.{w}")
        # spelled as the converter renames them before looking them up
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias").replace(
            "dt_bias", "dt_proj.bias").replace("self_attn.embed_q", "self_attn.k_b_proj").replace(
            "self_attn.unembed_out", "self_attn.v_b_proj")
        if hf.endswith(("in_proj_qkv.weight", "in_proj_z.weight")):  # named by the converter
            layer = hf.split(".")[2]
            known = {gguf.TENSOR_NAMES[t].format(bid=layer) for t in gguf.MODEL_TENSORS[arch]}
            assert gguf_archs.gguf_name(name, model_type).rsplit(".", 1)[0] in known, name
            continue
        if hf.endswith((".weight", ".bias")):
            hf = hf.rsplit(".", 1)[0]
        ours = gguf_archs.gguf_name(name, model_type)
        if ours.endswith((".weight", ".bias")):  # llama.cpp's tn(..., "weight") adds these
            ours = ours.rsplit(".", 1)[0]
        assert tensor_map.get_name(hf) == ours, name


def test_on_a_gpu_scales_are_half_precision_like_mlx_lms_own(tmp_path, monkeypatch):
    """Float32 scales would turn a GPU's activations and KV cache float32 (twice the memory);
    the GPU branch, run here on the CPU with the device check patched."""
    path, _, _ = write_twin(tmp_path, "qwen3", "Q4_K_M", layers=2)
    monkeypatch.setattr(gguf_loading, "_on_gpu", lambda: True)
    model, _ = gguf_loading.load_gguf(path)
    params = dict(tree_flatten(model.parameters()))
    assert params["model.layers.0.self_attn.k_proj.scales"].dtype == mx.float16
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0].keys.dtype == mx.float16
