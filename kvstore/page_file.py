"""One page file on disk: its name, how it is opened, its header read and checked, its payload
read into a buffer and verified. No shared state, so the store's reader threads call it.

What is checked, on every read and (all but the payload) by the store's start-up scan: the
header's own fields and check, the file's size against them, its owner (ours), its name and
directory, the model's page geometry once the worker attached (`PageGeometry`: payload length
for its token count and flags, tokens per page), the buffer it is read into, the tokens asked
for and the payload's keyed checksum (docs/design/kv-pages.md "KV pages"). A page that fails
any check raises `CorruptPage` here; the store removes it and counts it as a miss.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from switchyard.kvstore.pages import (
    PREFIX_SIZE,
    CorruptPage,
    PageHeader,
    decode_header,
    header_length,
    payload_checksum,
)
from switchyard.proto.page_flags import PageFlags

PAGE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"
# One read covers the header of a page of up to ~990 tokens (P=256 needs 1152 bytes).
_FIRST_READ = 4096
# Page files are opened without following a symlink and without blocking on a FIFO planted
# in the directory; files are created 0600 in 0700 directories (their headers hold prompt
# token ids): docs/design/security.md "Security".
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class PageGeometry:
    """What the attached worker's pages look like (AttachBuffers): a page of n tokens holds
    n * token_bytes of K and V, plus state_bytes of recurrent state with RECURRENT_STATE."""

    namespace: bytes
    page_size: int
    token_bytes: int
    state_bytes: int = 0

    def problem(self, num_tokens: int, flags: PageFlags, payload_len: int) -> str:
        if not 1 <= num_tokens <= self.page_size:
            return f"{num_tokens} tokens, pages hold 1 to {self.page_size}"
        if flags & PageFlags.RECURRENT_STATE and not self.state_bytes:
            return "a recurrent-state page, and the model has no recurrent state"
        want = num_tokens * self.token_bytes \
            + (self.state_bytes if flags & PageFlags.RECURRENT_STATE else 0)
        if payload_len != want:
            return (f"payload is {payload_len} bytes, the model's page of {num_tokens} tokens "
                    f"is {want}")
        return ""


def read_header(fd: int) -> tuple[PageHeader, os.stat_result]:
    """Header of an open page file, checked against the file size (catches truncation) and
    its owner (a page file of another user is never trusted)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptPage("not a regular file")
    if st.st_uid != os.getuid():
        raise CorruptPage(f"owned by uid {st.st_uid}, not ours")
    buf = os.pread(fd, _FIRST_READ, 0)
    header_len = header_length(buf[:PREFIX_SIZE])
    if header_len > len(buf):
        buf += os.pread(fd, header_len - len(buf), len(buf))
    header = decode_header(buf)
    if st.st_size != header_len + header.payload_len:
        raise CorruptPage(f"file is {st.st_size} bytes, header says "
                          f"{header_len + header.payload_len}")
    return header, st


@dataclass(frozen=True)
class PageRead:
    """What one thread found reading one page: the header when it was read and verified."""

    header: PageHeader | None = None
    size: int = 0
    used_at: float = 0.0
    corrupt: str = ""  # a bad page: removed by the caller
    unreadable: str = ""  # an I/O error: reported, kept


def read_page(path: Path, namespace: bytes, page_id: bytes, expected_token_ids: Sequence[int],
              out, key: bytes, geometry: PageGeometry | None = None) -> PageRead:
    """Open, verify and read one page file into `out`, touching no shared state (threads)."""
    out = memoryview(out).cast("B")
    try:
        fd = os.open(path, OPEN_READ)
    except FileNotFoundError:
        return PageRead()
    except OSError as exc:
        return PageRead(unreadable=f"unreadable: {exc.strerror}")
    try:
        with open(fd, "rb", buffering=0, closefd=True) as f:
            header, st = read_header(fd)
            problem = _mismatch(header, namespace, page_id, expected_token_ids) or (
                geometry.problem(header.num_tokens, header.flags, header.payload_len)
                if geometry is not None else "")
            if problem:
                raise CorruptPage(problem)
            n = header.payload_len
            if n > out.nbytes:  # the header lies (a worker's buffer holds its pages)
                raise CorruptPage(f"page payload is {n} bytes, buffer {out.nbytes}")
            f.seek(header.header_len)
            got = 0
            while got < n:  # one read of the whole payload, straight into the buffer
                step = f.readinto(out[got:n])
                if not step:
                    raise CorruptPage("payload shorter than its header says")
                got += step
            if payload_checksum(key, header.namespace, header.page_id, header.flags,
                                out[:n]) != header.payload_checksum:
                raise CorruptPage("payload checksum mismatch (damaged, forged, or written "
                                  "with another page key)")
            now = time.time()
            try:
                os.utime(fd, (now, now))  # recency survives a restart (the file we read)
            except OSError:
                pass  # a read-only disk: recency is only kept in memory
    except CorruptPage as exc:
        return PageRead(corrupt=str(exc))
    except OSError as exc:  # EIO mid-read: a miss; the file may be fine next time
        return PageRead(unreadable=f"unreadable: {exc.strerror}")
    return PageRead(header, st.st_size, now)


def _mismatch(header: PageHeader, namespace: bytes, page_id: bytes,
              expected_token_ids: Sequence[int]) -> str | None:
    if header.namespace != namespace:
        return "namespace does not match"
    if header.page_id != page_id:
        return "page id does not match"
    if header.token_ids != tuple(expected_token_ids):
        return "token ids do not match"
    return None


def writer_gone(temp_name: str) -> bool:
    """Whether the writer of a temporary page file (`.<stem>.<pid>.<rand>.tmp`) is gone, or
    is us: its file is a crash leftover."""
    parts = temp_name.split(".")
    if len(parts) < 4 or not parts[-3].isdigit():
        return True
    pid = int(parts[-3])
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
