"""A cold prefill must not starve a neighbour's reply (decode-first steps).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/interference.py [--model-size tiny|h512] [--chunks 128,256,512,1024]
        [--decode-shares 0,0.5]

For each `--prefill-chunk` value a fresh Switchyard group (`--slots 4 --ctx 16384`) runs:

1. X solo: conversation X (a short prompt) streams a `--reply`-token reply, greedy. The
   gateway has no `ignore_eos`, so X's prompt is picked (once, by trying seeds) so that greedy
   decoding runs the full length without a stop token.
2. X + Y: X streams again; `--delay` s after X's first token a cold `--cold`-token request Y
   (fresh random token ids, so nothing is cached) arrives. X's tokens/s while Y prefills (from
   Y's arrival to Y's first token, or X's end) / X's solo tokens/s: target >= 0.5.
   Y's TTFT / Y's TTFT alone (3.) says what the decode-first step costs Y.
3. Y alone: another fresh cold request of the same length, nothing else running.
4. Only with `--main-chunk` (512, the default): X + Y(background), as 2. with Y sent as
   `X-Switchyard-Priority: background`; and aggregate decode tokens/s of 4 concurrent streams
   (counted while all 4 stream) / one stream's, alternating 1 and 4 streams
   `--stream-rounds` times, median of the pair ratios: target >= 2.

`--prefill-chunk` is the largest chunk; while streams decode, the scheduler's budget
(`--decode-share`, scheduler/step_budget.py) may cut it to keep them at pace, so the table
also gives the prefill tokens actually run in steps that carry a decode. `--decode-shares`
runs every chunk value with each given share (0 turns the limit off: the fixed-chunk policy).

The worker's debug `step.done` lines give the step times behind the figures: decode-only
steps vs steps that carry X's decode and a chunk of Y. Token rates count streamed chunks
(one per token here). Every figure is a ratio within one run; the machine is shared.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (Streamed, fmt, log_events, median, model_dir,  # noqa: E402
                           preload_note, random_token_ids, stream, table)
from switchyard.testing.group import ServerGroup  # noqa: E402

COMPLETIONS = "/v1/completions"
BACKGROUND = {"X-Switchyard-Priority": "background"}


class Bench:
    def __init__(self, url: str, args, x_prompts: list[list[int]]):
        self.url = url
        self.args = args
        self.x_prompts = x_prompts
        self.cold_seed = 1000

    def reply(self, prompt: list[int], max_tokens: int, headers=None) -> Streamed:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        res = stream(self.url, COMPLETIONS, body, headers)
        if res.error:
            raise RuntimeError(res.error)
        return res

    def cold_prompt(self) -> list[int]:
        self.cold_seed += 1
        return random_token_ids(random.Random(self.cold_seed), self.args.cold)

    def x_solo(self) -> Streamed:
        return self.reply(self.x_prompts[0], self.args.reply)

    def y_alone(self) -> Streamed:
        return self.reply(self.cold_prompt(), 1)

    def x_with_y(self, headers=None) -> tuple[Streamed, Streamed]:
        """X streams; `delay` s after X's first token, cold Y arrives."""
        out: dict[str, Streamed] = {}
        x_started = threading.Event()

        def run_x():
            body = {"prompt": self.x_prompts[0], "max_tokens": self.args.reply,
                    "temperature": 0}
            res = stream(self.url, COMPLETIONS, body, on_chunk=x_started.set)
            out["x"] = res

        thread = threading.Thread(target=run_x)
        thread.start()
        if not x_started.wait(120):
            raise RuntimeError("X produced no token")
        time.sleep(self.args.delay)
        out["y"] = self.reply(self.cold_prompt(), 1, headers)
        thread.join()
        if out["x"].error:
            raise RuntimeError(out["x"].error)
        return out["x"], out["y"]

    def concurrent(self, n: int) -> list[Streamed]:
        results: list[Streamed | None] = [None] * n

        def run(i):
            results[i] = self.reply(self.x_prompts[i], self.args.reply)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def rate_during(x: Streamed, y: Streamed) -> float:
    """X's streamed tokens/s from Y's arrival until Y's first token (or X's last token)."""
    t0, t1 = y.sent, min(y.first, x.stamps[-1])
    if t1 - t0 <= 0:
        return float("nan")
    return x.count_between(t0, t1) / (t1 - t0)


