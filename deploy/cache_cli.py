"""`switchyard cache plan` and `switchyard cache stats`: size the disk budget, see what is on disk.

    switchyard cache plan --model M --conversations 6 --tokens 100000 [--kv-bits 8]
    switchyard cache stats [--kv-dir DIR] [--json]     (a worker group: a line per rank-R dir)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

from switchyard.deploy.default_model import DefaultModelUnavailable, model_for
from switchyard.common.settings import Settings, format_size

_HEADER_BYTES = 4096  # page header allowance, as the scheduler budgets it


def add_cache_parser(sub) -> None:
    cache = sub.add_parser("cache", help="size the KV disk budget; inspect the page store")
    actions = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    plan = actions.add_parser("plan", help="disk budget for K conversations of L tokens")
    plan.add_argument("--model", default="", help="model to size for (default: the default model, "
                      "as `serve`; `tiny`: the generated one)")
    plan.add_argument("--conversations", type=int, required=True)
    plan.add_argument("--tokens", type=int, required=True, help="tokens per conversation")
    plan.add_argument("--page-size", type=int, default=Settings.page_size)
    plan.add_argument("--state-interval", type=int, default=Settings.state_interval)
    plan.add_argument("--kv-bits", type=int, default=Settings.kv_bits, choices=(0, 4, 8),
                      help="size for quantized KV pages, as `serve --kv-bits` (0: none)")
    plan.add_argument("--kv-group-size", type=int, default=Settings.kv_group_size,
                      choices=(32, 64, 128))
    stats = actions.add_parser("stats", help="pages, bytes, namespaces and use on disk")
    stats.add_argument("--kv-dir", default="", help="page directory (default: the user cache)")
    stats.add_argument("--json", action="store_true")


def run_cache(args: argparse.Namespace) -> int:
    if args.cache_command == "plan":
        return _plan(args)
    return _stats(args)


# --- plan --------------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    from switchyard.scheduler.eviction import plan_budget, round_up_gib
    from switchyard.worker.errors import ModelLoadError
    from switchyard.worker.model_loading import load_model
    from switchyard.worker.kv_layout import kv_quant

    if args.conversations < 1 or args.tokens < 1:
        print("switchyard cache plan: --conversations and --tokens must be at least 1")
        return 2
    try:
        ref = model_for(args.model, announce=lambda message: print(f"switchyard: {message}"))
    except DefaultModelUnavailable as exc:
        print(f"switchyard cache plan: no default model: {exc}; give --model")
        return 2
    try:
        loaded = load_model(ref, kv_quant(args.kv_bits, args.kv_group_size))
    except ModelLoadError as exc:
        print(f"switchyard cache plan: {exc}")
        return 2
    bpt = loaded.kv_bytes_per_token
    overhead = _HEADER_BYTES
    snapshots = 0
    if loaded.has_recurrent_state:
        state = _state_bytes(loaded)
        # A snapshot every state interval, plus one where each turn resumes.
        snapshots = math.ceil(args.tokens / args.state_interval) + 1
        overhead += state * snapshots / math.ceil(args.tokens / args.page_size)
    need = plan_budget(bpt, args.conversations, args.tokens, int(overhead), args.page_size)
    print(f"model            {ref} ({loaded.model_type})")
    bits = (f" ({args.kv_bits}-bit, groups of {loaded.kv_quant.group_size})" if args.kv_bits
            else "")
    print(f"KV per token     {bpt:,} bytes{bits}" + (
        f" + {snapshots} state snapshots per conversation" if snapshots else ""))
    print(f"one conversation {format_size(need / args.conversations)} "
          f"({args.tokens:,} tokens in pages of {args.page_size})")
    print(f"budget needed    {format_size(need)} for {args.conversations} conversations")
    print(f"suggested flag   --kv-disk-budget {round_up_gib(need) // 2**30}GiB")
    return 0


def _state_bytes(loaded) -> int:
    import mlx.core as mx

    cache = loaded.make_cache()
    loaded.model(mx.array([[0]]), cache=cache)
    return sum(c.nbytes for c in cache if not c.is_trimmable())


# --- stats -------------------------------------------------------------------------------------


def _rank_shares(root: Path, rank0: list) -> list[dict]:
    """A worker group's rank R > 0 keeps its shares in `<kv-dir>/rank-R` (docs/design.md "Pages
    per rank"): one entry per rank found, rank 0 (the directory itself) first; none without."""
    from switchyard.kvstore.store import read_entries

    dirs = sorted((int(d.name[5:]), d) for d in root.glob("rank-*")
                  if d.is_dir() and d.name[5:].isdigit() and int(d.name[5:]) > 0)
    if not dirs:
        return []
    shares = [(0, root, rank0)] + [(rank, d, read_entries(d)[0]) for rank, d in dirs]
    return [{"rank": rank, "kv_dir": str(d), "num_pages": len(entries),
             "num_bytes": sum(e.nbytes for e in entries)} for rank, d, entries in shares]


def _stats(args: argparse.Namespace) -> int:
    from switchyard.kvstore.store import read_entries

    root = Path(args.kv_dir) if args.kv_dir else Settings().kv_path
    if not root.is_dir():
        print(f"switchyard cache stats: no page directory at {root}")
        return 1
    entries, num_bad = read_entries(root)
    per_ns: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in entries:
        per_ns[e.namespace.hex()][0] += 1
        per_ns[e.namespace.hex()][1] += e.nbytes
    used = [e.last_used for e in entries]
    report = {
        "kv_dir": str(root), "num_pages": len(entries),
        "num_bytes": sum(e.nbytes for e in entries),
        "num_tokens": sum(e.num_tokens for e in entries),
        "num_state_snapshots": sum(1 for e in entries if e.flags & 1),
        "num_unreadable": num_bad,
        "namespaces": {ns: {"num_pages": n, "num_bytes": b} for ns, (n, b) in per_ns.items()},
        "oldest_use": min(used, default=None), "newest_use": max(used, default=None),
        "ranks": _rank_shares(root, entries),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"page store   {root}")
    print(f"pages        {report['num_pages']:,} ({report['num_tokens']:,} tokens, "
          f"{report['num_state_snapshots']} with recurrent state)")
    print(f"bytes        {format_size(report['num_bytes'])}")
    for ns, counts in report["namespaces"].items():
        print(f"namespace    {ns[:16]}  {counts['num_pages']:,} pages, "
              f"{format_size(counts['num_bytes'])}")
    for share in report["ranks"]:
        print(f"rank {share['rank']:<7} {share['num_pages']:,} pages, "
              f"{format_size(share['num_bytes'])} in {share['kv_dir']}")
    for label in ("oldest_use", "newest_use"):
        if report[label] is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report[label]))
            print(f"{label.replace('_', ' '):12} {when}")
    if num_bad:
        print(f"unreadable   {num_bad} files (the kvstore daemon removes them at its next scan)")
    return 0
