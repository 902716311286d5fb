"""One server per KV page directory: an flock on `<kv dir>/lock`, as SQLite and Redis lock
their files (docs/design.md "Security").

Two servers sharing a page directory would remove each other's temporary files and evict each
other's pages under their own budgets. The kvstore takes the lock before its scan and holds
it for its life; the kernel drops it however the process ends, so a restarted kvstore of the
same group takes it again. The lock file holds the owner's pid, for the refusal message.

The root is checked as the runtime dir is, before the lock is taken: a real directory of ours
(`check_private_dir`, also used for the namespace and shard directories below it); a symlink
or another user's directory is refused (KvDirUnsafe: the kvstore exits 2 with the message),
group and other access is removed.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

LOCK_NAME = "lock"


class KvDirLocked(RuntimeError):
    """Another process holds the page directory."""


class KvDirUnsafe(RuntimeError):
    """A level of the page directory is a symlink, not a directory, or another user's."""


def check_private_dir(path: Path, what: str) -> None:
    """`path` must be a real directory of ours: never a symlink (a planted one would receive
    our pages), never another user's; group and other access is removed (0700), through an
    O_NOFOLLOW descriptor of the very inode checked (docs/design.md "Security")."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise KvDirUnsafe(f"{what} {path} is a symbolic link; refusing to use it (it may have "
                          f"been planted): remove it, or choose another --kv-dir")
    if not stat.S_ISDIR(info.st_mode):
        raise KvDirUnsafe(f"{what} {path} exists and is not a directory: remove it, or "
                          f"choose another --kv-dir")
    if info.st_uid != os.getuid():
        raise KvDirUnsafe(f"{what} {path} belongs to uid {info.st_uid}, not to us; refusing to "
                          f"use it: remove it, or choose another --kv-dir")
    if stat.S_IMODE(info.st_mode) & 0o077:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_ino != info.st_ino:
                raise KvDirUnsafe(f"{what} {path} changed while being checked")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def lock_kv_dir(root: Path) -> int:
    """Create `root` (0700) if needed, check it, and lock it; returns the lock's fd (keep it
    open). KvDirUnsafe for a root that is not a real directory of ours."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    check_private_dir(root, "KV page directory")
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"process {owner}" if owner.isdigit() else "another process"
        raise KvDirLocked(
            f"KV page directory {root} is in use by {who} (another Switchyard server): give "
            f"this one its own --kv-dir, or stop the other (kill -TERM {owner or '<pid>'})"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, only the message lacks the pid
    return fd
