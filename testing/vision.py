"""Images and mlx-vlm references for the vision tests.

`picture(seed, w, h)` is a deterministic PNG; `reference_tokens` is mlx-vlm's own greedy
generation in this process for messages with images, rendered by the model's chat template and
its processor (the marker expansion mlx-vlm does), cut at the first end token.
"""

from __future__ import annotations

import base64
import io

import numpy as np


def picture(seed: int, width: int = 56, height: int = 48, fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def short_id(data: bytes) -> str:
    """The image's id as the worker logs it (vision.encoded's `image`)."""
    from switchyard.common.images import image_id, open_rgb

    return image_id(open_rgb(data)).hex()[:12]


def openai_content(text_before: str, image: bytes, text_after: str) -> list[dict]:
    return [{"type": "text", "text": text_before},
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": text_after}]


def anthropic_content(text_before: str, image: bytes, text_after: str) -> list[dict]:
    return [{"type": "text", "text": text_before},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": text_after}]


def responses_content(text_before: str, image: bytes, text_after: str) -> list[dict]:
    return [{"type": "input_text", "text": text_before},
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": text_after}]


class Reference:
    """mlx-vlm's model and processor of one model directory, loaded in this process."""

    def __init__(self, model_dir):
        from mlx_vlm import load

        self.model, self.processor = load(str(model_dir))
        self.tokenizer = self.processor.tokenizer

    def prompt(self, messages: list[dict], images: list[bytes]) -> dict:
        """The processor's inputs for chat messages whose image parts are {"type": "image"}."""
        from switchyard.common.images import open_rgb

        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        kwargs = {"images": [open_rgb(d) for d in images]} if images else {}
        return self.processor(text=text, return_tensors="np", add_special_tokens=False,
                              **kwargs)

    def generate(self, messages: list[dict], images: list[bytes], max_tokens: int
                 ) -> tuple[list[int], int]:
        """(greedy tokens cut before the first end token, prompt length)."""
        import mlx.core as mx
        from mlx_vlm.generate import generate_step

        inputs = self.prompt(messages, images)
        ids = mx.array(np.asarray(inputs["input_ids"]))
        extra = {k: v for k, v in inputs.items()
                 if k not in ("input_ids", "attention_mask", "pixel_values")}
        pixels = mx.array(np.asarray(inputs["pixel_values"])) if images else None
        mask = mx.array(np.asarray(inputs["attention_mask"]))
        eos = set(self.model.config.eos_token_id if isinstance(
            self.model.config.eos_token_id, list) else [self.model.config.eos_token_id])
        eos |= {self.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        out = []
        for token, _ in generate_step(ids, self.model, pixels, mask, max_tokens=max_tokens,
                                      temperature=0.0, **extra):
            token = int(token)
            if token in eos:
                break
            out.append(token)
        return out, ids.shape[1]

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
