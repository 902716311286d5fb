"""When to restart a crashed component, and when to give up: a pure policy, no clock, no I/O.

The supervisor feeds it (start time, exit time) of each unexpected exit and does what it says.
Backoff doubles with every crash in a row; a child that ran `stable_after_s` before crashing
starts again from the initial delay. More than `max_crashes` crashes within `window_s` means the
component cannot run (port taken, a bug at start), and the group gives up. A component that
exits with one of `refusal_exit_codes` (2: it refused to start, e.g. the memory plan does not
fit or the model cannot be read) gives up at once: restarting cannot help.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    factor: float = 2.0
    max_crashes: int = 5
    window_s: float = 60.0
    stable_after_s: float = 30.0
    refusal_exit_codes: tuple[int, ...] = (2,)

    def __post_init__(self) -> None:
        if self.initial_delay_s < 0 or self.max_delay_s < self.initial_delay_s:
            raise ValueError("need 0 <= initial_delay_s <= max_delay_s")
        if self.factor < 1 or self.max_crashes < 0 or self.window_s <= 0:
            raise ValueError("need factor >= 1, max_crashes >= 0, window_s > 0")


@dataclass(frozen=True)
class Restart:
    delay_s: float
    num_restarts: int  # restarts of this component so far, this one included


@dataclass(frozen=True)
class GiveUp:
    num_crashes: int  # crashes within the policy window
    window_s: float
    refused: bool = False  # the component refused to start (a settings problem)


class RestartTracker:
    """The crash history of one component."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_restarts = 0
        self._streak = 0  # crashes in a row without a stable run in between
        self._crash_times: deque[float] = deque()

    def on_exit(self, started_at: float, exited_at: float,
                exit_code: int | None = None) -> Restart | GiveUp:
        policy = self.policy
        if exit_code is not None and exit_code in policy.refusal_exit_codes:
            return GiveUp(num_crashes=1, window_s=policy.window_s, refused=True)
        if exited_at - started_at >= policy.stable_after_s:
            self._streak = 0
        self._crash_times.append(exited_at)
        while self._crash_times and self._crash_times[0] <= exited_at - policy.window_s:
            self._crash_times.popleft()
        if len(self._crash_times) > policy.max_crashes:
            return GiveUp(num_crashes=len(self._crash_times), window_s=policy.window_s)
        delay = min(policy.max_delay_s, policy.initial_delay_s * policy.factor ** self._streak)
        self._streak += 1
        self.num_restarts += 1
        return Restart(delay_s=delay, num_restarts=self.num_restarts)
