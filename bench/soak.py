"""Soak under faults: 16 agents for --minutes against --slots 4 while components
are killed, the page disk fills or stops being writable, and page files are corrupted.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/soak.py [--minutes 10] [--seed 12]

Loopback only, bounded in time (--minutes per run) and count (--max-turns per agent); it stops
by itself. Two runs of the same seeded agents:

1. fault-free reference: every agent's replies (greedy) are recorded, per (conversation, turn);
2. under faults: each agent sends the same requests (at most as many turns as it did in the
   reference) while an injector, every --fault-min..--fault-max seconds (seeded), does one of:
   kill -9 of the gateway, scheduler, worker or kvstore (pid files; the supervisor restarts it),
   fill the page disk (the kv dir is a small tmpfs: a filler file takes all free space for a
   while), make the page directories unwritable (chattr +i, root only: chmod does not stop
   root), or flip a byte in a page file.

Agents (index % 16): 0-7 tool loops (the whole history resent each turn, a ~100-word tool
result added), 8-10 the same as `background` priority, 11-13 streaming, and every third turn
first a streamed request dropped after two chunks, 14-15 a malformed body before each turn.
The assistant turns in the history are fixed text, so every request is known in advance.

Checks (exit 1 if one fails): no response other than 2xx, 4xx for the malformed bodies, and
503/429 with Retry-After (retried, as a client would); 0 replies different from the reference
(unless both are greedy up to a float tie of the logits: bench/greedy_ties.py);
each conversation's first turn after a kill restores (cached >= prompt - new - one page); page
bytes on disk (sampled every 2 s, kvstore paused for the walk) never above --kv-disk-budget;
gateway and scheduler VmRSS growth over the second half < 5% (same pid); no /dev/shm segment
of the group and no process left after it stops. Corruption and disk faults legitimately lose
pages (and after the disk refused a page, the scheduler and kvstore try again after a backoff
of 1 s doubling to 30 s): a short restore of a conversation under way then is counted as
excused, apart.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import parse_with_model  # noqa: E402
from bench.greedy_ties import GreedyJudge  # noqa: E402
from bench.soak_agents import Record, run_agents, script_of  # noqa: E402
from bench.soak_faults import KILL_ROLES, Injector  # noqa: E402
from bench.soak_report import report  # noqa: E402
from bench.soak_samplers import Sampler  # noqa: E402
from switchyard.common.endpoints import Endpoints  # noqa: E402
from switchyard.testing.drill_serve import DRILL_SERVE  # noqa: E402
from switchyard.testing.group import ServerGroup, short_tmp_dir  # noqa: E402


def group_for(model: Path, args, kv_dir: Path) -> ServerGroup:
    return ServerGroup(model, slots=args.slots, ctx=args.ctx, kv_dir=kv_dir, entry=DRILL_SERVE,
                       extra=["--kv-disk-budget", args.kv_disk_budget,
                              *(["--kv-write-back"] if args.kv_write_back else [])])


def mount_tmpfs(path: Path, size: str) -> bool:
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(path)], check=True, capture_output=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


def shm_segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def parse_size(s: str) -> int:
    from switchyard.common.settings import parse_size as parse

    return parse(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation")
    ap.add_argument("--max-turns", type=int, default=200, help="turns per agent, at most")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-disk-budget", default="160MiB")
    ap.add_argument("--kv-write-back", action="store_true",
                    help="both runs write pages back as they leave memory (--kv-write-back)")
    ap.add_argument("--kv-disk-size", default="224m", help="size of the tmpfs kv dir")
    ap.add_argument("--fault-min", type=float, default=30.0)
    ap.add_argument("--fault-max", type=float, default=90.0)
    ap.add_argument("--faults", default="kill,corrupt,readonly,disk_full",
                    help="fault kinds to draw from (kill is drawn 3x as often as the others)")
    ap.add_argument("--kill-roles", default=",".join(KILL_ROLES))
    ap.add_argument("--log-out", type=Path,
                    help="keep the faulted run's group log here (the reference's beside it)")
    args, model = parse_with_model(ap)
    seconds = args.minutes * 60
    budget = parse_size(args.kv_disk_budget)
    started = time.monotonic()

    # 1. Fault-free reference.
    ref_kv = short_tmp_dir("sykvref")
    try:
        with group_for(model, args, ref_kv) as group:
            agents, ref_records = run_agents(group, args, seconds, None)
            for a in agents:
                a.join()
            ref_turns = {a.index: a.turns_done for a in agents}
            if args.log_out:
                shutil.copyfile(group.log_path, args.log_out.with_suffix(".reference.log"))
    finally:
        shutil.rmtree(ref_kv, ignore_errors=True)
    reference = {(r.agent, r.key): r for r in ref_records
                 if r.kind == "turn" and r.text is not None}
    print(f"reference: {len(reference)} replies, {sum(ref_turns.values())} turns in "
          f"{time.monotonic() - started:.0f}s", flush=True)

    # 2. The same requests under faults.
    kv_dir = short_tmp_dir("sykvsoak")
    tmpfs = mount_tmpfs(kv_dir, args.kv_disk_size)
    stop_problem = ""
    leaked_shm: list[str] = []
    try:
        group = group_for(model, args, kv_dir)
        group.start()
        prefix = Endpoints(group.runtime_dir).shm_prefix
        try:
            t0 = time.monotonic()
            sampler = Sampler(group, kv_dir)
            sampler.start()
            agents, records = run_agents(group, args, seconds, ref_turns)
            injector = Injector(group, kv_dir, random.Random(args.seed), args, t0 + seconds,
                                tmpfs)
            injector.start()
            for a in agents:
                a.join()
            injector.stop.set()
            injector.join()
            t1 = time.monotonic()
            sampler.stop.set()
            sampler.join()
            corrupt_events = group.log_events("kv.corrupt_page")
        finally:
            if args.log_out:
                shutil.copyfile(group.log_path, args.log_out)
            try:
                group.stop()
            except AssertionError as exc:
                stop_problem = str(exc).splitlines()[0]
            leaked_shm = shm_segments(prefix)
    finally:
        if tmpfs:
            subprocess.run(["umount", str(kv_dir)], capture_output=True)
        shutil.rmtree(kv_dir, ignore_errors=True)
    return report(args, reference, records, injector, sampler, t0, t1, budget, corrupt_events,
                  stop_problem, leaked_shm, tmpfs, time.monotonic() - started,
                  tie_judge(model, args))


def tie_judge(model: Path, args):
    """Two different replies to one turn are a tie when both are greedy up to float ties on
    the model loaded here (its tokens for the turn as many as the server counted)."""
    judge = GreedyJudge(model)

    def is_tie(rec: Record, ref: Record) -> bool:
        return judge.tie(script_of(rec.agent, args).messages(*rec.key), rec.prompt,
                         (rec.text, ref.text), args.max_tokens)

    return is_tie


if __name__ == "__main__":
    sys.exit(main())
