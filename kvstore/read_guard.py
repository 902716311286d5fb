"""The backstop for a bug no check foresaw: a page that crashes its reader costs one restart,
never a crash loop.

While a batch is read, the paths of its pages are kept in `<root>/reading`; the next scan
removes the pages a dead kvstore was reading (`kv.corrupt_page`, "being read when the kvstore
died"), whatever they look like now.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from switchyard.kvstore.page_file import PAGE_SUFFIX

READING_NAME = "reading"  # the list of pages being read


class ReadGuard:
    def __init__(self, root: Path):
        self.root = root
        self._fd = -1

    def reading(self, paths: list[Path]) -> None:
        """Name the pages about to be read ([]: the batch is done). No fsync: it only has to
        outlive the process, not the machine. Best effort: a disk that refuses the few bytes
        only loses the backstop."""
        try:
            if self._fd < 0:
                if not paths:
                    return
                self._fd = os.open(self.root / READING_NAME, os.O_RDWR | os.O_CREAT
                                   | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.ftruncate(self._fd, 0)
            if paths:
                text = "".join(f"{p.relative_to(self.root)}\n" for p in paths)
                os.pwrite(self._fd, text.encode(), 0)
        except OSError:
            pass

    def died_reading(self) -> list[Path]:
        """The pages a kvstore was reading when it died (the list is emptied): only paths
        this store writes, and only those still there."""
        path = self.root / READING_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            names = []
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                names = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace").split()
            os.ftruncate(fd, 0)
        except OSError:
            return []
        finally:
            os.close(fd)
        pages = []
        for name in names:
            parts = name.split("/")
            if len(parts) != 3 or not parts[2].endswith(PAGE_SUFFIX) or ".." in parts:
                continue  # not a path this store writes
            page = self.root.joinpath(*parts)
            if os.path.lexists(page):
                pages.append(page)
        return pages

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
