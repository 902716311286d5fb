"""Where a vision-language model's images go in its prompt, per family.

The chat template writes one marker per image part (Qwen-VL: `<|image_pad|>` inside
`<|vision_start|>...<|vision_end|>`; Gemma 3: `<start_of_image>`). Before the prompt is
tokenized each marker is expanded as the family's mlx-vlm processor expands it, into the
image's placeholder tokens, as many as the processor makes of an image of that size: Qwen-VL
resizes the image to a multiple of its patch grid within [min_pixels, max_pixels]
(`smart_resize`, read from preprocessor_config.json) and makes one token per 2x2 merged patches;
Gemma 3 makes `image_seq_length` tokens of every image. The worker's processor makes the same
count (it checks; tests/integration/test_vision_models.py compares them over many sizes).

After tokenization each image's placeholders are one run of the placeholder token: its span.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.gateway.errors import invalid
from switchyard.proto.values import ImageSpan


@dataclass(frozen=True)
class ImageTokens:
    num_tokens: int
    grid: tuple[int, ...] = ()


class ImagePrompt:
    """A family's marker, its expansion and the placeholder token."""

    model_type: str
    marker: str
    placeholder: str
    placeholder_id: int

    def tokens_for(self, width: int, height: int, param: str) -> ImageTokens:
        raise NotImplementedError

    def expansion(self, num_tokens: int) -> str:
        raise NotImplementedError

    def expand(self, text: str, images: list[ImageTokens]) -> str:
        """The rendered prompt with each marker expanded, in order; a marker count other
        than the images' is a 400 (a marker typed into a message's text, say)."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise invalid(f"The prompt holds {len(pieces) - 1} image markers ({self.marker}) "
                          f"for {len(images)} images; image markers may not appear in text",
                          param="messages", code="invalid_image_markers")
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:]):
            out += [self.expansion(image.num_tokens), piece]
        return "".join(out)

    def spans(self, ids: list[int], images: list[ImageTokens],
              image_ids: list[bytes]) -> tuple[ImageSpan, ...]:
        """The images' spans in the tokenized prompt: one run of placeholders per image."""
        runs, i, n = [], 0, len(ids)
        while i < n:
            if ids[i] == self.placeholder_id:
                j = i
                while j < n and ids[j] == self.placeholder_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) != len(images) or any(length != image.num_tokens for (_, length), image
                                           in zip(runs, images)):
            raise invalid(f"The prompt's image placeholder tokens ({self.placeholder}) do not "
                          f"match its {len(images)} images; placeholder tokens may not appear "
                          f"in text", param="messages", code="invalid_image_markers")
        return tuple(ImageSpan(image_id, start, length, image.grid)
                     for (start, length), image, image_id in zip(runs, images, image_ids))


class QwenVL(ImagePrompt):
    marker = placeholder = "<|image_pad|>"

    def __init__(self, model_type: str, placeholder_id: int, processor: dict,
                 default_patch: int):
        self.model_type = model_type
        self.placeholder_id = placeholder_id
        # As mlx-vlm's Qwen-VL processor reads its settings (qwen3_vl/processing_qwen3_vl.py).
        self.patch = int(processor.get("patch_size", default_patch))
        self.merge = int(processor.get("merge_size", 2))
        size = processor.get("size") or {}
        self.min_pixels = int(processor.get("min_pixels") or size.get("shortest_edge")
                              or 56 * 56)
        self.max_pixels = int(processor.get("max_pixels") or size.get("longest_edge")
                              or 14 * 14 * 4 * 1280)

    def tokens_for(self, width: int, height: int, param: str) -> ImageTokens:
        factor = self.patch * self.merge
        if max(width, height) / min(width, height) > 200:
            raise invalid(f"'{param}': the image is {width}x{height}; its aspect ratio must be "
                          f"below 200", param=param, code="invalid_image")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        grid = (1, h // self.patch, w // self.patch)
        return ImageTokens(grid[1] * grid[2] // self.merge ** 2, grid)

    def expansion(self, num_tokens: int) -> str:
        return self.placeholder * num_tokens


class Gemma3(ImagePrompt):
    model_type = "gemma3"
    marker = "<start_of_image>"
    placeholder = "<image_soft_token>"

    def __init__(self, placeholder_id: int, num_tokens: int, end: str = "<end_of_image>"):
        self.placeholder_id = placeholder_id
        self.num_tokens = num_tokens
        self.end = end

    def tokens_for(self, width: int, height: int, param: str) -> ImageTokens:
        return ImageTokens(self.num_tokens)

    def expansion(self, num_tokens: int) -> str:
        # mlx-vlm's Gemma3Processor.full_image_sequence
        return f"\n\n{self.marker}{self.placeholder * num_tokens}{self.end}\n\n"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_dir(ref: str) -> Path | None:
    """The model's directory: a local path, or a Hugging Face repo's snapshot (its JSON files)."""
    if not ref or ref.endswith(".gguf"):
        return None
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists() or ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, allow_patterns=["*.json"]))
    except Exception:  # the hub raises many types (offline, 404): then no images
        return None


def image_prompt_for(model_dir: Path | None, tokenizer: Any) -> ImagePrompt | None:
    """The family's image prompt of a vision-language model directory; None for any other
    model (images are then refused, naming the model)."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    config = _read_json(model_dir / "config.json")
    if "vision_config" not in config:
        return None
    processor = _read_json(model_dir / "preprocessor_config.json")
    processor.update(_read_json(model_dir / "processor_config.json").get("image_processor")
                     or {})
    vocab = tokenizer.get_vocab()
    model_type = config.get("model_type")
    if model_type in ("qwen2_5_vl", "qwen3_vl") and QwenVL.placeholder in vocab:
        return QwenVL(model_type, vocab[QwenVL.placeholder], processor,
                      14 if model_type == "qwen2_5_vl" else 16)
    if model_type == "gemma3" and Gemma3.placeholder in vocab:
        seq = _read_json(model_dir / "processor_config.json").get("image_seq_length") \
            or config.get("mm_tokens_per_image") or 256
        return Gemma3(vocab[Gemma3.placeholder], int(seq))
    return None
