"""The memory plan's share of a vision-language model beyond its weights (docs/design.md "Memory
plan"): the encoder's kept features (--vision-cache) and the vision tower's activations for the
largest image its processor makes (every patch's hidden state and MLP activations, twice: the
layer's input and output). Attention scores are not counted: mlx's fused attention does not
hold them (on the CPU backend an image near the processor's largest size needs more).
"""

from __future__ import annotations

from typing import Any

from switchyard.common.settings import parse_size


def max_patches(processor: Any, vision_config: dict) -> int:
    """Patches of the largest image the processor makes."""
    images = getattr(processor, "image_processor", None)
    patch = int(getattr(images, "patch_size", 0) or vision_config.get("patch_size") or 14)
    max_pixels = getattr(images, "max_pixels", None)
    if max_pixels:
        return int(max_pixels) // (patch * patch)
    side = int(vision_config.get("image_size") or 0) // patch
    return side * side


def vision_bytes(loaded: Any, settings: Any) -> int:
    if loaded.processor is None:
        return 0
    vision = loaded.config.get("vision_config") or {}
    hidden = int(vision.get("hidden_size") or 0)
    intermediate = int(vision.get("intermediate_size") or 4 * hidden)
    activations = 2 * max_patches(loaded.processor, vision) * (4 * hidden + intermediate) * 4
    return parse_size(settings.vision_cache) + activations
