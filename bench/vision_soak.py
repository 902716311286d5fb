"""A soak of image and text agents at once on a tiny vision twin, every reply checked.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        nice -n 5 .venv/bin/python bench/vision_soak.py [--minutes 10] [--arch qwen2_5_vl]

One group (`--slots`, default 4) serving a tiny vision twin (fixtures/tiny_models.py). Agents
run until `--minutes` have passed, each cycling through its own multi-turn conversations (the
whole history resent every turn, the assistant turns fixed text, so every request is known in
advance):

- image agents (`--image-agents`), round robin over the three APIs: OpenAI Chat (`image_url`
  parts, every other one streamed), Anthropic Messages (`image` blocks) and Responses
  (`input_image`); a screenshot in the first user turn, and on every other turn one more in the
  user's tool result. The pictures come from a pool of `--pool` images of varied sizes shared
  by all agents (so a picture appears in several conversations, at different places);
- text agents (`--text-agents`): the same conversations' shape without images, Chat streamed
  and Messages.

Every reply is checked against the expected greedy output: mlx-vlm's own generation in this
process (testing/vision.py `Reference`), computed once per distinct prompt before the
group starts. Reported: requests, wrong replies (each listed), errors (non-200, failed or cut
streams), latency p50/p95/max per kind (and TTFT of the streamed ones), prompt tokens read from
cache, the worker's encoder runs (`vision.encoded`) against the distinct pictures, and the
gateway's RSS at the start and end. Target: 0 wrong replies, 0 errors. Exit 1 if
either is not 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench._common import fmt, log_events, preload_note, table  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402
from switchyard.testing.vision import (  # noqa: E402
    Reference,
    anthropic_content,
    openai_content,
    picture,
    responses_content,
    short_id,
)
from switchyard.testing.workload import text  # noqa: E402

IMAGE_APIS = ("chat", "messages", "responses")
TEXT_APIS = ("chat", "messages")


# --- the scripted conversations ----------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One user turn: text, and the pool index of a picture placed after it (or None)."""

    text: str
    image: int | None


@dataclass(frozen=True)
class Prompt:
    """A whole request: the user turns so far (assistant turns between them are fixed)."""

    agent: int
    conv: int
    turns: tuple[Turn, ...]

    @property
    def images(self) -> list[int]:
        return [t.image for t in self.turns if t.image is not None]


def assistant_text(turn: int) -> str:
    return f"Step {turn} done."


def conversation(agent: int, conv: int, num_turns: int, with_images: bool, pool: int,
                 seed: int) -> list[Turn]:
    base = seed * 100_000 + agent * 1000 + conv * 50
    turns = [Turn(f"Agent {agent}, task {conv}: " + text(base, 40),
                  (agent * 7 + conv * 3) % pool if with_images else None)]
    for t in range(1, num_turns):
        image = (agent * 5 + conv * 11 + t) % pool if with_images and t % 2 == 0 else None
        turns.append(Turn("Tool result: " + text(base + t, 30), image))
    return turns


def template_messages(prompt: Prompt) -> list[dict]:
    """The messages as the chat template takes them (image parts as {"type": "image"})."""
    out = []
    for i, turn in enumerate(prompt.turns):
        if i:
            out.append({"role": "assistant", "content": assistant_text(i)})
        content = [{"type": "text", "text": turn.text}]
        if turn.image is not None:
            content += [{"type": "image"}, {"type": "text", "text": " What changed?"}]
        out.append({"role": "user", "content": content if turn.image is not None
                    else turn.text})
    return out


def body(api: str, prompt: Prompt, pictures: list[bytes], max_tokens: int) -> dict:
    """The request in `api`'s own shape."""
    shape = {"chat": openai_content, "messages": anthropic_content,
             "responses": responses_content}[api]
    messages = []
    for i, turn in enumerate(prompt.turns):
        if i:
            reply = assistant_text(i)
            messages.append({"type": "message", "role": "assistant",
                             "content": [{"type": "output_text", "text": reply}]}
                            if api == "responses" else {"role": "assistant", "content": reply})
        content = (shape(turn.text, pictures[turn.image], " What changed?")
                   if turn.image is not None else turn.text)
        messages.append({"role": "user", "content": content}
                        | ({"type": "message"} if api == "responses" else {}))
    if api == "responses":
        return {"input": messages, "max_output_tokens": max_tokens, "temperature": 0,
                "store": False}
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


