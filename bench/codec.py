"""A long prompt costs nothing on the wire.

    .venv/bin/python bench/codec.py [--rounds 200]

Round trip (encode, then decode) of a `SubmitRequest` of 1K, 10K, 100K and 200K tokens
through `proto.codec` (msgspec structs, token ids packed as one uint32 `bin` value), against
protocol 1's wire form of the same message: a msgpack map whose token list is an array of
ints, rebuilt element by element into a tuple (what the dataclass codec did). Also: packing a
tokenizer's list of ints into `TokenIds` (the gateway pays it once per request).

"fresh" keeps every frame and message of the run alive, so each round trip writes to memory
the process never touched, as a receiving process does; "reused" lets the allocator hand the
same memory back (the best case). Medians over rounds; target: 200K tokens <= 1 ms.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from switchyard.proto import codec  # noqa: E402
from switchyard.proto.values import SamplingParams  # noqa: E402
from switchyard.proto.gateway_scheduler import SubmitRequest  # noqa: E402
from switchyard.proto.tokens import TokenIds  # noqa: E402

LENGTHS = (1_000, 10_000, 100_000, 200_000)
TARGET_MS = 1.0


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def round_trip(message):
    return codec.decode(codec.encode(message))


def protocol_1_round_trip(wire: dict):
    raw = msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)
    return tuple(x for x in raw["prompt_token_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for n in LENGTHS:
        ids = [rng.randrange(151_000) for _ in range(n)]
        msg = SubmitRequest(f"r{n}", ids, 256, SamplingParams(seed=1), (0, 1))
        assert round_trip(msg) == msg
        kept = []
        reused = median_ms(lambda: round_trip(msg), args.rounds)
        fresh = median_ms(lambda: kept.append(round_trip(msg)), args.rounds)
        kept.clear()
        pack = median_ms(lambda: TokenIds(ids), max(10, args.rounds // 10))
        wire = {"kind": "submit_request", "rid": msg.rid, "prompt_token_ids": ids,
                "max_tokens": 256, "sampling": {"seed": 1}, "stop_token_ids": [0, 1]}
        old = median_ms(lambda: protocol_1_round_trip(wire), max(10, args.rounds // 10))
        rows.append((n, reused, fresh, pack, old))
    print(f"{'tokens':>8} {'reused ms':>10} {'fresh ms':>10} {'pack ms':>9} "
          f"{'protocol 1 ms':>14} {'speed-up':>9}")
    for n, reused, fresh, pack, old in rows:
        print(f"{n:>8} {reused:>10.3f} {fresh:>10.3f} {pack:>9.3f} {old:>14.3f} "
              f"{old / fresh:>8.0f}x")
    worst = max(rows[-1][1], rows[-1][2])
    verdict = "meets" if worst <= TARGET_MS else "misses"
    print(f"200K-token SubmitRequest round trip: {worst:.3f} ms ({verdict} <= {TARGET_MS} ms)")


if __name__ == "__main__":
    main()
