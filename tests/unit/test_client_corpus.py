"""The corpus of real agent-client requests (tests/corpus/<client>-<version>/, recorded by
tools/record_clients.py) replayed through the gateway's parsing and rendering: every request
parses, renders with the tiny model's tokenizer and template, and each later request of a
session (the second turn, a turn with a tool result) renders as an extension of the first
turn's prompt, token for token up to at most one page before its end (where a client edits its
own history), so the server finds the first turn's pages. Also: the
section per client of docs/clients.md shows exactly the configuration the e2e tests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from switchyard.gateway.api.anthropic_api import parse_messages_request
from switchyard.gateway.api.responses_api import parse_responses_request
from switchyard.gateway.api.openai_request import parse_chat_request
from switchyard.gateway.prompting.history import RenderOptions, render_prompt
from switchyard.gateway.request.response_store import ResponseStore
from switchyard.testing.agent_clients import CLIENTS, doc_blocks

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "corpus"
SESSIONS = sorted(p for p in CORPUS.iterdir() if p.is_dir()) if CORPUS.is_dir() else []
FILES = ("turn1.json", "turn2.json", "tool_result.json")
SECRETS = ("authorization", "x-api-key", "cookie", "proxy-authorization")


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_tokenizer):
    return tiny_hf_tokenizer


def load(session: Path, name: str) -> dict:
    return json.loads((session / name).read_text())


def parse(record: dict):
    """The ChatRequest the gateway makes of a recorded request, by its path."""
    path = record["path"].split("?")[0]
    body = record["body"]
    if path.endswith("/v1/messages"):
        return parse_messages_request(body).chat
    if path.endswith("/v1/responses"):
        return parse_responses_request(body, ResponseStore()).chat
    if path.endswith("/v1/chat/completions"):
        return parse_chat_request(body)
    raise AssertionError(f"not a model request: {record['method']} {path}")


def render(tokenizer, record: dict) -> list[int]:
    chat = parse(record)
    options = RenderOptions(memory=None, think_start="<think>", turn_ends=("<|im_end|>",))
    return render_prompt(tokenizer, chat.messages, chat.tools, chat.template_kwargs,
                         options).ids


def test_the_corpus_has_every_client():
    names = {s.name.rsplit("-", 1)[0] for s in SESSIONS}
    assert names == set(CLIENTS), f"corpus sessions: {[s.name for s in SESSIONS]}"


@pytest.mark.parametrize("session", SESSIONS, ids=[s.name for s in SESSIONS])
def test_recorded_requests_are_whole_and_hold_no_secrets(session):
    for name in FILES:
        record = load(session, name)
        assert record["method"] == "POST" and isinstance(record["body"], dict)
        assert not set(record["headers"]) & set(SECRETS)
        if name != "tool_result.json":
            assert record.get("status") in (200, None), (name, record.get("status"))
    assert "constructed" in load(session, "tool_result.json")


# How far before the end of turn 1's prompt a client's own edit of its history may start: one
# KV page, the issue's "served from cache within one page". Qwen Code 0.24 moves its "current
# date" <system-reminder> from the previous user message to the newest one (~120 tokens of
# turn 1's end re-read); the tool-result turn, built from turn 1 itself, must extend it exactly.
PAGE_SIZE = 256


@pytest.mark.parametrize("session", SESSIONS, ids=[s.name for s in SESSIONS])
def test_every_request_parses_and_later_turns_extend_the_first(session, tokenizer):
    first = render(tokenizer, load(session, "turn1.json"))
    assert len(first) > 1000  # a real client's system prompt and tools
    for name in FILES[1:]:
        later = render(tokenizer, load(session, name))
        assert len(later) > len(first), name
        same = next((i for i, (a, b) in enumerate(zip(first, later)) if a != b), len(first))
        allowed = 0 if name == "tool_result.json" else PAGE_SIZE
        assert same >= len(first) - allowed, (
            f"{name} departs from turn 1's prompt at token {same} of {len(first)}: "
            f"{tokenizer.decode(first[max(0, same - 20):same + 20])!r} vs "
            f"{tokenizer.decode(later[max(0, same - 20):same + 20])!r}")


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_clients_doc_shows_the_configuration_the_tests_use(name):
    readme = (REPO / "docs" / "clients.md").read_text()
    for block in doc_blocks(name):
        assert f"\n{block}```\n" in readme, f"docs/clients.md's {name} section lacks the block:\n{block}"


@pytest.mark.parametrize("session", SESSIONS, ids=lambda p: p.name)
def test_every_field_a_client_sends_is_known_and_in_the_clients_doc_table(session):
    """No corpus field is logged as unknown (each is read or ignored by design), and
    docs/clients.md's "What agent clients send" table names each one."""
    from structlog.testing import capture_logs

    from switchyard.gateway.request.wire import decoding

    readme = (REPO / "docs" / "clients.md").read_text()
    table = readme[readme.index("## What agent clients send"):]
    table = table[:table.index("\n\n", table.index("| API |"))]
    for name in FILES:
        record = load(session, name)
        decoding._noted.clear()
        with capture_logs() as logs:
            parse(record)
        assert [e for e in logs if e["event"] == "request.field_ignored"
                and not e["field"].startswith(("responses.tools[].type=",
                                               "context_management.edits[].type="))] == []
        for field in record["body"]:  # `field` or `field.member`
            assert re.search(f"`{re.escape(field)}[`.]", table), \
                f"{session.name}/{name}: `{field}` not in docs/clients.md"
