"""The KV page record: content-addressed ids and a self-describing header (docs/design/kv-pages.md "KV pages").

A page file is `header || payload`. The header starts with a fixed 16-byte prefix (magic,
format version, header length) so a scan reads only the header, never the payload. The payload
is opaque here: the worker defines its layout (K/V per layer, optional recurrent state at the
end, flagged by PageFlags.RECURRENT_STATE). Any inconsistency in a header raises CorruptPage; the
caller treats that as a miss, removes the file and logs it (a corrupt page can cost a re-read,
never wrong output).

Header layout, little-endian:
    prefix  magic 8s | format_version u16 | num_images u16 | header_len u32
    fields  namespace 16s | page_id 16s | parent_id 16s | flags u32 | num_tokens u32
            | payload_len u64 | created_at f64 | payload_checksum 16s (keyed, below)
    tokens  num_tokens x u32
    images  num_images x 16s (the ids of the images whose placeholders the page covers; part
            of the page id, common/page_ids.py; a page without images has none, and its header
            is byte for byte what it was before images existed)
    check   blake2b-8 of everything above
    padding zeros up to header_len (a multiple of 64, so the payload starts cache-line aligned)

The payload checksum is a MAC: keyed BLAKE3 (128 bits) with the install's page key
(kvstore/page_key.py) over the namespace, page id, flags, payload length and payload. Someone
who can write a page file but not read the key cannot forge a page that verifies, and a
payload cannot be moved under another page's header (format version 3; docs/design/security.md
"Security"). The header's own check stays an unkeyed blake2b-8: it only catches damage; what
a header says is trusted only after the payload's MAC, which covers every field that matters,
has verified.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from switchyard.proto.page_flags import PageFlags, unknown_page_flags
from switchyard.common.page_ids import (  # noqa: F401  (re-exported: the page format's id scheme)
    ID_BYTES,
    MAX_PAGE_IMAGES,
    PAGE_FORMAT_VERSION,
    ROOT_ID,
    check_id,
    hash_page,
    chain_page_ids,
    make_namespace,
    page_id,
    token_bytes,
)

MAGIC = b"SYKVPAGE"

_PREFIX = struct.Struct("<8sHHI")
_FIELDS = struct.Struct("<16s16s16sIIQd16s")
_CHECK_BYTES = 8
_ALIGN = 64
PREFIX_SIZE = _PREFIX.size
# Bounds a garbage header_len; 256K tokens per page is far beyond any sane page size.
MAX_HEADER_BYTES = 1 << 20


class CorruptPage(ValueError):
    """The bytes are not a valid page record (or not the one asked for)."""


class OtherFormat(CorruptPage):
    """A page of another format version: never usable by this build, not damage."""


@dataclass(frozen=True)
class PageHeader:
    format_version: int
    namespace: bytes
    page_id: bytes
    parent_id: bytes
    token_ids: tuple[int, ...]
    flags: PageFlags
    payload_len: int
    payload_checksum: bytes
    created_at: float
    image_ids: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_images(self) -> int:
        return len(self.image_ids) // ID_BYTES

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.flags & PageFlags.RECURRENT_STATE)

    @property
    def header_len(self) -> int:
        return _header_len(len(self.token_ids), self.num_images)


def header_size(num_tokens: int, num_images: int = 0) -> int:
    """Bytes of the header of a page of `num_tokens` tokens (file size = this + payload)."""
    return _header_len(num_tokens, num_images)


KEY_BYTES = 32
_MAC_FIELDS = struct.Struct("<16s16sIQ")


def payload_checksum(key: bytes, namespace: bytes, page_id: bytes, flags: int, payload) -> bytes:
    """Keyed BLAKE3-128 of what a read trusts: namespace, page id, flags, payload length and
    payload. BLAKE3 because a keyed hash must be a real MAC (xxh3, even seeded, is not) and
    must not make verifying a restore the bottleneck: measured on the 2-core test machine
    (AVX-512), 8 MiB payloads, keyed BLAKE3 4.5 GB/s against HMAC-SHA256's 1.7-1.9, keyed
    blake2b's 0.7 and the unkeyed xxh3-128's 17 it replaces; it releases the GIL, so the
    reader threads verify a restore's pages side by side."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the page key must be {KEY_BYTES} bytes")
    payload = memoryview(payload).cast("B")
    mac = blake3.blake3(_MAC_FIELDS.pack(namespace, page_id, int(flags), payload.nbytes),
                        key=key)
    mac.update(payload)
    return mac.digest(16)


