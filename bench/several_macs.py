"""Agents through SMG in front of two servers: `cache_aware` against `round_robin`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/several_macs.py [--agents 4] [--turns 4] [--model-size tiny]
        [--policies cache_aware,round_robin] [--peer] [--plot docs/several-macs.png]
    # servers already running elsewhere (two Macs), SMG started here by the bench:
    .venv/bin/python bench/several_macs.py --server-url http://10.0.0.1:8001 \\
        --server-url http://10.0.0.2:8001 --api-key KEY --model-name local --model PATH

Workload: bench/multi_agent.py's tool loops. `--agents` agents run at once, `--turns` turns
each; every agent shares one `--system`-token system prompt and has its own task line, and each
turn appends a scripted assistant line and a tool result of about `--tool` tokens, then resends
the whole history (chat completions, streamed, greedy, `--reply`-token replies). Each policy's
run opens every prompt with a line of its own, so no run finds what another one left.

Per policy (in the order given), SMG (testing/smg.py installs it from PyPI into
~/.cache/switchyard/smg-venv) is started in front of the two servers with `--policy P` and the
health-check and failover flags of the router's unit (deploy/router_unit.py). On one
machine the bench starts two fresh servers for each policy (`--served-model-name`, the name
SMG routes by); `--peer` starts each with `--peer URL` pointing at the other (servers that
fetch KV pages from each other), and stops with a clear message where `switchyard serve` has no
`--peer`. With `--server-url` (twice) it uses servers already running (two Macs: start them with
the same `--served-model-name`; each policy's opening line keeps the runs apart).

Reported per policy (over all its runs when `--policies` names it twice: wall times summed,
TTFTs pooled): wall time, TTFT p50 / p95 / max over all turns, tokens re-read (for every
turn after an agent's first: prompt - cached - new, new being the growth of the prompt since
that agent's previous turn; each server's own usage figures), tokens prefilled (prompt -
cached), and how many turns each server took (from the servers' `request.finished` log lines
when the bench started them). The ratios are cache_aware / round_robin within this run; the
plot (`--plot`, matplotlib: the `bench` extra) draws every turn's TTFT per policy.
Every figure is measured in one run on a shared machine: compare, do not quote absolutes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (MODELS, fmt, log_events, model_dir, preload_note,  # noqa: E402
                           table)
from bench._plot import check_plotting  # noqa: E402
from bench.multi_agent import Agent, build, percentile, reread, run_workload  # noqa: E402
from switchyard.deploy.router_unit import FAILOVER_FLAGS  # noqa: E402
from switchyard.testing.group import (ServerGroup, free_port, short_tmp_dir, start_all,  # noqa: E402
                                      stop_all)
from switchyard.testing.smg import SmgRouter, SmgUnavailable, install, version  # noqa: E402

POLICIES = ("cache_aware", "round_robin")
NO_PEER = ("this checkout's `switchyard serve` has no --peer flag yet (servers that fetch KV "
           "pages from each other): run the bench without --peer")


def lists_peer_flag(help_text: str) -> bool:
    """Whether a --help text lists `--peer` itself (not only `--peer-timeout-s` and the like)."""
    return re.search(r"--peer(?![-\w])", help_text) is not None


def serve_supports_peer() -> bool:
    done = subprocess.run([sys.executable, "-m", "switchyard.deploy.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=120)
    return lists_peer_flag(done.stdout)


def peer_flags(ports: list[int], peer: bool) -> list[list[str]]:
    """Each server's `--peer URL` flags: the other servers' URLs (none without `peer`)."""
    return [[flag for j, other in enumerate(ports) if j != i
             for flag in ("--peer", f"http://127.0.0.1:{other}")] if peer else []
            for i in range(len(ports))]


def start_servers(model: Path, args) -> list[ServerGroup]:
    ports = [free_port() for _ in range(2)]
    common = ["--served-model-name", args.model_name, "--page-size", str(args.page_size),
              "--kv-disk-budget", "2GiB", *args.extra.split()]
    groups = [ServerGroup(model, slots=args.slots, ctx=args.ctx, port=port,
                          extra=[*common, *peers], startup_timeout_s=600)
              for port, peers in zip(ports, peer_flags(ports, args.peer))]
    try:
        start_all(groups)
    except BaseException:
        stop_all(groups)
        raise
    return groups


def turns_taken(groups: list[ServerGroup]) -> list[int]:
    """Requests each server finished, from its scheduler's `request.finished` lines."""
    return [sum(1 for e in log_events(g.log_path, "request.finished")
                if e.get("role") == "scheduler") for g in groups]


