"""A real agent session, drawn: Claude Code with three sub-agents in parallel against Switchyard.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/agent_session.py [--png docs/agent-session.png] [--slots 4]

Starts a group on the terse twin (`--model tiny-terse`) with `--script` from
testing/agent_sessions.py, so the model's words follow the session's rules while the
server does all the real work (prefill, decode, KV pages, tool-call parsing, streaming), and
runs the real Claude Code (installed by testing/agent_clients.py, as in CI) headless on
the "claude-code-subagents" session: the main agent starts three sub-agents in one message,
each runs Bash (`wc -l`) and answers, and the main agent sums their answers.

Then reads the status's recent requests (what the dashboard draws, a lane per conversation)
and the gateway's `request.finished` lines (which rule of the script each request followed),
prints every request's TTFT and tokens by source and the session's wall time, and draws the
timeline as a PNG (bench/_plot.py `plot_timeline`). Figures of one run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._plot import PARTS, Bar  # noqa: E402
from switchyard.proto.status import RecentRequest, read_status  # noqa: E402
from switchyard.testing.agent_clients import CLIENTS, install  # noqa: E402
from switchyard.testing.agent_sessions import (  # noqa: E402
    SESSIONS,
    prepare_work,
    rule_numbers,
    session_script,
)
from switchyard.testing.group import ServerGroup  # noqa: E402

SESSION = "claude-code-subagents"
MODEL = "local"  # --served-model-name, as in the README
PAGE_SIZE = 256
CTX = 65536  # Claude Code asks for 32000 output tokens on top of its prompt
TURN_TIMEOUT_S = 1500


def lane_name(label: str, rule: str | None) -> str:
    """A lane's name: the status's label of the conversation and, from the rule its first
    request followed, who it is (a request no rule decided is a side request of the client)."""
    if rule is None:
        who = "side request"
    elif rule.startswith("cc.main."):
        who = "main agent"
    elif rule.startswith("cc.sub."):
        who = "sub-agent " + rule.removeprefix("cc.sub.").rsplit(".", 1)[0]  # of a.txt
    else:
        who = rule
    return f"{who} {label}"


def bars_of(recent: list[RecentRequest], rules: dict[str, str]) -> list[Bar]:
    """The session's requests as timeline bars, in seconds after its first request; `rules`:
    the script rule each request followed, by rid (none for side requests)."""
    if not recent:
        return []
    t0 = min(r.started_at for r in recent)
    first_rule: dict[str, str | None] = {}
    for r in sorted(recent, key=lambda r: r.started_at):
        first_rule.setdefault(r.conversation, rules.get(r.rid))
    return [Bar(lane=lane_name(r.conversation, first_rule[r.conversation]),
                start_s=r.started_at - t0, first_token_s=r.started_at - t0 + r.ttft_s,
                end_s=r.at - t0,
                tokens={"reused": r.reused_tokens, "copied": r.copied_tokens,
                        "restored": r.restored_tokens, "prefilled": r.prefilled_tokens,
                        "decoded": r.generated_tokens})
            for r in sorted(recent, key=lambda r: r.started_at)]


def figures(bars: list[Bar], rules: list[str | None]) -> list[str]:
    lines = [f"{'conversation':<34} {'rule':<20} {'start':>7} {'TTFT':>8} {'prompt':>7} "
             + " ".join(f"{k:>9}" for k in PARTS)]
    for bar, rule in zip(bars, rules):
        prompt = sum(bar.tokens[k] for k in PARTS[:-1])
        lines.append(f"{bar.lane:<34} {rule or '-':<20} {bar.start_s:>6.2f}s "
                     f"{1000 * (bar.first_token_s - bar.start_s):>6.0f}ms {prompt:>7} "
                     + " ".join(f"{bar.tokens[k]:>9}" for k in PARTS))
    return lines


def model_lines(group: ServerGroup) -> list[dict]:
    return [e for e in group.log_events("request.finished")
            if e.get("role") == "gateway" and "/v1/" in str(e.get("endpoint", ""))
            and e.get("rid")]


def wait_recent(group: ServerGroup, rids: set[str], timeout_s: float = 30.0
                ) -> list[RecentRequest]:
    """The status's recent requests of `rids`, once the scheduler has written them all."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = read_status(group.runtime_dir / "status.json")
        recent = [r for r in (status.stats.recent_requests if status else []) if r.rid in rids]
        if len(recent) >= len(rids) or time.monotonic() > deadline:
            return recent
        time.sleep(0.3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "agent-session.png")
    parser.add_argument("--slots", type=int, default=4,
                        help="slots of the group (4: every conversation of the session keeps one)")
    args = parser.parse_args()
    versions = install()
    session = next(s for s in SESSIONS if s.name == SESSION)
    client = CLIENTS[session.client]
    with tempfile.TemporaryDirectory(prefix="sy-session-") as scratch:
        work = Path(scratch) / "work"
        prepare_work(work)
        script = Path(scratch) / "script.json"
        script.write_text(json.dumps(session_script(work)))
        numbers = {n: name for name, n in rule_numbers(work).items()}
        with ServerGroup("tiny-terse", slots=args.slots, ctx=CTX, startup_timeout_s=300,
                         extra=("--served-model-name", MODEL, "--page-size", str(PAGE_SIZE),
                                "--script", str(script))) as group:
            env = client.prepare(Path(scratch) / "home", group.url, MODEL) | {"IS_SANDBOX": "1"}
            start = time.monotonic()
            for n, prompt in enumerate(session.prompts, 1):
                done = subprocess.run([*client.turn(n, prompt), *session.flags], cwd=work,
                                      env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                      text=True, timeout=TURN_TIMEOUT_S)
                if done.returncode != 0 or session.says not in done.stdout and \
                        n == len(session.prompts):
                    print(done.stdout[-3000:], done.stderr[-3000:], group.log_tail(30))
                    return 1
            wall_s = time.monotonic() - start
            time.sleep(1.5)  # the last request's line and status land
            lines = model_lines(group)
            rules = {e["rid"]: numbers.get(e.get("script_rule")) for e in lines}
            recent = wait_recent(group, set(rules))
    bars = bars_of(recent, {rid: rule for rid, rule in rules.items() if rule})
    ordered = sorted(recent, key=lambda r: r.started_at)
    print(f"Claude Code {versions.get(session.client, '?')}, session {SESSION}, "
          f"{len(ordered)} requests in {len({r.conversation for r in ordered})} conversations, "
          f"--slots {args.slots}")
    print("\n".join(figures(bars, [rules.get(r.rid) for r in ordered])))
    span = max(b.end_s for b in bars)
    print(f"session wall time {wall_s:.1f} s (the client's), {span:.1f} s from its first "
          f"request's arrival to its last request's end")
    from bench._plot import plot_timeline

    path = plot_timeline(bars, args.png, title=f"Claude Code {versions.get(session.client, '')}"
                         f" with three sub-agents on the terse twin (scripted words), "
                         f"{span:.1f} s")
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
