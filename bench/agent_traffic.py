"""Claude Code–shaped load on a real model, Switchyard vs mlx_lm.server vs vllm-mlx.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/agent_traffic.py [--model M.gguf] [--agents 20] [--turns 6]
        [--grow-to 20000] [--slots 4] [--servers switchyard,mlx_lm,vllm_mlx] [--plot T.png]
        [--shape claude-code|synthetic]

Workload (deterministic, `--seed`): a main session and `--agents` sub-agents, all sending what
Claude Code sends: Anthropic Messages requests, streamed, whose system prompt starts with an
`x-anthropic-billing-header:` line that changes on every request, then the shared system
prompt and tools; `tool_use` / `tool_result` turns. `--shape claude-code` (default): the
system blocks, all 12 tools and the mid-conversation `role: "system"` message of Claude Code
2.1.332's recorded first request (tests/corpus), that message right after each
conversation's first user message as Claude Code sends it (its searches and notes go through
Bash and Write: it has no Glob, Grep or TodoWrite). `--shape synthetic` (the first sittings):
a system prompt of about `--system` tokens and 20 tool definitions (Task, Bash, Glob, Grep,
Read, Edit, Write, TodoWrite, WebFetch, ... with JSON schemas), no system message.
- The main session sends its request (turn 0), then one assistant message with `--agents`
  parallel `Task` calls; every sub-agent runs at once.
- A sub-agent shares the main session's system prompt and tools. Its own tool loop: its task,
  then `--turns` tool calls (Glob, Grep, Read, Edit, Bash, TodoWrite, scripted and seeded),
  each answered by a tool result of realistic text (numbered file contents, grep lines, test
  output) sized so its last prompt is about `--grow-to` tokens (within the context), then its
  final turn. A request is sent as soon as the previous reply of that conversation ends.
- When every sub-agent is done, the main session sends their reports as the Task results.
- The model's replies are capped at `--reply` tokens and not carried into the history (the
  assistant turns are scripted), so every server sees the same conversations.

Servers, one at a time on the same machine:
- `switchyard`: the model as given (`--model`, default the embedded default model), `--slots`,
  `--max-running`.
- `mlx_lm`: `mlx_lm.server` of this venv, default prompt-cache settings.
- `vllm_mlx`: vllm-mlx 0.6.0 from its own venv (bench/_peers.py installs it once),
  `--continuous-batching --enable-prefix-cache --ssd-cache-dir --ssd-cache-max-gb`, own HOME.
The peers speak OpenAI chat completions: the same conversation as chat messages with tool
calls and tool messages, the billing line left out as Switchyard removes it, the system
message where Switchyard's gateway puts it (in place where the template writes it there, else
joined to the user message before it), so the chat template renders the same tokens
(checked: each server's prompt token count against the bench's own rendering). A GGUF
`--model` reaches the peers as a Hugging Face directory (built once, bench/_peers.py):
`--weights same` (default) holds exactly the GGUF loader's weights, so all three run the same
kernels on the same numbers; `f16` / `f32` dequantize them, and then Switchyard serves that
directory too.

Reported per server: wall time (the main session's first request to its last reply), TTFT
p50 / p95 / max over every request, tokens re-read beyond each request's new ones (prompt -
cached - new, where new is the growth over the conversation's previous prompt, or over the
main session's first prompt for a sub-agent's first request: what a perfect cache still
reads) from each server's own counter (Switchyard: usage `cache_read_input_tokens`;
mlx_lm.server: usage `cached_tokens`; vllm-mlx: its log's `[cache_fetch]` / `[ssd_promote]`
lines, matched by prompt length), and the peak RSS and PSS summed over the server's whole
process tree. Every figure is measured in one run on a shared machine: compare, do not quote
absolutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench._common import MODELS, fmt, model_dir, preload_note, table  # noqa: E402
from bench._plot import check_plotting  # noqa: E402
from bench._peers import (PEER_WEIGHTS, TreeMemory, hf_export, mlx_lm_server,  # noqa: E402
                          vllm_mlx_server)
from bench.agent_traffic_figures import (admission_times, match_vllm, residency,  # noqa: E402
                                         summarize, switchyard_detail, ttft_points)
from bench.agent_traffic_runs import run  # noqa: E402
from bench.agent_traffic_shapes import SHAPES  # noqa: E402
from bench.agent_traffic_workload import SUBAGENT_MODEL, Workload, prepare  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402

SERVERS = ("switchyard", "mlx_lm", "vllm_mlx")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf file or model directory, or a generated model of "
                    f"bench/_common.py ({', '.join(MODELS)}: random weights, for a smoke run) "
                    "(default: the embedded default model, switchyard.deploy.default_model)")
    ap.add_argument("--weights", choices=PEER_WEIGHTS, default="same",
                    help="a GGUF's weights for the peers: same (as Switchyard loads them) or "
                    "dequantized (then Switchyard serves the dequantized directory too)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--agents", type=int, default=20)
    ap.add_argument("--turns", type=int, default=6, help="tool calls per sub-agent")
    ap.add_argument("--shape", choices=SHAPES, default="claude-code",
                    help="the requests around each conversation's own turns: claude-code "
                    "(default): Claude Code 2.1.332's system prompt, tools and mid-conversation "
                    "system message as recorded in tests/corpus (the shared system prompt's size "
                    "is then the corpus's, about 12K tokens with its tools); synthetic: the "
                    "bench's first shape (20 tools, --system tokens), for older figures")
    ap.add_argument("--system", type=int, help="shared system prompt tokens, --shape synthetic "
                    "only (default 1200)")
    ap.add_argument("--grow-to", type=int,
                    help="a sub-agent's last prompt, tokens (about; within --ctx; default 20000 "
                    "for --shape claude-code, whose first prompt is about 12.4K tokens on "
                    "SmolLM2's tokenizer, 7000 for synthetic)")
    ap.add_argument("--reply", type=int, default=16, help="max_tokens of every request")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=0,
                    help="switchyard --max-running: requests run at once (0: its default, as "
                    "many as its memory plan holds, up to 4 x --slots)")
    ap.add_argument("--ctx", type=int, help="context per slot (default 24576 for --shape "
                    "claude-code, 8192 for synthetic)")
    ap.add_argument("--residency", type=int, default=4, metavar="K",
                    help="simulate LRU / agent-aware / Belady residency for K conversations "
                    "over Switchyard's admission order")
    ap.add_argument("--disk-budget", default="16GiB", help="Switchyard --kv-disk-budget")
    ap.add_argument("--ssd-gb", type=float, default=16, help="vllm-mlx --ssd-cache-max-gb")
    ap.add_argument("--background-subagents", action="store_true",
                    help="the sub-agents name a model Switchyard serves with --background-model "
                    "(as Claude Code's CLAUDE_CODE_SUBAGENT_MODEL would): their replies, which "
                    "no one reads as they stream, yield to waiting requests' prefill; the "
                    "peers get the same requests")
    ap.add_argument("--extra", default="", help="more switchyard serve flags, space-separated")
    ap.add_argument("--peer-extra", default="", help="more flags for both peers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-log", metavar="DIR", help="copy each server's log here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-request lines")
    ap.add_argument("--plot", metavar="PNG", help="draw every request's TTFT against when it "
                    "was sent, one series per server, into this PNG (needs matplotlib: pip "
                    "install -e '.[bench]')")
    args = ap.parse_args()
    synthetic = args.shape == "synthetic"
    args.grow_to = args.grow_to or (7000 if synthetic else 20000)
    args.ctx = args.ctx or (8192 if synthetic else 24576)
    if synthetic:
        args.system = 1200 if args.system is None else args.system
    elif args.system is not None:
        ap.error("--system: only with --shape synthetic (Claude Code's system prompt is the "
                 "corpus's)")
    if args.plot:
        check_plotting(ap)
    if note := preload_note():
        print(note, file=sys.stderr)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if bad := set(servers) - set(SERVERS):
        ap.error(f"--servers: unknown {', '.join(sorted(bad))}; known: {', '.join(SERVERS)}")
    if args.model in MODELS and not Path(args.model).exists():
        model = model_dir(args.model)
    elif args.model:
        model = Path(args.model).expanduser()
    else:
        from switchyard.deploy.default_model import default_model_path

        model = default_model_path()
    peers = set(servers) - {"switchyard"}
    # The peers' directory is built only for a run that has peers (or dequantized weights).
    peer_model = hf_export(model, args.weights) if model.suffix == ".gguf" and (
        peers or args.weights != "same") else model
    ours = model if args.weights == "same" else peer_model

    from switchyard.common.tokenizer_loading import load_tokenizer

    w = Workload(args, load_tokenizer(str(model)))
    reqs = prepare(w, args.ctx)
    sizes = [len(r.prompt_ids) for r in reqs.values()]
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    mid = w.shape.mid_system_text
    print(f"model {model} (peers: {peer_model}); shape {args.shape}; main session + "
          f"{args.agents} sub-agents x {args.turns} tool calls (+ a final turn), {len(reqs)} "
          f"requests; system prompt {w.count(w.system)} tokens + {len(w.openai_tools)} tools "
          f"({w.count(json.dumps(w.openai_tools))} tokens as JSON)"
          + (f" + a mid-conversation system message of {w.count(mid)} tokens" if mid else "")
          + f"; prompts {min(sizes)}-{max(sizes)} "
          f"tokens, {sum(r.new for r in reqs.values())} new tokens in all; replies <= "
          f"{args.reply} tokens; switchyard --slots {args.slots} --max-running "
          f"{args.max_running}", flush=True)

    rows, figs, notes, series = [], {}, [], {}
    for server in servers:
        print(f"\n== {server}", flush=True)
        if server == "switchyard":
            extra = ["--kv-disk-budget", args.disk_budget, "--max-running",
                     str(args.max_running), *args.extra.split()]
            if args.background_subagents:
                extra += ["--background-model", SUBAGENT_MODEL]
            with ServerGroup(ours, slots=args.slots, ctx=args.ctx, extra=extra,
                             startup_timeout_s=600) as group:
                try:
                    with TreeMemory(group.proc.pid) as mem:
                        done, wall = run(server, group.url, w, reqs, log)
                finally:
                    keep(args, server, group.log_text())
                label = f"switchyard --slots {args.slots}" + (
                    f" --max-running {args.max_running}" if args.max_running else "") + (
                    " --background-model" if args.background_subagents else "")
                row, figs[server] = summarize(label, done, wall, mem)
                notes += switchyard_detail(group, figs[server]["worst"])
                notes += residency(done, admission_times(group, done), args.turns, args.residency)
        else:
            peer = (mlx_lm_server(peer_model, args.peer_extra.split()) if server == "mlx_lm"
                    else vllm_mlx_server(peer_model, args.ssd_gb, args.peer_extra.split()))
            try:
                with peer:
                    try:
                        with TreeMemory(peer.pgid) as mem:
                            done, wall = run(server, peer.url, w, reqs, log, str(peer_model))
                    finally:
                        keep(args, server, peer.log_text())
                    if server == "vllm_mlx":
                        try:
                            stats = httpx.get(f"{peer.url}/v1/cache/stats", timeout=30).json()
                            notes.append("vllm-mlx /v1/cache/stats: " + json.dumps(
                                stats.get("engine_cache"))[:600])
                        except (httpx.HTTPError, ValueError) as e:
                            notes.append(f"vllm-mlx /v1/cache/stats: {e}")
                text = peer.log_text()
                if server == "vllm_mlx":
                    match_vllm(done, text)
                row, figs[server] = summarize(peer.name, done, wall, mem)
            finally:
                peer.cleanup()
        rows.append(row)
        series[row[0]] = ttft_points(done)

    print("\nTTFT over every request (s); re-read: prompt - cached - new, summed (each server's "
          "own cached count; new: growth over the conversation's previous prompt); prefilled: "
          "prompt - cached; prompt ok: prompt tokens equal to the chat template's rendering "
          "(vllm-mlx writes tool calls and results as text of its own for a template without "
          "tools); RSS / PSS: peak, MiB, summed over the server's process tree")
    print(table(["server", "requests", "wall s", "p50", "p95", "max", "slowest", "re-read",
                 "prefilled", "prompt ok", "RSS", "PSS"], rows))
    for line in notes:
        print(line)
    sy = figs.get("switchyard")
    for peer in ("mlx_lm", "vllm_mlx"):
        if sy and peer in figs:
            p = figs[peer]
            print(f"switchyard / {peer}: p95 {fmt(sy['p95'] / p['p95'], 2)}, max "
                  f"{fmt(sy['max'] / p['max'], 2)}, wall {fmt(sy['wall'] / p['wall'], 2)} "
                  "(targets: p95 < 1, max < 1, wall <= 1)")
    if sy:
        print(f"switchyard re-read tokens: {sy['reread']} (target 0 while the disk budget holds "
              "the working set)")
    if args.plot:
        from bench._plot import plot_ttft

        title = (f"{model.name}: main + {args.agents} sub-agents x {args.turns} tool calls, "
                 f"shape {args.shape}, grow to {args.grow_to}")
        print(f"plot: {plot_ttft(series, Path(args.plot), title)}")
    return 0


def keep(args, server: str, text: str) -> None:
    if args.keep_log:
        Path(args.keep_log).mkdir(parents=True, exist_ok=True)
        (Path(args.keep_log) / f"agent_traffic-{server}.log").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
