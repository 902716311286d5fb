"""The scheduler's kvstores as one page store (docs/design/worker-groups.md "Pages per rank").

A worker group keeps each rank's share of every page in that rank's kvstore (`kvstore` for
rank 0, `kvstore.R` for rank R). The core still talks to ONE page store: this pure layer sits
in the shell between the core and the sockets. It clones each command per rank (the rank's
buffer pool, its payload length), and merges the replies: a page is written when every rank
wrote its share, read when every rank read it, and on disk when every rank holds it.

A single worker (no hostfile) passes every message through unchanged: today's path.

Each kvstore answers reads in the order it received them, and writes in theirs (a read goes
ahead of queued writes), so the batches each rank still owes are two queues per rank. A rank kvstore that restarts is a restart of the group's page
store: the core re-sends what was in flight, and the replies the other ranks still owe for the
old batches are consumed and dropped.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec

from switchyard.common.endpoints import rank_role
from switchyard.proto.base import ROLE_KVSTORE
from switchyard.proto.scheduler_kvstore import (
    AttachBuffers,
    DeletePages,
    DescribeInventory,
    InventoryDescribed,
    PageInfo,
    PagesDeleted,
    PagesRead,
    PagesWritten,
    PageWrite,
    ReadPages,
    WritePages,
)
from switchyard.proto.scheduler_worker import RankInfo, WorkerReady
from switchyard.proto.page_flags import PageFlags
from switchyard.proto.status import KvstoreState, RankStatus
from switchyard.scheduler.outbox import Outbox


def kvstore_identity(rank: int) -> str:
    """The DEALER identity of rank `rank`'s kvstore (rank 0 keeps the single worker's)."""
    return rank_role(ROLE_KVSTORE, rank)


def kvstore_rank(identity: str) -> int | None:
    """The rank of a kvstore identity, or None when `identity` is not a kvstore's."""
    if identity == ROLE_KVSTORE:
        return 0
    prefix = ROLE_KVSTORE + "."
    if identity.startswith(prefix) and identity[len(prefix):].isdigit():
        rank = int(identity[len(prefix):])
        return rank if rank > 0 else None
    return None


@dataclass
class _Batch:
    """One command sent to every rank, and what each rank answered."""

    message: WritePages | ReadPages
    page_ids: frozenset[bytes]
    owed: set[int]  # ranks whose answer is still due
    answers: dict[int, PagesWritten | PagesRead] = field(default_factory=dict)
    undelivered: set[int] = field(default_factory=set)  # ranks it could not be sent to


