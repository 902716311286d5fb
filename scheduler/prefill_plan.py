"""Which prefill chunks a step carries: order, sizes, and where a hybrid model's chunk ends.

Decode-first (docs/design/scheduling.md "Scheduling"): the chunks fill what the prefill budget grants
after every decoding request got its token; interactive before background, then the fewest
remaining tokens first, aged by what a request has waited (`scheduler.fairness`).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.proto.scheduler_worker import PrefillChunk
from switchyard.scheduler.fairness import interactive_now, prefill_key
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.requests import Request, Slot
from switchyard.scheduler.step_budget import PrefillBudget
from switchyard.scheduler.tenant_shares import TenantShares



# However many requests wait for their first token, a decoding stream keeps at least this
# share of its solo speed.
MIN_DECODE_SHARE = 0.1


@dataclass(frozen=True)
class PrefillShare:
    """A step's split between decoding streams and the prefill of waiting requests."""

    decode_share: float  # of its solo speed, what each protected decoding stream keeps
    num_protected: int  # decoding streams this step's prefill must not slow beyond that
    num_waiting: int  # requests waiting for their first token, among those it prefills for


def prefill_share(decoding: list[Request], prefilling: list[Request], now: float,
                  cfg: CoreConfig) -> PrefillShare:
    """Who this step's prefill must not slow, and how much (docs/design/scheduling.md "Scheduling").

    `prefilling` is in prefill order. Interactive streams are protected: someone may be
    reading them. Background streams (cron jobs, sub-agents: their reader is a program that
    needs the whole reply) are not: they decode every step, but a request waiting for its
    first token may take the rest of it. Protected streams and the requests waiting for their
    first token are equal parties: D streams beside W waiting requests keep D / (D + W) of
    their solo speed, at most `--decode-share` (one stream beside one long prefill keeps
    it) and at least MIN_DECODE_SHARE. Waiting background requests count only while no
    interactive request of their tenant heads its prefill queue (they wait for it anyway).
    So twenty agents' tool results waiting behind a few short replies prefill at nearly full
    speed, and a lone chat stream beside a long prompt keeps half of its speed."""
    heads: dict[str, bool] = {}  # each tenant's: its background waits only for its own
    for r in prefilling:
        heads.setdefault(r.tenant, interactive_now(r, now, cfg.background_wait_s))
    num_protected = sum(1 for r in decoding if r.interactive)
    num_waiting = sum(1 for r in prefilling if not r.generated and (
        interactive_now(r, now, cfg.background_wait_s) or not heads[r.tenant]))
    share = cfg.decode_share
    if num_protected and num_waiting and share > 0:
        share = min(share, max(MIN_DECODE_SHARE,
                               num_protected / (num_protected + num_waiting)))
    return PrefillShare(share, num_protected, num_waiting)


def plan_prefills(prefilling: list[tuple[Request, int]], decoding: list[Request],
                  slots: list[Slot], budget: PrefillBudget, cfg: CoreConfig,
                  now: float, shares: TenantShares | None = None
                  ) -> tuple[list[PrefillChunk], PrefillShare | None]:
    """The chunks of this step for the requests prefilling, as (request, tokens left), and
    the split of the step it planned them with (prefill_share; None: nothing to prefill).
    `shares`: the tenants' (scheduler.tenant_shares), whose order goes before each tenant's
    own and which is charged for the chunks."""
    if not prefilling:
        return [], None
    prefilling.sort(key=lambda rr: prefill_key(rr[0], rr[1], now, cfg.overtake_limit,
                                               cfg.background_wait_s))
    if shares is not None:
        prefilling = shares.prefill_order(prefilling)
    share = prefill_share(decoding, [req for req, _ in prefilling], now, cfg)
    grant = budget.grant(share.num_protected, share.decode_share)
    prefills, used = [], 0
    for req, remaining in prefilling:
        room = grant - used
        if room <= 0:
            break
        slot = slots[req.slot]
        start = len(slot.tokens)
        end = start + min(remaining, room)
        if not cfg.trimmable:
            end = cut_at_state_point(req, start, end, cfg.page_size, cfg.state_interval)
        end, encoding = cut_before_images(req, start, end, room, budget)
        if end == start:
            break
        prefills.append(PrefillChunk(req.slot, start, tuple(req.feed[start:end]),
                                     req.images_before(end), req.image_files(start, end)))
        used += end - start + encoding
        if shares is not None:
            shares.charge(req.tenant, end - start + encoding)
        if req.first_chunk_at is None:
            req.first_chunk_at = now
    budget.spend(used)
    for req, _ in prefilling[len(prefills):]:
        req.num_waited_tokens += used  # ages it (scheduler.fairness)
    return prefills, share


def cut_before_images(req: Request, start: int, end: int, room: int, budget: PrefillBudget
                      ) -> tuple[int, int]:
    """Where a chunk ends so that the images whose encoding it starts fit its room (their
    cost counts as prefill tokens: step_budget.py), and that cost. An image that does not fit
    waits for a later step. One that starts the chunk and costs more than any step's room
    (an encoding cannot be split) goes once the budget can afford it whole: no chunk
    (`start`) until then."""
    cost = 0
    for image in req.images:
        if not start <= image.start < end:
            continue
        image_cost = budget.encode_tokens(image.num_tokens)
        if image.start > start and (image.start - start) + cost + image_cost > room:
            return image.start, cost
        # The chunk's own tokens are saved for too: the step that encodes owes nothing after.
        if (image.start == start and image_cost > room
                and not budget.afford(image_cost + end - start)):
            return start, 0
        cost += image_cost
    return end, cost


def state_points(slot: Slot, req: Request | None, remaining: int, page_size: int,
                 interval: int) -> set[int]:
    """Page ends where a hybrid model snapshots its recurrent state for this slot, given the
    request in it (if any) and its prefill tokens left."""
    end = len(slot.tokens)
    points = {end} if end % interval == 0 else set()
    if req is None or not remaining:
        points.add(end)  # decoding or idle: the newest state is where the next turn resumes
    else:
        points.add(req.num_context // page_size * page_size)  # last page end of the context
        points.add(req.branch_point)
    return points


def cut_at_state_point(req: Request, start: int, end: int, page_size: int,
                       interval: int) -> int:
    """End a hybrid prefill chunk exactly at the next snapshot point, if it is inside."""
    last_page_end = req.num_context // page_size * page_size
    next_interval = (start // interval + 1) * interval
    for point in sorted({last_page_end, next_interval, req.branch_point}):
        if start < point < end:
            return point
    return end
