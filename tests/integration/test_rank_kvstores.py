"""Two real kvstore processes (ranks 0 and 1 of a worker group, each with its own page
directory and its own shared-memory pool) driven through the scheduler's fan-out
(scheduler/page_stores.py): pages written on both, the inventory after both restarted, and
every rank's share read back bit-identical (docs/design/worker-groups.md "Pages per rank")."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from switchyard.deploy.lifeline import PARENT_ENV
from switchyard.proto import codec
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.proto.base import PROTOCOL_VERSION, ROLE_SCHEDULER, Hello
from switchyard.proto.scheduler_kvstore import (
    AttachBuffers,
    DescribeInventory,
    InventoryDescribed,
    PageRead,
    PagesRead,
    PagesWritten,
    PageWrite,
    ReadPages,
    WritePages,
)
from switchyard.proto.scheduler_worker import RankInfo, WorkerReady
from switchyard.common.page_ids import ROOT_ID, chain_page_ids
from switchyard.proto.shm import PageBufferPool
from switchyard.proto.sockets import bind_router, send_to
from switchyard.scheduler.page_stores import PageStores, kvstore_identity
from switchyard.proto.status import read_status
from switchyard.testing.group import short_tmp_dir
from tests.helpers.checkout import REPO_ROOT

P = 16
NS = bytes(range(16))
PER_TOKEN = (64, 40)  # rank 1's share of a token is smaller (another head count)
NUM_BUFFERS = 8
NUM_PAGES = 3


class Scheduler:
    """The scheduler's side: a ROUTER where the scheduler binds it, and the fan-out."""

    def __init__(self, runtime: Path):
        self.ctx = zmq.Context()
        self.sock = bind_router(self.ctx, Endpoints(ensure_runtime_dir(runtime)).scheduler)
        self.stores = PageStores(group=True)
        self.boots: dict[str, str] = {}

    def send(self, msg) -> list:
        clones = self.stores.outgoing(msg)
        for identity, clone in clones:
            send_to(self.sock, identity.encode(), clone)
        return self.stores.sent(msg, [(i, c, True) for i, c in clones])

    def until(self, done, timeout_s: float = 60.0) -> list:
        """Pump messages (greeting kvstores, merging replies) until `done(merged)`."""
        merged, deadline = [], time.monotonic() + timeout_s
        while not done(merged):
            assert time.monotonic() < deadline, f"timed out; merged so far: {merged}"
            if not self.sock.poll(200):
                continue
            identity, frame = self.sock.recv_multipart()
            role, msg = identity.decode(), codec.decode(frame)
            if isinstance(msg, Hello):
                send_to(self.sock, identity, Hello(PROTOCOL_VERSION, "sched", ROLE_SCHEDULER,
                                                   os.getpid()))
                if self.boots.get(role) != msg.boot_id:
                    self.boots[role] = msg.boot_id
                    self.stores.restarted(role)
            elif isinstance(msg, (PagesWritten, PagesRead, InventoryDescribed)):
                merged += self.stores.incoming(role, msg)
        return merged

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def start_kvstore(rank: int, runtime: Path, kv_dir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "switchyard.deploy.cli", "run", "kvstore", "--rank", str(rank),
             "--model", "unused", "--runtime-dir", str(runtime), "--kv-dir", str(kv_dir),
             "--heartbeat-s", "0.2", "--log-format", "json"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


@pytest.fixture
def setup():
    tmp = short_tmp_dir("syrk")
    runtime, kv_dir = tmp / "rt", tmp / "kv"
    tag = f"syrk{os.getpid() % 100000}"
    pools = [PageBufferPool.create(f"{tag}r{r}", NUM_BUFFERS, P * PER_TOKEN[r])
             for r in range(2)]
    sched = Scheduler(runtime)
    procs: list[subprocess.Popen] = []
    try:
        yield tmp, runtime, kv_dir, pools, sched, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        sched.close()
        for pool in pools:
            pool.unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def ranks(pools) -> tuple[RankInfo, ...]:
    return tuple(RankInfo(r, "localhost", bytes([r]) * 16, pool.name, NUM_BUFFERS,
                          pool.buffer_bytes, PER_TOKEN[r], 0) for r, pool in enumerate(pools))


def test_two_rank_kvstores_write_restart_and_read_back_their_shares(setup):
    tmp, runtime, kv_dir, pools, sched, procs = setup
    log = tmp / "kvstores.log"
    procs += [start_kvstore(r, runtime, kv_dir, log) for r in range(2)]
    group = ranks(pools)
    sched.stores.worker_ready(WorkerReady("w", NS, "tiny", 1, 4 * P, P, PER_TOKEN[0], True,
                                          (), pools[0].name, NUM_BUFFERS,
                                          pools[0].buffer_bytes, 0, ranks=group,
                                          parallel="tensor"))
    sched.until(lambda _: len(sched.stores.connected) == 2)

    # Each rank's share of each page: its own bytes, in its own pool (buffers 0..2).
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(100, 30000, NUM_PAGES * P)]
    ids = chain_page_ids(NS, tokens, P)
    shares = []
    for r, pool in enumerate(pools):
        data = rng.integers(0, 256, (NUM_PAGES, P * PER_TOKEN[r]), dtype=np.uint8)
        for k in range(NUM_PAGES):
            pool.array(k, np.uint8, pool.buffer_bytes)[:] = data[k]
        shares.append(data)
    sched.send(AttachBuffers(pools[0].name, NUM_BUFFERS, pools[0].buffer_bytes, NS))
    sched.send(DescribeInventory())
    [inventory] = sched.until(lambda m: len(m) == 1)
    assert inventory.pages == ()
    writes = tuple(PageWrite(ids[k], ids[k - 1] if k else ROOT_ID,
                             tuple(tokens[k * P:(k + 1) * P]), k, P * PER_TOKEN[0])
                   for k in range(NUM_PAGES))
    sched.send(WritePages(writes))
    [written] = sched.until(lambda m: len(m) == 1)
    assert [i.page_id for i in written.written] == ids and written.failed == ()
    assert all(i.nbytes > P * PER_TOKEN[0] for i in written.written)  # the largest share
    # each rank's share went to its own page directory
    assert len(list(kv_dir.glob("*/*/*.page"))) == NUM_PAGES
    assert len(list((kv_dir / "rank-1").glob("*/*/*.page"))) == NUM_PAGES

    # Both kvstores restart (kill -9): the group's page store comes back from the files.
    for proc in procs:
        proc.kill()
        proc.wait(30)
    procs[:] = [start_kvstore(r, runtime, kv_dir, log) for r in range(2)]
    old = dict(sched.boots)
    sched.until(lambda _: all(sched.boots.get(kvstore_identity(r)) not in (None, old[
        kvstore_identity(r)]) for r in range(2)))
    sched.send(AttachBuffers(pools[0].name, NUM_BUFFERS, pools[0].buffer_bytes, NS))
    sched.send(DescribeInventory())
    [inventory] = sched.until(lambda m: len(m) == 1)
    assert sorted(p.page_id for p in inventory.pages) == sorted(ids)
    sizes = {p.page_id: p.nbytes for p in inventory.pages}
    assert all(sizes[i.page_id] == i.nbytes for i in written.written)

    # Read every page into other buffers (3..5) of each pool: every share bit-identical.
    for pool in pools:
        for b in range(NUM_PAGES, 2 * NUM_PAGES):
            pool.array(b, np.uint8, pool.buffer_bytes)[:] = 0
    sched.send(ReadPages(tuple(PageRead(ids[k], tuple(tokens[k * P:(k + 1) * P]),
                                        NUM_PAGES + k) for k in range(NUM_PAGES))))
    [read] = sched.until(lambda m: len(m) == 1)
    assert read == PagesRead(tuple(ids), ())
    for r, pool in enumerate(pools):
        for k in range(NUM_PAGES):
            got = pool.array(NUM_PAGES + k, np.uint8, pool.buffer_bytes).copy()
            assert np.array_equal(got, shares[r][k]), f"rank {r} page {k}"


