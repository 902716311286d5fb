"""`TokenIds` behaves as a read-only sequence of ints, equal to the tuple of the same ids."""

import numpy as np
import pytest

from switchyard.common.page_ids import token_bytes
from switchyard.proto.tokens import TokenIds


def test_sequence_behaviour_matches_a_tuple():
    ids = (5, 0, 2**32 - 1, 7, 7)
    t = TokenIds(ids)
    assert len(t) == 5 and list(t) == list(ids) and t[2] == 2**32 - 1 and t[-1] == 7
    assert t[1:3] == ids[1:3] and isinstance(t[1:3], TokenIds)
    assert t == ids and t == list(ids) and t != ids[:-1] and t != (5, 0, 1, 7, 7)
    assert hash(t) == hash(ids)
    assert 7 in t and 8 not in t and t.index(7) == 3 and t.count(7) == 2
    assert t + (1,) == ids + (1,) and (1,) + t == (1,) + ids and t + t == ids + ids
    assert not TokenIds() and TokenIds() == ()


def test_wire_form_round_trips_and_rejects_partial_ids():
    t = TokenIds([1, 2, 70000])
    assert TokenIds.frombytes(t.tobytes()) == t
    with pytest.raises(ValueError):
        TokenIds.frombytes(b"\x00" * 5)


def test_out_of_range_ids_are_rejected():
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError):
            TokenIds(bad)


def test_numpy_sees_the_ids_read_only_and_hashing_agrees_with_a_tuple():
    t = TokenIds(range(600))
    arr = np.asarray(t)
    assert arr.dtype == np.uint32 and arr.tolist() == list(range(600))
    with pytest.raises(ValueError):
        arr[0] = 1
    assert token_bytes(t) == token_bytes(tuple(range(600)))
