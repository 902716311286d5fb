"""The suffix/n-gram proposer (scheduler/proposer.py): what it copies, from where, how much,
and that its memory and per-step work stay bounded."""

from switchyard.scheduler.proposer import MAX_MATCH, Proposer, ProposerConfig

FILE = [100 + (i * 7919) % 5000 for i in range(600)]  # a "file": no n-gram repeats


def test_a_reply_that_copies_its_prompt_gets_the_rest_of_the_copy_proposed():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = [1, 2, 3] + FILE + [4, 5]  # a tool result, then the reply starts copying it
    p.start("r", feed)
    feed += FILE[:20]
    p.extend("r")
    draft = p.propose("r", limit=8)
    assert draft and list(draft) == FILE[20:20 + len(draft)]


def test_longer_matches_and_good_acceptance_give_longer_drafts():
    p = Proposer(ProposerConfig(max_draft=16))
    feed = list(FILE[:300]) + [9, 9]
    p.start("r", feed)
    feed += FILE[:2]  # two tokens of the copy: a short match
    p.extend("r")
    short = p.propose("r", limit=16)
    feed += FILE[2:40]
    p.extend("r")
    for _ in range(6):
        p.observe("r", 8, 8)
    long = p.propose("r", limit=16)
    assert 0 < len(short) < len(long) == 16
    assert list(long) == FILE[40:56]


def test_poor_acceptance_stops_proposals_where_matches_are_short():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = [5, 6, 7, 8, 5, 6, 9, 9, 5]
    p.start("r", feed)
    feed.append(6)
    p.extend("r")
    assert p.propose("r", limit=8)  # "5 6" was followed by 7 and 9: something is proposed
    for _ in range(10):
        p.observe("r", 2, 0)
    assert p.propose("r", limit=8) == ()


def test_nothing_matches_nothing_is_proposed():
    p = Proposer()
    p.start("r", list(FILE[:50]))
    assert p.propose("r", limit=8) == ()


def test_the_limit_caps_the_draft():
    p = Proposer(ProposerConfig(max_draft=8))
    feed = list(FILE[:100]) + FILE[:30]
    p.start("r", feed)
    for _ in range(5):
        p.observe("r", 4, 4)
    assert len(p.propose("r", limit=3)) == 3
    assert p.propose("r", limit=0) == ()


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
    draft = p.propose("b", limit=8)
    assert draft and list(draft) == call[6:6 + len(draft)]


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
    assert p.propose("q", limit=8) == ()
    p.start("q2", [100_000 + j for j in range(200, 210)])
    assert p.propose("q2", limit=8)


def test_a_prompt_is_indexed_only_in_its_window():
    p = Proposer(ProposerConfig(window=100))
    prompt = list(FILE[:500])
    p.start("r", prompt + FILE[10:20])  # repeats text from before the window
    assert p.propose("r", limit=8) == ()
    p.start("s", prompt + FILE[450:460])  # repeats text inside it
    assert p.propose("s", limit=8)


def test_a_match_is_measured_backwards_at_most_max_match_tokens():
    p = Proposer(ProposerConfig(max_draft=4))
    text = list(FILE[:200])
    feed = text + text[:150]
    p.start("r", feed)
    assert p.propose("r", limit=4) == tuple(text[150:154])
    assert MAX_MATCH < 150  # the backward walk stopped early: O(MAX_MATCH), not O(context)


def test_counts_follow_what_was_observed():
    p = Proposer()
    p.start("r", [1, 2, 3])
    p.observe("r", 5, 3)
    p.observe("r", 2, 2)
    assert p.counts("r") == (7, 5)
    p.finish("r")
    assert p.counts("r") == (0, 0)
