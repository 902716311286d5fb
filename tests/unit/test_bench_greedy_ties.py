"""bench/greedy_ties.py's walk: a reply is greedy up to float ties, on a scripted model."""

import numpy as np

from bench.greedy_ties import follows_greedy

VOCAB = ["a", "b", "c", "\xe9"]


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def model(table):
    """Next-token logits from the text so far (a dict; unknown texts prefer "c")."""
    def next_logits(path):
        return np.array(table.get(decode(path), [0.0, 0.0, 1.0, 0.0]), dtype=np.float32)
    return next_logits


FLAT = model({"": [5.0, 5.0 - 1e-5, 1.0, 0.0],  # a and b tie; c is far below
              "a": [0.0, 3.0, 0.0, 0.0], "b": [4.0, 0.0, 0.0, 0.0]})


def test_the_greedy_reply_and_the_other_side_of_a_tie_follow_greedy():
    assert follows_greedy("abc", FLAT, decode, 3)
    assert follows_greedy("bac", FLAT, decode, 3)  # b: 1e-5 below a; then greedy from b


def test_a_token_far_below_the_best_or_a_wrong_continuation_does_not():
    assert not follows_greedy("cc", FLAT, decode, 2)
    assert not follows_greedy("bbc", FLAT, decode, 3)  # after b the model says a
    assert not follows_greedy("abcc", FLAT, decode, 3)  # more tokens than it may have
    assert not follows_greedy("ba", FLAT, decode, 2, tie=1e-6)  # a tighter tie: b is out
    assert follows_greedy("ba", FLAT, decode, 2)


def test_a_token_ending_in_an_incomplete_character_may_start_the_reply():
    """Token 3 is the first byte of a character: alone at the end it decodes to U+FFFD, the
    reply has the character it starts (here: as if with the c after it)."""
    def partial(ids):
        return decode(ids[:-1]) + "\ufffd" if ids and ids[-1] == 3 else decode(ids)

    assert follows_greedy("\xe9c", model({"": [0.0, 0.0, 0.0, 9.0]}), partial, 2)
