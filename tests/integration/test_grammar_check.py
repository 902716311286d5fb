"""Grammars are checked in a child process, within a time bound, abandoned with their client
(gateway/request/grammar_check.py)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from switchyard.gateway.errors import APIError
from switchyard.gateway.request import structured
from switchyard.gateway.request.grammar_check import GrammarChecker


def pattern_bomb(num_patterns: int) -> dict:
    """The reported payload: validation cost grows steeply with the patterns (600: 105 s)."""
    return {"type": "object", "additionalProperties": False, "patternProperties": {
        f"^p{i}_[a-z]+[0-9]*$": {"type": "integer"} for i in range(num_patterns)}}


def test_valid_invalid_and_cached():
    async def main():
        checker = GrammarChecker(num_children=1)
        try:
            await checker.check(structured.json_schema({"type": "object"}, "response_format"))
            with pytest.raises(APIError) as caught:
                await checker.check(structured.json_schema(
                    {"type": "object", "$dynamicRef": "#x"}, "response_format"))
            assert caught.value.param == "response_format" and "$dynamicRef" in \
                caught.value.message
            with pytest.raises(APIError):  # cached: no child is asked again
                checker._idle.clear()
                checker._slots = None
                await checker.check(structured.json_schema(
                    {"type": "object", "$dynamicRef": "#x"}, "response_format"))
        finally:
            await checker.aclose()

    asyncio.run(main())


def test_a_schema_bomb_is_refused_within_the_bound_and_the_next_check_works():
    async def main():
        checker = GrammarChecker(num_children=1, cpu_s=1.0)
        try:
            bomb = structured.json_schema(pattern_bomb(450), "response_format")
            started = time.monotonic()
            with pytest.raises(APIError) as caught:
                await checker.check(bomb)
            took = time.monotonic() - started
            assert "too complex" in caught.value.message and "of CPU" in caught.value.message
            assert checker.num_killed == 1
            with pytest.raises(APIError):  # the refusal is remembered: no second try
                await checker.check(bomb)
            assert checker.num_killed == 1
            await checker.check(structured.choice(["a", "b"], "guided_choice"))
            return took
        finally:
            await checker.aclose()

    assert asyncio.run(main()) < 60  # (a bound for a hung check, not a benchmark)


def test_a_check_whose_client_left_stops_its_child():
    async def main():
        checker = GrammarChecker(num_children=1, cpu_s=60.0)
        try:
            task = asyncio.ensure_future(checker.check(
                structured.json_schema(pattern_bomb(600), "response_format")))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert checker.num_killed == 1
            await checker.check(structured.json_schema({"type": "integer"}, "p"))
        finally:
            await checker.aclose()

    asyncio.run(main())



def test_a_check_the_machine_gives_no_cpu_is_a_503_and_not_remembered():
    """The wall-time backstop: a check still running after `timeout_s` (here a bomb with CPU
    to spare, standing for a machine too busy to run the child) is a 503 with Retry-After,
    not a refusal of the grammar."""
    async def main():
        checker = GrammarChecker(num_children=1, cpu_s=60.0, timeout_s=0.5)
        try:
            bomb = structured.json_schema(pattern_bomb(600), "response_format")
            with pytest.raises(APIError) as caught:
                await checker.check(bomb)
            assert caught.value.status == 503 and caught.value.headers["Retry-After"] == "5"
            assert not checker._results, "a busy machine's answer is not remembered"
        finally:
            await checker.aclose()

    asyncio.run(main())


def test_the_child_runs_at_the_lowest_priority():
    async def main():
        checker = GrammarChecker(num_children=1)
        try:
            await checker.warm()
            [child] = checker._idle[:1]
            return os.getpriority(os.PRIO_PROCESS, child.process.pid)
        finally:
            await checker.aclose()

    assert asyncio.run(main()) == 19
