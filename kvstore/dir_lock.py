"""One server per KV page directory: an flock on `<kv dir>/lock`, as SQLite and Redis lock
their files (docs/design/security.md "Security").

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
from pathlib import Path

from switchyard.common.endpoints import check_private_dir as check_dir

LOCK_NAME = "lock"


class KvDirLocked(RuntimeError):
    """Another process holds the page directory."""


class KvDirUnsafe(RuntimeError):
    """A level of the page directory is a symlink, not a directory, or another user's."""


def check_private_dir(path: Path, what: str) -> None:
    """A level of the page directory must be a real directory of ours, as the runtime dir
    (common.endpoints.check_private_dir); KvDirUnsafe if not."""
    check_dir(path, what, KvDirUnsafe, "choose another --kv-dir")


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
