"""Many agents at once, no agent starves while the others keep working.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/multi_agent.py [--agents 8] [--turns 6] [--slots 4]
        [--model-size tiny|h512] [--no-peer]

Workload: `--agents` tool loops run concurrently, `--turns` turns each. Every agent shares one
`--system`-token system prompt (about 1.5K tokens) and has its own task line; each turn
appends an assistant message (a fixed line standing for a tool call, so both servers see the
same bytes whatever they generate) and a tool result of about `--tool` tokens (agent by
agent a few tokens longer, `--spread` in all: near-equal turns), then resends
the whole history: chat completions, streamed, greedy, `--reply`-token replies. An agent sends
its next turn as soon as its previous reply ends.

The same requests go to Switchyard (`--slots`) and then to mlx_lm.server (same model
directory, default settings), one after the other in the same run. Reported per server: wall
time of the whole workload, TTFT p50 / p95 / max over all turns (the agent and turn of the
max), and tokens re-read: for every turn after the first, prompt - cached - new, where new is
the growth of the prompt since that agent's previous turn (what a perfect cache would still
have to read). Switchyard's `request.finished` lines split the slowest turn's TTFT into queue,
restore, prefill wait and prefill time.

Targets: Switchyard's TTFT max <= 2x its p95; its max and p95 <= mlx_lm.server's.
Every figure is measured in one run on a shared machine: compare, do not quote absolutes.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (MlxLmServer, Streamed, fmt, load_tokenizer, log_events,  # noqa: E402
                           make_text, model_dir, preload_note, stream, table,
                           word_list)
from switchyard.testing.group import ServerGroup  # noqa: E402

CHAT = "/v1/chat/completions"


@dataclass
class Agent:
    index: int
    system: str
    task: str
    tools: list[str]  # the tool result of each turn

    def messages(self, turn: int) -> list[dict]:
        msgs = [{"role": "system", "content": self.system},
                {"role": "user", "content": self.task}]
        for j in range(turn):
            msgs.append({"role": "assistant",
                         "content": f"Step {j}: calling run_tool on item {j}."})
            msgs.append({"role": "tool", "content": self.tools[j]})
        return msgs


@dataclass
class Turn:
    agent: int
    turn: int
    res: Streamed

    @property
    def prompt(self) -> int:
        return (self.res.usage or {}).get("prompt_tokens", 0)

    @property
    def cached(self) -> int:
        return ((self.res.usage or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0) or 0


def build(args, model: Path, tok=None) -> list[Agent]:
    """`tok`: a `tokenizers` tokenizer (default: the model directory's tokenizer.json)."""
    tok = tok or load_tokenizer(model)
    words = word_list()
    rng = random.Random(args.seed)
    system = "You are a coding agent with tools. " + make_text(rng, tok, args.system, words)
    agents = []
    for i in range(args.agents):
        task = f"Agent {i}: work through the files of project {i}, one tool call per step."
        # Agent i's tool results are a few tokens longer than agent i-1's (`--spread` from
        # the first to the last): near-equal turns, as for the agent that starved before aging.
        size = args.tool - args.spread // 2 + round(i * args.spread / max(1, args.agents - 1))
        tools = [make_text(rng, tok, size, words) for _ in range(args.turns)]
        agents.append(Agent(i, system, task, tools))
    return agents


def run_workload(url: str, agents: list[Agent], args, log, model: str | None = None,
                 headers: dict | None = None) -> tuple[list[Turn], float]:
    """Every agent's turns; `model`: the name to ask for (a router routes by it); `headers`:
    sent with every request (a key)."""
    turns: list[Turn] = []
    lock = threading.Lock()
    errors: list[str] = []

    def loop(agent: Agent) -> None:
        for t in range(args.turns):
            body = {"messages": agent.messages(t), "max_tokens": args.reply, "temperature": 0,
                    **({"model": model} if model else {})}
            res = stream(url, CHAT, body, headers)
            if res.error:
                errors.append(f"agent {agent.index} turn {t}: {res.error}")
                return
            with lock:
                turns.append(Turn(agent.index, t, res))
            log(f"    agent {agent.index} turn {t}: ttft {res.ttft:6.2f}s")

    threads = [threading.Thread(target=loop, args=(a,)) for a in agents]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    return turns, wall


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def reread(turns: list[Turn]) -> tuple[int, int]:
    """Tokens re-read beyond each turn's new tokens (turns after the first); tokens prefilled."""
    by_key = {(t.agent, t.turn): t for t in turns}
    extra = prefilled = 0
    for t in turns:
        prefilled += t.prompt - t.cached
        prev = by_key.get((t.agent, t.turn - 1))
        if prev is not None:
            new = t.prompt - prev.prompt
            extra += max(0, t.prompt - t.cached - new)
    return extra, prefilled


def summarize(name: str, turns: list[Turn], wall: float) -> tuple[list, dict]:
    ttfts = [t.res.ttft for t in turns]
    worst = max(turns, key=lambda t: t.res.ttft)
    extra, prefilled = reread(turns)
    fig = dict(wall=wall, p50=percentile(ttfts, 0.5), p95=percentile(ttfts, 0.95),
               max=worst.res.ttft, worst=worst, reread=extra, prefilled=prefilled)
    row = [name, len(turns), fmt(wall, 1), fmt(fig["p50"], 2), fmt(fig["p95"], 2),
           fmt(fig["max"], 2), f"agent {worst.agent} turn {worst.turn}",
           fmt(fig["max"] / fig["p95"], 2), extra, prefilled]
    return row, fig


def breakdown(group: ServerGroup, rid: str | None) -> str:
    for e in log_events(group.log_path, "request.finished"):
        if e.get("role") == "scheduler" and e.get("rid") == rid:
            keys = ("queue_s", "restore_s", "prefill_wait_s", "prefill_s", "ttft_s")
            parts = [f"{k} {fmt(e[k], 2)}" for k in keys if e.get(k) is not None]
            return (", ".join(parts) + f"; prompt {e['num_prompt_tokens']}, cached "
                    f"{e['num_cached_tokens']}, prefilled {e['num_prefilled_tokens']}")
    return "(no request.finished line)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("tiny", "h512"), default="tiny")
    ap.add_argument("--model", help="model directory (overrides --model-size)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--system", type=int, default=1500, help="shared system prompt tokens")
    ap.add_argument("--tool", type=int, default=400, help="tool-result tokens per turn")
    ap.add_argument("--spread", type=int, default=8,
                    help="tokens between the shortest and the longest agent's tool results")
    ap.add_argument("--reply", type=int, default=32, help="reply tokens (max_tokens)")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--extra", default="", help="more switchyard serve flags, space-separated")
    ap.add_argument("--keep-log", metavar="DIR", help="copy the group log here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-turn lines")
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    model = model_dir(args.model_size, args.model)
    agents = build(args, model)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    print(f"model {model}; {args.agents} agents x {args.turns} turns, shared ~{args.system}-"
          f"token system prompt, +~{args.tool} tokens per turn, {args.reply}-token replies; "
          f"switchyard --slots {args.slots}", flush=True)
    rows, figs = [], {}
    extra = ["--page-size", "256", "--kv-disk-budget", "2GiB", *args.extra.split()]
    print("\n== switchyard", flush=True)
    with ServerGroup(model, slots=args.slots, ctx=args.ctx, extra=extra) as group:
        turns, wall = run_workload(group.url, agents, args, log)
        row, figs["switchyard"] = summarize(f"switchyard --slots {args.slots}", turns, wall)
        rows.append(row)
        slowest = breakdown(group, figs["switchyard"]["worst"].res.rid)
        if args.keep_log:
            Path(args.keep_log).mkdir(parents=True, exist_ok=True)
            shutil.copy(group.log_path, Path(args.keep_log) / "multi_agent.log")
    if not args.no_peer:
        print("\n== mlx_lm.server", flush=True)
        with MlxLmServer(model) as peer:
            turns, wall = run_workload(peer.url, agents, args, log)
            row, figs["mlx_lm"] = summarize("mlx_lm.server", turns, wall)
            rows.append(row)
    print("\nTTFT over all turns (s); re-read: tokens prefilled beyond each turn's new tokens "
          "(turns after the first); prefilled: prompt - cached, all turns")
    print(table(["server", "turns", "wall s", "p50", "p95", "max", "slowest", "max/p95",
                 "re-read", "prefilled"], rows))
    ours = figs["switchyard"]
    print(f"switchyard's slowest turn: {slowest}")
    print(f"max <= 2x p95: {'met' if ours['max'] <= 2 * ours['p95'] else 'MISSED'} "
          f"({fmt(ours['max'] / ours['p95'], 2)})")
    theirs = figs.get("mlx_lm")
    if theirs:
        print(f"vs mlx_lm.server: max {fmt(ours['max'], 2)} / {fmt(theirs['max'], 2)} = "
              f"{fmt(ours['max'] / theirs['max'], 2)}, p95 {fmt(ours['p95'], 2)} / "
              f"{fmt(theirs['p95'], 2)} = {fmt(ours['p95'] / theirs['p95'], 2)}, wall "
              f"{fmt(ours['wall'], 1)} / {fmt(theirs['wall'], 1)} = "
              f"{fmt(ours['wall'] / theirs['wall'], 2)} (targets: max and p95 <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
