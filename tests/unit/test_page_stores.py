"""The kvstore fan-out of a worker group (scheduler/page_stores.py): one page store for the
core over one kvstore per rank. No sockets: replies are scripted per rank."""

from pathlib import Path

from switchyard.proto.scheduler_kvstore import (
    AttachBuffers,
    DeletePages,
    DescribeInventory,
    InventoryDescribed,
    PageInfo,
    PageRead,
    PagesDeleted,
    PagesRead,
    PagesWritten,
    PageWrite,
    ReadPages,
    TouchPages,
    WritePages,
)
from switchyard.proto.scheduler_worker import RankInfo, WorkerReady
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import KvstoreRestarted, PlanStep
from switchyard.scheduler.page_stores import PageStores, kvstore_identity, kvstore_rank

P = 4
NS = b"g" * 16
STATE_FLAG = 1


def rank_info(rank, per_token, state=0, num_buffers=8):
    return RankInfo(rank, f"host{rank}", bytes([rank]) * 16, f"shm{rank}", num_buffers,
                    P * per_token + state, per_token, state)


def ready(ranks, slots=1):
    r0 = ranks[0]
    return WorkerReady("w", NS, "tiny", slots, 64, P, r0.kv_bytes_per_token, True, (),
                       r0.shm_name, r0.num_buffers, r0.buffer_bytes, r0.state_bytes,
                       ranks=tuple(ranks), parallel="tensor")


def group(per_tokens=(10, 7), state=0):
    stores = PageStores(group=True)
    for rank in range(len(per_tokens)):
        stores.restarted(kvstore_identity(rank))
    stores.worker_ready(ready([rank_info(r, t, state) for r, t in enumerate(per_tokens)]))
    return stores


def send(stores, msg, undelivered=()):
    clones = stores.outgoing(msg)
    return clones, stores.sent(msg, [(i, m, i not in undelivered) for i, m in clones])


def pid(n):
    return bytes([n]) * 16


def write(*ids, flags=0):
    return WritePages(tuple(PageWrite(pid(i), bytes(16), (1, 2, 3, 4), i, 0, flags)
                            for i in ids))


def info(i, nbytes=100, flags=0, used=1.0):
    return PageInfo(pid(i), bytes(16), NS, P, nbytes, used, flags)


def written(*infos, failed=(), error=""):
    return PagesWritten(tuple(infos), tuple(failed), (), error)


def deletes(stores: PageStores) -> list[tuple[str, object]]:
    """What the fan-out queued by itself (orphan shares' deletes), per kvstore identity."""
    return [(m.to, m.message) for m in stores.outbox.take().messages]


def test_identities():
    assert [kvstore_identity(r) for r in range(3)] == ["kvstore", "kvstore.1", "kvstore.2"]
    assert [kvstore_rank(i) for i in ("kvstore", "kvstore.2", "kvstore.0", "worker", "kvstore.x")] \
        == [0, 2, None, None, None]


def test_single_worker_passes_everything_through():
    stores = PageStores(group=False)
    msg = write(1)
    assert stores.outgoing(msg) == [("kvstore", msg)]
    assert stores.sent(msg, [("kvstore", msg, True)]) == []
    reply = written(info(1))
    assert stores.incoming("kvstore", reply) == [reply]
    assert stores.identities() == ["kvstore"]
    assert stores.worker_ready(ready([rank_info(0, 10)])) == []


def test_attach_and_write_are_cloned_per_rank_with_its_pool_and_payload():
    stores = group(per_tokens=(10, 7), state=5)
    attach = dict(stores.outgoing(AttachBuffers("shm0", 8, 45, NS)))
    # Each rank's own geometry: its kvstore judges its pages by it.
    assert attach["kvstore.1"] == AttachBuffers("shm1", 8, P * 7 + 5, NS, P, 7, 5)
    clones = dict(stores.outgoing(WritePages((
        PageWrite(pid(1), bytes(16), (1, 2, 3, 4), 0, 45, STATE_FLAG),
        PageWrite(pid(2), bytes(16), (1, 2), 1, 20, 0)))))
    assert [w.payload_len for w in clones["kvstore"].writes] == [4 * 10 + 5, 2 * 10]
    assert [w.payload_len for w in clones["kvstore.1"].writes] == [4 * 7 + 5, 2 * 7]
    assert [w.buffer for w in clones["kvstore.1"].writes] == [0, 1]


