"""Opening the images of a request: checked before they are decoded, decoded off the event loop.

Each image is judged in this order, each failure a 400 naming the image (its place in the
request) and the problem:
1. its bytes: fetched first for a URL (gateway/vision/fetch.py, only with --image-fetch);
2. its header alone (Pillow reads the size without decoding, with only the plugins of PNG,
   JPEG, WebP, GIF and BMP: no other plugin ever parses a client's bytes): another format is
   refused (named from its signature when it is a common one), and so is a size beyond
   --max-image-pixels, before any pixel is decoded (a decompression bomb is a small file with
   a huge header size);
3. its pixels: decoded as every model sees them (common/images.py); a file that does not decode
   (truncated, corrupt) is refused.
Decoding runs on a small thread pool of its own (`ImageDecoder`): a request's images never
block the event loop, and at most that many images are decoded at once. URLs are fetched on
another pool (`FETCH_THREADS`), so slow URLs never hold the decoding threads: a data: URL
image waits only for other images' decoding. A fetch's deadline counts from the moment the
request asked for it (time queued for a fetch thread included), and a request that ends
(its client left, another of its images refused) shuts its fetches down.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from switchyard.gateway.errors import invalid
from switchyard.gateway.vision.fetch import Fetch, FetchLimits, fetch_image
from switchyard.gateway.vision.parts import ImageRef
from switchyard.common.images import FORMATS, image_id, open_rgb

DECODE_THREADS = 2
FETCH_THREADS = 8  # fetches wait on the network, not the CPU; each is bounded by its deadline

# Signatures of common image formats that are not taken, to name them in the refusal (the
# bytes are only compared, never parsed).
_SIGNATURES = ((b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"),
               (b"8BPS", "PSD"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
               (b"\xff\x4f\xff\x51", "JPEG 2000"), (b"%PDF", "PDF"), (b"icns", "ICNS"),
               (b"DDS ", "DDS"), (b"qoif", "QOI"), (b"\x76\x2f\x31\x01", "OpenEXR"))


def sniff_format(data: bytes) -> str | None:
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":  # ISO media: HEIC / AVIF
        brand = data[8:12]
        return "AVIF" if brand.startswith(b"avi") else "HEIF"
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) and b"<svg" in data[:4096].lower():
        return "SVG"
    return None


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

    try:  # reads the header only, with the plugins of FORMATS alone
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            kind, (width, height) = image.format, image.size
    except Image.DecompressionBombError as exc:  # Pillow's own check of the header size
        raise bad_image(ref, f"the image header claims too many pixels ({exc}); at most "
                             f"{max_pixels} are taken (--max-image-pixels)",
                        "image_too_large") from None
    except UnidentifiedImageError:
        kind = sniff_format(data)
        if kind is not None:
            raise bad_image(ref, f"{kind} images are not supported; send PNG, JPEG, WebP, GIF "
                                 "or BMP", "unsupported_image_format") from None
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


def decode(ref: ImageRef, max_pixels: int, fetch: FetchLimits | None,
           data: bytes | None = None) -> DecodedImage:
    """Runs in a decoding thread: check the header, decode, name it. `data` is the fetched
    file of a URL (fetched here, when not given: for callers outside the gateway's pools)."""
    from PIL import Image

    if data is None:
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
        self._fetch_pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="image-fetch")

    async def decode_all(self, refs: list[ImageRef]) -> list[DecodedImage]:
        fetches: list[Fetch] = []
        jobs = [asyncio.ensure_future(self._one(ref, fetches)) for ref in refs]
        try:
            return list(await asyncio.gather(*jobs))
        except BaseException:
            for job in jobs:
                job.cancel()
            for fetch in fetches:  # a fetch under way ends now, not at its deadline
                fetch.cancel()
            raise

    async def _one(self, ref: ImageRef, fetches: list[Fetch]) -> DecodedImage:
        loop = asyncio.get_running_loop()
        data = ref.data
        if data is None:
            fetch = Fetch(self.fetch.timeout_s) if self.fetch is not None else None
            if fetch is not None:
                fetches.append(fetch)
            data = await loop.run_in_executor(self._fetch_pool, fetch_image, ref, self.fetch,
                                              fetch)
        return await loop.run_in_executor(self._pool, decode, ref, self.max_pixels, self.fetch,
                                          data)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
