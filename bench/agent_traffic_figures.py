"""bench/agent_traffic.py's figures from one server's run: TTFT, tokens re-read beyond each
request's new ones (by each server's own counter), memory, the residency simulation over
Switchyard's admission order, and Switchyard's own log lines.

Not a benchmark itself: bench/agent_traffic.py prints and plots what these return.
"""

from __future__ import annotations

import math

from bench._common import fmt
from bench._peers import TreeMemory, vllm_cached_tokens
from bench.agent_traffic_runs import Done
from switchyard.testing.group import ServerGroup


def count_new(done: list[Done]) -> None:
    """New tokens by the server's own prompt counts: vllm-mlx renders tool calls and results
    as text of its own when the template has no tool support, so its prompts are longer than
    the template's; the growth over the previous prompt of the conversation is what is new.
    A conversation's first request: what the bench's rendering says (the system prompt is
    rendered alike by all)."""
    by_key = {(d.req.conv, d.req.turn): d for d in done}
    for d in done:
        prev = by_key.get((d.req.conv, d.req.turn - 1))
        d.new = d.prompt - prev.prompt if prev else d.req.new


def match_vllm(done: list[Done], log_text: str) -> None:
    """vllm-mlx reports cached tokens only in its log: give each request the first unclaimed
    log entry with its prompt length, in the order the requests were sent."""
    entries = vllm_cached_tokens(log_text)
    used = [False] * len(entries)
    for d in sorted(done, key=lambda d: d.res.sent):
        for k, (prompt, cached) in enumerate(entries):
            if not used[k] and prompt == d.prompt:
                used[k] = True
                d.cached = cached
                break


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def summarize(name: str, done: list[Done], wall: float, mem: TreeMemory) -> tuple[list, dict]:
    count_new(done)
    ttfts = [d.res.ttft for d in done]
    worst = max(done, key=lambda d: d.res.ttft)
    known = [d for d in done if d.cached is not None]
    reread = sum(d.reread for d in known)
    prefilled = sum(d.prompt - (d.cached or 0) for d in known)
    matches = sum(d.prompt == len(d.req.prompt_ids) for d in done)
    fig = dict(wall=wall, p50=percentile(ttfts, 0.5), p95=percentile(ttfts, 0.95),
               max=worst.res.ttft, worst=worst, reread=reread, rss=mem.peak_rss,
               pss=mem.peak_pss)
    row = [name, len(done), fmt(wall, 1), fmt(fig["p50"], 2), fmt(fig["p95"], 2),
           fmt(fig["max"], 2), f"{worst.req.conv} t{worst.req.turn}",
           reread if len(known) == len(done) else f"{reread} ({len(known)}/{len(done)} known)",
           prefilled, f"{matches}/{len(done)}", mib(mem.peak_rss), mib(mem.peak_pss)]
    return row, fig


def residency(done: list[Done], admitted: dict[str, float], turns: int, k: int) -> list[str]:
    """Agent-aware residency, measured before it is built: with RAM for `k`
    conversations, how many returning requests find theirs gone, and how many tokens those
    would restore (or re-read without a disk tier), under LRU, under "evict the conversations
    whose last reply ended the turn first, then LRU", and under Belady's furthest-next-use
    bound; requests in the order Switchyard admitted them (`admitted`: rid -> time)."""
    seq = sorted(done, key=lambda d: admitted.get(d.res.rid or "", d.res.sent))
    final = {d.req.conv: max(x.req.turn for x in done if x.req.conv == d.req.conv)
             for d in done}
    later = sum(1 for d in seq if d.req.turn > 0)
    lines = []
    for policy in ("LRU", "agent-aware", "Belady"):
        held: dict[str, tuple[float, bool, int]] = {}  # conv -> (last end, ended turn, next)
        last_prompt: dict[str, int] = {}
        misses = tokens = 0
        for i, d in enumerate(seq):
            c = d.req.conv
            if d.req.turn > 0 and c not in held:
                misses += 1
                tokens += last_prompt.get(c, 0)
            nxt = next((j for j in range(i + 1, len(seq)) if seq[j].req.conv == c), len(seq))
            held[c] = (d.res.finished, d.req.turn == final[c], nxt)
            last_prompt[c] = d.prompt
            while len(held) > k:
                others = [x for x in held if x != c]
                if policy == "LRU":
                    victim = min(others, key=lambda x: held[x][0])
                elif policy == "agent-aware":
                    victim = min(others, key=lambda x: (not held[x][1], held[x][0]))
                else:
                    victim = max(others, key=lambda x: held[x][2])
                del held[victim]
        lines.append(f"residency for {k} conversations, {policy}: {misses} of {later} returning "
                     f"requests miss, {tokens} tokens to restore (re-read without a disk tier)")
    return lines


def admission_times(group: ServerGroup, done: list[Done]) -> dict[str, float]:
    """rid -> when Switchyard's scheduler admitted the request (sent + its queue_s)."""
    from bench._common import log_events

    queue = {e["rid"]: e["queue_s"] for e in log_events(group.log_path, "request.finished")
             if e.get("role") == "scheduler" and "rid" in e}
    return {d.res.rid: d.res.sent + queue[d.res.rid] for d in done if d.res.rid in queue}


def switchyard_detail(group: ServerGroup, worst: Done) -> list[str]:
    from bench._common import log_events

    recs = [e for e in log_events(group.log_path, "request.finished")
            if e.get("role") == "scheduler"]
    lines = [f"switchyard: {len(recs)} request.finished lines; restored "
             f"{sum(e['num_restored_tokens'] for e in recs)} tokens, cached "
             f"{sum(e['num_cached_tokens'] for e in recs)}, prefilled "
             f"{sum(e['num_prefilled_tokens'] for e in recs)}; queue_s sum "
             f"{fmt(sum(e['queue_s'] for e in recs), 1)}, restore_s sum "
             f"{fmt(sum(e['restore_s'] for e in recs), 1)}"]
    for e in recs:
        if e.get("rid") == worst.res.rid:
            keys = ("queue_s", "restore_s", "prefill_wait_s", "prefill_s", "ttft_s")
            lines.append(f"switchyard's slowest request ({worst.req.conv} turn {worst.req.turn}): "
                         + ", ".join(f"{k} {fmt(e[k], 2)}" for k in keys if e.get(k) is not None)
                         + f"; prompt {e['num_prompt_tokens']}, cached {e['num_cached_tokens']}, "
                         f"restored {e['num_restored_tokens']}, prefilled "
                         f"{e['num_prefilled_tokens']}")
    return lines


def ttft_points(done: list[Done]) -> list[tuple[float, float]]:
    """(seconds after the run's first request, TTFT) per request, in the order sent."""
    t0 = min(d.res.sent for d in done)
    return sorted((d.res.sent - t0, d.res.ttft) for d in done)
