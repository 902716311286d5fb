"""Structured outputs end to end: the tiny random model's output always validates when a schema
constrains it, through the official `openai` and `anthropic` clients, streamed and not; strict
tool calls parse and match their schemas; bad schemas are 400s in each API's format."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

from tests.helpers.schemas import random_object_schema, random_schema

TIMEOUT_S = 300.0
MAX_TOKENS = 400  # far above what any generated schema's instance needs
NUM_SCHEMAS = 70  # per API (tests/unit/test_structured_outputs.py runs 200 without a model)
MODEL = "tiny-qwen3"  # the served id: the model directory's name (conftest's tiny_qwen3)


@pytest.fixture(scope="module")
def oa(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def an(group):
    with anthropic.Anthropic(base_url=group.url, api_key="none", timeout=TIMEOUT_S,
                             max_retries=0) as c:
        yield c


def _chat(oa, schema, stream: bool, seed: int) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": True}}
    messages = [{"role": "user", "content": f"Answer {seed} in JSON."}]
    if not stream:
        reply = oa.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content
    chunks = oa.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                        max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _responses(oa, schema, stream: bool, seed: int) -> str:
    fmt = {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}
    if not stream:
        return oa.responses.create(model=MODEL, input=f"JSON {seed}", text=fmt,
                                   max_output_tokens=MAX_TOKENS, temperature=0).output_text
    text = ""
    for event in oa.responses.create(model=MODEL, input=f"JSON {seed}", text=fmt,
                                     max_output_tokens=MAX_TOKENS, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
    return text


def _messages(an, schema, stream: bool, seed: int) -> str:
    extra = {"output_format": {"type": "json_schema", "schema": schema}}
    messages = [{"role": "user", "content": f"JSON {seed}"}]
    if not stream:
        reply = an.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                   extra_body=extra)
        return "".join(b.text for b in reply.content if b.type == "text")
    with an.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                            extra_body=extra) as s:
        return "".join(s.text_stream)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_random_schemas_always_validate(oa, an, api):
    call = {"chat": lambda s, st, i: _chat(oa, s, st, i),
            "responses": lambda s, st, i: _responses(oa, s, st, i),
            "messages": lambda s, st, i: _messages(an, s, st, i)}[api]
    rng = random.Random({"chat": 1, "responses": 2, "messages": 3}[api])
    schemas = [random_object_schema(rng) if i % 3 else random_schema(rng)
               for i in range(NUM_SCHEMAS)]

    def one(i: int):
        text = call(schemas[i], i % 2 == 1, i)
        jsonschema.validate(json.loads(text), schemas[i])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(NUM_SCHEMAS)))


WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "strict": True,
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["UTC", "CET"]}},
                                               "required": ["zone"],
                                               "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_strict_calls_validate(oa, choice, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": f"weather {seed}"}],
                      tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0,
                      seed=seed)
        if stream:
            calls: dict[int, dict] = {}
            for chunk in oa.chat.completions.create(stream=True, **kwargs):
                for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
            found = list(calls.values())
        else:
            reply = oa.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "tool_calls"
            found = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in reply.choices[0].message.tool_calls]
        assert found
        for call in found:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
            if isinstance(choice, dict):
                assert call["name"] == "get_weather"


def test_strict_anthropic_tool_use_validates(an):
    tools = [{"name": "get_weather", "input_schema": WEATHER, "strict": True}]
    for seed in range(3):
        reply = an.messages.create(model=MODEL, max_tokens=MAX_TOKENS, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": f"w {seed}"}])
        [use] = [b for b in reply.content if b.type == "tool_use"]
        jsonschema.validate(use.input, WEATHER)


def test_guided_choice_and_regex(oa):
    for seed in range(3):
        reply = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": str(seed)}], max_tokens=50,
            extra_body={"guided_choice": ["positive", "negative"]}, seed=seed)
        assert reply.choices[0].message.content in ("positive", "negative")
        reply = oa.completions.create(model=MODEL, prompt=f"code {seed}:", max_tokens=50,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
        text = reply.choices[0].text
        assert len(text) == 6 and text[3] == "-" and text[:3].isupper() and text[4:].isdigit()


def test_bad_schemas_are_400s_in_each_apis_format(oa, an):
    bad = {"type": "object", "$dynamicRef": "#x"}
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    assert "$dynamicRef" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(model=MODEL, input="x",
                            text={"format": {"type": "json_schema", "name": "b", "schema": bad}})
    with pytest.raises(anthropic.BadRequestError) as caught:
        an.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}],
                           extra_body={"output_format": {"type": "json_schema", "schema": bad}})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    # Nothing stored was lost: the server answers the next request.
    assert oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=2).choices


def test_a_forced_call_cut_by_max_tokens_says_length(oa, an):
    """A forced strict call the token limit cuts is never a complete call
    with `{}`: "length" (Anthropic: max_tokens, Responses: incomplete) and the partial
    arguments, as far as the model wrote them."""
    edit = {"type": "object", "properties": {"path": {"type": "string"},
                                             "line": {"type": "integer"}},
            "required": ["path", "line"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "edit", "strict": True, "parameters": edit}}
    reply = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "edit"}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "edit"}}, max_tokens=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "edit" and call.function.arguments.startswith("{")
    assert call.function.arguments != "{}"
    response = oa.responses.create(
        model=MODEL, input="edit", max_output_tokens=3, tool_choice={"type": "function",
                                                                     "name": "edit"},
        tools=[{"type": "function", "name": "edit", "strict": True, "parameters": edit}])
    assert response.status == "incomplete"
    (item,) = [i for i in response.output if i.type == "function_call"]
    assert item.status == "incomplete" and item.arguments.startswith("{")
    message = an.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "edit"}],
        tools=[{"name": "edit", "input_schema": edit, "strict": True}],
        tool_choice={"type": "tool", "name": "edit"})
    assert message.stop_reason == "max_tokens"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "edit" and set(use.input) <= {"path"}  # never a member half written
