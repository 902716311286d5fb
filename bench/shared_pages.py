"""Idle sub-agents shelved as shared pages: the memory they hold, and what using one costs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/shared_pages.py [--agents 8] [--shared 8192] [--own 1024]

In-process on the worker's own slot store (worker/slots.py, worker/shared_pages.py), on the
trained model (SmolLM2-135M-Instruct, `--model default`) or the tiny twin (`--model tiny`):
`--agents` slots hold one `--shared`-token prefix and `--own` tokens each, as sub-agents
between turns do (docs/design/kv-pages.md "Shared pages in memory"). Reported, as ratios in
this one run:
- the KV memory the idle slots hold shelved, against whole (mlx's active memory);
- making one shelved slot whole (what its next turn pays first), against restoring the same
  tokens from page buffers into an empty slot (worker/page_io.py `load`: what the turn pays
  when the slot went to disk instead) and against prefilling them (what it pays when the slot
  went and nothing was on disk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import model_dir, preload_note  # noqa: E402
from switchyard.worker.model_loading import load_model  # noqa: E402
from switchyard.worker.page_io import PageLayout  # noqa: E402
from switchyard.worker.slots import SlotStore  # noqa: E402

PAGE = 256


def prefill(store: SlotStore, slot: int, tokens: list[int], chunk: int = 2048) -> None:
    for s in range(0, len(tokens), chunk):
        store.prefill(slot, s, tokens[s:s + chunk])


def timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--shared", type=int, default=8192)
    ap.add_argument("--own", type=int, default=1024)
    ap.add_argument("--model", default="default", help="default | tiny | a path")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    preload_note()
    if args.model == "default":
        from switchyard.deploy.default_model import default_model_path
        path = default_model_path()
    else:
        path = model_dir("tiny") if args.model == "tiny" else Path(args.model)
    loaded = load_model(str(path))
    n = args.agents
    store = SlotStore(loaded.model, loaded.make_cache, n + 1, args.shared + args.own + 64)
    assert store.share_pages(PAGE), "this model's caches are not per-token attention KV"
    probe = _probe(loaded)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    rng = np.random.default_rng(0)
    vocab = 4000
    prefix = [int(t) for t in rng.integers(10, vocab, args.shared)]
    prompts = [prefix + [int(t) for t in rng.integers(10, vocab, args.own)] for _ in range(n)]
    prefill(store, 0, prompts[0])
    for s in range(1, n):  # siblings copy the prefix, as the scheduler places them
        store.copy_prefix(0, s, args.shared)
        prefill_rest = prompts[s][args.shared:]
        store.prefill(s, args.shared, prefill_rest)
    mx.synchronize()
    mx.clear_cache()
    whole = mx.get_active_memory()
    for s in range(n):
        store.shelve(s)
    mx.synchronize()
    mx.clear_cache()
    shelved = mx.get_active_memory()
    layout = PageLayout(probe, PAGE)

    # One agent's turn: make it whole / restore its tokens from page buffers / prefill them.
    ctx = len(prompts[0])
    buffers = [np.zeros(layout.buffer_bytes, np.uint8) for _ in range(-(-ctx // PAGE))]
    for k, buf in enumerate(buffers):
        layout.stage(store.stage_source(1), k * PAGE, buf, with_state=False,
                     num_tokens=min(PAGE, ctx - k * PAGE) if (k + 1) * PAGE > ctx else 0)
    make_whole, restore, reread = [], [], []
    for r in range(args.rounds):
        slot = 1 + r % (n - 1)
        make_whole.append(timed(lambda: store.truncate(slot, ctx - 1)))  # a turn's first step
        store.shelve(slot)

        def load():
            cache = store.loaded(n, 0, prompts[1])
            layout.load(cache, 0, buffers, with_state=False, num_tokens=ctx)
        restore.append(timed(load))
        store.release(n)
        reread.append(timed(lambda: prefill(store, n, prompts[1])))
        store.release(n)
    mw, rs, rr = (statistics.median(x) for x in (make_whole, restore, reread))
    kv_whole, kv_shelved = whole - base, shelved - base
    print(f"{n} agents, {args.shared:,} shared + {args.own:,} own tokens each, {path.name}")
    print(f"KV held by the idle agents: whole {kv_whole / 2**20:,.0f} MiB, shelved "
          f"{kv_shelved / 2**20:,.0f} MiB: {kv_shelved / kv_whole:.2f}x "
          f"(distinct tokens over all tokens: "
          f"{(args.shared + n * args.own) / (n * (args.shared + args.own)):.2f})")
    print(f"one agent's turn, {ctx:,} tokens: making it whole is {mw / rs:.2f}x a restore "
          f"from page buffers and {mw / rr:.3f}x re-reading them (median of {args.rounds})")


def _probe(loaded) -> list:
    probe = loaded.make_cache()
    loaded.model(mx.array([[1]]), cache=probe)
    mx.eval([c.state for c in probe])
    return probe


if __name__ == "__main__":
    main()
