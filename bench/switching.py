"""A conversation that comes back after others pays only for its new tokens.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/switching.py [--model-size tiny|h512] [--slots 1,2] [--rounds 4]
        [--arch gpt_oss gemma3_text ...]   # one summary line per family at the end

Workload (chat completions, streamed, temperature 0, 8-token replies): three conversations
A, B, C, each a system prompt + task of about `--initial` tokens, take turns A, B, C, A, ...
Every turn appends an assistant message (a fixed line standing for a tool call) and a tool
result of about `--new` tokens (the model's replies are not carried into the history, so both
servers see the same prompts whatever they generate). Round 0 is each conversation's cold
start; rounds 1..R are *switching turns*: with `--slots 1` the slot holds another
conversation, so the prefix must come back from disk pages.

Right after each switching turn comes its *resident twin*: the same history with a different
tool result of the same length, sent to the same server. Its prefix is resident (same slot),
so its TTFT is the cost of prefilling just the new tokens at the same context length: the
denominator of the per-turn ratio `switch TTFT / twin TTFT` (target: median <= 1.3).

With the first `--slots` value, mlx_lm.server (same model directory, default prompt-cache
settings) runs side by side and gets the same requests, alternating which server goes first;
reported: median switching TTFT of Switchyard / mlx_lm.server. The scheduler's
`request.finished` log lines give tokens restored vs prefilled per switching turn and
`restore_s`; restore throughput (bytes restored / restore_s) is compared with a plain
sequential Python read of every `.page` file in the KV dir (page cache warm) and `cat`.

The summary also gives, per Switchyard configuration, two figures that explain the ratio and
are free of machine noise: prefilled tokens of the switching turn / of its twin (the switching
turn re-reads the conversation's last, partial page: docs/design/kv-pages.md "KV pages"), and restore_s as a
share of the switching turn's TTFT. For families whose slot cannot be cut back (sliding-window
rings, recurrent states) the twin is restored too; the last column divides by the twin's TTFT
minus its restore_s, standing for a resident twin.

TTFT is the time from sending to the first streamed chunk with content (or the finish chunk
if the reply is empty). Every figure is a ratio within one run; the machine is shared.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (MlxLmServer, Streamed, fmt, load_tokenizer, log_events,  # noqa: E402
                           make_text, median, model_dir, preload_note, stream, table,
                           word_list)
from switchyard.testing.group import ServerGroup  # noqa: E402

CHAT = "/v1/chat/completions"
NAMES = "ABCDEFGH"


@dataclass
class Conversation:
    name: str
    base: list[dict]
    tools: list[str]  # the tool result of each round
    twins: list[str]  # the twin's tool result of each round

    def messages(self, rnd: int, twin: bool = False) -> list[dict]:
        msgs = list(self.base)
        for j in range(rnd + 1):
            last = twin and j == rnd
            # The twin diverges from the first token after the previous prompt, as the
            # switching turn does, so both have the same number of new tokens.
            word = "Retry" if last else "Step"
            msgs.append({"role": "assistant",
                         "content": f"{word} {j}: calling read_file on part {j}."})
            msgs.append({"role": "tool", "content": (self.twins if last else self.tools)[j]})
        return msgs


def build(num_conv: int, initial: int, new: int, rounds: int, model: Path,
          seed: int) -> list[Conversation]:
    tok = load_tokenizer(model)
    words = word_list()
    rng = random.Random(seed)
    convs = []
    for i in range(num_conv):
        name = NAMES[i]
        system = f"You are agent {name}. " + make_text(rng, tok, initial - 40, words)
        base = [{"role": "system", "content": system},
                {"role": "user", "content": f"Work through the files of project {name}."}]
        tools = [make_text(rng, tok, new, words) for _ in range(rounds + 1)]
        twins = [make_text(rng, tok, new, words) for _ in range(rounds + 1)]
        convs.append(Conversation(name, base, tools, twins))
    return convs


@dataclass
class Turn:
    server: str
    conv: str
    rnd: int
    kind: str  # cold, switch, twin
    res: Streamed

    @property
    def rid(self) -> str | None:
        return self.res.rid


def send(server: str, url: str, conv: Conversation, rnd: int, kind: str,
         max_tokens: int) -> Turn:
    body = {"messages": conv.messages(rnd, twin=kind == "twin"), "max_tokens": max_tokens,
            "temperature": 0}
    res = stream(url, CHAT, body)
    if res.error:
        raise RuntimeError(f"{server} {conv.name} round {rnd} {kind}: {res.error}")
    return Turn(server, conv.name, rnd, kind, res)


def run_workload(servers: dict[str, str], convs: list[Conversation], rounds: int,
                 max_tokens: int, log) -> list[Turn]:
    turns = []
    flip = False
    for rnd in range(rounds + 1):
        for conv in convs:
            kinds = ["cold"] if rnd == 0 else ["switch", "twin"]
            for kind in kinds:
                order = list(servers.items())
                if flip:
                    order.reverse()
                flip = not flip
                for name, url in order:
                    t = send(name, url, conv, rnd, kind, max_tokens)
                    turns.append(t)
                    log(f"  {name:10s} {conv.name} r{rnd} {kind:6s} ttft {t.res.ttft:6.3f}s "
                        f"cached {cached(t)}/{prompt_tokens(t)}")
    return turns


def cached(t: Turn) -> int | str:
    u = t.res.usage or {}
    return (u.get("prompt_tokens_details") or {}).get("cached_tokens", "?")


def prompt_tokens(t: Turn) -> int | str:
    return (t.res.usage or {}).get("prompt_tokens", "?")


def pair_ratios(turns: list[Turn], server: str) -> list[float]:
    by_key = {(t.conv, t.rnd, t.kind): t for t in turns if t.server == server}
    ratios = []
    for (conv, rnd, kind), t in by_key.items():
        if kind == "switch" and (conv, rnd, "twin") in by_key:
            ratios.append(t.res.ttft / by_key[(conv, rnd, "twin")].res.ttft)
    return ratios


def ttfts(turns: list[Turn], server: str, kind: str) -> list[float]:
    return [t.res.ttft for t in turns if t.server == server and t.kind == kind]


def seq_read(kv_dir: Path) -> tuple[int, float, float]:
    """Bytes of all page files, a Python sequential read's seconds, `cat`'s seconds."""
    files = sorted(kv_dir.rglob("*.page"))
    total = 0
    for f in files:  # warm the page cache first: the server just wrote or read them
        total += len(f.read_bytes())
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 20):
                pass
    py_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *map(str, files[i:i + 500])], stdout=subprocess.DEVNULL,
                       check=True)
    cat_s = time.perf_counter() - t0
    return total, py_s, cat_s


def summarize_switchyard(group: ServerGroup, turns: list[Turn], label: str,
                         page_size: int) -> tuple[list[str], dict]:
    """Per-turn table from the scheduler's log lines, and the figures of the summary."""
    events = log_events(group.log_path, "request.finished")
    sched = {e["rid"]: e for e in events if e.get("role") == "scheduler"}
    started = log_events(group.log_path, "worker.started")
    bpt = started[-1]["kv_bytes_per_token"] if started else 0
    rows, rates, by_key = [], [], {}
    for t in turns:
        if t.server != "switchyard" or t.kind == "cold":
            continue
        e = sched.get(t.rid or "")
        if e is None:
            continue
        by_key[(t.conv, t.rnd, t.kind)] = e
        restored, restore_s = e["num_restored_tokens"], e["restore_s"]
        rate = restored * bpt / restore_s / 1e6 if restore_s > 0 and restored else float("nan")
        if t.kind == "switch":
            rates.append(rate)
        rows.append([f"{t.conv} r{t.rnd}", t.kind, e["num_prompt_tokens"],
                     e["num_reused_tokens"], e["num_copied_tokens"], restored,
                     e["num_prefilled_tokens"], fmt(restore_s, 3), fmt(rate, 0),
                     fmt(e["ttft_s"] or float("nan"), 3), fmt(t.res.ttft, 3)])
    token_ratios, restore_shares, unrestored = [], [], []
    for (conv, rnd, kind), e in by_key.items():
        twin = by_key.get((conv, rnd, "twin"))
        if kind == "switch" and twin is not None:
            token_ratios.append(e["num_prefilled_tokens"] / twin["num_prefilled_tokens"])
            restore_shares.append(e["restore_s"] / e["ttft_s"])
            # A ring or recurrent state cannot be cut back, so there the twin is restored
            # too: its TTFT without its restore stands for a resident twin.
            unrestored.append(e["ttft_s"] / (twin["ttft_s"] - twin["restore_s"]))
    reads = [r for r in log_events(group.log_path, "kv.read") if r.get("read_s")]
    read_mbs = [r["num_pages"] * page_size * bpt / r["read_s"] / 1e6 for r in reads]
    total, py_s, cat_s = seq_read(group.kv_dir)
    figures = dict(token_ratio=median(token_ratios), restore_share=median(restore_shares),
                   unrestored_ratio=median(unrestored),
                   restore_mbs=median(rates), kv_read_mbs=median(read_mbs),
                   py_mbs=total / py_s / 1e6, cat_mbs=total / cat_s / 1e6)
    out = [f"\n[{label}] per turn, from the scheduler's request.finished lines "
           f"(kv_bytes_per_token={bpt})",
           table(["turn", "kind", "prompt", "reused", "copied", "restored", "prefilled",
                  "restore_s", "MB/s", "sched ttft", "http ttft"], rows),
           f"restore (bytes restored / restore_s, switching turns, median): "
           f"{fmt(figures['restore_mbs'], 0)} MB/s; of which kvstore's verified page reads "
           f"(kv.read lines, median): {fmt(figures['kv_read_mbs'], 0)} MB/s; plain sequential "
           f"read of all {total / 1e6:.0f} MB of .page files (page cache warm): python "
           f"{fmt(figures['py_mbs'], 0)} MB/s, cat {fmt(figures['cat_mbs'], 0)} MB/s"]
    return out, figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("tiny", "h512"), default="tiny")
    ap.add_argument("--model", help="model directory (overrides --model-size)")
    ap.add_argument("--arch", nargs="+", default=["qwen3"],
                    help="families to generate tiny twins of (with --model-size)")
    ap.add_argument("--slots", default="1,2", help="comma-separated --slots values to run")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--initial", type=int, default=3000, help="system+task tokens")
    ap.add_argument("--new", type=int, default=1000, help="tool-result tokens per turn")
    ap.add_argument("--rounds", type=int, default=4, help="switching rounds after the cold one")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-log", metavar="DIR", help="copy each group log here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-request lines")
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    families = []
    for arch in ([None] if args.model else args.arch):
        model = model_dir(args.model_size, args.model, arch or "qwen3")
        rows = bench_model(model, args)
        families += [[arch or str(model), *row] for row in rows]
    if len(families) > 1:
        print("\nper family: switching turn TTFT / resident twin")
        print(table(["family", "server", "turns", "switch ttft s", "twin ttft s", "median ratio",
                     "min", "max", "target <= 1.3", "prefilled sw/twin", "restore_s/ttft",
                     "sw/(twin-restore)"], families))
    return 0


