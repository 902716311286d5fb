"""Structured outputs: decode tokens/s of a JSON-schema-constrained stream / the same stream
unconstrained, single stream and 4 concurrent, plus the time to compile a typical tool schema.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/structured_outputs.py [--rounds 3]

Both runs use the same server, prompt and number of tokens (the constrained output's length),
alternating rounds so machine noise hits both alike (target: ratio >= 0.9). The masks are
computed on the CPU while each forward pass runs (docs/design.md "Structured outputs").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import model_dir, stream  # noqa: E402
from tests.helpers.group import ServerGroup  # noqa: E402

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


def stream_tps(url: str, seed: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """(decode tokens/s after the first content chunk, completion tokens) of one stream."""
    body = {"messages": [{"role": "user", "content": f"List {seed}."}], "max_tokens": max_tokens,
            "temperature": 0, "seed": seed}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "list", "schema": SCHEMA}}
    run = stream(url, "/v1/chat/completions", body)
    if run.error:
        raise RuntimeError(run.error)
    tokens = run.usage["completion_tokens"]
    return (tokens - 1) / (run.stamps[-1] - run.stamps[0]), tokens


def concurrent_tps(url: str, n: int, seed: int, max_tokens: int, constrained: bool) -> float:
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        results = list(pool.map(lambda i: stream_tps(url, seed + i, max_tokens, constrained),
                                range(n)))
        elapsed = time.perf_counter() - started
    return sum(t for _, t in results) / elapsed


def compile_ms(rounds: int = 20) -> float:
    from switchyard.gateway.request import structured

    times = []
    for i in range(rounds):
        schema = {**TOOL, "description": f"variant {i}"}  # defeat any caching
        started = time.perf_counter()
        structured.json_schema(schema, "tools")
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny qwen3)")
    args = ap.parse_args()
    model = model_dir("tiny", args.model)
    print(f"typical tool schema compiles in {compile_ms():.2f} ms (median of 20)")
    with ServerGroup(model, slots=4, ctx=4096) as group:
        url = group.url
        _, length = stream_tps(url, 0, 2000, True)  # warm up; the constrained length
        single = {True: [], False: []}
        multi = {True: [], False: []}
        for r in range(args.rounds):
            for constrained in (True, False):
                single[constrained].append(stream_tps(url, 100 + r, length, constrained)[0])
                multi[constrained].append(concurrent_tps(url, 4, 200 + 10 * r, length,
                                                         constrained))
    for name, runs in (("single stream", single), ("4 concurrent", multi)):
        c, u = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"{name:14s} constrained {c:7.1f} tok/s  unconstrained {u:7.1f} tok/s  "
              f"ratio {c / u:.3f}")
    print(f"({length} tokens per stream, {args.rounds} rounds, medians)")


if __name__ == "__main__":
    main()
