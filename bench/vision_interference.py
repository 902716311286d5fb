"""A neighbour's image must not stall a text stream's decode (the encoder in the step
budget, docs/design/images.md "Images").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/vision_interference.py [--rounds 3] [--side 896] [--images 2]

On the tiny Qwen2.5-VL twin, with its processor's image cap raised to `--side` pixels square (896:
1024 placeholder tokens an image), one group (`--slots 2`):

1. X solo: a text chat stream of `--reply` tokens (a prompt whose greedy reply streams the
   full length as text).
2. X + Y, `--rounds` times: `--delay` s after X's first token, Y arrives: `--images` fresh
   random images of `--side` x `--side` pixels and a line of text (new images every round, so
   the encoder runs). X's tokens/s from Y's arrival to Y's first token / X's solo tokens/s:
   target >= 0.5. The worker's `vision.encoded` lines give the encoder's milliseconds.

Every figure is a ratio within one run; the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Streamed, fmt, log_events, median, preload_note, stream, table  # noqa: E402
from bench.interference import rate_during  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402
from switchyard.testing.vision import data_url, picture  # noqa: E402

CHAT = "/v1/chat/completions"


def twin(side: int) -> Path:
    """The tiny Qwen2.5-VL twin, its image cap raised to side x side pixels."""
    from fixtures.tiny_models import generate_tiny_model

    out = Path(tempfile.mkdtemp(prefix="sybench-vision-")) / "qwen2_5_vl"
    generate_tiny_model(out, "qwen2_5_vl")
    config = out / "preprocessor_config.json"
    data = json.loads(config.read_text())
    data["max_pixels"] = side * side
    config.write_text(json.dumps(data))
    return out


def x_body(text: str, args) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": args.reply,
            "temperature": 0}


def pick_x(url: str, args) -> str:
    """A text whose greedy reply streams the full length as text (the twin's replies to
    some prompts are special tokens, which stream nothing)."""
    for word in ("harbour", "lantern", "river", "mill", "crane", "garden", "market", "bridge"):
        text = f"Tell me a long story about the {word}."
        res = stream(url, CHAT, x_body(text, args))
        if res.finish_reason == "length" and len(res.stamps) >= 0.8 * args.reply:
            return text
    raise RuntimeError(f"no prompt streams {args.reply} tokens of text")


def y_body(args, seed: int) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(
        picture(seed * 100 + i, args.side, args.side))}} for i in range(args.images)]
    parts.append({"type": "text", "text": "Compare these pictures."})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1, "temperature": 0}


def x_with_y(url: str, x_text: str, args, seed: int) -> tuple[Streamed, Streamed]:
    out: dict[str, Streamed] = {}
    started = threading.Event()
    body = y_body(args, seed)  # made before X starts: encoding the PNGs takes a while

    def run_x():
        out["x"] = stream(url, CHAT, x_body(x_text, args), on_chunk=started.set)

    thread = threading.Thread(target=run_x)
    thread.start()
    if not started.wait(120):
        raise RuntimeError("X produced no token")
    time.sleep(args.delay)
    out["y"] = stream(url, CHAT, body)
    thread.join()
    for name in ("x", "y"):
        if out[name].error:
            raise RuntimeError(f"{name}: {out[name].error}")
    return out["x"], out["y"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", type=int, default=896)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--reply", type=int, default=1536)
    ap.add_argument("--delay", type=float, default=0.5)
    args = ap.parse_args()
    model = twin(args.side)
    rows = []
    try:
        # Rates count streamed chunks: one per token only without decode bursts, and without
        # speculation (the twin's replies repeat themselves, so drafts would make X's rate
        # swing with what the proposer finds, hiding what the encoder costs it).
        with ServerGroup(model, slots=2, ctx=8192,
                         extra=["--log-level", "debug", "--decode-burst", "1",
                                "--speculative", "off"]) as group:
            x_text = pick_x(group.url, args)
            solo = stream(group.url, CHAT, x_body(x_text, args))
            ratios = []
            for i in range(args.rounds):
                x, y = x_with_y(group.url, x_text, args, i + 1)
                ratios.append(rate_during(x, y) / solo.decode_tps())
                rows.append([i + 1, y.usage["prompt_tokens"], fmt(y.ttft),
                             fmt(x.count_between(y.sent, y.first)), fmt(ratios[-1])])
            encodes = [e["encode_ms"] for e in log_events(group.log_path, "vision.encoded")]
    finally:
        shutil.rmtree(model.parent, ignore_errors=True)
    print(preload_note())
    print(f"X solo: {fmt(solo.decode_tps())} tokens/s; encoder runs: {len(encodes)}, "
          f"median {fmt(median(encodes))} ms")
    print(table(["round", "Y prompt tokens", "Y TTFT s", "X tokens during Y",
                 "X rate during Y / solo"], rows))
    print(f"median ratio {fmt(median(ratios))} (target >= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
