"""Greedy output parity: Switchyard gives what mlx_lm gives, for the same model and prompt.

The reference is mlx_lm's own `generate_step` run in this process on `mlx_lm.load(model_dir)`,
cut at the first end token (the server stops there and does not count it). The gateway returns
text, not token ids, so the comparison is the reference tokens decoded with the same tokenizer
(special tokens skipped, as the gateway's detokenizer does) against the server's text, plus the
number of generated tokens from `usage`.

One group per architecture (`--slots 2`): attention-only qwen3 and hybrid qwen3_next; a GGUF twin
of the qwen3 model must serve the same greedy text as its MLX directory. Two prompts that wait at
the same step are prefilled as rows of one pass (docs/design/scheduling.md "Packed prefill") and each still
gets mlx_lm's tokens.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from switchyard.testing.group import ServerGroup, stop_all
from switchyard.testing.texts import LONG_TEXT, MAX_TOKENS, REPEAT_TEXT, SHORT_TEXT

TIMEOUT_S = 180.0
ARCHS = ("qwen3", "qwen3_next")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """arch -> (model, tokenizer) loaded in-process with mlx_lm."""
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = mlx_load(str(tiny_model_dir(arch)))
        return loaded[arch]

    return get


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """name -> running ServerGroup, started on first use, all stopped at the module's end."""
    started: dict[str, ServerGroup] = {}
    paths = {"qwen3": lambda: tiny_model_dir("qwen3"),
             "qwen3_next": lambda: tiny_model_dir("qwen3_next"),
             "qwen3_gguf": lambda: tiny_model_dir("qwen3", fmt="gguf")}

    def get(name: str) -> ServerGroup:
        if name not in started:
            # Debug: the worker's `step.done` lines show packed prefill passes.
            # A long peer timeout: the packing test stops the worker for a moment.
            started[name] = ServerGroup(paths[name](), slots=2, ctx=4096,
                                        extra=("--log-level", "debug",
                                               "--peer-timeout-s", "30")).start()
        return started[name]

    yield get
    stop_all(started.values())


def client_of(group: ServerGroup) -> openai.OpenAI:
    return openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                         max_retries=0)


