"""Settings made concrete before a group starts: absolute directories and the model to run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from switchyard.proto.settings import Settings


def with_concrete_paths(settings: Settings) -> Settings:
    """Replace empty directory settings by the defaults they stand for, as absolute paths, so
    every child sees the same directories whatever its environment."""
    model = settings.model
    if model and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    hostfile = settings.hostfile and str(Path(settings.hostfile).expanduser().absolute())
    group_key = settings.group_key_file and str(
        Path(settings.group_key_file).expanduser().absolute())
    return dataclasses.replace(
        settings, model=model, hostfile=hostfile, group_key_file=group_key,
        runtime_dir=str(settings.runtime_path.expanduser().absolute()),
        kv_dir=str(settings.kv_path.expanduser().absolute()),
        cache_dir=str(settings.cache_path.expanduser().absolute()))


def with_model(settings: Settings) -> Settings:
    """An empty --model means the embedded default tiny model (generated once, then cached)."""
    if settings.model:
        return settings
    # Imported here, not at the top: it brings MLX, which `switchyard status` and the
    # supervisor never need.
    from switchyard.deploy.default_model import default_model_path

    return dataclasses.replace(settings, model=str(default_model_path(settings.cache_path)))
