"""What the status and /metrics show a key (docs/design/security.md "Tenants"). Pure.

With several keys, a tenant's key is shown its own requests and conversations (slots, queue,
recent requests, its counters: finished requests, tokens by source, draft tokens, TTFT), and
aggregates of the machine that no other tenant's text moves (step times, disk use, memory,
component state). Nothing of another tenant's request is shown one by one; failures, and the
pages fetched from peer servers (any tenant's turns move them), are counted for the operator
only; no path (the kv dir in a disk error) reaches a tenant. An
operator key (`role=operator` in the key file), and the one tenant of a single key, see it all.
"""

from __future__ import annotations

import re

import msgspec

from switchyard.proto.status import Histogram, Stats, Status, TenantStats, TokenCounts
from switchyard.common.tenants import Tenant, Tenants

_OS_REASON = re.compile(r"\[Errno \d+\] ([^:'\"]+)")
DISK_REFUSED = "the disk refused page writes"


def status_for(status: Status, viewer: Tenant | None, tenants: Tenants) -> Status:
    """`status` as `viewer`'s key may see it."""
    if tenants.sees_all(viewer):
        return status
    name = viewer.name if viewer is not None else None
    slots = [s for s in status.slots if s.tenant and s.tenant == name]
    queue = [q for q in status.queue if q.tenant and q.tenant == name]
    waits = [s.waiting_s for s in slots if s.waiting_s is not None] + [q.waiting_s for q in queue]
    return msgspec.structs.replace(
        status, slots=slots, queue=queue, oldest_waiting_s=max(waits, default=0.0),
        disk=msgspec.structs.replace(status.disk, error=reason_without_paths(status.disk.error)),
        stats=_own_stats(status.stats, name), peer_servers=[])


def _own_stats(stats: Stats, name: str | None) -> Stats:
    own = stats.by_tenant.get(name) if name else None
    if own is None:
        own = TenantStats(requests_finished={}, tokens=TokenCounts(), ttft=_empty(stats.ttft))
    return msgspec.structs.replace(
        stats, requests_finished=dict(own.requests_finished), requests_failed={},
        tokens=own.tokens, ttft=own.ttft,
        recent_requests=[r for r in stats.recent_requests if r.tenant and r.tenant == name],
        by_tenant={name: own} if name else {})


def _empty(histogram: Histogram) -> Histogram:
    return Histogram(bounds=list(histogram.bounds), counts=[0] * len(histogram.counts), sum=0.0,
                     count=0)


def reason_without_paths(error: str) -> str:
    """The operating system's reason in a disk error ("No space left on device"), without the
    kv dir's path that the kvstore's message names."""
    if not error:
        return ""
    found = _OS_REASON.search(error)
    if found:
        return found.group(1).strip()
    tail = error.rsplit(": ", 1)[-1]
    return tail if "/" not in tail and "\\" not in tail else DISK_REFUSED
