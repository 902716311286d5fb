"""A worker group of 2 ranks (ring backend on loopback) against 1 rank.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/distributed.py [--model-size tiny|h512] [--tokens 48]

Servers on generated twins: qwen3 with 1 rank and 2 ranks tensor
parallel; qwen3_moe with 1 rank, 2 ranks tensor and 2 ranks pipeline parallel (qwen3 has no
pipeline() in mlx-lm). Per server:

- per-stream decode tokens/s: one streamed completion of `--tokens` tokens at a time (so the
  worker's pipelined burst runs), median over `--rounds`;
- switching-turn TTFT: two conversations (about `--initial` tokens each) take turns on `--slots
  2`, every turn adding about `--new` tokens; the median TTFT of the turns after the first of
  each conversation (each re-uses its resident prefix and prefills only its new tokens);

The configurations of one model run side by side and every round visits them all (in
alternating order), so the machine's noise falls on all alike.
- communication, measured inside the ranks: the all_sum of one hidden vector (what tensor
  parallelism pays twice per layer per token) and of one token id (the token share), from
  `worker.group_ready`, and the step broadcast per step (one all_sum of a 4 KiB frame) from
  the `step.done` lines (`broadcast_ms`), against the step's own time. The broadcast waits
  for every rank to have finished the previous step, so it includes the ranks' skew.

First, a probe: a RunStep-sized payload broadcast through the group (one all_sum of the 4 KiB
frame) against a ZeroMQ round trip of the same bytes between the same two processes.

Reported: 2 ranks / 1 rank for decode tokens/s and switching TTFT. On one CPU machine the two
ranks share the same cores (and here the machine is shared with other jobs): a 2-rank group
cannot be faster than 1 rank; the ratios show the price of the lockstep and the collectives,
not what two Macs would gain. Every figure is measured within one run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (fmt, load_tokenizer, log_events, make_text, median,  # noqa: E402
                           model_dir, preload_note, stream, table, word_list)
from switchyard.testing.group import ServerGroup, free_port_pair  # noqa: E402

CONFIGS = [("qwen3", 1, ""), ("qwen3", 2, "tensor"),
           ("qwen3_moe", 1, ""), ("qwen3_moe", 2, "tensor"), ("qwen3_moe", 2, "pipeline")]


def hostfile(num_ranks: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sybh")) / "hosts.json"
    path.write_text(json.dumps([{"ssh": f"rank{r}", "ips": ["127.0.0.1"]}
                                for r in range(num_ranks)]))
    return path


class Server:
    """One configuration's running group and what was measured on it."""

    def __init__(self, arch: str, ranks: int, mode: str, args) -> None:
        self.arch, self.ranks, self.mode = arch, ranks, mode or "-"
        extra = ["--log-level", "debug"]
        roles: tuple[str, ...] = ()
        if ranks > 1:
            extra += ["--hostfile", str(hostfile(ranks)), "--parallel", mode,
                      "--dist-port", str(free_port_pair())]
            roles = tuple(f"{base}.{r}" for r in range(1, ranks) for base in ("worker", "kvstore"))
        self.group = ServerGroup(model_dir(args.model_size, arch=arch), slots=2, ctx=4096,
                                 extra=extra, extra_roles=roles, startup_timeout_s=300)
        self.decode: list[float] = []
        self.ttfts: list[float] = []
        self.histories: dict[str, list[dict]] = {}

    def request(self, path: str, body: dict):
        out = stream(self.group.url, path, body)
        if out.error:
            raise RuntimeError(f"{self.arch} {self.ranks} {self.mode}: {out.error}")
        return out

    def result(self) -> dict:
        steps = [e for e in log_events(self.group.log_path, "step.done")
                 if e.get("rank", 0) == 0]
        ready = log_events(self.group.log_path, "worker.group_ready")
        broadcast = [e["broadcast_ms"] for e in steps if "broadcast_ms" in e]

        def med(xs):
            return median(xs) if xs else float("nan")
        return {"arch": self.arch, "ranks": self.ranks, "mode": self.mode,
                "decode_tps": med(self.decode), "switch_ttft_s": med(self.ttfts),
                "step_ms": med([e["step_ms"] for e in steps]), "broadcast_ms": med(broadcast),
                "all_sum_hidden_us": med([e["all_sum_hidden_us"] for e in ready]),
                "all_sum_token_us": med([e["all_sum_token_us"] for e in ready])}


def run_arch(arch: str, configs: list[tuple[int, str]], args) -> list[dict]:
    """Every configuration of `arch` up at once; rounds alternate their order, so the
    machine's noise falls on all alike. Idle groups cost little (a ping per heartbeat)."""
    servers = [Server(arch, ranks, mode, args) for ranks, mode in configs]
    tokenizer = load_tokenizer(model_dir(args.model_size, arch=arch))
    rng = random.Random(7)
    words = word_list()
    prompts = [make_text(rng, tokenizer, 40, words) for _ in range(args.rounds)]
    systems = {c: make_text(rng, tokenizer, args.initial, words) for c in "AB"}
    news = [[make_text(rng, tokenizer, args.new, words) for _ in "AB"]
            for _ in range(args.rounds + 1)]
    try:
        for server in servers:
            server.group.start()
            server.histories = {c: [{"role": "system", "content": systems[c]}] for c in "AB"}
        for rnd in range(args.rounds + 1):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for server in order:
                if rnd < args.rounds:
                    out = server.request("/v1/completions", {
                        "prompt": f"{rnd} {prompts[rnd]}", "temperature": 0,
                        "max_tokens": args.tokens})
                    server.decode.append(out.decode_tps())
                for i, conv in enumerate("AB"):
                    history = server.histories[conv]
                    history.append({"role": "user", "content": news[rnd][i]})
                    out = server.request("/v1/chat/completions", {
                        "messages": history, "temperature": 0, "max_tokens": 8})
                    history.append({"role": "assistant", "content": "noted, next step."})
                    if rnd > 0:  # round 0 is each conversation's cold start
                        server.ttfts.append(out.ttft)
        return [server.result() for server in servers]
    finally:
        for server in servers:
            server.group.stop(check=False)


