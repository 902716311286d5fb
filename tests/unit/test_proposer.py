"""The suffix/n-gram proposer (scheduler/proposer.py): what it copies, from where, how much,
and that its memory and per-step work stay bounded."""

from switchyard.scheduler.proposer import MAX_MATCH, Proposal, Proposer, ProposerConfig


def draft(p: Proposer, rid: str, limit: int, batch: int = 1) -> tuple[int, ...]:
    """What a lone request (or one of `batch` alike) would verify: the proposal cut to the
    step's width."""
    proposal = p.propose(rid, limit)
    if proposal is None:
        return ()
    return proposal.tokens[:p.width([proposal] * batch) - 1]

FILE = [100 + (i * 7919) % 5000 for i in range(600)]  # a "file": no n-gram repeats


def test_a_reply_that_copies_its_prompt_gets_the_rest_of_the_copy_proposed():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = [1, 2, 3] + FILE + [4, 5]  # a tool result, then the reply starts copying it
    p.start("r", feed)
    feed += FILE[:20]
    p.extend("r")
    got = draft(p, "r", 8)
    assert got and list(got) == FILE[20:20 + len(got)]


def test_longer_matches_and_good_acceptance_give_longer_drafts():
    p = Proposer(ProposerConfig(max_draft=16))
    feed = list(FILE[:300]) + [9, 9]
    p.start("r", feed)
    feed += FILE[:2]  # two tokens of the copy: a short match
    p.extend("r")
    short = draft(p, "r", 16)
    feed += FILE[2:40]
    p.extend("r")
    for _ in range(6):
        p.observe("r", 8, 8)
    long = draft(p, "r", 16)
    assert 0 < len(short) < len(long) == 16
    assert list(long) == FILE[40:56]


def test_poor_acceptance_stops_proposals_where_matches_are_short():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = [5, 6, 7, 8, 5, 6, 9, 9, 5]
    p.start("r", feed)
    feed.append(6)
    p.extend("r")
    assert draft(p, "r", 8)  # "5 6" was followed by 7 and 9: something is proposed
    for _ in range(10):
        p.observe("r", 2, 0)
    assert draft(p, "r", 8) == ()


def test_nothing_matches_nothing_is_proposed():
    p = Proposer()
    p.start("r", list(FILE[:50]))
    assert draft(p, "r", 8) == ()


def test_the_limit_caps_the_draft():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = list(FILE[:100]) + FILE[:30]
    p.start("r", feed)
    for _ in range(5):
        p.observe("r", 4, 4)
    assert len(draft(p, "r", 3)) == 3
    assert draft(p, "r", 0) == ()


def test_conversations_help_each_other():
    """A sub-agent repeating another's tool call gets it proposed from the other's output."""
    p = Proposer()
    call = [7000 + i for i in range(40)]
    a = [1, 2, 3, 4]
    p.start("a", a)
    a += call + [2]
    p.extend("a")
    p.finish("a")  # finished requests stay to copy from
    b = [9, 8, 7, 6] + call[:6]
    p.start("b", b)
    got = draft(p, "b", 8)
    assert got and list(got) == call[6:6 + len(got)]


def test_finished_requests_are_kept_up_to_a_token_budget():
    p = Proposer(ProposerConfig(keep_tokens=1000, window=400))
    for i in range(10):
        feed = [10_000 * (i + 1) + j for j in range(500)]
        p.start(f"r{i}", feed)
        p.finish(f"r{i}")
    kept = sum(len(s.tokens) for s in p._sources.values())
    assert kept <= 1000
    # The oldest are gone: their n-grams no longer match anything.
    p.start("q", [10_000 + j for j in range(200, 210)])
    assert draft(p, "q", 8) == ()
    p.start("q2", [100_000 + j for j in range(200, 210)])
    assert draft(p, "q2", 8)


def test_a_prompt_is_indexed_only_in_its_window():
    p = Proposer(ProposerConfig(window=100))
    prompt = list(FILE[:500])
    p.start("r", prompt + FILE[10:20])  # repeats text from before the window
    assert draft(p, "r", 8) == ()
    p.start("s", prompt + FILE[450:460])  # repeats text inside it
    assert draft(p, "s", 8)


def test_a_match_is_measured_backwards_at_most_max_match_tokens():
    p = Proposer(ProposerConfig(max_draft=4))
    text = list(FILE[:200])
    feed = text + text[:150]
    p.start("r", feed)
    assert draft(p, "r", 4) == tuple(text[150:154])
    assert MAX_MATCH < 150  # the backward walk stopped early: O(MAX_MATCH), not O(context)


