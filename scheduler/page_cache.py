"""What the scheduler knows about KV pages beyond the slots: disk, buffers, writes in flight.

Pure bookkeeping, no I/O: the core asks it what to stage and where pages are, and it queues
the kvstore commands (`WritePages`, `DeletePages`, `TouchPages`) in the core's outbox.

Write-through (docs/design/kv-pages.md "KV pages"): every full page of every slot is staged
into a shared buffer at the start of the step after it filled, then written by kvstore, so a
conversation that leaves its slot needs no write then (--kv-write-back, on a disk smaller than
memory: as their slot leaves, `disk_copy.written_later`). Eviction happens when pages are
written: the budget is never exceeded, and what goes is chosen by `scheduler.eviction`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

from switchyard.proto.scheduler_kvstore import (
    AttachBuffers,
    DeletePages,
    PageInfo,
    PagesWritten,
    PageWrite,
    TouchPages,
    WritePages,
)
from switchyard.proto.scheduler_worker import StagePage
from switchyard.common.backoff import Backoff
from switchyard.proto.page_flags import PageFlags
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, page_id, page_image_ids
from switchyard.proto.shm import BufferAllocator
from switchyard.proto.status import DiskStatus
from switchyard.scheduler.disk_copy import recount, settle, stages_now
from switchyard.scheduler.eviction import EvictionPlan, plan_eviction
from switchyard.scheduler.outbox import Outbox
from switchyard.scheduler.page_tree import DiskPageTree
from switchyard.scheduler.requests import Slot
from switchyard.scheduler.turns import Anchor, RecentTurns

# Page ids match slots to requests even with no page store (no worker namespace yet).
_LOCAL_NAMESPACE = b"switchyard-local"
# Chain roots (cache salts) remembered for `superseded_tails`.
_ROOTS_KEPT = 4096
# Header bytes per page file, an upper bound for budget arithmetic (P=256 needs 1152).
_HEADER_ALLOWANCE = 4096
# The pages eviction must leave, asked for only when it has to choose.
Pinned = Callable[[], Set[bytes]]


@dataclass
class _Pending:
    write: PageWrite
    nbytes: int
    doomed: bool = False  # a tail passed before it reached disk: delete it when it does


@dataclass(frozen=True)
class DiskPage:
    """A page of a request's context that is on disk: tokens [start, start + num_tokens)."""

    start: int
    num_tokens: int
    page_id: bytes


