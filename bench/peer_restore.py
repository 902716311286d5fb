"""A conversation that comes back on the other server: restored from its peer, against restored
from local disk and against re-read (docs/design/kv-pages.md "Pages from a peer").

    .venv/bin/python bench/peer_restore.py [--tokens 8192 32768] [--model-size tiny]

Two servers, `--peer`s of each other, one slot each. Per length N: conversation X (N token ids
through /v1/completions) is prefilled on A: the re-read, what a server without X's pages pays
(its TTFT, after a warm-up request). Then X with 64 new tokens goes to B, which never saw it:
B asks A for X's pages, writes them to its disk and restores them (TTFT from a peer). Then a
short conversation takes B's slot, and X with 64 more tokens comes back to B: restored from
B's own disk (TTFT from local disk). Reported, per length: each TTFT over the re-read's, and
the peer's over the local disk's, with the fetch's share (the kvstore's `peer.fetched`
fetch_s). Ratios within one run; the machine is shared.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (fmt, log_events, model_dir, preload_note,  # noqa: E402
                           random_token_ids, stream, table)
from switchyard.proto.status import read_status  # noqa: E402
from switchyard.testing.group import ServerGroup, free_port, start_all, stop_all  # noqa: E402

COMPLETIONS = "/v1/completions"


def send(group: ServerGroup, prompt: list[int]) -> str:
    res = stream(group.url, COMPLETIONS, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    if res.error:
        raise RuntimeError(res.error)
    return res.rid or ""


def wait_written(group: ServerGroup, num_pages: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(group.runtime_dir / "status.json")
        if status and status.disk.num_pages >= num_pages and not status.disk.num_writing:
            return
        time.sleep(0.1)
    raise RuntimeError(f"pages not written within {timeout_s}s")


def finished(group: ServerGroup, rid: str) -> dict:
    for _ in range(100):
        found = [e for e in log_events(group.log_path, "request.finished")
                 if e.get("role") == "scheduler" and e.get("rid") == rid]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise RuntimeError(f"no request.finished for {rid}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("tiny", "h512"), default="tiny")
    ap.add_argument("--model", help="model directory (overrides --model-size)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--page-size", type=int, default=256)
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    model = model_dir(args.model_size, args.model)
    rng = random.Random(0)
    ctx = max(args.tokens) + 1024
    ports = [free_port(), free_port()]
    groups = [ServerGroup(model, slots=1, ctx=ctx, port=port, startup_timeout_s=300,
                          extra=["--page-size", str(args.page_size), "--kv-disk-budget", "8GiB",
                                 "--peer", f"http://127.0.0.1:{other}",
                                 "--peer-fetch-timeout-s", "30"])
              for port, other in zip(ports, reversed(ports))]
    rows = []
    try:
        start_all(groups)
        a, b = groups
        for group in groups:
            send(group, random_token_ids(rng, 64))  # warm-up
        for n in args.tokens:
            x = random_token_ids(rng, n)
            reread = finished(a, send(a, x))
            wait_written(a, n // args.page_size)
            peer = finished(b, send(b, x + random_token_ids(rng, 64)))
            fetch = [e for e in log_events(b.log_path, "peer.fetched")
                     if e.get("rid") == peer["rid"] and e.get("num_pages")]
            send(b, random_token_ids(rng, 300))  # takes B's slot
            wait_written(b, n // args.page_size)
            disk = finished(b, send(b, x + random_token_ids(rng, 128)))
            fetch_s = fetch[-1]["fetch_s"] if fetch else float("nan")
            fetch_mb = fetch[-1]["num_bytes"] / 1e6 if fetch else 0.0
            rows.append([n, peer["num_restored_tokens"], disk["num_restored_tokens"],
                         fmt(peer["ttft_s"] / reread["ttft_s"], 3),
                         fmt(disk["ttft_s"] / reread["ttft_s"], 3),
                         fmt(peer["ttft_s"] / disk["ttft_s"], 2),
                         fmt(fetch_s / peer["ttft_s"], 2), f"{fetch_mb:.0f}"])
            print(f"{n} tokens done", flush=True)
    finally:
        stop_all(groups)
    print(table(["tokens", "restored (peer)", "restored (disk)", "peer / re-read",
                 "disk / re-read", "peer / disk", "fetch share of peer TTFT", "fetched MB"],
                rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