def test_the_core_sizes_pages_by_the_largest_share():
    stores = PageStores(group=True)
    uneven = [rank_info(0, 7, state=9), rank_info(1, 10, state=3)]  # pipeline: uneven layers
    stores.worker_ready(ready(uneven))
    core_view = stores.for_core(ready(uneven))
    assert (core_view.buffer_bytes, core_view.state_bytes, core_view.kv_bytes_per_token) == (
        P * 10 + 9, 9, 10)
    assert core_view.shm_name == "shm0" and core_view.ranks == tuple(uneven)
    single = ready([rank_info(0, 7)])
    assert PageStores(group=False).for_core(single) is single
    clones = dict(stores.outgoing(WritePages((
        PageWrite(pid(1), bytes(16), (1, 2, 3, 4), 0, P * 10 + 9, STATE_FLAG),))))
    assert clones["kvstore"].writes[0].payload_len == P * 7 + 9
    assert clones["kvstore.1"].writes[0].payload_len == P * 10 + 3


def test_a_page_is_persisted_only_when_every_rank_wrote_its_share():
    stores = group()
    send(stores, write(1, 2))
    assert stores.incoming("kvstore", written(info(1, 100), info(2, 100))) == []
    [merged] = stores.incoming("kvstore.1", written(info(1, 70, used=5.0), info(2, 70)))
    assert [i.page_id for i in merged.written] == [pid(1), pid(2)]
    assert merged.written[0].nbytes == 100 and merged.written[0].last_used == 5.0
    assert merged.failed == () and merged.buffers == (1, 2)


def test_one_ranks_failure_fails_the_page_and_drops_the_other_share():
    stores = group()
    send(stores, write(1, 2))
    stores.incoming("kvstore.1", written(info(2), failed=(pid(1),), error="disk full"))
    [merged] = stores.incoming("kvstore", written(info(1), info(2)))
    assert merged.failed == (pid(1),) and [i.page_id for i in merged.written] == [pid(2)]
    assert merged.error == "disk full"
    # rank 0's share of page 1 would be an orphan on its disk
    assert deletes(stores) == [("kvstore", DeletePages((pid(1),)))]


def test_buffers_are_freed_only_when_every_rank_replied():
    """Through the real core: a staged page's buffer comes back after the last rank's reply."""
    core = SchedulerCore(CoreConfig(num_slots=1, ctx=64, prefill_chunk=64, max_queue=4,
                                    page_size=P, disk_budget_bytes=10**9))
    stores = group()
    out = []

    def deliver(effects):
        for msg in effects.messages:
            if isinstance(msg, (WritePages, ReadPages, AttachBuffers, DescribeInventory,
                                DeletePages, TouchPages)):
                out.append(send(stores, msg)[0])
    deliver(core.handle(KvstoreRestarted(), 1.0))
    for ident in ("kvstore", "kvstore.1"):
        for msg in stores.incoming(ident, InventoryDescribed(ident, ())):
            deliver(core.handle(msg, 1.0))
    deliver(core.handle(ready(stores.ranks), 1.0))
    from switchyard.proto.values import SamplingParams
    from switchyard.proto.gateway_scheduler import SubmitRequest
    from switchyard.proto.scheduler_worker import StepDone
    deliver(core.handle(SubmitRequest("a", tuple(range(10, 10 + 2 * P + 1)), 1,
                                      SamplingParams(), ()), 1.0))
    step = core.handle(PlanStep(), 2.0).step
    deliver(core.handle(StepDone(step.step, (), 2 * P + 1, 0, 0.0), 2.0))
    step = core.handle(PlanStep(), 3.0)  # stages the two full pages
    deliver(core.handle(StepDone(step.step.step, (), 0, 1, 0.0), 3.0))
    writes = [dict(c) for c in out if any(isinstance(m, WritePages) for _, m in c)]
    assert writes, "the full pages were handed to both kvstores"
    free = core.pages.allocator.num_free
    batch = writes[0]
    infos = tuple(PageInfo(w.page_id, w.parent_id, NS, P, 100, 3.0) for w in
                  batch["kvstore"].writes)
    assert stores.incoming("kvstore", written(*infos)) == []
    assert core.pages.allocator.num_free == free, "one rank is not enough"
    [merged] = stores.incoming("kvstore.1", written(*infos))
    core.handle(merged, 4.0)
    assert core.pages.allocator.num_free == free + len(infos)
    assert all(w.page_id in core.pages.tree for w in batch["kvstore"].writes)


