"""Which prefill chunks share a forward pass (worker/prefill_packing.py): near-equal chunks
go together, padding stays within its bound, every chunk runs exactly once."""

import pytest

from switchyard.worker.prefill_packing import MAX_PADDING, pack_groups


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
