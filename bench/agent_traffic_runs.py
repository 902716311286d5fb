"""bench/agent_traffic.py's run of one server: every request of the workload, streamed, each
conversation's next request sent as soon as its previous reply ends.

Not a benchmark itself: bench/agent_traffic_figures.py turns what it returns into figures.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

from bench._common import Streamed, stream
from bench.agent_traffic_workload import (CLAUDE_MODEL, SUBAGENT_MODEL, Request, Workload,
                                          anthropic_body, openai_body)


# --- streaming Anthropic ------------------------------------------------------------------------


def anthropic_stream(url: str, body: dict, client: httpx.Client) -> Streamed:
    out = Streamed(sent=time.perf_counter())
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "sk-bench",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with client.stream("POST", url + "/v1/messages", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            out.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            out.finished = time.perf_counter()
            return out
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            obj = json.loads(line[6:])
            kind = obj.get("type")
            if kind == "message_start":
                out.rid = obj["message"]["id"]
            elif kind == "content_block_delta":
                delta = obj["delta"]
                if delta.get("text") or delta.get("partial_json") or delta.get("thinking"):
                    out.stamps.append(now)
            elif kind == "content_block_start" and obj["content_block"]["type"] == "tool_use":
                out.stamps.append(now)
            elif kind == "message_delta":
                out.finish_reason = obj["delta"].get("stop_reason")
                out.usage = obj.get("usage")
            elif kind == "error":
                out.error = str(obj.get("error"))[:300]
    out.finished = time.perf_counter()
    return out


# --- running -------------------------------------------------------------------------------------


@dataclass
class Done:
    req: Request
    res: Streamed
    prompt: int = 0  # as the server counted it
    cached: int | None = None  # the server's own count

    new: int = 0  # prompt tokens beyond the conversation's previous prompt, as counted here

    @property
    def reread(self) -> int:
        return max(0, self.prompt - (self.cached or 0) - self.new)


def run(server: str, url: str, w: Workload, reqs: dict, log, model: str = ""
        ) -> tuple[list[Done], float]:
    """Every request of the workload; `model`: the name a peer serves (its model path)."""
    done: list[Done] = []
    lock = threading.Lock()
    errors: list[str] = []
    counter = iter(range(10**9))

    def send(key: tuple[str, int], client: httpx.Client) -> bool:
        r = reqs[key]
        if server == "switchyard":
            asks = SUBAGENT_MODEL if w.args.background_subagents and r.conv != "main" \
                else CLAUDE_MODEL
            res = anthropic_stream(url, anthropic_body(w, r.messages, next(counter), asks),
                                   client)
        else:
            res = stream(url, "/v1/chat/completions", openai_body(w, r.messages, model),
                         client=client)
        if res.error:
            errors.append(f"{r.conv} turn {r.turn}: {res.error}")
            return False
        d = Done(r, res)
        u = res.usage or {}
        if server == "switchyard":
            d.cached = u.get("cache_read_input_tokens", 0)
            d.prompt = u.get("input_tokens", 0) + d.cached
        else:
            d.prompt = u.get("prompt_tokens", 0)
            details = u.get("prompt_tokens_details") or {}
            if server == "mlx_lm":
                d.cached = details.get("cached_tokens") or 0
        with lock:
            done.append(d)
        log(f"    {r.conv} turn {r.turn}: prompt {d.prompt}, ttft {res.ttft:6.2f}s")
        return True

    def agent(i: int) -> None:
        with httpx.Client(timeout=1800) as client:
            for t in range(w.args.turns + 1):
                if not send((f"agent {i}", t), client):
                    return

    t0 = time.perf_counter()
    with httpx.Client(timeout=1800) as client:
        if send(("main", 0), client):
            threads = [threading.Thread(target=agent, args=(i,)) for i in range(w.args.agents)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if not errors:
                send(("main", 1), client)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server}: " + "; ".join(errors[:5]))
    return done, wall

