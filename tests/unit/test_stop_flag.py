"""A stop signal ends a service loop's wait at once: `StopFlag` is set and its file turns
readable, so a poll over it and the loop's sockets returns instead of running to its timeout
(proto/service_loop.py)."""

from __future__ import annotations

import os
import select
import signal

import pytest

from switchyard.proto.service_loop import StopFlag


@pytest.fixture
def stop_flag():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    flag = StopFlag()
    try:
        yield flag
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(flag._wake_read)
        os.close(flag._wake_write)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_sets_the_flag_and_wakes_a_poll(stop_flag, sig):
    assert not stop_flag.requested
    assert select.select([stop_flag.fileno()], [], [], 0)[0] == []  # nothing to wake for yet
    os.kill(os.getpid(), sig)  # the handler runs before the next bytecode of this thread
    assert stop_flag.requested
    assert select.select([stop_flag.fileno()], [], [], 10)[0] == [stop_flag.fileno()]


def test_more_signals_than_the_pipe_holds_neither_block_nor_fail(stop_flag):
    for _ in range(70_000):  # more bytes than a pipe holds (64 KiB on Linux)
        stop_flag._set()
    assert stop_flag.requested
    assert select.select([stop_flag.fileno()], [], [], 0)[0] == [stop_flag.fileno()]
