"""Regression tests for the local-security findings that need no server: the API
key off command lines, the runtime and KV directories (permissions, symlinks, FIFOs, a lock
against a second server), stale shared memory. Each test names its finding."""

from __future__ import annotations

import os
import stat

import pytest

from switchyard.deploy.supervisor import child_env, component_command
from switchyard.common.settings import (
    API_KEY_ENV,
    Settings,
    SettingsError,
    read_api_key_file,
    resolve_api_key,
)

KEY = "s3cret-key"


# -- 1. the API key is on no command line, and only the gateway gets it ----------------------

def test_api_key_is_on_no_child_command_line_and_only_the_gateway_gets_it():
    settings = Settings(model="/m", host="0.0.0.0", api_key=KEY)
    for role in ("scheduler", "kvstore", "worker", "gateway"):
        argv = component_command(role, settings)
        assert not any(KEY in arg for arg in argv), role
        env = child_env({"PATH": "/bin", API_KEY_ENV: "inherited"}, role, settings)
        assert env.get(API_KEY_ENV) == (KEY if role == "gateway" else None), role


def test_api_key_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    assert resolve_api_key({"api_key_file": str(path)}, env={})["api_key"] == KEY
    assert resolve_api_key({}, env={API_KEY_ENV: KEY})["api_key"] == KEY
    assert resolve_api_key({"api_key": "flag"}, env={API_KEY_ENV: KEY})["api_key"] == "flag"
    for mode in (0o644, 0o640, 0o660):  # group `staff` holds every local user on macOS
        path.chmod(mode)
        with pytest.raises(SettingsError, match="accessible to its group or other users"):
            read_api_key_file(str(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(SettingsError):
        read_api_key_file(str(link))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SettingsError, match="not a regular file"):
        read_api_key_file(str(tmp_path / "fifo"))  # and does not hang
    # A key file is enough to bind off loopback.
    path.chmod(0o600)
    Settings(host="0.0.0.0", api_key_file=str(path)).validate()


# -- 3. the runtime dir check follows no symlink ------------------------------------------------

def test_a_symlink_at_the_runtime_dir_is_refused_and_its_target_left_alone(tmp_path, capsys):
    from switchyard.deploy import cli
    from switchyard.common.endpoints import RuntimeDirError, ensure_runtime_dir

    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(RuntimeDirError, match="symbolic link"):
        ensure_runtime_dir(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # not chmodded through the link
    assert cli.main(["serve", "--runtime-dir", str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    # A real directory of ours is tightened to 0700.
    ensure_runtime_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


# -- 2. page files: private, never through a symlink, never blocked on a FIFO ---------------------

def _page_store(root):
    from switchyard.kvstore.pages import ROOT_ID, make_namespace
    from switchyard.kvstore.store import PageStore

    store = PageStore(root, sync=False)
    ns = make_namespace("model-a")
    tokens = list(range(16))
    store.write(ns, ROOT_ID, tokens, bytes(range(256)) * 4)
    (info,) = store.pages()
    return store, ns, info.page_id, tokens


def test_page_files_are_private(tmp_path):
    store, ns, pid, _ = _page_store(tmp_path / "kv")
    path = store.path_for(ns, pid)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for directory in (path.parent, path.parent.parent, tmp_path / "kv"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_a_fifo_or_symlink_in_the_kv_dir_neither_hangs_nor_is_followed(tmp_path):
    import threading

    from switchyard.kvstore.store import PageStore, read_entries

    store, ns, pid, tokens = _page_store(tmp_path / "kv")
    shard = store.path_for(ns, pid).parent
    os.mkfifo(shard / ("ab" * 16 + ".page"))
    outside = tmp_path / "outside.page"
    outside.write_bytes(store.path_for(ns, pid).read_bytes())
    (shard / ("cd" * 16 + ".page")).symlink_to(outside)
    again = PageStore(tmp_path / "kv", sync=False)
    scanned = []
    scan = threading.Thread(target=lambda: scanned.append(again.scan()), daemon=True)
    scan.start()
    scan.join(10)
    assert not scan.is_alive(), "the scan hung on a FIFO"
    assert [p.page_id for p in scanned[0]] == [pid]  # the real page only
    assert outside.exists()
    entries, num_bad = read_entries(tmp_path / "kv")  # `switchyard cache stats` too
    assert len(entries) == 1 and num_bad == 1  # the symlink; the scan removed the FIFO
    # A page file replaced by a symlink to a valid copy is not read through it.
    page = store.path_for(ns, pid)
    page.unlink()
    page.symlink_to(outside)
    assert again.read_into(ns, pid, tokens, bytearray(4096)) is None


# -- 8. one server per kv dir: a lock; only our own (or dead writers') temp files go ------------

def test_a_second_server_on_the_same_kv_dir_refuses_naming_the_first(tmp_path):
    import subprocess
    import sys

    from switchyard.kvstore.dir_lock import KvDirLocked, lock_kv_dir

    fd = lock_kv_dir(tmp_path / "kv")
    try:
        with pytest.raises(KvDirLocked, match=f"process {os.getpid()}"):
            lock_kv_dir(tmp_path / "kv")
        done = subprocess.run(
            [sys.executable, "-m", "switchyard.deploy.cli", "run", "kvstore", "--kv-dir",
             str(tmp_path / "kv"), "--runtime-dir", str(tmp_path / "run"),
             "--log-format", "json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"in use by process {os.getpid()}" in done.stderr
    finally:
        os.close(fd)
    os.close(lock_kv_dir(tmp_path / "kv"))  # released with its holder


# -- every level of the kv dir is checked; page files must be ours ------------

def _run_kvstore(tmp_path, kv_dir, *extra):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "run", "kvstore", "--kv-dir",
         str(kv_dir), "--runtime-dir", str(tmp_path / "run"), "--log-format", "json", *extra],
        capture_output=True, text=True, timeout=60)


def test_a_symlink_at_the_kv_dir_is_refused_and_its_target_left_alone(tmp_path):
    from switchyard.kvstore.dir_lock import KvDirUnsafe, lock_kv_dir

    target = tmp_path / "victim"
    target.mkdir()
    target.chmod(0o755)
    link = tmp_path / "kv"
    link.symlink_to(target)
    with pytest.raises(KvDirUnsafe, match="symbolic link"):
        lock_kv_dir(link)
    done = _run_kvstore(tmp_path, link)
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not list(target.iterdir())


def test_a_planted_namespace_or_shard_symlink_never_receives_our_pages(tmp_path):
    """The reported probe: another user's symlinked namespace directory got our pages."""
    from switchyard.kvstore.dir_lock import KvDirUnsafe
    from switchyard.kvstore.pages import ROOT_ID, make_namespace
    from switchyard.kvstore.store import PageStore, StoreUnavailable

    ns = make_namespace("model-a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    (root / ns.hex()[:8]).symlink_to(elsewhere)
    store = PageStore(root, sync=False)
    with pytest.raises(KvDirUnsafe, match="symbolic link"):
        store.scan()
    with pytest.raises(StoreUnavailable, match="symbolic link"):
        store.write(ns, ROOT_ID, list(range(16)), bytes(1024))
    assert not list(elsewhere.rglob("*"))
    # The kvstore refuses to start, naming the link.
    done = _run_kvstore(tmp_path, root)
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr
    # One level down, the same.
    (root / ns.hex()[:8]).unlink()
    store = PageStore(root, sync=False)
    pid = store.write(ns, ROOT_ID, list(range(16)), bytes(1024)) and store.pages()[0].page_id
    shard = store.path_for(ns, pid).parent
    for page in shard.iterdir():
        page.unlink()
    shard.rmdir()
    shard.symlink_to(elsewhere)
    with pytest.raises(KvDirUnsafe, match="symbolic link"):
        PageStore(root, sync=False).scan()
    with pytest.raises(StoreUnavailable):
        PageStore(root, sync=False).write(ns, ROOT_ID, list(range(16)), bytes(1024))
    assert not list(elsewhere.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_kv_dir_level_of_another_user_is_refused(tmp_path):
    from switchyard.kvstore.dir_lock import KvDirUnsafe, lock_kv_dir
    from switchyard.kvstore.store import PageStore

    store, ns, pid, _ = _page_store(tmp_path / "kv")
    ns_dir = store.path_for(ns, pid).parent.parent
    os.chown(ns_dir, 65534, 65534)
    with pytest.raises(KvDirUnsafe, match="uid 65534"):
        PageStore(tmp_path / "kv", sync=False).scan()
    done = _run_kvstore(tmp_path, tmp_path / "kv")
    assert done.returncode == 2 and "uid 65534, not to us" in done.stderr, done.stderr
    os.chown(ns_dir, 0, 0)
    os.chown(tmp_path / "kv", 65534, 65534)
    with pytest.raises(KvDirUnsafe, match="uid 65534"):
        lock_kv_dir(tmp_path / "kv")


def test_group_or_world_access_to_a_kv_dir_level_is_removed(tmp_path):
    from switchyard.kvstore.dir_lock import lock_kv_dir
    from switchyard.kvstore.store import PageStore

    store, ns, pid, tokens = _page_store(tmp_path / "kv")
    shard = store.path_for(ns, pid).parent
    levels = (tmp_path / "kv", shard.parent, shard)
    for directory in levels:
        directory.chmod(0o777)
    os.close(lock_kv_dir(tmp_path / "kv"))
    again = PageStore(tmp_path / "kv", sync=False)
    assert [p.page_id for p in again.scan()] == [pid]
    for directory in levels:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_a_page_key_that_is_not_ours_or_not_private_is_refused(tmp_path):
    from switchyard.kvstore.page_key import PageKeyError, key_path, load_page_key

    path = key_path(tmp_path / "cache")
    key, warning = load_page_key(path)
    assert len(key) == 32 and not warning
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_page_key(path) == (key, "")  # made once, read back
    path.chmod(0o644)
    with pytest.raises(PageKeyError, match="group or other users"):
        load_page_key(path)
    done = _run_kvstore(tmp_path, tmp_path / "kv", "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 2 and "page key" in done.stderr, done.stderr
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(PageKeyError):
        load_page_key(path)
    assert not (tmp_path / "elsewhere.key").exists()


def test_a_cache_dir_that_cannot_take_a_key_gives_a_key_for_this_run(tmp_path):
    from switchyard.kvstore.page_key import key_path, load_page_key

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    key, warning = load_page_key(key_path(blocker / "cache"))
    assert len(key) == 32 and "misses after the kvstore restarts" in warning


# -- 10. shared memory left by a SIGKILL of the whole group is removed at the next start -------

def test_stale_shared_memory_of_this_group_is_removed_and_others_kept(tmp_path):
    from multiprocessing import resource_tracker

    from switchyard.common.endpoints import Endpoints
    from switchyard.proto.shm import PageBufferPool, ShmError, record_segment, remove_stale_segments

    ours = Endpoints(tmp_path / "a")
    theirs = Endpoints(tmp_path / "b")
    (tmp_path / "a").mkdir()
    names = [f"{ours.shm_prefix}wdead0001", f"{ours.shm_prefix}wdead0002",
             f"{theirs.shm_prefix}wlive0001"]
    for name in names:  # as a killed group leaves them: mapped by nobody, tracked by nobody
        pool = PageBufferPool.create(name, 1, 4096)
        pool.close()
        resource_tracker.unregister("/" + name, "shared_memory")
    record_segment(ours.shm_record, names[0])
    try:
        removed = remove_stale_segments(ours.shm_prefix, ours.shm_record)
        expected = names[:2] if os.path.isdir("/dev/shm") else names[:1]
        assert removed == expected
        for name in expected:
            with pytest.raises(ShmError, match="does not exist"):
                PageBufferPool.attach(name, 1, 4096)
        PageBufferPool.attach(names[2], 1, 4096).close()  # another group's: kept
    finally:
        import _posixshmem

        for name in names:
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                pass


# -- 11. library (uvicorn) logs go through structlog, without tracebacks by default -------------

def test_uvicorn_logs_through_structlog(capsys):
    import json
    import logging

    import structlog

    from switchyard.common.logs import configure_logging

    saved = structlog.get_config()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging("gateway", "boot-x", fmt="json")
        try:
            raise ValueError("secret prompt text")
        except ValueError:
            logging.getLogger("uvicorn.error").error("Exception in ASGI application",
                                                     exc_info=True)
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    finally:  # later tests must not write to this test's captured stderr
        structlog.configure(**saved)
        root.handlers[:], root.level = saved_handlers, saved_level
    record = json.loads(line)
    assert record["event"] == "library.log" and record["role"] == "gateway"
    assert record["error_type"] == "ValueError" and "secret" not in line


def test_connection_limits_close_the_longest_idle_of_the_busiest_client():
    """At --max-connections a new connection closes an idle one of the
    client host holding the most; requests keep an eighth of the slots for other hosts."""
    from switchyard.gateway.http_limits import ConnectionLimits

    class Conn:
        def __init__(self, host, idle=True):
            self.client, self.idle, self.closed = (host, 1), idle, False

        def is_idle(self):
            return self.idle

        def close_idle(self):
            self.closed = True
            limits.closed(self)

    limits = ConnectionLimits(4)
    a1, a2, a3, b1 = Conn("a"), Conn("a"), Conn("a", idle=False), Conn("b")
    for conn in (a1, a2, a3, b1):
        limits.opened(conn)
    newcomer = Conn("b")
    limits.opened(newcomer)
    assert a1.closed and not (a2.closed or a3.closed or b1.closed or newcomer.closed)
    for conn in (a2, b1, newcomer):
        conn.idle = False
    limits.opened(Conn("c"))  # nothing idle: the request on it will be refused
    assert limits.refusal("c") is not None
    limits = ConnectionLimits(16)
    assert limits.per_client == 14
    for _ in range(14):
        assert limits.refusal("a") is None
        limits.started("a")
    assert "other clients" in limits.refusal("a") and limits.refusal("b") is None
    limits.ended("a")
    assert limits.refusal("a") is None
