"""Image content in each API's own shape, parsed into one part: `{"type": "image", "image": ImageRef}`.

- OpenAI Chat: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or
  the url as a string), in user messages and tool results.
- Anthropic Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
  or `{"source": {"type": "url", "url"}}`, in user turns and in `tool_result` content.
- Responses: `{"type": "input_image", "image_url": "data:..." | "https://..."}`.

A data URL's base64 is decoded here (a data URL that is not base64 is refused); what the bytes
are (format, size, pixels) is judged when they are decoded (gateway/vision/images.py), and a
URL is fetched only there, and only with --image-fetch. Nothing here touches the network.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from switchyard.gateway.errors import invalid, invalid_type

IMAGE_PART = "image"


@dataclass(frozen=True, eq=False)
class ImageRef:
    """An image as the request gave it: its bytes (a data URL, base64) or a URL to fetch;
    `param` names where it is in the request, for errors."""

    param: str
    data: bytes | None = None
    url: str | None = None


def image_part(ref: ImageRef) -> dict[str, Any]:
    return {"type": IMAGE_PART, "image": ref}


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART \
        and isinstance(part.get("image"), ImageRef)


def from_url(url: Any, param: str) -> ImageRef:
    """A `data:` URL (decoded now) or an http(s) URL (fetched later, if allowed)."""
    if not isinstance(url, str) or not url:
        raise invalid_type(param, "a data: URL or an http(s) URL")
    if url[:5].lower() == "data:":
        return ImageRef(param, data=_data_url_bytes(url, param))
    if url.lower().startswith(("http://", "https://")):
        return ImageRef(param, url=url)
    raise invalid(f"'{param}' must be a data: URL (data:image/png;base64,...) or an http(s) "
                  f"URL", param=param, code="invalid_image_url")


def _data_url_bytes(url: str, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise invalid(f"'{param}' is a data URL without a comma before its data", param=param,
                      code="invalid_image_url")
    if not header.lower().endswith(";base64"):
        raise invalid(f"'{param}' is a data URL that is not base64 (expected "
                      f"data:<media type>;base64,<data>)", param=param, code="invalid_image_url")
    return decode_base64(payload, param)


def decode_base64(text: Any, param: str) -> bytes:
    if not isinstance(text, str):
        raise invalid_type(param, "base64 text")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"'{param}' is not valid base64", param=param,
                      code="invalid_image_data") from None
    if not data:
        raise invalid(f"'{param}' holds no image data", param=param, code="invalid_image_data")
    return data


def image_refs(messages: list[dict[str, Any]]) -> list[ImageRef]:
    """The images of a conversation, in the order the template renders them."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if is_image_part(part)]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: each image part is `{"type": "image"}`."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            m = {**m, "content": [{"type": IMAGE_PART} if is_image_part(p) else p
                                  for p in content]}
        out.append(m)
    return out
