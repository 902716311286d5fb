"""msgspec's validation messages, word for word, as gateway/request/wire/decoding.py reads them.

msgspec gives a failure's kind and path only as English text, and decoding.py turns that text
into each API's 400. pyproject.toml holds msgspec to one minor release; a release that words a
message otherwise fails here first, before users see other errors."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta


class First(msgspec.Struct, tag_field="type", tag="first"):
    x: int


class Second(msgspec.Struct, tag_field="type", tag="second"):
    y: int


class Body(msgspec.Struct):
    number: int = 0
    text: Annotated[str, Meta(min_length=1)] = "x"
    numbers: list[int] = []
    choice: Literal["p", "q"] = "p"
    items: list[First | Second] = []
    ids: dict[Annotated[str, Meta(pattern="^[0-9]+$")], int] = {}


@pytest.mark.parametrize("body, message", [
    ({"number": "5"}, "Expected `int`, got `str` - at `$.number`"),
    ({"numbers": [1, "2"]}, "Expected `int`, got `str` - at `$.numbers[1]`"),
    ({"text": ""}, "Expected `str` of length >= 1 - at `$.text`"),
    ({"choice": "z"}, "Invalid enum value 'z' - at `$.choice`"),
    ({"items": [{"type": "third"}]}, "Invalid value 'third' - at `$.items[0].type`"),
    ({"items": [{"type": "first"}]}, "Object missing required field `x` - at `$.items[0]`"),
    ({"ids": {"k": 1}}, "Expected `str` matching regex '^[0-9]+$' - at `key` in `$.ids`"),
])
def test_msgspec_words_its_failures_as_decoding_reads_them(body, message):
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert(body, Body, strict=True)
    assert str(caught.value) == message


def test_the_forms_decoding_reads_match_these_words():
    from switchyard.gateway.request.wire import decoding

    assert decoding._AT.search(" - at `key` in `$.ids`").group(1)
    assert decoding._AT.search(" - at `$.items[0].type`").group(2) == ".items[0].type"
    assert decoding._WRONG_TYPE.match("Expected `int`, got `str`").groups() == ("int", "str")
    assert decoding._BOUND.match("Expected `str` of length >= 1").groups() == (
        "str", "of length >= 1")
