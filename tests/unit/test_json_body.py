"""Large JSON bodies parse without holding the event loop, their top-level lists bounded
(gateway/api/json_body.py)."""

import asyncio
import json
import time

import pytest

from switchyard.gateway.api.json_body import COOPERATIVE_BYTES, ListLimit, parse_body
from switchyard.gateway.errors import APIError

BODY = {"model": "m", "messages": [{"role": "user", "content": f"message {i} \u00e9\U0001f99c"}
                                   for i in range(20_000)],
        "tools": [], "nested": {"a": [1, 2.5, None, True, "x"]}, "empty": {}, "s": "\\n"}


def parse(raw: bytes, limits=None, max_values: int = 10**7):
    return asyncio.run(parse_body(raw, limits or {}, max_values))


def test_a_large_body_parses_as_json_loads_does():
    raw = json.dumps(BODY, ensure_ascii=False, indent=1).encode()
    assert len(raw) > COOPERATIVE_BYTES
    assert parse(raw) == BODY
    assert parse(json.dumps(BODY).encode()) == BODY


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"a": 1} x', b'{"a": 1,}', b'{"a" 1}', b"{",
                                 b'{"a": NaN}', b'{"a": "\xed\xa0\x80"}', b'{"a": "\\ud800"}',
                                 b'{1: 2}'])
def test_what_is_not_a_json_object_is_a_400_however_large(raw):
    padded = raw[:-1] + b" " * COOPERATIVE_BYTES + raw[-1:] if raw.endswith(b"}") else raw
    for body in (raw, padded):
        with pytest.raises(APIError) as caught:
            parse(body)
        assert caught.value.status == 400 and caught.value.code == "invalid_json"


def test_a_list_past_its_limit_is_refused_at_the_limit():
    raw = json.dumps({"messages": [{}] * 200_000}).encode()
    started = time.perf_counter()
    with pytest.raises(APIError) as caught:
        parse(raw, {"messages": ListLimit(100, "too many", "context_length_exceeded")})
    assert caught.value.param == "messages" and caught.value.code == "context_length_exceeded"
    small = json.dumps({"messages": [{}] * 101}).encode()
    with pytest.raises(APIError):
        parse(small, {"messages": ListLimit(100, "too many")})
    assert time.perf_counter() - started < 60  # (a bound for a hung parse, not a benchmark)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": ""}] * 300_000},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 300_000}]}],
    ids=["many messages", "one message, many parts"])
def test_the_event_loop_runs_while_a_large_body_parses(body):
    raw = json.dumps(body).encode()

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        before = ticks
        parsed = await parse_body(raw, {}, 10**7)
        ticker.cancel()
        return parsed, ticks - before

    result, ticks = asyncio.run(main())
    assert result == body and ticks > 1


def test_a_messages_content_parts_are_bounded_too():
    from switchyard.gateway.api.json_body import chat_limits

    raw = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}] * 50_000}]}).encode()
    with pytest.raises(APIError) as caught:
        parse(raw, chat_limits(1000))
    assert caught.value.param == "content" and caught.value.code == "context_length_exceeded"
    fine = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 10}] * 30_000}).encode()
    assert len(parse(fine, chat_limits(40_000))["messages"]) == 30_000


def test_messages_are_bounded_by_the_fewest_tokens_one_costs():
    from switchyard.gateway.api.json_body import chat_limits

    def body(count: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": ""}] * count}).encode()

    with pytest.raises(APIError) as caught:
        parse(body(201), chat_limits(1000, message_tokens=5))
    assert caught.value.param == "messages" and "at least 5 tokens" in caught.value.message
    assert len(parse(body(200), chat_limits(1000, message_tokens=5))["messages"]) == 200


def _peak_bytes_parsing(raw: bytes) -> tuple[int, Exception | None]:
    import tracemalloc

    from switchyard.gateway.api.json_body import MIN_VALUE_BUDGET

    tracemalloc.start()
    try:
        parse(raw, max_values=MIN_VALUE_BUDGET)
        outcome = None
    except APIError as exc:
        outcome = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, outcome


def test_a_body_of_nested_arrays_costs_no_more_than_a_string_of_its_size():
    """`"metadata": [[],[],...]`: 30 MiB grew the gateway by 775 MiB, a 30 MiB string by 30."""
    size = 30 << 20
    head = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": '
    count = (size - len(head)) // 3
    nested = head + b"[" + b"[]," * (count - 1) + b"[]]}"
    string = head + b'"' + b"x" * (size - len(head) - 3) + b'"}'
    string_peak, outcome = _peak_bytes_parsing(string)
    assert outcome is None
    nested_peak, outcome = _peak_bytes_parsing(nested)
    assert outcome is not None and (outcome.status, outcome.code) == (413, "request_too_large")
    assert nested_peak <= string_peak, (nested_peak >> 20, string_peak >> 20)


def test_values_are_counted_at_every_depth_and_nesting_is_bounded():
    from switchyard.gateway.api.json_body import MAX_NESTING, value_budget

    pad = " " * COOPERATIVE_BYTES
    deep = ("[" * 6 + ",".join(["[]"] * 5_000) + "]" * 6).encode()  # below the first levels
    with pytest.raises(APIError) as caught:
        parse(b'{"tools": ' + deep + pad.encode() + b"}", max_values=4_000)
    assert caught.value.status == 413
    too_deep = b'{"a": ' + b"[" * (MAX_NESTING + 1) + pad.encode() + b"]" * (MAX_NESTING + 1) + b"}"
    with pytest.raises(APIError) as caught:
        parse(too_deep)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")
    ids = json.dumps({"prompt": list(range(100_000, 232_768))}).encode()  # a context of ids
    assert len(parse(ids, max_values=value_budget(131_072))["prompt"]) == 132_768