def test_counts_follow_what_was_observed():
    p = Proposer()
    p.start("r", [1, 2, 3])
    p.observe("r", 5, 3)
    p.observe("r", 2, 2)
    assert p.counts("r") == (7, 5)
    p.finish("r")
    assert p.counts("r") == (0, 0)


def test_the_width_follows_what_a_pass_costs_on_this_machine():
    """Where a row's extra token costs nearly nothing (a GPU), long drafts pay even for a
    batch; where it costs a sixth of a pass (a CPU), one copying row does not pay for padding
    three others (a lone one still drafts), and an uncertain draft is cut shorter."""
    copying = Proposer(ProposerConfig(max_draft=8))
    copying.start("r", list(FILE[:200]) + FILE[:40])
    for _ in range(8):
        copying.observe("r", 8, 8)
    proposal = copying.propose("r", 8)
    assert proposal is not None and proposal.acceptance > 0.9
    batch = [proposal, None, None, None]
    for pass_s, row_s in ((0.020, 0.0001), (0.30, 0.05)):
        copying._pass_s, copying._row_s = {}, None
        for b in (1, 4):
            copying.observe_cost(b, pass_s, 1)
        for b in (1, 4):
            copying.observe_cost(b, pass_s + row_s * b * 4, 5)
        assert abs(copying.row_cost(1) - row_s / pass_s) < 1e-9
        unsure = Proposal(proposal.tokens, 0.6)
        if row_s < 0.001:
            assert copying.width([proposal]) == 9 and copying.width(batch) == 9
            assert copying.width([unsure]) == 9
        else:
            assert copying.width([proposal]) > 1 and copying.width(batch) == 1
            assert 1 < copying.width([unsure]) < 5


def test_always_verifies_every_whole_proposal():
    """--speculative suffix: the whole proposal, however poor this request's acceptance and
    however dear a row (auto would not draft here)."""
    p = Proposer(ProposerConfig(max_draft=8, always=True))
    feed = list(FILE[:100]) + FILE[:30]
    p.start("r", feed)
    for _ in range(10):
        p.observe("r", 4, 0)
    p.observe_cost(1, 0.02, 1)
    p.observe_cost(1, 0.02 + 8 * 0.05, 9)
    proposal = p.propose("r", 8)
    assert p.width([proposal, None]) == 9 and p.width([None, None]) == 1


def test_a_row_cost_measured_on_a_busy_moment_relaxes_back():
    """One verify pass timed while the machine was busy (a row as dear as 2.5 passes) moves
    the estimate little: drafts go on. Rows that stay dear turn drafts off; then no verify
    pass would measure them again, so plain passes bring the estimate back toward the prior,
    and drafts return."""
    copying = Proposer(ProposerConfig(max_draft=8))
    copying.start("r", list(FILE[:200]) + FILE[:40])
    for _ in range(8):
        copying.observe("r", 8, 8)
    proposal = copying.propose("r", 8)
    copying.observe_cost(1, 0.02, 1)
    copying.observe_cost(1, 0.02 + 8 * 0.05, 9)
    assert copying.width([proposal]) > 1
    for _ in range(30):
        copying.observe_cost(1, 0.02 + 8 * 0.05, 9)
    assert copying.width([proposal]) == 1
    for _ in range(200):
        copying.observe_cost(1, 0.02, 1)
    assert copying.width([proposal]) > 1


def test_a_round_trip_a_burst_would_share_counts_against_drafts():
    """Where passes are short (a GPU) the round trip to the scheduler is a large part of a
    step. Plain steps share it over a decode burst; a verify step pays it whole. So an
    uncertain draft that beats one plain pass does not beat a burst, and is verified where
    the step pays the trip anyway (others waiting: a burst of 1). A sure copy still pays."""
    p = Proposer(ProposerConfig(max_draft=8))
    p.start("r", list(FILE[:200]) + FILE[:40])
    for _ in range(8):
        p.observe("r", 8, 8)
    sure = p.propose("r", 8)
    unsure = Proposal(sure.tokens, 0.35)
    p.observe_cost(1, 0.010, 1)
    p.observe_cost(1, 0.010 + 8 * 0.0002, 9)  # a GPU: a row costs 2% of a pass
    assert p.width([unsure], burst=8) > 1  # no trip measured yet: as before
    for _ in range(5):
        p.observe_trip(0.005)  # half a pass
    assert abs(p.trip_cost(1) - 0.5) < 1e-9
    assert p.width([unsure], burst=8) == 1
    assert p.width([unsure], burst=1) > 1
    assert p.width([sure], burst=8) > 1
