"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), per token, from image spans.

A text token has one position on all three axes (time, height, width). An image's placeholder
tokens form its merged patch grid (t, h, w): token (i, j, k) of it sits at p0 + (i, j, k), where
p0 is the position the next text token would have had, and the text after the image goes on from
p0 + max(t, h, w). So every token's position follows from the image spans before it: a chunk's
positions need no state from earlier chunks, and a slot decodes at its length plus the `delta`
of its images (as mlx-vlm's `get_rope_index` computes them for a whole prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def llm_grid(grid: Sequence[int], merge: int) -> tuple[int, int, int]:
    """The encoder's patch grid (t, h, w) as the language model's tokens see it."""
    t, h, w = grid
    return int(t), int(h) // merge, int(w) // merge


def delta_before(spans: Sequence, position: int, merge: int) -> int:
    """How far the position of token `position` (a text token after every span that ends by
    then) lies from `position` itself."""
    delta = 0
    for span in spans:
        if span.start + span.num_tokens <= position:
            t, h, w = llm_grid(span.grid, merge)
            delta += max(t, h, w) - span.num_tokens
    return delta


def positions(spans: Sequence, start: int, length: int, merge: int) -> np.ndarray:
    """[3, length] int32 positions of tokens [start, start + length) of a sequence whose images
    are `spans` (in order; a span's tokens are its grid's, t-major)."""
    out = np.empty((3, length), dtype=np.int32)
    end = start + length
    pos, delta = start, 0  # next token to place, and the offset of text positions there
    for span in spans:
        if span.start >= end:
            break
        t, h, w = llm_grid(span.grid, merge)
        if t * h * w != span.num_tokens:
            raise ValueError(f"an image grid {tuple(span.grid)} does not make "
                             f"{span.num_tokens} tokens")
        if span.start > pos:  # text before the image
            lo, hi = pos, min(span.start, end)
            if hi > start:
                a = max(lo, start)
                out[:, a - start:hi - start] = np.arange(a, hi) + delta
            pos = span.start
        p0 = span.start + delta
        lo, hi = max(span.start, start), min(span.start + span.num_tokens, end)
        if hi > lo:
            k = np.arange(lo - span.start, hi - span.start)
            out[0, lo - start:hi - start] = p0 + k // (h * w)
            out[1, lo - start:hi - start] = p0 + (k // w) % h
            out[2, lo - start:hi - start] = p0 + k % w
        delta += max(t, h, w) - span.num_tokens
        pos = span.start + span.num_tokens
    if pos < end:
        a = max(pos, start)
        out[:, a - start:] = np.arange(a, end) + delta
    return out
