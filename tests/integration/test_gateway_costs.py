"""What one client can cost the gateway and the other tenants: the memory of a request body,
and the Responses store. The real app under uvicorn against the scripted fake scheduler of
test_gateway (loopback)."""

from __future__ import annotations

import httpx
import pytest

from switchyard.proto.tenants import resolved_keys

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
