"""Per-sequence sampling, stateless: the key is derived from (seed, sample index).

Statelessness lets the scheduler replay any step after a worker restart and still get the same
tokens for seeded requests. The filters are mlx-lm's own.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from switchyard.proto.values import SamplingParams

_INDEX_STRIDE = 1_000_003  # prime: distinct (seed, index) pairs map to distinct keys


def sample_rows(logits: mx.array, params: list[SamplingParams],
                sample_indexes: list[int]) -> list[int]:
    """Sample one token per row of `logits` ([B, vocab]) with that row's parameters."""
    return sample_lazy(logits, params, sample_indexes).tolist()


def sample_lazy(logits: mx.array, params: list[SamplingParams],
                sample_indexes: list[int]) -> mx.array:
    """Like `sample_rows`, but returns the unevaluated [B] token array (for pipelining)."""
    if any(p.logit_bias for p in params):
        logits = mx.stack([_biased(logits[i], p.logit_bias) if p.logit_bias else logits[i]
                           for i, p in enumerate(params)])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(p.temperature == 0 for p in params):
        return mx.argmax(logprobs, axis=-1)
    tokens = [_sample_one(logprobs[i], p, idx)
              for i, (p, idx) in enumerate(zip(params, sample_indexes))]
    return mx.stack(tokens)


def _biased(row: mx.array, bias: tuple[tuple[int, float], ...]) -> mx.array:
    """OpenAI's logit_bias, as mlx-lm's logits processor applies it: added to the logits."""
    vocab = row.shape[-1]
    pairs = [(t, b) for t, b in bias if 0 <= t < vocab]  # ids past the model's head: no logit
    if not pairs:
        return row
    ids = mx.array([t for t, _ in pairs])
    return row.at[ids].add(mx.array([b for _, b in pairs], dtype=row.dtype))


def _sample_one(logprobs: mx.array, p: SamplingParams, sample_index: int) -> mx.array:
    if p.temperature == 0:
        return mx.argmax(logprobs, axis=-1)
    vocab = logprobs.shape[-1]
    if 0 < p.top_k < vocab:
        logprobs = apply_top_k(logprobs, p.top_k)
    if 0 < p.top_p < 1:
        logprobs = apply_top_p(logprobs, p.top_p)
    if p.min_p > 0:
        logprobs = apply_min_p(logprobs, p.min_p)
    key = mx.random.key((p.seed * _INDEX_STRIDE + sample_index) % 2**63)
    return mx.random.categorical(logprobs * (1.0 / p.temperature), key=key)
