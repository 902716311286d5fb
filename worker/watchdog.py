"""A worker group rank's watchdog: the rank ends when one collective outlasts a limit
(docs/design/worker-groups.md "Worker groups", "Failures").

A peer that vanishes without closing its TCP connection (power loss, a frozen Mac, a pulled
cable) never makes a ring collective fail: the rank waits in it forever. The serving thread
marks each operation that waits on the other ranks (`watching`); a daemon thread sleeps until
the current operation's deadline and, if the same operation is still running, calls
`on_timeout` (which logs and `os._exit`s: the blocked thread cannot be unwound). MLX releases
the GIL while it waits in a collective, so the thread runs. Cost per operation: two attribute
writes; the thread wakes about once per limit.
"""

from __future__ import annotations

import contextvars
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


class CollectiveWatch:
    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if limit_s <= 0:
            raise ValueError(f"the group timeout must be positive, not {limit_s}")
        self.limit_s = limit_s
        self.clock = clock
        # (operation, started): one tuple, replaced whole, so the watching thread reads a
        # consistent pair without a lock.
        self._current: tuple[str, float] | None = None

    @contextmanager
    def watching(self, operation: str) -> Iterator[None]:
        """Mark `operation` (e.g. "ping", "step 17") as running until the block ends."""
        self._current = (operation, self.clock())
        try:
            yield
        finally:
            self._current = None

    def overdue(self, now: float) -> tuple[str, float] | None:
        """(operation, seconds waited) when the running operation has outlasted the limit."""
        current = self._current
        if current is not None and now - current[1] >= self.limit_s:
            return current[0], now - current[1]
        return None

    def sleep_s(self, now: float) -> float:
        """How long the watching thread may sleep: until the running operation's deadline,
        or a whole limit when none runs (one that starts meanwhile has a later deadline)."""
        current = self._current
        if current is None:
            return self.limit_s
        return max(0.0, current[1] + self.limit_s - now)

    def start(self, on_timeout: Callable[[str, float], None]) -> threading.Thread:
        """Watch in a daemon thread; `on_timeout(operation, waited_s)` is called once, when an
        operation is overdue, and is expected to end the process."""
        def run() -> None:
            while True:
                now = self.clock()
                found = self.overdue(now)
                if found is not None:
                    on_timeout(*found)
                    return
                time.sleep(self.sleep_s(now))

        # In the starting thread's context: log lines keep the fields bound there (role, pid).
        thread = threading.Thread(target=contextvars.copy_context().run, args=(run,),
                                  name="group-watchdog", daemon=True)
        thread.start()
        return thread
