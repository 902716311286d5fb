"""PageStore: atomic writes, verified reads, rebuild by scan, namespaces, bad pages."""

import errno
import os
import shutil
import time

import numpy as np
import pytest

from switchyard.kvstore import page_file
from switchyard.kvstore import store as store_mod
from switchyard.kvstore.pages import (ROOT_ID, chain_page_ids, decode_header, encode_header,
                                      make_header, make_namespace)
from switchyard.proto.page_flags import PageFlags
from switchyard.kvstore.page_file import PageGeometry
from switchyard.kvstore.store import PageStore, StoreUnavailable

NS = make_namespace("model-a")
OTHER_NS = make_namespace("model-b")
P = 16


def _tokens(i, n=P):
    return list(range(i * n, (i + 1) * n))


def _payload(seed, nbytes=4096):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _write_chain(store, num_pages, ns=NS, nbytes=4096):
    tokens = [t for i in range(num_pages) for t in _tokens(i)]
    ids = chain_page_ids(ns, tokens, P)
    parent = ROOT_ID
    for i, pid in enumerate(ids):
        store.write(ns, parent, _tokens(i), _payload(i, nbytes), page_id=pid)
        parent = pid
    return ids


def _read(store, pid, i, ns=NS, size=8192):
    out = bytearray(size)
    header = store.read_into(ns, pid, _tokens(i), memoryview(out))
    return header, out


@pytest.fixture
def store(tmp_path):
    return PageStore(tmp_path / "kv")


def test_write_read_round_trip(store):
    ids = _write_chain(store, 3)
    header, out = _read(store, ids[1], 1)
    assert header is not None and header.page_id == ids[1] and header.parent_id == ids[0]
    assert bytes(out[:header.payload_len]) == _payload(1).tobytes()
    path = store.path_for(NS, ids[1])
    assert path == store.root / NS.hex()[:8] / ids[1].hex()[:2] / (ids[1].hex() + ".page")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    assert path.stat().st_size == store.get(ids[1]).nbytes
    assert store.num_corrupt_removed == 0


def test_write_is_idempotent(store):
    (pid,) = _write_chain(store, 1)
    inode = store.path_for(NS, pid).stat().st_ino
    assert store.write(NS, ROOT_ID, _tokens(0), _payload(0)) == 0
    assert store.path_for(NS, pid).stat().st_ino == inode
    # Also after a restart (the page is not yet in the new index).
    again = PageStore(store.root)
    assert again.write(NS, ROOT_ID, _tokens(0), _payload(0)) == 0
    assert pid in again and len(again) == 1


def test_adding_a_state_snapshot_replaces_the_page(store):
    (pid,) = _write_chain(store, 1)
    with_state = np.concatenate([_payload(0), _payload(9, 512)])
    written = store.write(NS, ROOT_ID, _tokens(0), with_state, flags=PageFlags.RECURRENT_STATE)
    assert written > 0 and store.get(pid).flags == PageFlags.RECURRENT_STATE
    assert store.write(NS, ROOT_ID, _tokens(0), with_state, flags=PageFlags.RECURRENT_STATE) == 0
    again = PageStore(store.root)
    again.scan()
    assert again.get(pid).flags == PageFlags.RECURRENT_STATE
    header, out = _read(again, pid, 0)
    assert header.has_recurrent_state
    assert bytes(out[:header.payload_len]) == with_state.tobytes()


def test_write_rejects_a_wrong_page_id(store):
    with pytest.raises(ValueError):
        store.write(NS, ROOT_ID, _tokens(0), _payload(0), page_id=bytes(16))


def test_restart_rebuilds_the_index_from_files(store):
    ids = _write_chain(store, 4)
    again = PageStore(store.root)
    infos = {info.page_id: info for info in again.scan()}
    assert set(infos) == set(ids)
    assert infos[ids[2]].parent_id == ids[1] and infos[ids[2]].num_tokens == P
    assert again.num_bytes == store.num_bytes == sum(i.nbytes for i in infos.values())
    header, out = _read(again, ids[3], 3)
    assert bytes(out[:header.payload_len]) == _payload(3).tobytes()


def test_scan_removes_leftover_temp_files(store):
    (pid,) = _write_chain(store, 1)
    path = store.path_for(NS, pid)
    (path.parent / f".{pid.hex()}.99999999.abcd.tmp").write_bytes(b"half a page")  # gone
    alive = path.parent / f".{pid.hex()}.{os.getppid()}.abcd.tmp"  # a live writer's
    alive.write_bytes(b"being written")
    again = PageStore(store.root)
    assert len(again.scan()) == 1
    assert again.num_temp_removed == 1 and list(path.parent.glob("*.tmp")) == [alive]


