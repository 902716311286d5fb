"""Retry backoff after the page disk refused a write (docs/design/kv-pages.md "KV pages").

A disk that was full or unwritable is tried again soon (space is often freed within seconds),
then less and less often while it keeps refusing: FIRST_S, doubling up to MAX_S. One write
that succeeds resets it. Pure: the caller passes the clock.
"""

from __future__ import annotations

FIRST_S = 1.0
MAX_S = 30.0


class Backoff:
    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S):
        if not 0 < first_s <= max_s:
            raise ValueError("need 0 < first_s <= max_s")
        self.first_s, self.max_s = first_s, max_s
        self.delay_s = 0.0  # the wait after the last failure; 0: no failure since a success
        self.retry_at = 0.0

    @property
    def failing(self) -> bool:
        return self.delay_s > 0

    def ready(self, now: float) -> bool:
        """Whether to try now: never failed, succeeded since, or the wait is over."""
        return now >= self.retry_at

    def failed(self, now: float) -> float:
        """A try failed at `now`: the next waits twice as long as the last (returned)."""
        self.delay_s = min(self.max_s, self.delay_s * 2) if self.delay_s else self.first_s
        self.retry_at = now + self.delay_s
        return self.delay_s

    def succeeded(self) -> None:
        self.delay_s, self.retry_at = 0.0, 0.0
