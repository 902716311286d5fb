"""Pages on the wire between peers: page records as the files hold them, MAC'd with the peer key
(docs/design/kv-pages.md "Pages from a peer").

An answer is page records back to back, each a page file's bytes (kvstore/pages.py: header,
then payload) whose payload checksum is keyed with the peer key instead of the install's page
key: the same format and the same checks as a page on disk. The receiver checks each header
(its own check, and that its id is the hash of its namespace, parent and tokens), that it is
the page asked for at that place in the chain (so its parent is the page before it), and its
MAC; the first record that fails ends the answer (what came before it stays good).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from switchyard.kvstore.page_file import OPEN_READ, PageGeometry, read_header
from switchyard.kvstore.pages import (PREFIX_SIZE, CorruptPage, PageHeader, decode_header,
                                      encode_header, header_length, payload_checksum)


@dataclass(frozen=True)
class WirePage:
    header: PageHeader  # its payload_checksum is the peer key's MAC
    payload: memoryview


def encode_page(header: PageHeader, payload, peer_key: bytes) -> bytes:
    """One record: the page's header, MAC'd with the peer key, and its payload."""
    mac = payload_checksum(peer_key, header.namespace, header.page_id, header.flags, payload)
    return encode_header(dataclasses.replace(header, payload_checksum=mac)) + bytes(payload)


def read_local_page(path: Path, namespace: bytes, page_id: bytes,
                    page_key: bytes) -> tuple[PageHeader, bytearray] | None:
    """A page file read and verified with the install's page key, touching no shared state (the
    server thread reads while the daemon's loop writes); None when missing or bad (the daemon's
    own reads remove bad pages)."""
    try:
        fd = os.open(path, OPEN_READ)
    except OSError:
        return None
    try:
        with open(fd, "rb", buffering=0, closefd=True) as f:
            header, _ = read_header(fd)
            if header.namespace != namespace or header.page_id != page_id:
                return None
            f.seek(header.header_len)
            payload = bytearray(header.payload_len)
            if f.readinto(payload) != header.payload_len:
                return None
    except (CorruptPage, OSError):
        return None
    if payload_checksum(page_key, namespace, page_id, header.flags, payload) \
            != header.payload_checksum:
        return None
    return header, payload


def decode_pages(blob, peer_key: bytes, namespace: bytes, root: bytes,
                 page_ids: Sequence[bytes], start: int,
                 geometry: PageGeometry | None = None) -> tuple[list[WirePage], str]:
    """The verified pages at the front of an answer to an ask for `page_ids[start:]` (a chain
    from `root`), and "" or why the rest was refused."""
    view = memoryview(blob).cast("B")
    pages: list[WirePage] = []
    at = 0
    while at < len(view):
        k = start + len(pages)
        if k >= len(page_ids):
            return pages, "more pages than were asked for"
        try:
            header_len = header_length(view[at:at + PREFIX_SIZE])
            header = decode_header(view[at:at + header_len])
        except CorruptPage as exc:
            return pages, f"page {k}: {exc}"
        parent = page_ids[k - 1] if k else root
        if header.namespace != namespace or header.page_id != page_ids[k] \
                or header.parent_id != parent:
            return pages, f"page {k} is not the page asked for"
        if geometry is not None:
            problem = geometry.problem(header.num_tokens, header.flags, header.payload_len)
            if problem:
                return pages, f"page {k}: {problem}"
        payload = view[at + header_len:at + header_len + header.payload_len]
        if len(payload) != header.payload_len:
            return pages, f"page {k} is cut short"
        if payload_checksum(peer_key, namespace, header.page_id, header.flags, payload) \
                != header.payload_checksum:
            return pages, f"page {k}: MAC mismatch (damaged, or another peer key)"
        pages.append(WirePage(header, payload))
        at += header_len + header.payload_len
    return pages, ""