def make_header(namespace: bytes, parent_id: bytes, token_ids: Sequence[int], payload,
                flags: PageFlags = PageFlags.NONE, created_at: float | None = None,
                image_ids: bytes = b"", *, key: bytes) -> PageHeader:
    """The header for `payload`, with its page id and keyed checksum computed here."""
    tokens = tuple(int(t) for t in token_ids)
    pid = page_id(namespace, parent_id, tokens, image_ids)
    return PageHeader(
        format_version=PAGE_FORMAT_VERSION,
        namespace=namespace,
        page_id=pid,
        parent_id=parent_id,
        token_ids=tokens,
        flags=PageFlags(flags),
        payload_len=memoryview(payload).nbytes,
        payload_checksum=payload_checksum(key, namespace, pid, flags, payload),
        created_at=time.time() if created_at is None else created_at,
        image_ids=image_ids,
    )


def _header_len(num_tokens: int, num_images: int = 0) -> int:
    raw = _PREFIX.size + _FIELDS.size + 4 * num_tokens + ID_BYTES * num_images + _CHECK_BYTES
    return -(-raw // _ALIGN) * _ALIGN


def encode_header(h: PageHeader) -> bytes:
    for name in ("namespace", "page_id", "parent_id"):
        check_id(name, getattr(h, name))
    if unknown_page_flags(h.flags):
        raise ValueError(f"unknown page flags {h.flags:#x}")
    if len(h.payload_checksum) != 16:
        raise ValueError("payload_checksum must be 16 bytes")
    if len(h.image_ids) % ID_BYTES or h.num_images > MAX_PAGE_IMAGES:
        raise ValueError(f"image_ids must be at most {MAX_PAGE_IMAGES} ids of {ID_BYTES} bytes")
    header_len = _header_len(len(h.token_ids), h.num_images)
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"page of {len(h.token_ids)} tokens is too large")
    body = b"".join((
        _PREFIX.pack(MAGIC, h.format_version, h.num_images, header_len),
        _FIELDS.pack(h.namespace, h.page_id, h.parent_id, h.flags, len(h.token_ids),
                     h.payload_len, h.created_at, h.payload_checksum),
        token_bytes(h.token_ids),
        h.image_ids,
    ))
    check = hashlib.blake2b(body, digest_size=_CHECK_BYTES).digest()
    return body + check + bytes(header_len - len(body) - _CHECK_BYTES)


def header_length(prefix) -> int:
    """Total header length from the first PREFIX_SIZE bytes of a page file."""
    if len(prefix) < _PREFIX.size:
        raise CorruptPage("truncated header prefix")
    magic, version, _, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != PAGE_FORMAT_VERSION:
        # Layout may differ; this build can never use the page (and it is namespaced apart).
        raise OtherFormat(f"unsupported page format version {version}")
    if not _header_len(0) <= header_len <= MAX_HEADER_BYTES or header_len % _ALIGN:
        raise CorruptPage(f"bad header length {header_len}")
    return header_len


def decode_header(buf) -> PageHeader:
    """Parse and verify a header from the start of `buf` (the payload may follow)."""
    buf = memoryview(buf).cast("B")
    header_len = header_length(buf)
    if len(buf) < header_len:
        raise CorruptPage("truncated header")
    num_images = _PREFIX.unpack_from(buf)[2]
    namespace, pid, parent_id, flags, num_tokens, payload_len, created_at, checksum = \
        _FIELDS.unpack_from(buf, _PREFIX.size)
    tokens_at = _PREFIX.size + _FIELDS.size
    images_at = tokens_at + 4 * num_tokens
    check_at = images_at + ID_BYTES * num_images
    if _header_len(num_tokens, num_images) != header_len:
        raise CorruptPage("token count does not match header length")
    if hashlib.blake2b(buf[:check_at], digest_size=_CHECK_BYTES).digest() \
            != bytes(buf[check_at:check_at + _CHECK_BYTES]):
        raise CorruptPage("header checksum mismatch")
    if any(buf[check_at + _CHECK_BYTES:header_len]):
        raise CorruptPage("nonzero header padding")
    if unknown_page_flags(flags):
        raise CorruptPage(f"unknown page flags {flags:#x}")
    tokens = buf[tokens_at:images_at]
    image_ids = bytes(buf[images_at:check_at])
    # Content addressing is self-checking: the id must be the hash of what the header claims.
    if hash_page(namespace, parent_id, tokens, image_ids) != pid:
        raise CorruptPage("page id does not match namespace, parent, tokens and images")
    return PageHeader(
        format_version=PAGE_FORMAT_VERSION,
        namespace=namespace,
        page_id=pid,
        parent_id=parent_id,
        token_ids=tuple(np.frombuffer(tokens, dtype="<u4").tolist()),
        flags=PageFlags(flags),
        payload_len=payload_len,
        payload_checksum=checksum,
        created_at=created_at,
        image_ids=image_ids,
    )
