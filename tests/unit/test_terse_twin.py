"""The terse twin (`--model tiny-terse`, twins/models.py make_terse) ends its replies:
under plain sampling (temperature 1, as agent clients send) every reply stops at its end token
within a few dozen tokens, and carries no markup or control token."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from switchyard.twins import tokenizer as tiny_tokenizer
from switchyard.twins.models import write_tiny_mlx

LIMIT = 200  # tokens: the longest reply the test allows (the median is about a dozen)


@pytest.fixture(scope="module")
def terse(tmp_path_factory):
    from mlx_lm import load

    path = write_tiny_mlx(tmp_path_factory.mktemp("terse") / "tiny-terse", "qwen3", 0, terse=True)
    return load(str(path))


def sample(model, ids: list[int], seed: int, eos: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[:, -1, :]
    key = mx.random.key(seed)
    out = []
    while len(out) < LIMIT:
        key, sub = mx.random.split(key)
        token = mx.random.categorical(logits, key=sub).item()
        out.append(token)
        if token == eos:
            break
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


def test_sampled_replies_end_soon_and_are_plain_text(terse):
    model, tok = terse
    eos = tok.convert_tokens_to_ids(tiny_tokenizer.EOS_TOKEN)
    muted = {tok.convert_tokens_to_ids(t)
             for t in (*tiny_tokenizer.CONTROL_TOKENS, *tiny_tokenizer.MARKUP_TOKENS)} - {eos}
    words = " ".join(tiny_tokenizer._WORDS).split()
    lengths = []
    for seed in range(6):
        rng = random.Random(seed)
        text = " ".join(rng.choice(words) for _ in range(rng.choice((10, 100, 600))))
        ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}],
                                      add_generation_prompt=True)
        out = sample(model, ids, seed, eos)
        assert out[-1] == eos, f"no end within {LIMIT} tokens"
        assert not muted & set(out)
        lengths.append(len(out))
    # A reply, not an end token at once (a client takes an empty turn for a failure and retries).
    assert 3 <= sorted(lengths)[len(lengths) // 2] <= 60, lengths
