"""Reading secret files (API key, group key): regular files only, private to their owner."""

from __future__ import annotations

import os
import stat


class SettingsError(ValueError):
    pass


def read_private_file(path: str, flag: str, max_bytes: int) -> bytes:
    """The first `max_bytes` of a secret file named by `flag`: a regular file (no symlink, no
    FIFO) that neither its group nor other users can access (docs/design/security.md "Security"); on
    macOS the group `staff` holds every local user."""
    try:
        fd = os.open(os.path.expanduser(path),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SettingsError(f"{flag} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"{flag} {path} is not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SettingsError(f"{flag} {path} is accessible to its group or other users: "
                                f"chmod 600 {path}")
        return f.read(max_bytes)
