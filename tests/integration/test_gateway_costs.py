"""What one client can cost the gateway and the other tenants: the memory of a request body,
and the Responses store. The real app under uvicorn against the scripted fake scheduler of
test_gateway (loopback)."""

from __future__ import annotations

import json
import resource
import socket

import httpx
import pytest

from switchyard.gateway.http_limits import LARGE_BODY_BYTES, MAX_LARGE_BODIES
from switchyard.common.tenants import resolved_keys

from tests.integration.test_gateway import CHAT, JSON_TYPE, assert_error, wait_until

from tests.integration.test_gateway_security import (  # noqa: F401  (module-scoped fixtures)
    fake, make_settings, runtime_dir, serving, tokenizer)

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


@pytest.fixture(scope="module")
def two_keys(runtime_dir, tokenizer, fake):
    keys = resolved_keys("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    with serving(make_settings(runtime_dir, api_key=keys, max_stored_responses=8),
                 tokenizer) as pair:
        yield pair


def client_of(url: str, name: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=20,
                        headers={"Authorization": f"Bearer {KEYS[name]}"})


def respond(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/responses", json={"max_output_tokens": 4, "input": "hi", **fields})


def test_one_key_cannot_evict_anothers_responses(two_keys):
    url = two_keys[0]
    with client_of(url, "alice") as alice, client_of(url, "bob") as bob:
        first = respond(alice)
        assert first.status_code == 200, first.text
        kept = first.json()["id"]
        for _ in range(30):  # many times the store's bound
            assert respond(bob).status_code == 200
        follow = respond(alice, previous_response_id=kept, input="go on")
        assert follow.status_code == 200, follow.text
        # another key's response id is not found, as if it did not exist
        stolen = respond(bob, previous_response_id=kept)
        assert stolen.status_code == 400
        assert stolen.json()["error"]["code"] == "previous_response_not_found"
        # a key's own responses still go in its own least-recently-used order
        ids = [respond(alice).json()["id"] for _ in range(6)]
        assert respond(alice, previous_response_id=ids[-1]).status_code == 200
        assert respond(alice, previous_response_id=kept).status_code == 400  # its share is 4


# -- a body costs the gateway about its size, however it is written ------------------------------

ROUTES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
          "/v1/completions": {"prompt": "hi"},
          "/v1/responses": {"input": "hi"},
          "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}


def nested_arrays_body(fields: dict, size: int) -> bytes:
    """`fields` and an ignored `metadata` of empty arrays, `size` bytes in all."""
    head = json.dumps(fields)[:-1].encode() + b', "metadata": '
    count = (size - len(head)) // 3
    return head + b"[" + b"[]," * (count - 1) + b"[]]}"


@pytest.fixture(scope="module")
def large_bodies(runtime_dir, tokenizer, fake):
    with serving(make_settings(runtime_dir, max_body_bytes=32 << 20), tokenizer) as pair:
        yield pair


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_body_of_nested_arrays_is_refused_at_its_cost(large_bodies, fake, path):
    """The audit's 30 MiB `"metadata": [[],[],...]` was answered 200 and grew the gateway by
    640-780 MiB each: now a 413 in the API's format, the process growing far less."""
    url = large_bodies[0]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    body = nested_arrays_body(ROUTES[path], 30 << 20)
    response = httpx.post(url + path, content=body, headers=JSON_TYPE, timeout=60)
    del body
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert response.status_code == 413, response.text[:300]
    if path.startswith("/v1/messages"):
        assert response.json()["error"]["type"] == "request_too_large"
    else:
        assert response.json()["error"]["code"] == "request_too_large"
    assert grown_mib < 200, grown_mib  # the client's copies of the body included
    ok = httpx.post(url + path, json=ROUTES[path], timeout=20)
    assert ok.status_code == 200, ok.text


def test_large_bodies_held_at_once_are_bounded(runtime_dir, tokenizer, fake):
    """Four bodies of --max-body-bytes at once; a fifth large one is a 503 with Retry-After,
    small ones go on, and a body's share comes back when its request ends."""
    limit = 1 << 20
    with serving(make_settings(runtime_dir, max_body_bytes=limit), tokenizer) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        holders = []
        for _ in range(MAX_LARGE_BODIES):  # headers and part of a body: held, not finished
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
                         % limit)
            holders.append(sock)
        bodies = app.state.gateway.bodies
        wait_until(lambda: bodies.held == MAX_LARGE_BODIES * limit)
        large = {"messages": [{"role": "user", "content": "x" * LARGE_BODY_BYTES}]}
        refused = httpx.post(url + "/v1/chat/completions", json=large, timeout=20)
        error = assert_error(refused, 503, "overloaded")
        assert "large request bodies" in error["message"]
        assert refused.headers["retry-after"] == "1"
        refused = httpx.post(url + "/v1/messages", json={"max_tokens": 4, **large}, timeout=20)
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "overloaded_error"
        small = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=20)
        assert small.status_code == 200, small.text
        for sock in holders:
            sock.close()
        wait_until(lambda: bodies.held == 0)
        assert httpx.post(url + "/v1/chat/completions", json=large,
                          timeout=20).status_code != 503
