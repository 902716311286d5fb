"""Content-addressed page ids, shared by the scheduler (matching) and kvstore (verifying).

`page_id = blake2b-128(namespace, parent_id, token ids)`: through the parent, a page id names
its whole prefix, so matching a request is walking its chain (nothing else is a key).
The namespace names the model, KV layout and quantization, and page format: foreign pages
never match.

A page that covers placeholder tokens of images also hashes the images' content hashes (vLLM's
"extra hashes"), in another hash domain: `blake2b-128(namespace, person="sy-images", parent_id,
count, image ids, token ids)`, so equal token ids with other images never share a page (the
placeholders of two images are the same token ids), and the pages after them differ through
the chain. Pages without images keep the id they always had (docs/design/images.md "Images").
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence

import numpy as np

PAGE_FORMAT_VERSION = 3  # 2: xxh3-128 payload checksums; 3: keyed BLAKE3 (a MAC)
ID_BYTES = 16
ROOT_ID = bytes(ID_BYTES)  # parent id of an unsalted sequence's first page
_ROOT_PERSON = b"sy-chain-root"


def chain_root(salt: bytes = b"") -> bytes:
    """The parent id of the first page of a sequence under a cache salt (common/tenants.py):
    ROOT_ID unsalted, so one tenant's page ids are the ones every release computed; another
    salt's chain shares no page id with it, nor with any other salt's (docs/design/security.md
    "Tenants"). The kvstore needs nothing of it: a page's parent id is any 16 bytes."""
    if not salt:
        return ROOT_ID
    return hashlib.blake2b(salt, digest_size=ID_BYTES, person=_ROOT_PERSON).digest()


def make_namespace(*parts: str | bytes) -> bytes:
    """16-byte namespace from a model fingerprint, KV dtype/layout, ...: foreign pages never match.

    The page format version is always mixed in, so a format change makes old pages foreign.
    """
    h = hashlib.blake2b(f"switchyard-kv-page-v{PAGE_FORMAT_VERSION}".encode(),
                        digest_size=ID_BYTES)
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(struct.pack("<Q", len(data)))  # length-prefixed: ("ab","c") != ("a","bc")
        h.update(data)
    return h.digest()


def kv_namespace(fingerprint: str, model_type: str, kv_dtype: str, layout_version: int,
                 page_size: int, kv_quant: str = "", layout: str = "") -> bytes:
    """The namespace of a worker's pages: weights, KV dtype and layout, page size and, with
    quantized KV, bits and group size (`kv_quant`, e.g. "q8g64"), so that pages of another
    setting never match. Full-precision KV adds no part: its page ids are unchanged. A rank of
    a worker group adds its share (`layout`, e.g. "tp2r1"); a single worker adds nothing."""
    parts = [fingerprint, model_type, kv_dtype, f"layout{layout_version}", f"page{page_size}"]
    if kv_quant:
        parts.append(f"kv-{kv_quant}")
    if layout:
        parts.append(f"par-{layout}")
    return make_namespace(*parts)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes, the form that is hashed and stored."""
    if isinstance(token_ids, (list, tuple)):
        # array.array converts a list 3x faster than numpy (200K tokens: 3 ms vs 9 ms) and
        # rejects what is not an integer in [0, 2**32) by itself.
        try:
            arr = array.array("I", token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        if sys.byteorder != "little":
            arr.byteswap()
        return arr.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence")
    if arr.size and arr.dtype != np.dtype("<u4"):
        if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF:
            raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def check_id(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise ValueError(f"{name} must be {ID_BYTES} bytes")


_IMAGES_PERSON = b"sy-images"
MAX_PAGE_IMAGES = 0xFFFF  # the page header's count field


def hash_page(namespace: bytes, parent_id: bytes, tokens: bytes | memoryview,
              image_ids: bytes = b"") -> bytes:
    if not image_ids:
        h = hashlib.blake2b(namespace, digest_size=ID_BYTES)
        h.update(parent_id)
        h.update(tokens)
        return h.digest()
    if len(image_ids) % ID_BYTES or len(image_ids) // ID_BYTES > MAX_PAGE_IMAGES:
        raise ValueError(f"image ids must be 1 to {MAX_PAGE_IMAGES} ids of {ID_BYTES} bytes")
    h = hashlib.blake2b(namespace, digest_size=ID_BYTES, person=_IMAGES_PERSON)
    h.update(parent_id)
    h.update(struct.pack("<I", len(image_ids) // ID_BYTES))  # fixes where the tokens start
    h.update(image_ids)
    h.update(tokens)
    return h.digest()


def page_id(namespace: bytes, parent_id: bytes, token_ids: Sequence[int],
            image_ids: bytes = b"") -> bytes:
    """128-bit id of a page; through parent_id it names the page's whole prefix. `image_ids`:
    the ids of the images whose placeholders the page covers (`page_image_ids`)."""
    check_id("namespace", namespace)
    check_id("parent_id", parent_id)
    return hash_page(namespace, parent_id, token_bytes(token_ids), image_ids)


def page_image_ids(images: Sequence, start: int, end: int) -> bytes:
    """The ids of the images (anything with `image_id`, `start`, `end`, in order) whose
    placeholder tokens overlap tokens [start, end), concatenated."""
    return b"".join(im.image_id for im in images if im.start < end and im.end > start)


def chain_page_ids(namespace: bytes, token_ids: Sequence[int] | np.ndarray, page_size: int,
                   parent_id: bytes = ROOT_ID, images: Sequence = (), offset: int = 0
                   ) -> list[bytes]:
    """Ids of the full pages of a sequence (a trailing partial page has no id). `images`: the
    sequence's images (`ImageSpan`s); `offset`: the position of `token_ids[0]` in it."""
    check_id("namespace", namespace)
    check_id("parent_id", parent_id)
    if page_size < 1:
        raise ValueError("page_size must be positive")
    data = memoryview(token_bytes(token_ids))
    step = page_size * 4
    ids = []
    for start in range(0, len(data) - step + 1, step):
        first = offset + start // 4
        extra = page_image_ids(images, first, first + page_size) if images else b""
        parent_id = hash_page(namespace, parent_id, data[start:start + step], extra)
        ids.append(parent_id)
    return ids
