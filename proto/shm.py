"""Shared-memory page buffers between the worker and kvstore (KV bytes never travel in messages).

One segment of `num_buffers x buffer_bytes`, created and pre-faulted once by its owner (first
touch of a fresh segment costs ~10x the copy itself: notes/mlx.md §5) and attached by the peer.
Messages name buffer indexes; the scheduler hands indexes out with BufferAllocator.

Python < 3.13 registers every *attach* with the resource tracker, which then unlinks the
segment when the attaching process exits, destroying the owner's memory. `attach` therefore
never registers (3.13: track=False). We suppress the registration rather than unregistering
afterwards: when both processes share one tracker (multiprocessing children), an unregister
would also drop the owner's registration, so a crashed owner would leak the segment.
"""

from __future__ import annotations

import glob
import mmap
import os
import sys
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import _posixshmem

import numpy as np

# macOS limits POSIX shm names to 31 bytes including the leading slash.
MAX_NAME_LEN = 30


class ShmError(RuntimeError):
    pass


class PageBufferPool:
    def __init__(self, shm: shared_memory.SharedMemory, num_buffers: int, buffer_bytes: int,
                 owner: bool):
        self._shm = shm
        self.name = shm.name
        self.num_buffers = num_buffers
        self.buffer_bytes = buffer_bytes
        self.owner = owner

    @classmethod
    def create(cls, name: str, num_buffers: int, buffer_bytes: int) -> "PageBufferPool":
        """Allocate the segment and fault in every page now, not during a copy."""
        size = _check_shape(name, num_buffers, buffer_bytes)
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            raise ShmError(f"shared memory {name!r} already exists (another group, or a "
                           f"crashed owner: remove /dev/shm/{name} on Linux)") from None
        try:
            if hasattr(os, "posix_fallocate"):
                # Reserve now so a full /dev/shm is a clear error here, not a SIGBUS later.
                os.posix_fallocate(shm._fd, 0, size)
            _prefault(shm, write=True)
        except OSError as exc:
            shm.close()
            shm.unlink()
            raise ShmError(f"cannot allocate {size} bytes of shared memory for page buffers "
                           f"({exc.strerror}): lower the buffer count or size") from exc
        return cls(shm, num_buffers, buffer_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, num_buffers: int, buffer_bytes: int) -> "PageBufferPool":
        size = _check_shape(name, num_buffers, buffer_bytes)
        try:
            shm = _attach_untracked(name)
        except FileNotFoundError:
            raise ShmError(f"shared memory {name!r} does not exist (owner not started?)") \
                from None
        if shm.size < size:
            shm.close()
            raise ShmError(f"shared memory {name!r} is {shm.size} bytes, expected {size}")
        _prefault(shm, write=False)  # map every page here too, so copies don't fault
        return cls(shm, num_buffers, buffer_bytes, owner=False)

    def buffer(self, i: int) -> memoryview:
        start = self._offset(i)
        return self._shm.buf[start:start + self.buffer_bytes]

    def array(self, i: int, dtype, count: int, offset: int = 0) -> np.ndarray:
        """A numpy view of `count` items at byte `offset` inside buffer i (no copy)."""
        dtype = np.dtype(dtype)
        if offset < 0 or count < 0 or offset + count * dtype.itemsize > self.buffer_bytes:
            raise ValueError(f"{count} x {dtype} at offset {offset} does not fit in a "
                             f"{self.buffer_bytes}-byte buffer")
        return np.frombuffer(self._shm.buf, dtype=dtype, count=count,
                             offset=self._offset(i) + offset)

    def _offset(self, i: int) -> int:
        if not 0 <= i < self.num_buffers:
            raise IndexError(f"buffer {i} out of range 0..{self.num_buffers - 1}")
        return i * self.buffer_bytes

    def close(self) -> None:
        """Unmap. Views from buffer()/array() must be dropped first (BufferError otherwise)."""
        self._shm.close()

    def unlink(self) -> None:
        if not self.owner:
            raise ShmError("only the creator unlinks the page buffer segment")
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "PageBufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()


def _check_shape(name: str, num_buffers: int, buffer_bytes: int) -> int:
    if not name or "/" in name or len(name) > MAX_NAME_LEN:
        raise ValueError(f"shared memory name {name!r} must be 1..{MAX_NAME_LEN} chars, no '/'")
    if num_buffers < 1 or buffer_bytes < 1:
        raise ValueError("num_buffers and buffer_bytes must be positive")
    return num_buffers * buffer_bytes


def _prefault(shm: shared_memory.SharedMemory, write: bool) -> None:
    pages = np.frombuffer(shm.buf, dtype=np.uint8)[::mmap.PAGESIZE]  # one byte per OS page
    if write:
        pages[:] = 0
    else:
        int(pages.sum())
    del pages  # a live view would make close() fail


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register

    def register_except_shm(res_name, rtype):
        if rtype != "shared_memory":
            register(res_name, rtype)

    resource_tracker.register = register_except_shm
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def remove_stale_segments(prefix: str, record: Path) -> list[str]:
    """Unlink the segments an earlier owner of this group left behind (a SIGKILL of the whole
    group takes the resource tracker with it, so nothing else would): the one named in
    `record`, and on Linux any `/dev/shm/<prefix>*`. Names are per group (the runtime dir's
    hash), so another group's segments are never touched. Returns the names removed."""
    names = set()
    try:
        names.update(record.read_text().split())
    except OSError:
        pass
    if os.path.isdir("/dev/shm"):
        names.update(os.path.basename(p) for p in glob.glob(f"/dev/shm/{glob.escape(prefix)}*"))
    removed = []
    for name in sorted(n for n in names if n.startswith(prefix) and "/" not in n):
        try:
            _posixshmem.shm_unlink("/" + name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def record_segment(record: Path, name: str) -> None:
    """Note the live segment's name, for the next owner's `remove_stale_segments`."""
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, record)


class BufferAllocator:
    """Hands out buffer indexes (scheduler side). Pure: no shared memory involved."""

    def __init__(self, num_buffers: int):
        if num_buffers < 1:
            raise ValueError("num_buffers must be positive")
        self.num_buffers = num_buffers
        self._free = list(range(num_buffers - 1, -1, -1))  # pop() yields low indexes first
        self._used = [False] * num_buffers

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_acquire(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def acquire(self, n: int) -> list[int] | None:
        """n buffer indexes, or None (all or nothing) when fewer are free."""
        if n < 0:
            raise ValueError("n must be non-negative")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._used[i] = True
        return ids

    def release(self, ids) -> None:
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self.num_buffers or not self._used[i]:
                raise ValueError(f"buffer {i} is not acquired")  # double release: a bug
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate buffer ids in release")
        for i in ids:
            self._used[i] = False
            self._free.append(i)
