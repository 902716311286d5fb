"""The install's page key: the secret that keys page checksums (docs/design.md "Security").

`<cache dir>/page.key`, 32 random bytes, created once 0600 (never overwritten, never through a
symlink) and read back on every start. It lives outside the page directory, so write access to
the pages (a kv-dir on an external volume that ignores ownership, a copied cache) is not enough
to forge one that verifies. A lost key costs only re-reads: every page becomes a miss.

A cache dir where no key can be created (read-only, full) gets a key for this run only, with
a warning: pages written now verify until the kvstore restarts. A key file that exists but is
not ours, not private or not a key is refused: `PageKeyError`, and the kvstore does not start.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from switchyard.kvstore.pages import KEY_BYTES

KEY_NAME = "page.key"
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Cannot create a key there now: run with a key of this run only.
_CANNOT_CREATE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO,
                  errno.ENOTDIR}


class PageKeyError(RuntimeError):
    """The key file exists but cannot be trusted or used."""


def key_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / KEY_NAME


def load_page_key(path: Path) -> tuple[bytes, str]:
    """(the key, "" or why it is a key for this run only)."""
    path = Path(path)
    try:
        try:
            return _read(path), ""
        except FileNotFoundError:
            return _create(path), ""
    except OSError as exc:
        if exc.errno not in _CANNOT_CREATE:
            raise PageKeyError(f"page key {path}: {exc.strerror}") from None
        return secrets.token_bytes(KEY_BYTES), (
            f"cannot read or create the page key {path} ({exc.strerror}): pages written now "
            f"are misses after the kvstore restarts")


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, _OPEN)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise PageKeyError(f"page key {path} is a symbolic link: remove it and restart (a new "
                           f"key is made; pages written with the old one become misses)") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        problem = ""
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.getuid():
            problem = f"belongs to uid {info.st_uid}, not ours"
        elif info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            problem = "is accessible to its group or other users"
        key = f.read(KEY_BYTES + 1) if not problem else b""
        if not problem and len(key) != KEY_BYTES:
            problem = f"is not a page key ({len(key)} bytes, not {KEY_BYTES})"
    if problem:
        raise PageKeyError(f"page key {path} {problem}: remove it and restart (a new key is "
                           f"made; pages written with the old one become misses)")
    return key


def _create(path: Path) -> bytes:
    """Write a new key beside `path` and link it into place: another kvstore creating one at
    the same moment wins or loses whole, and nobody reads half a key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        view = memoryview(key)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.link(tmp, path)
    except FileExistsError:
        return _read(path)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
    return key
