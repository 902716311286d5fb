"""Disk reads for requests being restored: batches of pages read into shared buffers.

kvstore answers reads in the order they were sent, so the batches in flight are a queue. A
request keeps the batch it waits for in `req.reading` and the pages read but not yet loaded
in `req.loading`: the next batch is read while the worker loads the last one. A batch whose
request finished or moved meanwhile only gives its buffers back. Pure bookkeeping: the disk
manager (scheduler/disk_manager.py) sends what `issue` returns.
"""

from __future__ import annotations

from collections import deque

from switchyard.proto.scheduler_worker import LoadPages
from switchyard.proto.scheduler_kvstore import PageRead, PagesRead, ReadPages
from switchyard.scheduler.page_cache import PageCache
from switchyard.scheduler.requests import Request

# Pages read per batch: bounds the buffers one restore holds at a time. A batch takes at most
# half the buffer pool, so the next one can be read while it loads (docs/design/kv-pages.md "Restores").
RESTORE_BATCH = 64
# The first batch is smaller: the worker starts loading while the rest is read.
RESTORE_FIRST_BATCH = 16


class DiskReads:
    def __init__(self, pages: PageCache):
        self.pages = pages
        self.in_flight: deque[tuple[str, list]] = deque()  # (rid, [(DiskPage, buffer)])

    def __bool__(self) -> bool:
        return bool(self.in_flight)

    def clear(self) -> None:
        """A new worker, a new buffer pool: the batches in flight name buffers of the old.
        kvstore still answers them, in order: they stay in the queue, ownerless, so that
        their answers are dropped (taken for a later batch, one would load buffers of the
        new pool that nothing has read into)."""
        self.in_flight = deque((None, batch) for _, batch in self.in_flight)

    def issue(self, req: Request) -> ReadPages | None:
        """Read the request's next pages, as many as free buffers allow (None: wait)."""
        pool = self.pages.allocator.num_buffers if self.pages.allocator else 0
        first = req.num_restored == 0 and not req.loading
        n = min(len(req.restore_pages), RESTORE_FIRST_BATCH if first else RESTORE_BATCH,
                max(1, pool // 2))
        buffers = None
        while n and buffers is None:
            buffers = self.pages.acquire(n)
            n = n if buffers is not None else n // 2
        if not buffers:
            return None
        batch = list(zip(req.restore_pages, buffers))
        del req.restore_pages[:len(batch)]
        req.reading = batch
        self.in_flight.append((req.rid, batch))
        feed = req.feed  # pages lie within the context: slices of it, no copy of the whole
        return ReadPages(tuple(
            PageRead(p.page_id, feed[p.start:p.start + p.num_tokens], b) for p, b in batch))

    def answered(self, msg: PagesRead, requests: dict[str, Request]):
        """The oldest batch came back: (request, pages read in order up to the first miss,
        whether all were read), or None when no request waits for it any more."""
        if not self.in_flight:
            return None
        rid, batch = self.in_flight.popleft()
        if rid is None:
            return None  # read into a pool that is gone: nothing to give back
        req = requests.get(rid)
        if req is None or req.reading is not batch:
            self.pages.release([b for _, b in batch])
            return None
        req.reading = []
        missing = set(msg.missing)
        good = []
        for page, buffer in batch:
            if page.page_id in missing:
                break
            good.append((page, buffer))
        if len(good) < len(batch):
            self.pages.forget(missing)  # gone or corrupt: kvstore removed them
            self.pages.release([b for _, b in batch[len(good):]])
            req.restore_pages = []
        return req, good, len(good) == len(batch)

    def lost(self, requests: dict[str, Request]) -> None:
        """kvstore restarted: what it was reading is read again once the new one attached."""
        while self.in_flight:
            rid, batch = self.in_flight.popleft()
            if rid is None:
                continue  # of a pool that is gone
            self.pages.release([b for _, b in batch])
            req = requests.get(rid)
            if req is not None and req.reading is batch:
                req.restore_pages[:0] = [page for page, _ in batch]
                req.reading = []


def load_of(req: Request, trimmable: bool) -> LoadPages:
    """The step command that loads the request's batch that was read."""
    batch, req.loading = req.loading, []
    first, last = batch[0][0], batch[-1][0]
    tokens = req.feed[first.start:last.start + last.num_tokens]
    if not req.generated:  # resumed mid-reply: its prompt was counted already
        req.num_restored += len(tokens)
    with_state = not trimmable and not req.restore_pages
    # The slot makes room for the whole context at the restore's first load: later batches
    # and the prefill after them write in place instead of growing (copying) the slot.
    reserve = max(0, len(req.feed) - 1 - (first.start + len(tokens)))
    end = first.start + len(tokens)
    return LoadPages(req.slot, first.start, tuple(b for _, b in batch), tokens, with_state,
                     reserve, req.images_before(end))
