"""The foundation end to end: real processes, the tiny qwen3 model, the official `openai` client.

One group per module (`group` from conftest: `--slots 4 --ctx 4096`). Every expectation is
computed independently of the server: prompt lengths with the model's own tokenizer and chat
template, concurrent outputs against the same server's solo greedy outputs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from switchyard.common.tokenizer_loading import load_tokenizer

TIMEOUT_S = 180.0  # the machine is shared and slow; nothing here asserts on time
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return load_tokenizer(str(tiny_qwen3))


@pytest.fixture(scope="module")
def model_id(tiny_qwen3):
    return tiny_qwen3.name


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Prompt tokens as the model's chat template renders and tokenizes them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def chat_prompt_len(tokenizer, messages) -> int:
    return len(chat_prompt_ids(tokenizer, messages))


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_usage(usage, prompt_tokens: int, finish_reason: str, max_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    if finish_reason == "length":
        assert usage.completion_tokens == max_tokens
    else:
        assert finish_reason == "stop"
        assert 0 <= usage.completion_tokens < max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < prompt_tokens


# --- models ----------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, model_id):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id


# --- chat: non-streamed and streamed, with usage ----------------------------------------------


MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three rivers and say why they matter."}]


def test_chat_non_streamed_has_text_and_exact_usage(client, tokenizer, model_id):
    reply = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                           max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model_id
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("length", "stop")
    check_usage(reply.usage, chat_prompt_len(tokenizer, MESSAGES), choice.finish_reason,
                MAX_TOKENS)


def test_chat_streamed_equals_non_streamed_and_ends_with_usage(client, tokenizer, model_id):
    plain = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                           max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(model=model_id, messages=MESSAGES,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "no chunks"
    *content_chunks, usage_chunk = chunks
    # The usage chunk comes last, with no choices; every other chunk has usage null.
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in content_chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    reasons = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert reasons == [plain.choices[0].finish_reason]
    assert content_chunks[-1].choices[0].finish_reason is not None
    assert text == plain.choices[0].message.content
    check_usage(usage_chunk.usage, chat_prompt_len(tokenizer, MESSAGES), reasons[0], MAX_TOKENS)
    assert usage_chunk.usage.completion_tokens == plain.usage.completion_tokens


def test_chat_streamed_without_include_usage_has_no_usage(client, model_id):
    chunks = list(client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=4, temperature=0, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


# --- text completions -------------------------------------------------------------------------


PROMPT = "The river flows past the old mill and"


def test_completion_with_string_and_token_id_prompts(client, tokenizer, model_id):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=MAX_TOKENS,
                                       temperature=0)
    for reply in (by_text, by_ids):
        assert reply.object == "text_completion" and reply.model == model_id
        assert reply.choices[0].text
        check_usage(reply.usage, len(ids), reply.choices[0].finish_reason, MAX_TOKENS)
    # The same prompt tokens, however given, produce the same greedy text.
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_streamed_with_usage(client, tokenizer, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    check_usage(usage_chunk.usage, len(tokenizer.encode(PROMPT)),
                text_chunks[-1].choices[0].finish_reason, MAX_TOKENS)


# --- concurrency ------------------------------------------------------------------------------


CONCURRENT_PROMPTS = [
    "Once upon a time in a small village",
    "def fibonacci(n):\n    if n < 2:",
    "The capital of the country is",
    "List of animals: dog, cat,",
    "Water boils at a temperature of",
    "My favourite music is played by",
]


def test_concurrent_requests_each_get_their_own_solo_output(client, model_id):
    """Six prompts on four slots at once (batched decode, queueing, slot reuse): each reply
    equals that prompt's greedy reply when it ran alone on the same server."""
    def complete(prompt: str):
        return client.completions.create(model=model_id, prompt=prompt, max_tokens=24,
                                         temperature=0)

    solo = [complete(p) for p in CONCURRENT_PROMPTS]
    assert len({r.choices[0].text for r in solo}) == len(CONCURRENT_PROMPTS), \
        "prompts must give different outputs or the test proves nothing"
    with ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as pool:
        together = list(pool.map(complete, CONCURRENT_PROMPTS))
    for prompt, alone, batched in zip(CONCURRENT_PROMPTS, solo, together):
        assert batched.choices[0].text == alone.choices[0].text, prompt
        assert batched.choices[0].finish_reason == alone.choices[0].finish_reason
        assert batched.usage.completion_tokens == alone.usage.completion_tokens
        assert batched.usage.prompt_tokens == alone.usage.prompt_tokens
    assert len({r.id for r in solo + together}) == 2 * len(CONCURRENT_PROMPTS)


def test_concurrent_streams_each_get_their_own_solo_output(client, model_id):
    def stream(prompt: str) -> str:
        chunks = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=16,
            temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    prompts = CONCURRENT_PROMPTS[:5]
    solo = [stream(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(stream, prompts))
    assert together == solo


# --- a second turn reuses the first ------------------------------------------------------------


def test_second_turn_reports_cached_prompt_tokens(client, tokenizer, model_id):
    """Turn 2 = turn 1's messages + the reply + a new question. By default the gateway renders
    the returned reply as the tokens the model generated (prefix-stable history), so all of
    turn 1, prompt and reply, is reused from the slot it left behind."""
    first_messages = [
        {"role": "system", "content": "You help plan trips along rivers. " * 8},
        {"role": "user", "content": "Where should I start a trip down the long river?"}]
    first = client.chat.completions.create(model=model_id, messages=first_messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
    first_ids = chat_prompt_ids(tokenizer, first_messages)
    assert first.usage.prompt_tokens == len(first_ids)
    second_messages = first_messages + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And where should I stop for the night?"}]
    second = client.chat.completions.create(model=model_id, messages=second_messages,
                                            max_tokens=MAX_TOKENS, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The slot holds turn 1's prompt and every generated token but the last one sampled.
    turn_one = len(first_ids) + first.usage.completion_tokens - 1
    assert turn_one <= cached < second.usage.prompt_tokens
    assert second.usage.prompt_tokens > len(first_ids) + first.usage.completion_tokens


def test_second_turn_rendered_by_the_template_alone_reuses_the_shared_prefix(
        client, tokenizer, model_id):
    """With prefix-stable rendering off for the request (`x-switchyard-prefix-stable: 0`), the
    prompt is exactly the chat template's rendering, and what it shares with turn 1 is reused."""
    plain = {"x-switchyard-prefix-stable": "0"}
    first_messages = [
        {"role": "system", "content": "You help plan walks in the mountains. " * 8},
        {"role": "user", "content": "Which hill should I climb first?"}]
    first = client.chat.completions.create(model=model_id, messages=first_messages,
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_headers=plain)
    first_ids = chat_prompt_ids(tokenizer, first_messages)
    assert first.usage.prompt_tokens == len(first_ids)
    second_messages = first_messages + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And where should I rest?"}]
    second = client.chat.completions.create(model=model_id, messages=second_messages,
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_headers=plain)
    second_ids = chat_prompt_ids(tokenizer, second_messages)
    assert second.usage.prompt_tokens == len(second_ids)
    cached = second.usage.prompt_tokens_details.cached_tokens
    shared = common_prefix_len(first_ids, second_ids)
    assert shared > 40  # the system prompt and first question at least
    assert shared <= cached < len(second_ids)


def test_health_reports_ok(group):
    response = httpx.get(group.url + "/health", timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
