"""bench/soak.py's agents: 16 seeded agents whose every request is known in advance (tool
loops resending their whole history, background priority, streaming with dropped connections,
malformed bodies), each a thread that records every request's status, reply and cached tokens.

Not a benchmark itself: bench/soak.py runs them twice, fault-free and under faults.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import text

NUM_AGENTS = 16
RETRY_STATUSES = (429, 503)


def agent_kind(index: int) -> str:
    i = index % 16
    return ("tool" if i < 8 else "background" if i < 11 else "stream" if i < 14
            else "malformed")


# --- requests --------------------------------------------------------------------------------


@dataclass
class Record:
    agent: int
    kind: str  # turn | drop | malformed
    key: tuple[int, int] | None  # (conversation, turn) of a turn
    started: float
    ended: float = 0.0
    status: int | None = None  # final status; None: no reply at all
    text: str | None = None
    rid: str = ""  # the reply's id: its request in the group's log
    prompt: int = 0
    cached: int = 0
    retries: int = 0  # 503/429 with Retry-After, connection failures, mid-stream errors
    problems: list[str] = field(default_factory=list)


class Script:
    """An agent's requests, known in advance: conversations of --turns turns."""

    def __init__(self, index: int, seed: int, turns: int, system: str):
        self.index, self.seed, self.turns, self.system = index, seed, turns, system

    def messages(self, conv: int, turn: int) -> list[dict]:
        base = self.seed * 100_000 + self.index * 1000 + conv * 50
        msgs = [{"role": "system",
                 "content": f"{self.system} agent {self.index} conversation {conv}"},
                {"role": "user", "content": text(base, 120)}]
        for t in range(1, turn + 1):
            msgs.append({"role": "assistant", "content": f"step {t} done"})
            msgs.append({"role": "user", "content": "tool result: " + text(base + t, 100)})
        return msgs


def malformed_bodies(model: str) -> list[tuple[bytes, str]]:
    ok = [{"role": "user", "content": "hi"}]
    bodies = [b"{not json", json.dumps({"model": model}).encode(),
              json.dumps({"model": model, "messages": "hello"}).encode(),
              json.dumps({"model": model, "messages": ok, "max_tokens": -5}).encode(),
              json.dumps({"model": model, "messages": [{"role": "wizard",
                                                        "content": "hi"}]}).encode(),
              json.dumps({"model": model, "messages": ok, "temperature": "hot"}).encode(),
              json.dumps([1, 2, 3]).encode()]
    return [(b, "application/json") for b in bodies]


def _reply(data: dict) -> dict:
    details = data["usage"].get("prompt_tokens_details") or {}
    return {"text": data["choices"][0]["message"]["content"], "rid": data["id"],
            "prompt": data["usage"]["prompt_tokens"], "cached": details.get("cached_tokens", 0)}


