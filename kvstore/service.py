"""The kvstore checkpoint daemon: owns page files and their index; chooses nothing.

At start it scans the page directory (headers only) and rebuilds its index. It answers
`DescribeInventory` with every page it holds, writes pages the scheduler hands it from the
shared buffer pool, reads pages back into buffers (verified: a bad page is a miss, removed and
logged), deletes what the scheduler evicts. Reads jump ahead of queued writes: a restore is on
a request's critical path, a write-through never is. A disk that refuses pages (full,
read-only) makes persistence pause with a warning and retried after a short backoff (1 s,
doubling to 30 s, reset by a write that succeeds); serving goes on. An eviction the disk refused
is retried before any later write: nothing is written while pages the scheduler counted as
gone are still there (the budget holds). With `--peer`, it serves its pages to the peers' asks
the gateway forwards, and fetches the pages the scheduler asks for from the peers
(kvstore/peers.py; docs/design/kv-pages.md "Pages from a peer").
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from switchyard.kvstore.dir_lock import KvDirLocked, KvDirUnsafe, lock_kv_dir
from switchyard.kvstore.page_key import PageKeyError, key_path, load_page_key
from switchyard.kvstore.page_file import PageGeometry
from switchyard.kvstore.peers import Fetched, PeerFetcher, PeerPageServer
from switchyard.kvstore.store import CorruptEvent, PageStore, StoreUnavailable
from switchyard.common.backoff import Backoff
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir, rank_role
from switchyard.proto.ids import new_boot_id
from switchyard.common.logs import configure_logging
from switchyard.common.secret_keys import load_peer_key
from switchyard.common.secret_keys import SecretKeyError
from switchyard.proto.base import ROLE_KVSTORE
from switchyard.proto.scheduler_kvstore import (
    AttachBuffers,
    DeletePages,
    DescribeInventory,
    FetchPeerPages,
    InventoryDescribed,
    PageInfo,
    PagesDeleted,
    PagesRead,
    PagesWritten,
    PeerPagesFetched,
    ReadPages,
    TouchPages,
    WritePages,
)
from switchyard.proto.service_loop import GroupKeyRefused, SchedulerLink, StopFlag
from switchyard.common.settings import Settings, SettingsError
from switchyard.proto.shm import PageBufferPool, ShmError


class KvStoreDaemon:
    def __init__(self, settings: Settings, log, boot_id: str):
        self.settings = settings
        self.log = log
        self.boot_id = boot_id
        self.send = lambda message: None  # replaced by the scheduler link's send
        self.pool: PageBufferPool | None = None
        self.namespace = b""
        # Writes and deletes, in the order sent; reads go ahead of them.
        self.writes: deque[WritePages | DeletePages] = deque()
        self.error = ""  # why the disk refused the last try; "" after a write succeeded
        self.backoff = Backoff()
        self.clock = time.monotonic
        self.undeleted: set[bytes] = set()  # evicted pages the disk refused to delete
        # PageKeyError (a key file not ours, not private, not a key): the caller refuses.
        key, key_warning = load_page_key(key_path(settings.cache_path))
        if key_warning:
            log.warning("kv.page_key_temporary", reason=key_warning)
        self.store = PageStore(settings.rank_kv_path, key=key, on_corrupt=self._on_corrupt,
                               read_guard=True)
        started = time.perf_counter()
        self.lock_fd = -1
        try:
            # KvDirLocked, KvDirUnsafe (a level of the kv dir a symlink or another user's):
            # the caller refuses to start.
            self.lock_fd = lock_kv_dir(settings.rank_kv_path)
            self.inventory = self.store.scan()
        except OSError as exc:
            self.error = f"page directory {settings.rank_kv_path} is unusable: {exc.strerror}"
            self.backoff.failed(time.monotonic())
            self.inventory = []
            log.warning("kv.persistence_off", error=self.error)
        self.scan_s = time.perf_counter() - started
        self.peer_server: PeerPageServer | None = None
        self.fetcher: PeerFetcher | None = None
        if settings.peer:  # SettingsError, SecretKeyError: the caller refuses
            peer_key = load_peer_key(settings.peer_key_file, settings.cache_path)
            self.fetcher = PeerFetcher(tuple(settings.peer), peer_key, log)
            endpoint = Endpoints(ensure_runtime_dir(settings.runtime_path)).peer_pages
            self.peer_server = PeerPageServer(endpoint, self.store, peer_key, log)
            self.peer_server.start()
        log.info("kvstore.scanned", kv_dir=str(settings.rank_kv_path),
                 num_pages=len(self.inventory),
                 num_other_format_removed=self.store.num_other_format_removed,
                 disk_bytes=self.store.num_bytes, scan_s=round(self.scan_s, 3))

    def _on_corrupt(self, event: CorruptEvent) -> None:
        self.log.warning("kv.corrupt_page", path=event.path, reason=event.reason)

    # --- messages --------------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, ReadPages):
            self.read(msg)
        elif isinstance(msg, WritePages):
            self.writes.append(msg)
        elif isinstance(msg, AttachBuffers):
            self.flush_writes()  # queued writes name buffers of the pool being replaced
            self.attach(msg)
        elif isinstance(msg, DescribeInventory):
            self.flush_writes()
            self.send(InventoryDescribed(
                self.boot_id, tuple(self.store.pages()), self.scan_s,
                writable=not self.error, error=self.error))
        elif isinstance(msg, DeletePages):
            self.writes.append(msg)  # in order with the writes: a page written, then dropped
        elif isinstance(msg, TouchPages):
            now = time.time()
            for pid in msg.page_ids:
                self.store.touch(pid, now)
        elif isinstance(msg, FetchPeerPages):
            if self.fetcher is not None and self.namespace and self._may_write():
                self.fetcher.start(msg, self.namespace, self.store.geometry)
            else:  # nothing to fetch into: the request prefills now
                self.send(PeerPagesFetched(msg.rid, (), ()))

    def finish_fetches(self) -> None:
        """Write what the peers gave into the store, and tell the scheduler."""
        for fetched in self.fetcher.finished() if self.fetcher is not None else ():
            self.send(PeerPagesFetched(fetched.msg.rid, tuple(self._store_fetched(fetched)),
                                       fetched.results))
            for result in fetched.results:
                self.log.info("peer.fetched", rid=fetched.msg.rid, peer=result.peer,
                              num_pages=result.num_pages, num_bytes=result.num_bytes,
                              fetch_s=result.fetch_s, error=result.error)

    def _store_fetched(self, fetched: Fetched) -> list[PageInfo]:
        written = []
        for page in fetched.pages:
            h = page.header
            if h.namespace != self.namespace or not self._may_write():
                break
            try:
                self.store.write(self.namespace, h.parent_id, h.token_ids, page.payload,
                                 flags=h.flags, page_id=h.page_id, image_ids=h.image_ids)
            except StoreUnavailable as exc:
                self._refused(exc)
                break
            entry = self.store.get(h.page_id)
            written.append(PageInfo(h.page_id, h.parent_id, self.namespace, h.num_tokens,
                                    entry.nbytes, entry.last_used, entry.flags))
        return written

    def attach(self, msg: AttachBuffers) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        try:
            self.pool = PageBufferPool.attach(msg.shm_name, msg.num_buffers, msg.buffer_bytes)
        except ShmError as exc:
            self.log.error("kvstore.attach_failed", error=str(exc))
            return
        self.namespace = msg.namespace
        geometry = None
        if msg.page_size and msg.token_bytes:
            geometry = PageGeometry(msg.namespace, msg.page_size, msg.token_bytes,
                                    msg.state_bytes)
        self.store.set_geometry(geometry)  # removes indexed pages that disagree (logged)
        self.log.info("kvstore.attached", shm_name=msg.shm_name, num_buffers=msg.num_buffers,
                      buffer_bytes=msg.buffer_bytes)

    def read(self, msg: ReadPages) -> None:
        ok, missing = [], []
        num_bytes = 0
        started = time.perf_counter()
        headers = [None] * len(msg.reads)
        if self.pool is not None:
            headers = self.store.read_many(self.namespace, [
                (r.page_id, r.token_ids, self.pool.buffer(r.buffer)) for r in msg.reads])
        for r, header in zip(msg.reads, headers):
            (ok if header is not None else missing).append(r.page_id)
            num_bytes += header.payload_len if header is not None else 0
        self.send(PagesRead(tuple(ok), tuple(missing)))
        self.log.debug("kv.read", num_pages=len(ok), num_missing=len(missing),
                       num_bytes=num_bytes, read_s=round(time.perf_counter() - started, 4))

    def write_one_batch(self) -> None:
        msg = self.writes.popleft()
        if isinstance(msg, DeletePages):
            self.undeleted.update(msg.page_ids)
            freed = self._delete_refused_pages() if self._disk_ready() else 0
            self.send(PagesDeleted(msg.page_ids, freed))
            return
        written, failed = [], []
        for w in msg.writes:
            self.undeleted.discard(w.page_id)  # wanted again: no longer to delete
            if self.pool is None or not self._may_write():
                failed.append(w.page_id)
                continue
            try:
                nbytes = self.store.write(self.namespace, w.parent_id, w.token_ids,
                                          self.pool.buffer(w.buffer)[:w.payload_len],
                                          flags=w.flags, page_id=w.page_id,
                                          image_ids=w.image_ids)
            except StoreUnavailable as exc:
                self._refused(exc)
                failed.append(w.page_id)
                continue
            if nbytes:  # a page already stored proves nothing about the disk
                self._succeeded()
            entry = self.store.get(w.page_id)
            written.append(PageInfo(w.page_id, w.parent_id, self.namespace, len(w.token_ids),
                                    entry.nbytes, entry.last_used, entry.flags))
        self.send(PagesWritten(tuple(written), tuple(failed),
                                     tuple(w.buffer for w in msg.writes), self.error))

    def _disk_ready(self) -> bool:
        return not self.error or self.backoff.ready(self.clock())

    def _may_write(self) -> bool:
        """Whether to try the disk now: not while backing off after a refusal, nor while a
        refused eviction is still undone (the write would exceed the budget)."""
        if not self._disk_ready():
            return False
        if self.undeleted:
            self._delete_refused_pages()
        return not self.undeleted

    def _delete_refused_pages(self) -> int:
        freed = 0
        for pid in list(self.undeleted):
            try:
                freed += self.store.delete((pid,))
            except StoreUnavailable as exc:
                self._refused(exc)
                return freed
            self.undeleted.discard(pid)
        return freed

    def _refused(self, exc: StoreUnavailable) -> None:
        first = not self.error
        self.error = str(exc)
        delay = self.backoff.failed(self.clock())
        if first:
            self.log.warning("kv.persistence_off", error=self.error, retry_in_s=delay)

    def _succeeded(self) -> None:
        if self.error:
            self.log.info("kv.persistence_on", after=self.error)
        self.error = ""
        self.backoff.succeeded()

    def flush_writes(self) -> None:
        while self.writes:
            self.write_one_batch()

    def close(self) -> None:
        if self.peer_server is not None:
            self.peer_server.stop()
        if self.fetcher is not None:
            self.fetcher.close()
        self.store.close()
        if self.pool is not None:
            self.pool.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def run(settings: Settings) -> None:
    boot_id = new_boot_id()
    log = configure_logging(rank_role(ROLE_KVSTORE, settings.rank), boot_id,
                            settings.log_level, settings.log_format, settings.log_content)
    stop = StopFlag()
    try:
        daemon = KvStoreDaemon(settings, log, boot_id)
    except (KvDirLocked, KvDirUnsafe, PageKeyError, SettingsError, SecretKeyError) as exc:
        # refuse to start: exit 2 ends the group with a message
        log.error("kvstore.refused_to_start", reason=str(exc))
        print(f"switchyard kvstore: {exc}", file=sys.stderr)
        sys.exit(2)
    # Rank R of a worker group is `kvstore.R` to the scheduler (docs/design/worker-groups.md "Pages per rank").
    try:
        link = SchedulerLink(settings, rank_role(ROLE_KVSTORE, settings.rank), boot_id, log,
                             stop=stop)
    except SettingsError as exc:  # the group key file is missing, readable by others or bad
        _refuse(log, exc, daemon)
    daemon.send = link.send
    log.info("kvstore.started", kv_dir=str(settings.rank_kv_path))
    try:
        while not stop.requested:
            # With writes queued, only peek: a read arriving meanwhile goes first. While
            # peers are asked, look for their answers often.
            fetching = daemon.fetcher is not None and daemon.fetcher.num_inflight
            message = link.receive(0.0 if daemon.writes else 0.005 if fetching
                                   else settings.heartbeat_s)
            if message is not None:
                daemon.handle(message)
            elif daemon.writes:
                daemon.write_one_batch()
            if fetching:
                daemon.finish_fetches()
    except GroupKeyRefused as exc:  # another group's key file: retrying cannot help
        refused = exc
    else:
        refused = None
    finally:
        daemon.close()
        link.close()
        log.info("kvstore.stopped")
    if refused is not None:
        _refuse(log, refused)


def _refuse(log, exc: Exception, daemon: KvStoreDaemon | None = None) -> None:
    """Exit 2: the supervisor reports the reason and does not restart (deploy/supervisor.py)."""
    log.error("kvstore.refused_to_start", reason=str(exc))
    print(f"switchyard kvstore: {exc}", file=sys.stderr)
    if daemon is not None:
        daemon.close()
    sys.exit(2)
