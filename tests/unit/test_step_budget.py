import pytest

from switchyard.scheduler.step_budget import PrefillBudget


def test_full_chunks_when_nobody_decodes_or_nothing_is_measured():
    b = PrefillBudget(512, 0.5)
    assert b.grant(3) == 512  # no measurements yet
    b.observe(1, 0.010, 256, 0.256)
    assert b.grant(0) == 512


@pytest.mark.parametrize("share, decode_s, token_s, expected", [
    (0.5, 0.010, 0.0005, 17),    # prefill may take as long as the decode: 0.85 x 10 / 0.5
    (0.25, 0.010, 0.0005, 51),   # streams may slow to a quarter: 0.85 x 3 x decode time
    (0.5, 0.010, 0.00001, 512),  # cheap tokens: capped by the largest chunk
])
def test_allowance_keeps_decoding_streams_at_their_share(share, decode_s, token_s, expected):
    b = PrefillBudget(512, share)
    b.observe(2, decode_s, 100, token_s * 100)
    assert b.grant(2) == expected


@pytest.mark.parametrize("allowance_tokens", [2, 5, 10])
def test_small_allowances_alternate_chunks_with_decode_only_steps(allowance_tokens):
    """Below one minimum chunk the average still holds: chunk steps and decode-only steps."""
    b = PrefillBudget(512, 0.5, min_tokens=16)
    b.observe(1, 0.010 / 0.85, 100, 100 * 0.010 / allowance_tokens)
    grants = []
    for _ in range(160):
        g = b.grant(1)
        b.spend(g)
        grants.append(g)
    assert 0 in grants and max(grants) >= 16
    assert abs(sum(grants) / len(grants) - allowance_tokens) <= 16 / len(grants) * 2


def test_budget_follows_a_growing_prefill_cost():
    b = PrefillBudget(512, 0.5)
    b.observe(1, 0.010, 100, 0.05)  # 0.5 ms per token
    first = b.allowance(1)
    for _ in range(20):
        b.observe(1, 0.010, 100, 0.2)  # long context: 2 ms per token
    assert b.allowance(1) < first / 3


def test_share_zero_disables_the_limit():
    b = PrefillBudget(512, 0.0)
    b.observe(1, 0.010, 100, 1.0)
    assert b.grant(1) == 512


def test_a_step_prefills_at_most_about_ten_seconds_of_tokens():
    """A slow machine deep in a long context: chunks shrink to what fits the step bound."""
    b = PrefillBudget(512, 0.5)
    b.observe(0, 0.0, 512, 512 * 0.05)  # 50 ms per token: 512 tokens would take 25.6 s
    assert b.grant(0) == 200
    b.observe(0, 0.0, 16, 16 * 10.0)  # absurdly slow: still at least a minimum chunk
    assert b.chunk_tokens == 16