# --- one request -----------------------------------------------------------------------------

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@dataclass
class Result:
    agent: int
    kind: str  # image | text
    api: str
    stream: bool
    key: tuple[int, int, int]  # (agent, conv, turn)
    latency: float = float("nan")
    ttft: float = float("nan")
    reply: str | None = None
    cached: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def reply_of(api: str, data: dict) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a non-streamed reply."""
    usage = data.get("usage") or {}
    if api == "chat":
        details = usage.get("prompt_tokens_details") or {}
        return (data["choices"][0]["message"].get("content") or "", usage["prompt_tokens"],
                details.get("cached_tokens") or 0)
    if api == "messages":
        cached = usage.get("cache_read_input_tokens") or 0
        return ("".join(b["text"] for b in data["content"] if b["type"] == "text"),
                usage["input_tokens"] + cached, cached)
    details = usage.get("input_tokens_details") or {}
    texts = [c["text"] for item in data["output"] if item.get("type") == "message"
             for c in item["content"] if c.get("type") == "output_text"]
    return "".join(texts), usage["input_tokens"], details.get("cached_tokens") or 0


def send(client: httpx.Client, url: str, api: str, stream: bool, payload: dict,
         result: Result) -> None:
    sent = time.perf_counter()
    try:
        if not stream:
            resp = client.post(url + PATHS[api], json=payload)
            result.latency = time.perf_counter() - sent
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return
            result.reply, result.prompt_tokens, result.cached = reply_of(api, resp.json())
            return
        pieces, finish = [], None
        payload = dict(payload, stream=True, stream_options={"include_usage": True})
        with client.stream("POST", url + PATHS[api], json=payload) as resp:
            if resp.status_code != 200:
                resp.read()
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    result.error = f"stream error: {str(obj['error'])[:200]}"
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if not pieces:
                            result.ttft = time.perf_counter() - sent
                        pieces.append(piece)
                    finish = choice.get("finish_reason") or finish
                if obj.get("usage"):
                    usage = obj["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
        result.latency = time.perf_counter() - sent
        if finish is None and result.error is None:
            result.error = "stream ended without a finish_reason"
        result.reply = "".join(pieces)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        result.latency = time.perf_counter() - sent
        result.error = f"{type(exc).__name__}: {exc}"[:200]


# --- agents ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Agent:
    index: int
    kind: str
    api: str
    convs: tuple[tuple[Turn, ...], ...]

    def prompts(self):
        """(prompt, stream) in the order the agent sends them, forever."""
        n = 0
        while True:
            for c, turns in enumerate(self.convs):
                for t in range(1, len(turns) + 1):
                    # Chat: every other request streamed.
                    yield Prompt(self.index, c, turns[:t]), self.api == "chat" and n % 2 == 1
                    n += 1


def make_agents(args) -> list[Agent]:
    agents = []
    for i in range(args.image_agents + args.text_agents):
        image = i < args.image_agents
        apis = IMAGE_APIS if image else TEXT_APIS
        api = apis[(i if image else i - args.image_agents) % len(apis)]
        convs = tuple(tuple(conversation(i, c, args.turns, image, args.pool, args.seed))
                      for c in range(args.convs))
        agents.append(Agent(i, "image" if image else "text", api, convs))
    return agents


def run_agent(agent: Agent, url: str, pictures: list[bytes], args, deadline: float,
              results: list[Result], lock: threading.Lock) -> None:
    with httpx.Client(timeout=args.timeout) as client:
        for prompt, stream in agent.prompts():
            if time.monotonic() >= deadline:
                return
            result = Result(agent.index, agent.kind, agent.api, stream,
                            (agent.index, prompt.conv, len(prompt.turns)))
            send(client, url, agent.api, stream, body(agent.api, prompt, pictures,
                                                      args.max_tokens), result)
            with lock:
                results.append(result)


# --- figures -----------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def rss_mb(group: ServerGroup) -> float:
    try:
        pid = int((group.runtime_dir / "gateway.pid").read_text().split()[0])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def twin(arch: str) -> Path:
    from fixtures.tiny_models import generate_tiny_model

    out = Path(tempfile.mkdtemp(prefix="sybench-vsoak-")) / arch
    generate_tiny_model(out, arch)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--arch", default="qwen2_5_vl", help="a vision twin of fixtures/tiny_models")
    ap.add_argument("--image-agents", type=int, default=4)
    ap.add_argument("--text-agents", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--convs", type=int, default=3, help="conversations per agent")
    ap.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    ap.add_argument("--pool", type=int, default=12, help="distinct pictures")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=20)
    args = ap.parse_args()
    if note := preload_note():
        print(note, file=sys.stderr)

    model = twin(args.arch)
    try:
        return soak(model, args)
    finally:
        shutil.rmtree(model.parent, ignore_errors=True)


def soak(model: Path, args) -> int:
    # Pictures of varied sizes: 28x28 (one token) up to past the twin's 224x224 cap.
    pictures = [picture(args.seed * 1000 + k, 28 + (k * 37) % 220, 28 + (k * 53) % 200)
                for k in range(args.pool)]
    agents = make_agents(args)
    reference = Reference(model)
    expected: dict[tuple[int, int, int], str] = {}
    started = time.perf_counter()
    for agent in agents:
        for c, turns in enumerate(agent.convs):
            for t in range(1, len(turns) + 1):
                prompt = Prompt(agent.index, c, turns[:t])
                tokens, _ = reference.generate(template_messages(prompt),
                                               [pictures[k] for k in prompt.images],
                                               args.max_tokens)
                expected[(agent.index, c, t)] = reference.text(tokens)
    print(f"{len(expected)} distinct prompts ({sum(1 for v in expected.values() if v)} "
          f"with a non-empty reply, {len(set(expected.values()))} distinct replies), "
          f"references from mlx-vlm in {time.perf_counter() - started:.1f} s")
    del reference

    results: list[Result] = []
    lock = threading.Lock()
    with ServerGroup(model, slots=args.slots, ctx=8192) as group:
        rss_start = rss_mb(group)
        deadline = time.monotonic() + args.minutes * 60
        threads = [threading.Thread(target=run_agent, daemon=True,
                                    args=(a, group.url, pictures, args, deadline, results,
                                          lock)) for a in agents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rss_end = rss_mb(group)
        encodes = log_events(group.log_path, "vision.encoded")
    return report(results, expected, encodes, pictures, rss_start, rss_end, args)


def report(results: list[Result], expected: dict, encodes: list[dict], pictures: list[bytes],
           rss_start: float, rss_end: float, args) -> int:
    wrong = [r for r in results if r.error is None and r.reply != expected[r.key]]
    errors = [r for r in results if r.error is not None]
    rows = []
    for kind in ("image", "text"):
        for api in IMAGE_APIS:
            for stream in (False, True):
                group = [r for r in results if r.kind == kind and r.api == api
                         and r.stream == stream]
                if not group:
                    continue
                lat = [r.latency for r in group if r.error is None]
                prompt = sum(r.prompt_tokens for r in group)
                rows.append([kind, api + (" stream" if stream else ""), len(group),
                             sum(r in wrong for r in group), sum(r in errors for r in group),
                             fmt(pct(lat, 0.5)), fmt(pct(lat, 0.95)), fmt(max(lat or [0])),
                             fmt(pct([r.ttft for r in group], 0.95)) if stream else "",
                             fmt(sum(r.cached for r in group) / prompt if prompt else 0, 2)])
    print(preload_note())
    print(f"{args.minutes:g} min, {args.image_agents} image + {args.text_agents} text agents, "
          f"--slots {args.slots}, {args.arch} twin, {args.max_tokens}-token greedy replies")
    print(table(["kind", "api", "requests", "wrong", "errors", "latency p50 s", "p95 s",
                 "max s", "TTFT p95 s", "cached/prompt"], rows))
    ids = {short_id(p) for p in pictures}
    encoded = [e.get("image") for e in encodes]
    print(f"requests {len(results)}, wrong {len(wrong)}, errors {len(errors)}; encoder runs "
          f"{len(encoded)} for {len(ids & set(encoded))} of {len(ids)} distinct pictures; "
          f"gateway RSS {fmt(rss_start, 0)} -> {fmt(rss_end, 0)} MB")
    for r in wrong[:10]:
        print(f"WRONG agent {r.agent} {r.api} key {r.key}: got {r.reply!r}, "
              f"expected {expected[r.key]!r}")
    for r in errors[:10]:
        print(f"ERROR agent {r.agent} {r.api} key {r.key}: {r.error}")
    return 1 if wrong or errors else 0


if __name__ == "__main__":
    sys.exit(main())
