"""Crash-safety drill through a whole group: kill -9 the kvstore daemon 100 times
while it writes pages.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/crash_drill.py [--kills 100] [--words 300] [--seed 12]

1. Reference: a fault-free group answers every round's prompt (greedy, `--max-tokens`).
2. Drill: a group on `--slots 1` gets one new prompt per round (`--words` words, about 770 tokens:
   three 256-token pages written through to disk), and the kvstore is killed with SIGKILL
   the moment a page file is being written (its temp file appears: polled every millisecond),
   or, if none is seen, at a random moment (seeded) up to `--kill-window` s after sending.
   The supervisor restarts it
   (testing/drill_serve.py: the serve command with a drill restart policy, since the real
   one gives up after 5 crashes a minute) and the next round waits until it is ready.
3. The group is stopped; every page file on disk is checked with the kvstore's own code
   (`PageStore.scan` then `PageStore.read_into` of each page: header, token ids, checksum).
4. A new group starts on the same page directory and every round's prompt is sent again: it
   is restored from disk (cached tokens) and its greedy reply must equal the reference (or
   both be greedy up to a float tie of the logits: bench/greedy_ties.py).

Reports kills, pages on disk, pages removed (torn temp files and bad pages, as the daemon and
the final scan saw them), corrupt pages served (replies that differ from the reference after
a restore: must be 0), restores, wall time. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench._common import parse_with_model, table  # noqa: E402
from bench.greedy_ties import GreedyJudge  # noqa: E402
from switchyard.kvstore.pages import decode_header  # noqa: E402
from switchyard.kvstore.store import PageStore  # noqa: E402
from switchyard.testing.drill_serve import DRILL_SERVE  # noqa: E402
from switchyard.testing.group import ServerGroup, short_tmp_dir  # noqa: E402
from switchyard.testing.workload import text, wait_ready  # noqa: E402

PAGE = 256


def prompt(seed: int, round_: int, words: int) -> list[dict]:
    return [{"role": "system", "content": f"drill round {round_}"},
            {"role": "user", "content": text(seed * 1000 + round_, words)}]


def ask(http: httpx.Client, group: ServerGroup, model: str, messages, max_tokens: int) -> dict:
    """One greedy chat turn; {"status", "text", "prompt", "cached"} (status None: no reply)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    try:
        resp = http.post(f"{group.base_url}/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return {"status": None, "error": type(exc).__name__}
    out = {"status": resp.status_code}
    if resp.status_code == 200:
        data = resp.json()
        out["text"] = data["choices"][0]["message"]["content"]
        out["prompt"] = data["usage"]["prompt_tokens"]
        out["cached"] = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    else:
        out["error"] = resp.text[:200]
    return out


def ask_until_ok(http, group, model, messages, max_tokens, tries: int = 20) -> dict:
    for _ in range(tries):
        out = ask(http, group, model, messages, max_tokens)
        if out["status"] == 200:
            return out
        time.sleep(0.5)
    return out


def model_id(group: ServerGroup) -> str:
    return httpx.get(f"{group.base_url}/models").json()["data"][0]["id"]


def temp_files(kv_dir: Path) -> list[str]:
    """Temp files of pages being written (scandir: the fastest look at every shard)."""
    found = []
    try:
        for ns in os.scandir(kv_dir):
            if ns.is_dir():
                for shard in os.scandir(ns.path):
                    if shard.is_dir():
                        found += [e.name for e in os.scandir(shard.path)
                                  if e.name.endswith(".tmp")]
    except FileNotFoundError:
        pass  # a shard being created
    return found


def verify_pages(kv_dir: Path) -> dict:
    """Scan and read back every page with the kvstore's own checks (group stopped)."""
    store = PageStore(kv_dir)
    pages = store.scan()
    buf = memoryview(bytearray(16 << 20))
    bad = 0
    for info in pages:
        entry = store.get(info.page_id)
        with open(entry.path, "rb") as f:
            tokens = decode_header(f.read(1 << 20)).token_ids
        if store.read_into(info.namespace, info.page_id, tokens, buf) is None:
            bad += 1
    return {"pages": len(pages), "bytes": store.num_bytes, "unreadable": bad,
            "corrupt_removed": store.num_corrupt_removed, "temp_removed": store.num_temp_removed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--words", type=int, default=300, help="words per round's prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kill-window", type=float, default=1.5,
                    help="kill at a random time in [0, this] seconds after sending")
    ap.add_argument("--random-times", dest="target_writes", action="store_false",
                    help="kill at random times only, not when a page write is seen")
    args, model = parse_with_model(ap)
    rng = random.Random(args.seed)
    rounds = [prompt(args.seed, r, args.words) for r in range(args.kills)]
    started = time.monotonic()
    group_args = dict(slots=1, ctx=16384, entry=DRILL_SERVE)

    # 1. Fault-free reference.
    with ServerGroup(model, **group_args) as group, httpx.Client(timeout=300) as http:
        mid = model_id(group)
        reference = [ask_until_ok(http, group, mid, m, args.max_tokens) for m in rounds]
    assert all(r["status"] == 200 for r in reference), "the reference run failed"
    print(f"reference: {len(reference)} replies in {time.monotonic() - started:.0f}s",
          flush=True)

    # 2. The drill.
    kv_dir = short_tmp_dir("sykvdrill")
    drill_started = time.monotonic()
    during, temps_after_kill, kills, mid_write = [], 0, 0, 0
    try:
        with ServerGroup(model, kv_dir=kv_dir, **group_args) as group, \
                httpx.Client(timeout=300) as http:
            mid = model_id(group)
            for r, messages in enumerate(rounds):
                result: dict = {}
                sender = threading.Thread(
                    target=lambda: result.update(ask(http, group, mid, messages,
                                                     args.max_tokens)))
                sender.start()
                # Kill the moment a page is being written (a temp file exists), or at a
                # random time if none is seen within the window.
                until = time.monotonic() + rng.uniform(0.0, args.kill_window)
                seen = False
                while args.target_writes and (sender.is_alive() or time.monotonic() < until):
                    if temp_files(kv_dir):
                        seen = True
                        break
                    time.sleep(0.001)
                time.sleep(max(0.0, until - time.monotonic()) if not seen else 0.0)
                old = group.kill("kvstore")
                kills += 1
                mid_write += seen
                temps_after_kill += len(temp_files(kv_dir))
                sender.join()
                during.append(result)
                new = group.wait_restarted("kvstore", old)
                wait_ready(group, "kvstore", new)
                if (r + 1) % 10 == 0:
                    print(f"  {r + 1} kills, {time.monotonic() - drill_started:.0f}s",
                          flush=True)
            corrupt_logged = group.log_events("kv.corrupt_page")
        drill_s = time.monotonic() - drill_started

        # 3. Every page on disk verifies.
        verified = verify_pages(kv_dir)

        # 4. Every restore is bit-identical to the reference.
        with ServerGroup(model, kv_dir=kv_dir, **group_args) as group, \
                httpx.Client(timeout=300) as http:
            mid = model_id(group)
            restored = [ask_until_ok(http, group, mid, m, args.max_tokens) for m in rounds]
            corrupt_at_restore = group.log_events("kv.corrupt_page")
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)

    judge = GreedyJudge(model)

    def differs(messages, got: dict, ref: dict) -> bool:
        """A reply other than the reference's, unless both are greedy up to a float tie
        (bench/greedy_ties.py: a restore and a prefill sum in different orders)."""
        if got.get("text") == ref["text"]:
            return False
        return not judge.tie(messages, ref["prompt"], (got.get("text") or "", ref["text"]),
                             args.max_tokens)

    wrong_during = sum(1 for m, d, ref in zip(rounds, during, reference)
                       if d.get("status") == 200 and differs(m, d, ref))
    failed_during = [d for d in during if d.get("status") != 200]
    wrong = [r for r, (m, got, ref) in enumerate(zip(rounds, restored, reference))
             if differs(m, got, ref)]
    full_pages = [ref["prompt"] // PAGE * PAGE for ref in reference]
    whole = sum(1 for got, n in zip(restored, full_pages) if got.get("cached", 0) >= n)
    partial = sum(1 for got, n in zip(restored, full_pages) if 0 < got.get("cached", 0) < n)
    none = sum(1 for got in restored if got.get("cached", 0) == 0)
    restored_tokens = sum(got.get("cached", 0) for got in restored)
    rows = [
        ["kvstore kill -9s done", kills],
        ["requests during the kills: ok / failed", f"{len(during) - len(failed_during)} / "
                                                   f"{len(failed_during)}"],
        ["  failures", ", ".join(sorted({str(d.get('status') or d.get('error'))
                                         for d in failed_during})) or "-"],
        ["kills while a page file was being written", mid_write],
        ["temp files left right after the kills (torn writes)", temps_after_kill],
        ["pages removed as bad by the daemon (kv.corrupt_page)", len(corrupt_logged)],
        ["pages on disk after the drill", verified["pages"]],
        ["  bytes", verified["bytes"]],
        ["  removed at the final scan: bad / temp", f"{verified['corrupt_removed']} / "
                                                   f"{verified['temp_removed']}"],
        ["  failing read-back verification", verified["unreadable"]],
        ["restores: all full pages / partly / none", f"{whole} / {partial} / {none}"],
        ["  tokens restored from disk", restored_tokens],
        ["  bad pages met at restore (kv.corrupt_page)", len(corrupt_at_restore)],
        ["replies during the kills != reference", wrong_during],
        ["corrupt pages served: restored replies != reference", len(wrong)],
        ["drill wall time (s)", round(drill_s, 1)],
        ["total wall time (s)", round(time.monotonic() - started, 1)],
    ]
    print(table(["crash drill", "value"], rows))
    ok = (not wrong and wrong_during == 0 and verified["unreadable"] == 0
          and verified["corrupt_removed"] == 0 and not corrupt_at_restore)
    if wrong:
        print(f"rounds whose restored reply differs: {wrong[:20]}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
