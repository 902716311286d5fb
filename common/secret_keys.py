"""Install secrets kept in the cache dir: the page key (kvstore/page_key.py), the salt key
(common/tenants.py) and the peer key (proto/peer_pages.py) (docs/design/security.md "Security").

Each is 32 random bytes, created once 0600 (never overwritten, never through a symlink) and read
back on every start, so what was keyed with it stays valid across restarts. The cache dir that
holds them is made 0700 and checked like the runtime dir (a real directory of ours).

A cache dir where no key can be created (read-only, full) gets a key for this run only, with a
warning. A key file that exists but is not ours, not private or not a key is refused:
`SecretKeyError`, and the component does not start.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from switchyard.common.endpoints import ensure_private_dir
from switchyard.common.secret_files import SettingsError, read_private_file

KEY_BYTES = 32
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Cannot create a key there now: run with a key of this run only.
_CANNOT_CREATE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO,
                  errno.ENOTDIR}


class SecretKeyError(RuntimeError):
    """A key file (or the cache dir holding it) exists but cannot be trusted or used."""


def ensure_cache_dir(path: Path) -> Path:
    """Create the cache dir 0700, or accept it if it is a real directory of ours (its mode
    tightened): it holds the install's keys and the default models. SecretKeyError if not."""
    return ensure_private_dir(path, "cache dir", SecretKeyError, "choose another --cache-dir")


def load_secret_key(path: Path, what: str, lost: str, temporary: str) -> tuple[bytes, str]:
    """(the key at `path`, "" or why it is a key for this run only). `what` names the key in
    messages, `lost` says what a new key costs, `temporary` what a key of this run costs."""
    path = Path(path)
    try:
        ensure_cache_dir(path.parent)
        try:
            return _read(path, what, lost), ""
        except FileNotFoundError:
            return _create(path, what, lost), ""
    except OSError as exc:
        if exc.errno not in _CANNOT_CREATE:
            raise SecretKeyError(f"{what} {path}: {exc.strerror}") from None
        return secrets.token_bytes(KEY_BYTES), (
            f"cannot read or create the {what} {path} ({exc.strerror}): {temporary}")


def _read(path: Path, what: str, lost: str) -> bytes:
    advice = f"remove it and restart (a new key is made; {lost})"
    try:
        fd = os.open(path, _OPEN)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise SecretKeyError(f"{what} {path} is a symbolic link: {advice}") from None
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
            problem = f"is not a {what} ({len(key)} bytes, not {KEY_BYTES})"
    if problem:
        raise SecretKeyError(f"{what} {path} {problem}: {advice}")
    return key


def _create(path: Path, what: str, lost: str) -> bytes:
    """Write a new key beside `path` and link it into place: another process creating one at
    the same moment wins or loses whole, and nobody reads half a key."""
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
        return _read(path, what, lost)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
    return key


PEER_KEY_NAME = "peer.key"


def load_peer_key(key_file: str, cache_dir: Path) -> bytes:
    """`--peer-key-file`'s 32 bytes (0600, not a symlink), or `<cache dir>/peer.key`, made once
    like the page and salt keys. SettingsError or SecretKeyError."""
    if key_file:
        key = read_private_file(key_file, "--peer-key-file", KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise SettingsError(f"--peer-key-file {key_file} is not a peer key ({len(key)} "
                                f"bytes, not {KEY_BYTES}): copy one peer's key to the others")
        return key
    key, warning = load_secret_key(Path(cache_dir) / PEER_KEY_NAME, "peer key",
                                   "peers holding the old key are refused",
                                   "peers cannot authenticate this server")
    if warning:
        raise SettingsError(warning)
    return key
