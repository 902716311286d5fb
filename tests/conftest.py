"""Shared fixtures.

MLX tests expect an optimized BLAS on Linux: `.ci/run` starts pytest with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 (it cannot be set from here,
the dynamic loader reads it at process start). Without it they pass, only slower.
"""

from __future__ import annotations

from pathlib import Path

import pytest

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="qwen3", fmt="mlx", **kw) -> Path, generated once per session."""
    from fixtures.tiny_models import generate_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[tuple, Path] = {}

    def make(arch: str = "qwen3", fmt: str = "mlx", seed: int = 0, **kw) -> Path:
        key = (arch, fmt, seed, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([arch, str(seed), *(f"{k}{v}" for k, v in sorted(kw.items()))])
            out = root / (f"{name}.gguf" if fmt == "gguf" else name)
            made[key] = generate_tiny_model(out, arch=arch, seed=seed, fmt=fmt, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer and chat template through transformers (no MLX)."""
    from transformers import PreTrainedTokenizerFast

    from switchyard.deploy.tiny_tokenizer import tokenizer_files

    path = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files().items():
        (path / name).write_bytes(data)
    return PreTrainedTokenizerFast.from_pretrained(str(path))
