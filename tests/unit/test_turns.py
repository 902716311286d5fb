"""scheduler.turns: the turns the scheduler remembers and the tails they ended in."""

from switchyard.scheduler.turns import Anchor, RecentTurns


def anchor(i: int, parent: bytes = b"p") -> Anchor:
    return Anchor(10 + i, parent, bytes([i]) * 16)


def test_a_tail_is_owned_while_a_turn_that_ended_in_it_is_remembered():
    turns = RecentTurns()
    a, b = anchor(1), anchor(2)
    turns.ended_in(a, b"t")
    turns.ended_in(b, b"t")  # the same tail (identical prompts): two owners
    turns.retire(a)
    assert turns.owned(b"t")
    turns.retire(b)
    assert not turns.owned(b"t")


def test_the_oldest_turn_is_forgotten_first_and_a_placement_renews_one():
    turns = RecentTurns(capacity=2)
    a, b, c = anchor(1), anchor(2), anchor(3)
    turns.ended_in(a, b"ta")
    turns.ended_in(b, b"tb")
    turns.begin(a)  # placed again: the newest now
    turns.ended_in(c, b"tc")
    assert len(turns) == 2
    assert turns.owned(b"ta") and turns.owned(b"tc") and not turns.owned(b"tb")
    assert set(turns.under([b"p"])) == {a, c}


def test_a_tail_that_left_the_disk_is_no_ones():
    turns = RecentTurns()
    a = anchor(1, parent=b"q")
    turns.ended_in(a, b"t")
    turns.forget_tail(b"t")
    assert not turns.owned(b"t")
    assert turns.under([b"q"]) == [a]  # the turn is still known (its next tails are its)
    turns.retire(a)
    assert turns.under([b"q"]) == []
