"""Each API's request model (gateway/request/wire/) is the one statement of its shape: the field
table of docs/clients.md names exactly its fields, the models' own checks run, and /openapi.json is made
from them (its truth against the live server: tests/integration/test_openapi_schemathesis.py)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from switchyard.gateway.api.openapi import openapi_spec
from switchyard.gateway.request.wire import anthropic, openai, responses
from switchyard.gateway.request.wire.base import Checked, Model, checked_fields, hints, members

REPO = Path(__file__).resolve().parents[2]
MODELS = {"Messages": anthropic.MessagesRequest, "Chat": openai.ChatCompletionRequest,
          "Completions": openai.CompletionRequest, "Responses": responses.ResponsesRequest}


def field_table_rows() -> list[tuple[list[str], list[str]]]:
    """(APIs, backquoted names in the field column) of each row of docs/clients.md's field table."""
    doc = (REPO / "docs" / "clients.md").read_text()
    table = doc[doc.index("## What agent clients send"):]
    table = table[table.index("| API |"):]
    table = table[:table.index("\n\n")]
    rows = []
    for line in table.splitlines()[2:]:
        api, field, _ = (cell.strip() for cell in line.strip("|").split("|", 2))
        apis = list(MODELS) if api == "all" else [a.strip() for a in api.split(",")]
        rows.append((apis, re.findall(r"`([^`]+)`", field)))
    return rows


def _structs(tp: typing.Any) -> list[type]:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    out = []
    for member in members(tp):
        while typing.get_origin(member) is typing.Annotated:
            member = typing.get_args(member)[0]
        if isinstance(member, type) and issubclass(member, msgspec.Struct):
            out.append(member)
    return out


def declares(model: type, path: str) -> bool:
    """Whether `model` has the member `path` (`field` or `field.member`)."""
    structs = [model]
    for name in path.split("."):
        found = [s for s in structs if name in s.__struct_fields__]
        if not found:
            return False
        structs = [t for s in found for t in _structs(hints(s)[name])]
    return True


def test_every_field_of_every_model_is_in_the_field_table():
    rows = field_table_rows()
    assert {api for apis, _ in rows for api in apis} == set(MODELS)
    for api, model in MODELS.items():
        named = {n.split(".")[0] for apis, names in rows if api in apis for n in names}
        missing = sorted(set(model.__struct_fields__) - named)
        assert not missing, f"docs/clients.md's field table has no row for {api}'s {missing}"


def test_every_name_in_the_field_table_is_a_field():
    for apis, names in field_table_rows():
        assert names, apis
        for name in names:
            assert any(declares(MODELS[api], name) for api in apis), \
                f"docs/clients.md's field table names `{name}` for {apis}: no such field"


def test_the_field_table_check_can_fail():
    assert declares(anthropic.MessagesRequest, "output_config.effort")
    assert declares(anthropic.MessagesRequest, "thinking.budget_tokens")
    assert not declares(anthropic.MessagesRequest, "output_config.colour")
    assert not declares(openai.CompletionRequest, "messages")


def _models() -> list[type]:
    found, stack = [], [Model]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("model", _models(), ids=lambda m: f"{m.__module__}.{m.__name__}")
def test_a_model_with_integer_or_unsupported_members_checks_them(model):
    """integer() and unsupported() are checked in Checked.__post_init__; only models that
    derive from it pay for one."""
    if checked_fields(model):
        assert issubclass(model, Checked)


def test_limits_are_stated_once_in_the_models_and_published():
    """MAX_STOP and the sampling ranges come from the models into /openapi.json."""
    from switchyard.gateway.request.wire.common import MAX_STOP

    paths = openapi_spec("m")["paths"]

    def schema(path):
        return paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    stop = schema("/v1/chat/completions")["properties"]["stop"]
    assert {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP} \
        in stop["anyOf"][0]["anyOf"]
    sequences = schema("/v1/messages")["properties"]["stop_sequences"]["anyOf"][0]
    assert sequences["maxItems"] == MAX_STOP
    top_k = schema("/v1/messages")["properties"]["top_k"]["anyOf"][0]
    assert (top_k["type"], top_k["minimum"], top_k["maximum"]) == ("integer", 0, 2**31 - 1)


# --- decoding: each API's 400 names the field --------------------------------------------------


def _anthropic(**fields):
    from switchyard.gateway.api.anthropic_api import parse_messages_request

    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return parse_messages_request(body | fields).chat


def _responses(**fields):
    from switchyard.gateway.api.responses_api import parse_responses_request
    from switchyard.gateway.request.response_store import ResponseStore

    return parse_responses_request({"input": "hi"} | fields, ResponseStore(4)).chat


def _refused(fn, **fields):
    from switchyard.gateway.errors import APIError

    with pytest.raises(APIError) as caught:
        fn(**fields)
    assert caught.value.status == 400 and caught.value.param in caught.value.message
    return caught.value


@pytest.mark.parametrize("parse,field", [(_anthropic, "max_tokens"), (_anthropic, "top_k"),
                                         (_responses, "max_output_tokens")])
def test_an_integral_number_is_an_integer_and_a_string_is_not(parse, field):
    assert isinstance(getattr(parse(**{field: 5.0}).options, field.replace(
        "max_output_tokens", "max_tokens")), int)
    for value in ("5", 5.5, True):
        error = _refused(parse, **{field: value})
        assert (error.param, error.code) == (field, "invalid_type")


def test_a_nested_400_names_the_path_in_each_apis_terms():
    error = _refused(_anthropic, messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": [{"type": "text", "text": "a"},
                                         {"type": "tool_result", "tool_use_id": "t"}]}])
    assert error.param == "messages[1].content[1].type"
    assert "'text', 'thinking', 'redacted_thinking' or 'tool_use'" in error.message
    assert error.anthropic_body()["error"]["message"] == error.message
    error = _refused(_responses, input=[{"type": "function_call", "call_id": "c1",
                                          "name": ""}])
    assert (error.param, error.code) == ("input[0].name", "invalid_value")
    error = _refused(_responses, input=[{"type": "function_call", "call_id": "c1"}])
    assert (error.param, error.code) == ("input[0].name", "missing_required_parameter")


def test_unknown_members_are_ignored_at_every_depth_and_known_ones_checked():
    chat = _anthropic(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}, "x": [1]}]}])
    assert chat.messages == [{"role": "user", "content": "hi"}]
    assert _refused(_anthropic, temperature="hot").param == "temperature"


def test_a_block_without_its_type_is_refused_where_a_type_is_required():
    """msgspec reads a tagged struct's tag only among a union's members; a lone one is
    declared with its `type` as a member (the old checks refused such blocks too)."""
    for fields, param in (({"system": [{"text": "x"}]}, "system[0].type"),
                          ({"messages": [{"role": "system", "content": [{"text": "x"}]}]},
                           "messages[0].content[0].type"),
                          ({"output_format": {"schema": {}}}, "output_format.type")):
        assert _refused(_anthropic, **fields).param == param


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"5": "1"}, {"5": True}])
def test_a_bad_key_or_value_of_a_map_names_the_map(bias):
    from switchyard.gateway.api.openai_request import parse_chat_request

    error = _refused(lambda **f: parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}]} | f), logit_bias=bias)
    assert (error.param, error.code) == ("logit_bias", "invalid_value")
