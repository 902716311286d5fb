"""Request traces for the residency bench: what each request shares with earlier ones.

A trace is a JSON-lines file. Its first line is a header:

    {"trace": "claude-code-subagents", "format": 1, "page_size": 256, "source": "...",
     "command": "how to regenerate it"}

then one line per request, in arrival order:

    {"i": 3, "t": 12.41, "conv": "agent 1", "prompt": 21034, "shared": [0, 20890],
     "new": 144, "reply": 37, "end": "tool_calls"}

- `t`: arrival, seconds from the first request.
- `shared`: [j, n]: the first n tokens of this prompt are the first n tokens of request j's
  prompt (the earlier request with the longest common prefix), or null. This is the compact
  equivalent of the prompt's page ids: pages chain (common/page_ids.py), so two prompts share
  exactly the pages of their common prefix, and a replay rebuilds a token sequence with the
  same sharing (`synthesize`). It holds no text and no token id, so nothing can be recovered.
- `new`: prompt - n, the tokens no earlier prompt held: what even a perfect cache prefills.
- `reply`: tokens generated; `end`: how the reply ended ("tool_calls", "stop" for the end of
  a turn, "length").
- `conv`: the conversation it belongs to, if known ("main", "agent 3", ...), else null.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = 1


@dataclass(frozen=True)
class TraceRequest:
    i: int
    t: float
    prompt: int
    shared: tuple[int, int] | None  # (earlier request, tokens in common)
    reply: int
    end: str
    conv: str | None = None

    @property
    def new(self) -> int:
        return self.prompt - (self.shared[1] if self.shared else 0)

    @property
    def num_shared(self) -> int:
        return self.shared[1] if self.shared else 0


@dataclass(frozen=True)
class Trace:
    name: str
    page_size: int
    requests: tuple[TraceRequest, ...]
    source: str = ""
    command: str = ""


def dumps(trace: Trace) -> str:
    head = {"trace": trace.name, "format": FORMAT, "page_size": trace.page_size,
            "source": trace.source, "command": trace.command}
    lines = [json.dumps(head)]
    for r in trace.requests:
        row = asdict(r)
        row["shared"] = list(r.shared) if r.shared else None
        row["new"] = r.new
        row["t"] = round(r.t, 3)
        lines.append(json.dumps(row))
    return "\n".join(lines) + "\n"


def loads(text: str) -> Trace:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    head, body = rows[0], rows[1:]
    if head.get("format") != FORMAT:
        raise ValueError(f"trace format {head.get('format')!r}, this build reads {FORMAT}")
    requests = tuple(TraceRequest(
        i=r["i"], t=r["t"], prompt=r["prompt"],
        shared=tuple(r["shared"]) if r["shared"] else None, reply=r["reply"], end=r["end"],
        conv=r.get("conv")) for r in body)
    for r in requests:
        if r.shared and not (0 <= r.shared[0] < r.i and r.shared[1] <= r.prompt):
            raise ValueError(f"request {r.i}: shared {r.shared} does not point back")
    return Trace(head["trace"], head["page_size"], requests, head.get("source", ""),
                 head.get("command", ""))


def save(trace: Trace, path: Path) -> None:
    Path(path).write_text(dumps(trace))


def load(path: Path) -> Trace:
    return loads(Path(path).read_text())


def _page_keys(ids: list[int], page_size: int) -> list[bytes]:
    """A chained digest per whole page: key k names ids[:(k+1)*page_size]."""
    keys, parent = [], b""
    for k in range(len(ids) // page_size):
        chunk = ids[k * page_size:(k + 1) * page_size]
        parent = hashlib.blake2b(parent + json.dumps(chunk).encode(), digest_size=16).digest()
        keys.append(parent)
    return keys


def _common(a: list[int], b: list[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefixes(prompts: list[list[int]], page_size: int) -> list[tuple[int, int] | None]:
    """For each prompt, (the earlier prompt with the longest common prefix, its length): whole
    pages are matched by chained digests, then token by token into the next page."""
    owners: dict[bytes, list[int]] = {}  # page key -> earlier prompts holding that prefix
    out: list[tuple[int, int] | None] = []
    for i, ids in enumerate(prompts):
        keys = _page_keys(ids, page_size)
        k = 0
        while k < len(keys) and keys[k] in owners:
            k += 1
        candidates = owners[keys[k - 1]] if k else range(i)
        best = None
        for j in candidates:
            n = _common(prompts[j], ids, k * page_size)
            if n and (best is None or n > best[1]):
                best = (j, n)
        out.append(best)
        for key in keys:
            owners.setdefault(key, []).append(i)
    return out


def synthesize(trace: Trace) -> list[list[int]]:
    """Token ids with the trace's sharing: each prompt is its earlier request's first n tokens,
    then ids no other prompt has (from 1 up; 0 is left for a stop token)."""
    fresh = 1
    prompts: list[list[int]] = []
    for r in trace.requests:
        head = prompts[r.shared[0]][:r.shared[1]] if r.shared else []
        prompts.append(head + list(range(fresh, fresh + r.new)))
        fresh += r.new
    return prompts


def reordered(trace: Trace, order: list[int] | tuple[int, ...]) -> Trace:
    """The same requests in another order (the order a scheduler ran them in), their shared
    prefixes found again against the requests now before them."""
    prompts = synthesize(trace)
    chosen = [prompts[i] for i in order]
    shared = shared_prefixes(chosen, trace.page_size)
    reqs = tuple(TraceRequest(k, trace.requests[i].t, trace.requests[i].prompt, shared[k],
                              trace.requests[i].reply, trace.requests[i].end,
                              trace.requests[i].conv) for k, i in enumerate(order))
    return Trace(trace.name, trace.page_size, reqs, trace.source, trace.command)
