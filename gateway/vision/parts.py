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


# --- each API's shape --------------------------------------------------------------------------


DETAILS = ("auto", "low", "high")


def check_detail(holder: dict[str, Any], param: str) -> None:
    """OpenAI's `detail` (auto, low, high), checked as OpenAI does; the model sees every image
    at the resolution its processor makes of it, whatever the detail."""
    detail = holder.get("detail")
    if detail is not None and detail not in DETAILS:
        raise invalid(f"'{param}.detail' must be one of {', '.join(DETAILS)}",
                      param=f"{param}.detail", code="invalid_value")


def openai_image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """Chat Completions' `image_url` part."""
    value = part.get("image_url")
    if isinstance(value, dict):
        check_detail(value, f"{param}.image_url")
        return image_part(from_url(value.get("url"), f"{param}.image_url.url"))
    return image_part(from_url(value, f"{param}.image_url"))


def responses_image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """The Responses API's `input_image` part (`image_url`; `file_id` is not served here)."""
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise invalid(f"'{param}.file_id': uploaded files are not served here; send the image "
                      f"as a data: URL in 'image_url'", param=f"{param}.file_id",
                      code="unsupported_content")
    check_detail(part, param)
    return image_part(from_url(part.get("image_url"), f"{param}.image_url"))


def mixed_parts(parts: list, param: str, text_keys: dict[str, str], images: dict[str, Any],
                what: str) -> list[dict[str, Any]]:
    """Content parts with images, in order: text parts as `{"type": "text", "text"}` (the type
    of each accepted text part maps to the key holding its text), image parts parsed by
    `images` (part type -> parser). Any other type is a 400 naming `what` is taken."""
    out = []
    for j, part in enumerate(parts):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(part_param, "an object")
        kind = part.get("type")
        if isinstance(kind, str) and kind in images:
            out.append(images[kind](part, part_param))
            continue
        if not isinstance(kind, str) or kind not in text_keys:
            raise invalid(f"'{part_param}.type' {kind!r} is not supported; only {what} are",
                          param=f"{part_param}.type", code="unsupported_content")
        text = part.get(text_keys[kind])
        if not isinstance(text, str):
            raise invalid_type(f"{part_param}.text", "a string")
        out.append({"type": "text", "text": text})
    return out


def has_part(parts: Any, kinds: tuple[str, ...]) -> bool:
    return isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") in kinds
                                           for p in parts)


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
