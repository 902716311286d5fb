"""Tiny model generation, model loading (MLX directory and GGUF) and the gateway tokenizer."""

from __future__ import annotations

import hashlib
import shutil
import threading

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from switchyard.common.tokenizer_loading import load_tokenizer
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.model_loading import load_model
from fixtures.tiny_models import generate_tiny_model, main
from switchyard.deploy.default_model import TINY_MODEL_NAME, tiny_model_path

TEXT = "Hello, world! def f(x):\n\treturn x * 42  # ok\n😀🚀 你好，世界 e\u0301 ß \x00\x7f <think>hm</think>"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "look it up",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Get weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def file_hashes(path):
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def greedy(model, prompt, n=30):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir("qwen3")))
    return tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True)


def test_generation_is_byte_identical_for_same_arguments(tiny_model_dir, tmp_path):
    first = tiny_model_dir("qwen3")
    again = generate_tiny_model(tmp_path / "again", arch="qwen3", seed=0)
    assert file_hashes(again) == file_hashes(first)
    assert sorted(file_hashes(first)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]
    other = generate_tiny_model(tmp_path / "seed1", arch="qwen3", seed=1)
    assert file_hashes(other)["model.safetensors"] != file_hashes(first)["model.safetensors"]
    gguf_again = generate_tiny_model(tmp_path / "again.gguf", arch="qwen3", fmt="gguf")
    assert file_hashes(gguf_again) == {"again.gguf": file_hashes(tiny_model_dir("qwen3", "gguf"))["qwen3-0.gguf"]}
    with pytest.raises(FileExistsError):
        generate_tiny_model(again)


def test_fingerprint_identifies_weights_not_location(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3")
    copy = shutil.copytree(src, tmp_path / "copy")
    seed1 = generate_tiny_model(tmp_path / "seed1", arch="qwen3", seed=1)
    fps = [load_model(str(p)).fingerprint for p in (src, copy, seed1)]
    assert fps[0] == fps[1] != fps[2]
    assert len(fps[0]) == 32 and int(fps[0], 16) >= 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next", "qwen2", "llama"])
def test_each_arch_loads_and_decodes(tiny_model_dir, prompt, arch):
    loaded = load_model(str(tiny_model_dir(arch)))
    assert loaded.model_type == arch
    assert loaded.num_layers == 4
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(loaded.model.parameters()))
    tokens = greedy(loaded.model, prompt)
    assert len(tokens) == 30 and len(set(tokens)) > 10
    # 2 (k, v) x attention layers x 2 kv heads x 64 dims x 4 bytes
    attention_layers = 1 if arch == "qwen3_next" else 4
    assert loaded.kv_bytes_per_token == 2 * attention_layers * 2 * 64 * 4
    assert loaded.has_recurrent_state == (arch == "qwen3_next")
    assert len(loaded.make_cache()) == 4


# The cache kinds each family's twin uses (mlx-lm's make_cache), the facts paging is built on.
FAMILY_CACHES = {
    "qwen3_moe": {"KVCache"}, "glm4_moe": {"KVCache"}, "minimax": {"KVCache"},
    "mistral3": {"KVCache"}, "deepseek_v3": {"KVCache"},  # MLA: latent + rope key per token
    "deepseek_v32": {"CacheList"},  # MLA KV + the sparse-attention indexer's keys
    "deepseek_v41": {"LayerCache"},  # its own: window, compressed groups, index keys
    "qwen3_5": {"ArraysCache", "KVCache"}, "qwen3_5_moe": {"ArraysCache", "KVCache"},
    "gpt_oss": {"KVCache", "RotatingKVCache"}, "gemma3_text": {"KVCache", "RotatingKVCache"},
    "gemma4_text": {"KVCache", "RotatingKVCache"},
}


@pytest.mark.parametrize("arch", sorted(FAMILY_CACHES))
def test_each_family_twin_loads_and_decodes(tiny_model_dir, prompt, arch):
    loaded = load_model(str(tiny_model_dir(arch)))
    assert loaded.model_type == arch
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(loaded.model.parameters()))
    tokens = greedy(loaded.model, prompt)
    assert len(tokens) == 30 and len(set(tokens)) > 10  # not collapsed into one token
    assert {type(c).__name__ for c in loaded.make_cache()} == FAMILY_CACHES[arch]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_gguf_twin_gives_same_greedy_tokens(tiny_model_dir, prompt, arch):
    ref = load_model(str(tiny_model_dir(arch)))
    twin = load_model(str(tiny_model_dir(arch, "gguf")))
    assert twin.model_type == arch and twin.fingerprint != ref.fingerprint
    assert greedy(twin.model, prompt) == greedy(ref.model, prompt)


