"""Page files on disk and their in-memory index (docs/design/kv-pages.md "KV pages").

Layout: `<root>/<namespace hex[:8]>/<page_id hex[:2]>/<page_id hex>.page`. Sharding keeps
directories small (a 100K-page cache is ~400 files per directory). Writes go to a temporary
name in the same directory, are fsynced and renamed, then the directory is fsynced: a crash
leaves either the whole page or a `.tmp` file that the next scan removes.

The store chooses nothing (the scheduler picks what to evict) and never raises on bad data: a
page that fails any check (kvstore/page_file.py says which) is a miss, its file is removed and
the event is counted and reported. Disk trouble that makes persistence impossible (full,
read-only, no permission) raises StoreUnavailable so the daemon can keep serving without
persistence.

The directories at every level (root, namespace, shard) must be real directories of ours:
the root is checked before anything else (kvstore/dir_lock.py), namespace and shard
directories by the scan and when a write first uses them; a symlink or another user's
directory raises KvDirUnsafe (the kvstore refuses to start), a mode other than 0700 is
tightened.

With `read_guard`, the pages being read are named in `<root>/reading` until the batch is done,
so a page that crashes its reader costs one restart, never a crash loop (kvstore/read_guard.py).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from switchyard.kvstore import page_file, pages
from switchyard.kvstore.dir_lock import KvDirUnsafe, check_private_dir
from switchyard.kvstore.page_file import (OPEN_READ, PAGE_SUFFIX, TEMP_SUFFIX, PageGeometry,
                                          read_header, writer_gone)
from switchyard.kvstore.page_key import key_path, load_page_key
from switchyard.kvstore.pages import (CorruptPage, OtherFormat, PageHeader, encode_header,
                                      make_header)
from switchyard.kvstore.read_guard import ReadGuard
from switchyard.proto.scheduler_kvstore import PageInfo
from switchyard.proto.page_flags import PageFlags
from switchyard.common.settings import user_cache_dir

# Threads reading the pages of one restore batch: enough to keep an SSD's queue busy and to
# verify checksums on several cores; reads release the GIL.
READ_THREADS = max(4, min(8, os.cpu_count() or 1))
# Errors that mean "this disk cannot take our pages now", as opposed to a bug.
_UNAVAILABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO,
                errno.ENOTDIR, errno.ENAMETOOLONG}


class StoreUnavailable(RuntimeError):
    """The page directory cannot be written (full, read-only, permissions, I/O error)."""


@dataclass(frozen=True)
class IndexEntry:
    namespace: bytes
    parent_id: bytes
    num_tokens: int
    nbytes: int  # file size: what counts against the disk budget
    last_used: float  # file mtime, so recency survives a restart
    path: Path
    flags: PageFlags = PageFlags.NONE  # RECURRENT_STATE: a restore point of a hybrid model
    payload_len: int = -1  # from the header (-1: not known, an entry made by a write)


@dataclass(frozen=True)
class CorruptEvent:
    at: float
    path: str
    reason: str


@dataclass(frozen=True)
class NamespaceStats:
    num_pages: int
    num_bytes: int


@dataclass(frozen=True)
class StoreStats:
    num_pages: int
    num_bytes: int
    namespaces: dict[str, NamespaceStats]  # namespace hex -> counts
    oldest_last_used: float | None
    newest_last_used: float | None
    num_corrupt_removed: int
    num_temp_removed: int


def _unavailable(root: Path, exc: OSError) -> StoreUnavailable:
    return StoreUnavailable(
        f"KV page store {root} is unavailable ({exc.strerror or exc}); pages are not being "
        f"persisted: free disk space, fix permissions or choose another --kv-dir")


def _write_all(fd: int, buf: memoryview) -> None:
    while buf:
        buf = buf[os.write(fd, buf):]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PageStore:
    def __init__(self, root: Path, *, sync: bool = True, key: bytes | None = None,
                 on_corrupt: Callable[[CorruptEvent], None] | None = None,
                 read_guard: bool = False):
        """`sync=False` skips fsync (tests, benchmarks): not crash-safe. `key` keys the page
        checksums; by default the install's (`<user cache dir>/page.key`, kvstore/page_key.py).
        `read_guard`: keep `<root>/reading` (the daemon's; see the module's doc)."""
        self.root = Path(root)
        self.sync = sync
        self.key = key if key is not None else load_page_key(key_path(user_cache_dir()))[0]
        self.on_corrupt = on_corrupt
        self.read_guard = ReadGuard(self.root) if read_guard else None
        self.geometry: PageGeometry | None = None
        self._private_dirs: set[Path] = set()  # checked, or made by us
        self.num_corrupt_removed = 0
        self.num_temp_removed = 0
        # Pages of another format version (an upgrade): removed by the scan, counted, not
        # logged one by one (they are not damage, and there may be 100K of them).
        self.num_other_format_removed = 0
        self.corrupt_events: collections.deque[CorruptEvent] = collections.deque(maxlen=64)
        self._index: dict[bytes, IndexEntry] = {}
        self._num_bytes = 0
        self._pool: ThreadPoolExecutor | None = None  # page readers, started on first use
        # The directory is created by the first write: a store over a path that cannot be a
        # directory still answers (every lookup a miss) and reports StoreUnavailable on write.

    # --- paths and index ------------------------------------------------------------------

    def path_for(self, namespace: bytes, page_id: bytes) -> Path:
        hex_id = page_id.hex()
        return self.root / namespace.hex()[:8] / hex_id[:2] / (hex_id + PAGE_SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, page_id: bytes) -> bool:
        return page_id in self._index

    def get(self, page_id: bytes) -> IndexEntry | None:
        return self._index.get(page_id)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def pages(self) -> list[PageInfo]:
        """The inventory, as the scheduler receives it."""
        return [PageInfo(pid, e.parent_id, e.namespace, e.num_tokens, e.nbytes, e.last_used,
                         e.flags) for pid, e in self._index.items()]

    def _add(self, page_id: bytes, entry: IndexEntry) -> None:
        self._drop(page_id)
        self._index[page_id] = entry
        self._num_bytes += entry.nbytes

    def _drop(self, page_id: bytes) -> IndexEntry | None:
        entry = self._index.pop(page_id, None)
        if entry is not None:
            self._num_bytes -= entry.nbytes
        return entry

    def _entry(self, header: PageHeader, path: Path, st: os.stat_result) -> IndexEntry:
        return IndexEntry(header.namespace, header.parent_id, header.num_tokens, st.st_size,
                          st.st_mtime, path, header.flags, header.payload_len)

    def set_geometry(self, geometry: PageGeometry | None) -> int:
        """The attached worker's page geometry: from now on every read checks it, and the
        pages already indexed in its namespace that disagree are removed now (the scan could
        not judge them before a worker said what its pages look like). Returns how many."""
        self.geometry = geometry
        if geometry is None:
            return 0
        bad = []
        for pid, e in self._index.items():
            if e.namespace == geometry.namespace and e.payload_len >= 0:
                problem = geometry.problem(e.num_tokens, e.flags, e.payload_len)
                if problem:
                    bad.append((pid, e.path, problem))
        for pid, path, problem in bad:
            self._discard(path, pid, problem)
        return len(bad)

    def _discard(self, path: Path, page_id: bytes | None, reason: str) -> None:
        """A bad page is a miss: remove it, count it, report it; never raise."""
        if page_id is not None:
            self._drop(page_id)
        try:
            os.unlink(path)
        except OSError:
            pass  # already gone, or a read-only disk: it stays a miss either way
        self.num_corrupt_removed += 1
        event = CorruptEvent(time.time(), str(path), reason)
        self.corrupt_events.append(event)
        if self.on_corrupt is not None:
            self.on_corrupt(event)

    # --- write ----------------------------------------------------------------------------

    def write(self, namespace: bytes, parent_id: bytes, token_ids: Sequence[int], payload,
              *, flags: PageFlags = PageFlags.NONE, page_id: bytes | None = None,
              image_ids: bytes = b"") -> int:
        """Persist one page; returns bytes written (0 when a valid copy is already stored).

        `page_id`, when given, must equal the id computed from namespace, parent, tokens and
        the ids of the images the page covers (`image_ids`). The id does not cover flags: a
        page stored with other flags (a recurrent-state snapshot added or dropped) is
        replaced atomically.
        """
        payload = memoryview(payload).cast("B")
        flags = PageFlags(flags)
        tokens = tuple(int(t) for t in token_ids)
        pid = pages.page_id(namespace, parent_id, tokens, image_ids)
        if page_id is not None and page_id != pid:
            raise ValueError("page_id does not match namespace, parent_id, token_ids and "
                             "image_ids")
        path = self.path_for(namespace, pid)
        nbytes = pages.header_size(len(tokens), len(image_ids) // pages.ID_BYTES) \
            + payload.nbytes
        # Before the checksum: a page saved again (shared prefix) costs a stat, not a hash.
        if self._already_stored(pid, path, flags, nbytes):
            self.touch(pid)
            return 0
        header = make_header(namespace, parent_id, tokens, payload, flags=flags,
                             image_ids=image_ids, key=self.key)
        head = encode_header(header)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        fd = -1
        try:
            self._make_private_dirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            _write_all(fd, memoryview(head))
            _write_all(fd, payload)
            if self.sync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            if self.sync:
                _fsync_dir(path.parent)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if exc.errno in _UNAVAILABLE:
                raise _unavailable(self.root, exc) from exc
            raise
        self._add(header.page_id, IndexEntry(namespace, parent_id, header.num_tokens, nbytes,
                                             time.time(), path, flags, payload.nbytes))
        return nbytes

    def _make_private_dirs(self, shard: Path) -> None:
        """root/ns/shard, each created 0700 (mkdir's mode for every level, not only the
        last); one that existed already is used only once checked (kvstore/dir_lock.py)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for directory in (self.root, shard.parent, shard):
            try:  # every time: a directory removed under us is made again
                os.mkdir(directory, 0o700)
            except FileExistsError:
                if directory in self._private_dirs:
                    continue
                try:
                    check_private_dir(directory, "KV page directory")
                except KvDirUnsafe as exc:
                    raise StoreUnavailable(f"{exc}; pages are not being persisted") from None
            self._private_dirs.add(directory)

    def _already_stored(self, page_id: bytes, path: Path, flags: PageFlags,
                        nbytes: int) -> bool:
        entry = self._index.get(page_id)
        try:
            if entry is not None:
                return (entry.flags, entry.nbytes) == (flags, nbytes) \
                    and os.stat(path).st_size == nbytes
            fd = os.open(path, OPEN_READ)
        except OSError:  # missing, or a symlink (ELOOP): the rename replaces it
            return False
        try:
            header, st = read_header(fd)
        except (CorruptPage, OSError):
            return False  # rewritten by the caller; the rename replaces it
        finally:
            os.close(fd)
        if header.page_id != page_id or header.namespace.hex()[:8] != path.parent.parent.name:
            return False
        self._add(page_id, self._entry(header, path, st))
        return (header.flags, st.st_size) == (flags, nbytes)

    # --- read -----------------------------------------------------------------------------

    def read_into(self, namespace: bytes, page_id: bytes, expected_token_ids: Sequence[int],
                  out: memoryview) -> PageHeader | None:
        """Read a page's payload into `out[:payload_len]`; None on a miss or a bad page.

        Verifies namespace, page id, token ids and the payload checksum. A successful read
        marks the page used (mtime), so recency survives a restart.
        """
        return self.read_many(namespace, [(page_id, expected_token_ids, out)])[0]

    def read_many(self, namespace: bytes,
                  reads: Sequence[tuple[bytes, Sequence[int], memoryview]]
                  ) -> list[PageHeader | None]:
        """`read_into` for each (page_id, token ids, buffer), on several threads.

        A restore reads a batch of pages: read and verified in parallel they keep the disk's
        queue full and the checksums off one core (docs/design/kv-pages.md "Restores"). The
        index is updated afterwards, here, in order.
        """
        geometry = self.geometry if self.geometry and self.geometry.namespace == namespace \
            else None
        jobs = [(self.path_for(namespace, pid), namespace, pid, tokens, out, self.key, geometry)
                for pid, tokens, out in reads]
        self._guard([job[0] for job in jobs])
        if len(jobs) > 1:
            results = list(self._readers().map(lambda job: page_file.read_page(*job), jobs))
        else:
            results = [page_file.read_page(*job) for job in jobs]
        self._guard([])
        headers = []
        for (path, _, pid, *_), r in zip(jobs, results):
            if r.header is not None:
                self._add(pid, IndexEntry(namespace, r.header.parent_id, r.header.num_tokens,
                                          r.size, r.used_at, path, r.header.flags,
                                          r.header.payload_len))
            elif r.corrupt:
                self._discard(path, pid, r.corrupt)
            elif r.unreadable:
                self._report(path, r.unreadable)  # an EIO may pass: the file stays
            else:
                self._drop(pid)  # gone
            headers.append(r.header)
        return headers

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-read")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.read_guard is not None:
            self.read_guard.close()

    def _guard(self, paths: list[Path]) -> None:
        if self.read_guard is not None:
            self.read_guard.reading(paths)

    def _report(self, path: Path, reason: str) -> None:
        event = CorruptEvent(time.time(), str(path), reason)
        self.corrupt_events.append(event)
        if self.on_corrupt is not None:
            self.on_corrupt(event)

    # --- scan -----------------------------------------------------------------------------

    def scan(self) -> list[PageInfo]:
        """Rebuild the index from page headers; remove crash leftovers and bad pages (and the
        pages a kvstore was reading when it died)."""
        self._index.clear()
        self._num_bytes = 0
        if self.read_guard is not None:
            for page in self.read_guard.died_reading():
                self._discard(page, None, "being read when the kvstore died")
        for ns_dir in self._checked_subdirs(self.root):
            for shard in self._checked_subdirs(ns_dir):
                with os.scandir(shard) as entries:
                    names = [e.name for e in entries]
                for name in names:
                    if name.endswith(TEMP_SUFFIX):
                        self._remove_temp(shard / name)
                    elif name.endswith(PAGE_SUFFIX):
                        self._scan_page(shard, name)
        return self.pages()

    def _checked_subdirs(self, path: Path) -> list[Path]:
        """Subdirectories of `path`, each checked (KvDirUnsafe for a symlink or another
        user's directory: the kvstore refuses to start; group or world access is removed)."""
        try:
            with os.scandir(path) as entries:
                found = [Path(e.path) for e in entries
                         if e.is_dir(follow_symlinks=False) or e.is_symlink()]
        except OSError:
            return []
        for directory in found:
            check_private_dir(directory, "KV page directory")
            self._private_dirs.add(directory)
        return found

    def _remove_temp(self, path: Path) -> None:
        """A crash leftover: ours, or a writer that is gone (`.<stem>.<pid>.<rand>.tmp`)."""
        if not writer_gone(path.name):
            return
        try:
            os.unlink(path)
            self.num_temp_removed += 1
        except OSError:
            pass

    def _scan_page(self, shard: Path, name: str) -> None:
        path = shard / name
        try:
            fd = os.open(path, OPEN_READ)
        except OSError as exc:  # a symlink (ELOOP) is never followed
            self._report(path, f"unreadable: {exc.strerror}")
            return
        try:
            header, st = read_header(fd)
        except OtherFormat:
            try:
                os.unlink(path)
                self.num_other_format_removed += 1
            except OSError:
                pass
            return
        except CorruptPage as exc:
            self._discard(path, None, str(exc))
            return
        except OSError as exc:
            self._report(path, f"unreadable: {exc.strerror}")
            return
        finally:
            os.close(fd)
        # String checks, not path_for(): pathlib costs more than reading the header.
        hex_id = header.page_id.hex()
        if (name != hex_id + PAGE_SUFFIX or shard.name != hex_id[:2]
                or shard.parent.name != header.namespace.hex()[:8]):
            self._discard(path, None, "file name or directory does not match its header")
            return
        self._add(header.page_id, self._entry(header, path, st))

    # --- delete, touch, stats -------------------------------------------------------------

    def delete(self, page_ids: Iterable[bytes]) -> int:
        """Remove pages (eviction); returns bytes freed. Unknown ids are ignored."""
        freed = 0
        for pid in page_ids:
            entry = self._drop(pid)
            if entry is None:
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._add(pid, entry)
                if exc.errno in _UNAVAILABLE:
                    raise _unavailable(self.root, exc) from exc
                raise
            freed += entry.nbytes
        return freed

    def touch(self, page_id: bytes, when: float | None = None) -> bool:
        """Mark a page used now (its file mtime); False if it is not stored."""
        entry = self._index.get(page_id)
        if entry is None:
            return False
        when = time.time() if when is None else when
        if not self._touch_path(entry.path, when):
            self._drop(page_id)
            return False
        self._index[page_id] = dataclasses.replace(entry, last_used=when)
        return True

    def _touch_path(self, path: Path, when: float) -> bool:
        try:
            os.utime(path, (when, when))
        except FileNotFoundError:
            return False
        except OSError:
            pass  # read-only disk: recency is only kept in memory
        return True

    def stats(self) -> StoreStats:
        per_ns: dict[bytes, list[int]] = {}
        for e in self._index.values():
            counts = per_ns.setdefault(e.namespace, [0, 0])
            counts[0] += 1
            counts[1] += e.nbytes
        used = [e.last_used for e in self._index.values()]
        return StoreStats(
            num_pages=len(self._index),
            num_bytes=self._num_bytes,
            namespaces={ns.hex(): NamespaceStats(n, b) for ns, (n, b) in per_ns.items()},
            oldest_last_used=min(used, default=None),
            newest_last_used=max(used, default=None),
            num_corrupt_removed=self.num_corrupt_removed,
            num_temp_removed=self.num_temp_removed,
        )


def read_entries(root: Path) -> tuple[list[IndexEntry], int]:
    """Every readable page's index entry, and the number of unreadable files, changing nothing.

    For `switchyard cache stats` while a daemon may be writing: no temp file or bad page is
    removed here (the daemon's scan does that).
    """
    entries, num_bad = [], 0
    for ns_dir in _subdirs(Path(root)):
        for shard in _subdirs(ns_dir):
            for path in shard.glob(f"*{PAGE_SUFFIX}"):
                try:
                    fd = os.open(path, OPEN_READ)
                except OSError:
                    num_bad += 1
                    continue
                try:
                    header, st = read_header(fd)
                    entries.append(IndexEntry(header.namespace, header.parent_id,
                                              header.num_tokens, st.st_size, st.st_mtime, path,
                                              header.flags))
                except (CorruptPage, OSError):
                    num_bad += 1
                finally:
                    os.close(fd)
    return entries, num_bad


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as entries:
            return [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
