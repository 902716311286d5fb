import pytest

from scheduler.step_budget import PrefillBudget


def test_full_chunks_when_nobody_decodes_or_nothing_is_measured():
    b = PrefillBudget(512, 0.5)
    assert b.tokens(3) == 512  # no measurements yet
    b.observe(1, 0.010, 256, 0.256)
    assert b.tokens(0) == 512


@pytest.mark.parametrize("share, decode_s, token_s, expected", [
    (0.5, 0.010, 0.0005, 20),    # prefill may take as long as the decode: 10 ms / 0.5 ms
    (0.25, 0.010, 0.0005, 60),   # streams may slow to a quarter: 3 x decode time
    (0.5, 0.010, 0.00001, 512),  # cheap tokens: capped by the largest chunk
    (0.9, 0.010, 0.001, 16),     # strict share: floored so prefill still progresses
])
def test_budget_keeps_decoding_streams_at_their_share(share, decode_s, token_s, expected):
    b = PrefillBudget(512, share)
    b.observe(2, decode_s, 100, token_s * 100)
    assert b.tokens(2) == expected


def test_budget_follows_a_growing_prefill_cost():
    b = PrefillBudget(512, 0.5)
    b.observe(1, 0.010, 100, 0.05)  # 0.5 ms per token
    first = b.tokens(1)
    for _ in range(20):
        b.observe(1, 0.010, 100, 0.2)  # long context: 2 ms per token
    assert b.tokens(1) < first
    assert b.tokens(1) == 16  # 10 ms / 2 ms = 5 tokens, floored so prefill still progresses


def test_share_zero_disables_the_limit():
    b = PrefillBudget(512, 0.0)
    b.observe(1, 0.010, 100, 1.0)
    assert b.tokens(1) == 512