@pytest.mark.parametrize("quant, bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_quantized_gguf_loads_and_runs(tiny_model_dir, prompt, quant, bits):
    ref = dict(tree_flatten(load_model(str(tiny_model_dir("llama"))).model.parameters()))
    loaded = load_model(str(tiny_model_dir("llama", "gguf", quant=quant)))
    quantization = loaded.config["quantization"]
    assert (quantization["group_size"], quantization["bits"], quantization["mode"]) == (32, bits, "affine")
    params = dict(tree_flatten(loaded.model.parameters()))
    q = "model.layers.0.self_attn.q_proj"  # llama: also checks un-permuting packed rows
    w = mx.dequantize(params[f"{q}.weight"], params[f"{q}.scales"], params[f"{q}.biases"], 32, bits)
    ref_w = ref[f"{q}.weight"]
    step = mx.abs(ref_w).max().item() / 2 ** (bits - 1)  # one quantization step, roughly
    assert mx.abs(w - ref_w).max().item() < step
    tokens = greedy(loaded.model, prompt)
    assert len(tokens) == 30 and len(set(tokens)) > 10


def test_gguf_tokenizer_matches_directory_tokenizer(tiny_model_dir):
    d = load_tokenizer(str(tiny_model_dir("qwen3")))
    g = load_tokenizer(str(tiny_model_dir("qwen3", "gguf")))
    assert g.encode(TEXT) == d.encode(TEXT)
    for kw in ({"tools": TOOLS, "add_generation_prompt": True}, {"enable_thinking": False}):
        rendered = d.apply_chat_template(MESSAGES, tokenize=False, **kw)
        assert g.apply_chat_template(MESSAGES, tokenize=False, **kw) == rendered
        assert g.apply_chat_template(MESSAGES, **kw) == d.apply_chat_template(MESSAGES, **kw)
    assert g.eos_token_ids == d.eos_token_ids == set(d.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert type(g.detokenizer) is type(d.detokenizer)


def test_tokenizer_round_trips_any_text(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir("qwen3")))
    assert tok.vocab_size + 9 == len(tok.get_vocab()) == 4096
    for text in (TEXT, "日本語のテキスト🎉👩‍👩‍👧", "\u200b\ufeff\U0010ffff", "  spaces\r\n\ttabs"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        # Streaming, with characters split across tokens. mlx_lm's BPEStreamingDetokenizer drops
        # NUL bytes and a leading space (its quirks, not the tokenizer's), so avoid those here.
        streamed = text.replace("\x00", "").lstrip(" ")
        detok = tok.detokenizer
        detok.reset()
        for i in tok.encode(streamed):
            detok.add_token(i)
        detok.finalize()
        assert detok.text == streamed
    assert len(tok.encode("<|im_start|><tool_call></tool_call><think>")) == 4


def test_chat_template_renders_tools_and_tool_calls(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir("qwen3")))
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "weather"' in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert "<think>\nlook it up\n</think>" in text  # after the last user turn: kept, as in Qwen3
    assert text.endswith("<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.tool_call_start == "<tool_call>" and tok.has_thinking


def _write_gguf(path, arch, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_arch_and_tensor_type_raise_model_load_error(tmp_path):
    a = np.ones((4, 32), np.float32)
    mamba = _write_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": (a, None)})
    with pytest.raises(ModelLoadError, match=r"'mamba'.*llama.*qwen2.*qwen3"):
        load_model(str(mamba))
    tq = gguf.quants.quantize(np.ones((4, 256), np.float32), gguf.GGMLQuantizationType.TQ2_0)
    bad = _write_gguf(tmp_path / "tq.gguf", "qwen3", {"token_embd.weight": (tq, gguf.GGMLQuantizationType.TQ2_0)})
    with pytest.raises(ModelLoadError, match=r"TQ2_0.*supported.*Q8_0"):
        load_model(str(bad))


def test_bad_references_raise_model_load_error(tmp_path):
    for ref in (str(tmp_path / "missing"), str(tmp_path / "missing.gguf"), "./nope"):
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_model(ref)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_tiny_model_is_generated_once_even_when_raced(tmp_path):
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(tiny_model_path(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert paths == [tmp_path / "models" / TINY_MODEL_NAME] * 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.name[0] != ".") == [TINY_MODEL_NAME]
    assert load_model(str(paths[0])).model_type == "qwen3"


def test_cli_writes_gguf(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main([str(out), "--arch", "qwen2", "--format", "gguf", "--seed", "3", "--layers", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert load_model(str(out)).num_layers == 2


@pytest.mark.parametrize("arch, full_layers, kv_per_layer", [
    ("gpt_oss", 2, 2 * 2 * 64 * 4),  # 2 of 4 layers full; the 2 sliding ones are rings
    ("gemma3_text", 2, 2 * 2 * 64 * 4),
    ("qwen3_moe", 4, 2 * 2 * 64 * 4),
    # MLA: mlx-lm caches the compressed latent (kv_lora_rank 64) and the shared rope key
    # (16) per token, not per-head keys and values
    ("deepseek_v3", 4, (64 + 16) * 4),
])
def test_memory_plan_per_family(tiny_model_dir, arch, full_layers, kv_per_layer):
    """Only full-attention KV grows with --ctx; sliding rings and states are fixed per slot;
    every weight (each expert once) is counted once: the plan equals the file's tensors."""
    from switchyard.common.settings import Settings
    from switchyard.worker.service import page_layout, plan_memory

    model_dir = tiny_model_dir(arch)
    loaded = load_model(str(model_dir))
    assert loaded.kv_bytes_per_token == full_layers * kv_per_layer
    plans = {}
    for ctx in (1024, 4096):
        settings = Settings(model=str(model_dir), ctx=ctx, slots=2, page_size=32)
        layout, paging = page_layout(loaded, settings, log=None)
        assert paging == "on"
        plans[ctx] = plan_memory(loaded, settings, layout)
    small, large = plans[1024], plans[4096]
    assert small.kv_bytes_per_token == loaded.kv_bytes_per_token
    assert large.full_request - small.full_request == 3072 * loaded.kv_bytes_per_token
    assert large.recurrent == small.recurrent
    assert (small.recurrent > 0) == (arch in ("gpt_oss", "gemma3_text"))
    on_disk = sum(v.nbytes for v in mx.load(str(model_dir / "model.safetensors")).values())
    assert small.weights == on_disk


def test_memory_plan_counts_a_cache_that_cannot_be_paged(tiny_model_dir):
    """DeepSeek-V4.1's own cache grows with the context (compressed groups) though it has no
    KVCache layers: the plan measures its growth, so it still grows with --ctx."""
    import structlog

    from switchyard.common.settings import Settings
    from switchyard.worker.service import page_layout, plan_memory

    model_dir = tiny_model_dir("deepseek_v41")
    loaded = load_model(str(model_dir))
    assert loaded.kv_bytes_per_token == 0
    plans = []
    for ctx in (1024, 4096):
        settings = Settings(model=str(model_dir), ctx=ctx, slots=1, page_size=32)
        layout, paging = page_layout(loaded, settings, structlog.get_logger())
        assert layout is None and paging.startswith("off: LayerCache")
        plans.append(plan_memory(loaded, settings, layout))
    assert plans[0].kv_bytes_per_token >= 4 * 64  # > 64 bytes/token per layer
    assert plans[1].full_request - plans[0].full_request == 3072 * plans[0].kv_bytes_per_token


def test_kv_bits_refused_for_gpt_oss_sinks(tiny_model_dir):
    """mlx-lm's quantized attention has no attention sinks: --kv-bits on gpt-oss is refused at
    start with one line (exit 2 in the worker), not a crash on the first request."""
    from switchyard.common.settings import Settings
    from switchyard.worker.kv_layout import kv_quant
    from switchyard.worker.service import check_kv_quant_runs

    model_dir = tiny_model_dir("gpt_oss")
    loaded = load_model(str(model_dir), kv_quant(8, 64))
    with pytest.raises(ModelLoadError, match="--kv-bits 8 cannot be used with this model"):
        check_kv_quant_runs(loaded, Settings(model=str(model_dir), kv_bits=8))
    check_kv_quant_runs(load_model(str(tiny_model_dir("gemma3_text")), kv_quant(8, 64)),
                        Settings(model="x", kv_bits=8))  # gemma's sliding layers are fine
