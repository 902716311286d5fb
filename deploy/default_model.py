"""The model `switchyard serve` runs when no --model is given, and where it is cached."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from switchyard.deploy.tiny_models import write_tiny_mlx

TINY_MODEL_NAME = "tiny-qwen3-v1"


def cache_root() -> Path:
    """Switchyard's cache directory: ~/Library/Caches on macOS, XDG elsewhere."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "switchyard"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "switchyard"


def tiny_model_path(cache_dir: Path | None = None) -> Path:
    """The embedded tiny model (qwen3, seed 0, MLX format), generated on first use.

    An exclusive lock serialises concurrent first uses; the atomic rename inside
    write_tiny_mlx means a directory that exists is always complete.
    """
    out = Path(cache_dir or cache_root()) / "models" / TINY_MODEL_NAME
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{TINY_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            write_tiny_mlx(out, arch="qwen3", seed=0)
    return out


def default_model_path(cache_dir: Path | None = None) -> Path:
    """The model an empty --model means."""
    return tiny_model_path(cache_dir)
