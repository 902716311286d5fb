"""A conversation comes back from disk at the speed of the disk.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/restore.py [--tokens 32768] [--rounds 4] [--model-size tiny]

One slot (`--slots 1`). Conversation A (`--tokens` tokens of token ids, sent to
/v1/completions) is prefilled once; then rounds of: B (a short conversation) takes the slot,
then A comes back with a few new tokens, so its whole prefix is restored from disk pages.
Every other round drops the OS page cache first (`echo 3 > /proc/sys/vm/drop_caches`, when the
OS allows it), so kvstore reads from the device; the other rounds read warm page files.

Per switching turn, from the scheduler's `request.finished` line: restore throughput = bytes
restored (tokens x KV bytes per token) / `restore_s` (placement to the last page loaded into
the slot: kvstore's verified reads, the worker's loads and the messages between them). It is
compared with `cat` of every page file of the run, in the same page-cache state (warm: right
after the turn, median of 3; cold: after dropping the cache again). Breakdown: kvstore's
`kv.read` lines (verified reads into shared memory) and the worker's `step.done` lines
(`load_ms`).
Target: restore >= 50% of `cat` on the same files. Ratios within one run; the machine is shared.

Restored against re-read (docs/performance.md "How it compares"): after the rounds, conversation C of
`--tokens` fresh token ids (nothing of it cached anywhere) is prefilled on the same warm
server: what a server without a disk tier pays to bring A back. Reported: each switching turn's
TTFT (scheduler `ttft_s`) over C's, median per page-cache state. The 100K figure:

    .venv/bin/python bench/restore.py --tokens 100000 --rounds 2 --model M.gguf
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (fmt, log_events, median, model_dir, preload_note,  # noqa: E402
                           random_token_ids, stream, table)
from switchyard.testing.group import ServerGroup  # noqa: E402

COMPLETIONS = "/v1/completions"


def drop_page_cache() -> bool:
    """Drop the OS page cache (Linux, root); False where the OS does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cat_seconds(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *map(str, files[i:i + 500])], stdout=subprocess.DEVNULL,
                       check=True)
    return time.perf_counter() - t0