def start(role: str, runtime: Path, kv_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "switchyard.deploy.cli", "run", role, "--model", "unused",
             "--runtime-dir", str(runtime), "--kv-dir", str(kv_dir), "--heartbeat-s", "0.2",
             "--log-format", "json", *extra],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def test_the_scheduler_serves_the_pages_every_rank_holds():
    """The real scheduler with --hostfile, both rank kvstores and a scripted rank-0 worker:
    the page index is the pages both ranks hold, the share only rank 0 has is deleted, and
    status lists both ranks."""
    from switchyard.kvstore.store import PageStore
    from switchyard.proto.base import Heartbeat

    tmp = short_tmp_dir("sysk")
    runtime, kv_dir, log = tmp / "rt", tmp / "kv", tmp / "group.log"
    hostfile = tmp / "hosts.json"
    hostfile.write_text('[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]')
    tokens = list(range(1000, 1000 + 3 * P))
    ids = chain_page_ids(NS, tokens, P)
    for rank, num_pages in ((0, 3), (1, 2)):  # rank 1 never wrote the third page
        store = PageStore(kv_dir / "rank-1" if rank else kv_dir, sync=False)
        for k in range(num_pages):
            store.write(NS, ids[k - 1] if k else ROOT_ID, tokens[k * P:(k + 1) * P],
                        bytes([rank]) * (P * PER_TOKEN[rank]))
    tag = f"sysk{os.getpid() % 100000}"
    pools = [PageBufferPool.create(f"{tag}r{r}", NUM_BUFFERS, P * PER_TOKEN[r])
             for r in range(2)]
    procs = [start("scheduler", runtime, kv_dir, log, "--hostfile", str(hostfile))]
    procs += [start("kvstore", runtime, kv_dir, log, "--hostfile", str(hostfile), "--rank",
                    str(r)) for r in range(2)]
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"worker")
    worker.setsockopt(zmq.LINGER, 0)
    try:
        status_file = Endpoints(ensure_runtime_dir(runtime)).status_file
        worker.connect(Endpoints(runtime).scheduler)
        worker.send(codec.encode(Hello(PROTOCOL_VERSION, "w1", "worker", os.getpid())))
        worker.send(codec.encode(WorkerReady(
            "w1", NS, "tiny", 1, 4 * P, P, PER_TOKEN[0], True, (), pools[0].name, NUM_BUFFERS,
            pools[0].buffer_bytes, 0, ranks=ranks(pools), parallel="tensor")))
        def beat() -> None:  # the scripted worker stays alive (else the scheduler drops it)
            worker.send(codec.encode(Heartbeat("w1")))
            while worker.poll(0):
                worker.recv()
            time.sleep(0.2)

        deadline, status = time.monotonic() + 60, None
        while True:
            assert time.monotonic() < deadline, f"not ready: {status}\n{log.read_text()[-3000:]}"
            beat()
            status = read_status(status_file)
            if status is not None and status.kvstore_ready and \
                    [(r.kvstore_state, r.num_pages) for r in status.ranks] == [("ready", 2)] * 2:
                break
        assert status.disk.num_pages == 2
        assert [(r.rank, r.host, r.kvstore) for r in status.ranks] == [
            (0, "localhost", "kvstore"), (1, "localhost", "kvstore.1")]
        # rank 0's share of the page rank 1 lacks was an orphan: its kvstore deletes the file
        while len(list(kv_dir.glob("*/*/*.page"))) != 2:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            beat()
        assert len(list((kv_dir / "rank-1").glob("*/*/*.page"))) == 2
    finally:
        worker.close()
        ctx.term()
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for pool in pools:
            pool.unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def test_only_a_kvstore_holding_the_group_key_reaches_the_scheduler_over_tcp():
    """The scheduler, whose hostfile names another machine, binds --scheduler-address as a
    CURVE server; rank 1's kvstore, on a host where rank 0 is another machine, greets it there
    as kvstore.1 with the group key. One holding another group's key is refused at the
    handshake: the scheduler never hears from it. Without a key file the scheduler does not
    start. (One machine plays every host: each gets the hostfile as its host sees it.)"""
    from switchyard.common.group_key import write_group_key
    from switchyard.testing.group import free_port

    tmp = short_tmp_dir("sytc")
    here_0 = tmp / "host-a.json"  # 192.0.2.0/24 is documentation space: never this machine
    here_0.write_text('[{"ssh": "mac-a", "ips": ["127.0.0.1"]}, '
                      '{"ssh": "mac-b", "ips": ["192.0.2.9"]}]')
    here_1 = tmp / "host-b.json"
    here_1.write_text('[{"ssh": "mac-a", "ips": ["192.0.2.7"]}, '
                      '{"ssh": "mac-b", "ips": ["127.0.0.1"]}]')
    key, wrong_key = tmp / "group.key", tmp / "other-group.key"
    write_group_key(str(key))
    write_group_key(str(wrong_key))
    # knows the scheduler's public key but holds a client key of its own
    own_client = tmp / "own-client.key"
    own_client.write_text(json.dumps({**json.loads(key.read_text()), **{
        k: v for k, v in json.loads(wrong_key.read_text()).items() if k.startswith("client")}}))
    own_client.chmod(0o600)
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp / "group.log"

    def refusals() -> int:
        return log.read_text().count('"scheduler.connection_refused"')

    def refused_both() -> bool:
        text = log.read_text()
        return all(f'"reason": "{reason}"' in text for reason in (
            "client key not this group's", "not this group's scheduler key, or no CURVE"))

    keyless = subprocess.run(
        [sys.executable, "-m", "switchyard.deploy.cli", "run", "scheduler", "--runtime-dir",
         str(tmp / "rt-x"), "--hostfile", str(here_0), "--scheduler-address", address],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=60)
    assert keyless.returncode == 2
    assert "--scheduler-address needs --group-key-file: make one with `switchyard group-key" \
        in keyless.stderr

    procs = [start("scheduler", tmp / "rt-a", tmp / "kv-a", log, "--hostfile", str(here_0),
                   "--scheduler-address", address, "--group-key-file", str(key)),
             start("kvstore", tmp / "rt-c", tmp / "kv-c", log, "--hostfile", str(here_1),
                   "--rank", "1", "--scheduler-address", address,
                   "--group-key-file", str(wrong_key)),
             start("kvstore", tmp / "rt-d", tmp / "kv-d", log, "--hostfile", str(here_1),
                   "--rank", "1", "--scheduler-address", address,
                   "--group-key-file", str(own_client))]
    intruders = [p.pid for p in procs[1:]]
    try:
        deadline = time.monotonic() + 60
        while not refused_both():  # both intruders tried, and were turned away
            assert procs[1].poll() is None and time.monotonic() < deadline, \
                log.read_text()[-3000:]
            time.sleep(0.2)
        procs.append(start("kvstore", tmp / "rt-b", tmp / "kv-b", log, "--hostfile",
                           str(here_1), "--rank", "1", "--scheduler-address", address,
                           "--group-key-file", str(key)))
        status_file = Endpoints(ensure_runtime_dir(tmp / "rt-a")).status_file
        status = None
        while status is None or "kvstore.1" not in status.peers:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            status = read_status(status_file)
        assert status.peers["kvstore.1"].pid == procs[3].pid
        assert (tmp / "kv-b" / "rank-1" / "lock").exists()
        seen = refusals()
        while refusals() == seen:  # refused again while the rightful kvstore.1 is connected
            assert procs[1].poll() is None and time.monotonic() < deadline, \
                log.read_text()[-3000:]
            time.sleep(0.2)
        status = read_status(status_file)
        assert status.peers["kvstore.1"].pid == procs[3].pid
        assert not set(intruders) & {p.pid for p in status.peers.values()}
        # the one the scheduler's ZAP handler turned away knows it can never get in: it stops
        assert procs[2].wait(30) == 2
        assert "refused this host's group key" in log.read_text()
        assert procs[1].poll() is None and procs[3].poll() is None
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_group_key_holder_is_only_a_kvstore_and_odd_identities_are_dropped():
    """Over TCP the group key lets in the other hosts' kvstores and
    nothing else: a key holder greeting as `gateway` or `worker` is never heard and never
    gets their route; on the ipc socket a non-UTF-8 identity, or a role sending what it may
    not, is dropped and logged, and the scheduler keeps serving."""
    from switchyard.common.group_key import curve_client, read_group_key, write_group_key
    from switchyard.proto.base import Heartbeat
    from switchyard.proto.values import SamplingParams
    from switchyard.proto.gateway_scheduler import SubmitRequest
    from switchyard.proto.tokens import TokenIds
    from switchyard.testing.group import free_port

    tmp = short_tmp_dir("syid")
    hostfile = tmp / "host-a.json"  # rank 1 on another machine: the TCP endpoint is bound
    hostfile.write_text('[{"ssh": "mac-a", "ips": ["127.0.0.1"]}, '
                        '{"ssh": "mac-b", "ips": ["192.0.2.9"]}]')
    key = tmp / "group.key"
    write_group_key(str(key))
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp / "group.log"
    runtime = tmp / "rt"
    proc = start("scheduler", runtime, tmp / "kv", log, "--hostfile", str(hostfile),
                 "--scheduler-address", address, "--group-key-file", str(key))
    ctx = zmq.Context()
    socks = []

    def dealer(identity: bytes, endpoint: str, secure: bool = False) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        if secure:
            curve_client(sock, read_group_key(str(key)))
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    def hello(sock: zmq.Socket, role: str, boot: str) -> None:
        sock.send(codec.encode(Hello(PROTOCOL_VERSION, boot, role, os.getpid())))

    def received(sock: zmq.Socket) -> list:
        out = []
        while sock.poll(0):
            out.append(type(codec.decode(sock.recv())).__name__)
        return out

    submit = SubmitRequest("rid-1", TokenIds([1, 2, 3]), 4, SamplingParams(), (0,), "background")
    try:
        status_file = Endpoints(ensure_runtime_dir(runtime)).status_file
        deadline = time.monotonic() + 60
        while read_status(status_file) is None:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        rogue_gateway = dealer(b"gateway", address, secure=True)
        rogue_worker = dealer(b"worker", address, secure=True)
        odd = dealer(b"\xff\xfe-not-utf8", Endpoints(runtime).scheduler)
        kvstore_submits = dealer(b"kvstore", Endpoints(runtime).scheduler)
        gateway = dealer(b"gateway", Endpoints(runtime).scheduler)
        for _ in range(3):
            hello(rogue_gateway, "gateway", "rogue-gateway")
            rogue_gateway.send(codec.encode(submit))
            hello(rogue_worker, "worker", "rogue-worker")
            hello(odd, "gateway", "rogue-odd")
            hello(kvstore_submits, "kvstore", "boot-kvstore")
            kvstore_submits.send(codec.encode(submit))
            time.sleep(0.3)
        hello(gateway, "gateway", "boot-gateway")
        while "GroupState" not in received(gateway):  # the gateway's route is the real one's
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            gateway.send(codec.encode(Heartbeat("boot-gateway")))
            time.sleep(0.2)
        text = log.read_text()
        while text.count('"scheduler.peer_refused"') < 3 or '"peer.bad_identity"' not in text:
            assert time.monotonic() < deadline and proc.poll() is None, text[-3000:]
            time.sleep(0.2)
            text = log.read_text()
        assert received(rogue_gateway) == [] and received(rogue_worker) == []
        # A status written after all of the above: it names the real gateway's boot.
        status = read_status(status_file)
        while status is None or "gateway" not in status.peers \
                or status.peers["gateway"].boot_id != "boot-gateway":
            assert time.monotonic() < deadline and proc.poll() is None, text[-3000:]
            time.sleep(0.2)
            status = read_status(status_file)
        written = status_file.read_text()
        assert "rogue" not in written and "rid-1" not in written
        assert "kvstore (SubmitRequest)" in text and proc.poll() is None
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
