"""Who goes first: the prefill order, the slot admission order and the background bound.

Pure functions of a request's state and the time (docs/design/scheduling.md "Scheduling"):

- Prefill order: interactive before background, then shortest remaining prefill first with
  aging. A request waiting for prefill counts as one token shorter for every `overtake_limit`
  tokens prefilled for other requests while it got none (`Request.num_waited_tokens`). So a
  nearly resident turn still goes before a cold prompt, but a request with R tokens left is
  overtaken by later, shorter arrivals only until others have been prefilled
  `overtake_limit` x R tokens past it; after that no newcomer goes first.
  `overtake_limit` 0 is first come, first served.
- Slot admission: interactive before background, then requests still waiting for their
  first token before those that gave their slot up after it (time slicing, below), then the
  oldest in the queue first (arrival, or when it gave its slot up).
- Preemption (`preempts`): a waiting request takes a running request's slot when it ranks
  above it: an interactive request takes a background request's slot at any time; within a
  priority, a request waiting for its first token takes the slot of one that has had its
  first token and generated its quantum since it was placed (time slicing): `slice_tokens`,
  doubled for every slot it gave up before, so a reply of n tokens yields at most
  log2(n / slice_tokens) + 1 times. It requeues and resumes from its pages.
- Slicing bound: a request that gave its slot up counts as waiting for its first token again
  once `num_slots` requests that entered the queue after it were placed while it waited. So
  it is placed before any request that enters the queue later, and it keeps the slot for its
  (doubled) quantum: no stream of newcomers starves it.
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


def awaits_first_token(req: Request, overtake_bound: int) -> bool:
    """Ranks as a request waiting for its first token: it has none, or it gave its slot up
    after it and has been overtaken by `overtake_bound` later requests since (the bound)."""
    return not req.generated or req.num_overtaken >= overtake_bound


def admission_key(req: Request, now: float, background_wait_s: float,
                  overtake_bound: int = 1) -> tuple:
    """Sort key of a request waiting for a slot (smallest first)."""
    return (not interactive_now(req, now, background_wait_s),
            not awaits_first_token(req, overtake_bound), req.queued_at)


def slice_quantum(req: Request, slice_tokens: int) -> int:
    """Tokens a request generates in a placement before it may give its slot up: the quantum,
    doubled for every time it gave a slot up before (at most 2**16 times the quantum)."""
    return slice_tokens << min(req.num_yields, 16)


def preempts(waiter: Request, victim: Request, now: float, background_wait_s: float,
             slice_tokens: int, overtake_bound: int) -> bool:
    """Whether `waiter`, waiting for a slot, takes the slot of `victim`, running."""
    urgent = interactive_now(waiter, now, background_wait_s)
    if urgent != interactive_now(victim, now, background_wait_s):
        return urgent  # interactive over background, at any point of its reply
    return (slice_tokens > 0 and awaits_first_token(waiter, overtake_bound)
            and bool(victim.generated) and not victim.restoring and not victim.cancelled
            and len(victim.generated) - victim.placed_generated
            >= slice_quantum(victim, slice_tokens))


def oldest_waiting_s(requests, now: float) -> float:
    """Age of the oldest request still waiting for its first token (queued, restoring or
    prefilling); 0 when none waits."""
    ages = [now - r.arrived_at for r in requests if r.first_token_at is None]
    return max(ages, default=0.0)