def probe_rank(rank: int, hosts: Path, port: int, zmq_port: int, repeats: int) -> None:
    """One rank of the broadcast probe: a RunStep-sized payload sent by rank 0 through the group
    (worker/group.py's frame) and, for comparison, through a ZeroMQ PAIR socket (rank 1 echoes
    a byte, so the figure is a round trip, as the all_sum's is)."""
    import zmq

    from switchyard.common.hostfile import read_hostfile
    from switchyard.worker.group import STEP, RankGroup

    group = RankGroup.join(read_hostfile(hosts), rank, "ring", "tensor", port, hosts.parent)
    payload = bytes(range(256)) * 2  # a decode step's RunStep is a few hundred bytes
    sock = zmq.Context.instance().socket(zmq.PAIR)
    if rank == 0:
        sock.bind(f"tcp://127.0.0.1:{zmq_port}")
    else:
        sock.connect(f"tcp://127.0.0.1:{zmq_port}")

    def zmq_round_trip() -> None:
        if rank == 0:
            sock.send(payload)
            sock.recv()
        else:
            sock.recv()
            sock.send(b"k")

    def broadcast() -> None:
        group.broadcast_bytes(0, payload if rank == 0 else None, STEP)

    times: list[float] = []
    zmq_times: list[float] = []
    for i in range(repeats + 1):  # interleaved, so the machine's noise falls on both alike
        for fn, out in ((broadcast, times), (zmq_round_trip, zmq_times)):
            started = time.perf_counter()
            fn()
            if i:
                out.append(time.perf_counter() - started)
    if rank == 0:
        print(json.dumps({"group_broadcast_us": round(median(times) * 1e6, 1),
                          "zmq_round_trip_us": round(median(zmq_times) * 1e6, 1),
                          "payload_bytes": len(payload)}), flush=True)
    sock.close(linger=0)


def broadcast_probe(repeats: int) -> dict:
    """Two probe ranks as subprocesses; rank 0's line of figures."""
    import subprocess

    hosts = hostfile(2)
    port, zmq_port = free_port_pair(), free_port_pair()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--probe-rank", str(r), "--probe-hosts", str(hosts),
         "--probe-port", str(port), "--probe-zmq-port", str(zmq_port),
         "--probe-repeats", str(repeats)], stdout=subprocess.PIPE, text=True)
        for r in range(2)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return json.loads(out[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="tiny", choices=("tiny", "h512"))
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--initial", type=int, default=400)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--probe-repeats", type=int, default=200)
    for name in ("rank", "hosts", "port", "zmq-port"):  # one rank of the broadcast probe
        p.add_argument(f"--probe-{name}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_rank is not None:
        probe_rank(int(args.probe_rank), Path(args.probe_hosts), int(args.probe_port),
                   int(args.probe_zmq_port), args.probe_repeats)
        return 0
    print(preload_note(), flush=True)
    probe = broadcast_probe(args.probe_repeats)
    print(f"step broadcast of {probe['payload_bytes']} bytes, median: through the group "
          f"{probe['group_broadcast_us']} us; ZeroMQ PAIR round trip {probe['zmq_round_trip_us']}"
          f" us", flush=True)
    results = []
    for arch in dict.fromkeys(a for a, _, _ in CONFIGS):
        done = run_arch(arch, [(r, m) for a, r, m in CONFIGS if a == arch], args)
        print(f"done: {done}", flush=True)
        results += done
    print(table(["arch", "ranks", "parallel", "decode tok/s", "switch TTFT s", "step ms",
                 "broadcast ms/step", "all_sum hidden us", "all_sum token us"],
                [[r["arch"], r["ranks"], r["mode"], fmt(r["decode_tps"], 1),
                  fmt(r["switch_ttft_s"]), fmt(r["step_ms"], 1), fmt(r["broadcast_ms"]),
                  fmt(r["all_sum_hidden_us"], 0), fmt(r["all_sum_token_us"], 0)]
                 for r in results]))
    base = {r["arch"]: r for r in results if r["ranks"] == 1}
    print("\n2 ranks / 1 rank (same cores: the ranks compete for this machine's CPUs)")
    print(table(["arch", "parallel", "decode tok/s ratio", "switch TTFT ratio"],
                [[r["arch"], r["mode"], fmt(r["decode_tps"] / base[r["arch"]]["decode_tps"], 2),
                  fmt(r["switch_ttft_s"] / base[r["arch"]]["switch_ttft_s"], 2)]
                 for r in results if r["ranks"] > 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
