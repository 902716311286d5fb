"""What validating a request against its declared model costs.

    .venv/bin/python bench/request_parsing.py [--rounds 200]

The fastest of many rounds of each API's parser (body already parsed from JSON, as the gateway hands it over:
api/json_body.py) on the recorded agent-client requests of tests/corpus/ (Claude Code, Codex,
opencode, Qwen Code: a real system prompt, 20-60 tools, a few turns) and on a synthetic long
conversation (2,000 Chat messages of text parts, the same as Anthropic content blocks). Run it
in two checkouts to compare: the figures are microseconds per request, and the ratio that
matters is this checkout's over the other's, in one run each on the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from switchyard.gateway.api.anthropic_api import parse_messages_request  # noqa: E402
from switchyard.gateway.api.responses_api import parse_responses_request  # noqa: E402
from switchyard.gateway.api.openai_request import parse_chat_request  # noqa: E402
from switchyard.gateway.request.response_store import ResponseStore  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
NUM_MESSAGES = 2_000


def parser_of(path: str):
    if path.endswith("/v1/messages"):
        return parse_messages_request
    if path.endswith("/v1/responses"):
        return lambda body: parse_responses_request(body, ResponseStore())
    return parse_chat_request


def best_us(fn, rounds: int) -> float:
    """The fastest of `rounds` (the work is the same each time: the slower ones measure the
    shared machine's other load)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def cases(corpus: Path) -> list[tuple[str, object, dict]]:
    out = []
    for session in sorted(p for p in corpus.iterdir() if p.is_dir()):
        record = json.loads((session / "turn2.json").read_text())
        path = record["path"].split("?")[0]
        out.append((f"{session.name} turn2", parser_of(path), record["body"]))
    chat = {"messages": [{"role": "user" if i % 2 == 0 else "assistant",
                          "content": [{"type": "text", "text": f"line {i} " * 20}]}
                         for i in range(NUM_MESSAGES)]}
    out.append((f"chat {NUM_MESSAGES} messages", parse_chat_request, chat))
    out.append((f"anthropic {NUM_MESSAGES} messages", parse_messages_request,
                {**chat, "max_tokens": 64}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    args = parser.parse_args()
    for name, parse, body in cases(args.corpus):
        print(f"{name:40s} {best_us(lambda: parse(body), args.rounds):10.1f} us")


if __name__ == "__main__":
    main()
