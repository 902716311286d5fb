"""Crash-safety drill of the page store (issue 12): kill -9 a writer mid-write, N times.

A child process runs the kvstore's own write path (`PageStore.write`: temporary file, fsync,
rename, directory fsync) in a loop, on chains of pages whose payload is a pure function of
their tokens; the parent SIGKILLs it at a random moment, then does what a restarted kvstore
does (`scan`: rebuild the index, remove torn temporary files) and checks every page on disk:
it must verify (header, token ids, checksum) and its payload must be bit-identical to the
bytes that were written. Run by hand (not a test):

    .venv/bin/python bench/crash_drill.py --rounds 100

Prints one line per 10 rounds and a summary: kills, pages on disk, pages verified, torn temp
files removed, corrupt pages found (the target is 0), restores that differ (target 0).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import pages  # noqa: E402
from kvstore.pages import ROOT_ID, decode_header, make_namespace  # noqa: E402
from kvstore.store import PageStore, read_entries  # noqa: E402

NAMESPACE = make_namespace("crash-drill")
PAGE_TOKENS = 256
PAYLOAD_BYTES = 64 * 1024  # small pages: the drill is about the write path, not bandwidth
MAX_PAGES = 400  # beyond, the oldest half is deleted between rounds (disk stays bounded)


def payload_of(tokens: tuple[int, ...]) -> bytes:
    """The bytes a page of these tokens holds: deterministic, so a restore can be compared."""
    seed = hashlib.blake2b(repr(tokens).encode(), digest_size=32).digest()
    return (seed * (PAYLOAD_BYTES // len(seed) + 1))[:PAYLOAD_BYTES]


def tokens_of(chain: int, index: int) -> tuple[int, ...]:
    return tuple((chain * 7919 + index * PAGE_TOKENS + i) % 50_000 for i in range(PAGE_TOKENS))


def writer(root: Path, seed: int) -> None:
    """The child: write page chains until killed (fsync on, as the daemon does)."""
    store = PageStore(root, sync=True)
    store.scan()
    print("writing", flush=True)  # the parent kills from now on
    rng = random.Random(seed)
    while True:
        chain = rng.randrange(1_000_000)
        parent = ROOT_ID
        for index in range(rng.randint(2, 8)):
            tokens = tokens_of(chain, index)
            store.write(NAMESPACE, parent, tokens, payload_of(tokens))
            parent = pages.page_id(NAMESPACE, parent, tokens)


def check(root: Path) -> dict[str, int]:
    """What a restarted kvstore sees, then every page read back and compared."""
    store = PageStore(root, sync=True)
    infos = store.scan()
    entries, unreadable = read_entries(root)
    by_id = {e.path.stem: e for e in entries}
    buf = bytearray(PAYLOAD_BYTES)
    verified = differ = 0
    for info in infos:
        entry = by_id[info.page_id.hex()]
        with open(entry.path, "rb") as f:
            tokens = decode_header(f.read(65536)).token_ids
        header = store.read_into(info.namespace, info.page_id, tokens, memoryview(buf))
        if header is None:
            continue
        verified += 1
        if bytes(buf[:header.payload_len]) != payload_of(tuple(tokens)):
            differ += 1
    if len(infos) > MAX_PAGES:
        oldest = sorted(infos, key=lambda i: i.last_used)[:len(infos) // 2]
        store.delete(i.page_id for i in oldest)
    return {"pages": len(infos), "verified": verified, "differ": differ,
            "corrupt_removed": store.num_corrupt_removed, "temp_removed": store.num_temp_removed,
            "unreadable": unreadable}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--dir", type=Path, help="page directory (default: a temp dir)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        writer(args.dir, args.child)
        return 0
    root = args.dir or Path(tempfile.mkdtemp(prefix="sy-drill-"))
    rng = random.Random(12)
    totals = {"kills": 0, "corrupt_removed": 0, "temp_removed": 0, "differ": 0,
              "unverified": 0}
    started = time.monotonic()
    try:
        for round_ in range(1, args.rounds + 1):
            child = subprocess.Popen([sys.executable, __file__, "--child", str(round_),
                                      "--dir", str(root)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE)
            child.stdout.readline()  # imported and scanned: writing now
            time.sleep(0.05 + rng.random() * 0.3)
            child.send_signal(signal.SIGKILL)
            child.wait()
            totals["kills"] += 1
            result = check(root)
            totals["corrupt_removed"] += result["corrupt_removed"]
            totals["temp_removed"] += result["temp_removed"]
            totals["differ"] += result["differ"]
            totals["unverified"] += result["pages"] - result["verified"]
            if round_ % 10 == 0 or round_ == args.rounds:
                print(f"round {round_:4d}: {result['pages']} pages on disk, "
                      f"{result['verified']} verified, {result['differ']} differ, "
                      f"torn temp files removed so far {totals['temp_removed']}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{totals['kills']} kill -9's during writes in {time.monotonic() - started:.0f} s: "
          f"corrupt pages found {totals['corrupt_removed']}, pages that did not verify "
          f"{totals['unverified']}, restores that differ {totals['differ']}, "
          f"torn temp files removed {totals['temp_removed']}")
    ok = totals["corrupt_removed"] == totals["differ"] == totals["unverified"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
