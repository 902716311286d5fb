"""After the page disk refused a write: retry after 1 s, doubling to 30 s, reset by a write that
succeeds; on both sides (kvstore daemon, scheduler page cache). Pure, fake clock."""

import errno
import os

import numpy as np
import pytest

from switchyard.kvstore.pages import ROOT_ID, chain_page_ids, make_namespace
from switchyard.kvstore.service import KvStoreDaemon
from switchyard.kvstore.store import _unavailable
from switchyard.common.backoff import Backoff
from switchyard.proto.scheduler_kvstore import (
    DeletePages,
    PageInfo,
    PagesDeleted,
    PagesWritten,
    PageWrite,
    WritePages,
)
from switchyard.common.settings import Settings
from switchyard.scheduler.outbox import Outbox
from switchyard.scheduler.page_cache import PageCache

NS = make_namespace("model-a")
P = 16


def test_backoff_doubles_to_its_cap_and_resets_on_success():
    b = Backoff(1.0, 30.0)
    assert b.ready(0.0) and not b.failing
    delays = [b.failed(100.0 + i) for i in range(7)]
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert not b.ready(106.0 + 29.9) and b.ready(106.0 + 30.0)
    b.succeeded()
    assert b.ready(0.0) and not b.failing
    assert b.failed(200.0) == 1.0


# --- kvstore ---------------------------------------------------------------------------------


class _Log:
    def __init__(self):
        self.events = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((level, event))


class _Pool:
    def __init__(self, n, nbytes):
        self.data = [np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
                     for i in range(n)]

    def buffer(self, i):
        return memoryview(self.data[i])

    def close(self):
        pass


class _Disk:
    """Makes the store's writes and deletes fail like a full or immutable directory."""

    def __init__(self, store):
        self.refusing = False
        self.tries = 0
        self.root = store.root
        write, delete = store.write, store.delete

        def guarded(real):
            def call(*args, **kw):
                self.tries += 1
                if self.refusing:
                    raise _unavailable(self.root, OSError(errno.EPERM, os.strerror(errno.EPERM)))
                return real(*args, **kw)
            return call

        store.write, store.delete = guarded(write), guarded(delete)


@pytest.fixture
def daemon(tmp_path):
    d = KvStoreDaemon(Settings(kv_dir=str(tmp_path / "kv")), _Log(), "boot")
    d.now = 1000.0
    d.clock = lambda: d.now
    d.sent = []
    d.send = d.sent.append
    d.pool = _Pool(16, 256)
    d.namespace = NS
    d.disk = _Disk(d.store)
    yield d
    d.close()


def _writes(first, n):
    tokens = [t for i in range(first + n) for t in range(i * P, (i + 1) * P)]
    ids = chain_page_ids(NS, tokens, P)
    return [PageWrite(ids[i], ids[i - 1] if i else ROOT_ID, tuple(tokens[i * P:(i + 1) * P]),
                      i % 16, 256, 0) for i in range(first, first + n)]


def _write(d, writes) -> PagesWritten:
    d.handle(WritePages(tuple(writes)))
    d.flush_writes()
    return d.sent[-1]


def test_kvstore_retries_a_refusing_disk_after_1s_doubling_and_resets(daemon):
    d = daemon
    d.disk.refusing = True
    reply = _write(d, _writes(0, 2))
    assert reply.failed and reply.error and d.disk.tries == 1  # one try per batch, not per page
    d.now += 0.5
    assert _write(d, _writes(2, 1)).failed and d.disk.tries == 1  # backing off: disk not tried
    d.now += 0.6  # 1.1 s after the refusal
    assert _write(d, _writes(2, 1)).failed and d.disk.tries == 2
    d.now += 1.5
    assert _write(d, _writes(2, 1)).failed and d.disk.tries == 2  # now 2 s
    d.now += 0.6
    d.disk.refusing = False  # space was freed
    reply = _write(d, _writes(2, 2))
    assert len(reply.written) == 2 and not reply.failed and reply.error == ""
    assert not d.backoff.failing
    d.disk.refusing = True  # a new refusal starts again at 1 s
    _write(d, _writes(4, 1))
    assert d.backoff.delay_s == 1.0


def test_kvstore_writes_nothing_while_an_eviction_it_refused_is_undone(daemon):
    d = daemon
    kept = _writes(0, 3)
    assert len(_write(d, kept).written) == 3
    d.disk.refusing = True
    d.handle(DeletePages((kept[2].page_id,)))  # the scheduler made room for what follows
    d.flush_writes()
    assert isinstance(d.sent[-1], PagesDeleted) and kept[2].page_id in d.store
    d.disk.refusing = False
    d.now += 5
    reply = _write(d, _writes(3, 1))  # the delete goes first, then the write
    assert len(reply.written) == 1 and kept[2].page_id not in d.store
    assert not d.undeleted


# --- scheduler -------------------------------------------------------------------------------


def _cache():
    c = PageCache(P, budget_bytes=1 << 30, protect_window_s=3600, outbox=Outbox())
    c.worker_ready(NS, "shm", 8, 4096, 0)
    c.kvstore_inventory((), True, 0.0)
    return c


def _info(pid):
    return PageInfo(pid, ROOT_ID, NS, P, 4196, 0.0, 0)


def test_scheduler_stages_again_1s_after_a_refusal_doubling_and_resets():
    c = _cache()
    pid = b"p" * 16
    c.pages_written(PagesWritten((), (pid,), (0,), "disk full"), now=100.0)
    logs = c.outbox.take().logs
    assert logs[-1][0] == "kv.persistence_off" and logs[-1][1]["retry_in_s"] == 1.0
    assert not c.write_backoff.ready(100.9) and c.write_backoff.ready(101.0)
    c.pages_written(PagesWritten((), (pid,), (0,), "disk full"), now=101.0)
    assert c.write_backoff.retry_at == 103.0
    c.pages_written(PagesWritten((_info(pid),), (), (0,), ""), now=103.0)
    assert c.write_backoff.ready(103.0) and not c.write_backoff.failing
    assert c.outbox.take().logs[-1][0] == "kv.persistence_on"


def test_scheduler_backs_off_when_kvstore_starts_on_an_unwritable_disk():
    c = PageCache(P, budget_bytes=1 << 30, protect_window_s=3600, outbox=Outbox())
    c.worker_ready(NS, "shm", 8, 4096, 0)
    c.kvstore_inventory((), False, now=50.0)
    assert not c.write_backoff.ready(50.5) and c.write_backoff.ready(51.0)

