"""Real agent clients, installed as users install them (npm, the versions of the day), drive
one server end to end: Claude Code (Anthropic Messages), Codex CLI (Responses), Qwen Code and
opencode (Chat Completions), each with its own default system prompt and tools, two turns of one
session, headless, in a scratch HOME (testing/agent_clients.py builds their configuration,
the same the README shows).

One server group for the module, on the terse twin (`--model tiny-terse`: sampled replies end
after a few dozen tokens, so a turn ends as it would with a real model, not at the client's
output limit). Pass: every turn completes without an API error (the client says so, and the
server answered every model request 200), and the second turn is served from cache for all of
the first turn's prompt within one page: its cached tokens >= the first turn's prompt tokens -
page size, read from the gateway's `request.finished` lines (each turn's main request: the
largest prompt of the turn; clients also send small side requests).

Then whole sessions, their words decided by `--script` (testing/agent_sessions.py): tool
loops, parallel sub-agents, a session that outgrows the context and compacts, each client with
the flags that let it act headless; and a stream the client stops (the SDK).

The clients are installed into ~/.cache/switchyard/agent-clients (refreshed daily). Without
npm or a registry the tests skip with the reason, unless SWITCHYARD_REQUIRE_CLIENTS=1 (`.ci/run`
sets it): then they fail. The clients' first prompts are 13K-26K tokens; the terse twin (one
layer of two narrow heads, twins/models.py TERSE_SIZES) prefills one in about a second on 2
CPU cores, and every later turn re-reads only its own new tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from switchyard.testing.agent_clients import CLIENTS, ClientsUnavailable, install
from switchyard.testing.agent_sessions import (
    SESSIONS,
    numbers_name,
    prepare_work,
    rule_numbers,
    session_problems,
    session_script,
)
from switchyard.testing.group import ServerGroup

MODEL = "local"  # --served-model-name, as in the README
PAGE_SIZE = 256
CTX = 65536  # Claude Code asks for 32000 output tokens on top of its ~28K-token prompt
PROMPTS = ("Say hello in one short sentence.", "Now say goodbye in one short sentence.")
MODEL_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
TURN_TIMEOUT_S = 1500
# Cheap clients first: a failure of the wiring shows before the long prefills.
ORDER = ("codex", "opencode", "qwen-code", "claude-code")

FIGURES: dict[str, list[dict]] = {}
SESSION_FIGURES: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def versions() -> dict[str, str]:
    try:
        return install()
    except ClientsUnavailable as exc:
        if os.environ.get("SWITCHYARD_REQUIRE_CLIENTS") == "1":
            pytest.fail(f"agent clients required (SWITCHYARD_REQUIRE_CLIENTS=1): {exc}")
        pytest.skip(f"agent clients not installed: {exc}")


@pytest.fixture(scope="module")
def terse_model(tmp_path_factory):
    from fixtures.tiny_models import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny-terse", "qwen3",
                               terse=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The sessions' files (testing/agent_sessions.py), one directory for the module: the
    script's rules name their paths."""
    work = tmp_path_factory.mktemp("work")
    prepare_work(work)
    return work


@pytest.fixture(scope="module")
def server(versions, terse_model, work):
    script = work.parent / "script.json"
    script.write_text(json.dumps(session_script(work)))
    with ServerGroup(terse_model, slots=2, ctx=CTX, startup_timeout_s=300,
                     extra=("--served-model-name", MODEL, "--page-size", str(PAGE_SIZE),
                            "--script", str(script))) as group:
        yield group
    for name, requests in SESSION_FIGURES.items():
        print(f"\n{name}: " + "; ".join(
            f"{numbers_name(rule_numbers(work), r)}: " + (
                f"{r['num_prompt_tokens']} prompt, {r['num_cached_tokens']} cached, ttft "
                f"{r.get('ttft_s')}s" if r.get("status") == 200 else f"{r.get('status')} "
                f"{r.get('error_code')}") for r in requests[1:])
            + f"; wall {requests[0]['wall_s']:.1f}s")
    for name, turns in FIGURES.items():
        print(f"\n{name} {versions[name]}: " + "; ".join(
            f"turn {n}: {t['num_prompt_tokens']} prompt, {t['num_cached_tokens']} cached, "
            f"{t['num_generated_tokens']} generated, ttft {t.get('ttft_s')}s, {t['wall_s']:.0f}s"
            for n, t in enumerate(turns, 1)))


