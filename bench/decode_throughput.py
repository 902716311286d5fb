"""Single-stream decode tokens/s through the full HTTP path vs mlx_lm in-process, one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/decode_throughput.py [--tokens 256] [--rounds 3] [--arch gpt_oss ...]

Both sides decode the same prompt greedily for the same number of tokens on the same tiny
model (`--arch`: one line per family), alternating rounds so machine noise hits both alike.
Reports the median of each, their ratio and the median of the per-round ratios (target:
Switchyard / mlx_lm >= 0.9). Never an absolute target: the machine is
shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from switchyard.testing.group import ServerGroup  # noqa: E402


def server_tps(url: str, prompt: str, num_tokens: int) -> float:
    """Decode tokens/s of one streamed completion: the tokens after the first content chunk
    over the time from that chunk to the last one (a chunk may carry several tokens)."""
    body = {"prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    stamps, usage, first_text = [], None, ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                first_text = first_text or chunk["choices"][0]["text"]
    tokenizer = server_tps.tokenizer
    first_tokens = len(tokenizer.encode(first_text, add_special_tokens=False))
    return (usage["completion_tokens"] - first_tokens) / (stamps[-1] - stamps[0])


def mlx_tps(model_dir: Path, prompt: str, num_tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    if not hasattr(mlx_tps, "loaded"):
        mlx_tps.loaded = load(str(model_dir))
    model, tokenizer = mlx_tps.loaded
    ids = mx.array(tokenizer.encode(prompt))
    stamps = []
    for _tok, _ in generate_step(ids, model, max_tokens=num_tokens):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="model directory (default: generate a tiny twin of --arch)")
    ap.add_argument("--arch", nargs="+", default=["qwen3"],
                    help="families to generate tiny twins of, one result line each")
    args = ap.parse_args()
    if args.model:
        print(run(Path(args.model), args))
        return
    from fixtures.tiny_models import generate_tiny_model

    lines = []
    for arch in args.arch:
        model_dir = Path(tempfile.mkdtemp(prefix="sybench")) / f"tiny-{arch}"
        generate_tiny_model(model_dir, arch)
        lines.append(f"{arch:>14}: {run(model_dir, args)}")
        mlx_tps.__dict__.pop("loaded", None)
        print(lines[-1], flush=True)
    print("\n".join(["per family:", *lines]))


def run(model_dir: Path, args) -> str:
    prompt = "Switchyard keeps every conversation's KV pages warm. " * 8
    ours, theirs = [], []
    from switchyard.common.tokenizer_loading import load_tokenizer

    server_tps.tokenizer = load_tokenizer(str(model_dir))
    with ServerGroup(model_dir, slots=1, ctx=4096) as group:
        server_tps(group.url, prompt, 16)  # warm-up
        mlx_tps(model_dir, prompt, 16)
        for _ in range(args.rounds):
            ours.append(server_tps(group.url, prompt, args.tokens))
            theirs.append(mlx_tps(model_dir, prompt, args.tokens))
    o, t = statistics.median(ours), statistics.median(theirs)
    # Each round's two runs are adjacent in time, so their ratio shares the machine's noise.
    paired = statistics.median(a / b for a, b in zip(ours, theirs))
    return (f"switchyard HTTP {o:.1f} tok/s {[round(x, 1) for x in ours]}, mlx_lm in-process "
            f"{t:.1f} tok/s {[round(x, 1) for x in theirs]}, ratio of medians {o / t:.3f}, "
            f"median per-round ratio {paired:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
