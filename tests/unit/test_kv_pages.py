"""Page ids and the page header: content addressing, self-describing records, namespaces."""

import hashlib

import numpy as np
import pytest

from switchyard.kvstore import pages
from switchyard.kvstore.pages import (
    MAGIC,
    PAGE_FORMAT_VERSION,
    ROOT_ID,
    CorruptPage,
    chain_page_ids,
    decode_header,
    encode_header,
    make_header,
    make_namespace,
    page_id,
)
from switchyard.proto.page_flags import PageFlags
from switchyard.common.page_ids import kv_namespace

NS = make_namespace("model-a", "float32", "layout-1")
P = 256
KEY = bytes(range(32))


def _header(tokens=tuple(range(P)), payload=b"kv" * 100, flags=0):
    return make_header(NS, ROOT_ID, tokens, payload, flags=flags, created_at=1234.5, key=KEY)


def test_header_round_trip():
    h = _header(flags=PageFlags.RECURRENT_STATE)
    buf = encode_header(h)
    assert buf.startswith(MAGIC)
    assert len(buf) == h.header_len and len(buf) % 64 == 0
    assert decode_header(buf) == h
    # The payload may follow the header in the buffer (a scan reads one block).
    assert decode_header(buf + b"payload bytes") == h
    assert h.format_version == PAGE_FORMAT_VERSION
    assert h.has_recurrent_state and h.num_tokens == P
    assert h.payload_len == 200 and h.payload_checksum == pages.payload_checksum(
        KEY, NS, h.page_id, PageFlags.RECURRENT_STATE, b"kv" * 100)


def test_the_payload_checksum_is_keyed_and_binds_the_header():
    """A MAC: another key, page id, flags or payload length gives another checksum, so a
    forged page (or a payload moved under another page's header) never verifies."""
    pid = page_id(NS, ROOT_ID, tuple(range(P)))
    mac = pages.payload_checksum(KEY, NS, pid, 0, b"kv" * 100)
    assert len(mac) == 16
    assert pages.payload_checksum(bytes(32), NS, pid, 0, b"kv" * 100) != mac
    assert pages.payload_checksum(KEY, NS, ROOT_ID, 0, b"kv" * 100) != mac
    assert pages.payload_checksum(KEY, NS, pid, PageFlags.RECURRENT_STATE, b"kv" * 100) != mac
    assert pages.payload_checksum(KEY, NS, pid, 0, b"kv" * 100 + b"\0") != mac
    with pytest.raises(ValueError):
        pages.payload_checksum(b"short", NS, pid, 0, b"")


def test_every_flipped_header_byte_is_detected():
    buf = bytearray(encode_header(_header()))
    for i in range(len(buf)):
        buf[i] ^= 0x01
        with pytest.raises(CorruptPage):
            decode_header(buf)
        buf[i] ^= 0x01
    decode_header(buf)


@pytest.mark.parametrize("cut", [0, 5, pages.PREFIX_SIZE, 100, -1])
def test_truncated_header_is_corrupt(cut):
    buf = encode_header(_header())
    with pytest.raises(CorruptPage):
        decode_header(buf[:cut])


def test_garbage_is_corrupt():
    with pytest.raises(CorruptPage):
        decode_header(np.random.default_rng(0).bytes(4096))


def test_header_checks_id_against_its_content():
    h = _header()
    forged = pages.PageHeader(**{**h.__dict__, "token_ids": (1,) + h.token_ids[1:]})
    with pytest.raises(CorruptPage, match="page id"):
        decode_header(encode_header(forged))


def test_page_id_depends_on_namespace_parent_and_tokens():
    tokens = list(range(P))
    base = page_id(NS, ROOT_ID, tokens)
    assert len(base) == 16
    assert page_id(NS, ROOT_ID, tokens) == base
    assert page_id(make_namespace("model-b", "float32", "layout-1"), ROOT_ID, tokens) != base
    assert page_id(NS, base, tokens) != base
    assert page_id(NS, ROOT_ID, tokens[:-1] + [tokens[-1] + 1]) != base
    assert page_id(NS, ROOT_ID, np.array(tokens, dtype=np.int64)) == base


def test_chain_ids_name_the_whole_prefix():
    tokens = np.arange(3 * P + 17) % 50_000
    ids = chain_page_ids(NS, tokens, P)
    assert len(ids) == 3  # the partial tail has no id
    parent = ROOT_ID
    for i, pid in enumerate(ids):
        assert pid == page_id(NS, parent, tokens[i * P:(i + 1) * P])
        parent = pid
    assert chain_page_ids(NS, tokens.tolist(), P) == ids
    # Same last page after a different first page: a different id.
    other = tokens.copy()
    other[0] += 1
    other_ids = chain_page_ids(NS, other, P)
    assert all(a != b for a, b in zip(ids, other_ids))
    # Continuing a chain from a known parent gives the same ids.
    assert chain_page_ids(NS, tokens[P:], P, parent_id=ids[0]) == ids[1:]


def test_namespace_parts_are_length_prefixed():
    assert make_namespace("ab", "c") != make_namespace("a", "bc")
    assert len(make_namespace("x")) == 16


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        page_id(b"short", ROOT_ID, [1])
    with pytest.raises(ValueError):
        page_id(NS, ROOT_ID, [-1])
    with pytest.raises(ValueError):
        page_id(NS, ROOT_ID, [2**32])
    with pytest.raises(ValueError):
        encode_header(_header(flags=0x80))
    with pytest.raises(ValueError):
        encode_header(_header(flags=PageFlags.RECURRENT_STATE | 0x2))


def test_flag_bits_are_the_on_disk_format():
    """A page written by an older build keeps its meaning: the bits never move."""
    assert int(PageFlags.RECURRENT_STATE) == 1
    raw = encode_header(_header(flags=PageFlags.RECURRENT_STATE))
    flags_at = pages._PREFIX.size + 48  # after namespace, page id, parent id
    assert int.from_bytes(raw[flags_at:flags_at + 4], "little") == 1
    assert decode_header(raw).flags is PageFlags.RECURRENT_STATE


@pytest.mark.parametrize("unknown", [0x2, 0x80000000])
def test_unknown_flag_bits_on_disk_are_corrupt(unknown):
    """A header whose checksum is right but whose flags this build does not know."""
    raw = bytearray(encode_header(_header()))
    flags_at = pages._PREFIX.size + 48
    raw[flags_at:flags_at + 4] = (1 | unknown).to_bytes(4, "little")
    check_at = pages._PREFIX.size + pages._FIELDS.size + 4 * P
    raw[check_at:check_at + 8] = hashlib.blake2b(raw[:check_at], digest_size=8).digest()
    with pytest.raises(CorruptPage, match="unknown page flags"):
        decode_header(bytes(raw))


def test_kv_namespace_names_bits_and_group_size():
    """Pages of another --kv-bits / --kv-group-size never match; full-precision KV keeps
    the namespace it had before quantized KV existed."""
    base = ("fp", "qwen3", "float32", 1, 256)
    spaces = {tag: kv_namespace(*base, kv_quant=tag) for tag in ("", "q8g64", "q4g64", "q8g32")}
    assert len(set(spaces.values())) == 4
    assert spaces[""] == make_namespace("fp", "qwen3", "float32", "layout1", "page256")
    tokens = list(range(256))
    assert len({page_id(ns, ROOT_ID, tokens) for ns in spaces.values()}) == 4