def bench_model(model: Path, args) -> list[list]:
    """Run the workload on one model for each --slots value; returns the summary rows."""
    convs = build(args.conversations, args.initial, args.new, args.rounds, model, args.seed)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    slot_values = [int(s) for s in args.slots.split(",")]
    print(f"model {model} ({args.model_size if not args.model else 'given'}); "
          f"{args.conversations} conversations of ~{args.initial} tokens, +~{args.new} per turn, "
          f"{args.rounds} switching rounds, {args.max_tokens}-token replies, "
          f"--prefill-chunk {args.prefill_chunk}")
    summary_rows, details = [], []
    peer_line = None
    for i, slots in enumerate(slot_values):
        extra = ["--prefill-chunk", str(args.prefill_chunk), "--page-size", str(args.page_size),
                 "--kv-disk-budget", "2GiB", "--log-level", "debug"]
        with_peer = i == 0 and not args.no_peer
        print(f"\n== switchyard --slots {slots}" + (" + mlx_lm.server side by side" if with_peer
                                                     else ""), flush=True)
        t0 = time.perf_counter()
        with ServerGroup(model, slots=slots, ctx=args.ctx, extra=extra) as group:
            servers = {"switchyard": group.url}
            peer = MlxLmServer(model) if with_peer else None
            if peer is not None:
                peer.__enter__()
                servers["mlx_lm"] = peer.url
            try:
                turns = run_workload(servers, convs, args.rounds, args.max_tokens, log)
            finally:
                if peer is not None:
                    peer.__exit__()
            lines, figures = summarize_switchyard(group, turns, f"--slots {slots}",
                                                  args.page_size)
            details += lines
            if args.keep_log:
                Path(args.keep_log).mkdir(parents=True, exist_ok=True)
                shutil.copy(group.log_path, Path(args.keep_log) / f"switching-slots{slots}.log")
        for name in servers:
            ratios = pair_ratios(turns, name)
            sw, tw = ttfts(turns, name, "switch"), ttfts(turns, name, "twin")
            ours = name == "switchyard"
            summary_rows.append([f"switchyard --slots {slots}" if ours else name,
                                 len(sw), fmt(median(sw)), fmt(median(tw)),
                                 fmt(median(ratios), 2), fmt(min(ratios), 2),
                                 fmt(max(ratios), 2),
                                 "met" if median(ratios) <= 1.3 else "MISSED",
                                 fmt(figures["token_ratio"], 2) if ours else "",
                                 fmt(figures["restore_share"], 3) if ours else "",
                                 fmt(figures["unrestored_ratio"], 2) if ours else ""])
        if with_peer:
            ours = median(ttfts(turns, "switchyard", "switch"))
            theirs = median(ttfts(turns, "mlx_lm", "switch"))
            peer_line = (f"median switching TTFT switchyard --slots {slots} / mlx_lm.server = "
                         f"{fmt(ours)} / {fmt(theirs)} = {fmt(ours / theirs, 2)}")
        print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)
    print("\n".join(details))
    print("\nswitching turn TTFT vs its resident twin (same context, same number of new tokens)")
    print(table(["server", "turns", "switch ttft s", "twin ttft s", "median ratio", "min",
                 "max", "target <= 1.3", "prefilled sw/twin", "restore_s/ttft",
                 "sw/(twin-restore)"], summary_rows))
    if peer_line:
        print(peer_line)
    return summary_rows


if __name__ == "__main__":
    sys.exit(main())