def aggregate_rate(results: list[Streamed]) -> float:
    """Tokens/s summed over streams, counted while all of them stream."""
    t0 = max(r.stamps[0] for r in results)
    t1 = min(r.stamps[-1] for r in results)
    if t1 <= t0:
        return float("nan")
    return sum(r.count_between(t0, t1) for r in results) / (t1 - t0)


def pick_x_prompts(url: str, args, n: int) -> list[list[int]]:
    """Prompts whose greedy reply runs `args.reply` tokens without a stop token."""
    picked = []
    seed = 0
    while len(picked) < n and seed < 40:
        prompt = random_token_ids(random.Random(seed), args.x_prompt)
        seed += 1
        res = stream(url, COMPLETIONS, {"prompt": prompt, "max_tokens": args.reply,
                                        "temperature": 0})
        done = (res.usage or {}).get("completion_tokens", 0)
        if res.finish_reason == "length" and done == args.reply and \
                len(res.stamps) >= args.reply * 0.95:
            picked.append(prompt)
    if len(picked) < n:
        raise RuntimeError(f"found only {len(picked)} prompts that reply {args.reply} tokens")
    return picked


def step_stats(group: ServerGroup, since: str) -> tuple[float, float, float]:
    """Median worker step ms: decode only; decode + prefill chunk; prefill-chunk tokens."""
    decode, mixed, chunk = [], [], []
    for e in log_events(group.log_path, "step.done"):
        if e.get("role") != "worker" or e.get("timestamp", "") < since:
            continue
        if e["num_decode"] and not e["num_prefill"]:
            decode.append(e["step_ms"])
        elif e["num_decode"] and e["num_prefill"]:
            mixed.append(e["step_ms"])
            chunk.append(e["num_prefill"])
    return median(decode), median(mixed), median(chunk)


def verdict(ok: bool, value: float) -> str:
    return "n/a" if value != value else ("met" if ok else "MISSED")


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())