class PageCache:
    def __init__(self, page_size: int, budget_bytes: int, protect_window_s: float,
                 outbox: Outbox):
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self.protect_window_s = protect_window_s
        self.outbox = outbox
        self.namespace = b""
        self.tree = DiskPageTree()
        self.state_pages: set[bytes] = set()
        # Tails: the last, partial page of a conversation as its turn ended (parent -> ids).
        self.tails: dict[bytes, dict[bytes, int]] = {}
        self.tail_parent: dict[bytes, bytes] = {}
        # The turns that ended in them: whose conversation may still resume there.
        self.turns = RecentTurns()
        # The chain roots of the cache salts seen lately (proto/page_ids.chain_root), ROOT_ID
        # always: the pages under a root are not one conversation's, so its tails are never
        # superseded for having siblings. Bounded; a root forgotten only makes its tails
        # likelier evicted.
        self.roots: OrderedDict[bytes, None] = OrderedDict({ROOT_ID: None})
        self.staged: dict[bytes, _Pending] = {}   # staged by the step in flight
        self.writing: dict[bytes, _Pending] = {}  # sent to kvstore, not yet written
        # Sent to kvstore from a worker's pool that is gone: they still reach the disk, so
        # they count against the budget until kvstore answers (or a new kvstore rescans).
        self.orphans: dict[bytes, int] = {}
        self.fetching_bytes = 0  # held for pages asked of the peers (scheduler/peer_fetch.py)
        self.resend_writes = False  # a new kvstore gets `writing` again after its inventory
        self.allocator: BufferAllocator | None = None
        self.pool: AttachBuffers | None = None
        self.state_bytes = 0
        self.kvstore_attached = False
        self.pool_sent = False  # the current kvstore was told of the current pool
        # After the disk refused pages (full, read-only): stage again 1 s later, doubling to
        # 30 s while it keeps refusing, back to normal at the first page written.
        self.write_backoff = Backoff()
        self.write_error = ""  # kvstore's reason while writes are paused
        self.num_unwritten = 0  # pages the disk refused (not cached; nothing else lost)
        self.num_evicted = 0
        self.num_thrash = 0
        self.removals = 0  # pages that left the disk so far: slots recount theirs (disk_copy)

    # --- peers -----------------------------------------------------------------------------

    def worker_ready(self, namespace: bytes, shm_name: str, num_buffers: int,
                     buffer_bytes: int, state_bytes: int) -> None:
        """A worker (re)started with a new buffer pool: what used the old one is forgotten."""
        self.namespace = namespace
        self.staged.clear()
        self.orphans.update((pid, p.nbytes) for pid, p in self.writing.items())
        self.writing.clear()
        self.state_bytes = state_bytes
        if not shm_name:
            self.allocator, self.pool = None, None
            return
        self.allocator = BufferAllocator(num_buffers)
        self.pool = AttachBuffers(shm_name, num_buffers, buffer_bytes, namespace,
                                  self.page_size,
                                  (buffer_bytes - state_bytes) // self.page_size, state_bytes)
        self.pool_sent = False
        if self.kvstore_attached:
            self._send_pool()

    def kvstore_restarted(self) -> None:
        """Writes sent to the old kvstore may be lost; their buffers still hold the pages (the
        slot that computed them may hold other tokens by now): the new one gets them once its
        inventory says what is on disk (`kvstore_inventory`)."""
        self.kvstore_attached = False
        self.pool_sent = False
        self.resend_writes = True

    def kvstore_inventory(self, pages: tuple[PageInfo, ...], writable: bool, now: float,
                          pinned: Pinned = frozenset, error: str = "") -> None:
        # Foreign pages join the tree too: they never match, and age out like any other.
        self.tree = DiskPageTree()
        self.state_pages, self.tails, self.tail_parent = set(), {}, {}
        for info in pages:
            self._add(info)
        self.kvstore_attached = True
        # A worker that became ready after kvstore greeted but before its inventory came
        # found no kvstore to tell: tell it now, ahead of any read or write.
        self._send_pool()
        if not writable:
            self.write_backoff.failed(now)
            self.write_error = error
        # What the old kvstore had not done yet is on disk or lost, as the scan found it: its
        # evictions may be undone, so room is made again before the writes are resent.
        self.orphans.clear()
        if self.resend_writes and self.writing:
            pending = list(self.writing.values())
            self.writing = {}
            self._write(pending, now, pinned)
        self.resend_writes = False

    def attach_message(self) -> AttachBuffers | None:
        self.pool_sent = self.pool is not None
        return self.pool

    def _send_pool(self) -> None:
        if self.pool is not None and not self.pool_sent:
            self.pool_sent = True
            self.outbox.send_first(self.pool)

    def note_root(self, root: bytes) -> None:
        """A request of the chain root `root` arrived."""
        self.roots[root] = None
        self.roots.move_to_end(root)
        while len(self.roots) > _ROOTS_KEPT:
            oldest = next(iter(self.roots))
            if oldest == ROOT_ID:
                self.roots.move_to_end(oldest)
                continue
            del self.roots[oldest]

    # --- queries ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return bool(self.namespace) and self.allocator is not None and self.kvstore_attached

    @property
    def chain_namespace(self) -> bytes:
        """The namespace slot and request page ids are computed in."""
        return self.namespace or _LOCAL_NAMESPACE

    def chain(self, tokens) -> list[bytes]:
        return chain_page_ids(self.namespace, tokens, self.page_size) if self.namespace else []

    def sync_slot(self, slot: Slot) -> None:
        """Extend the slot's page ids to cover its full pages (truncation already cut them)."""
        full = len(slot.tokens) // self.page_size
        have = len(slot.page_ids)
        if have < full:
            parent = slot.page_ids[-1] if have else slot.root
            slot.page_ids += chain_page_ids(
                self.chain_namespace, slot.tokens[have * self.page_size:full * self.page_size],
                self.page_size, parent, slot.images, have * self.page_size)

    def disk_prefix(self, chain: list[bytes], tokens, n: int, trimmable: bool,
                    images=(), root: bytes = ROOT_ID) -> list[DiskPage]:
        """The pages of the context `tokens[:n]` (whose full pages are `chain` from `root`,
        whose images are `images`) restorable from disk, from its start: full pages, then the tail stored
        where a conversation's turn ended. A hybrid model restores to a page carrying the
        recurrent state."""
        if not self.enabled:
            return []
        P = self.page_size
        n_pages = self.tree.longest_prefix(chain)
        pages = [DiskPage(k * P, P, chain[k]) for k in range(n_pages)]
        tail = self._tail_after(chain[n_pages - 1] if n_pages else root, tokens, n,
                                n_pages * P, images)
        if tail is not None and (trimmable or tail.page_id in self.state_pages):
            return pages + [tail]
        if not trimmable:
            while pages and pages[-1].page_id not in self.state_pages:
                pages.pop()
        return pages

    def writing_end(self, chain: list[bytes], tokens, n: int, on_disk: list[DiskPage],
                    images=(), root: bytes = ROOT_ID) -> int:
        """How far into the context `tokens[:n]` a restore reaches once the pages on their way
        to disk (staged or sent, not yet written) land, where they extend what `on_disk`
        restores: its next full pages, or a tail that continues it; 0 where none does. A
        request that comes back while its own pages are being written waits for them rather
        than re-reading them (docs/design/kv-pages.md "Restores")."""
        pending = {**self.staged, **self.writing} if self.enabled else {}
        if not pending:
            return 0
        P = self.page_size
        # A hybrid model's restore stops short of full pages stored without a snapshot: a
        # tail after any of them may be what it resumes from.
        restorable = sum(1 for p in on_disk if p.num_tokens == P)
        stored = k = self.tree.longest_prefix(chain)
        while k < len(chain) and (chain[k] in pending or chain[k] in self.tree):
            k += 1
        done = on_disk[-1].start + on_disk[-1].num_tokens if on_disk else 0
        best = k * P if k > stored else 0
        parents = {chain[k - 1] if k else root: k * P
                   for k in range(restorable, stored + 1)}
        for pid, p in pending.items():
            start = parents.get(p.write.parent_id)
            if start is None:
                continue
            end = start + len(p.write.token_ids)
            if max(done, best) < end <= n and page_id(
                    self.namespace, p.write.parent_id, tokens[start:end],
                    page_image_ids(images, start, end)) == pid:
                best = end
        return best if best > done else 0

    def _tail_after(self, parent: bytes, tokens, end: int, start: int, images=()
                    ) -> DiskPage | None:
        best = None
        for tail_id, n in self.tails.get(parent, {}).items():
            if start + n <= end and (best is None or n > best.num_tokens):
                if page_id(self.namespace, parent, tokens[start:start + n],
                           page_image_ids(images, start, start + n)) == tail_id:
                    best = DiskPage(start, n, tail_id)
        return best

    def _add(self, info: PageInfo) -> None:
        self.tree.add(info.page_id, info.parent_id, info.nbytes, info.last_used)
        if info.flags & PageFlags.RECURRENT_STATE:
            self.state_pages.add(info.page_id)
        if info.num_tokens < self.page_size:
            self.tails.setdefault(info.parent_id, {})[info.page_id] = info.num_tokens
            self.tail_parent[info.page_id] = info.parent_id

    def _remove(self, pid: bytes) -> None:
        if pid in self.tree:
            self.tree.remove(pid)
            self.removals += 1
        self.state_pages.discard(pid)
        parent = self.tail_parent.pop(pid, None)
        if parent is not None:
            del self.tails[parent][pid]
            if not self.tails[parent]:
                del self.tails[parent]
            self.turns.forget_tail(pid)

    # --- turns and their tails (scheduler.turns) -------------------------------------------

    def anchor(self, chain: list[bytes], tokens, n: int, images=(),
               root: bytes = ROOT_ID) -> Anchor | None:
        """The anchor of the context `tokens[:n]` (whose full pages start `chain`); None for
        an empty one (every request would extend it)."""
        if n <= 0:
            return None
        P = self.page_size
        k, rest = divmod(n, P)
        if not rest:
            return Anchor(n, chain[k - 1], b"")
        parent = chain[k - 1] if k else root
        start = k * P
        return Anchor(n, parent, page_id(self.chain_namespace, parent, tokens[start:n],
                                         page_image_ids(images, start, n)))

    def supersede(self, chain: list[bytes], tokens, n: int, images=(),
                  root: bytes = ROOT_ID) -> tuple[list[Anchor], float | None]:
        """The context `tokens[:n]` (full pages `chain`) is a request being placed: every
        remembered turn whose prompt context it starts with is its own conversation's, now
        superseded, and forgotten (its tails are nobody's unless another turn ended there).
        Returns those turns (the conversation it continues) and when their last reply ended."""
        mine: dict[int, Anchor | None] = {}  # the context's anchor at each length asked
        continued, replied = [], []
        for a in self.turns.under([root, *chain]):
            if a.num_tokens > n:
                continue
            if a.num_tokens not in mine:
                mine[a.num_tokens] = self.anchor(chain, tokens, a.num_tokens, images, root)
            if mine[a.num_tokens] == a:
                replied.append(self.turns.retire(a))
                continued.append(a)
        return continued, max((t for t in replied if t is not None), default=None)

    def drop_passed_tails(self, chain: list[bytes], pinned: set[bytes],
                          root: bytes = ROOT_ID) -> None:
        """A request whose context has full pages past a tail's parent has moved its
        conversation on: its own tails there are superseded (the turns it continues were
        retired by `supersede`), and so are tails no remembered turn ended in (a branch a
        conversation left, one long forgotten), so they go now and disk stays linear in unique
        tokens. Tails other conversations ended in stay: a main session's under the system
        prompt its sub-agents share is where it resumes. Tails after the request's last full
        page stay: they are where this very request may resume."""
        passed = {root, *chain[:-1]}
        dead = [tid for parent in passed for tid in self.tails.get(parent, {})
                if tid not in pinned and not self.turns.owned(tid)]
        if dead:
            for tid in dead:
                self._remove(tid)
            self.outbox.send(DeletePages(tuple(dead)))
        for pending in [*self.staged.values(), *self.writing.values()]:
            write = pending.write
            if len(write.token_ids) < self.page_size and write.parent_id in passed and \
                    not self.turns.owned(write.page_id):
                pending.doomed = True

    def superseded_tails(self) -> set[bytes]:
        """Tails whose conversation has grown past them: another page follows their parent,
        and no remembered turn ended in them."""
        return {tid for parent, ids in self.tails.items() if parent not in self.roots
                and self.tree.num_children(parent) > 1 for tid in ids
                if not self.turns.owned(tid)}

    def awaited(self, contexts: Iterable[tuple[list[bytes], object, int, tuple]],
                trimmable: bool) -> set[bytes]:
        """The pages waiting requests will restore (`contexts`: chain, tokens, length, images
        and, optionally, chain root of each context, the first to keep first), up to half the
        budget, the context that would pass it by its leading pages. Each is about to be read,
        so evicting it costs a re-read for certain; the rest of the disk is only likely to be
        wanted again (docs/design/kv-pages.md "Disk eviction policy")."""
        awaited: set[bytes] = set()
        total = 0
        for chain, tokens, n, images, *root in contexts:
            ids = [p.page_id for p in self.disk_prefix(chain, tokens, n, trimmable, images,
                                                       *root)
                   if p.page_id not in awaited]
            for pid in ids:
                if total + self.tree.nbytes(pid) > self.budget_bytes // 2:
                    return awaited
                awaited.add(pid)
                total += self.tree.nbytes(pid)
        return awaited

    def persisted_tokens(self, slot: Slot, from_token: int) -> int:
        """Tokens of `slot` past `from_token` whose pages are on disk (restorable later)."""
        first = from_token // self.page_size
        return sum(self.page_size for pid in slot.page_ids[first:] if pid in self.tree)

    def disk_status(self) -> DiskStatus:
        return DiskStatus(bytes=self.tree.total_bytes, budget_bytes=self.budget_bytes,
                          num_pages=len(self.tree), writable=not self.write_backoff.failing,
                          num_evicted=self.num_evicted, num_thrash=self.num_thrash,
                          num_writing=len(self.writing),
                          error=self.write_error if self.write_backoff.failing else "",
                          num_unwritten=self.num_unwritten)

    def payload_len(self, num_tokens: int, with_state: bool) -> int:
        per_token = (self.pool.buffer_bytes - self.state_bytes) // self.page_size
        return num_tokens * per_token + (self.state_bytes if with_state else 0)

    def page_file_bytes(self, num_tokens: int, with_state: bool) -> int:
        return self.payload_len(num_tokens, with_state) + _HEADER_ALLOWANCE if self.pool else 0

    # --- buffers ---------------------------------------------------------------------------

    def acquire(self, n: int) -> list[int] | None:
        return self.allocator.acquire(n) if self.allocator else None

    def release(self, buffers) -> None:
        if self.allocator is not None:
            self.allocator.release(buffers)

    # --- write-through ---------------------------------------------------------------------

    def plan_stages(self, slots: list[Slot], trimmable: bool, state_points, now: float,
                    writes_back: bool = False) -> list[StagePage]:
        """Stage every full page not yet on disk or on its way there, while buffers last
        (`writes_back`: of slots that leave memory). `state_points(slot)` gives the page ends
        where a hybrid model should snapshot its recurrent state. The state exists only at the
        slot's current end, so a hybrid slot's last page waits until it is a snapshot point
        or the slot has moved past it; a page already on disk without a snapshot gets one
        when a later request stops there (the end of a shared prefix)."""
        if not self.enabled or not self.write_backoff.ready(now):
            return []
        stages = []
        P = self.page_size
        for slot in slots:
            self.sync_slot(slot)
            if not stages_now(slot, self.here, self.removals, writes_back):
                continue
            self.touch(slot.page_ids[:slot.num_persisted] if slot.disk_gap else [], now)  # kept
            at_end = len(slot.tokens) // P - 1 if len(slot.tokens) % P == 0 else None
            snapshot_here = (not trimmable and at_end is not None and at_end >= 0
                             and not slot.stateless_end and len(slot.tokens) in state_points(slot))
            for k in range(slot.num_persisted, len(slot.page_ids)):
                pid = slot.page_ids[k]
                if self.here(pid):
                    if k == slot.num_persisted:
                        slot.num_persisted += 1
                    continue
                if not trimmable and k == at_end and not snapshot_here:
                    continue  # maybe a snapshot point later; staged when the slot moves on
                if not self._stage(slot, k, with_state=k == at_end and snapshot_here, out=stages):
                    return stages
            if snapshot_here:
                pid = slot.page_ids[at_end]
                stored_plain = pid in self.tree and pid not in self.state_pages
                if stored_plain and pid not in self.staged and pid not in self.writing:
                    if not self._stage(slot, at_end, with_state=True, out=stages):
                        return stages
            for end in slot.take_tails():
                if not self._stage_tail(slot, trimmable, stages, end):
                    return stages
            settle(slot)
        return stages

    def _stage_tail(self, slot: Slot, trimmable: bool, out: list[StagePage], end: int) -> bool:
        """The partial page that ends at token `end` (`Slot.take_tails`). A hybrid model's
        page carries the state at its end, which the worker has at the slot's end and mark."""
        tail = self._tail(slot, end)
        if tail is None or not (trimmable or slot.has_state_at(end)):
            return True
        start, pid, parent, tokens, images = tail
        if slot.turn is not None:
            self.turns.ended_in(slot.turn, pid)
        if self.here(pid):
            return True
        return self._stage_page(slot.index, start, pid, parent, tokens,
                                with_state=not trimmable, out=out, image_ids=images)

    def _tail(self, slot: Slot, end: int | None = None
              ) -> tuple[int, bytes, bytes, tuple[int, ...], bytes] | None:
        """The partial page that ends at token `end` of the slot (its end by default): its
        start, page id, parent id, tokens and image ids; None when `end` is a page boundary."""
        end = len(slot.tokens) if end is None else end
        start = end // self.page_size * self.page_size
        if start == end:
            return None
        parent = slot.page_ids[start // self.page_size - 1] if start else slot.root
        tokens = tuple(slot.tokens[start:end])
        images = page_image_ids(slot.images, start, end)
        return start, page_id(self.namespace, parent, tokens, images), parent, tokens, images

    def here(self, pid: bytes) -> bool:
        """On disk, or on its way there (staged or being written)."""
        return pid in self.tree or pid in self.staged or pid in self.writing

    def all_on_disk(self, slot: Slot) -> bool:
        """Whether every token of the slot is on disk or on its way there (its full pages and
        its tail), as of the stages planned last: its KV can leave memory at no re-read."""
        recount(slot, self.here, self.removals)  # true to the disk (scheduler/disk_copy.py)
        if slot.num_persisted < len(slot.page_ids):
            return False
        tail = self._tail(slot)
        return tail is None or self.here(tail[1])

    def _stage(self, slot: Slot, k: int, with_state: bool, out: list[StagePage]) -> bool:
        P = self.page_size
        parent = slot.page_ids[k - 1] if k else slot.root
        return self._stage_page(slot.index, k * P, slot.page_ids[k], parent,
                                tuple(slot.tokens[k * P:(k + 1) * P]), with_state, out,
                                page_image_ids(slot.images, k * P, (k + 1) * P))

    def _stage_page(self, slot: int, start: int, pid: bytes, parent: bytes,
                    tokens: tuple[int, ...], with_state: bool, out: list[StagePage],
                    image_ids: bytes = b"") -> bool:
        buffers = self.acquire(1)
        if buffers is None:
            return False
        n = len(tokens)
        write = PageWrite(pid, parent, tokens, buffers[0], self.payload_len(n, with_state),
                          PageFlags.RECURRENT_STATE if with_state else PageFlags.NONE, image_ids)
        self.staged[pid] = _Pending(write, self.page_file_bytes(n, with_state))
        full = n == self.page_size
        out.append(StagePage(slot, start, buffers[0], with_state, 0 if full else n))
        return True

    def staged_done(self, now: float, pinned: Pinned) -> None:
        """The step that staged pages finished: make room on disk, then hand them to kvstore."""
        if not self.staged:
            return
        pending, self.staged = list(self.staged.values()), {}
        self._write(pending, now, pinned)

    def _write(self, pending: list[_Pending], now: float, pinned: Pinned) -> None:
        """Make room on disk for `pending`, then hand them to kvstore (or drop them)."""
        if not self._evict(sum(p.nbytes for p in pending), now, pinned):
            self.release([p.write.buffer for p in pending])
            self.outbox.log("kv.budget_exhausted", **{"num_pages_skipped": len(pending),
                                                        "budget_bytes": self.budget_bytes})
            return
        for p in pending:
            self.writing[p.write.page_id] = p
        self.outbox.send(WritePages(tuple(p.write for p in pending)))

    def make_room_for_fetch(self, nbytes: int, now: float, pinned: Pinned) -> int:
        """`nbytes` if the budget has room for pages asked of the peers (evicting as for a
        write), else 0 (docs/design/kv-pages.md "Pages from a peer")."""
        return nbytes if self._evict(nbytes, now, pinned) else 0

    def add_fetched(self, pages: Iterable[PageInfo]) -> None:
        for info in pages:  # written by kvstore from what a peer sent
            self._add(info)

    def _evict(self, nbytes: int, now: float, pinned: Pinned) -> bool:
        """Make room for `nbytes` more on disk; whether it fits."""
        # Pages still being written count too: they are on disk as soon as kvstore answers;
        # so do the bytes held for pages asked of the peers.
        incoming = (nbytes + sum(p.nbytes for p in self.writing.values())
                    + sum(self.orphans.values()) + self.fetching_bytes)
        if self.tree.total_bytes + incoming <= self.budget_bytes:
            plan = EvictionPlan()  # room enough: what is pinned does not matter
        else:
            plan = plan_eviction(self.tree, self.budget_bytes, incoming, now,
                                 self.protect_window_s, pinned=pinned(),
                                 evict_first=self.superseded_tails())
        if plan.page_ids:
            for pid in plan.page_ids:
                self._remove(pid)
            self.num_evicted += len(plan.page_ids)
            self.outbox.send(DeletePages(tuple(plan.page_ids)))
            self.outbox.log("kv.evicted", **{"num_pages": len(plan.page_ids),
                                               "freed_bytes": plan.freed_bytes})
        if plan.thrash is not None:
            self.num_thrash += 1
            self.outbox.log("kv.thrash", **{
                "num_protected_evicted": plan.thrash.num_protected_evicted,
                "working_set_bytes": plan.thrash.working_set_bytes,
                "budget_bytes": plan.thrash.budget_bytes,
                "suggested_budget_bytes": plan.thrash.suggested_budget_bytes,
                "advice": "raise --kv-disk-budget to the suggested size"})
        return plan.fits

    def pages_written(self, msg: PagesWritten, now: float) -> None:
        for info in msg.written:
            self.orphans.pop(info.page_id, None)
            pending = self.writing.pop(info.page_id, None)
            if pending is not None:
                self.release([pending.write.buffer])
                if pending.doomed:
                    self.turns.forget_tail(info.page_id)
                    self.outbox.send(DeletePages((info.page_id,)))
                    continue
            self._add(info)
        self.num_unwritten += len(msg.failed)
        for pid in msg.failed:
            self.orphans.pop(pid, None)
            pending = self.writing.pop(pid, None)
            if pending is not None:
                self.release([pending.write.buffer])
        if msg.error:
            first = not self.write_backoff.failing
            delay = self.write_backoff.failed(now)
            self.write_error = msg.error
            if first:
                self.outbox.log("kv.persistence_off", **{"error": msg.error,
                                                           "retry_in_s": delay})
        elif msg.written:
            if self.write_backoff.failing:
                self.outbox.log("kv.persistence_on")
            self.write_backoff.succeeded()
            self.write_error = ""

    def touch(self, chain: list[bytes], now: float) -> None:
        on_disk = [pid for pid in chain if pid in self.tree]
        if on_disk:
            self.tree.touch(on_disk, now)
            self.outbox.send(TouchPages(tuple(on_disk)))

    def forget(self, page_ids) -> None:
        """Pages kvstore could not read back (gone or corrupt, and removed)."""
        for pid in page_ids:
            self._remove(pid)