class PageStores:
    def __init__(self, group: bool, outbox: Outbox | None = None):
        """`group`: the server runs a worker group (a hostfile), so kvstores are per rank.
        `outbox`: the core's, where the deletes this layer decides by itself go."""
        self.group = group
        self.outbox = outbox if outbox is not None else Outbox()
        self.ranks: tuple[RankInfo, ...] = ()  # from the worker group's WorkerReady
        self.page_size = 0
        self.connected: set[int] = set()  # ranks whose kvstore greeted us
        # Per kind (WritePages, ReadPages): the batches in flight, in the order sent, and
        # per (rank, kind) the batches that rank still has to answer.
        self.batches: dict[type, deque[_Batch]] = {WritePages: deque(), ReadPages: deque()}
        self.owed: dict[tuple[int, type], deque[_Batch]] = {}
        self.inventory_owed: dict[int, int] = {}
        self.inventories: dict[int, InventoryDescribed] = {}
        self.num_orphans_deleted = 0
        self.held: dict[int, set[bytes]] = {}  # per rank: the pages its kvstore holds
        # Per rank: pages a DeletePages named that its kvstore has not confirmed. An inventory
        # it was asked for before that delete still lists them.
        self.deleting: dict[int, Counter[bytes]] = {}

    # --- who is there ----------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.ranks) if self.ranks else 1

    def identities(self) -> list[str]:
        """Every kvstore the scheduler talks to (heartbeats, liveness)."""
        if not self.group:
            return [ROLE_KVSTORE]
        ranks = set(range(len(self.ranks))) | self.connected
        return [kvstore_identity(r) for r in sorted(ranks)]

    def worker_ready(self, msg: WorkerReady) -> list:
        """The worker group's ranks (their pools and payload sizes) are known from here on.
        Returns the merged inventory when every rank's came before the group was ready."""
        if not self.group:
            return []
        self.ranks = msg.ranks
        self.page_size = msg.page_size
        return self._inventory_if_complete()

    def for_core(self, msg: WorkerReady) -> WorkerReady:
        """The group as one page store: page sizes of the largest share (per token and per
        state), which is what the disk budget must allow on the fullest machine."""
        if not self.group or not msg.ranks:
            return msg
        state = max(r.state_bytes for r in msg.ranks)
        return msgspec.structs.replace(
            msg, kv_bytes_per_token=max(r.kv_bytes_per_token for r in msg.ranks),
            buffer_bytes=self._per_token(max(msg.ranks, key=self._per_token)) * msg.page_size
            + state, state_bytes=state)

    def _per_token(self, rank: RankInfo) -> int:
        return (rank.buffer_bytes - rank.state_bytes) // self.page_size

    def restarted(self, identity: str) -> None:
        """A kvstore greeted us with a new boot id (or for the first time): what was in
        flight anywhere is lost to the core (a KvstoreRestarted for the group follows)."""
        rank = kvstore_rank(identity)
        if not self.group or rank is None:
            return
        self.connected.add(rank)
        # The other ranks still answer the old batches: their answers are consumed, unused.
        for batches in self.batches.values():
            batches.clear()
        for kind in self.batches:  # the new process owes nothing the old one was sent
            self.owed.pop((rank, kind), None)
        self.inventory_owed.pop(rank, None)
        self.inventories.pop(rank, None)
        self.held.pop(rank, None)
        self.deleting.pop(rank, None)

    def rank_status(self, now: float, last_seen: dict[str, float], timeout_s: float
                    ) -> list[RankStatus]:
        """Per rank, for `switchyard status`: host, pool, its kvstore's state and pages."""
        out = []
        for r in self.ranks:
            identity = kvstore_identity(r.rank)
            state: KvstoreState
            if r.rank not in self.connected:
                state = "absent"
            elif now - last_seen.get(identity, 0.0) > timeout_s:
                state = "silent"
            elif self.inventory_owed.get(r.rank):
                state = "scanning"
            else:
                state = "ready"
            out.append(RankStatus(
                rank=r.rank, host=r.host, namespace=r.namespace.hex()[:8], shm_name=r.shm_name,
                num_buffers=r.num_buffers, buffer_bytes=r.buffer_bytes, kvstore=identity,
                kvstore_state=state, num_pages=len(self.held.get(r.rank, ()))))
        return out

    # --- core -> kvstores ------------------------------------------------------------------

    def outgoing(self, msg) -> list[tuple[str, object]]:
        """(identity, message) for every kvstore that should get `msg`."""
        if not self.group:
            return [(ROLE_KVSTORE, msg)]
        if isinstance(msg, AttachBuffers):
            return [(kvstore_identity(r.rank), AttachBuffers(
                r.shm_name, r.num_buffers, r.buffer_bytes, msg.namespace, self.page_size,
                self._per_token(r), r.state_bytes)) for r in self.ranks]
        if isinstance(msg, WritePages):
            return [(kvstore_identity(r.rank), self._write_for(r, msg)) for r in self.ranks]
        if isinstance(msg, DeletePages):
            for rank in range(self.num_ranks):
                self._deleting(rank, msg.page_ids)
        if isinstance(msg, DescribeInventory) and not self.ranks:
            # Before the worker group is ready: ask every kvstore that greeted us.
            return [(kvstore_identity(r), msg) for r in sorted(self.connected)]
        return [(kvstore_identity(r), msg) for r in range(self.num_ranks)]

    def sent(self, original, clones: list[tuple[str, object, bool]]) -> list:
        """Record what `outgoing(original)` gave and whether each clone was delivered.
        Returns messages for the core (a batch no kvstore could take is answered at once)."""
        if not self.group:
            return []
        delivered = {kvstore_rank(ident) for ident, _, ok in clones if ok}
        if isinstance(original, DescribeInventory):
            for rank in delivered:
                self.inventory_owed[rank] = self.inventory_owed.get(rank, 0) + 1
            return []
        if not isinstance(original, (WritePages, ReadPages)):
            return []
        ids = (original.writes if isinstance(original, WritePages) else original.reads)
        batch = _Batch(original, frozenset(x.page_id for x in ids), set(delivered))
        batch.undelivered = {kvstore_rank(ident) for ident, _, ok in clones if not ok}
        kind = type(original)
        self.batches[kind].append(batch)
        for rank in delivered:
            self.owed.setdefault((rank, kind), deque()).append(batch)
        return self._complete(kind)

    def _write_for(self, rank: RankInfo, msg: WritePages) -> WritePages:
        """Rank `rank`'s share of each page: its own bytes per token and state size."""
        per_token = self._per_token(rank)
        if all((self._per_token(r), r.state_bytes) == (per_token, rank.state_bytes)
               for r in self.ranks):
            return msg  # shares of one size (an even split): the core's lengths are right
        return WritePages(tuple(
            PageWrite(w.page_id, w.parent_id, w.token_ids, w.buffer,
                      len(w.token_ids) * per_token
                      + (rank.state_bytes if w.flags & PageFlags.RECURRENT_STATE else 0), w.flags)
            for w in msg.writes))

    # --- kvstores -> core ------------------------------------------------------------------

    def incoming(self, identity: str, msg) -> list:
        """What the core sees of a kvstore's reply: nothing until every rank answered."""
        if not self.group:
            return [msg]
        rank = kvstore_rank(identity)
        if rank is None:
            return []
        if isinstance(msg, InventoryDescribed):
            return self._inventory(rank, msg)
        if isinstance(msg, PagesDeleted):
            deleting = self.deleting.get(rank, Counter())
            deleting.subtract(msg.page_ids)
            self.deleting[rank] = +deleting  # drops the confirmed
            return [msg]
        if isinstance(msg, (PagesWritten, PagesRead)):
            kind = WritePages if isinstance(msg, PagesWritten) else ReadPages
            queue = self.owed.get((rank, kind))
            if not queue:
                return []  # owed by a process that has restarted since
            if isinstance(msg, PagesWritten):
                answered = frozenset((*(i.page_id for i in msg.written), *msg.failed))
            else:
                answered = frozenset((*msg.ok, *msg.missing))
            if queue[0].page_ids != answered:
                return []  # not the answer to what this rank owes first: a stray
            batch = queue.popleft()
            batch.owed.discard(rank)
            batch.answers[rank] = msg
            held = self.held.setdefault(rank, set())
            if isinstance(msg, PagesWritten):
                held.update(info.page_id for info in msg.written)
                for info in msg.written:  # written again after a delete
                    self.deleting.get(rank, {}).pop(info.page_id, None)
            else:
                held.difference_update(msg.missing)  # absent, or corrupt and removed
            return self._complete(kind)
        return [msg]

    def _complete(self, kind: type) -> list:
        """Merged answers of the batches every rank has answered, in the order sent."""
        out, batches = [], self.batches[kind]
        while batches and not batches[0].owed:
            batch = batches.popleft()
            if kind is WritePages:
                out.append(self._merge_writes(batch))
            else:
                out.append(self._merge_reads(batch))
        return out

    def _merge_writes(self, batch: _Batch) -> PagesWritten:
        """Written = pages every rank wrote (nbytes: the largest share); failed = the rest.
        A share written where another rank failed would be an orphan on that disk: deleted."""
        written: dict[bytes, list[PageInfo]] = {}
        for answer in batch.answers.values():
            for info in answer.written:
                written.setdefault(info.page_id, []).append(info)
        ok, failed = [], []
        orphans: dict[int, list[bytes]] = {}
        for w in batch.message.writes:
            infos = written.get(w.page_id, [])
            if len(infos) == self.num_ranks and not batch.undelivered:
                ok.append(_merged_info(infos))
            else:
                failed.append(w.page_id)
                for rank, answer in batch.answers.items():
                    if any(i.page_id == w.page_id for i in answer.written):
                        orphans.setdefault(rank, []).append(w.page_id)
        self._delete_orphans(orphans)
        error = next((a.error for a in batch.answers.values() if a.error), "")
        return PagesWritten(tuple(ok), tuple(failed),
                            tuple(w.buffer for w in batch.message.writes), error)

    def _merge_reads(self, batch: _Batch) -> PagesRead:
        """A page is read when every rank read its share into its buffer."""
        ok_everywhere = None
        for answer in batch.answers.values():
            ok = set(answer.ok)
            ok_everywhere = ok if ok_everywhere is None else ok_everywhere & ok
        if ok_everywhere is None or batch.undelivered:
            ok_everywhere = set()
        ok = [r.page_id for r in batch.message.reads if r.page_id in ok_everywhere]
        missing = [r.page_id for r in batch.message.reads if r.page_id not in ok_everywhere]
        # A page a rank lost is forgotten by the core: the other shares are orphans now.
        gone = {pid for answer in batch.answers.values() for pid in answer.missing}
        self._delete_orphans({rank: sorted(gone & set(answer.ok))
                              for rank, answer in batch.answers.items()})
        return PagesRead(tuple(ok), tuple(missing))

    def _inventory(self, rank: int, msg: InventoryDescribed) -> list:
        owed = self.inventory_owed.get(rank, 0)
        if owed:
            self.inventory_owed[rank] = owed - 1
        self.inventories[rank] = msg
        deleting = self.deleting.get(rank, {})
        self.held[rank] = {info.page_id for info in msg.pages if info.page_id not in deleting}
        return self._inventory_if_complete()

    def _inventory_if_complete(self) -> list:
        ranks = range(self.num_ranks)
        if not self.ranks or any(self.inventory_owed.get(r) or r not in self.inventories
                                 for r in ranks):
            return []
        merged = self._merge_inventories()
        self.inventories.clear()  # a later merge needs every rank's answer again
        return [merged]

    def _merge_inventories(self) -> InventoryDescribed:
        """Pages every rank holds (one id names a page on every rank); the others are
        orphans of a rank that died mid-write, deleted unless a write of them is in flight."""
        parts = [self.inventories[r] for r in range(self.num_ranks)]
        held: dict[bytes, list[PageInfo]] = {}
        for part in parts:
            for info in part.pages:
                held.setdefault(info.page_id, []).append(info)
        pages = tuple(_merged_info(infos) for infos in held.values()
                      if len(infos) == self.num_ranks)
        in_flight = {pid for b in self.batches[WritePages] for pid in b.page_ids}
        complete = {p.page_id for p in pages}
        self._delete_orphans({
            r: [i.page_id for i in part.pages
                if i.page_id not in complete and i.page_id not in in_flight]
            for r, part in enumerate(parts)})
        error = next((p.error for p in parts if p.error), "")
        return InventoryDescribed(parts[0].boot_id, pages, max(p.scan_s for p in parts),
                                  all(p.writable for p in parts), error)

    def _delete_orphans(self, per_rank: dict[int, list[bytes]]) -> None:
        for rank, ids in sorted(per_rank.items()):
            if ids:
                self._deleting(rank, ids)
                self.num_orphans_deleted += len(ids)
                self.outbox.send_to(kvstore_identity(rank), DeletePages(tuple(ids)))
                self.outbox.log("kv.orphan_shares_deleted", kvstore=kvstore_identity(rank),
                                num_pages=len(ids))

    def _deleting(self, rank: int, ids) -> None:
        self.held.get(rank, set()).difference_update(ids)
        self.deleting.setdefault(rank, Counter()).update(ids)


def _merged_info(infos: list[PageInfo]) -> PageInfo:
    """One page over its shares: rank 0's identity, the largest share's bytes (what the disk
    budget must allow on the fullest machine), the latest use, a state only if every share
    carries it."""
    first = infos[0]
    flags = first.flags
    for info in infos[1:]:
        flags &= info.flags
    return PageInfo(first.page_id, first.parent_id, first.namespace, first.num_tokens,
                    max(i.nbytes for i in infos), max(i.last_used for i in infos), flags)
