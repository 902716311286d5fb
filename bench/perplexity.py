"""What `--kv-bits 8|4` costs in quality on the trained default model.

Perplexity of SmolLM2-135M-Instruct (the default model; `--model` for another) on two fixed
texts shipped with the bench, English prose (bench/texts/english.txt) and a Python module
(bench/texts/python.txt), with float KV, `--kv-bits 8` and `--kv-bits 4` (`--kv-group-size`,
default 64). In-process, with the cache the worker builds for those settings
(`LoadedModel.make_cache`: mlx-lm's QuantizedKVCache from the first token, worker/kv_layout.py)
and the server's prefill chunks (512 tokens): every chunk attends to the quantized keys and
values of the chunks before it, as a served conversation does; each setting's model is loaded
as the worker loads it (with quantized KV, keys leave RoPE Hadamard-rotated). Perplexity = exp(mean negative
log-likelihood of each token given the ones before it), over the whole text.

Targets: kv8 <= +0.5% of float KV, kv4 <= +5%.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/perplexity.py [--model PATH] [--chunk 512]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench._common import preload_note, table  # noqa: E402
from switchyard.deploy.default_model import default_model_path  # noqa: E402
from switchyard.common.tokenizer_loading import load_tokenizer  # noqa: E402
from switchyard.worker.kv_layout import kv_quant  # noqa: E402
from switchyard.worker.model_loading import LoadedModel, load_model  # noqa: E402

TEXTS = Path(__file__).parent / "texts"
TARGETS = {8: 0.005, 4: 0.05}


def nll_sum(loaded: LoadedModel, tokens: list[int], chunk: int) -> float:
    """Sum of -log p(token | earlier tokens) over tokens[1:], fed in chunks to one cache."""
    cache = loaded.make_cache()
    total = 0.0
    for start in range(0, len(tokens) - 1, chunk):
        inputs = tokens[start:start + chunk]
        targets = tokens[start + 1:start + 1 + len(inputs)]
        logits = loaded.model(mx.array(inputs)[None], cache=cache)[0, :len(targets)]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
        total -= float(mx.sum(picked).item())
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path (default: the default model, fetched once)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk, as --prefill-chunk")
    ap.add_argument("--kv-group-size", type=int, default=0,
                    help="0: as the server chooses (32 with 4 bits, 64 with 8)")
    ap.add_argument("--texts", nargs="*", default=sorted(p.name for p in TEXTS.glob("*.txt")))
    args = ap.parse_args()
    if preload_note():
        print(preload_note())
    model = args.model or str(default_model_path(announce=print))
    tokenizer = load_tokenizer(model)
    texts = {name: list(tokenizer.encode((TEXTS / name).read_text(), add_special_tokens=False))
             for name in args.texts}
    ppl: dict[str, dict[int, float]] = {name: {} for name in texts}
    for bits in (0, 8, 4):
        # As the worker loads it for `--kv-bits`: the cache kind, and the key rotation
        # that goes with quantized KV (worker/kv_layout.py).
        loaded = load_model(model, kv_quant(bits, args.kv_group_size))
        form = loaded.kv_quant.tag if loaded.kv_quant else "float"
        print(f"model {model} ({loaded.model_type}), KV {form}, chunks of {args.chunk}",
              flush=True)
        for name, tokens in texts.items():
            t0 = time.perf_counter()
            ppl[name][bits] = math.exp(nll_sum(loaded, tokens, args.chunk) / (len(tokens) - 1))
            print(f"  {name}: perplexity {ppl[name][bits]:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    rows, verdicts = [], []
    for name, tokens in texts.items():
        row = [name, len(tokens), f"{ppl[name][0]:.4f}"]
        for bits in (8, 4):
            change = ppl[name][bits] / ppl[name][0] - 1
            row += [f"{ppl[name][bits]:.4f}", f"{change:+.2%}"]
            verdicts.append((name, bits, change))
        rows.append(row)
    print(table(["text", "tokens", "float KV", "kv8", "kv8 vs float", "kv4", "kv4 vs float"],
                rows))
    for name, bits, change in verdicts:
        met = "met" if change <= TARGETS[bits] else "MISSED"
        print(f"{name}: kv{bits} {change:+.2%} of float KV (target <= +{TARGETS[bits]:.1%}: "
              f"{met})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
