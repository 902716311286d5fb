"""The pure restart policy of the supervisor: backoff, reset after a stable run, give-up."""

import pytest

from switchyard.deploy.restart_policy import GiveUp, Restart, RestartPolicy, RestartTracker

POLICY = RestartPolicy(initial_delay_s=0.5, max_delay_s=4.0, factor=2.0, max_crashes=5,
                       window_s=60.0, stable_after_s=30.0)


def crash_loop(tracker, times):
    """Crash after `ran` seconds at each of `times` (absolute exit times)."""
    return [tracker.on_exit(started_at=t - 1.0, exited_at=t) for t in times]


def test_backoff_doubles_up_to_the_cap():
    tracker = RestartTracker(POLICY)
    decisions = crash_loop(tracker, [10, 11, 12, 13, 14])
    assert [d.delay_s for d in decisions] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert [d.num_restarts for d in decisions] == [1, 2, 3, 4, 5]


def test_gives_up_after_too_many_crashes_in_the_window():
    tracker = RestartTracker(POLICY)
    decisions = crash_loop(tracker, [10, 11, 12, 13, 14, 15])
    assert all(isinstance(d, Restart) for d in decisions[:5])
    assert decisions[5] == GiveUp(num_crashes=6, window_s=60.0)


def test_crashes_outside_the_window_are_forgotten():
    tracker = RestartTracker(POLICY)
    decisions = crash_loop(tracker, [0, 20, 40, 60.5, 80, 100, 120, 140])
    assert all(isinstance(d, Restart) for d in decisions)
    assert tracker.num_restarts == 8


def test_a_stable_run_resets_the_backoff():
    tracker = RestartTracker(POLICY)
    crash_loop(tracker, [10, 11, 12])
    decision = tracker.on_exit(started_at=13.0, exited_at=13.0 + 30.0)
    assert decision == Restart(delay_s=0.5, num_restarts=4)
    assert tracker.on_exit(started_at=44.0, exited_at=45.0).delay_s == 1.0


def test_zero_crashes_allowed_gives_up_at_once():
    tracker = RestartTracker(RestartPolicy(max_crashes=0))
    assert isinstance(tracker.on_exit(0.0, 1.0), GiveUp)


def test_trackers_are_independent():
    a, b = RestartTracker(POLICY), RestartTracker(POLICY)
    crash_loop(a, [1, 2, 3])
    assert b.on_exit(3.0, 4.0) == Restart(delay_s=0.5, num_restarts=1)


@pytest.mark.parametrize("kw", [dict(initial_delay_s=-1), dict(max_delay_s=0.1),
                                dict(factor=0.5), dict(window_s=0)])
def test_policy_rejects_nonsense(kw):
    with pytest.raises(ValueError):
        RestartPolicy(**kw)


def test_a_refusal_to_start_gives_up_at_once():
    tracker = RestartTracker(POLICY)
    assert isinstance(tracker.on_exit(0.0, 1.0, exit_code=1), Restart)
    assert tracker.on_exit(2.0, 3.0, exit_code=2) == GiveUp(num_crashes=1, window_s=60.0,
                                                           refused=True)
    assert isinstance(RestartTracker(RestartPolicy(refusal_exit_codes=())).on_exit(
        0.0, 1.0, exit_code=2), Restart)
