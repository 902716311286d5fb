"""Speculative decoding's verifier: which proposed tokens a sequence keeps
(docs/design/speculative-decoding.md "Speculative decoding"). Pure: no MLX, no model. The worker
applies it to what a verify pass sampled; the scheduler counts with it what was accepted.

A step feeds a sequence's input token followed by its draft d_0..d_{k-1} (a proposal copied
from text: deterministic, no probabilities of its own) in one forward pass. At every position
i the model's token x_i is sampled exactly as without speculation: the same filters
(temperature, top-k/top-p/min-p, logit bias, grammar mask) and the same stateless key
(seed, sample_index + i) of worker/sampling.py. The sequence keeps x_0..x_a, where a is the
first position whose x_a differs from d_a (or k when all agree).

Why this is exact: for a point-mass draft q = delta(d), standard speculative rejection sampling
accepts d with probability min(1, p(d) / q(d)) = p(d) and on rejection samples the residual
max(0, p - q) renormalized, i.e. p without d. Drawing x ~ p and accepting iff x == d accepts
with probability p(d), and a rejected x is distributed as p conditioned on x != d: the same
residual. So every emitted token has the model's distribution, and since x_i is the very token
the non-speculative step would have sampled at that index, a seeded request produces the same
tokens with or without speculation (up to the float rounding of a multi-row forward pass).
Greedy decoding is the temperature-0 case: x_i is the argmax.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def verified(draft: Sequence[int], targets: Sequence[int], stop_token_ids: Container[int],
             limit: int) -> list[int]:
    """The tokens a sequence emits: the model's tokens `targets` (x_0.. x_k, one per verify
    position, len(draft) + 1 of them) up to and including the first that differs from the
    draft, or all of them; never past a stop token (it is emitted, then nothing) or `limit`
    tokens (the step's burst limit: max_tokens and the context's room)."""
    out: list[int] = []
    for i, token in enumerate(targets):
        out.append(token)
        if token in stop_token_ids or len(out) >= limit:
            break
        if i >= len(draft) or token != draft[i]:
            break
    return out


def num_accepted(draft: Sequence[int], emitted: Sequence[int]) -> int:
    """Draft tokens the sequence kept: those equal to the emitted tokens before the model's own
    next token. (A draft token the grammar or the model rejected is never emitted in its
    place, so the common prefix is exactly the accepted part.)"""
    n = 0
    for d, x in zip(draft, emitted[:-1] if emitted else ()):
        if d != x:
            break
        n += 1
    if emitted and n == len(emitted) - 1 and n < len(draft) and emitted[-1] == draft[n]:
        n += 1  # the last emitted token matched too: cut by a stop token or the limit
    return n