def test_reads_are_ok_only_when_every_rank_read_its_share():
    stores = group()
    reads = ReadPages(tuple(PageRead(pid(i), (1, 2, 3, 4), i) for i in (1, 2, 3)))
    clones, _ = send(stores, reads)
    assert dict(clones)["kvstore.1"] == reads  # same buffer indexes, each in its own pool
    assert stores.incoming("kvstore.1", PagesRead((pid(1), pid(3)), (pid(2),))) == []
    [merged] = stores.incoming("kvstore", PagesRead((pid(1), pid(2)), (pid(3),)))
    assert merged == PagesRead((pid(1),), (pid(2), pid(3)))
    # the shares that were read of pages another rank lost are dropped
    assert deletes(stores) == [("kvstore", DeletePages((pid(2),))),
                             ("kvstore.1", DeletePages((pid(3),)))]


def test_batches_are_answered_in_order_and_strays_are_ignored():
    stores = group()
    send(stores, ReadPages((PageRead(pid(1), (1,), 0),)))
    send(stores, ReadPages((PageRead(pid(1), (1,), 1),)))  # the same page, another buffer
    assert stores.incoming("kvstore", PagesRead((pid(9),), ())) == []  # answers nothing owed
    stores.incoming("kvstore", PagesRead((pid(1),), ()))
    stores.incoming("kvstore", PagesRead((), (pid(1),)))
    first = stores.incoming("kvstore.1", PagesRead((pid(1),), ()))
    second = stores.incoming("kvstore.1", PagesRead((pid(1),), ()))
    assert first == [PagesRead((pid(1),), ())] and second == [PagesRead((), (pid(1),))]


def test_a_read_overtakes_the_writes_queued_before_it():
    """kvstore answers a read before writes it queued earlier: neither waits for the other."""
    stores = group()
    send(stores, write(1))
    send(stores, ReadPages((PageRead(pid(2), (1,), 5),)))
    assert stores.incoming("kvstore", PagesRead((pid(2),), ())) == []
    assert stores.incoming("kvstore.1", PagesRead((pid(2),), ())) == [PagesRead((pid(2),), ())]
    stores.incoming("kvstore.1", written(info(1)))
    [merged] = stores.incoming("kvstore", written(info(1)))
    assert [i.page_id for i in merged.written] == [pid(1)]


def test_a_rank_that_cannot_be_reached_fails_writes_and_reads_at_once():
    stores = group()
    _, answered = send(stores, write(1), undelivered={"kvstore.1"})
    assert answered == []  # rank 0 still owes its answer
    [merged] = stores.incoming("kvstore", written(info(1)))
    assert merged.failed == (pid(1),)
    _, answered = send(stores, ReadPages((PageRead(pid(1), (1,), 0),)),
                       undelivered={"kvstore", "kvstore.1"})
    assert answered == [PagesRead((), (pid(1),))]


