"""Speculative decoding on a real model: decode tok/s with drafts / without, same bytes.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/speculative.py --model PATH.gguf [--tokens 160] [--rounds 2] \\
        [--draft-model PATH [--speculative draft]] [--speculative mtp]
        [--peer mlx_lm [--weights f32] [--draft-model PATH]]

Three workloads on one server (`--slots 4`), greedy and streamed through /v1/chat/completions:

- **edit**: a ~600-token Python file in a tool result; the reply rewrites it with one rename;
- **tools**: a tool-call loop whose earlier calls repeat paths and JSON keys; the reply is the
  next call;
- **chat**: free-form prose, where copying rarely helps (speculation must not cost there).

Each request is sent twice, with and without speculation (the request field
`"speculative": false`: same server, same weights, same prompt bytes; the order alternates
per round), so machine noise hits both alike. Reported per workload: decode tok/s (tokens after
the first over the time from the first to the last streamed chunk) with and without, their
ratio (median of the per-pair ratios; also over the worker's CPU time in the same span, which
the shared machine's other load moves far less), the share of draft tokens accepted (from the
server's `request.finished` lines) and whether the outputs are equal. Then 4 concurrent streams of
each workload, all with or all without (the order alternating over `--x4-rounds`): aggregate
decode tok/s and the median ratio. Every round uses other files, paths and topics, so a
request cannot copy its own twin of an earlier round.

With `--draft-model` the server also has a draft model (`--speculative auto`: copied drafts
where they match, the draft model's elsewhere, each where it pays; `--speculative draft`: the
draft model's for every row, whatever it costs). The model as its own draft model gives the
exactness check (every draft token accepted, outputs equal) and the overhead bound: k draft
passes as dear as the model's own pass buy k + 1 tokens per verify pass. `--speculative mtp`
serves a model that ships an MTP head (Qwen3-Next, Qwen3.5 text checkpoints) with its drafts.

`--peer mlx_lm` runs the same workloads instead beside mlx_lm.server of this venv, single
stream, in one run (the order of the six requests of a round reversed every other round):
Switchyard as it ships (`auto`, the request field on/off), Switchyard with
`--draft-model --speculative draft` (field on/off), mlx_lm.server plain and mlx_lm.server with
`--draft-model`, both with `--num-draft-tokens` as ours (default 8). The draft model is the
model itself unless `--draft-model` names one; a GGUF reaches mlx_lm.server as a Hugging Face
directory (bench/_peers.py, `--weights same`; `f32` on a CPU, where MLX's quantized prefill of
the edit's prompt takes minutes). mlx_lm.server turns batching off when it has a draft model,
hence the single stream; it reports no acceptance.

Targets: edit >= 2.0x, tools >= 1.5x, chat >= 0.95x, 4 concurrent edits >= 1.5x.
The default model is `switchyard.deploy.default_model.default_model_path()`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from switchyard.testing.group import ServerGroup  # noqa: E402

NAMES = ["config", "session", "invoice", "report", "cache", "profile", "order", "ticket",
         "payment", "schedule", "inventory", "message"]
TOPICS = ["a lighthouse keeper who finds a message in a bottle",
          "a baker who opens a shop on the moon", "two rival chess clubs in a small town",
          "a robot learning to paint", "a storm that stops every clock in a city",
          "a librarian who can hear books", "a fox that runs a train station",
          "a girl who maps underground rivers", "an old ferry that refuses to sink",
          "a garden that grows only on Tuesdays", "a detective who is afraid of maps",
          "twin sisters who run rival bakeries", "a whale that sings in Morse code",
          "a clockmaker's last commission", "a village where it snows upward",
          "a mail carrier on Mars"]


# --- workloads ---------------------------------------------------------------------------------

def python_file(rng: random.Random, name: str) -> str:
    """A plausible ~600-token module about `name`."""
    cls = name.capitalize()
    lines = [f'"""Loading, validating and saving {name} records."""', "",
             "from __future__ import annotations", "", "import json", "import logging",
             "from dataclasses import dataclass, field", "from pathlib import Path", "",
             "log = logging.getLogger(__name__)", "", "", "@dataclass",
             f"class {cls}:", f'    """One {name} record as stored on disk."""', "",
             "    key: str", "    owner: str", "    created: float",
             "    tags: list[str] = field(default_factory=list)",
             "    payload: dict = field(default_factory=dict)", ""]
    for verb in rng.sample(["load", "save", "validate", "merge", "describe", "archive"], 4):
        lines += ["", f"def {verb}_{name}(path: Path, record: {cls} | None = None) -> {cls}:",
                  f'    """{verb.capitalize()} a {name} at `path`."""',
                  "    if not path.exists():",
                  f'        raise FileNotFoundError(f"no {name} at {{path}}")',
                  "    data = json.loads(path.read_text())",
                  f"    record = record or {cls}(key=data['key'], owner=data['owner'],",
                  f"{' ' * (19 + len(cls))}created=data['created'])",
                  f"    log.info(\"{verb} {name} %s for %s\", record.key, record.owner)",
                  "    for tag in data.get('tags', []):",
                  "        if tag not in record.tags:",
                  "            record.tags.append(tag)",
                  "    return record"]
    return "\n".join(lines) + "\n"


def edit_messages(rng: random.Random, name: str) -> list[dict]:
    source = python_file(rng, name)
    path = f"src/records/{name}_store.py"
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Show me {path}."},
        {"role": "assistant", "content": f"read_file({path!r})"},
        {"role": "tool", "content": f"```python\n{source}```"},
        {"role": "user", "content": f"Rewrite the whole file with `load_{name}` renamed to "
                                    f"`read_{name}`."},
    ]


def tool_messages(rng: random.Random, name: str) -> list[dict]:
    base = f"src/app/handlers/{name}"
    calls, messages = [], [
        {"role": "system", "content": "You are a coding agent. Answer with exactly one tool "
                                      "call as JSON: {\"tool\": ..., \"path\": ..., "
                                      "\"old_string\": ..., \"new_string\": ...}."}]
    for i, part in enumerate(rng.sample(["views", "models", "forms", "urls", "tests", "admin"], 4)):
        path = f"{base}/{part}.py"
        call = {"tool": "edit_file", "path": path, "old_string": f"from {name}.legacy import "
                f"{part}_helper", "new_string": f"from {name}.core import {part}_helper"}
        messages += [{"role": "user", "content": f"Update the import in {path}."},
                     {"role": "assistant", "content": json.dumps(call)},
                     {"role": "tool", "content": f"ok: {path} edited (1 replacement)"}]
        calls.append(call)
    messages.append({"role": "user", "content": f"Update the import in {base}/serializers.py "
                                                f"the same way."})
    return messages


def chat_messages(rng: random.Random, topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {topic}."}]


WORKLOADS = {"edit": (edit_messages, NAMES), "tools": (tool_messages, NAMES),
             "chat": (chat_messages, TOPICS)}


# --- requests ----------------------------------------------------------------------------------

MODEL_ID: list[str] = []  # the served model's name, asked once
WORKER_PID: list[int] = []  # the worker's pid: its CPU time is read around each decode


def worker_cpu_s(pid: int | None = None) -> float:
    """The worker's (or `pid`'s) CPU seconds so far (user + system, /proc; 0 where there is
    none)."""
    try:
        pid = pid if pid is not None else WORKER_PID[0]
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (IndexError, OSError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_chat(url: str, messages: list[dict], max_tokens: int, speculative: bool | None,
                model: str | None = None, pid: int | None = None) -> dict:
    """One greedy streamed chat completion; `speculative` None sends no such field (a peer),
    `model` the name to send (default: what the server lists first), `pid` the process whose
    CPU time is read (default: the worker's)."""
    if model is None:
        if not MODEL_ID:
            MODEL_ID.append(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])
        model = MODEL_ID[0]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["speculative"] = speculative
    stamps, text, usage, rid, cpu = [], [], None, None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
                    if len(stamps) == 1:
                        cpu.append(worker_cpu_s(pid))
    cpu.append(worker_cpu_s(pid))
    return {"rid": rid, "text": "".join(text), "stamps": stamps, "cpu_s": cpu[-1] - cpu[0],
            "tokens": usage["completion_tokens"] if usage else 0}


