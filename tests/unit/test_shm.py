"""Shared-memory page buffers across real processes; the buffer allocator."""

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from switchyard.proto.shm import BufferAllocator, PageBufferPool, ShmError

ROOT = Path(__file__).resolve().parents[2]
NUM, SIZE = 4, 64 * 1024


def _name():
    return f"sytest{secrets.token_hex(4)}"


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # A script file, not -c: multiprocessing's spawn re-imports __main__ from it.
    script = tmp_path / f"script_{secrets.token_hex(3)}.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def pool():
    p = PageBufferPool.create(_name(), NUM, SIZE)
    yield p
    p.close()
    p.unlink()


def test_data_is_visible_both_ways_and_survives_the_attacher(pool, tmp_path):
    pool.array(1, np.uint32, 4)[:] = [1, 2, 3, 4]
    child = _run(f"""
        import numpy as np
        from switchyard.proto.shm import PageBufferPool
        pool = PageBufferPool.attach({pool.name!r}, {NUM}, {SIZE})
        print(pool.array(1, np.uint32, 4).tolist())
        pool.buffer(2)[:5] = b"hello"
        pool.close()
    """, tmp_path)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[1, 2, 3, 4]"
    assert child.stderr == ""  # no resource-tracker "leaked" warning, no traceback
    assert bytes(pool.buffer(2)[:5]) == b"hello"
    # The attacher exited; its resource tracker must not have unlinked our segment.
    again = PageBufferPool.attach(pool.name, NUM, SIZE)
    assert bytes(again.buffer(2)[:5]) == b"hello"
    again.close()


def test_shared_resource_tracker_keeps_the_owner_registration(tmp_path):
    """A multiprocessing child shares its parent's tracker: attach must not touch it."""
    name = _name()
    result = _run(f"""
        import multiprocessing as mp
        from switchyard.proto.shm import PageBufferPool

        def child(name):
            pool = PageBufferPool.attach(name, {NUM}, {SIZE})
            pool.buffer(0)[0] = 7
            pool.close()

        if __name__ == "__main__":
            pool = PageBufferPool.create(name={name!r}, num_buffers={NUM}, buffer_bytes={SIZE})
            proc = mp.get_context("spawn").Process(target=child, args=({name!r},))
            proc.start()
            proc.join()
            assert proc.exitcode == 0
            assert pool.buffer(0)[0] == 7
            pool.close()
            pool.unlink()
            print("ok")
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "Traceback" not in result.stderr and "leaked" not in result.stderr


def test_views_and_bounds(pool):
    assert len(pool.buffer(3)) == SIZE
    a = pool.array(0, np.float32, SIZE // 4)
    a[-1] = 1.5
    assert pool.array(0, np.float32, 1, offset=SIZE - 4)[0] == 1.5
    assert pool.buffer(1)[0] == 0  # no spill into the next buffer
    with pytest.raises(ValueError):
        pool.array(0, np.float32, SIZE // 4 + 1)
    with pytest.raises(IndexError):
        pool.buffer(NUM)
    del a


def test_attach_checks_name_and_size(pool):
    with pytest.raises(ShmError, match="does not exist"):
        PageBufferPool.attach(_name(), NUM, SIZE)
    with pytest.raises(ShmError, match="bytes"):
        PageBufferPool.attach(pool.name, NUM + 1, SIZE)
    with pytest.raises(ShmError, match="already exists"):
        PageBufferPool.create(pool.name, NUM, SIZE)
    with pytest.raises(ValueError):
        PageBufferPool.create("x" * 31, NUM, SIZE)
    attached = PageBufferPool.attach(pool.name, NUM, SIZE)
    with pytest.raises(ShmError):
        attached.unlink()
    attached.close()


def test_allocator_is_all_or_nothing():
    alloc = BufferAllocator(4)
    first = alloc.acquire(3)
    assert first == [0, 1, 2] and alloc.num_free == 1
    assert alloc.acquire(2) is None and alloc.num_free == 1
    assert not alloc.can_acquire(2) and alloc.can_acquire(1)
    assert alloc.acquire(0) == []
    alloc.release(first[:2])
    assert sorted(alloc.acquire(3)) == [0, 1, 3]
    with pytest.raises(ValueError):
        alloc.release([first[0], first[0]])
    alloc.release([first[0]])
    with pytest.raises(ValueError):
        alloc.release([first[0]])  # double release is a bug
    with pytest.raises(ValueError):
        alloc.release([9])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux-only")
def test_unlink_removes_the_segment():
    pool = PageBufferPool.create(_name(), 1, 4096)
    assert os.path.exists(f"/dev/shm/{pool.name}")
    pool.close()
    pool.unlink()
    assert not os.path.exists(f"/dev/shm/{pool.name}")