def test_inventory_is_the_pages_every_rank_holds():
    stores = group()
    send(stores, DescribeInventory())
    send(stores, write(4))  # in flight: its share on rank 0 is no orphan
    inv0 = InventoryDescribed("b0", (info(1, 100, STATE_FLAG), info(2, 100), info(4)), 0.5)
    inv1 = InventoryDescribed("b1", (info(1, 120), info(2, 90, used=7.0), info(3)), 0.25,
                              writable=False, error="read-only")
    assert stores.incoming("kvstore.1", inv1) == []
    [merged] = stores.incoming("kvstore", inv0)
    assert {p.page_id: (p.nbytes, p.flags, p.last_used) for p in merged.pages} == {
        pid(1): (120, 0, 1.0), pid(2): (100, 0, 7.0)}  # a state only if every share has it
    assert (merged.scan_s, merged.writable, merged.error) == (0.5, False, "read-only")
    assert deletes(stores) == [("kvstore.1", DeletePages((pid(3),)))]


def test_inventories_before_the_group_is_ready_wait_for_its_ranks():
    stores = PageStores(group=True)
    stores.restarted("kvstore")
    stores.restarted("kvstore.1")
    clones, _ = send(stores, DescribeInventory())
    assert [i for i, _ in clones] == ["kvstore", "kvstore.1"]
    assert stores.incoming("kvstore", InventoryDescribed("b0", (info(1),))) == []
    assert stores.incoming("kvstore.1", InventoryDescribed("b1", (info(1),))) == []
    [merged] = stores.worker_ready(ready([rank_info(0, 10), rank_info(1, 10)]))
    assert [p.page_id for p in merged.pages] == [pid(1)]
    # a merged inventory is given once: a worker restart does not repeat a stale one
    assert stores.worker_ready(ready([rank_info(0, 10), rank_info(1, 10)])) == []


def test_a_rank_kvstore_restart_is_a_restart_of_the_group_store():
    stores = group()
    send(stores, write(1))
    send(stores, ReadPages((PageRead(pid(2), (1,), 3),)))
    send(stores, DescribeInventory())
    stores.incoming("kvstore", written(info(1)))
    stores.restarted("kvstore.1")  # new process: it owes nothing; the core re-sends
    # rank 0's answers to what was sent before are consumed and dropped
    assert stores.incoming("kvstore", PagesRead((pid(2),), ())) == []
    assert stores.incoming("kvstore", InventoryDescribed("b0", (info(1),))) == []
    send(stores, DescribeInventory())
    send(stores, write(1))
    assert stores.incoming("kvstore.1", InventoryDescribed("b1", ())) == []
    [merged] = stores.incoming("kvstore", InventoryDescribed("b0", (info(1),)))
    assert merged.pages == ()  # rank 1 lost page 1 (its write is being re-sent)
    assert deletes(stores) == []  # ...so rank 0's share is kept for it
    stores.incoming("kvstore", written(info(1)))
    [rewritten] = stores.incoming("kvstore.1", written(info(1)))
    assert [i.page_id for i in rewritten.written] == [pid(1)]


