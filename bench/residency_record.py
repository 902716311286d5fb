"""Traces for the residency bench, recorded from a real server's log (bench/residency_trace.py
says the format).

The server says all a trace needs in its JSON log at `--log-level debug`: the scheduler's
`request.pages` line when a request is first placed (its arrival and its full pages' ids,
hashed again: no token, no text), its `request.finished` line (the reply's length, the time it
took, the conversation's label) and the gateway's `request.finished` line (`reply_end`: how
the reply ended, as the scheduler was told). A request shares with the earlier request whose
pages it starts with the longest run of (whole pages: the tail of a page is counted as new),
or, when the scheduler's label says it continues that request's conversation through its last
full page, that request's whole prompt. Conversations are renamed c1, c2, ... in the order
they began.

    # any server log (deploy/dev.sh serve --log-level debug --log-format json 2> LOG):
    PYTHONPATH=. .venv/bin/python bench/residency.py record --log LOG --name NAME
    # the scripted agent-client sessions (testing/agent_sessions.py), on one server:
    PYTHONPATH=. .venv/bin/python bench/residency.py record --shape sessions
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

from bench.residency_trace import Trace, TraceRequest, save

def _when(line: dict) -> float:
    """A request's arrival: the line's `arrived_at`, else the time it was logged."""
    if "arrived_at" in line:
        return float(line["arrived_at"])
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def read_log(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def trace_from_log(lines: list[dict], name: str, page_size: int, source: str = "",
                   command: str = "") -> Trace:
    """The requests the scheduler ran (those it finished), in arrival order."""
    pages, finished, ends = {}, {}, {}
    for e in lines:
        event, role = e.get("event"), e.get("role")
        if role == "scheduler" and event == "request.pages":
            pages[e["rid"]] = e
        elif role == "scheduler" and event == "request.finished":
            finished[e["rid"]] = e
        elif role == "gateway" and event == "request.finished" and e.get("rid"):
            ends[e["rid"]] = e.get("reply_end") or e.get("finish_reason")
    rids = sorted((rid for rid in pages if rid in finished), key=lambda r: _when(pages[r]))
    if not rids:
        raise ValueError("no request with both a request.pages and a request.finished line "
                         "(was the server at --log-level debug?)")
    t0 = _when(pages[rids[0]])
    labels: dict[str, str] = {}
    # A page id names its whole prefix (docs/design/kv-pages.md "KV pages"): page id -> the
    # latest request whose prompt holds it.
    owners: dict[str, int] = {}
    requests = []
    for i, rid in enumerate(rids):
        ids = pages[rid]["pages"]
        k = 0
        while k < len(ids) and ids[k] in owners:
            k += 1
        shared = (owners[ids[k - 1]], k * page_size) if k else None
        owners.update((pid, i) for pid in ids)
        rec = finished[rid]
        label = rec.get("conversation") or rid
        conv = labels.setdefault(label, f"c{len(labels) + 1}")
        if shared and requests[shared[0]].conv == conv and \
                k == len(pages[rids[shared[0]]]["pages"]):
            # The scheduler's label says it continues that turn: its whole prompt context
            # (scheduler/conversation_threads.py), the partial last page too.
            shared = (shared[0], requests[shared[0]].prompt)
        end = ends.get(rid) or rec.get("finish_reason", "stop")
        requests.append(TraceRequest(i, _when(pages[rid]) - t0, pages[rid]["num_prompt_tokens"],
                                     shared, rec.get("num_generated_tokens", 0), end, conv,
                                     rec.get("duration_s")))
    return Trace(name, page_size, tuple(requests), source, command)


def record_sessions(out_dir: Path, names: list[str] | None = None) -> list[Path]:
    """Run the scripted agent-client sessions of tests/e2e/test_agent_clients.py (real Claude
    Code, Codex, opencode, Qwen Code against `serve --script` on the terse twin) one after
    another against one server group at --log-level debug, as the e2e module does, and write
    a trace of each session and one of them all (`agent-sessions`: sessions of one client
    share its system prompt, as a day's sessions do)."""
    import tempfile

    from fixtures.tiny_models import generate_tiny_model
    from switchyard.testing.agent_clients import CLIENTS, install
    from switchyard.testing.agent_sessions import SESSIONS, prepare_work, session_script
    from switchyard.testing.group import ServerGroup

    page_size, ctx, model_name = 256, 65536, "local"
    versions = install()
    sessions = [s for s in SESSIONS if not names or s.name in names]
    spans = []  # (session, the rids its requests had)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = generate_tiny_model(tmp / "tiny-terse", "qwen3", terse=True)
        work = tmp / "work"
        prepare_work(work)
        script = tmp / "script.json"
        script.write_text(json.dumps(session_script(work)))
        with ServerGroup(model, slots=2, ctx=ctx, startup_timeout_s=300, extra=(
                "--served-model-name", model_name, "--page-size", str(page_size),
                "--script", str(script), "--log-level", "debug")) as group:
            for session in sessions:
                client = CLIENTS[session.client]
                env = client.prepare(tmp / f"home-{session.name}", group.url, model_name) \
                    | {"IS_SANDBOX": "1"}
                before = {e["rid"] for e in group.log_events("request.pages")}
                for n, prompt in enumerate(session.prompts, 1):
                    done = subprocess.run([*client.turn(n, prompt), *session.flags], cwd=work,
                                          env=env, stdin=subprocess.DEVNULL,
                                          capture_output=True, text=True, timeout=1500)
                    if done.returncode != 0:
                        raise RuntimeError(f"{session.name} turn {n}: exit {done.returncode}: "
                                           f"{done.stderr[-2000:]}")
                time.sleep(2)  # the last request's lines reach the log through the supervisor
                spans.append((session, {e["rid"] for e in group.log_events("request.pages")}
                               - before))
            lines = group.log_events()
    used = ", ".join(f"{c} {v}" for c, v in sorted(versions.items())
                     if any(s.client == c for s in sessions))
    written = []
    for session, rids in [*spans, (None, None)]:
        mine = lines if rids is None else [e for e in lines if e.get("rid") in rids]
        name = session.name if session else "agent-sessions"
        what = f"scripted session {name}" if session else \
            "the scripted sessions one after another on one server"
        who = f"{session.client} {versions.get(session.client, '')}" if session else used
        trace = trace_from_log(
            mine, name, page_size,
            source=f"{who}; {what} (testing/agent_sessions.py) against serve --script "
                   f"on the terse twin, --slots 2; measured times",
            command="bench/residency.py record --shape sessions")
        path = Path(out_dir) / f"{name}.jsonl"
        save(trace, path)
        written.append(path)
    return written
