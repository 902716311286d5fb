"""The verifier core (common/speculation.py): scripted proposals accepted fully, partly and not at
all; stop tokens and limits cut what a verify pass emits."""

from switchyard.common.speculation import num_accepted, verified

DRAFT = [11, 12, 13, 14]


def test_a_draft_the_model_agrees_with_is_kept_whole_plus_the_next_token():
    emitted = verified(DRAFT, [11, 12, 13, 14, 15], (), limit=100)
    assert emitted == [11, 12, 13, 14, 15]
    assert num_accepted(DRAFT, emitted) == 4


def test_a_draft_is_kept_up_to_the_first_disagreement_which_the_model_replaces():
    emitted = verified(DRAFT, [11, 12, 99, 14, 15], (), limit=100)
    assert emitted == [11, 12, 99]
    assert num_accepted(DRAFT, emitted) == 2


def test_a_draft_rejected_at_once_still_yields_the_models_token():
    emitted = verified(DRAFT, [7, 12, 13, 14, 15], (), limit=100)
    assert emitted == [7]
    assert num_accepted(DRAFT, emitted) == 0


def test_no_draft_is_a_plain_decode():
    assert verified([], [42], (), limit=100) == [42]
    assert num_accepted([], [42]) == 0


def test_nothing_is_emitted_past_a_stop_token_even_an_accepted_draft():
    emitted = verified(DRAFT, [11, 12, 13, 14, 15], stop_token_ids={12}, limit=100)
    assert emitted == [11, 12]
    assert num_accepted(DRAFT, emitted) == 2


def test_the_limit_caps_what_is_emitted():
    assert verified(DRAFT, [11, 12, 13, 14, 15], (), limit=2) == [11, 12]
    assert num_accepted(DRAFT, [11, 12]) == 2
    assert verified(DRAFT, [11, 99, 13, 14, 15], (), limit=1) == [11]


def test_the_model_may_pick_a_stop_token_in_place_of_a_draft_token():
    emitted = verified(DRAFT, [11, 2, 13, 14, 15], stop_token_ids={2}, limit=100)
    assert emitted == [11, 2]
    assert num_accepted(DRAFT, emitted) == 1