def run_chunk(model: Path, chunk: int, share: str | None, args, x_prompts, main_config: bool,
              log):
    # Rates count streamed chunks, one per token only without decode bursts (a burst of 8
    # tokens arrives as one chunk): --decode-burst 1 keeps solo and shared rates comparable.
    # Speculation off: X's prompt comes back every round, and drafts copied from its earlier
    # replies would deliver a reply in a few verify passes (no decode left to interfere with).
    extra = ["--prefill-chunk", str(chunk), "--page-size", "256", "--kv-disk-budget", "2GiB",
             "--log-level", "debug", "--decode-burst", "1", "--speculative", "off"]
    if share is not None:
        extra += ["--decode-share", share]
    row: dict = {"chunk": chunk, "share": share if share is not None else "default"}
    with ServerGroup(model, slots=4, ctx=args.ctx, extra=extra) as group:
        if x_prompts is None:
            x_prompts = pick_x_prompts(group.url, args, 4)
        b = Bench(group.url, args, x_prompts)
        b.reply(b.cold_prompt()[:512], 1)  # warm-up: first-use costs of prefill paths
        since = now_stamp()
        solo = [b.x_solo()]
        x, y = b.x_with_y()
        log(f"  chunk {chunk}: X+Y   X {rate_during(x, y):.1f} tok/s during Y, "
            f"Y ttft {y.ttft:.2f}s")
        y_alone = b.y_alone()
        log(f"  chunk {chunk}: Y alone ttft {y_alone.ttft:.2f}s")
        solo.append(b.x_solo())
        row.update(solo_tps=median([s.decode_tps() for s in solo]), x_during=rate_during(x, y),
                   y_ttft=y.ttft, y_alone=y_alone.ttft)
        row["decode_ms"], row["mixed_ms"], row["chunk_tokens"] = step_stats(group, since)
        if main_config:
            xb, yb = b.x_with_y(BACKGROUND)
            log(f"  chunk {chunk}: X+Ybg X {rate_during(xb, yb):.1f} tok/s during Y, "
                f"Y ttft {yb.ttft:.2f}s")
            row.update(xb_during=rate_during(xb, yb), yb_ttft=yb.ttft)
            one, four, ratios = [], [], []
            for _ in range(args.stream_rounds):  # alternate 1 and 4 streams; pair ratios
                one.append(b.x_solo().decode_tps())
                four.append(aggregate_rate(b.concurrent(4)))
                ratios.append(four[-1] / one[-1])
                log(f"  4 streams: {four[-1]:.1f} tok/s total vs {one[-1]:.1f} for one")
            row.update(agg1=median(one), agg4=median(four), agg_ratio=median(ratios),
                       agg_ratios=ratios)
        if args.keep_log:
            Path(args.keep_log).mkdir(parents=True, exist_ok=True)
            name = f"interference-chunk{chunk}" + (f"-share{share}" if share else "") + ".log"
            shutil.copy(group.log_path, Path(args.keep_log) / name)
    return row, x_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("tiny", "h512"), default="tiny")
    ap.add_argument("--model", help="model directory (overrides --model-size)")
    ap.add_argument("--chunks", default="128,256,512,1024", help="--prefill-chunk values")
    ap.add_argument("--reply", type=int, default=200, help="X's reply tokens")
    ap.add_argument("--x-prompt", type=int, default=256, help="X's prompt tokens")
    ap.add_argument("--cold", type=int, default=8000, help="Y's prompt tokens")
    ap.add_argument("--delay", type=float, default=0.5, help="s after X's first token")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--decode-shares", default="",
                    help="comma-separated --decode-share values, each run with every chunk "
                         "(default: the server's default only)")
    ap.add_argument("--main-chunk", type=int, default=512,
                    help="the chunk value that also runs background Y and 4 streams (0: none)")
    ap.add_argument("--stream-rounds", type=int, default=3, help="1-vs-4-stream pairs")
    ap.add_argument("--keep-log", metavar="DIR", help="copy each group log here")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    model = model_dir(args.model_size, args.model)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"model {model} ({args.model_size if not args.model else 'given'}); X: "
          f"{args.x_prompt}-token prompt, {args.reply}-token reply; Y: {args.cold} cold tokens "
          f"{args.delay}s after X's first token")
    if args.main_chunk and args.main_chunk not in chunks:
        chunks.append(args.main_chunk)
    shares = [s.strip() for s in args.decode_shares.split(",") if s.strip()] or [None]
    rows, x_prompts, main_row = [], None, None
    t_all = time.perf_counter()
    for share in shares:
        for chunk in chunks:
            t0 = time.perf_counter()
            is_main = chunk == args.main_chunk and main_row is None
            row, x_prompts = run_chunk(model, chunk, share, args, x_prompts, is_main, log)
            log(f"  ({time.perf_counter() - t0:.0f}s)")
            rows.append(row)
            if is_main:
                main_row = row
    out = []
    for r in rows:
        ratio = r["x_during"] / r["solo_tps"]
        out.append([r["chunk"], r["share"], fmt(r["solo_tps"], 1), fmt(r["x_during"], 1),
                    fmt(ratio, 3), verdict(ratio >= 0.5, ratio), fmt(r["y_ttft"], 2),
                    fmt(r["y_alone"], 2), fmt(r["y_ttft"] / r["y_alone"], 2),
                    fmt(r["decode_ms"], 1), fmt(r["mixed_ms"], 1), fmt(r["chunk_tokens"], 0)])
    print("\nX's decode during Y's cold prefill vs X solo; Y's TTFT with X vs Y alone; worker "
          "step medians over the run ('chunk tokens': prefill tokens in steps that also decode)")
    print(table(["chunk", "decode share", "X solo tok/s", "X during Y", "X ratio", ">= 0.5",
                 "Y ttft s", "Y alone s", "Y ttft ratio", "decode step ms", "decode+chunk step ms",
                 "chunk tokens"], out))
    r = main_row
    if r is None:
        print(f"({time.perf_counter() - t_all:.0f}s)")
        return 0
    print(f"\nY as background (--prefill-chunk {r['chunk']}, decode share {r['share']}): X ratio "
          f"{fmt(r['xb_during'] / r['solo_tps'], 3)} (interactive Y: "
          f"{fmt(r['x_during'] / r['solo_tps'], 3)}); Y ttft / Y alone "
          f"{fmt(r['yb_ttft'] / r['y_alone'], 2)} (interactive Y: "
          f"{fmt(r['y_ttft'] / r['y_alone'], 2)})")
    agg = r["agg_ratio"]
    print(f"aggregate decode, 4 concurrent streams vs 1: {fmt(r['agg4'], 1)} / "
          f"{fmt(r['agg1'], 1)} tok/s, median pair ratio {fmt(agg, 2)}x "
          f"(pairs {[round(x, 2) for x in r['agg_ratios']]}; target >= 2x: "
          f"{'met' if agg >= 2 else 'MISSED'})")
    print(f"({time.perf_counter() - t_all:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