def decode_tps(r: dict) -> float:
    if len(r["stamps"]) < 2:
        return float("nan")
    return (r["tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0])


def decode_tpcs(r: dict) -> float:
    """Tokens after the first per second of the worker's CPU time over the same span: what
    the decode cost, whatever else ran on the machine meanwhile (a lone stream only)."""
    return (r["tokens"] - 1) / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")


def acceptance(group: ServerGroup, rids: list[str]) -> tuple[int, int]:
    proposed = accepted = 0
    wanted = set(rids)
    for rec in group.log_events("request.finished"):
        if rec.get("rid") in wanted and "num_proposed_tokens" in rec:
            proposed += rec["num_proposed_tokens"]
            accepted += rec["num_accepted_tokens"]
    return proposed, accepted


def concurrent(url: str, conversations: list[list[dict]], max_tokens: int,
               speculative: bool) -> list[dict]:
    results = [None] * len(conversations)

    def one(i: int) -> None:
        results[i] = stream_chat(url, conversations[i], max_tokens, speculative)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def aggregate_tps(results: list[dict]) -> float:
    first = min(r["stamps"][0] for r in results if r["stamps"])
    last = max(r["stamps"][-1] for r in results if r["stamps"])
    return sum(max(0, r["tokens"] - 1) for r in results) / (last - first)


# --- the run -----------------------------------------------------------------------------------

def run_workload(group: ServerGroup, kind: str, args, rng: random.Random) -> dict:
    make, subjects = WORKLOADS[kind]
    picks = rng.sample(subjects, args.rounds + 4 * args.x4_rounds)
    ratios, cpu_ratios, on_tps, off_tps, equal, rids = [], [], [], [], [], []
    for i in range(args.rounds):
        messages = make(random.Random(i), picks[i])
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {spec: stream_chat(group.url, messages, args.tokens, spec) for spec in order}
        off, on = got[False], got[True]
        off_tps.append(decode_tps(off))
        on_tps.append(decode_tps(on))
        ratios.append(on_tps[-1] / off_tps[-1])
        cpu_ratios.append(decode_tpcs(on) / decode_tpcs(off))
        equal.append(off["text"] == on["text"])
        rids.append(on["rid"])
        print(f"  {kind} round {i}: off {off_tps[-1]:.2f} tok/s, on {on_tps[-1]:.2f} tok/s, "
              f"x{ratios[-1]:.2f} (worker CPU time: x{cpu_ratios[-1]:.2f}), {on['tokens']} "
              f"tokens, equal {equal[-1]}", flush=True)
    proposed, accepted = acceptance(group, rids)
    agg = {False: [], True: []}
    x4_ratios, x4_equal = [], True
    for j in range(args.x4_rounds):  # 4 new conversations each time, the order alternating
        batch = [make(random.Random(100 + 4 * j + b), picks[args.rounds + 4 * j + b])
                 for b in range(4)]
        for messages in batch:  # prefilled first: the 4 streams then only decode
            stream_chat(group.url, messages, 1, False)
        got = {}
        for spec in ((False, True) if j % 2 == 0 else (True, False)):
            results = concurrent(group.url, batch, args.tokens, spec)
            got[spec] = (aggregate_tps(results), [r["text"] for r in results])
            agg[spec].append(got[spec][0])
        x4_ratios.append(got[True][0] / got[False][0])
        x4_equal &= got[False][1] == got[True][1]
        print(f"  {kind} x4 round {j}: off {got[False][0]:.2f} tok/s, on {got[True][0]:.2f} "
              f"tok/s, x{x4_ratios[-1]:.2f}", flush=True)
    nan = float("nan")
    return {"kind": kind, "off": statistics.median(off_tps), "on": statistics.median(on_tps),
            "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios),
            "proposed": proposed, "accepted": accepted,
            "equal": all(equal), "x4_off": statistics.median(agg[False]) if x4_ratios else nan,
            "x4_on": statistics.median(agg[True]) if x4_ratios else nan,
            "x4_ratio": statistics.median(x4_ratios) if x4_ratios else nan,
            "x4_equal": x4_equal if x4_ratios else "-"}


TARGETS = {"edit": (2.0, 1.5), "tools": (1.5, None), "chat": (0.95, None)}


# --- beside mlx_lm.server --draft-model ----------------------------------------------------------

# (arm, server, speculative field): each pair is one ratio, "on" over "off".
PEER_ARMS = [("sy off", "auto", False), ("sy auto", "auto", True),
             ("sy draft off", "draft", False), ("sy draft", "draft", True),
             ("mlx plain", "mlx plain", None), ("mlx draft", "mlx draft", None)]
PEER_PAIRS = [("auto", "sy off", "sy auto"), ("draft", "sy draft off", "sy draft"),
              ("mlx_lm draft", "mlx plain", "mlx draft")]


def run_peer(args, model: Path, rng: random.Random) -> None:
    """Every workload, single stream, sent in one run to four servers on the same bytes:
    Switchyard as it ships (`auto`: copied drafts, request field on/off), Switchyard with
    `--draft-model --speculative draft` (field on/off), and mlx_lm.server of this venv plain and
    with `--draft-model` (both `--num-draft-tokens` as ours). The six requests of a round go in
    turn, the order reversed every other round."""
    from contextlib import ExitStack

    from bench._peers import hf_export, mlx_lm_server

    draft = Path(args.draft_model) if args.draft_model else model
    k = str(args.num_draft_tokens or 8)  # Switchyard's default bound
    peer_model = hf_export(model, args.weights) if model.suffix == ".gguf" else model
    peer_draft = hf_export(draft, args.weights) if draft.suffix == ".gguf" else draft
    common = ["--prefill-chunk", "1024", "--num-draft-tokens", k]
    servers: dict[str, tuple[str, str | None, int]] = {}  # name -> (url, model, pid)
    groups: dict[str, ServerGroup] = {}
    with ExitStack() as stack:
        for name, extra in (("auto", common),
                            ("draft", common + ["--draft-model", str(draft),
                                                "--speculative", "draft"])):
            group = stack.enter_context(ServerGroup(model, slots=4, ctx=4096, extra=extra))
            groups[name] = group
            info = httpx.get(f"{group.url}/v1/models", timeout=30).json()
            servers[name] = (group.url, info["data"][0]["id"], group.pid_of("worker"))
        for name, extra in (("mlx plain", ["--num-draft-tokens", k]),
                            ("mlx draft", ["--draft-model", str(peer_draft),
                                           "--num-draft-tokens", k])):
            peer = mlx_lm_server(peer_model, extra)
            stack.enter_context(peer)
            stack.callback(peer.cleanup)
            servers[name] = (peer.url, "default_model", peer.proc.pid)
        for name, (url, served, pid) in servers.items():  # loads and compiles before timing
            stream_chat(url, chat_messages(rng, "warming up"), 4,
                        None if name.startswith("mlx") else False, served, pid)
        rows = []
        for kind in args.workloads:
            rows.append(peer_workload(kind, args, rng, servers, groups))
    print(f"\nmodel {model} (mlx_lm.server: {peer_model}, --weights {args.weights}), "
          f"draft model {draft}, "
          f"--num-draft-tokens {k}, {args.tokens} tokens per reply, {args.rounds} rounds, "
          f"greedy, single stream (mlx_lm.server turns batching off with a draft model)")
    print(f"{'workload':>8} | {'server':>12} | {'off tok/s':>9} | {'on tok/s':>8} | "
          f"{'x':>5} | {'x cpu':>5} | {'accepted':>9} | equal")
    for r in rows:
        for label, off, on in PEER_PAIRS:
            p = r[label]
            print(f"{r['kind']:>8} | {label:>12} | {p['off']:9.2f} | {p['on']:8.2f} | "
                  f"{p['ratio']:5.2f} | {p['cpu_ratio']:5.2f} | {p['rate']:>9} | {p['equal']}")
        print(f"{r['kind']:>8} | mlx_lm plain output equals Switchyard's off: {r['same']}")


def peer_workload(kind: str, args, rng: random.Random, servers: dict,
                  groups: dict[str, ServerGroup]) -> dict:
    make, subjects = WORKLOADS[kind]
    picks = rng.sample(subjects, args.rounds)
    runs: dict[str, list[dict]] = {arm: [] for arm, _, _ in PEER_ARMS}
    for i in range(args.rounds):
        messages = make(random.Random(i), picks[i])
        for arm, server, spec in (PEER_ARMS if i % 2 == 0 else PEER_ARMS[::-1]):
            url, served, pid = servers[server]
            runs[arm].append(stream_chat(url, messages, args.tokens, spec, served, pid))
            print(f"  {kind} round {i} {arm}: {decode_tps(runs[arm][-1]):.2f} tok/s, "
                  f"{runs[arm][-1]['tokens']} tokens", flush=True)
    row = {"kind": kind, "same": all(a["text"] == b["text"]
                                     for a, b in zip(runs["mlx plain"], runs["sy off"]))}
    for label, off, on in PEER_PAIRS:
        offs, ons = runs[off], runs[on]
        rate = "-"
        if label in groups:
            proposed, accepted = acceptance(groups[label], [r["rid"] for r in ons])
            rate = f"{accepted}/{proposed}"
        row[label] = {
            "off": statistics.median(decode_tps(r) for r in offs),
            "on": statistics.median(decode_tps(r) for r in ons),
            "ratio": statistics.median(decode_tps(b) / decode_tps(a) for a, b in zip(offs, ons)),
            "cpu_ratio": statistics.median(decode_tpcs(b) / decode_tpcs(a)
                                           for a, b in zip(offs, ons)),
            "rate": rate, "equal": all(a["text"] == b["text"] for a, b in zip(offs, ons))}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path (default: the default model)")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens of every reply")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--x4-rounds", type=int, default=2,
                    help="rounds of 4 concurrent streams (0: none)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--draft-model", help="serve with this draft model (--draft-model)")
    ap.add_argument("--speculative", choices=["auto", "suffix", "draft", "mtp"], default=None,
                    help="the server's --speculative (default: its own, auto)")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--keep-log", help="copy the server's JSON log here")
    ap.add_argument("--step-log", action="store_true",
                    help="the server logs every step (step.finished: pass and cycle times)")
    ap.add_argument("--peer", choices=["mlx_lm"],
                    help="instead: the same workloads, single stream, beside mlx_lm.server "
                         "plain and with --draft-model (the model itself unless "
                         "--draft-model names one)")
    ap.add_argument("--weights", choices=["same", "f16", "f32"], default="same",
                    help="with --peer: the GGUF's weights for mlx_lm.server (bench/_peers.py): "
                         "same (as Switchyard loads them) or dequantized")
    args = ap.parse_args()
    model = args.model
    if not model:
        from switchyard.deploy.default_model import default_model_path

        model = str(default_model_path())
    rng = random.Random(args.seed)
    if args.peer:
        run_peer(args, Path(model), rng)
        return
    extra = ["--prefill-chunk", "1024"] + (["--log-level", "debug"] if args.step_log else [])
    if args.num_draft_tokens:
        extra += ["--num-draft-tokens", str(args.num_draft_tokens)]
    if args.draft_model:
        extra += ["--draft-model", args.draft_model]
    if args.speculative:
        extra += ["--speculative", args.speculative]
    rows = []
    with ServerGroup(model, slots=4, ctx=4096, extra=extra) as group:
        try:
            WORKER_PID.append(group.pid_of("worker"))
            stream_chat(group.url, chat_messages(rng, "warming up"), 4, False)
            for kind in args.workloads:
                rows.append(run_workload(group, kind, args, rng))
        finally:  # also when a request failed: the log says why
            if args.keep_log:
                Path(args.keep_log).write_text(group.log_text())
    print(f"\nmodel {model}, {args.tokens} tokens per reply, {args.rounds} rounds, greedy"
          + (f", draft model {args.draft_model}" if args.draft_model else "")
          + (f", --speculative {args.speculative}" if args.speculative else ""))
    print(f"{'workload':>8} | {'off tok/s':>9} | {'on tok/s':>8} | {'x':>5} | {'x cpu':>5} | "
          f"{'target':>6} | {'accepted':>13} | {'equal':>5} | {'x4 off':>6} | {'x4 on':>6} | "
          f"{'x4 x':>5} | x4 equal")
    for r in rows:
        target, x4_target = TARGETS[r["kind"]]
        rate = f"{r['accepted']}/{r['proposed']}" if r["proposed"] else "0/0"
        x4 = f"{r['x4_ratio']:.2f}" + (f" (>= {x4_target})" if x4_target else "")
        print(f"{r['kind']:>8} | {r['off']:9.2f} | {r['on']:8.2f} | {r['ratio']:5.2f} | "
              f"{r['cpu_ratio']:5.2f} | >= {target:<3} | {rate:>13} | {str(r['equal']):>5} | "
              f"{r['x4_off']:6.2f} | "
              f"{r['x4_on']:6.2f} | {x4} | {r['x4_equal']}")


if __name__ == "__main__":
    main()
