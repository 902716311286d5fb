"""A vision-language model (mlx-vlm's own classes) as the worker's slots use a model.

`VisionLanguageModel` is what `LoadedModel.model` is for such a model: called with token ids
and a cache it runs mlx-vlm's language model and returns logits, as an mlx-lm model does; its
layer caches are mlx-lm's own kinds (the kinds mlx-vlm's language model makes), so slots, batches,
pages and the memory plan treat it like a text model. Prefill chunks with images go through
worker/vision/slots.py, which adds the features and positions.

Positions: a family with multimodal RoPE (Qwen-VL) places text after an image at its token
index plus the image's `delta`. The slot store binds each cache list it hands out to its rows'
deltas (`bind`); a call on any other cache (a probe, a fresh cache) positions its rows at their
cache offsets.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from switchyard.worker.errors import ModelLoadError
from switchyard.worker.vision.families import FAMILIES, Family

# The mlx-vlm release whose classes and processors this code is proven with; installed
# without its declared dependencies (pyproject.toml [tool.switchyard] vision-no-deps).
MLX_VLM_REQUIREMENT = "mlx-vlm==0.7.10"
INSTALL_HINT = (f"install the vision extra: pip install 'switchyard[vision]' && "
                f"pip install --no-deps '{MLX_VLM_REQUIREMENT}'")


def vision_model_type(config: dict) -> str | None:
    """The config's model_type when it is a vision-language family served here, else None
    (a checkpoint of a text family, or a vision checkpoint's weights served as text)."""
    model_type = config.get("model_type")
    return model_type if model_type in FAMILIES and "vision_config" in config else None


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class VisionLanguageModel(nn.Module):
    def __init__(self, vlm: nn.Module, family: Family):
        super().__init__()
        self.vlm = vlm
        self.family = family
        self._bound: tuple[object, list[int]] | None = None

    @property
    def layers(self):
        return self.vlm.language_model.model.layers

    @property
    def language_model(self):
        return self.vlm.language_model

    def make_cache(self) -> list:
        """mlx-lm caches of the kinds mlx-vlm's language model makes for itself."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        lm = self.vlm.language_model
        if not hasattr(lm, "make_cache"):
            return [KVCache() for _ in self.layers]
        out = []
        for c in lm.make_cache():
            kind = type(c).__name__
            if kind == "KVCache":
                out.append(KVCache())
            elif kind == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
            else:
                raise ModelLoadError(f"{self.family.model_type}: its {kind} layers are not "
                                     "served here")
        return out

    def bind(self, cache: list, deltas: list[int]) -> None:
        """Calls on `cache` (a slot's, or a batch of slots') position their rows' text this
        far from their cache offsets."""
        self._bound = (cache, deltas) if any(deltas) else None

    def __call__(self, inputs: mx.array, cache=None, **inputs_kw) -> mx.array:
        if self.family.merge is not None and "position_ids" not in inputs_kw:
            inputs_kw["position_ids"] = self._text_positions(inputs, cache)
        return self.vlm.language_model(inputs, cache=cache, **inputs_kw).logits

    def _text_positions(self, inputs: mx.array, cache) -> mx.array:
        batch, length = inputs.shape
        offset = cache[0].offset if cache else 0
        start = (offset if isinstance(offset, mx.array) else mx.array([offset] * batch))
        if self._bound is not None and self._bound[0] is cache:
            start = start + mx.array(self._bound[1])
        pos = start.astype(mx.int32)[:, None] + mx.arange(length, dtype=mx.int32)[None]
        return mx.broadcast_to(pos[None], (3, batch, length))


def load_vision_model(path: Path, config: dict):
    """(VisionLanguageModel, processor) of a vision-language model directory, lazily loaded."""
    model_type = vision_model_type(config)
    try:
        from mlx_vlm.utils import load_image_processor, load_model, load_processor
    except ImportError as exc:
        raise ModelLoadError(f"{path} is a vision-language model ({model_type}); it needs "
                             f"mlx-vlm ({exc.name} is missing): {INSTALL_HINT}") from None
    try:
        vlm = load_model(path, lazy=True)
        processor = load_processor(path, add_detokenizer=False)
        image_processor = load_image_processor(path)
    except (FileNotFoundError, ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    if image_processor is not None:
        processor.image_processor = image_processor
    return VisionLanguageModel(vlm, FAMILIES[model_type](vlm)), processor
