"""A worker group rank's watchdog without MLX or sockets: which operation is overdue, how long
the watching thread sleeps, and that the thread reports a blocked operation
(docs/design/worker-groups.md "Worker groups", "Failures")."""

import threading
import time

import pytest

from switchyard.worker.watchdog import CollectiveWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_operation_is_overdue_only_once_it_outlasts_the_limit():
    clock = Clock()
    watch = CollectiveWatch(10.0, clock)
    assert watch.overdue(clock.now + 1000) is None  # nothing running: nothing overdue
    with watch.watching("ping"):
        assert watch.overdue(clock.now + 9.9) is None
        assert watch.overdue(clock.now + 10.0) == ("ping", 10.0)
    assert watch.overdue(clock.now + 1000) is None  # it completed


def test_each_operation_is_timed_from_its_own_start():
    clock = Clock()
    watch = CollectiveWatch(10.0, clock)
    with watch.watching("step 1"):
        clock.now += 8
    with watch.watching("step 2"):  # a long run of short steps never adds up
        clock.now += 8
        assert watch.overdue(clock.now) is None
        clock.now += 3
        assert watch.overdue(clock.now) == ("step 2", 11.0)


def test_an_operation_that_raises_is_no_longer_watched():
    clock = Clock()
    watch = CollectiveWatch(10.0, clock)
    with pytest.raises(RuntimeError):
        with watch.watching("stop"):
            raise RuntimeError("[ring] connection to a peer was lost")
    assert watch.overdue(clock.now + 1000) is None


def test_the_thread_sleeps_until_the_running_operations_deadline():
    clock = Clock()
    watch = CollectiveWatch(10.0, clock)
    assert watch.sleep_s(clock.now) == 10.0  # idle: one that starts now is due no sooner
    with watch.watching("step 7"):
        clock.now += 4
        assert watch.sleep_s(clock.now) == 6.0
        clock.now += 7
        assert watch.sleep_s(clock.now) == 0.0


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        CollectiveWatch(0)


def test_the_thread_reports_a_blocked_operation_once():
    watch = CollectiveWatch(0.05)
    reports = []
    reported = threading.Event()

    def on_timeout(operation: str, waited_s: float) -> None:
        reports.append((operation, waited_s))
        reported.set()

    watch.start(on_timeout)
    with watch.watching("broadcast of step 3"):
        assert reported.wait(30), "the watchdog never reported the blocked operation"
        time.sleep(0.2)  # still blocked: no second report
    assert len(reports) == 1
    operation, waited_s = reports[0]
    assert operation == "broadcast of step 3" and waited_s >= 0.05