def model_lines(group: ServerGroup) -> list[dict]:
    return [e for e in group.log_events("request.finished")
            if e.get("role") == "gateway"
            and str(e.get("endpoint", "")).split("?")[0].endswith(MODEL_PATHS)]


def model_requests_counted(group: ServerGroup) -> int:
    """The model requests the gateway finished, by its /metrics counter (incremented just
    after the request's log line is written: the counting middleware wraps the logging one)."""
    total = 0
    for line in httpx.get(f"{group.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("switchyard_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            endpoint = labels.split('endpoint="', 1)[1].split('"', 1)[0]
            total += int(float(value)) if endpoint.endswith(MODEL_PATHS) else 0
    return total


def lines_after(group: ServerGroup, mark: int) -> list[dict]:
    """The model requests logged since `mark`, once there is one and the log holds every
    request the gateway counts as finished (a request is logged just after its reply, and the
    line reaches the file through the supervisor)."""
    deadline = time.monotonic() + 30
    while True:
        counted = model_requests_counted(group)
        lines = model_lines(group)
        if len(lines) > mark and len(lines) >= counted:
            return lines[mark:]
        assert time.monotonic() < deadline, (mark, counted, lines[mark:])
        time.sleep(0.1)


def client_succeeded(name: str, stdout: str) -> str | None:
    """None if the client's own output says the turn completed; else what it said."""
    if name in ("claude-code", "qwen-code"):
        try:
            events = json.loads(stdout)
        except ValueError:
            return f"no JSON result: {stdout[-2000:]}"
        result = events[-1] if isinstance(events, list) else events
        if result.get("type") != "result" or result.get("is_error"):
            return json.dumps(result)[:2000]
        return None
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    if name == "codex":
        if "turn.completed" not in kinds or "turn.failed" in kinds:
            return stdout[-2000:]
        return None
    if name == "opencode":
        if "error" in kinds or "step_finish" not in kinds:
            return stdout[-2000:]
        return None
    raise ValueError(name)


@pytest.mark.parametrize("name", ORDER)
def test_two_turns_and_the_second_reads_the_first_from_cache(name, server, tmp_path):
    client = CLIENTS[name]
    env = client.prepare(tmp_path / "home", server.url, MODEL)
    work = tmp_path / "work"
    work.mkdir()
    turns = []
    for n, prompt in enumerate(PROMPTS, 1):
        mark = len(model_lines(server))
        start = time.monotonic()
        done = subprocess.run(client.turn(n, prompt), cwd=work, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TURN_TIMEOUT_S)
        wall_s = time.monotonic() - start
        said = f"{name} turn {n} (exit {done.returncode}):\n{done.stdout[-3000:]}\n" \
               f"{done.stderr[-3000:]}\n{server.log_tail(20)}"
        assert done.returncode == 0, said
        problem = client_succeeded(name, done.stdout)
        assert problem is None, f"{name} turn {n}: {problem}\n{said}"
        lines = lines_after(server, mark)
        assert lines, f"{name} turn {n} sent no model request\n{said}"
        assert all(line.get("status") == 200 for line in lines), (lines, said)
        # A client that gave up on a request and sent it again (Claude Code drops a stream
        # that has shown no content for 5 minutes and asks again without streaming): the
        # request it was answered by counts.
        answered = [line for line in lines if not line.get("disconnected")]
        assert answered, (lines, said)
        turns.append(max(answered, key=lambda line: line["num_prompt_tokens"])
                     | {"wall_s": wall_s, "num_requests": len(lines),
                        "client_usage": client_usage(name, done.stdout)})
    FIGURES[name] = turns
    first, second = turns
    assert second["num_prompt_tokens"] > first["num_prompt_tokens"]
    assert second["num_cached_tokens"] >= first["num_prompt_tokens"] - PAGE_SIZE, turns
    if (second["client_usage"] or {}).get("cached") is not None:  # what the client was told
        assert second["client_usage"]["cached"] >= first["num_prompt_tokens"] - PAGE_SIZE, turns


def client_usage(name: str, stdout: str) -> dict | None:
    """The turn's usage as Claude Code reports it in its JSON result (Anthropic's usage of the
    turn's last request: uncached input and cache reads); None for the other clients, whose
    figures are per session or per step."""
    if name != "claude-code":
        return None
    usage = json.loads(stdout).get("usage") or {}
    return {"input": usage.get("input_tokens"), "cached": usage.get("cache_read_input_tokens")}


@pytest.mark.parametrize("session", SESSIONS, ids=lambda s: s.name)
def test_a_real_session_loops_over_tools_and_sub_agents_and_reads_only_new_tokens(
        session, server, work, tmp_path):
    """A whole session of a client, its words scripted (testing/agent_sessions.py): the
    client runs its tools and sub-agents for real, its last turn prints the scripted answer,
    and the log shows every request after a conversation's first prefilling at most one page
    beyond its new tokens, and sub-agents started together reading their shared prefix once."""
    client = CLIENTS[session.client]
    env = client.prepare(tmp_path / "home", server.url, MODEL) | {"IS_SANDBOX": "1"}
    mark = len(model_lines(server))
    start = time.monotonic()
    for n, prompt in enumerate(session.prompts, 1):
        done = subprocess.run([*client.turn(n, prompt), *session.flags], cwd=work, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TURN_TIMEOUT_S)
        said = f"{session.name} turn {n} (exit {done.returncode}):\n{done.stdout[-3000:]}\n" \
               f"{done.stderr[-3000:]}\n{server.log_tail(20)}"
        assert done.returncode == 0, said
        assert client_succeeded(session.client, done.stdout) is None, said
    wall_s = time.monotonic() - start
    assert session.says in done.stdout, said
    requests = lines_after(server, mark)
    assert all(r.get("status") == 200 or session.compacts
               and r.get("error_code") == "context_length_exceeded" for r in requests), requests
    SESSION_FIGURES[session.name] = [{"wall_s": wall_s}, *requests]
    numbers = rule_numbers(work)
    problems = session_problems(requests, session, numbers, PAGE_SIZE)
    assert problems == [], (problems, [(numbers_name(numbers, r), r) for r in requests])
    if session.name == "claude-code-edit":
        assert (work / "notes.txt").read_text().startswith("status: final\n")


def test_a_stream_the_client_stops_keeps_what_was_read_and_written(server):
    """Esc in an agent, or a dropped connection (the SDK here: a client stopped mid-stream
    cannot be driven headless): the prompt and the tokens generated before the stop stay
    cached, so the next turn, which sends the partial reply back, and a retry of the same
    turn each prefill at most a page."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    system = "You tell stories. " + " ".join(f"Rule {i}: be kind." for i in range(400))
    story = [{"role": "user", "content": "Tell me a long story"}]
    mark = len(model_lines(server))
    partial = ""
    with client.messages.stream(model=MODEL, max_tokens=2000, system=system,
                                messages=story) as stream:
        for text in stream.text_stream:
            partial += text
            if len(partial) > 60:
                break  # the client closes the connection here
    stopped = lines_after(server, mark)
    assert [line.get("disconnected") for line in stopped] == [True], stopped
    prompt = stopped[0]["num_prompt_tokens"]
    go_on = client.messages.create(model=MODEL, max_tokens=50, system=system, messages=[
        *story, {"role": "assistant", "content": partial}, {"role": "user", "content": "go on"}])
    assert go_on.usage.cache_read_input_tokens >= prompt - 1 + len(partial) // 8
    assert go_on.usage.input_tokens <= PAGE_SIZE
    again = client.messages.create(model=MODEL, max_tokens=2000, system=system, messages=story)
    assert again.usage.cache_read_input_tokens == prompt - 1  # all but the one to prefill
