"""Opening the images of a request: checked before they are decoded, decoded off the event loop.

Each image is judged in this order, each failure a 400 naming the image (its place in the
request) and the problem:
1. its bytes: fetched first for a URL (gateway/vision/fetch.py, only with --image-fetch);
2. its header alone (Pillow reads the size without decoding): a format other than PNG, JPEG,
   WebP, GIF or BMP is refused, and so is a size beyond --max-image-pixels, before any pixel
   is decoded (a decompression bomb is a small file with a huge header size);
3. its pixels: decoded as every model sees them (proto/images.py); a file that does not decode
   (truncated, corrupt) is refused.
Decoding runs on a small thread pool of its own (`ImageDecoder`): a request's images never
block the event loop, and at most that many images are decoded at once.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from switchyard.gateway.errors import invalid
from switchyard.gateway.vision.fetch import FetchLimits, fetch_image
from switchyard.gateway.vision.parts import ImageRef
from switchyard.proto.images import image_id, open_rgb

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DECODE_THREADS = 2


@dataclass(frozen=True)
class DecodedImage:
    image_id: bytes
    width: int
    height: int
    data: bytes  # the file, for the worker's image processor
    param: str


def bad_image(ref: ImageRef, problem: str, code: str = "invalid_image") -> Exception:
    return invalid(f"'{ref.param}': {problem}", param=ref.param, code=code)


def check_header(ref: ImageRef, data: bytes, max_pixels: int) -> tuple[int, int]:
    """The image's size from its header, after checking format and pixel count."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            kind, (width, height) = image.format, image.size
    except Image.DecompressionBombError as exc:  # Pillow's own check of the header size
        raise bad_image(ref, f"the image header claims too many pixels ({exc}); at most "
                             f"{max_pixels} are taken (--max-image-pixels)",
                        "image_too_large") from None
    except UnidentifiedImageError:
        raise bad_image(ref, "the bytes are not an image in a known format (PNG, JPEG, "
                             "WebP, GIF, BMP)", "invalid_image_data") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise bad_image(ref, f"the image header is corrupt ({exc})",
                        "invalid_image_data") from None
    if kind not in FORMATS:
        raise bad_image(ref, f"{kind} images are not supported; send PNG, JPEG, WebP, GIF or "
                             "BMP", "unsupported_image_format")
    if width < 1 or height < 1:
        raise bad_image(ref, f"the image is {width}x{height} pixels", "invalid_image_data")
    if width * height > max_pixels:
        raise bad_image(ref, f"the image is {width}x{height} = {width * height} pixels, more "
                             f"than the {max_pixels} this server takes (--max-image-pixels)",
                        "image_too_large")
    return width, height


def decode(ref: ImageRef, max_pixels: int, fetch: FetchLimits | None) -> DecodedImage:
    """Runs in a decoding thread: fetch (if a URL), check the header, decode, name it."""
    from PIL import Image

    data = ref.data if ref.data is not None else fetch_image(ref, fetch)
    width, height = check_header(ref, data, max_pixels)
    try:
        image = open_rgb(data)
    except Image.DecompressionBombError:
        raise bad_image(ref, "the image decodes to more pixels than its header says",
                        "image_too_large") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise bad_image(ref, f"the image could not be decoded ({exc})",
                        "invalid_image_data") from None
    return DecodedImage(image_id(image), image.width, image.height, data, ref.param)


class ImageDecoder:
    def __init__(self, max_pixels: int, fetch: FetchLimits | None):
        from PIL import Image

        self.max_pixels = max_pixels
        self.fetch = fetch
        # Pillow's own bomb guard, as a second line behind the header check: an image whose
        # decoded size exceeds the limit raises instead of allocating.
        Image.MAX_IMAGE_PIXELS = max_pixels
        self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="images")

    async def decode_all(self, refs: list[ImageRef]) -> list[DecodedImage]:
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._pool, decode, ref, self.max_pixels, self.fetch)
                for ref in refs]
        try:
            return list(await asyncio.gather(*jobs))
        except BaseException:
            for job in jobs:
                job.cancel()
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
