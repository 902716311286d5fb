from types import SimpleNamespace

import pytest

from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.prefill_plan import MIN_DECODE_SHARE, prefill_share
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


# --- who a step's prefill must not slow, and how much (prefill_plan.prefill_share) -------------


def request(interactive=True, generated=(), arrived_at=0.0, tenant=""):
    return SimpleNamespace(interactive=interactive, generated=list(generated),
                           arrived_at=arrived_at, tenant=tenant)


def config(**kw):
    return CoreConfig(num_slots=4, ctx=4096, prefill_chunk=512, max_queue=8, **kw)


CFG = config(decode_share=0.5, background_wait_s=30.0)


def test_one_stream_beside_one_long_prefill_keeps_the_decode_share():
    """The promise: a chat stream beside an agent's long prompt keeps half its speed."""
    share = prefill_share([request(generated=[1])], [request()], 1.0, CFG)
    assert (share.decode_share, share.num_protected, share.num_waiting) == (0.5, 1, 1)


@pytest.mark.parametrize("num_decoding, num_waiting, expected", [
    (3, 10, 3 / 13),  # tool results waiting behind a few short replies: prefill gets most
    (1, 20, MIN_DECODE_SHARE),  # never below the floor
    (10, 2, 0.5),  # never above --decode-share
])
def test_streams_and_waiting_requests_share_the_machine_as_equal_parties(
        num_decoding, num_waiting, expected):
    decoding = [request(generated=[1]) for _ in range(num_decoding)]
    waiting = [request() for _ in range(num_waiting)]
    share = prefill_share(decoding, waiting, 1.0, CFG)
    assert share.decode_share == pytest.approx(expected)
    assert (share.num_protected, share.num_waiting) == (num_decoding, num_waiting)


def test_a_request_that_has_tokens_does_not_count_as_waiting():
    """A preempted request resuming its prefill has had its first token."""
    share = prefill_share([request(generated=[1])], [request(generated=[5])] * 4, 1.0, CFG)
    assert (share.decode_share, share.num_waiting) == (0.5, 0)


def test_background_streams_are_not_protected():
    """Nobody reads a background stream's pace (a cron job, a sub-agent): a request waiting
    for its first token takes what an interactive stream's share leaves."""
    decoding = [request(generated=[1]), request(interactive=False, generated=[1])]
    share = prefill_share(decoding, [request()], 1.0, CFG)
    assert (share.num_protected, share.num_waiting, share.decode_share) == (1, 1, 0.5)
    share = prefill_share(decoding, [request(interactive=False)], 1.0, CFG)
    assert (share.num_protected, share.num_waiting, share.decode_share) == (1, 1, 0.5)
    # Sub-agents alone: their tool results prefill at full speed beside their replies.
    agents = [request(interactive=False, generated=[1]) for _ in range(3)]
    share = prefill_share(agents, [request(interactive=False)], 1.0, CFG)
    assert (share.num_protected, share.num_waiting) == (0, 1)
    budget = PrefillBudget(512, 0.5)
    budget.observe(3, 0.2, 100, 0.01 * 100)
    assert budget.grant(share.num_protected, share.decode_share) == 512
    assert budget.grant(1, 0.5) == 17  # one protected stream: 0.85 x 0.2 s of prefill a step


def test_waiting_background_requests_count_only_without_an_interactive_head():
    decoding = [request(generated=[1])]
    waiting = [request(), request(interactive=False), request(interactive=False)]
    share = prefill_share(decoding, waiting, 1.0, CFG)
    assert (share.num_protected, share.num_waiting) == (1, 1)
    share = prefill_share(decoding, waiting[1:], 1.0, CFG)
    assert (share.num_protected, share.num_waiting) == (1, 2)
    # A background request that waited out --background-wait counts as interactive.
    share = prefill_share(decoding, [waiting[0], request(interactive=False, arrived_at=-40)],
                          1.0, CFG)
    assert share.num_waiting == 2
    # Another tenant's interactive head does not make a tenant's background wait: it counts.
    share = prefill_share(decoding, [request(tenant="bob"),
                                     request(interactive=False, tenant="alice")], 1.0, CFG)
    assert share.num_waiting == 2


def test_share_zero_still_disables_protection():
    cfg = config(decode_share=0.0)
    share = prefill_share([request(generated=[1])], [request()] * 3, 1.0, cfg)
    assert share.decode_share == 0.0


def test_the_budget_grants_more_at_a_smaller_share():
    b = PrefillBudget(512, 0.5)
    b.observe(2, 0.010, 100, 0.0005 * 100)
    assert b.allowance(2) == pytest.approx(17, abs=0.1)
    assert b.allowance(2, 0.1) == pytest.approx(0.85 * 0.010 * 9 / 0.0005)
