"""The cache against the optimum: recorded request traces replayed under memory and disk budgets
through Switchyard's own policy (the scheduler core), LRU and the offline optimum (Belady).

    PYTHONPATH=. .venv/bin/python bench/residency.py --json [--plot docs/residency.png]
    PYTHONPATH=. .venv/bin/python bench/residency.py record --shape agent-traffic
    PYTHONPATH=. .venv/bin/python bench/residency.py record --shape sessions
    PYTHONPATH=. .venv/bin/python bench/residency.py record --log LOG --name NAME

One JSON line per trace x budget x policy:
    {"trace", "budget": {"memory_tokens", "disk_tokens"},
     "policy": "switchyard"|"switchyard-write-back"|"switchyard-hybrid"|"switchyard-no-word"|
               "optimal-slots"|"lru"|"optimal",
     "tokens_reread", "bytes_restored", "bytes_written", ...}
Bytes are tokens x `--bytes-per-token` (default 46,080: SmolLM2-135M's KV at float32, as the
memory plan counts it). Traces: bench/traces/*.jsonl (bench/residency_trace.py says the
format). Policies: bench/residency_policies.py (LRU, Belady and the bound it gives),
bench/residency_core.py (the core through `SchedulerCore.handle`, scripted peers; with
`switchyard-hybrid`, a hybrid model's worker: recurrent state only at a slot's end and mark),
bench/residency_oracle.py (`optimal-slots`: the core told the future, so the best its own
memory layout allows; the rest of the gap to `optimal` is the layout's, not the policy's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.residency_core import replay_core  # noqa: E402
from bench.residency_policies import replay, reread_bound  # noqa: E402
from bench.residency_record import read_log, record_sessions, trace_from_log  # noqa: E402
from bench.residency_trace import (Trace, TraceRequest, load, reordered, save,  # noqa: E402
                                   shared_prefixes)

TRACES = REPO / "bench" / "traces"
BYTES_PER_TOKEN = 46_080
# A modelled client: a tool runs this long before its result goes back.
TOOL_S = 2.0
PREFILL_TOKENS_PER_S = 4000.0
DECODE_TOKEN_S = 0.02


# The core told how each reply ended (its residency order), the same with --kv-write-back (a
# disk smaller than memory written as slots leave), the same on a hybrid model (a
# recurrent state at a slot's end and mark only: no cut, a copy or restore only to a state),
# the core told nothing (least recently used among idle slots, as before the gateway's word),
# the core told the future (whole slots per conversation, as the worker keeps them), LRU
# pages, the optimum over pages (a shared prefix held once).
POLICIES = ("switchyard", "switchyard-write-back", "switchyard-hybrid", "switchyard-no-word",
            "optimal-slots", "lru", "optimal")
# The plot compares policies on one layout, attention-only: the hybrid row is a family's cost,
# several times the others', in performance.md's table.
PLOTTED = tuple(p for p in POLICIES if p != "switchyard-hybrid")


def budgets(trace: Trace) -> list[dict]:
    """Memory of 1.5, 3 and 6 of the trace's largest prompts; disk of a quarter of the tokens
    its prompts hold and of all of them (the unique tokens, whole pages: a disk that keeps
    everything)."""
    largest = max(r.prompt for r in trace.requests)
    unique = sum(r.new for r in trace.requests)
    out = []
    for mem in (1.5, 3, 6):
        for disk in (unique // 4, unique * 2):
            out.append({"memory_tokens": int(mem * largest), "disk_tokens": int(disk)})
    return out


def measure(trace: Trace, budget: dict, bytes_per_token: int) -> list[dict]:
    """The core first; LRU and the optimum then see the requests in the order the core
    admitted them, so the three differ in what they keep, not in when requests ran."""
    m, d = budget["memory_tokens"], budget["disk_tokens"]
    rows = []
    in_core_order = trace
    for policy in POLICIES:
        extra = {}
        if policy.startswith("switchyard") or policy == "optimal-slots":
            c = replay_core(trace, m, d, tell_ends=policy != "switchyard-no-word",
                            oracle=policy == "optimal-slots",
                            hybrid=policy == "switchyard-hybrid",
                            write_back=policy == "switchyard-write-back")
            reread, restored, written = c.tokens_reread, c.tokens_restored, c.tokens_written
            extra["peak_memory_tokens"] = c.peak_memory_tokens
            extra["peak_held_tokens"] = c.peak_held_tokens
            if policy == "switchyard":
                in_core_order = reordered(trace, c.order)
        else:
            c = replay(in_core_order, policy, m, d)
            reread, restored, written = c.tokens_reread, c.tokens_restored, c.tokens_written
            if policy == "optimal":
                extra["reread_bound"] = reread_bound(in_core_order, m, d)
                extra["disk_overshoot_tokens"] = c.disk_overshoot_tokens
        rows.append({"trace": trace.name, "budget": budget, "policy": policy,
                     "tokens_reread": reread, "bytes_restored": restored * bytes_per_token,
                     "bytes_written": written * bytes_per_token,
                     "tokens_restored": restored, **extra})
    return rows


def plot(rows: list[dict], path: Path) -> Path:
    """Restored plus re-read tokens per budget, one panel per trace, a bar per policy."""
    from matplotlib.figure import Figure

    from bench._plot import DPI, HEIGHT, WIDTH

    traces = sorted({r["trace"] for r in rows})
    cols = min(3, len(traces))
    nrows = -(-len(traces) // cols)
    height = HEIGHT if nrows == 1 else 0.6 * HEIGHT * nrows
    fig = Figure(figsize=(WIDTH / DPI, height / DPI), dpi=DPI)
    axes = list(fig.subplots(nrows, cols, squeeze=False).flat)
    for ax in axes[len(traces):]:
        ax.set_visible(False)
    for ax, name in zip(axes, traces):
        mine = [r for r in rows if r["trace"] == name]
        labels = []
        for r in mine:
            b = r["budget"]
            label = f"mem {b['memory_tokens'] // 1000}K\ndisk {b['disk_tokens'] // 1000}K"
            if label not in labels:
                labels.append(label)
        width = 0.8 / len(PLOTTED)
        for k, policy in enumerate(PLOTTED):
            ys = [r["tokens_reread"] + r["tokens_restored"] for r in mine
                  if r["policy"] == policy]
            ax.bar([x + width * (k - (len(PLOTTED) - 1) / 2) for x in range(len(ys))], ys,
                   width=width, label=policy)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("tokens re-read + restored")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def record_agent_traffic(agents: int, turns: int, grow_to: int, reply: int) -> Trace:
    """bench/agent_traffic.py's shape (Claude Code's recorded system prompt and tools, a main
    session and parallel sub-agents), rendered by the gateway's renderer (the bench's ids equal
    the gateway's: tests/unit/test_bench_agent_traffic.py) with the tiny model's tokenizer.
    Arrival times are modelled, not measured: a request goes when its conversation's previous
    reply ended (prefill of its new tokens, then its reply) plus a tool's run time."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    from bench.agent_traffic_workload import Workload, prepare
    from switchyard.twins.tokenizer import tokenizer_files

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in tokenizer_files().items():
            (Path(tmp) / name).write_bytes(data)
        tok = PreTrainedTokenizerFast.from_pretrained(tmp)
    args = argparse.Namespace(seed=0, shape="claude-code", system=None, agents=agents,
                              turns=turns, grow_to=grow_to, reply=reply)
    reqs = prepare(Workload(args, tok), ctx=1 << 20)
    service = {k: r.new / PREFILL_TOKENS_PER_S + reply * DECODE_TOKEN_S for k, r in reqs.items()}
    when = {("main", 0): 0.0}
    spawned = service[("main", 0)] + TOOL_S
    for i in range(agents):
        t = spawned
        for turn in range(turns + 1):
            when[(f"agent {i}", turn)] = t
            t += service[(f"agent {i}", turn)] + TOOL_S
    when[("main", 1)] = max(when[(f"agent {i}", turns)] + service[(f"agent {i}", turns)]
                            for i in range(agents)) + TOOL_S
    order = sorted(reqs, key=lambda k: (when[k], k))
    prompts = [reqs[k].prompt_ids for k in order]
    shared = shared_prefixes(prompts, 256)
    last_turn = {"main": 1, **{f"agent {i}": turns for i in range(agents)}}
    return Trace(
        f"agent-traffic-{agents}", 256, tuple(
            TraceRequest(i, when[k], len(prompts[i]), shared[i], reply,
                         "stop" if k[1] == last_turn[k[0]] else "tool_calls", k[0])
            for i, k in enumerate(order)),
        source=f"bench/agent_traffic.py --shape claude-code --agents {agents} --turns {turns} "
               f"--grow-to {grow_to} --reply {reply}, tiny tokenizer; modelled times",
        command=f"bench/residency.py record --shape agent-traffic --agents {agents} "
                f"--turns {turns} --grow-to {grow_to}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        ap = argparse.ArgumentParser(description="record a trace into bench/traces/")
        ap.add_argument("--shape", choices=["agent-traffic", "sessions"],
                        help="agent-traffic: bench/agent_traffic.py's requests with modelled "
                        "times; sessions: the scripted agent-client sessions, run for real")
        ap.add_argument("--log", type=Path, help="a server's JSON log at --log-level debug "
                        "(bench/residency_record.py)")
        ap.add_argument("--name", help="the trace's name, with --log")
        ap.add_argument("--source", default="", help="what the log is of, with --log")
        ap.add_argument("--sessions", nargs="*", help="with --shape sessions: only these")
        ap.add_argument("--agents", type=int, default=20)
        ap.add_argument("--turns", type=int, default=6)
        ap.add_argument("--grow-to", type=int, default=20000)
        ap.add_argument("--reply", type=int, default=16)
        args = ap.parse_args(argv[1:])
        TRACES.mkdir(parents=True, exist_ok=True)
        if args.shape == "sessions":
            paths = record_sessions(TRACES, args.sessions)
        elif args.log:
            if not args.name:
                ap.error("--log needs --name")
            trace = trace_from_log(read_log(args.log), args.name, 256, args.source,
                                   f"bench/residency.py record --log LOG --name {args.name}")
            paths = [TRACES / f"{trace.name}.jsonl"]
            save(trace, paths[0])
        elif args.shape == "agent-traffic":
            trace = record_agent_traffic(args.agents, args.turns, args.grow_to, args.reply)
            paths = [TRACES / f"{trace.name}.jsonl"]
            save(trace, paths[0])
        else:
            ap.error("give --shape or --log")
        for path in paths:
            print(f"{path}: {len(load(path).requests)} requests, {path.stat().st_size} bytes")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON line per trace x budget x "
                    "policy (the default prints the same lines)")
    ap.add_argument("--traces", nargs="*", type=Path,
                    help="trace files (default: bench/traces/*.jsonl)")
    ap.add_argument("--bytes-per-token", type=int, default=BYTES_PER_TOKEN)
    ap.add_argument("--plot", type=Path, metavar="PNG")
    args = ap.parse_args(argv)
    rows = []
    for path in args.traces or sorted(TRACES.glob("*.jsonl")):
        trace = load(path)
        for budget in budgets(trace):
            for row in measure(trace, budget, args.bytes_per_token):
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.plot:
        print(f"plot: {plot(rows, args.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
