"""A chat request's images, from its parsed parts to the spans of a `SubmitRequest`.

`ImageInputs.prepare` runs before the prompt is rendered: it refuses images for a text-only
model (naming it) and more than --max-images, decodes them off the event loop
(gateway/vision/images.py) and sizes each image's placeholders (gateway/vision/prompt.py).
Rendering expands the template's markers (`PromptImages.expand`); `PromptImages.attach` finds
the spans in the token ids and gives the files to send, one per distinct image.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from switchyard.gateway.errors import invalid
from switchyard.gateway.request.model import ChatRequest
from switchyard.gateway.vision.fetch import FetchLimits
from switchyard.gateway.vision.images import DecodedImage, ImageDecoder
from switchyard.gateway.vision.parts import image_refs, template_messages
from switchyard.gateway.vision.prompt import ImagePrompt, ImageTokens
from switchyard.proto.values import ImageData, ImageSpan


@dataclass(frozen=True)
class PromptImages:
    """The images of one prompt, in order (empty for a vision model's text-only prompt)."""

    prompt: ImagePrompt
    decoded: tuple[DecodedImage, ...] = ()
    tokens: tuple[ImageTokens, ...] = ()

    def expand(self, text: str) -> str:
        return self.prompt.expand(text, list(self.tokens))

    def attach(self, prompt_ids: list[int]) -> tuple[tuple[ImageSpan, ...], tuple[ImageData, ...]]:
        spans = self.prompt.spans(prompt_ids, list(self.tokens),
                                  [d.image_id for d in self.decoded])
        files = {d.image_id: ImageData(d.image_id, d.data) for d in self.decoded}
        return spans, tuple(files.values())


class ImageInputs:
    def __init__(self, prompt: ImagePrompt | None, model_id: str, *, max_images: int,
                 max_pixels: int, fetch: FetchLimits | None):
        self.prompt = prompt
        self.model_id = model_id
        self.max_images = max_images
        self._decoder: ImageDecoder | None = None
        self._max_pixels = max_pixels
        self._fetch = fetch

    async def prepare(self, chat: ChatRequest) -> tuple[ChatRequest, PromptImages | None]:
        """The request as the template takes it, and its images (None: a text model)."""
        refs = image_refs(chat.messages)
        if not refs:
            return chat, PromptImages(self.prompt) if self.prompt is not None else None
        if self.prompt is None:
            raise invalid(f"The model '{self.model_id}' is a text-only model and does not take "
                          f"images; '{refs[0].param}' is an image", param=refs[0].param,
                          code="images_not_supported")
        if len(refs) > self.max_images:
            raise invalid(f"The request has {len(refs)} images; at most {self.max_images} are "
                          f"allowed (--max-images)", param=refs[self.max_images].param,
                          code="too_many_images")
        decoded = await self.decoder().decode_all(refs)
        tokens = tuple(self.prompt.tokens_for(d.width, d.height, d.param) for d in decoded)
        chat = dataclasses.replace(chat, messages=template_messages(chat.messages))
        return chat, PromptImages(self.prompt, tuple(decoded), tokens)

    def decoder(self) -> ImageDecoder:
        if self._decoder is None:  # Pillow only once an image comes
            self._decoder = ImageDecoder(self._max_pixels, self._fetch)
        return self._decoder

    def shutdown(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown()


def image_inputs(settings: Any, prompt: ImagePrompt | None, model_id: str) -> ImageInputs:
    from switchyard.common.settings import parse_size

    fetch = FetchLimits(parse_size(settings.image_fetch_bytes), settings.image_fetch_timeout_s) \
        if settings.image_fetch else None
    return ImageInputs(prompt, model_id, max_images=settings.max_images,
                       max_pixels=settings.max_image_pixels, fetch=fetch)
