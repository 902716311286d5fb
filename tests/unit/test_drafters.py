"""The pure parts of drafts made in the worker (worker/drafters.py): whether a draft model's
tokenizer can draft for the model, and where a draft stops being worth verifying."""

from switchyard.worker.drafters import draft_end, vocab_difference

VOCAB = {"<|im_end|>": 0, "a": 1, "b": 2, "ab": 3}


def test_the_same_vocabulary_and_stop_ids_can_draft():
    assert vocab_difference(VOCAB, {0}, dict(VOCAB), {0}) == ""


def test_a_different_size_map_or_stop_ids_is_named():
    assert vocab_difference(VOCAB, {0}, {**VOCAB, "c": 4}, {0}) == \
        "vocabularies of 5 and 4 tokens"
    swapped = {**VOCAB, "a": 2, "b": 1}
    assert vocab_difference(VOCAB, {0}, swapped, {0}) == \
        "token 'b' is id 1 in the draft model's vocabulary and 2 in the model's"
    renamed = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}
    assert "'<|endoftext|>' is id 0" in vocab_difference(VOCAB, {0}, renamed, {0})
    assert vocab_difference(VOCAB, {0}, VOCAB, {0, 3}) == \
        "end-of-sequence ids [0, 3] (draft model) and [0] (model)"


def test_a_draft_ends_at_its_first_stop_token():
    assert draft_end([5, 6, 7], (0,)) == 3
    assert draft_end([5, 0, 7], (0,)) == 2
    assert draft_end([], (0,)) == 0
