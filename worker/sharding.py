"""Split a model over a worker group with mlx-lm's own methods (docs/design/worker-groups.md "Worker groups"):
`model.shard(group)` for tensor parallelism (every layer's heads and experts split), or
`model.model.pipeline(group)` (PipelineMixin: whole layers per rank, rank 0 the last ones).

The check runs on the lazily loaded model before the group is joined, so a model mlx-lm cannot
split is refused at once on every rank, with one line (exit status 2).
"""

from __future__ import annotations

from importlib.metadata import version

import mlx.nn as nn

from switchyard.worker.errors import ModelLoadError


def _mlx_lm_version() -> str:
    try:
        return version("mlx-lm")
    except Exception:  # not installed as a distribution
        return "?"


def check_splittable(model: nn.Module, config: dict, parallel: str, size: int) -> None:
    """Raise ModelLoadError when `model` cannot be split `parallel`-wise over `size` ranks."""
    model_type = config.get("model_type", "?")
    text = config.get("text_config", config)
    has_shard = callable(getattr(model, "shard", None))
    has_pipeline = callable(getattr(getattr(model, "model", None), "pipeline", None))
    where = f"in mlx-lm {_mlx_lm_version()}"
    if not (has_shard or has_pipeline):
        raise ModelLoadError(f"{model_type} has neither shard() nor pipeline() {where}: it "
                             f"cannot run as a worker group; serve it without --hostfile")
    if parallel == "tensor":
        if not has_shard:
            raise ModelLoadError(f"{model_type} has no shard() {where}; use --parallel pipeline")
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = text.get(key)
            if isinstance(heads, int) and heads % size:
                raise ModelLoadError(f"{model_type}: {key} = {heads} does not divide over "
                                     f"{size} ranks; use --parallel pipeline or another "
                                     f"number of hosts")
    else:
        if not has_pipeline:
            raise ModelLoadError(f"{model_type} has no pipeline() {where}; use --parallel tensor")
        layers = len(model.model.layers)
        if layers < size:
            raise ModelLoadError(f"{model_type} has {layers} layers, fewer than {size} ranks")


def split(model: nn.Module, group, parallel: str) -> None:
    """Keep only this rank's share of `model` (before its weights are evaluated)."""
    if parallel == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