def greedy_reference(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """mlx_lm's greedy tokens (generate_step samples argmax by default), cut before the first
    end token."""
    eos = set(tokenizer.eos_token_ids)
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out


def served_completion(group: ServerGroup, prompt_ids: list[int], max_tokens: int = MAX_TOKENS):
    with client_of(group) as client:
        models = client.models.list()
        return client.completions.create(model=models.data[0].id, prompt=prompt_ids,
                                         max_tokens=max_tokens, temperature=0)


def assert_same_as_reference(reply, tokenizer, expected: list[int], max_tokens: int) -> None:
    choice = reply.choices[0]
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.text == expected_text
    assert reply.usage.completion_tokens == len(expected)
    assert choice.finish_reason == ("length" if len(expected) == max_tokens else "stop")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", [SHORT_TEXT, LONG_TEXT], ids=["short", "long"])
def test_greedy_tokens_match_mlx_lm(servers, reference, arch, text):
    model, tokenizer = reference(arch)
    prompt_ids = tokenizer.encode(text)
    if text is LONG_TEXT:
        assert len(prompt_ids) > 600
    expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
    assert len(expected) >= 10, "the reference stops too early to compare anything"
    reply = served_completion(servers(arch), prompt_ids)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_prefilled_in_one_pass_match_mlx_lm(servers, reference, arch):
    """A's prompt is one 512-token chunk and a tail as long as B's prompt. B arrives while A's
    first chunk is in the worker's hands, so it waits for the next step, where its prompt and
    A's tail are two chunks of one length: one pass. The worker is stopped (SIGSTOP) from
    before A until both requests are in the scheduler's hands, as the group's status says, so
    B's arrival never races A's first step; every reply is mlx_lm's."""
    model, tokenizer = reference(arch)
    group = servers(arch)
    b = tokenizer.encode("Bo walks to the mill. " + SHORT_TEXT)
    a = tokenizer.encode("Ada reads the lines. " + LONG_TEXT)[:512 + len(b)]
    expected = [greedy_reference(model, tokenizer, p, 16) for p in (a, b)]
    mark = len(group.log_events("step.done"))
    worker = group.pid_of("worker")
    with ThreadPoolExecutor(2) as pool:
        os.kill(worker, signal.SIGSTOP)
        try:
            first = pool.submit(served_completion, group, a, 16)
            wait_for_health(group, lambda h: h["num_running"] == 1)
            second = pool.submit(served_completion, group, b, 16)
            wait_for_health(group, lambda h: h["num_running"] + h["num_waiting"] == 2)
        finally:
            os.kill(worker, signal.SIGCONT)
        replies = [first.result(), second.result()]
    for reply, want in zip(replies, expected):
        assert_same_as_reference(reply, tokenizer, want, 16)
    steps = group.wait_events("step.done", at_least=mark + 2, timeout_s=10)[mark:]
    packed = [e for e in steps
              if e.get("num_chunks", 0) >= 2 and e["prefill_passes"] < e["num_chunks"]]
    assert packed, steps
    assert packed[0]["tokens_per_pass"] > 0


def wait_for_health(group: ServerGroup, holds, timeout_s: float = 3.0) -> None:
    """Until the group's /health satisfies `holds` (the scheduler's counts, sent on change)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(group.url + "/health", timeout=5).json()
        if holds(health) or time.monotonic() > deadline:
            assert holds(health), health
            return
        time.sleep(0.02)


@pytest.mark.parametrize("arch", ARCHS)
def test_continuation_from_a_reused_prefix_matches_mlx_lm(servers, reference, arch):
    """A follow-up that extends an earlier prompt (the next turn of a conversation) reuses what
    the server kept of the first request, and still gives mlx_lm's greedy tokens for the whole
    prompt computed from scratch."""
    model, tokenizer = reference(arch)
    first_ids = tokenizer.encode(LONG_TEXT)
    first = greedy_reference(model, tokenizer, first_ids, MAX_TOKENS)
    served_first = served_completion(servers(arch), first_ids)
    assert_same_as_reference(served_first, tokenizer, first, MAX_TOKENS)

    follow_ids = first_ids + first[:20] + tokenizer.encode(" Then the miller said")
    expected = greedy_reference(model, tokenizer, follow_ids, MAX_TOKENS)
    reply = served_completion(servers(arch), follow_ids)
    assert reply.usage.prompt_tokens == len(follow_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_repeated_page_aligned_prompt_matches_mlx_lm(servers, reference, arch):
    """The same prompt twice, exactly two pages long: the second request finds all of it
    cached but must still prefill at least one token, and gives the same tokens. (Text
    no other test sends: pages another prompt already wrote would change what is cached.)"""
    model, tokenizer = reference(arch)
    prompt_ids = tokenizer.encode(REPEAT_TEXT)[:512]
    assert len(prompt_ids) == 512
    expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
    for _ in range(2):
        reply = served_completion(servers(arch), prompt_ids)
        assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens < len(prompt_ids)


@pytest.mark.parametrize("text", [SHORT_TEXT, LONG_TEXT], ids=["short", "long"])
def test_gguf_twin_serves_the_same_greedy_completion(servers, reference, text):
    _, tokenizer = reference("qwen3")
    prompt_ids = tokenizer.encode(text)
    from_dir = served_completion(servers("qwen3"), prompt_ids)
    from_gguf = served_completion(servers("qwen3_gguf"), prompt_ids)
    assert from_gguf.choices[0].text == from_dir.choices[0].text
    assert from_gguf.usage.completion_tokens == from_dir.usage.completion_tokens
    assert from_gguf.choices[0].finish_reason == from_dir.choices[0].finish_reason


def test_gguf_twin_serves_the_same_greedy_chat(servers):
    """Through the GGUF file's own tokenizer and chat template, not only token ids."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Describe the river in one sentence."}]
    replies = []
    for name in ("qwen3", "qwen3_gguf"):
        with client_of(servers(name)) as client:
            model = client.models.list().data[0].id
            replies.append(client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0))
    from_dir, from_gguf = replies
    assert from_dir.choices[0].message.content
    assert from_gguf.choices[0].message.content == from_dir.choices[0].message.content
    assert from_gguf.usage.prompt_tokens == from_dir.usage.prompt_tokens
    assert from_gguf.usage.completion_tokens == from_dir.usage.completion_tokens
