"""Regression tests for the gateway findings of issue 23 (hardening, second pass): what an
abusive, careless or second-tenant client could do to the others. The real app under uvicorn
against the scripted fake scheduler of test_gateway (loopback, no API key)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_gateway import CHAT, JSON_TYPE, Finish, Tokens, assert_error
from tests.integration.test_gateway_security import (  # noqa: F401  (module-scoped fixtures)
    fake, make_settings, runtime_dir, served, serving, tokenizer)

POST_ROUTES = {"/v1/chat/completions": {},
               "/v1/completions": {"prompt": "hi"},
               "/v1/responses": {"input": "hi"},
               "/v1/messages": {"max_tokens": 4},
               "/v1/messages/count_tokens": {}}


@pytest.fixture
def http(served, fake):
    fake.received.clear()
    with httpx.Client(base_url=served[0], timeout=20) as client:
        yield client


def assert_api_error(response, path: str, status: int, code: str | None = None):
    """The error in the route's own format: Anthropic's under /v1/messages, else OpenAI's."""
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["message"]
        return body["error"]
    return assert_error(response, status, code)


# -- 4. raw-byte lone surrogates are a 400 on every POST route -----------------------------------

@pytest.mark.parametrize("path", sorted(POST_ROUTES))
def test_raw_encoded_surrogates_are_a_400(http, fake, path):
    fields = b"".join(b'"%s": %s, ' % (k.encode(), str(v).replace("'", '"').encode())
                      for k, v in POST_ROUTES[path].items())
    body = b'{' + fields + b'"messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}'
    if path == "/v1/completions":
        body = b'{"prompt": "hi \xed\xa0\x80"}'
    elif path == "/v1/responses":
        body = b'{"input": "hi \xed\xa0\x80"}'
    response = http.post(path, content=body, headers=JSON_TYPE)
    assert_api_error(response, path, 400, "invalid_json")
    assert fake.submits() == []
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


# -- 1. templates come from the model, never a request -------------------------------------------

def test_a_request_cannot_replace_the_chat_template(http, fake):
    bombs = ["{{ 'ab ' * 3000 }}", "{% for i in range(100000) %}{% for j in range(2000) %}x"
             "{% endfor %}{% endfor %}"]
    for bomb in bombs:
        response = http.post("/v1/chat/completions", json={
            **CHAT, "chat_template_kwargs": {"chat_template": bomb}})
        error = assert_error(response, 400, "invalid_value")
        assert error["param"] == "chat_template_kwargs.chat_template"
        response = http.post("/v1/chat/completions", json={**CHAT, "chat_template": bomb})
        assert_error(response, 400, "unsupported_parameter")
    response = http.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"note": "x" * 40_000}})
    assert_error(response, 400, "invalid_value")
    assert fake.submits() == []
    ok = http.post("/v1/chat/completions", json={
        **CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


# -- 5. the Responses store keeps what the model saw, within a byte bound ------------------------

def test_the_response_store_keeps_only_what_the_model_saw(http, served, fake):
    store = served[1].state.gateway.responses
    before = store.num_bytes
    reasoning = "r" * 30_000  # a reasoning item the template drops (before the last user turn)
    ids = []
    for i in range(30):
        reply = http.post("/v1/responses", json={"max_output_tokens": 4, "input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]},
            {"role": "user", "content": f"question {i}"}]})
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    assert store.num_bytes - before < 30 * 2_000  # the replies and questions, not 900 KB
    follow = http.post("/v1/responses", json={"max_output_tokens": 4, "input": "go on",
                                              "previous_response_id": ids[-1]})
    assert follow.status_code == 200, follow.text


# -- 6. a remembered turn is spliced only into its own conversation -----------------------------

def test_one_conversation_never_renders_anothers_remembered_reply(http, fake, tokenizer):
    """Conversation B's reply "Done." came with private reasoning; A's history holds its own
    "Done.": A's prompt is what the template renders for A (prefix-stable on and off agree),
    and count_tokens tells A nothing about B."""
    secret = tokenizer.encode("<think>\nB's private plan: the launch code is 0000\n</think>\n\n"
                              "Done.", add_special_tokens=False)
    try:
        fake.script = lambda submit: [Tokens(tuple(secret)), Finish()]
        b = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "B: plan the launch"}]})
        assert b.json()["choices"][0]["message"]["content"] == "Done."
    finally:
        fake.script = fake.default_script
    own = [{"role": "user", "content": "B: plan the launch"},
           {"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]
    other = [{"role": "user", "content": "A: say done"},
             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]

    def count(messages, stable: bool) -> int:
        reply = http.post("/v1/messages/count_tokens", json={"messages": messages},
                          headers={"X-Switchyard-Prefix-Stable": "1" if stable else "0"})
        assert reply.status_code == 200, reply.text
        return reply.json()["input_tokens"]

    assert count(other, True) == count(other, False)  # A: no splice of B's reasoning
    assert count(own, True) > count(own, False)  # B itself still gets its exact tokens back
    fake.received.clear()
    http.post("/v1/chat/completions", json={"messages": other})
    (submit,) = fake.submits()
    assert "launch code" not in tokenizer.decode(list(submit.prompt_token_ids))