class Agent(threading.Thread):
    def __init__(self, index: int, script: Script, url: str, model: str, deadline: float,
                 max_turns: int, max_tokens: int, sink: list, lock: threading.Lock):
        super().__init__(daemon=True, name=f"agent-{index}")
        self.index, self.script, self.url, self.model = index, script, url, model
        self.kind = agent_kind(index)
        self.deadline, self.max_turns, self.max_tokens = deadline, max_turns, max_tokens
        self.sink, self.lock = sink, lock
        self.rng = random.Random(script.seed * 7919 + index)
        self.turns_done = 0
        self.give_up_at = deadline + 180  # a turn in flight at the deadline may still retry

    def _add(self, rec: Record) -> None:
        rec.ended = time.monotonic()
        with self.lock:
            self.sink.append(rec)

    def run(self) -> None:
        headers = {"x-switchyard-priority": "background"} if self.kind == "background" else {}
        with httpx.Client(timeout=httpx.Timeout(300, connect=5), headers=headers) as http:
            n = 0
            while n < self.max_turns and time.monotonic() < self.deadline:
                conv, turn = divmod(n, self.script.turns)
                body = {"model": self.model, "messages": self.script.messages(conv, turn),
                        "max_tokens": self.max_tokens, "temperature": 0}
                if self.kind == "malformed":
                    self._malformed(http)
                if self.kind == "stream" and turn % 3 == 2:
                    self._dropped(http, body)
                self._add(self._turn(http, body, (conv, turn)))
                n += 1
                self.turns_done = n

    def _turn(self, http: httpx.Client, body: dict, key) -> Record:
        rec = Record(self.index, "turn", key, time.monotonic())
        stream = self.kind == "stream"
        while time.monotonic() < self.give_up_at:
            try:
                if stream:
                    status, retry_after, reply = self._post_stream(http, body)
                else:
                    resp = http.post(f"{self.url}/v1/chat/completions", json=body)
                    status, retry_after = resp.status_code, resp.headers.get("retry-after")
                    reply = _reply(resp.json()) if status == 200 else None
            except (httpx.TransportError, json.JSONDecodeError):
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.status = status
            if status in RETRY_STATUSES:
                if retry_after is None:
                    rec.problems.append(f"{status} without Retry-After")
                rec.retries += 1
                time.sleep(min(2.0, float(retry_after or 1)))
                continue
            if status != 200:
                rec.problems.append(f"HTTP {status} for a valid request")
                return rec
            if reply is None:  # an error event mid-stream (a component died): retry
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.text, rec.rid = reply["text"], reply["rid"]
            rec.prompt, rec.cached = reply["prompt"], reply["cached"]
            return rec
        rec.problems.append("gave up retrying")
        return rec

    def _post_stream(self, http: httpx.Client, body: dict):
        body = dict(body, stream=True, stream_options={"include_usage": True})
        with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return resp.status_code, resp.headers.get("retry-after"), None
            parts, usage, failed, rid = [], None, False, ""
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    failed = True
                rid = obj.get("id", rid)
                for choice in obj.get("choices") or []:
                    parts.append((choice.get("delta") or {}).get("content") or "")
                if obj.get("usage"):
                    usage = obj["usage"]
            if failed or usage is None:
                return 200, None, None
            details = usage.get("prompt_tokens_details") or {}
            return 200, None, {"text": "".join(parts), "prompt": usage["prompt_tokens"],
                               "cached": details.get("cached_tokens", 0), "rid": rid}

    def _dropped(self, http: httpx.Client, body: dict) -> None:
        """A streamed request the client abandons after two chunks."""
        rec = Record(self.index, "drop", None, time.monotonic())
        body = dict(body, stream=True)
        try:
            with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code == 200:
                    for i, _ in enumerate(resp.iter_lines()):
                        if i >= 3:
                            break  # leaving the block closes the connection mid-reply
                else:
                    resp.read()
                    if (resp.status_code in RETRY_STATUSES
                            and resp.headers.get("retry-after") is None):
                        rec.problems.append(f"{resp.status_code} without Retry-After")
                    elif resp.status_code not in RETRY_STATUSES:
                        rec.problems.append(f"HTTP {resp.status_code} for a valid request")
        except httpx.TransportError:
            rec.retries += 1
        self._add(rec)

    def _malformed(self, http: httpx.Client) -> None:
        body, ctype = self.rng.choice(malformed_bodies(self.model))
        rec = Record(self.index, "malformed", None, time.monotonic())
        for _ in range(20):
            try:
                resp = http.post(f"{self.url}/v1/chat/completions", content=body,
                                 headers={"content-type": ctype})
            except httpx.TransportError:
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.status = resp.status_code
            if resp.status_code in RETRY_STATUSES:
                if resp.headers.get("retry-after") is None:
                    rec.problems.append(f"{resp.status_code} without Retry-After")
                rec.retries += 1
                time.sleep(1.0)
                continue
            if not 400 <= resp.status_code < 500:
                rec.problems.append(f"HTTP {resp.status_code} for a malformed body")
            break
        self._add(rec)


def script_of(index: int, args) -> Script:
    return Script(index, args.seed, args.turns, text(args.seed, 150))


def run_agents(group: ServerGroup, args, seconds: float, max_turns: dict[int, int] | None):
    model = httpx.get(f"{group.base_url}/models").json()["data"][0]["id"]
    records: list[Record] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    agents = [Agent(i, script_of(i, args), group.url, model, deadline,
                    (max_turns or {}).get(i, args.max_turns), args.max_tokens, records, lock)
              for i in range(NUM_AGENTS)]
    for a in agents:
        a.start()
    return agents, records


