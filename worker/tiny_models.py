"""Small random-weight models in real formats, generated deterministically from a seed.

Used by tests and as the embedded default model (`default_model_path`). The parameters come from
mlx_lm's own model classes, so names and shapes are exactly what mlx_lm loads. Every weight matrix
is scaled by 4: at the default init greedy decoding collapses into repeating one token, which
would make token-equality tests meaningless.

    python -m worker.tiny_models OUT --arch qwen3 --format gguf --seed 0
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from worker import tiny_tokenizer
from worker.gguf_writer import GGUF_ARCHS, QUANT_TYPES, write_gguf

ARCHS = ("qwen3", "qwen3_next", "qwen2", "llama")
FORMATS = ("mlx", "gguf")
WEIGHT_SCALE = 4.0
DEFAULT_MODEL_NAME = "tiny-qwen3-v1"

# Size knobs shared by all archs (keyword overrides of generate_tiny_model).
_SIZES = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768,
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
}


def tiny_config(arch: str = "qwen3", token_ids: dict[str, int] | None = None, **sizes) -> dict:
    """The config.json of a tiny model; `sizes` overrides keys of _SIZES (or any config key)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    s = {**_SIZES, **{k: v for k, v in sizes.items() if k in _SIZES}}
    extra = {k: v for k, v in sizes.items() if k not in _SIZES}
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
        weights[name] = w
    mx.eval(weights)
    return weights


def generate_tiny_model(
    out: Path, arch: str = "qwen3", seed: int = 0, fmt: str = "mlx", quant: str = "F32", **sizes
) -> Path:
    """Write a tiny model to `out` (a directory for "mlx", a file for "gguf") and return it.

    Same arguments give byte-identical files. The result appears atomically (written under a
    temporary name, then renamed); an existing `out` is an error, so racing writers cannot mix.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; supported: {', '.join(FORMATS)}")
    if fmt == "gguf" and arch not in GGUF_ARCHS:
        raise ValueError(f"no GGUF writer for {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    if fmt == "mlx" and quant != "F32":
        raise ValueError("quantized tiny models exist only as GGUF")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    files = tiny_tokenizer.tokenizer_files()
    token_ids = tiny_tokenizer.token_ids(files["tokenizer.json"])
    config = tiny_config(arch, token_ids, **sizes)
    num_tokens = max(token_ids.values()) + 1
    if config["vocab_size"] < num_tokens:  # larger is fine: unused rows, as in Qwen's vocabularies
        raise ValueError(f"vocab_size must be at least the tokenizer's {num_tokens}")
    weights = make_weights(config, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if fmt == "mlx":
            _write_mlx_dir(tmp, config, weights, files, token_ids)
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
            os.rename(tmp, out)
        else:
            chat_template = json.loads(files["tokenizer_config.json"])["chat_template"]
            write_gguf(tmp / "model.gguf", config, weights, files["tokenizer.json"], chat_template, quant)
            os.link(tmp / "model.gguf", out)  # link fails if `out` appeared meanwhile
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_mlx_dir(d: Path, config: dict, weights: dict, files: dict[str, bytes], ids: dict) -> None:
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "mlx"})
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


def cache_root() -> Path:
    """Switchyard's cache directory: ~/Library/Caches on macOS, XDG elsewhere."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "switchyard"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "switchyard"


def default_model_path(cache_dir: Path | None = None) -> Path:
    """The embedded default model (qwen3, seed 0, MLX format), generated on first use.

    An exclusive lock serialises concurrent first uses; the atomic rename inside
    generate_tiny_model means a directory that exists is always complete.
    """
    out = Path(cache_dir or cache_root()) / "models" / DEFAULT_MODEL_NAME
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            generate_tiny_model(out, arch="qwen3", seed=0, fmt="mlx")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.tiny_models", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="output directory (mlx) or file (gguf)")
    p.add_argument("--arch", choices=ARCHS, default="qwen3")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="mlx")
    p.add_argument("--quant", choices=tuple(QUANT_TYPES), default="F32", help="GGUF tensor type")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing OUT")
    for knob in _SIZES:
        p.add_argument(f"--{knob.replace('_', '-')}", dest=knob, type=int)
    args = p.parse_args(argv)
    sizes = {k: getattr(args, k) for k in _SIZES if getattr(args, k) is not None}
    if args.force and args.out.exists():
        shutil.rmtree(args.out) if args.out.is_dir() else args.out.unlink()
    try:
        path = generate_tiny_model(args.out, args.arch, args.seed, args.fmt, args.quant, **sizes)
    except (ValueError, FileExistsError) as e:
        p.error(str(e))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
