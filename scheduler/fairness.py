"""Who goes first: the prefill order, the slot admission order and the background bound.

Pure functions of a request's state and the time (docs/design.md "Scheduling"):

- Prefill order: interactive before background, then shortest remaining prefill first with
  aging. A request waiting for prefill counts as one token shorter for every `overtake_limit`
  tokens prefilled for other requests while it got none (`Request.num_waited_tokens`). So a
  nearly resident turn still goes before a cold prompt, but a request with R tokens left is
  overtaken by later, shorter arrivals only until others have been prefilled
  `overtake_limit` x R tokens past it; after that no newcomer goes first.
  `overtake_limit` 0 is first come, first served.
- Slot admission: interactive before background, then oldest first.
- Background bound: a background request that has waited `background_wait_s` since it
  arrived is scheduled as interactive from then on (order, budget, and it is no longer
  preempted), so background work waits for interactive work, but not forever.
"""

from __future__ import annotations

from switchyard.scheduler.requests import Request


def interactive_now(req: Request, now: float, background_wait_s: float) -> bool:
    """Interactive, or background that has waited out its bound (0: no bound)."""
    if req.interactive:
        return True
    return background_wait_s > 0 and now - req.arrived_at >= background_wait_s


def prefill_key(req: Request, remaining: int, now: float, overtake_limit: float,
                background_wait_s: float) -> tuple:
    """Sort key of a request waiting for prefill chunks (smallest first)."""
    urgent = interactive_now(req, now, background_wait_s)
    if overtake_limit <= 0:
        return (not urgent, req.arrived_at)
    return (not urgent, remaining - req.num_waited_tokens / overtake_limit, req.arrived_at)


def admission_key(req: Request, now: float, background_wait_s: float) -> tuple:
    """Sort key of a request waiting for a slot (smallest first)."""
    return (not interactive_now(req, now, background_wait_s), req.arrived_at)


def oldest_waiting_s(requests, now: float) -> float:
    """Age of the oldest request still waiting for its first token (queued, restoring or
    prefilling); 0 when none waits."""
    ages = [now - r.arrived_at for r in requests if r.first_token_at is None]
    return max(ages, default=0.0)
