"""The fuzz and abuse suite: each class of abusive request, generated, against one
live group while a well-behaved client chats beside it. Every abusive request gets a bounded
answer (a 4xx, or a normal reply; a request abandoned by its client gets none), and the
well-behaved client gets the same correct reply throughout. Sizes are small for CI;
bench/abuse.py runs the full sizes and measures the times and memory."""

from __future__ import annotations

import pytest

from switchyard.testing.abuse import (
    WellBehaved,
    disconnect_storm,
    huge_tools,
    many_messages,
    raw_bytes,
    schema_blowups,
    template_bombs,
)

CLASSES = {
    "template bombs": lambda: template_bombs(),
    "schema blow-ups": lambda: schema_blowups(patterns=(450,)),
    "huge tool lists": lambda: huge_tools(),
    "many messages": lambda: many_messages(count=20_000),
    "raw-byte encodings": lambda: raw_bytes(),
    "disconnect storms": lambda: disconnect_storm(count=2, size=1_000_000),
}


@pytest.fixture(scope="module")
def neighbour(group):
    with WellBehaved(group.url, every_s=0.3) as client:
        yield client
    assert client.wrong == []  # every reply the well-behaved client got was the right one
    assert len(client.ttfts) >= 2


@pytest.mark.parametrize("name", list(CLASSES))
def test_abusive_requests_get_bounded_answers_beside_a_neighbour(group, neighbour, name):
    seen_before = len(neighbour.ttfts)
    for payload in CLASSES[name]():
        status = payload.send(group.url, timeout_s=120)
        if status is None:
            continue  # abandoned by its client: no answer to read
        assert 200 <= status < 500, (payload.name, status)
        if payload.refused:
            assert 400 <= status < 500, (payload.name, status)
    assert neighbour.replied_beyond(seen_before)  # served on, after all of it
    assert neighbour.wrong == [], neighbour.wrong
    log = group.log_text()
    assert '"request.crashed"' not in log and '"worker.lost"' not in log
