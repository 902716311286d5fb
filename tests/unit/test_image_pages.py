"""Page ids and page files of pages that cover images (docs/design/images.md "Images")."""

import hashlib

import numpy as np
import pytest

from switchyard.kvstore import pages
from switchyard.kvstore.store import PageStore
from switchyard.common.page_ids import ROOT_ID, make_namespace, page_id

NS = make_namespace("model", "float32", "layout-1")
X, Y = b"x" * 16, b"y" * 16
TOKENS = list(range(100, 116))


def test_a_page_without_images_keeps_the_id_it_always_had():
    h = hashlib.blake2b(NS, digest_size=16)
    h.update(ROOT_ID)
    h.update(np.array(TOKENS, dtype="<u4").tobytes())
    assert page_id(NS, ROOT_ID, TOKENS) == h.digest() == page_id(NS, ROOT_ID, TOKENS, b"")


def test_images_make_their_own_ids():
    plain = page_id(NS, ROOT_ID, TOKENS)
    ids = {page_id(NS, ROOT_ID, TOKENS, x) for x in (X, Y, X + Y, Y + X)}
    assert len(ids) == 4 and plain not in ids
    assert page_id(NS, ROOT_ID, TOKENS, X) == page_id(NS, ROOT_ID, TOKENS, X)
    # An image id is never mistaken for four tokens, nor four tokens for an image id.
    shifted = page_id(NS, ROOT_ID, TOKENS[:12], np.array(TOKENS[12:], "<u4").tobytes())
    assert shifted != plain
    with pytest.raises(ValueError):
        page_id(NS, ROOT_ID, TOKENS, b"short")


def test_header_round_trip_with_images():
    payload = bytes(range(256)) * 4
    header = pages.make_header(NS, ROOT_ID, TOKENS, payload, image_ids=X + Y, key=bytes(32))
    assert header.page_id == page_id(NS, ROOT_ID, TOKENS, X + Y)
    raw = pages.encode_header(header)
    assert len(raw) == pages.header_size(len(TOKENS), 2)
    back = pages.decode_header(raw + payload)
    assert back.image_ids == X + Y and back.token_ids == tuple(TOKENS)
    assert back.page_id == header.page_id


def test_header_without_images_is_the_old_layout():
    header = pages.make_header(NS, ROOT_ID, TOKENS, b"\0" * 64, key=bytes(32))
    raw = pages.encode_header(header)
    assert raw[10:12] == b"\0\0"  # the image count, where a reserved 0 always was
    assert len(raw) == pages.header_size(len(TOKENS))


def test_a_header_whose_images_were_changed_is_corrupt():
    raw = bytearray(pages.encode_header(pages.make_header(NS, ROOT_ID, TOKENS, b"",
                                                          image_ids=X, key=bytes(32))))
    at = raw.index(X)
    raw[at] ^= 1
    with pytest.raises(pages.CorruptPage):
        pages.decode_header(bytes(raw))


def test_store_writes_and_reads_a_page_with_images(tmp_path):
    store = PageStore(tmp_path / "kv", sync=False)
    payload = np.arange(512, dtype=np.uint8).tobytes()
    pid = page_id(NS, ROOT_ID, TOKENS, X)
    with pytest.raises(ValueError):  # the id must be the one of its images
        store.write(NS, ROOT_ID, TOKENS, payload, page_id=pid)
    assert store.write(NS, ROOT_ID, TOKENS, payload, page_id=pid, image_ids=X) > 0
    out = bytearray(len(payload))
    assert store.read_into(NS, pid, TOKENS, memoryview(out)).image_ids == X
    assert bytes(out) == payload
    # A new store finds it by scanning its files (a restart).
    assert pid in {info.page_id for info in PageStore(tmp_path / "kv", sync=False).scan()}
