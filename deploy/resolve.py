"""Settings made concrete before a group starts: absolute directories and the model to run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from switchyard.deploy.default_model import GENERATED, model_for
from switchyard.common.settings import Settings


def with_concrete_paths(settings: Settings) -> Settings:
    """Replace empty directory settings by the defaults they stand for, as absolute paths, so
    every child sees the same directories whatever its environment."""
    model = settings.model
    # `tiny` names the generated model even where a ./tiny exists (that one is `./tiny`).
    if model and model not in GENERATED and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    draft = settings.draft_model
    if draft and Path(draft).expanduser().exists():
        draft = str(Path(draft).expanduser().resolve())
    hostfile = settings.hostfile and str(Path(settings.hostfile).expanduser().absolute())
    group_key = settings.group_key_file and str(
        Path(settings.group_key_file).expanduser().absolute())
    script = settings.script and str(Path(settings.script).expanduser().absolute())
    return dataclasses.replace(
        settings, model=model, draft_model=draft, hostfile=hostfile, group_key_file=group_key,
        script=script,
        runtime_dir=str(settings.runtime_path.expanduser().absolute()),
        kv_dir=str(settings.kv_path.expanduser().absolute()),
        cache_dir=str(settings.cache_path.expanduser().absolute()))


def with_model(settings: Settings, announce: Callable[[str], None] | None = None) -> Settings:
    """An empty --model means the default model (fetched once), `tiny` the generated one
    (deploy/default_model.py); both are cached in the cache dir. Raises
    DefaultModelUnavailable when the default model can be neither found nor fetched."""
    return dataclasses.replace(
        settings, model=model_for(settings.model, settings.cache_path, announce))
