"""What `--kv-bits 8|4` saves and what it changes, measured in one run.

For the tiny model as served on this CPU (float32) and as a 16-bit model (its float16 twin),
with full-precision, 8-bit and 4-bit KV (`--kv-group-size`, default 64), through the worker's
own slot store, page layout and page store (no server: the e2e tests cover the HTTP path):

- slot memory per token: bytes of the attention caches of a slot holding N tokens, / N;
- disk bytes per token: page files (header included) written for those N tokens, / N;
- restored = in memory: the slot restored from those files decodes bit-identical logits;
- greedy parity on the parity prompts (tests/e2e/test_parity.py), against full-precision KV
  of the same dtype: "free" compares the greedy outputs position by position (cut at the first
  end token: after a first difference the rest is another text); "forced" feeds the
  full-precision output back and counts the steps whose greedy token is the same.

Targets: with 8 bits, bytes per token <= 0.55x of 16-bit KV (<= 0.3x of float32), and >= 95%
of greedy tokens equal to full-precision KV.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/kv_bits.py [--model-size tiny] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import model_dir  # noqa: E402
from switchyard.kvstore.store import PageStore  # noqa: E402
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, kv_namespace  # noqa: E402
from switchyard.testing.texts import LONG_TEXT, MAX_TOKENS, REPEAT_TEXT, SHORT_TEXT  # noqa: E402
from switchyard.worker.kv_layout import is_attention_kv, kv_quant  # noqa: E402
from switchyard.worker.model_loading import load_model  # noqa: E402
from switchyard.worker.page_io import PageLayout  # noqa: E402
from switchyard.worker.slots import SlotStore  # noqa: E402

P = 256
CHUNK = 512  # the server's default --prefill-chunk


def prefill(store: SlotStore, slot: int, tokens: list[int], start: int = 0) -> None:
    for s in range(0, len(tokens), CHUNK):
        store.prefill(slot, start + s, tokens[s:s + CHUNK])


def greedy(store: SlotStore, prompt: list[int], eos: set[int],
           forced: list[int] | None = None) -> list[int]:
    """Greedy tokens after `prompt`, as the worker decodes them; with `forced`, the greedy
    choice at each step while `forced` is what is fed back."""
    store.truncate(0, 0)
    prefill(store, 0, prompt[:-1])
    out, tok = [], prompt[-1]
    for i in range(len(forced) if forced is not None else MAX_TOKENS):
        tok = int(mx.argmax(store.decode([0], [len(store.tokens[0])], [tok])[0]).item())
        if forced is None and tok in eos:
            break
        out.append(tok)
        tok = forced[i] if forced is not None else tok
    return out


def num_equal(reference: list[list[int]], outputs: list[list[int]]) -> int:
    return sum(sum(1 for a, b in zip(r, o) if a == b) for r, o in zip(reference, outputs))


def bytes_and_restore(loaded, store: SlotStore, tokens: list[int], kv_dir: Path):
    """(slot bytes/token, disk bytes/token, restored logits == in-memory logits)."""
    store.truncate(0, 0)
    prefill(store, 0, tokens)
    slot_bytes = sum(c.nbytes for c in store.parked(0) if is_attention_kv(c))
    layout = PageLayout(store.parked(0), P)
    ns = kv_namespace(loaded.fingerprint, loaded.model_type, layout.dtype_name, 1, P,
                      loaded.kv_quant.tag if loaded.kv_quant else "")
    page_store = PageStore(kv_dir, sync=False)
    ids = chain_page_ids(ns, tokens, P)
    buf = np.zeros(layout.buffer_bytes, np.uint8)
    disk = 0
    for k, parent in enumerate([ROOT_ID, *ids[:-1]]):
        layout.stage(store.parked(0), k * P, buf, with_state=False)
        disk += page_store.write(ns, parent, tokens[k * P:(k + 1) * P],
                                 buf[:layout.payload_len(P, False)])
    pages = [np.zeros(layout.buffer_bytes, np.uint8) for _ in ids]
    for k, (pid, page) in enumerate(zip(ids, pages)):
        assert page_store.read_into(ns, pid, tokens[k * P:(k + 1) * P], page) is not None
    probe = [7, 8, 9]
    store.prefill(0, len(tokens), probe)
    in_memory = np.array(store.decode([0], [len(store.tokens[0])], [10]))
    layout.load(store.loaded(1, 0, tokens), 0, pages, with_state=False, num_tokens=len(tokens))
    store.prefill(1, len(tokens), probe)
    restored = np.array(store.decode([1], [len(store.tokens[1])], [10]))
    n = len(tokens)
    return slot_bytes / n, disk / n, bool(np.array_equal(in_memory, restored))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens in the slot (pages of 256)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,float16",
                    help="float16 (the 16-bit twin) is slow on a CPU")
    args = ap.parse_args()
    path = model_dir(args.model_size, args.model)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode(t) for t in (SHORT_TEXT, LONG_TEXT)]
    prompts.append(tokenizer.encode(REPEAT_TEXT)[:512])
    tokens = [int(t) for t in np.random.default_rng(0).integers(5, 3000, args.tokens)]
    tokens = tokens[:len(tokens) // P * P]

    print(f"model {path} ({len(tokens)} tokens in the slot, groups of {args.group_size}; "
          f"parity: {len(prompts)} prompts x up to {MAX_TOKENS} greedy tokens)")
    print(f"{'KV':>6} {'dtype':>8} {'slot B/tok':>11} {'disk B/tok':>11} {'x full':>12} "
          f"{'restored==mem':>14} {'greedy free':>16} {'greedy forced':>16}")
    for dtype in (getattr(mx, name) for name in args.dtypes.split(",")):
        base = None
        reference = None
        for bits in (0, 8, 4):
            loaded = load_model(str(path), kv_quant(bits, args.group_size))
            loaded.model.set_dtype(dtype)  # the 16-bit twin: weights, hence KV, in float16
            store = SlotStore(loaded.model, loaded.make_cache, 2, len(tokens) + 64)
            with tempfile.TemporaryDirectory() as kv_dir:
                slot_bpt, disk_bpt, same = bytes_and_restore(loaded, store, tokens, Path(kv_dir))
            outputs = [greedy(store, p, eos) for p in prompts]
            if bits == 0:
                base, reference = (slot_bpt, disk_bpt), outputs
            forced = [greedy(store, p, eos, r) for p, r in zip(prompts, reference)]
            total = sum(len(r) for r in reference)
            free, teacher = num_equal(reference, outputs), num_equal(reference, forced)
            ratio = f"{slot_bpt / base[0]:.3f}/{disk_bpt / base[1]:.3f}"
            print(f"{(f'{bits}-bit' if bits else 'full'):>6} {str(dtype).split('.')[-1]:>8} "
                  f"{slot_bpt:>11.0f} {disk_bpt:>11.0f} {ratio:>12} {str(same):>14} "
                  f"{free:>5}/{total} {free / total:>6.1%} {teacher:>5}/{total} "
                  f"{teacher / total:>6.1%}")
    print("x full = slot/disk bytes per token over full-precision KV of the same dtype")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