def test_rank_page_directories_and_the_scheduler_address(tmp_path):
    import pytest

    from switchyard.common.endpoints import Endpoints
    from switchyard.proto.service_loop import scheduler_endpoint
    from switchyard.common.settings import Settings, SettingsError
    from switchyard.scheduler.service import remote_kvstore_address

    assert Settings(kv_dir="/kv").rank_kv_path == Path("/kv")
    assert Settings(kv_dir="/kv", rank=2).rank_kv_path == Path("/kv/rank-2")
    for bad in ("tcp://0.0.0.0:5510", "tcp://*:5510", "tcp://mac-a:5510", "ipc:///x",
                "tcp://10.0.0.1"):
        with pytest.raises(SettingsError, match="--scheduler-address must be tcp://IP:PORT"):
            Settings(scheduler_address=bad, group_key_file="/k.json").validate()
    Settings(scheduler_address="tcp://[fd00::1]:5510", group_key_file="/k.json").validate()

    local = tmp_path / "local.json"
    local.write_text('[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]')
    remote = tmp_path / "remote.json"  # 192.0.2.0/24 is documentation space: never ours
    remote.write_text('[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["192.0.2.7"]}]')
    address = "tcp://127.0.0.1:5510"
    assert remote_kvstore_address(Settings()) == ""
    assert remote_kvstore_address(Settings(hostfile=str(local), scheduler_address=address)) == ""
    with pytest.raises(SettingsError, match="b \\(rank 1\\) is another machine"):
        remote_kvstore_address(Settings(hostfile=str(remote)))
    assert remote_kvstore_address(Settings(hostfile=str(remote),
                                           scheduler_address=address)) == address
    # a kvstore connects over TCP only where rank 0 (the scheduler's host) is another machine
    endpoints = Endpoints(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('[{"ssh": "a", "ips": ["192.0.2.7"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]')
    assert scheduler_endpoint(Settings(hostfile=str(remote), scheduler_address=address, rank=1),
                              endpoints) == endpoints.scheduler
    assert scheduler_endpoint(Settings(hostfile=str(elsewhere), scheduler_address=address,
                                       rank=1), endpoints) == address


def test_each_role_may_send_only_its_own_messages():
    """A peer is heard only in its role (the scheduler drops the rest)."""
    from switchyard.proto.base import Heartbeat
    from switchyard.proto.scheduler_kvstore import PagesDeleted
    from switchyard.proto.scheduler_worker import StepDone
    from switchyard.proto.gateway_scheduler import SubmitRequest
    from switchyard.scheduler.service import may_send

    beat, step, submit, deleted = Heartbeat, StepDone, SubmitRequest, PagesDeleted
    assert may_send("gateway", submit) and may_send("gateway", beat)
    assert may_send("worker", step) and not may_send("worker", submit)
    assert may_send("kvstore.1", deleted) and not may_send("kvstore.1", submit)
    assert not may_send("kvstore.1", step) and may_send("kvstore", beat)
    assert not may_send("stranger", beat) and not may_send("kvstore.0", beat)


def test_a_kvstore_heard_from_again_is_ready_again():
    """Silent past the timeout (a long prefill starving it on a loaded machine) it is lost;
    heard from again without a restart it is back, and /health says ok again."""
    from switchyard.scheduler.service import kvstore_readiness

    assert kvstore_readiness(True, False, False) == (True, False, None)
    assert kvstore_readiness(True, False, True) == (False, True, "kvstore.lost")
    assert kvstore_readiness(False, True, True) == (False, True, None)
    assert kvstore_readiness(False, True, False) == (True, False, "kvstore.back")
    # Starting (no inventory yet): never made ready by a heartbeat alone.
    assert kvstore_readiness(False, False, False) == (False, False, None)


def test_an_inventory_asked_for_before_a_delete_does_not_count_the_deleted_page():
    """As the group starts: rank 1's kvstore greets (a describe to both ranks), then rank 0's
    (its count starts over; a describe to both again). Rank 0's first answer and rank 1's two
    make the merge, which deletes rank 0's orphan; rank 0's second answer, asked for before
    that delete, still lists it. Status must count 2 pages on rank 0, as its disk will hold."""
    stores = group()
    send(stores, DescribeInventory())
    stores.restarted("kvstore")
    send(stores, DescribeInventory())
    three, two = (info(1), info(2), info(3)), (info(1), info(2))
    assert stores.incoming("kvstore", InventoryDescribed("b0", three)) == []
    assert stores.incoming("kvstore.1", InventoryDescribed("b1", two)) == []
    [merged] = stores.incoming("kvstore.1", InventoryDescribed("b1", two))
    assert deletes(stores) == [("kvstore", DeletePages((pid(3),)))]
    assert stores.incoming("kvstore", InventoryDescribed("b0", three)) == []
    assert stores.held == {0: {pid(1), pid(2)}, 1: {pid(1), pid(2)}}
    stores.incoming("kvstore", PagesDeleted((pid(3),), 100))
    send(stores, write(3))  # written again: counted again, and kept by a later inventory
    stores.incoming("kvstore", written(info(3)))
    send(stores, DescribeInventory())
    stores.incoming("kvstore", InventoryDescribed("b0", three))
    assert stores.held[0] == {pid(1), pid(2), pid(3)}
