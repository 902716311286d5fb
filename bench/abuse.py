"""The abuse figures: each class of abusive request against a live group on
loopback, beside a well-behaved client that sends a small streamed chat every second.

Per class, `--reps` repetitions of its payloads (testing/abuse.py and its sizes;
the schema blow-ups are new schemas every repetition, so the refusal cache never answers them):

- abusive s: the slowest abusive request, sent to answered (client side, upload included);
  target <= 2 s of work;
- TTFT p95 x solo: the well-behaved client's p95 time to first token during the class / its
  p95 alone in the `--solo` requests just before the class (on a shared machine the load
  moves: each class is compared with its own neighbourhood); target <= 2;
- wrong: replies of the well-behaved client that were not its reference reply (or an error);
- RSS MB: the gateway's resident memory after the class minus before it; target <= 200.

    .venv/bin/python bench/abuse.py [--reps 20] [--classes "many messages" ...] [--model DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import parse_with_model, table  # noqa: E402
from switchyard.testing.abuse import CLASSES, WellBehaved, p95  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402


def rss_mb(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--solo", type=int, default=12,
                    help="requests alone before each class, for its TTFT p95 baseline")
    ap.add_argument("--every-s", type=float, default=1.0)
    ap.add_argument("--classes", nargs="*", default=list(CLASSES))
    ap.add_argument("--ctx", type=int, default=32768)
    args, model = parse_with_model(ap)
    rows = []
    with ServerGroup(model, slots=4, ctx=args.ctx) as group:
        probe = WellBehaved(group.url)
        reference, _ = probe.once()

        def solo_p95() -> float:
            solo = []
            for _ in range(args.solo):
                began = time.monotonic()
                text, ttft = probe.once()
                assert text == reference, (text, reference)
                solo.append(ttft)
                time.sleep(max(0.0, args.every_s - (time.monotonic() - began)))
            return p95(solo)

        gateway = group.pid_of("gateway")
        baselines = []
        for name in args.classes:
            baseline = solo_p95()
            baselines.append(baseline)
            make = CLASSES[name]
            payloads = list(make())
            before = rss_mb(gateway)
            slowest, statuses = 0.0, {}
            with WellBehaved(group.url, every_s=args.every_s, expected=reference) as neighbour:
                for rep in range(args.reps):
                    if name == "schema blow-ups" and rep:
                        payloads = list(make())  # new schemas: no cached refusal
                    for payload in payloads:
                        began = time.monotonic()
                        status = payload.send(group.url)
                        slowest = max(slowest, time.monotonic() - began)
                        statuses[status] = statuses.get(status, 0) + 1
                time.sleep(2 * args.every_s)  # the neighbour's last replies
            time.sleep(1.0)
            growth = rss_mb(gateway) - before
            rows.append([name, sum(statuses.values()),
                         " ".join(f"{k}:{v}" for k, v in sorted(statuses.items(), key=str)),
                         f"{slowest:.2f}", f"{p95(neighbour.ttfts) / baseline:.2f}",
                         len(neighbour.wrong), len(neighbour.ttfts), f"{growth:+.0f}"])
            print(f"  {name}: done", flush=True)
        crashed = group.log_text().count('"request.crashed"')
    print(f"\nmodel {model.name}, ctx {args.ctx}, {args.reps} repetitions per class, "
          f"well-behaved solo TTFT p95 {min(baselines) * 1e3:.0f}-{max(baselines) * 1e3:.0f} "
          f"ms ({args.solo} requests before each class); request.crashed in the log: {crashed}")
    print(table(["class", "sent", "statuses (None: abandoned)", "abusive s", "TTFT p95 x solo",
                 "wrong", "replies", "RSS MB"], rows))


if __name__ == "__main__":
    main()
