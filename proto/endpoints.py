"""Where the processes of one group meet: ipc socket paths, pid files, shared-memory names.

Everything lives in one runtime directory created with mode 0700, so two groups with different
runtime directories never see each other (tests run several side by side).
"""

from __future__ import annotations

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
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime dir {path} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class Endpoints:
    runtime_dir: Path

    @property
    def scheduler(self) -> str:
        return self._ipc("scheduler.sock")

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

    def _ipc(self, name: str) -> str:
        path = str(self.runtime_dir / name)
        if len(path) > _MAX_IPC_PATH:
            raise RuntimeDirError(
                f"socket path {path} is {len(path)} bytes; ipc paths must stay under "
                f"{_MAX_IPC_PATH}: choose a shorter --runtime-dir")
        return f"ipc://{path}"
