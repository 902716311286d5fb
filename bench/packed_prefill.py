"""Fewer forward passes per step. Packed prefill on and off.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/packed_prefill.py [--model tiny|default|PATH] [--agents 4]
        [--context 1024] [--chunks 16 48 192] [--rounds 5]

Workload, in process through the worker's own StepExecutor and SlotStore (no sockets: the
step is what changes, docs/design/scheduling.md "Packed prefill"): `--agents` slots each hold a
`--context`-token conversation; every round is one step whose prefill carries each agent's
next tool result, `--chunks` tokens give or take a few (near-equal, so they pack into one
pass), all waiting at the same step. Each chunk starts at the context's end, so the step cuts
the slots back first and every round prefills the same tokens. Then the same with context 0
(every agent's first chunk of a fresh prompt). The same steps run with --packed-prefill on and
off, two executors over one model (the weights loaded once), their order alternating per
round: the step's wall time (median over rounds; the slot cut-back inside it is noise next to
a pass), forward passes per step and tokens per pass (StepDone), and whether the greedy token
each slot decodes after the last round is the same on both sides.

`--model tiny`: the tiny qwen3 twin (float32); `default`: SmolLM2-135M-Instruct Q4_1, the
default model (fetched once), with the worker's float32 weight copies on the CPU backend
(worker/cpu_weights.py), as the worker serves it. Every figure is a ratio measured in one run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import fmt, median, model_dir, preload_note, table  # noqa: E402


def load(ref: str):
    from switchyard.deploy.default_model import default_model_path
    from switchyard.worker.cpu_weights import add_float_copies, wanted
    from switchyard.worker.model_loading import load_model

    path = {"tiny": lambda: model_dir("tiny"), "default": default_model_path}.get(
        ref, lambda: Path(ref))()
    loaded = load_model(str(path))
    if wanted():
        add_float_copies(loaded.model)
    return loaded, path


def executors(loaded, agents: int, ctx: int):
    from switchyard.worker.executor import StepExecutor
    from switchyard.worker.slots import SlotStore

    return {packed: StepExecutor(SlotStore(loaded.model, loaded.make_cache, agents, ctx), None,
                                 None, packed_prefill=packed)
            for packed in (True, False)}


def run(loaded, args, context: int, chunk: int, rng: random.Random) -> list:
    from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
    from switchyard.proto.values import SamplingParams

    vocab = loaded.model.args.vocab_size if hasattr(loaded.model, "args") else 4000
    ids = lambda n: tuple(rng.randrange(300, min(vocab, 40000)) for _ in range(n))  # noqa: E731
    histories = [ids(context) for _ in range(args.agents)]
    # Near-equal tool results: within MAX_PADDING of the longest, so one group.
    results = [ids(chunk - rng.randrange(0, max(1, chunk // 8))) for _ in range(args.agents)]
    sides = executors(loaded, args.agents, context + chunk + 8)
    for ex in sides.values():
        if context:
            for s, h in enumerate(histories):
                ex.run(RunStep(0, prefills=(PrefillChunk(s, 0, h),)))
    step = [PrefillChunk(s, context, r) for s, r in enumerate(results)]
    seconds = {True: [], False: []}
    done = {}
    for i in range(args.rounds + 1):  # the first round warms up, unmeasured
        for packed in ((True, False) if i % 2 else (False, True)):
            started = time.perf_counter()
            done[packed] = sides[packed].run(RunStep(1 + i, prefills=tuple(step)))
            if i:
                seconds[packed].append(time.perf_counter() - started)
    tokens = {}
    for packed, ex in sides.items():
        items = tuple(DecodeItem(s, context + len(r), r[-1], SamplingParams(), 0)
                      for s, r in enumerate(results))
        tokens[packed] = [t.token_id for t in ex.run(RunStep(99, decodes=items)).sampled]
    on, off = median(seconds[True]), median(seconds[False])
    return [context, f"{chunk}±{chunk // 8}", fmt(on * 1e3, 1), fmt(off * 1e3, 1), fmt(on / off),
            f"{done[True].num_forward_passes}/{done[False].num_forward_passes}",
            f"{done[True].tokens_per_pass}/{done[False].tokens_per_pass}",
            "yes" if tokens[True] == tokens[False] else "NO"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, default or a model path")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 48, 192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    if note := preload_note():
        print(note, file=sys.stderr)
    from switchyard.worker.cpu_weights import weight_bytes_read
    from switchyard.worker.prefill_packing import context_per_weight_read

    loaded, path = load(args.model)
    rng = random.Random(args.seed)
    rows = []
    for context in (args.context, 0):
        for chunk in args.chunks:
            rows.append(run(loaded, args, context, chunk, rng))
            print(f"context {context}, chunk {chunk}: on/off {rows[-1][4]}", file=sys.stderr,
                  flush=True)
    print(f"{path.name}: {args.agents} agents, one step of {args.agents} prefill chunks, "
          f"median of {args.rounds} rounds; weights read per pass "
          f"{weight_bytes_read(loaded.model) / 1e6:.0f} MB, KV "
          f"{loaded.kv_bytes_per_token / 1e3:.1f} KB per token: packed rows may hold "
          f"{context_per_weight_read(weight_bytes_read(loaded.model), loaded.kv_bytes_per_token)}"
          f" tokens of context per read saved")
    print(table(["context", "chunk", "on ms", "off ms", "on/off", "passes on/off",
                 "tok/pass on/off", "same tokens"], rows))


if __name__ == "__main__":
    main()