def test_miss_is_not_corruption(store):
    header, _ = _read(store, bytes(16), 0)
    assert header is None and store.num_corrupt_removed == 0


def _corrupt_and_check(store, pid, i, damage, via):
    events = []
    store.on_corrupt = events.append
    path = store.path_for(NS, pid)
    data = bytearray(path.read_bytes())
    path.write_bytes(damage(data))
    if via == "read":
        header, _ = _read(store, pid, i)
        assert header is None
    else:
        assert pid not in {info.page_id for info in store.scan()}
    assert not path.exists()
    assert store.num_corrupt_removed == 1 and len(events) == 1
    assert pid not in store
    assert _read(store, pid, i)[0] is None  # and never returned afterwards


def _flip_payload(data):
    data[-1] ^= 0xFF
    return data


def _truncate(data):
    return data[:-100]


def _garbage_header(data):
    return b"\x00" * 64 + data[64:]


@pytest.mark.parametrize("via", ["read", "scan"])
@pytest.mark.parametrize("damage", [_truncate, _garbage_header])
def test_damaged_page_is_removed(store, damage, via):
    ids = _write_chain(store, 2)
    _corrupt_and_check(store, ids[1], 1, damage, via)
    assert _read(store, ids[0], 0)[0] is not None  # neighbours are untouched


def test_flipped_payload_byte_is_caught_on_read(store):
    ids = _write_chain(store, 2)
    _corrupt_and_check(store, ids[1], 1, _flip_payload, "read")


def test_wrong_tokens_are_a_miss_and_remove_the_page(store):
    (pid,) = _write_chain(store, 1)
    out = bytearray(8192)
    assert store.read_into(NS, pid, _tokens(5), memoryview(out)) is None
    assert not store.path_for(NS, pid).exists() and store.num_corrupt_removed == 1


def test_page_under_the_wrong_name_is_removed(store):
    ids = _write_chain(store, 2)
    # A valid record of page 0 stored where page 1 belongs.
    shutil.copy(store.path_for(NS, ids[0]), store.path_for(NS, ids[1]))
    assert _read(store, ids[1], 1)[0] is None and store.num_corrupt_removed == 1
    shutil.copy(store.path_for(NS, ids[0]), store.path_for(NS, ids[1]))
    assert {i.page_id for i in store.scan()} == {ids[0]}
    assert store.num_corrupt_removed == 2


def test_foreign_namespace_is_kept_but_never_matched(store):
    (pid,) = _write_chain(store, 1, ns=OTHER_NS)
    assert _read(store, pid, 0, ns=NS)[0] is None
    # Even planted at our namespace's path, the header's namespace does not match.
    ours = store.path_for(NS, pid)
    ours.parent.mkdir(parents=True)
    shutil.copy(store.path_for(OTHER_NS, pid), ours)
    assert _read(store, pid, 0, ns=NS)[0] is None and not ours.exists()
    # The foreign page stays on disk and in the inventory (it ages out by eviction).
    again = PageStore(store.root)
    assert [i.namespace for i in again.scan()] == [OTHER_NS]
    assert set(again.stats().namespaces) == {OTHER_NS.hex()}
    assert _read(again, pid, 0, ns=OTHER_NS)[0] is not None


# --- lies: a header that agrees with its file and checksum but not with the model ------------
# (a security review's finding). Each is a miss: removed, logged, never a crash, never wrong bytes.

