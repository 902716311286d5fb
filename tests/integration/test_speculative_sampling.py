"""Speculative sampling keeps the model's distribution (docs/design/speculative-decoding.md "Speculative decoding").

A small-vocabulary "model" (a fixed Markov chain over 6 tokens: the logits of the next token
depend on the last one) is sampled with the worker's own sampler (worker/sampling.py) and
verifier (common/speculation.py), without and with drafts that are right part of the time. Over a
fixed set of seeds (so the test cannot flake) the frequencies of each output position match
the chain's exact distribution (chi-square), and each seed's tokens are the same with or
without drafts: the verifier accepts a draft token exactly when it is the token the plain
step samples with the same key.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from switchyard.proto.values import SamplingParams
from switchyard.worker.sampling import sample_lazy
from switchyard.common.speculation import verified

V, LENGTH, START, NUM_SEEDS = 6, 3, 0, 1000
rng = np.random.default_rng(7)
TABLE = mx.array(rng.normal(0.0, 1.2, (V, V)).astype(np.float32))  # logits[prev] -> next


def plain(params: SamplingParams) -> list[int]:
    out, prev = [], START
    for i in range(LENGTH):
        prev = sample_lazy(TABLE[prev][None], [params], [i]).item()
        out.append(prev)
    return out


def speculative(params: SamplingParams, draft_rng: random.Random) -> list[int]:
    out, prev = [], START
    while len(out) < LENGTH:
        draft = [draft_rng.randrange(V) for _ in range(draft_rng.choice([1, 2, 3]))]
        row = [prev, *draft]  # position j's logits follow row[j]
        logits = TABLE[mx.array(row)]
        n = len(out)
        targets = sample_lazy(logits, [params] * len(row), [n + j for j in range(len(row))])
        emitted = verified(draft, targets.tolist(), (), LENGTH - n)
        out += emitted
        prev = emitted[-1]
    return out


def exact_marginals(params: SamplingParams) -> np.ndarray:
    """[LENGTH, V]: the probability of each token at each position, from the chain."""
    logits = np.array(TABLE) / params.temperature
    if params.top_k:  # the top_k likeliest next tokens only
        cut = np.sort(logits, axis=-1)[:, -params.top_k][:, None]
        logits = np.where(logits >= cut, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    dist = np.zeros(V)
    dist[START] = 1.0
    out = []
    for _ in range(LENGTH):
        dist = dist @ probs
        out.append(dist)
    return np.array(out)


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    from math import erf, sqrt

    expected = expected_probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    # Wilson-Hilferty: chi2(dof) -> standard normal, good to ~1e-3 for dof >= 5.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    return 0.5 * (1 - erf(z / sqrt(2)))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_token_frequencies_with_drafts_match_the_model_and_plain_sampling(temperature, top_k):
    draft_rng = random.Random(11)
    with_drafts, without = np.zeros((LENGTH, V)), np.zeros((LENGTH, V))
    same = 0
    for seed in range(NUM_SEEDS):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
        a, b = speculative(params, draft_rng), plain(params)
        same += a == b
        for i, (x, y) in enumerate(zip(a, b)):
            with_drafts[i, x] += 1
            without[i, y] += 1
    assert same == NUM_SEEDS  # the very tokens plain sampling draws, seed by seed
    expected = exact_marginals(SamplingParams(temperature=temperature, top_k=top_k))
    for i in range(LENGTH):
        seen = expected[i] > 0  # top-k: tokens outside every row's top k never come
        assert with_drafts[i][~seen].sum() == 0
        assert chi_square_p(with_drafts[i][seen], expected[i][seen]) > 1e-3, (i, with_drafts[i])
        assert chi_square_p(without[i][seen], expected[i][seen]) > 1e-3, (i, without[i])


def test_a_draft_that_always_agrees_is_accepted_at_the_models_rate():
    """Accepting d with probability p(d) (standard speculative sampling for a point-mass
    draft): a draft of the chain's likeliest next token is kept as often as the model
    draws it."""
    params_of = [SamplingParams(temperature=1.0, seed=s) for s in range(NUM_SEEDS)]
    likeliest = int(np.argmax(np.array(TABLE[START])))
    kept = sum(verified([likeliest], sample_lazy(TABLE[mx.array([START, likeliest])],
                                                 [p, p], [0, 1]).tolist(), (), 2)[0]
               == likeliest for p in params_of)
    p = float(np.array(mx.softmax(TABLE[START]))[likeliest])
    sd = (p * (1 - p) / NUM_SEEDS) ** 0.5
    assert abs(kept / NUM_SEEDS - p) < 4 * sd
