"""Fair shares between tenants: the queue, the running requests and the prefill.

Each API key is a tenant (common/tenants.py); the gateway names a request's tenant and the
tenant's weight in `SubmitRequest.tenant`/`tenant_weight`. Tenants with a request queued or
running are active, and divide three things in proportion to their weights (weighted fair
queuing, docs/design/scheduling.md "Scheduling"):

- **Queue places** (`queue_refusal`): a tenant whose queued requests reach its share of
  `--max-queue` gets the 429 with Retry-After; the others still queue. A tenant alone has the
  whole queue, as before. So one tenant's flood never refuses another's first request.
- **Running requests** (`admission_order`, `takes_share`): admission interleaves tenants by
  their running requests per weight, and a request of a tenant below its share takes the
  slot of a request of a tenant above it (the core preempts it: it resumes from its pages),
  but only while the taker stays at or below the giver afterwards, so no slot changes hands
  back and forth.
- **Prefill** (`prefill_order`, `charge`): a step's chunks go first to the tenant that has
  had the least prefill per weight since it became active.

Within a tenant nothing changes: interactive before background, shortest prefill first with
aging, time slicing and the background bound order its own requests. Between tenants the
shares decide, so one tenant's interactive work never holds another's background work back
past that tenant's share. With one tenant every function here leaves the order as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from switchyard.scheduler.requests import Request

Item = TypeVar("Item")


class TenantShares:
    """The weights of the tenants seen, and the prefill each active tenant has had."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}
        # Prefill tokens per weight each tenant with prefill under way has had since it last
        # started prefilling; one that starts again begins at the least of the others, so
        # an idle tenant banks no credit.
        self.prefilled: dict[str, float] = {}

    def note(self, tenant: str, weight: float) -> None:
        """The weight the key file gives `tenant` (its latest request's)."""
        self.weights[tenant] = weight if weight > 0 else 1.0

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def usage(self, tenant: str, running: Mapping[str, int]) -> float:
        return running.get(tenant, 0) / self.weight(tenant)

    # --- queue places --------------------------------------------------------------------

    def queue_refusal(self, tenant: str, queued: Iterable[Request], active: set[str],
                      max_queue: int) -> str | None:
        """Why a new request of `tenant` is refused a queue place (a 429), or None.
        `queued`: the requests waiting; `active`: the tenants with a request queued or
        running."""
        queued = list(queued)
        others = active - {tenant}
        if not others:
            if len(queued) >= max_queue:
                return f"{len(queued)} requests are waiting; try again shortly"
            return None
        total = self.weight(tenant) + sum(self.weight(t) for t in others)
        share = max(1.0, max_queue * self.weight(tenant) / total)
        mine = sum(1 for r in queued if r.tenant == tenant)
        if mine >= share:
            return (f"{mine} requests of this key are waiting, its share of the queue beside "
                    "the other keys in use; try again shortly")
        return None

    # --- running requests ----------------------------------------------------------------

    def admission_order(self, ordered: Sequence[Item], tenant_of, running: Mapping[str, int]
                        ) -> list[Item]:
        """`ordered` (each tenant's requests in its own admission order) interleaved by
        weighted fair queuing: a tenant's k-th waiting request ranks at (running + k) /
        weight, ties in the given order."""
        tenants = {tenant_of(item) for item in ordered}
        if len(tenants | {t for t, n in running.items() if n}) <= 1:
            return list(ordered)
        seen: Counter[str] = Counter()
        ranked = []
        for index, item in enumerate(ordered):
            tenant = tenant_of(item)
            ranked.append(((running.get(tenant, 0) + seen[tenant]) / self.weight(tenant),
                           index, item))
            seen[tenant] += 1
        return [item for _, _, item in sorted(ranked, key=lambda r: r[:2])]

    def takes_share(self, waiter: str, holder: str, running: Mapping[str, int]) -> bool:
        """Whether a waiting request of tenant `waiter` takes a running request's slot from
        tenant `holder` (`running`: slots per tenant, placements already promised
        included): only while `waiter`, one slot up, stays at or below `holder`, one slot
        down, per weight. So the same slot never goes back."""
        if waiter == holder:
            return False
        return ((running.get(waiter, 0) + 1) / self.weight(waiter)
                <= (running.get(holder, 0) - 1) / self.weight(holder))

    # --- prefill -------------------------------------------------------------------------

    def prefill_order(self, prefilling: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The requests prefilling (in each tenant's own prefill order), the tenant that has
        had the least prefill per weight first."""
        active = {req.tenant for req, _ in prefilling}
        known = [self.prefilled[t] for t in active if t in self.prefilled]
        floor = min(known, default=0.0)
        self.prefilled = {t: max(self.prefilled.get(t, floor), floor) for t in active}
        if len(active) <= 1:
            return prefilling
        return sorted(prefilling, key=lambda rr: self.prefilled[rr[0].tenant])

    def charge(self, tenant: str, num_tokens: int) -> None:
        """`tenant` had `num_tokens` of a step's prefill."""
        if tenant in self.prefilled:
            self.prefilled[tenant] += num_tokens / self.weight(tenant)


def running_by_tenant(requests: Iterable[Request]) -> Counter[str]:
    return Counter(req.tenant for req in requests)
