"""Structured outputs: decode tokens/s of a JSON-schema-constrained stream / the same stream
unconstrained, single stream and 4 concurrent, plus the time to compile a typical tool schema.
Four concurrent streams are reported twice: decode (tokens emitted while all four decode /
that window) and wall (all tokens / sent-to-done, so prefill waits and first-token times count).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/structured_outputs.py [--model PATH.gguf] [--rounds 3]
            [--speculative off|on|both] [--streams 4] [--tokens N]

Both sides use the same server, prompt and number of tokens (the constrained output's length);
within each round the order of constrained and unconstrained alternates (constrained first in
even rounds, second in odd ones) so machine noise hits both alike (target: ratio >= 0.9). The
masks are computed on the CPU while each forward pass runs (docs/design.md "Structured
outputs").

Speculative decoding is off by default: every request carries `"speculative": false`, so the
ratio is the grammar's own cost (mask computation, masking) on plain decode steps. With it on,
the ratio mostly measures how well suffix drafts predict each text (the JSON's repeated keys,
or free text that fell into repetition), not the grammar, and swings from run to run. `--speculative on` measures
that side, `both` runs the two in one sitting (off, then on, on the same server).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import model_dir, stream  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402

# About 300 tokens of JSON: long enough that the first token's latency does not count.
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 24, "maxItems": 24, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                "maximum": 9999},
                                         "label": {"type": "string", "maxLength": 10}},
        "required": ["id", "label"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
TOOL = {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
    "mode": {"enum": ["read", "write", "append"]},
    "options": {"type": "object", "properties": {"recursive": {"type": "boolean"},
                                                 "depth": {"type": "integer"}},
                "additionalProperties": False}},
    "required": ["path", "mode"], "additionalProperties": False}


def stream_run(url: str, seed: int, max_tokens: int, constrained: bool,
               speculative: bool = False):
    """One streamed chat request; its `Streamed` record (chunk arrival times, usage)."""
    body = {"messages": [{"role": "user", "content": f"List {seed}."}], "max_tokens": max_tokens,
            "temperature": 0, "seed": seed, "speculative": speculative}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "list", "schema": SCHEMA}}
    run = stream(url, "/v1/chat/completions", body)
    if run.error:
        raise RuntimeError(run.error)
    return run


def stream_tps(url: str, seed: int, max_tokens: int, constrained: bool,
               speculative: bool = False) -> tuple[float, int]:
    """(decode tokens/s after the first content chunk, completion tokens) of one stream."""
    run = stream_run(url, seed, max_tokens, constrained, speculative)
    tokens = run.usage["completion_tokens"]
    return (tokens - 1) / (run.stamps[-1] - run.stamps[0]), tokens


def concurrent_tps(url: str, n: int, seed: int, max_tokens: int, constrained: bool,
                   speculative: bool = False) -> tuple[float, float]:
    """(decode, wall) aggregate tokens/s of `n` concurrent streams. Decode: tokens emitted
    while all n streams were decoding (from the last one's first token to the first one's
    end) / that window, so prefill waits and staggered first tokens do not count; wall: all
    tokens / sent-to-last-done."""
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        runs = list(pool.map(
            lambda i: stream_run(url, seed + i, max_tokens, constrained, speculative), range(n)))
        elapsed = time.perf_counter() - started
    wall = sum(r.usage["completion_tokens"] for r in runs) / elapsed
    return all_decoding_tps(runs), wall


def all_decoding_tps(runs: list) -> float:
    """Tokens the streams emitted from the last one's first token to the first one's end /
    that window (NaN when they never all decoded at once)."""
    t0, t1 = max(r.stamps[0] for r in runs), min(r.stamps[-1] for r in runs)
    if t1 <= t0:
        return float("nan")
    # A chunk may carry more than one token: scale each stream's chunks to its tokens.
    emitted = sum(r.count_between(t0, t1) * r.usage["completion_tokens"] / len(r.stamps)
                  for r in runs)
    return emitted / (t1 - t0)


def compile_ms(rounds: int = 20) -> float:
    from switchyard.gateway.request import structured

    times = []
    for i in range(rounds):
        schema = {**TOOL, "description": f"variant {i}"}  # defeat any caching
        started = time.perf_counter()
        structured.json_schema(schema, "tools")
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(url: str, rounds: int, length: int, speculative: bool, streams: int
            ) -> dict[str, dict[bool, list[float]]]:
    """Per-round tok/s of each side, single stream and `streams` concurrent (0: skipped); the
    order of the two sides alternates from round to round."""
    single: dict[bool, list[float]] = {True: [], False: []}
    multi: dict[bool, list[float]] = {True: [], False: []}
    wall: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for constrained in ((True, False) if r % 2 == 0 else (False, True)):
            single[constrained].append(
                stream_tps(url, 100 + r, length, constrained, speculative)[0])
            if streams:
                decode, total = concurrent_tps(url, streams, 200 + 10 * r, length,
                                               constrained, speculative)
                multi[constrained].append(decode)
                wall[constrained].append(total)
    return {"single stream": single, f"{streams} concurrent": multi,
            f"{streams} conc. wall": wall}


def report(label: str, results: dict[str, dict[bool, list[float]]]) -> None:
    for name, runs in results.items():
        # Rounds where both sides have a figure (the decode window may be empty: NaN).
        pairs = [(a, b) for a, b in zip(runs[True], runs[False])
                 if not (math.isnan(a) or math.isnan(b))]
        if not pairs:
            continue
        c, u = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        per_round = " ".join(f"{a / b:.2f}" for a, b in pairs)
        print(f"speculation {label:3s} {name:14s} constrained {c:7.1f} tok/s  unconstrained "
              f"{u:7.1f} tok/s  ratio {c / u:.3f}  (rounds: {per_round})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: the tiny "
                    "qwen3)")
    ap.add_argument("--speculative", choices=("off", "on", "both"), default="off",
                    help="the requests' speculative field (default off: the grammar's own cost)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams (0: skip)")
    ap.add_argument("--tokens", type=int, default=2000,
                    help="tokens per stream (at most the constrained output's length, ~300)")
    args = ap.parse_args()
    model = model_dir("tiny", args.model)
    print(f"typical tool schema compiles in {compile_ms():.2f} ms (median of 20)", flush=True)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.speculative]
    with ServerGroup(model, slots=4, ctx=4096) as group:
        url = group.url
        # Warm up both sides; the constrained output's length is every stream's.
        _, length = stream_tps(url, 0, args.tokens, True)
        stream_tps(url, 0, length, False)
        for speculative in modes:
            report("on" if speculative else "off",
                   measure(url, args.rounds, length, speculative, args.streams))
    print(f"({length} tokens per stream, {args.rounds} rounds, medians)")


if __name__ == "__main__":
    main()
