"""Two servers behind SMG (Shepherd Model Gateway, SGLang's router), installed from PyPI as its
users install it (testing/smg.py), on the tiny model: Chat, Messages and Responses answer
through it, streamed and not, with SGLang's integer priority (SMG itself adds one to Responses);
SMG's discovery and load monitor accept what the servers answer; a later turn of a conversation
sent through SMG's `cache_aware` policy reaches the server that holds it, and is cached.

SMG routes by the name each server announces (`--served-model-name`). Without pip or an index
the tests skip with the reason, unless SWITCHYARD_REQUIRE_CLIENTS=1 (`.ci/run` sets it): then
they fail.
"""

from __future__ import annotations

import os
import threading
import time

import anthropic
import httpx
import openai
import pytest

from switchyard.testing.group import ServerGroup, short_tmp_dir, stop_all
from switchyard.testing.smg import SmgRouter, SmgUnavailable, install

MODEL = "tiny"
CLAUDE_MODEL = "claude-sonnet-4-5"  # a name Claude Code sends, routed by SMG's --model-alias
PAGE_SIZE = 16
TIMEOUT_S = 120.0
# Long enough that a later turn's cached tokens say where it went (many pages of it).
SYSTEM = "You are a terse assistant for a team of agents. " * 12


@pytest.fixture(scope="module")
def smg_exe():
    try:
        return install()
    except SmgUnavailable as exc:
        if os.environ.get("SWITCHYARD_REQUIRE_CLIENTS") == "1":
            pytest.fail(f"SMG required (SWITCHYARD_REQUIRE_CLIENTS=1): {exc}")
        pytest.skip(f"SMG not installed: {exc}")


@pytest.fixture(scope="module")
def servers(tiny_qwen3, smg_exe):
    groups = [ServerGroup(tiny_qwen3, slots=2, ctx=2048,
                          extra=("--served-model-name", MODEL, "--page-size", str(PAGE_SIZE)))
              for _ in range(2)]
    errors: list[BaseException] = []

    def start(group: ServerGroup) -> None:
        try:
            group.start()
        except BaseException as exc:  # noqa: BLE001 - reported below, after both tried
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(g,)) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield groups
    finally:
        stop_all(groups)


@pytest.fixture(scope="module")
def router(servers, smg_exe):
    log = short_tmp_dir("smg") / "smg.log"
    with SmgRouter(smg_exe, [g.url for g in servers], log,
                   extra=("--model-alias", f"{CLAUDE_MODEL}={MODEL}")) as running:
        yield running


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(router):
    with anthropic.Anthropic(base_url=router.url, api_key="none", timeout=TIMEOUT_S,
                             max_retries=0) as c:
        yield c


def test_every_server_answers_what_smg_reads(servers):
    for group in servers:
        loads = httpx.get(group.url + "/v1/loads").json()
        assert loads["dp_rank_count"] == 1 and loads["loads"][0]["max_running_requests"] >= 2
        assert httpx.get(group.url + "/server_info").json()["served_model_name"] == MODEL
        assert httpx.get(group.url + "/model_info").json()["is_generation"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_smg(client, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello"}],
                  max_tokens=4, extra_body={"priority": 1})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens > 0
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") if chunks[-1].choices \
        else chunks[-2].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_smg(claude, stream):
    kwargs = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                  extra_body={"priority": 0})
    if not stream:
        reply = claude.messages.create(**kwargs)
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
        return
    with claude.messages.stream(**kwargs) as events:
        final = events.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_claude_codes_model_name_routes_by_smgs_alias(claude):
    reply = claude.messages.create(model=CLAUDE_MODEL, max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_smg(client, stream):
    """SMG re-serializes a Responses body with SGLang's integer priority of its own."""
    kwargs = dict(model=MODEL, input="Hi", max_output_tokens=4, extra_body={"priority": -1})
    if not stream:
        reply = client.responses.create(**kwargs)
        assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens > 0
        return
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_a_later_turn_through_smg_is_cached(client):
    """cache_aware sends the second turn where the first one's text is: its cached tokens
    cover the first prompt, less at most the page it ends in."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Plan the first step."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the next one?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - PAGE_SIZE, (first.usage, second.usage)


def test_smg_sees_the_servers_load(router, servers):
    """SMG's load monitor took each server's /v1/loads: its /get_loads lists both, with the
    figures they gave (max_running_requests is --max-running; a worker whose load SMG could
    not read is left out)."""
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(router.url + "/get_loads", timeout=10).json()
        seen = {w["worker"]: w for w in body.get("loads", [])}
        if set(seen) == {g.url for g in servers} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(seen) == {g.url for g in servers}, (body, router.log_tail())
    assert all(w["max_running_requests"] == 2 and w["max_total_num_tokens"] > 0
               for w in seen.values()), body