GEOMETRY = PageGeometry(NS, P, 4096 // P, 512)  # the pages _write_chain writes: 256 B a token


def _lie(store, pid, *, payload=None, flags=None, key=None):
    """Rewrite a page with another payload or flags: file size and keyed checksum recomputed
    (with the store's key unless `key`), so only the lie itself is left to catch."""
    path = store.path_for(NS, pid)
    data = path.read_bytes()
    header = decode_header(data)
    body = data[header.header_len:] if payload is None else payload
    new = make_header(header.namespace, header.parent_id, header.token_ids, body,
                      flags=header.flags if flags is None else flags,
                      key=store.key if key is None else key)
    path.write_bytes(encode_header(new) + bytes(body))
    return path


def _judged_corrupt(store, pid, i, reason, size=8192):
    events = []
    store.on_corrupt = events.append
    header, out = _read(store, pid, i, size=size)
    assert header is None
    assert not store.path_for(NS, pid).exists() and pid not in store
    assert [reason in e.reason for e in events] == [True], events
    return out


def test_a_payload_larger_than_the_buffer_is_a_miss_not_a_crash(store):
    """The reported reproduction: a header claiming a payload 64x too large, with a matching
    file size and a recomputed checksum, raised ValueError in _read_page (kvstore crash)."""
    (pid,) = _write_chain(store, 1)
    _lie(store, pid, payload=bytes(64 * 4096))
    _judged_corrupt(store, pid, 0, "buffer")


def test_a_payload_that_disagrees_with_the_model_geometry_is_a_miss(store):
    ids = _write_chain(store, 3)
    store.set_geometry(GEOMETRY)
    assert _read(store, ids[0], 0)[0] is not None  # honest pages pass
    _lie(store, ids[1], payload=_payload(1, 2048).tobytes())  # half the bytes: fits the buffer
    out = _judged_corrupt(store, ids[1], 1, "the model's page of 16 tokens is 4096")
    # A state flag without the state, and a page with the state it claims, of another size.
    _lie(store, ids[2], flags=PageFlags.RECURRENT_STATE)
    _judged_corrupt(store, ids[2], 2, "is 4608")
    del out


def test_a_state_flag_on_a_model_without_state_is_a_miss(store):
    (pid,) = _write_chain(store, 1)
    store.set_geometry(PageGeometry(NS, P, 4096 // P, 0))
    _lie(store, pid, flags=PageFlags.RECURRENT_STATE)
    _judged_corrupt(store, pid, 0, "no recurrent state")


def test_more_tokens_than_a_page_holds_is_a_miss(store):
    tokens = list(range(2 * P))
    store.write(NS, ROOT_ID, tokens, _payload(0, 2 * 4096))
    (info,) = store.pages()
    store.set_geometry(GEOMETRY)
    out = bytearray(3 * 4096)
    assert store.read_into(NS, info.page_id, tokens, memoryview(out)) is None
    assert info.page_id not in store and store.corrupt_events[-1].reason.startswith("32 tokens")


def test_pages_the_scan_indexed_are_judged_when_the_model_says_its_geometry(store):
    ids = _write_chain(store, 3)
    _lie(store, ids[1], payload=_payload(1, 2048).tobytes())
    again = PageStore(store.root)
    assert set(p.page_id for p in again.scan()) == set(ids)  # geometry unknown yet
    events = []
    again.on_corrupt = events.append
    assert again.set_geometry(GEOMETRY) == 1
    assert ids[1] not in again and not again.path_for(NS, ids[1]).exists()
    assert "payload is 2048 bytes" in events[0].reason
    assert ids[0] in again and ids[2] in again
    # Another namespace's geometry judges nothing of ours.
    assert PageStore(store.root).set_geometry(PageGeometry(OTHER_NS, P, 1)) == 0


def test_a_page_forged_without_the_key_is_a_miss(store):
    """Checksums were unkeyed xxh3, so a forged page with a recomputed checksum
    verified. With another key (an attacker does not have ours) it is a miss."""
    (pid,) = _write_chain(store, 1)
    _lie(store, pid, payload=_payload(7).tobytes(), key=bytes(32))
    _judged_corrupt(store, pid, 0, "checksum")


def test_a_store_with_another_key_reads_none_of_the_pages(store, tmp_path):
    ids = _write_chain(store, 2)
    other = PageStore(store.root, key=b"k" * 32)
    other.scan()
    assert [_read(other, pid, i)[0] for i, pid in enumerate(ids)] == [None, None]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_page_file_of_another_user_is_a_miss(store):
    (pid,) = _write_chain(store, 1)
    os.chown(store.path_for(NS, pid), 65534, 65534)
    _judged_corrupt(store, pid, 0, "owned by uid 65534")


def test_a_page_that_kills_its_reader_is_removed_by_the_next_scan(tmp_path, monkeypatch):
    """The backstop: whatever a future check misses, a kvstore that died reading a page does
    not die on it again after its restart (before: 6 crashes, then the group stopped)."""
    store = PageStore(tmp_path / "kv", read_guard=True)
    ids = _write_chain(store, 3)

    def boom(*args):
        raise MemoryError("a bug no check foresaw")

    monkeypatch.setattr(page_file, "read_page", boom)
    with pytest.raises(MemoryError):
        store.read_many(NS, [(ids[1], _tokens(1), memoryview(bytearray(8192)))])
    monkeypatch.undo()
    again = PageStore(store.root, read_guard=True)  # the restarted kvstore
    events = []
    again.on_corrupt = events.append
    assert {p.page_id for p in again.scan()} == {ids[0], ids[2]}
    assert [e.reason for e in events] == ["being read when the kvstore died"]
    assert _read(again, ids[0], 0)[0] is not None
    # A batch that finished leaves nothing behind to remove.
    assert {p.page_id for p in PageStore(store.root, read_guard=True).scan()} == {ids[0], ids[2]}


def test_delete_touch_stats(store):
    ids = _write_chain(store, 3)
    _write_chain(store, 1, ns=OTHER_NS)
    assert store.touch(ids[0], when=1000.0)
    assert store.path_for(NS, ids[0]).stat().st_mtime == 1000.0
    stats = store.stats()
    assert stats.num_pages == 4 and stats.oldest_last_used == 1000.0
    assert stats.namespaces[NS.hex()].num_pages == 3
    assert stats.num_bytes == store.num_bytes
    nbytes = store.get(ids[2]).nbytes
    assert store.delete([ids[2], bytes(16)]) == nbytes
    assert not store.path_for(NS, ids[2]).exists() and ids[2] not in store
    assert store.num_bytes == stats.num_bytes - nbytes
    assert not store.touch(ids[2])
    # Recency survives a restart (mtime).
    again = PageStore(store.root)
    again.scan()
    assert again.get(ids[0]).last_used == 1000.0


def test_disk_full_raises_store_unavailable(store, monkeypatch):
    def full(fd, buf):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod, "_write_all", full)
    with pytest.raises(StoreUnavailable, match="No space left"):
        store.write(NS, ROOT_ID, _tokens(0), _payload(0))
    assert len(store) == 0 and not list(store.root.rglob("*.tmp"))


def test_read_only_disk_raises_store_unavailable(store, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args, **kw):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(store_mod.os, "open", read_only)
    with pytest.raises(StoreUnavailable, match="Read-only"):
        store.write(NS, ROOT_ID, _tokens(0), _payload(0))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory_raises_store_unavailable(tmp_path):
    store = PageStore(tmp_path / "kv")
    store.root.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailable):
            store.write(NS, ROOT_ID, _tokens(0), _payload(0))
    finally:
        store.root.chmod(0o700)


def test_scan_of_2000_pages_is_fast(tmp_path):
    writer = PageStore(tmp_path / "kv", sync=False)
    tokens = list(range(2000 * P))
    ids = chain_page_ids(NS, tokens, P)
    payload = _payload(0, 256)
    for i, pid in enumerate(ids):
        writer.write(NS, ids[i - 1] if i else ROOT_ID, tokens[i * P:(i + 1) * P], payload,
                     page_id=pid)
    started = time.perf_counter()
    infos = PageStore(writer.root).scan()
    elapsed = time.perf_counter() - started
    print(f"scan of {len(infos)} pages: {elapsed * 1000:.0f} ms "
          f"({len(infos) / elapsed:.0f} pages/s)")
    assert len(infos) == 2000


def test_a_batch_is_read_in_parallel_each_page_judged_on_its_own(store):
    ids = _write_chain(store, 6)
    bad = store.path_for(NS, ids[2])
    bad.write_bytes(_flip_payload(bytearray(bad.read_bytes())))
    store.path_for(NS, ids[4]).unlink()
    outs = [bytearray(8192) for _ in ids]
    tokens = [_tokens(i) for i in range(6)]
    tokens[3] = _tokens(9)  # the caller expects other tokens: a miss
    headers = store.read_many(NS, list(zip(ids, tokens, map(memoryview, outs))))
    good = [i for i, h in enumerate(headers) if h is not None]
    assert good == [0, 1, 5]
    for i in good:
        assert headers[i].page_id == ids[i]
        assert bytes(outs[i][:headers[i].payload_len]) == _payload(i).tobytes()
    # Corrupt (bad checksum, wrong tokens) pages are removed; the missing one leaves the index.
    assert store.num_corrupt_removed == 2
    assert [pid in store for pid in ids] == [True, True, False, False, False, True]
    assert not store.path_for(NS, ids[2]).exists() and not store.path_for(NS, ids[3]).exists()
    store.close()


def test_a_shard_removed_under_the_store_is_made_again(store):
    ids = _write_chain(store, 1)
    shutil.rmtree(store.root / NS.hex()[:8])
    store.write(NS, ROOT_ID, _tokens(0), _payload(0), page_id=ids[0])
    assert _read(store, ids[0], 0)[0] is not None


def test_pages_of_another_format_version_are_removed_quietly_by_the_scan(store):
    """An upgrade (format 2, unkeyed xxh3, to 3): the old pages can never be read; the scan
    removes them and counts them, without a corrupt-page line each."""
    ids = _write_chain(store, 2)
    old = store.path_for(NS, ids[1])
    data = bytearray(old.read_bytes())
    data[8:10] = (2).to_bytes(2, "little")  # the prefix's format version
    old.write_bytes(bytes(data))
    again = PageStore(store.root)
    events = []
    again.on_corrupt = events.append
    assert [p.page_id for p in again.scan()] == [ids[0]]
    assert not old.exists() and again.num_other_format_removed == 1 and not events
