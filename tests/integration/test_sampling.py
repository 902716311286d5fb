"""The worker's sampler (MLX): logit_bias moves the choice, greedy or sampled."""

from __future__ import annotations

import mlx.core as mx

from switchyard.proto.values import SamplingParams
from switchyard.worker.sampling import sample_rows


def test_logit_bias_forces_and_forbids_tokens():
    logits = mx.random.normal((3, 64), key=mx.random.key(0))
    top = int(mx.argmax(logits[0]).item())
    forced = 7 if top != 7 else 8
    params = [SamplingParams(logit_bias=((forced, 100.0),)),
              SamplingParams(logit_bias=((top, -100.0), (10**6, 5.0))),  # an id past the head
              SamplingParams(temperature=1.0, seed=3, logit_bias=((forced, 100.0),))]
    for index in range(5):
        rows = sample_rows(mx.stack([logits[0]] * 3), params, [index] * 3)
        assert rows[0] == forced and rows[1] != top and rows[2] == forced
    assert sample_rows(logits[:1], [SamplingParams()], [0]) == [top]  # no bias: unchanged
