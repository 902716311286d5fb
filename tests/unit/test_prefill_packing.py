"""Which prefill chunks share a forward pass (worker/prefill_packing.py): near-equal chunks
go together, padding stays within its bound, every chunk runs exactly once."""

import pytest

from switchyard.worker.prefill_packing import MAX_PADDING, context_per_weight_read, pack_groups


def padding_shares(lengths, group):
    width = max(lengths[i] for i in group)
    return [1 - lengths[i] / width for i in group]


def test_equal_chunks_share_one_pass():
    assert pack_groups([64, 64, 64, 64]) == [[0, 1, 2, 3]]


def test_a_lone_chunk_is_its_own_group():
    assert pack_groups([300]) == [[0]]
    assert pack_groups([]) == []


def test_a_short_chunk_does_not_pad_a_long_pass():
    # 500 + 12 as one pass would be half padding: two passes.
    assert pack_groups([12, 500]) == [[1], [0]]


def test_near_equal_tool_results_share_a_pass_and_outliers_do_not():
    lengths = [410, 395, 402, 40, 38, 420]
    groups = pack_groups(lengths)
    assert groups == [[5, 0, 2, 1], [3, 4]]
    for group in groups:
        assert max(padding_shares(lengths, group)) <= MAX_PADDING


@pytest.mark.parametrize("lengths", [[1, 2, 3, 4, 5, 6, 7, 8], [512, 1, 256, 200, 7, 7, 300],
                                     [100] * 9 + [76, 75, 74, 25]])
def test_every_chunk_once_and_padding_bounded(lengths):
    groups = pack_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert max(padding_shares(lengths, group)) <= MAX_PADDING


def test_no_padding_allowed_groups_only_equal_lengths():
    assert pack_groups([8, 8, 7, 8], max_padding=0) == [[0, 1, 3], [2]]


def test_a_padding_bound_out_of_range_is_refused():
    with pytest.raises(ValueError, match="max_padding"):
        pack_groups([1, 2], max_padding=1.0)


def test_long_contexts_keep_their_own_pass():
    """Copying a row's context into the batch and back must cost less than the weight reads
    the group saves: `context_per_read` tokens of context per read saved."""
    lengths, contexts = [32, 30, 28, 31], [45, 0, 70, 5000]
    # 45 + 0 fits one saved read of 50; adding 70 (115 > 2 x 50) does not; 5000 never fits.
    assert pack_groups(lengths, contexts, 50) == [[0, 1], [3], [2]]
    assert pack_groups(lengths, contexts, 10_000) == [[0, 3, 1, 2]]
    # Fresh prompts (no context) always pack, even before the bound is known (0).
    assert pack_groups(lengths, [0] * 4, 0) == [[0, 3, 1, 2]]


def test_context_per_weight_read():
    # 540 MB of weights, 46 KB of KV per token, read and written: 5859 tokens move 540 MB.
    assert context_per_weight_read(540_000_000, 46_080) == 5859
    assert context_per_weight_read(1000, 0) == 1000  # no attention KV: never 0 / 0
