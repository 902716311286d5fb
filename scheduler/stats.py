"""Counters and histograms the scheduler keeps for /metrics, `switchyard status` and the
dashboard. Pure: fed finished-request records and step results; snapshotted as the status
document's `Stats` (proto/status.py)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from switchyard.proto.status import (Histogram, RecentRequest, Stats, TenantStats, TokenCounts,
                                     TtftCause)

TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RECENT = 200


@dataclass
class BucketCounter:
    """A histogram being counted: values by bucket, their sum and number."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.num += 1

    def snapshot(self) -> Histogram:
        return Histogram(bounds=list(self.bounds), counts=list(self.counts), sum=self.total,
                         count=self.num)


def ttft_cause(rec) -> TtftCause:
    """What dominated a request's prefix: kept in memory, restored from disk, or prefilled."""
    in_memory = rec.num_reused_tokens + rec.num_copied_tokens
    parts = {"reused": in_memory, "restored": rec.num_restored_tokens,
             "prefilled": rec.num_prefilled_tokens}
    return max(parts, key=lambda k: (parts[k], k == "prefilled"))


@dataclass
class _TenantCounters:
    """A tenant's own share of the counters (with several keys)."""

    finished: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    ttft: BucketCounter = field(default_factory=lambda: BucketCounter(TTFT_BUCKETS_S))

    def snapshot(self) -> TenantStats:
        return TenantStats(requests_finished=dict(self.finished),
                           tokens=TokenCounts(**self.tokens), ttft=self.ttft.snapshot())


def _token_counts(rec) -> dict[str, int]:
    return dict(prompt=rec.num_prompt_tokens, reused=rec.num_reused_tokens,
                copied=rec.num_copied_tokens, restored=rec.num_restored_tokens,
                prefilled=rec.num_prefilled_tokens, generated=rec.num_generated_tokens,
                draft_proposed=rec.num_proposed_tokens, draft_accepted=rec.num_accepted_tokens)


def recent_request(rec, at: float) -> RecentRequest:
    """A finished request (its `FinishedRecord`, with a TTFT) as the status shows it, `at`
    the time it finished."""
    return RecentRequest(
        at=at, ttft_s=rec.ttft_s, cause=ttft_cause(rec), prompt_tokens=rec.num_prompt_tokens,
        cached_tokens=rec.num_cached_tokens, priority=rec.priority,
        tenant=getattr(rec, "tenant", ""), rid=getattr(rec, "rid", ""),
        conversation=getattr(rec, "conversation", ""),
        started_at=at - getattr(rec, "duration_s", 0.0),
        reused_tokens=rec.num_reused_tokens, copied_tokens=rec.num_copied_tokens,
        restored_tokens=rec.num_restored_tokens, prefilled_tokens=rec.num_prefilled_tokens,
        generated_tokens=rec.num_generated_tokens)


class SchedulerStats:
    def __init__(self) -> None:
        self.finished = Counter()  # finish reason -> requests
        self.failed = Counter()  # failure code -> requests
        # prompt, reused, copied, restored, prefilled, generated; draft_proposed and
        # draft_accepted (speculative decoding)
        self.tokens = Counter()
        self.ttft = BucketCounter(TTFT_BUCKETS_S)
        self.step_time = BucketCounter(STEP_BUCKETS_S)
        self.num_steps = 0
        self.restarts = Counter()  # peer role -> restarts seen
        self.recent: deque[RecentRequest] = deque(maxlen=_RECENT)
        # With several keys, each tenant's own (its key's name: as many as the key file has).
        self.by_tenant: dict[str, _TenantCounters] = {}

    def request_finished(self, rec, at: float) -> None:
        tenant = getattr(rec, "tenant", "")
        own = self.by_tenant.setdefault(tenant, _TenantCounters()) if tenant else None
        self.finished[rec.finish_reason] += 1
        self.tokens.update(_token_counts(rec))
        if own is not None:
            own.finished[rec.finish_reason] += 1
            own.tokens.update(_token_counts(rec))
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
            if own is not None:
                own.ttft.observe(rec.ttft_s)
            self.recent.append(recent_request(rec, at))

    def request_failed(self, code: str) -> None:
        self.failed[code] += 1

    def step_done(self, duration_s: float) -> None:
        self.num_steps += 1
        self.step_time.observe(duration_s)

    def snapshot(self) -> Stats:
        return Stats(requests_finished=dict(self.finished), requests_failed=dict(self.failed),
                     tokens=TokenCounts(**self.tokens), ttft=self.ttft.snapshot(),
                     step_time=self.step_time.snapshot(), num_steps=self.num_steps,
                     restarts=dict(self.restarts), recent_requests=list(self.recent),
                     by_tenant={name: own.snapshot() for name, own in self.by_tenant.items()})
