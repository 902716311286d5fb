"""What the scheduler pays per page to keep a worker group's shares on N kvstores.

    .venv/bin/python bench/page_fanout.py [--rounds 15] [--pages 64]

The scheduler side of a write-through batch of P=256 pages as it runs in the shell
(scheduler/page_stores.py): clone the `WritePages` per rank and encode each clone, then
decode each rank's `PagesWritten` and merge the replies. The single worker (pass-through, one
kvstore) is the reference; the ranks alternate with it round by round, medians reported.
Scheduler CPU only: the kvstores' disk writes happen on N machines in parallel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from switchyard.proto import codec  # noqa: E402
from switchyard.proto.scheduler_kvstore import (  # noqa: E402
    PageInfo,
    PagesWritten,
    PageWrite,
    WritePages,
)
from switchyard.proto.scheduler_worker import RankInfo, WorkerReady  # noqa: E402
from switchyard.scheduler.page_stores import PageStores, kvstore_identity  # noqa: E402

P = 256
PER_TOKEN = 4096  # bytes of one token's KV on one rank (a mid-size model's share)


def stores_for(num_ranks: int) -> PageStores:
    stores = PageStores(group=num_ranks > 1)
    ranks = tuple(RankInfo(r, f"mac{r}", bytes(16), f"shm{r}", 256, P * PER_TOKEN, PER_TOKEN,
                           0) for r in range(num_ranks))
    for r in range(num_ranks):
        stores.restarted(kvstore_identity(r))
    stores.worker_ready(WorkerReady("w", bytes(16), "m", 1, 8192, P, PER_TOKEN, True, (),
                                    "shm0", 256, P * PER_TOKEN, 0,
                                    ranks=ranks if num_ranks > 1 else ()))
    return stores


def one_batch(stores: PageStores, batch: int, num_pages: int) -> float:
    tokens = tuple(range(P))
    msg = WritePages(tuple(PageWrite(batch.to_bytes(8, "little") + i.to_bytes(8, "little"),
                                     bytes(16), tokens, i, P * PER_TOKEN)
                           for i in range(num_pages)))
    # What each kvstore will answer, encoded beforehand: the scheduler only decodes it.
    replies = [(ident, codec.encode(PagesWritten(tuple(
        PageInfo(w.page_id, w.parent_id, bytes(16), P, w.payload_len + 1152, 1.0)
        for w in msg.writes), (), ()))) for ident, _ in stores.outgoing(msg)]
    started = time.perf_counter()
    clones = stores.outgoing(msg)
    frames = [codec.encode(clone) for _, clone in clones]
    stores.sent(msg, [(ident, clone, True) for ident, clone in clones])
    merged = []
    for ident, frame in replies:
        merged += stores.incoming(ident, codec.decode(frame))
    elapsed = time.perf_counter() - started
    assert len(merged) == 1 and len(merged[0].written) == num_pages and frames
    return elapsed / num_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pages", type=int, default=64)
    args = parser.parse_args()
    sizes = (1, 2, 4, 8)
    stores = {n: stores_for(n) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(args.rounds):
        for n in (sizes if rnd % 2 == 0 else reversed(sizes)):
            times[n].append(one_batch(stores[n], rnd, args.pages))
    single = statistics.median(times[1])
    print(f"scheduler cost of a write-through batch of {args.pages} pages (P={P}), "
          f"median of {args.rounds} rounds")
    print("ranks  per page / single worker's")
    for n in sizes:
        print(f"{n:>5}  {statistics.median(times[n]) / single:6.2f}x")
    print(f"(single worker: {single * 1e6:.1f} us per page on this machine; informative only)")


if __name__ == "__main__":
    main()
