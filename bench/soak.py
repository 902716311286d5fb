"""Soak under faults (issue 12): many agents for minutes while components are killed and pages
corrupted; then the same requests again on a fault-free group, replies compared.

    .venv/bin/python bench/soak.py --agents 16 --minutes 10 --slots 4

Loopback only, bounded in count and time. Agents (threads, httpx) run tool loops that resend
their whole history (greedy); every 4th streams and disconnects mid-reply every other turn,
every 4th (offset 1) is `background`, every 8th (offset 2) sends a malformed body every third
turn. A fault injector, every `--fault-min`..`--fault-max` seconds, kill -9's one component
or flips a byte in a page file. The KV disk budget is small (`--kv-disk-budget`), so
eviction runs all the time; its use is sampled. Reported (targets in parentheses):

- responses other than 2xx, 4xx for malformed bodies, 503/429 with Retry-After (0);
  connection errors while the gateway restarts are counted apart (clients retry them);
- wrong outputs: replies that differ from the fault-free run of the same request bodies (0;
  served with --no-prefix-stable unless `--prefix-stable`, so a body alone fixes the prompt);
- turns whose cached tokens < prompt - new tokens - one page, after a fault and overall;
- disk use above the budget in any sample (0);
- gateway and scheduler RSS growth over the second half, same process (< 5%);
- shared memory segments and processes left after the group stops (0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import model_dir  # noqa: E402
from proto.endpoints import Endpoints  # noqa: E402
from tests.helpers.group import ServerGroup, group_members  # noqa: E402
from tests.helpers.workload import text  # noqa: E402

ROLES = ("gateway", "scheduler", "worker", "kvstore")
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                         "parameters": {"type": "object", "properties": {
                                             "word": {"type": "string"}}}}}
SYSTEM = "You are a harbor logistics agent. " + text(1, 300)
PAGE = 256


@dataclass
class Turn:
    agent: int
    body: dict
    status: int = 0
    reply: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    at: float = 0.0
    malformed: bool = False
    stream_cut: bool = False


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: dict = field(default_factory=dict)
    bad: list = field(default_factory=list)
    connection_errors: int = 0
    retries: int = 0

    def note(self, status: int, ok: bool, what: str) -> None:
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if not ok:
                self.bad.append(what)


def post(http: httpx.Client, body: dict, tally: Tally, *, headers=None, malformed=False,
         deadline: float) -> httpx.Response | None:
    """POST with the retries a well-behaved client does: Retry-After on 503/429, and a
    short wait when the gateway is restarting (connection refused)."""
    while time.monotonic() < deadline + 120:
        try:
            if malformed:
                response = http.post("/v1/chat/completions", content=b'{"messages": [',
                                     headers={"content-type": "application/json"})
            else:
                response = http.post("/v1/chat/completions", json=body, headers=headers)
        except httpx.HTTPError:
            with tally.lock:
                tally.connection_errors += 1
            time.sleep(1.0)
            continue
        status = response.status_code
        if status in (429, 503):
            ok = "retry-after" in response.headers
            tally.note(status, ok, f"{status} without Retry-After")
            with tally.lock:
                tally.retries += 1
            time.sleep(min(5.0, float(response.headers.get("retry-after", "1"))))
            continue
        ok = 200 <= status < 300 or (malformed and 400 <= status < 500)
        tally.note(status, ok, f"{status}: {response.text[:200]}")
        return response
    return None


def stream_and_cut(http: httpx.Client, body: dict, tally: Tally) -> None:
    try:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            tally.note(r.status_code, r.status_code < 300 or r.status_code in (429, 503),
                       f"stream {r.status_code}")
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # disconnect mid-reply
    except httpx.HTTPError:
        with tally.lock:
            tally.connection_errors += 1


def agent(index: int, url: str, deadline: float, tally: Tally, turns: list[Turn],
          model: str) -> None:
    rng = random.Random(index)
    conversation = 0

    def fresh() -> list[dict]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {index}.{conversation}: " +
                 text(index * 1000 + conversation, 150)}]

    messages = fresh()
    priority = {"X-Switchyard-Priority": "background"} if index % 4 == 1 else None
    with httpx.Client(base_url=url, timeout=300) as http:
        turn_no = 0
        while time.monotonic() < deadline:
            turn_no += 1
            body = {"model": model, "messages": messages, "tools": [TOOL],
                    "max_tokens": 12, "temperature": 0}
            if index % 8 == 2 and turn_no % 3 == 0:
                post(http, body, tally, malformed=True, deadline=deadline)
                continue
            if index % 4 == 0 and turn_no % 2 == 0:
                stream_and_cut(http, body, tally)
            response = post(http, body, tally, headers=priority, deadline=deadline)
            if response is None or response.status_code != 200:
                continue
            data = response.json()
            message = data["choices"][0]["message"]
            usage = data["usage"]
            turns.append(Turn(index, json.loads(json.dumps(body)), 200, reply_of(message),
                              usage["prompt_tokens"],
                              (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                              usage["completion_tokens"], time.monotonic()))
            assistant = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                assistant["tool_calls"] = message["tool_calls"]
            messages = messages + [assistant]
            for call in message.get("tool_calls") or ():
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": text(rng.randrange(10**6), rng.randint(30, 80))})
            if not message.get("tool_calls"):
                messages.append({"role": "user", "content": text(rng.randrange(10**6), 40)})
            if usage["prompt_tokens"] > 3000:
                conversation += 1
                messages = fresh()


def reply_of(message: dict) -> str:
    """What the model said: text and calls (name, arguments), not the random call ids."""
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    return json.dumps([message.get("content"), calls])


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def disk_bytes(kv_dir: Path) -> int:
    return sum(p.stat().st_size for p in kv_dir.rglob("*.page") if p.is_file())


def injector(group: ServerGroup, deadline: float, args, faults: list, stop: threading.Event):
    rng = random.Random(99)
    while not stop.wait(rng.uniform(args.fault_min, args.fault_max)):
        if time.monotonic() > deadline - 10:
            return
        if rng.random() < 0.25:
            pages = sorted(group.kv_dir.rglob("*.page"))
            if pages:
                target = rng.choice(pages)
                try:
                    raw = bytearray(target.read_bytes())
                    raw[-rng.randint(1, 1000)] ^= 0xFF
                    target.write_bytes(bytes(raw))
                    faults.append((time.monotonic(), "corrupt page"))
                except OSError:
                    pass
                continue
        role = rng.choice(ROLES)
        try:
            group.kill(role)
            faults.append((time.monotonic(), f"kill -9 {role}"))
        except (LookupError, ProcessLookupError):
            pass


def sampler(group: ServerGroup, budget: int, samples: list, stop: threading.Event):
    while not stop.wait(3.0):
        row = {"at": time.monotonic(), "disk": disk_bytes(group.kv_dir)}
        for role in ("gateway", "scheduler"):
            try:
                pid = group.pid_of(role)
            except (LookupError, ProcessLookupError):
                continue
            row[role] = (pid, rss_kib(pid))
        samples.append(row)


def run_group(args, model: Path, faults_on: bool, replay: list[Turn] | None):
    budget = args.kv_disk_budget
    extra = ["--kv-disk-budget", str(budget), "--max-queue", "64"]
    if not args.prefix_stable:
        extra.append("--no-prefix-stable")
    group = ServerGroup(model, slots=args.slots, ctx=8192, extra=extra)
    tally, turns, faults, samples = Tally(), [], [], []
    stop = threading.Event()
    with group:
        model_id = httpx.get(group.base_url + "/models").json()["data"][0]["id"]
        started = time.monotonic()
        deadline = started + args.minutes * 60
        threads = [threading.Thread(target=sampler, args=(group, budget, samples, stop),
                                    daemon=True)]
        if faults_on:
            threads.append(threading.Thread(target=injector,
                                            args=(group, deadline, args, faults, stop),
                                            daemon=True))
        if replay is None:
            threads += [threading.Thread(target=agent, args=(i, group.url, deadline, tally,
                                                             turns, model_id), daemon=True)
                        for i in range(args.agents)]
        else:
            threads += [threading.Thread(target=replay_agent,
                                         args=(i, group.url, replay, tally, turns), daemon=True)
                        for i in range(args.agents)]
        for t in threads:
            t.start()
        for t in threads[(2 if faults_on else 1):]:
            t.join()
        stop.set()
        prefix = Endpoints(group.runtime_dir).shm_prefix
        pgid = group.proc.pid
    leaked_shm = [p.name for p in Path("/dev/shm").glob(prefix + "*")] \
        if Path("/dev/shm").is_dir() else []
    return {"tally": tally, "turns": turns, "faults": faults, "samples": samples,
            "leaked_shm": leaked_shm, "left_processes": group_members(pgid),
            "seconds": time.monotonic() - started, "budget": budget}


def replay_agent(index: int, url: str, replay: list[Turn], tally: Tally, turns: list[Turn]):
    with httpx.Client(base_url=url, timeout=300) as http:
        for turn in [t for t in replay if t.agent == index]:
            response = post(http, turn.body, tally, deadline=time.monotonic() + 600)
            if response is None or response.status_code != 200:
                continue
            message = response.json()["choices"][0]["message"]
            turns.append(Turn(index, turn.body, 200, reply_of(message)))


def report(faulty: dict, reference: dict, args) -> int:
    tally = faulty["tally"]
    ref = {json.dumps(t.body, sort_keys=True): t.reply for t in reference["turns"]}
    compared = wrong = 0
    first_fault = min((at for at, _ in faulty["faults"]), default=float("inf"))
    wrong_before = compared_before = 0
    rows = []
    for turn in faulty["turns"]:
        key = json.dumps(turn.body, sort_keys=True)
        if key in ref:
            compared += 1
            differs = ref[key] != turn.reply
            wrong += differs
            if turn.at < first_fault:
                compared_before += 1
                wrong_before += differs
            rows.append({"agent": turn.agent, "at": turn.at, "differs": differs,
                         "prompt_tokens": turn.prompt_tokens, "cached": turn.cached_tokens})
    if args.dump:
        Path(args.dump).write_text(json.dumps({"faults": faulty["faults"], "turns": rows}))
    by_agent: dict[int, list[Turn]] = {}
    for turn in faulty["turns"]:
        by_agent.setdefault(turn.agent, []).append(turn)
    short = short_after_fault = after_fault = 0
    fault_times = [at for at, _ in faulty["faults"]]
    for turns in by_agent.values():
        for prev, turn in zip(turns, turns[1:]):
            if turn.body["messages"][:len(prev.body["messages"])] != prev.body["messages"]:
                continue  # a new conversation
            new = turn.prompt_tokens - (prev.prompt_tokens + prev.completion_tokens)
            low = turn.cached_tokens < turn.prompt_tokens - max(new, 0) - PAGE
            short += low
            if any(prev.at <= at <= turn.at for at in fault_times):
                after_fault += 1
                short_after_fault += low
    over = [s["disk"] for s in faulty["samples"] if s["disk"] > faulty["budget"]]
    half = faulty["seconds"] / 2
    t0 = faulty["samples"][0]["at"] if faulty["samples"] else 0
    growth = {}
    for role in ("gateway", "scheduler"):
        rows = [s[role] for s in faulty["samples"] if role in s and s["at"] - t0 >= half
                and s[role][1]]
        if rows and rows[0][0] == rows[-1][0]:
            growth[role] = f"{(rows[-1][1] / rows[0][1] - 1) * 100:+.1f}%"
        else:
            growth[role] = "restarted in the second half"
    print(f"\nsoak: {args.agents} agents, {faulty['seconds']:.0f} s, --slots {args.slots}, "
          f"disk budget {faulty['budget']} bytes")
    print(f"faults: {len(faulty['faults'])}: " + ", ".join(f for _, f in faulty["faults"]))
    print(f"statuses: {dict(sorted(tally.statuses.items()))}; retried 503/429: "
          f"{tally.retries}; connection errors (retried): {tally.connection_errors}")
    print(f"responses outside 2xx / 4xx-for-malformed / 503-429-with-Retry-After: "
          f"{len(tally.bad)} {tally.bad[:3]}")
    print(f"wrong outputs: {wrong} of {compared} turns compared with the fault-free run "
          f"({wrong_before} of {compared_before} before the first fault)")
    print(f"turns with cached < prompt - new - one page: {short} of "
          f"{sum(len(t) - 1 for t in by_agent.values())}; right after a fault: "
          f"{short_after_fault} of {after_fault}")
    print(f"disk samples over budget: {len(over)} of {len(faulty['samples'])}")
    print(f"RSS growth over the second half: {growth}")
    print(f"left after stop: shared memory {faulty['leaked_shm']}, processes "
          f"{faulty['left_processes']}")
    return 0 if not tally.bad and not wrong and not over else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--fault-min", type=float, default=30.0)
    parser.add_argument("--fault-max", type=float, default=90.0)
    parser.add_argument("--kv-disk-budget", type=int, default=400 * 2**20)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--dump", help="write per-turn results (JSON) here")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-faults: a control run; its 'wrong outputs' are what "
                             "concurrency alone changes (batch composition, chunk splits)")
    parser.add_argument("--prefix-stable", action=argparse.BooleanOptionalAction, default=False,
                        help="serve with prefix-stable rendering: a body's prompt then also "
                             "depends on what the gateway remembers (lost when it is killed), "
                             "so replies are not comparable by body; off by default here")
    args = parser.parse_args()
    model = model_dir(args.model_size)
    print("faulty run ...", flush=True)
    faulty = run_group(args, model, faults_on=args.faults, replay=None)
    print(f"fault-free replay of {len(faulty['turns'])} turns ...", flush=True)
    reference = run_group(args, model, faults_on=False, replay=faulty["turns"])
    return report(faulty, reference, args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
