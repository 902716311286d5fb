"""Scripted replies (`--script`) on every API, streamed or not, through the official clients:
the rule's words come out as the text and the parsed tool call, with each API's own shapes,
while a request no rule holds for is answered by the model itself."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from switchyard.testing.group import ServerGroup

SAY = "Checking the weather."
CITY = {"city": "Paris"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
SCRIPT = {"rules": [
    {"when": {"last": "weather in Paris", "tools": ["get_weather"], "system": "forecaster"},
     "say": SAY, "calls": [{"name": "get_weather", "arguments": CITY}]},
    {"when": {"last": "(?m)^Sunny, 21 C$"}, "say": "It is sunny in Paris."},
    {"when": {"last": "Complete the scripted line"}, "say": "scripted line done"},
]}
SYSTEM = "You are a forecaster."
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def group(tiny_qwen3, tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with ServerGroup(tiny_qwen3, slots=4, ctx=4096, extra=("--script", str(script))) as running:
        yield running


@pytest.fixture(scope="module")
def client(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(group):
    with anthropic.Anthropic(base_url=group.url, api_key="none", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_chat_says_and_calls_then_answers_the_result(client, stream):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    if stream:
        text, calls = "", {}
        for chunk in client.chat.completions.create(model="tiny-qwen3", messages=messages,
                                                    tools=[WEATHER], stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            text += (delta.content or "") if delta else ""
            for call in (delta.tool_calls or []) if delta else []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        (call,) = calls.values()
    else:
        reply = client.chat.completions.create(model="tiny-qwen3", messages=messages,
                                               tools=[WEATHER])
        assert reply.choices[0].finish_reason == "tool_calls"
        text = reply.choices[0].message.content or ""
        (raw,) = reply.choices[0].message.tool_calls
        call = {"id": raw.id, "name": raw.function.name, "arguments": raw.function.arguments}
    assert text.strip() == SAY
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == CITY
    messages += [{"role": "assistant", "content": text, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(model="tiny-qwen3", messages=messages,
                                            tools=[WEATHER])
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_says_and_calls(claude, stream):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    kwargs = dict(model="tiny-qwen3", max_tokens=200, system=SYSTEM, tools=tools,
                  messages=[{"role": "user", "content": ASK}])
    if stream:
        with claude.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.text.strip() == SAY
    assert use.name == "get_weather" and use.input == CITY


@pytest.mark.parametrize("stream", [False, True])
def test_responses_says_and_calls(client, stream):
    kwargs = dict(model="tiny-qwen3", instructions=SYSTEM, input=ASK, tools=[
        {"type": "function", "name": "get_weather",
         "parameters": WEATHER["function"]["parameters"]}])
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    message, call = response.output
    assert message.content[0].text.strip() == SAY
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == CITY


def test_completions_and_a_request_no_rule_holds_for(client):
    scripted = client.completions.create(model="tiny-qwen3", max_tokens=50,
                                         prompt="Complete the scripted line:")
    assert scripted.choices[0].text == "scripted line done"
    assert scripted.choices[0].finish_reason == "stop"
    own = client.chat.completions.create(model="tiny-qwen3", max_tokens=8, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}])  # no system: no rule
    assert own.choices[0].message.content != SAY