def send(url: str, prompt: list[int]) -> str:
    res = stream(url, COMPLETIONS, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    if res.error:
        raise RuntimeError(res.error)
    return res.rid or ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("tiny", "h512"), default="tiny")
    ap.add_argument("--model", help="model directory (overrides --model-size)")
    ap.add_argument("--tokens", type=int, default=32768, help="conversation A's length")
    ap.add_argument("--other", type=int, default=600, help="conversation B's length")
    ap.add_argument("--rounds", type=int, default=4, help="switching turns of A")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="small: a chunk at 32K+ context must finish within the step limit")
    ap.add_argument("--extra", default="", help="more `switchyard serve` flags")
    ap.add_argument("--keep-log", metavar="FILE", help="copy the group log here")
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    model = model_dir(args.model_size, args.model)
    rng = random.Random(0)
    a_base = random_token_ids(rng, args.tokens)
    b_base = random_token_ids(rng, args.other)
    c_base = random_token_ids(rng, args.tokens)
    ctx = args.tokens + 64 * (args.rounds + 2) + 64
    can_drop = drop_page_cache()
    print(f"model {model}; A {args.tokens} tokens, B {args.other}; {args.rounds} switching "
          f"turns; page cache drop: {'allowed' if can_drop else 'NOT allowed here'}")
    extra = ["--prefill-chunk", str(args.prefill_chunk), "--page-size", str(args.page_size),
             "--kv-disk-budget", "8GiB", "--log-level", "debug", *args.extra.split()]
    rows, turns = [], []
    with ServerGroup(model, slots=1, ctx=ctx, extra=extra, startup_timeout_s=300) as group:
        t0 = time.perf_counter()
        first_rid = send(group.url, a_base)
        print(f"A prefilled cold in {time.perf_counter() - t0:.1f}s", flush=True)
        for rnd in range(1, args.rounds + 1):
            cold = can_drop and rnd % 2 == 0
            send(group.url, b_base + random_token_ids(rng, 16))
            time.sleep(1.0)  # let write-through of B's pages finish; A's are on disk already
            if cold:
                drop_page_cache()
            rid = send(group.url, a_base + random_token_ids(rng, 64 * rnd))
            # A's pages and what else is stored now (passed tails are deleted as turns go).
            files = sorted(group.kv_dir.rglob("*.page"))
            if cold:
                drop_page_cache()
            total = sum(f.stat().st_size for f in files)
            cat_s = cat_seconds(files) if cold else median([cat_seconds(files) for _ in range(3)])
            turns.append((rid, cold, total, cat_s))
        t0 = time.perf_counter()
        reread_rid = send(group.url, c_base)  # the same length read afresh, server warm
        print(f"C ({args.tokens} fresh tokens) prefilled in {time.perf_counter() - t0:.1f}s",
              flush=True)
        sched = {e["rid"]: e for e in log_events(group.log_path, "request.finished")
                 if e.get("role") == "scheduler"}
        started = log_events(group.log_path, "worker.started")
        bpt = started[-1]["kv_bytes_per_token"]
        reads = log_events(group.log_path, "kv.read")
        steps = [e for e in log_events(group.log_path, "step.done") if e.get("num_loaded")]
        if args.keep_log:
            Path(args.keep_log).write_bytes(group.log_path.read_bytes())
    ratios = {False: [], True: []}
    vs_reread = {False: [], True: []}
    reread = sched[reread_rid]
    for rid, cold, total, cat_s in turns:
        e = sched[rid]
        restored, restore_s = e["num_restored_tokens"], e["restore_s"]
        mbs = restored * bpt / restore_s / 1e6 if restore_s else float("nan")
        cat_mbs = total / cat_s / 1e6
        ratios[cold].append(mbs / cat_mbs)
        vs_reread[cold].append(e["ttft_s"] / reread["ttft_s"])
        rows.append(["cold" if cold else "warm", restored, f"{restored * bpt / 1e6:.0f}",
                     fmt(restore_s, 3), fmt(mbs, 0), f"{total / 1e6:.0f}", fmt(cat_mbs, 0),
                     fmt(mbs / cat_mbs, 2), e["num_prefilled_tokens"], fmt(e["ttft_s"], 3)])
    print(table(["cache", "restored tok", "MB", "restore_s", "MB/s", "files MB", "cat MB/s",
                 "restore/cat", "prefilled", "ttft_s"], rows))
    read_s = sum(r.get("read_s", 0.0) for r in reads)
    read_mb = sum(r.get("num_bytes", 0) for r in reads) / 1e6
    load_s = sum(s["load_ms"] for s in steps) / 1e3
    print(f"kvstore kv.read: {read_mb:.0f} MB in {read_s:.2f}s ({fmt(read_mb / read_s, 0)} MB/s)"
          if read_s else "kvstore kv.read: no timed reads in the log")
    print(f"worker loads: {len(steps)} steps, {load_s:.2f}s "
          f"({fmt(sum(s['num_loaded'] for s in steps) * args.page_size * bpt / 1e6 / load_s, 0)}"
          f" MB/s)" if load_s else "worker loads: none logged")
    for cold in (False, True):
        if ratios[cold]:
            verdict = "met" if median(ratios[cold]) >= 0.5 else "MISSED"
            print(f"{'cold' if cold else 'warm'} page cache: restore / cat, median = "
                  f"{fmt(median(ratios[cold]), 2)} (target >= 0.5: {verdict}; per turn "
                  f"{', '.join(fmt(r, 2) for r in ratios[cold])})")
    print(f"re-read: C's ttft_s {fmt(reread['ttft_s'], 3)} ({reread['num_prefilled_tokens']} "
          f"tokens prefilled; A's first, cold server: {fmt(sched[first_rid]['ttft_s'], 3)})")
    for cold in (False, True):
        if vs_reread[cold]:
            print(f"{'cold' if cold else 'warm'} page cache: TTFT restored / re-read, median = "
                  f"{fmt(median(vs_reread[cold]), 3)} at {args.tokens} tokens (per turn "
                  f"{', '.join(fmt(r, 3) for r in vs_reread[cold])})")
    print("The first turn's restore also faults in the slot's memory where the slot's buffer is "
          "too small for it (a fresh array); later turns write into the slot's own buffers.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
