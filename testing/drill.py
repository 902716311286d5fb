"""The restart drill: kill -9 each component in turn while three conversations are served.

Used by tests/e2e/test_restart_drill.py (which asserts the rules) and bench/restart_drill.py
(which prints the figures). Each conversation runs in its own thread, turn after turn, adding a
tool result each time, and records every outcome. For each killed component the drill reports
the time from the kill to the first request that then succeeds, the requests that failed and
how, and the tokens re-read by each conversation's first turn afterwards beyond its new tokens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from switchyard.testing.workload import text, wait_ready
from switchyard.testing.group import ServerGroup

ROLES_IN_DRILL = ("worker", "kvstore", "scheduler", "gateway")


@dataclass
class Outcome:
    conversation: int
    started: float
    ended: float
    status: int | None  # None: the connection failed
    retry_after: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0


@dataclass
class DrillResult:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[str, float, int]] = field(default_factory=list)  # role, time, old pid

    def after(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started >= t]

    def report(self) -> list[dict]:
        rows = []
        times = [k[1] for k in self.kills] + [float("inf")]
        for (role, at, _), until in zip(self.kills, times[1:]):
            window = [o for o in self.outcomes if at <= o.ended < until]
            ok = [o for o in window if o.status == 200]
            first_ok = min((o.ended for o in ok), default=None)
            failed = [o for o in window if o.status != 200]
            reread = 0
            for conv in {o.conversation for o in ok}:
                first = min((o for o in ok if o.conversation == conv), key=lambda o: o.started)
                reread += max(0, first.prompt_tokens - first.cached_tokens - first.new_tokens)
            rows.append({
                "role": role,
                "recovery_s": None if first_ok is None else round(first_ok - at, 2),
                "requests_ok": len(ok),
                "requests_failed": len(failed),
                "failures": sorted({f"{o.status or 'conn'}"
                                    + (f" retry-after={o.retry_after}" if o.retry_after else "")
                                    for o in failed}),
                "tokens_reread": reread,
            })
        return rows


class _Conversation(threading.Thread):
    def __init__(self, index: int, group: ServerGroup, result: DrillResult,
                 stop: threading.Event, lock: threading.Lock):
        super().__init__(daemon=True)
        self.index, self.group, self.result, self.stop, self.lock = index, group, result, stop, lock
        self.messages = [{"role": "system", "content": text(1000 + index, 200)},
                         {"role": "user", "content": text(2000 + index, 150)}]
        self.last_prompt = 0

    def run(self) -> None:
        turn = 0
        with httpx.Client(timeout=90) as http:
            while not self.stop.is_set():
                outcome = self._turn(http)
                with self.lock:
                    self.result.outcomes.append(outcome)
                if outcome.status == 200:
                    turn += 1
                    self.messages.append({"role": "assistant", "content": f"step {turn}"})
                    self.messages.append({"role": "user",
                                          "content": text(3000 + 100 * self.index + turn, 250)})
                else:
                    time.sleep(0.3)

    def _turn(self, http: httpx.Client) -> Outcome:
        started = time.monotonic()
        body = {"model": self.group.model_id, "messages": self.messages, "max_tokens": 12,
                "temperature": 0}
        try:
            resp = http.post(f"{self.group.base_url}/chat/completions", json=body)
        except httpx.HTTPError:
            return Outcome(self.index, started, time.monotonic(), None)
        outcome = Outcome(self.index, started, time.monotonic(), resp.status_code,
                          resp.headers.get("retry-after"))
        if resp.status_code == 200:
            usage = resp.json()["usage"]
            outcome.prompt_tokens = usage["prompt_tokens"]
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            outcome.new_tokens = max(0, usage["prompt_tokens"] - self.last_prompt)
            self.last_prompt = usage["prompt_tokens"]
        return outcome


def run_drill(group: ServerGroup, turns: int = 1,
              roles: tuple[str, ...] = ROLES_IN_DRILL) -> DrillResult:
    """Each phase (before the first kill, then after each) lasts until every conversation
    has had `turns` turns answered that started in it: each restart is seen by all three."""
    group.model_id = httpx.get(f"{group.base_url}/models").json()["data"][0]["id"]
    result, stop, lock = DrillResult(), threading.Event(), threading.Lock()
    threads = [_Conversation(i, group, result, stop, lock) for i in range(3)]
    for t in threads:
        t.start()
    _wait_turns(result, lock, time.monotonic(), turns, len(threads))
    for role in roles:
        at = time.monotonic()
        old = group.kill(role)
        result.kills.append((role, at, old))
        new = group.wait_restarted(role, old)
        wait_ready(group, role, new)
        _wait_turns(result, lock, at, turns, len(threads))
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return result


def _wait_turns(result: DrillResult, lock: threading.Lock, since: float, turns: int,
                num_conversations: int, timeout_s: float = 120.0) -> None:
    """Until each conversation has `turns` answered turns that started at `since` or later."""
    deadline = time.monotonic() + timeout_s
    while True:
        with lock:
            answered = [sum(1 for o in result.outcomes if o.conversation == conv
                            and o.status == 200 and o.started >= since)
                        for conv in range(num_conversations)]
        if min(answered) >= turns:
            return
        assert time.monotonic() < deadline, f"answered turns per conversation: {answered}"
        time.sleep(0.05)