class ToolAgent(Agent):
    """multi_agent's agent whose steps are real tool calls (SMG checks that a tool message
    answers a call: `tool_call_id`)."""

    def messages(self, turn: int) -> list[dict]:
        msgs = [{"role": "system", "content": self.system},
                {"role": "user", "content": self.task}]
        for j in range(turn):
            call = f"call_{self.index}_{j}"
            msgs.append({"role": "assistant", "content": f"Step {j}.", "tool_calls": [
                {"id": call, "type": "function", "function": {
                    "name": "run_tool", "arguments": f'{{"item": {j}}}'}}]})
            msgs.append({"role": "tool", "tool_call_id": call, "content": self.tools[j]})
        return msgs


def opened(agents: list[Agent], run: str, own_system: bool = False) -> list[Agent]:
    """The same agents, every prompt opened by a line naming this run (and the agent, with
    `own_system`: then no two agents share a prefix)."""
    return [ToolAgent(a.index, (f"Agent {a.index}. " if own_system else "") + f"Run {run}. "
                      + a.system, a.task, a.tools) for a in agents]


def run_policy(policy: str, smg: Path, model: Path, agents: list[Agent], args, log) -> dict:
    groups = [] if args.server_url else start_servers(model, args)
    urls = args.server_url or [g.url for g in groups]
    smg_log = short_tmp_dir("smg") / f"smg-{policy}.log"
    try:
        # With a key, SMG takes it as its own: it accepts it and polls the servers' loads with it.
        keyed = ("--api-key", args.api_key) if args.api_key else ()
        with SmgRouter(smg, urls, smg_log, policy=policy,
                       extra=(*FAILOVER_FLAGS, *keyed, *args.smg_extra.split())) as router:
            turns, wall = run_workload(router.url, agents, args, log, args.model_name,
                                       {"Authorization": f"Bearer {args.api_key}"}
                                       if args.api_key else None)
        counts = turns_taken(groups) if groups else None
    finally:
        stop_all(groups)
    extra, prefilled = reread(turns)
    t0 = min(t.res.sent for t in turns)
    return dict(turns=turns, wall=wall, reread=extra, prefilled=prefilled, counts=counts,
                points=[(t.res.sent - t0, t.res.ttft) for t in turns])


