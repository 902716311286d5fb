"""Pages from a peer through two real groups that are `--peer`s of each other, on the tiny model
(docs/design/kv-pages.md "Pages from a peer"): a conversation's next turn sent to the server
that never saw it restores what the other holds instead of re-reading it; a cache salt (a
tenant, as pages know it) gets no page of another; an ask without the peer key is refused; and
a peer that never answers, or is gone, costs at most the deadline and the request still answers.
"""

from __future__ import annotations

import socket
import time
from datetime import datetime

import httpx
import openai
import pytest

from switchyard.proto.peer_pages import MAC_HEADER, PEER_PAGES_PATH
from switchyard.proto.status import read_status
from switchyard.testing.group import ServerGroup, free_port, peer_pair, start_all, stop_all
from switchyard.testing.workload import text, wait_written

P = 16
DEADLINE_S = 2.0
TIMEOUT_S = 120.0


def peers(model, *, extra=()) -> list[ServerGroup]:
    return peer_pair(model, ctx=4096, extra=("--page-size", str(P), "--peer-fetch-timeout-s",
                                             str(DEADLINE_S), *extra))


@pytest.fixture(scope="module")
def pair(tiny_qwen3):
    groups = peers(tiny_qwen3)
    try:
        start_all(groups)
        yield groups
    finally:
        stop_all(groups)


def chat(group: ServerGroup, messages, **extra):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as client:
        return client.chat.completions.create(model=client.models.list().data[0].id,
                                              messages=messages, max_tokens=4, temperature=0,
                                              extra_body=extra or None)



def two_turns(first: ServerGroup, second: ServerGroup, seed: int, **extra):
    """Turn 1 on `first`, turn 2 (the history plus a new message) on `second` once the first
    turn's pages are on `first`'s disk."""
    messages = [{"role": "system", "content": text(seed, 120)},
                {"role": "user", "content": text(seed + 1, 60)}]
    one = chat(first, messages, **extra)
    wait_written(first, one.usage.prompt_tokens // P, time.time())
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": text(seed + 2, 20)}]
    return one, chat(second, messages, **extra)


def peer_counts(group: ServerGroup, url: str, num_asks: int, timeout_s: float = 30.0):
    """The status's counts of peer `url`, once they count `num_asks` asks (the status is
    rewritten every heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = read_status(group.runtime_dir / "status.json")
        counts = {p.url: p for p in status.peer_servers} if status is not None else {}
        if url in counts and counts[url].num_asks >= num_asks:
            return counts[url]
        assert time.monotonic() < deadline, counts
        time.sleep(0.1)


def test_a_turn_on_the_other_server_restores_from_its_peer(pair):
    a, b = pair
    one, two = two_turns(a, b, seed=101)
    new = two.usage.prompt_tokens - one.usage.prompt_tokens
    prefilled = two.usage.prompt_tokens - two.usage.prompt_tokens_details.cached_tokens
    assert prefilled <= new + P, (one.usage, two.usage)
    fetched = b.wait_events("peer.pages", role="scheduler")
    assert fetched and fetched[-1]["num_pages"] >= one.usage.prompt_tokens // P - 1, fetched
    assert a.wait_events("peer.served", role="kvstore")
    counts = peer_counts(b, a.url, 1)
    assert counts.num_pages >= fetched[-1]["num_pages"] and counts.num_bytes > 0


def test_another_salt_gets_nothing_of_a_conversation(pair):
    """The same conversation under another cache salt: its ids are another chain's, and the
    peer holds none of it; all of it is prefilled."""
    a, b = pair
    messages = [{"role": "system", "content": text(202, 120)},
                {"role": "user", "content": text(203, 60)}]
    chat(a, messages, cache_salt="alice")
    other = chat(b, messages, cache_salt="mallory")
    assert other.usage.prompt_tokens_details.cached_tokens == 0, other.usage


def test_an_ask_without_the_peer_key_is_refused(pair):
    a, _ = pair
    reply = httpx.post(a.url + PEER_PAGES_PATH, content=b"\x80", headers={MAC_HEADER: "00" * 16})
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "peer_refused"
    assert httpx.post(a.url + PEER_PAGES_PATH, content=b"").status_code == 403


def test_a_silent_or_gone_peer_costs_at_most_the_deadline(tiny_qwen3):
    """One peer accepts the connection and never answers (a socket nobody reads), another is
    gone (nothing listens): the request waits at most the deadline for them, prefills, and
    answers; each is counted as a failure."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nobody ever reads them
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        gone_url = f"http://127.0.0.1:{free_port()}"
        with ServerGroup(tiny_qwen3, slots=1, ctx=4096,
                         extra=("--page-size", str(P), "--peer", silent_url, "--peer", gone_url,
                                "--peer-fetch-timeout-s", str(DEADLINE_S))) as group:
            reply = chat(group, [{"role": "user", "content": text(301, 200)}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            asked = group.wait_events("peer.asked", role="scheduler")
            answered = group.wait_events("peer.pages", role="scheduler")
            assert answered and answered[-1]["num_pages"] == 0, answered
            assert answered[-1]["num_failures"] == 2, answered
            waited = _seconds(answered[-1]) - _seconds(asked[-1])
            assert waited < DEADLINE_S + 1.0, waited  # the deadline, and the answer's way back
            assert peer_counts(group, silent_url, 1).last_error.startswith("no answer within")
            assert peer_counts(group, gone_url, 1).num_failures == 1


def _seconds(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
