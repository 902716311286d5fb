"""bench/soak.py's checks and report: statuses, replies against the reference, restores after
each fault, page bytes on disk against the budget, RSS growth, and what the group left behind.

Not a benchmark itself: bench/soak.py calls `report` once both runs are done.
"""

from __future__ import annotations

from bench._common import table
from bench.soak_agents import Record
from bench.soak_faults import Fault
from bench.soak_samplers import rss_growth
from switchyard.common.backoff import MAX_S

PAGE = 256

# After a disk fault ends, writes resume within one backoff delay at most (common/backoff.py).
PAUSE_S = MAX_S


def restore_check(records: list[Record], faults: list[Fault]):
    """Each agent's first turn after each fault: cached >= prompt - new - one page.

    A short one is excused (counted apart) if its conversation was under way while pages
    could not be written (a disk fault, until PAUSE_S after it ended) or when a page file was
    corrupted: its pages may legitimately be missing."""
    turns = sorted((r for r in records if r.kind == "turn" and r.text is not None),
                   key=lambda r: r.started)
    prev_prompt: dict[tuple[int, int], int] = {}  # (agent, conv) -> prompt of the turn before
    previous_of, conv_start = {}, {}
    for r in turns:
        conv = (r.agent, r.key[0])
        previous_of[id(r)] = prev_prompt.get(conv, 0)
        prev_prompt[conv] = r.prompt
        conv_start.setdefault(conv, r.started)
    lossy = [(f.started, f.ended + PAUSE_S) if f.kind in ("disk_full", "readonly")
             else (f.started, f.started) for f in faults if not f.kind.startswith("kill")]
    judged, excused, failed = 0, 0, []
    for fault in faults:
        seen = set()
        for r in turns:
            if r.started < fault.ended or r.agent in seen:
                continue
            seen.add(r.agent)
            new = r.prompt - previous_of[id(r)]
            judged += 1
            if r.cached >= r.prompt - new - PAGE:
                continue
            start = conv_start[(r.agent, r.key[0])]
            if any(start <= hi and lo <= r.started for lo, hi in lossy):
                excused += 1
            else:
                failed.append((fault.kind, r.agent, r.key, r.prompt, new, r.cached,
                               r.started - fault.ended))
    return judged, excused, failed


def report(args, reference, records, injector, sampler, t0, t1, budget, corrupt_events,
           stop_problem, leaked_shm, tmpfs, wall, is_tie) -> int:
    """`is_tie(record, reference_record)`: whether two different replies are both the model's
    greedy reply up to float ties (bench/greedy_ties.py), which is not counted wrong."""
    turns = [r for r in records if r.kind == "turn"]
    bad_status = [p for r in records for p in r.problems]
    compared = [r for r in turns if (r.agent, r.key) in reference and r.text is not None]
    differ = [r for r in compared if r.text != reference[(r.agent, r.key)].text]
    tied = [r for r in differ if is_tie(r, reference[(r.agent, r.key)])]
    wrong = [r for r in differ if r not in tied]
    judged, excused, failed = restore_check(records, injector.faults)
    max_disk = max((b for _, b in sampler.disk), default=0)
    rss_rows = []
    rss_ok = True
    for role, samples in sampler.rss.items():
        g = rss_growth(samples, t0, t1)
        if g is None:  # restarted too late in the run to judge it: said, not failed
            rss_rows.append([f"{role} RSS growth, second half",
                             "not judged: restarted late" if samples else "no samples"])
            rss_ok &= bool(samples)
            continue
        pid, first, last, growth, n = g
        rss_ok &= growth < 0.05
        rss_rows.append([f"{role} RSS growth, second half (pid {pid}, {n} samples)",
                         f"{first} -> {last} KiB = {growth * 100:+.1f}%"])
    fault_counts: dict[str, int] = {}
    for f in injector.faults:
        fault_counts[f.kind] = fault_counts.get(f.kind, 0) + 1
    statuses: dict[str, int] = {}
    for r in records:
        statuses[f"{r.kind} {r.status}"] = statuses.get(f"{r.kind} {r.status}", 0) + 1
    rows = [
        ["run length (s) / total wall (s)", f"{t1 - t0:.0f} / {wall:.0f}"],
        ["page disk", f"tmpfs {args.kv_disk_size}" if tmpfs else "plain dir (no disk-full)"],
        ["faults", ", ".join(f"{k} x{v}" for k, v in sorted(fault_counts.items())) or "none"],
        ["fault injector errors", "; ".join(injector.errors) or "0"],
        ["requests (kind status: count)", ", ".join(f"{k}: {v}"
                                                    for k, v in sorted(statuses.items()))],
        ["retries (503/429 + Retry-After, conn errors, stream errors)",
         sum(r.retries for r in records)],
        ["responses outside 2xx / 4xx-malformed / 503,429+Retry-After", len(bad_status)],
        ["replies compared with the reference", f"{len(compared)} of {len(turns)} turns"],
        ["wrong outputs", len(wrong)],
        ["different at a float tie (both greedy within a logit tie)", len(tied)],
        ["first turns after a fault: judged / short / short but excused (pages lost)",
         f"{judged} / {len(failed)} / {excused}"],
        ["bad pages met (kv.corrupt_page)", len(corrupt_events)],
        ["page bytes on disk, max sampled / budget", f"{max_disk} / {budget}"],
        *rss_rows,
        ["group stop", stop_problem or "clean (no process, pid file left)"],
        ["leaked /dev/shm segments", ", ".join(leaked_shm) or "0"],
    ]
    print(table(["soak", "value"], rows))
    for (at, nbytes), counted in zip(sampler.disk, sampler.counted):
        if nbytes > budget:
            last = max((f for f in injector.faults if f.started <= at), default=None,
                       key=lambda f: f.started)
            print(f"  over budget at {at - t0:.0f}s: {nbytes} bytes (+{nbytes - budget}); "
                  + (f"last fault {last.kind} at {last.started - t0:.0f}s" if last else
                     "no fault before")
                  + (f"; the scheduler counted {counted.bytes} bytes on disk, "
                     f"{counted.num_writing} pages being written" if counted else
                     "; no status.json then"))
    for p in sorted(set(bad_status))[:10]:
        print("  status problem:", p)
    for word, rows in (("wrong", wrong), ("tie", tied)):
        for r in rows[:10]:
            ref = reference[(r.agent, r.key)]
            print(f"  {word}: agent {r.agent} {r.key}: {r.text!r} ({r.rid}, cached {r.cached}) "
                  f"!= {ref.text!r} ({ref.rid}, cached {ref.cached})")
    for f in failed[:10]:
        print("  not restored after %s: agent %d %s prompt %d new %d cached %d, sent %.1fs "
              "after the fault" % f)
    ok = (not bad_status and not wrong and not failed and max_disk <= budget and rss_ok
          and not stop_problem and not leaked_shm and not injector.errors)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
