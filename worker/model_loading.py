"""Load a model for the worker: an MLX/HF directory, a Hugging Face repo id, or a .gguf file.

Directories and repo ids go through mlx_lm's own loader; GGUF files through worker.gguf_loading.
On the CPU backend every half-precision weight is converted to float32: MLX's CPU matmul in
float16/bfloat16 is many times slower than float32 with an optimized BLAS, and float32 keeps
results comparable across runs (see docs/design.md, "Models for tests and the default");
quantized layers multiply many rows at once through BLAS too (worker/cpu_quantized.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from switchyard.worker.cache_kinds import leaves, rewindable
from switchyard.worker.cpu_quantized import use_cpu_quantized_products
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.gguf_loading import load_gguf
from switchyard.worker.vision.model import load_vision_model, read_config, vision_model_type
from switchyard.worker.kv_layout import (
    KVQuant,
    KVQuantError,
    apply_quant,
    attention_head_dims,
    check_quantizable,
    fit_group_size,
    calibration_tokens,
    center_keys,
    kv_bytes_per_token,
    rotate_keys,
)

FINGERPRINT_VERSION = b"switchyard-fingerprint-v1"
_SAMPLE_BYTES = 4096
_NUM_SAMPLES = 16
_EDGE_BYTES = 65536


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict
    model_type: str
    fingerprint: str
    path: Path = field(repr=True)
    kv_quant: KVQuant | None = None  # --kv-bits / --kv-group-size (worker/kv_layout.py)
    # A vision-language model (worker/vision/): its mlx-vlm processor; None for text models.
    processor: object | None = None

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return apply_quant(make_prompt_cache(self.model), self.kv_quant)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @cached_property
    def has_recurrent_state(self) -> bool:
        """True when some layer keeps a state that cannot be split per token (ArraysCache,
        rotating windows, ...): such a model cannot be restored from KV pages alone."""
        return not rewindable(self.make_cache())

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys + values one token adds, over the attention (KVCache) layers only
        (members of a CacheList included; sliding-window rings do not grow per token).

        Measured with a one-token forward pass rather than derived from the config, so it is right
        for any architecture (head_dim overrides, MLA, partial attention layers) and any KV dtype
        or quantization.
        """
        cache = self.make_cache()
        self.model(mx.array([[0]]), cache=cache)
        return kv_bytes_per_token(leaves(cache))


def load_model(ref: str, kv_quant: KVQuant | None = None, prepare=None) -> LoadedModel:
    """Load `ref`: a local directory, a local .gguf file, or a Hugging Face repo id; its
    attention KV quantized as `kv_quant` says (None: the model's dtype). `prepare(model,
    config)` runs before the weights are evaluated: a worker group's rank keeps only its share
    there (worker/sharding.py), so no rank ever holds the whole model."""
    path = _resolve(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf; otherwise pass a directory")
        model, config = load_gguf(path)
        files, processor = [path], None
    else:
        model, config, processor = _load_dir(path)
        files = [path / "config.json", *sorted(path.glob("model*.safetensors"))]
    if prepare is not None:
        if processor is not None:
            raise ModelLoadError(f"{path}: a vision-language model runs on one worker; serve "
                                 "it without --hostfile")
        prepare(model, config)
    _force_float32_on_cpu(model)
    if _on_cpu():
        use_cpu_quantized_products(model)
    mx.eval(model.parameters())
    loaded = LoadedModel(
        model=model,
        config=config,
        model_type=config["model_type"],
        fingerprint=fingerprint(files),
        path=path,
        processor=processor,
    )
    if kv_quant is not None:
        probe = loaded.make_cache()
        vocab_size = model(mx.array([[0]]), cache=probe).shape[-1]
        kv_quant = fit_group_size(probe, kv_quant)
        try:
            check_quantizable(probe, kv_quant)
        except KVQuantError as exc:
            raise ModelLoadError(f"{path}: {exc}") from None
        rotated = rotate_keys(model, attention_head_dims(probe))
        # Not in a worker group: each rank holds some heads, and measuring the means runs
        # the model, which there is a collective step of every rank.
        centre = (center_keys(model, calibration_tokens(vocab_size))
                  if rotated and prepare is None else "")
        loaded.kv_quant = dataclasses.replace(kv_quant, rotated=rotated, centre=centre)
    return loaded


def _resolve(ref: str) -> Path:
    path = Path(ref).expanduser()
    if path.exists():
        return path
    if _looks_like_path(ref):
        raise ModelLoadError(f"model path {ref!r} does not exist")
    return _download(ref)


def _looks_like_path(ref: str) -> bool:
    # A repo id is exactly "owner/name"; anything else is meant as a local path.
    return ref.startswith((".", "/", "~")) or ref.endswith(".gguf") or ref.count("/") != 1


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # the hub raises many types (offline, 404, auth)
        raise ModelLoadError(
            f"{repo_id!r} is not a local path and could not be fetched from Hugging Face: {e}"
        ) from e


def _load_dir(path: Path) -> tuple[nn.Module, dict, object | None]:
    """(model, config, processor): a vision-language model through mlx-vlm
    (worker/vision/model.py), any other through mlx-lm (processor None)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json; expected an MLX/HF model directory or a .gguf file")
    config = read_config(path)
    if vision_model_type(config):
        model, processor = load_vision_model(path, config)
        return model, config, processor
    model, config = _load_mlx_dir(path)
    return model, config, None


def _load_mlx_dir(path: Path) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import load_model as mlx_load_model

    try:
        # lazy: the float32 conversion below then replaces weights without holding both copies
        return mlx_load_model(path, lazy=True)
    except (FileNotFoundError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _force_float32_on_cpu(model: nn.Module) -> None:
    """Half-precision weights (and quantization scales) become float32 on the CPU backend."""
    if not _on_cpu():
        return
    model.set_dtype(mx.float32, lambda dtype: dtype in (mx.float16, mx.bfloat16))


def fingerprint(files: list[Path]) -> str:
    """A stable id of the weights: names, sizes and sampled bytes of each file.

    Reading whole files would take seconds to minutes for real models; the sampled blocks (head,
    tail and evenly spaced blocks) differ between any two differently trained or seeded models.
    Absolute paths are left out so that a copied model keeps its fingerprint.
    """
    h = hashlib.blake2b(FINGERPRINT_VERSION, digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(json.dumps([f.name, size]).encode())
        with open(f, "rb") as fh:
            for offset, length in _samples(size):
                fh.seek(offset)
                h.update(fh.read(length))
    return h.hexdigest()


def _samples(size: int) -> list[tuple[int, int]]:
    """(offset, length) blocks to hash: all of a small file, else head, tail and 16 inner blocks."""
    if size <= 2 * _EDGE_BYTES + _NUM_SAMPLES * _SAMPLE_BYTES:
        return [(0, size)]
    step = size // (_NUM_SAMPLES + 1)
    inner = [(step * i, _SAMPLE_BYTES) for i in range(1, _NUM_SAMPLES + 1)]
    return [(0, _EDGE_BYTES), *inner, (size - _EDGE_BYTES, _EDGE_BYTES)]
