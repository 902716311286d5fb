"""Where the processes of one group meet: ipc socket paths, pid files, shared-memory names.

Everything lives in one runtime directory created with mode 0700, so two groups with different
runtime directories never see each other (tests run several side by side).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

# sun_path is 104 bytes on macOS, 108 on Linux.
_MAX_IPC_PATH = 100


class RuntimeDirError(RuntimeError):
    pass


def ensure_runtime_dir(path: Path) -> Path:
    """Create `path` 0700, or accept it if it is a real directory of ours; tighten its mode.

    Never follows a symlink at `path` (the default path is predictable: another user could
    plant one there, docs/design/security.md "Security"): lstat, and fchmod through an O_NOFOLLOW fd.
    """
    return ensure_private_dir(path, "runtime dir", RuntimeDirError, "choose another --runtime-dir")


def ensure_private_dir(path: Path, what: str, error: type[Exception], advice: str) -> Path:
    """Create `path` 0700 (its parents as needed), or accept it as check_private_dir does."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a directory should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                 str(path.parent)) from None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path, what, error, advice)
    return path


def check_private_dir(path: Path, what: str, error: type[Exception], advice: str) -> None:
    """`path` must be a real directory of ours: never a symlink (a planted one would receive
    our sockets or pages), never another user's; its mode is made 0700 through an O_NOFOLLOW
    descriptor of the very inode checked (docs/design/security.md "Security"). Raises `error`, whose
    message ends with `advice` (the flag that picks another directory)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise error(f"{what} {path} is a symbolic link; refusing to use it (it may have been "
                    f"planted): remove it, or {advice}")
    if not stat.S_ISDIR(info.st_mode):
        raise error(f"{what} {path} exists and is not a directory: remove it, or {advice}")
    if info.st_uid != os.getuid():
        raise error(f"{what} {path} belongs to uid {info.st_uid}, not to us; refusing to use "
                    f"it: remove it, or {advice}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_ino != info.st_ino:
                raise error(f"{what} {path} changed while being checked")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def rank_role(role: str, rank: int) -> str:
    """A worker group's per-rank process name (socket identity, pid file): `kvstore` for rank
    0, as a single worker's, `kvstore.R` for rank R (docs/design/worker-groups.md "Pages per rank")."""
    return role if rank == 0 else f"{role}.{rank}"


@dataclass(frozen=True)
class Endpoints:
    runtime_dir: Path

    @property
    def scheduler(self) -> str:
        return self._ipc("scheduler.sock")

    @property
    def peer_pages(self) -> str:
        """The kvstore's socket where the gateway forwards peers' asks for pages."""
        return self._ipc("peer-pages.sock")

    def pid_file(self, role: str) -> Path:
        return self.runtime_dir / f"{role}.pid"

    @property
    def status_file(self) -> Path:
        """JSON snapshot the scheduler rewrites for `switchyard status` and the dashboard."""
        return self.runtime_dir / "status.json"

    @property
    def shm_prefix(self) -> str:
        """Prefix for shared-memory segment names, unique per runtime directory."""
        digest = hashlib.blake2b(str(self.runtime_dir.resolve()).encode(), digest_size=6)
        return f"sy{digest.hexdigest()}"

    @property
    def shm_record(self) -> Path:
        """The worker's live segment name, so that a later worker removes it if stale."""
        return self.runtime_dir / "worker.shm"

    def _ipc(self, name: str) -> str:
        path = str(self.runtime_dir / name)
        if len(path) > _MAX_IPC_PATH:
            raise RuntimeDirError(
                f"socket path {path} is {len(path)} bytes; ipc paths must stay under "
                f"{_MAX_IPC_PATH}: choose a shorter --runtime-dir")
        return f"ipc://{path}"