def pooled(runs: list[dict]) -> dict:
    """One policy's figures over its runs: TTFTs pooled, the rest summed."""
    ttfts = [t.res.ttft for run in runs for t in run["turns"]]
    counts = [run["counts"] for run in runs]
    return dict(runs=len(runs), turns=len(ttfts), wall=sum(r["wall"] for r in runs),
                p50=percentile(ttfts, 0.5), p95=percentile(ttfts, 0.95), max=max(ttfts),
                longest=max(t.prompt for run in runs for t in run["turns"]),
                reread=sum(r["reread"] for r in runs),
                prefilled=sum(r["prefilled"] for r in runs),
                counts=counts if None not in counts else None,
                points=sorted(p for r in runs for p in r["points"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="in this order; one named twice runs twice and its figures are pooled "
                    "(cache_aware,round_robin,round_robin,cache_aware evens out a load that "
                    "drifts)")
    ap.add_argument("--peer", action="store_true",
                    help="start each server with --peer URL of the other (needs a server that "
                    "has --peer)")
    ap.add_argument("--server-url", action="append", metavar="URL",
                    help="a server already running (give two); the bench then starts only SMG")
    ap.add_argument("--api-key", help="a key of the --server-url servers (off loopback a "
                    "server needs one): sent with every request, and SMG's own")
    ap.add_argument("--model-name", default="local",
                    help="the name the servers announce (--served-model-name) and SMG routes by")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--system", type=int, default=600, help="shared system prompt tokens")
    ap.add_argument("--own-system", action="store_true",
                    help="every agent's system prompt opens with a line of its own (agents of "
                    "different projects): no two agents share a prefix")
    ap.add_argument("--tool", type=int, default=200, help="tool-result tokens per turn")
    ap.add_argument("--spread", type=int, default=8,
                    help="tokens between the shortest and the longest agent's tool results")
    ap.add_argument("--reply", type=int, default=16, help="reply tokens (max_tokens)")
    ap.add_argument("--extra", default="", help="more switchyard serve flags, space-separated")
    ap.add_argument("--smg-extra", default="", help="more smg launch flags, space-separated "
                    "(after the unit's: a later flag wins)")
    ap.add_argument("--plot", metavar="PNG", help="draw every turn's TTFT per policy here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", choices=tuple(MODELS), default="tiny")
    ap.add_argument("--model", help="model directory or .gguf, or `default` (the trained "
                    "default model; overrides --model-size; with --server-url only its "
                    "tokenizer is read, to size the prompts)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-turn lines")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.server_url and len(args.server_url) != 2:
        ap.error("--server-url: give two servers")
    if args.server_url and args.peer:
        ap.error("--peer: only when the bench starts the servers (start yours with --peer)")
    if args.peer and not serve_supports_peer():
        print(f"several_macs: {NO_PEER}", file=sys.stderr)
        return 2
    if args.plot:
        check_plotting(ap)
    if note := preload_note():
        print(note, file=sys.stderr)
    try:
        smg = install()
    except SmgUnavailable as exc:
        print(f"several_macs: {exc}", file=sys.stderr)
        return 2
    if args.model == "default":
        from switchyard.deploy.default_model import default_model_path

        model = Path(default_model_path())
    else:
        model = Path(args.model).expanduser() if args.model else model_dir(args.model_size)
    base = build_agents(args, model)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    where = ", ".join(args.server_url) if args.server_url else "two servers on this machine"
    print(f"model {model}; SMG {version(smg)} in front of {where}"
          f"{' (each --peer the other)' if args.peer else ''}; {args.agents} agents x "
          f"{args.turns} turns, {'own' if args.own_system else 'shared'} ~{args.system}-token "
          f"system prompt, +~{args.tool} tokens "
          f"per turn, {args.reply}-token replies; --slots {args.slots}", flush=True)
    runs: dict[str, list[dict]] = {}
    for k, policy in enumerate(policies):  # a policy named twice runs twice (ABBA order)
        print(f"\n== --policy {policy}", flush=True)
        agents = opened(base, f"{policy} {k}", args.own_system)
        runs.setdefault(policy, []).append(run_policy(policy, smg, model, agents, args, log))
    report({policy: pooled(r) for policy, r in runs.items()}, args, model)
    return 0


def build_agents(args, model: Path) -> list[Agent]:
    """multi_agent's agents, their texts sized with the model's tokenizer.json (a GGUF's
    written out first)."""
    if model.suffix != ".gguf":
        return build(args, model)
    from tokenizers import Tokenizer

    from switchyard.common.tokenizer_loading import save_gguf_tokenizer

    out = short_tmp_dir("sytok")
    save_gguf_tokenizer(model, out)
    return build(args, model, Tokenizer.from_file(str(out / "tokenizer.json")))


def report(figs: dict[str, dict], args, model: Path) -> None:
    rows = []
    for policy, f in figs.items():
        counts = ", ".join(" / ".join(map(str, c)) for c in f["counts"]) if f["counts"] \
            else "n/a"
        rows.append([policy, f["runs"], f["turns"], fmt(f["wall"], 1), fmt(f["p50"], 2),
                     fmt(f["p95"], 2), fmt(f["max"], 2), f["longest"], f["reread"],
                     f["prefilled"], counts])
    print("\nTTFT over all turns (s); re-read: tokens prefilled beyond each turn's new tokens "
          "(turns after an agent's first); prefilled: prompt - cached, all turns; turns per "
          "server: request.finished lines of each, run by run")
    print(table(["policy", "runs", "turns", "wall s", "p50", "p95", "max", "prompt max",
                 "re-read", "prefilled",
                 "turns per server"], rows))
    a, b = figs.get("cache_aware"), figs.get("round_robin")
    if a and b:
        ratio = (lambda x, y: fmt(x / y, 2) if y else ("1.00" if x == y else "inf"))
        print(f"cache_aware / round_robin: re-read {a['reread']} / {b['reread']} = "
              f"{ratio(a['reread'], b['reread'])}, prefilled {ratio(a['prefilled'], b['prefilled'])}"
              f", TTFT p95 {ratio(a['p95'], b['p95'])}, wall {ratio(a['wall'], b['wall'])}")
    if args.plot:
        from bench._plot import plot_ttft

        title = (f"{model.name}: {args.agents} agents x {args.turns} turns through SMG, two "
                 f"servers{' (--peer)' if args.peer else ''}, "
                 f"{'own' if args.own_system else 'shared'} system prompts")
        print(f"plot: {plot_ttft({p: f['points'] for p, f in figs.items()}, Path(args.plot), title)}")


if __name__ == "__main__":
    sys.exit(main())
