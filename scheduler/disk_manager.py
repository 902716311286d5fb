"""The core's side of kvstore: reads for the requests being restored, kvstore's answers, its
restarts and its inventory (docs/design/kv-pages.md "Restores", "KV pages").

The page cache (scheduler.page_cache) keeps the index of what is on disk and stages writes;
the read batches are `scheduler.restore`'s. This manager sends the reads as their requests
run, hands the pages read to the requests for the next step to load, and settles what a
kvstore that restarted or failed a write lost.
"""

from __future__ import annotations

from switchyard.proto.scheduler_kvstore import (
    DescribeInventory,
    InventoryDescribed,
    PagesRead,
    PagesWritten,
)
from switchyard.proto.scheduler_worker import WorkerMayStop
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.request_lifecycle import RequestLifecycle
from switchyard.scheduler.requests import Request


class DiskManager:
    def __init__(self, state: CoreState, lifecycle: RequestLifecycle):
        self.state = state
        self.lifecycle = lifecycle

    def issue_reads(self) -> None:
        st = self.state
        if not st.pages.enabled:
            return  # kvstore (re)starting: reads wait until it has attached the buffers
        for slot in st.slots:
            req = st.requests.get(slot.rid) if slot.rid else None
            # Read ahead while a batch loads; a hybrid slot takes its batches one at a time
            # (a miss may make the slot unusable below a page that carries its state).
            if req is not None and req.restore_pages and not req.reading \
                    and (st.config.trimmable or not req.loading):
                read = st.reads.issue(req)
                if read is not None:
                    st.outbox.send(read)

    def note_restore_done(self, req: Request, now: float) -> None:
        """The request's prefix is in its slot (kept, copied or restored): its timings, the
        tokens it found cached, and its prompt's tail staged once its prompt is all in."""
        st = self.state
        if req.ready_at is None:
            req.ready_at = now
        if req.prefilled_at is None and st.remaining_prefill(req) == 0:
            req.prefilled_at = now
        if req.restore_started_at is not None:
            req.restore_s = now - req.restore_started_at
            req.restore_started_at = None
        if not req.cache_counted:
            req.cache_counted = True
            req.num_cached = min(len(st.slots[req.slot].tokens), len(req.prompt) - 1)
        if not req.prompt_tail_saved and st.remaining_prefill(req) == 0:
            req.prompt_tail_saved = True
            # The page where the prompt's context ends, staged next step: a next turn, or
            # the same prompt again, resumes there (docs/design/kv-pages.md "KV pages").
            st.slots[req.slot].prompt_tail_at = req.num_context

    # --- kvstore's events ------------------------------------------------------------------

    def pages_read(self, msg: PagesRead, now: float) -> None:
        st = self.state
        answer = st.reads.answered(msg, st.requests)
        if answer is None:
            return
        req, good, complete = answer
        last = good[-1][0].page_id if good else None
        if not complete and not st.config.trimmable and last not in st.pages.state_pages:
            # A hybrid slot is usable only up to a page that carries its state.
            st.pages.release([b for _, b in good])
            good = []
            st.slots[req.slot].truncate(0, st.config.page_size)
        req.loading = req.loading + good  # a batch not yet loaded stays first
        if req.cancelled and not st.busy(req):
            self.lifecycle.finish(req, "cancelled", now)
        self.issue_reads()  # the next batch is read while this one loads

    def pages_written(self, msg: PagesWritten, now: float) -> None:
        self.state.pages.pages_written(msg, now)
        if msg.failed:
            self._recheck_persisted()
        self.worker_may_stop()

    def worker_stopping(self) -> None:
        """The worker was asked to stop: every slot's pages not on disk are written first, as
        if each left memory, and nothing new is placed meanwhile (docs/design/kv-pages.md
        "A disk smaller than memory")."""
        st = self.state
        st.worker_stopping = True
        unwritten = [slot for slot in st.slots if slot.page_ids and not st.releasable(slot)]
        st.outbox.log("worker.stopping", num_slots_unwritten=len(unwritten),
                      num_tokens_held=sum(len(s.tokens) for s in unwritten))  # by those slots
        for slot in st.slots:
            slot.disk_wanted = slot.tail_wanted = True
        self.worker_may_stop()

    def worker_may_stop(self) -> None:
        """Tell a stopping worker it may go once every slot could leave memory and kvstore
        answered every write."""
        st = self.state
        if not st.worker_stopping or st.pages.writing or not all(
                st.releasable(slot) for slot in st.slots if slot.page_ids):
            return
        st.worker_stopping = False
        st.outbox.log("worker.may_stop")
        st.outbox.send(WorkerMayStop())

    def kvstore_restarted(self) -> None:
        """Reads sent to the old kvstore are lost: ask the new one again once it is attached.
        Writes are lost too: every slot's pages are checked against the new inventory again."""
        st = self.state
        st.pages.kvstore_restarted()  # may send the writes in flight again...
        self._recheck_persisted()
        st.reads.lost(st.requests)
        attach = st.pages.attach_message()
        # ...after the new kvstore has the buffers they are in (messages of this event only).
        st.outbox.send_first(*([attach] if attach is not None else []), DescribeInventory())

    def inventory(self, msg: InventoryDescribed, now: float) -> None:
        st = self.state
        st.pages.kvstore_inventory(msg.pages, msg.writable, now, st.pinned, msg.error)
        st.index_overdue = False
        st.outbox.log("kvstore.inventory", **{
            "num_pages": len(msg.pages), "disk_bytes": st.pages.tree.total_bytes,
            "scan_s": round(msg.scan_s, 3), "writable": msg.writable, "error": msg.error})

    def _recheck_persisted(self) -> None:
        """Pages a slot counted as on their way to disk may not have arrived: stage again,
        with the tail where an idle slot's turn ended."""
        for slot in self.state.slots:
            slot.num_persisted = 0
            slot.tail_wanted = slot.tail_wanted or slot.rid is None
