"""An image file as every model sees it, and its content id (docs/design/images.md "Images").

The gateway opens what a client sent to check it and name it; the worker opens the same bytes
for the image processor. Both go through `open_rgb`, the steps mlx-vlm's own `load_image`
takes (EXIF orientation applied, converted to RGB), so the id names exactly the pixels the
encoder sees. Pillow is imported when an image is opened, never at import.
"""

from __future__ import annotations

import hashlib
import io
import struct

IMAGE_ID_BYTES = 16
_ID_DOMAIN = b"switchyard-image-v1"


# The only formats taken, and the only Pillow plugins that ever parse a client's bytes.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def open_rgb(data: bytes):
    """The decoded image (PIL.Image, RGB) of an image file. Raises what Pillow raises (a format
    outside FORMATS: UnidentifiedImageError, no other plugin having read it)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data), formats=FORMATS) as image:
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")


def image_id(image) -> bytes:
    """16-byte content id of a decoded RGB image: its size and pixels, not its file format, so
    the same picture sent as PNG or as a lossless re-encoding is one image."""
    h = hashlib.blake2b(_ID_DOMAIN, digest_size=IMAGE_ID_BYTES)
    h.update(struct.pack("<II", image.width, image.height))
    h.update(image.tobytes())
    return h.digest()
