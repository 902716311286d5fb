"""The context limit as each agent client expects to hear it, through the real gateway app
against a fake scheduler: the words Claude Code, Qwen Code and opencode parse to compact
(their own patterns, copied from the clients of the day), Codex's streamed `response.failed`,
and the window in /v1/models."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from tests.integration.test_gateway_agent_api import (  # noqa: F401 (fixtures)
    base_url, claude, client, fake, http, scheduler, settings, tokenizer)

# Claude Code 2.1.x reads the counts with this pattern to compact (shared/notes).
CLAUDE_CODE = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)")
# Qwen Code 0.24 (packages/core/src/utils/contextLengthError.ts): the OpenAI wording's counts.
QWEN_CODE = re.compile(r"maximum context length is\s*(\d[\d,]*)\s*tokens?[\s\S]*?"
                       r"(?:resulted in|requested|used)\s*(\d[\d,]*)\s*tokens?", re.I)
# opencode 1.18 (its overflow patterns, two of them).
OPENCODE = (re.compile(r"maximum context length is \d+ tokens", re.I),
            re.compile(r"reduce the length of the messages", re.I))


def too_long(settings) -> str:
    """More tokens than the context, fewer characters than the character bound: tokenized
    and counted."""
    return "word " * (settings.ctx + 10)


def test_messages_says_prompt_is_too_long_as_claude_code_parses_it(claude, settings):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny-qwen3", max_tokens=32000,
                               messages=[{"role": "user", "content": too_long(settings)}])
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    actual, maximum = map(int, CLAUDE_CODE.search(error["message"]).groups())
    assert actual > settings.ctx and maximum == settings.ctx - 1  # the longest prompt


def test_chat_says_it_in_openais_words_as_qwen_code_and_opencode_parse_them(client, settings):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-qwen3", messages=[
            {"role": "user", "content": too_long(settings)}])
    assert caught.value.code == "context_length_exceeded"
    message = caught.value.body["message"]
    limit, actual = map(int, QWEN_CODE.search(message).groups())
    assert limit == settings.ctx and actual > settings.ctx
    assert all(p.search(message) for p in OPENCODE)


def test_a_streamed_response_fails_in_the_stream_as_codex_reads_it(http, settings):
    body = {"model": "tiny-qwen3", "input": too_long(settings), "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "context_length_exceeded"
    # Not streamed: the same 400 as Chat Completions.
    response = http.post("/v1/responses", json={**body, "stream": False})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_models_tell_the_context_window(client, settings):
    card = client.models.list().data[0].model_dump()
    assert card["max_model_len"] == card["context_length"] == settings.ctx
