"""The worker's memory plan against its peak resident memory with every slot at full context.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/memory_plan.py [--slots 4] [--ctx 8192]

Fills every slot to (almost) its full context concurrently, decodes in one batch, and reads
the worker's peak RSS (VmHWM in /proc) against what the plan counts for it: the fixed part the
worker logged at start (`worker.memory_plan`) plus the KV those slots hold as the scheduler
counts it (common/held_kv.py: capacity, reserves and the decode batch; docs/design.md "Memory
plan"). Target: the count is not below the peak, and within 10% of it. Linux only (reads
/proc).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from switchyard.common.held_kv import CACHE_STEP, SlotHold, held_tokens  # noqa: E402
from switchyard.common.settings import format_size  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def fill(group: ServerGroup, slot: int, ctx: int) -> int:
    rng = random.Random(slot)
    prompt = [rng.randrange(100, 4000) for _ in range(ctx - 64)]
    resp = httpx.post(f"{group.base_url}/completions", timeout=900,
                      json={"prompt": prompt, "max_tokens": 32, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["usage"]["prompt_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    from fixtures.tiny_models import generate_tiny_model

    model = generate_tiny_model(Path(tempfile.mkdtemp(prefix="symem")) / "m", "qwen3")
    with ServerGroup(model, slots=args.slots, ctx=args.ctx) as group:
        worker = group.pid_of("worker")
        before = peak_rss(worker)
        with concurrent.futures.ThreadPoolExecutor(args.slots) as pool:
            list(pool.map(lambda s: fill(group, s, args.ctx), range(args.slots)))
        peak = peak_rss(worker)
        [plan] = group.log_events("worker.memory_plan")
    held = held_tokens([SlotHold(args.ctx - 64 + 32, CACHE_STEP, running=True)] * args.slots,
                       args.ctx)
    counted = plan["fixed"] + held * plan["kv_bytes_per_token"]
    print(f"plan at start: fixed {format_size(plan['fixed'])} "
          + ", ".join(f"{k} {format_size(v)}" for k, v in plan.items()
                      if k in ("runtime", "weights", "activations", "page_buffers",
                               "recurrent", "kv_budget")))
    print(f"held KV as counted: {held:,} tokens = {format_size(held * plan['kv_bytes_per_token'])}"
          f"; with the fixed part {format_size(counted)}")
    print(f"worker peak RSS: {format_size(peak)} (after start: {format_size(before)})")
    print(f"peak / counted = {peak / counted:.3f}  (target: at most 1, at least 0.9)")


if __name__ == "__main__":
    main()
