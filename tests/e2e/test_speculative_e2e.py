"""Speculative decoding end to end (docs/design/speculative-decoding.md "Speculative decoding"), through the
official `openai` client on the tiny random qwen3: greedy output with drafts is the output
without (the per-request opt-out `"speculative": false` gives the reference on the same
server), with 4 streams decoded together and under a JSON-schema constraint; and a
conversation decoded with drafts, switched out of its slot and restored from disk, continues
exactly as mlx_lm continues it. A group with the twin as its own draft model (`--draft-model`)
gives the same replies, every draft accepted, and a restored conversation continues exactly
(the draft model catches up on the restored tokens). (Every family twin, --kv-bits 8 and scripted drafts are proved
in-process: tests/integration/test_speculative_executor.py.)

A random-weight model copies nothing on its own, so drafts come from the other requests the
proposer has seen: a prompt sent a second time is continued by the first time's output, which
the proposer proposes (and the model accepts, being greedy). The groups run with `--speculative
suffix`, which verifies every whole proposal: `auto` weighs each draft against what a verify
pass costs, measured from step times, which a loaded machine makes vary from run to run.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from mlx_lm import load as mlx_load

from tests.e2e.test_parity import assert_same_as_reference, greedy_reference
from switchyard.testing.group import ServerGroup

TIMEOUT_S = 300.0
MODEL = "tiny-qwen3"
MAX_TOKENS = 48
PROMPTS = [" ".join(f"{w}{i}" for i in range(n)) for w, n in
           (("river", 40), ("stone", 55), ("lamp", 30), ("mill", 70))]


SPECULATIVE = ("--speculative", "suffix")


@pytest.fixture(scope="module")
def group(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=4, ctx=4096, extra=SPECULATIVE) as running:
        yield running


@pytest.fixture(scope="module")
def oa(group):
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


def complete(oa, prompt, speculative: bool, max_tokens: int = MAX_TOKENS):
    return oa.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                 temperature=0, extra_body={"speculative": speculative})


def drafts_of(group, rid: str) -> tuple[int, int]:
    [rec] = [r for r in group.wait_events("request.finished", rid=rid, role="scheduler")
             if "num_proposed_tokens" in r]
    return rec["num_proposed_tokens"], rec["num_accepted_tokens"]


def test_four_streams_speculating_together_give_the_output_without_drafts(oa, group):
    for prompt in PROMPTS:  # seen once: the proposer can copy these replies next time
        complete(oa, prompt, True)
    with ThreadPoolExecutor(4) as pool:
        with_drafts = list(pool.map(lambda p: complete(oa, p, True), PROMPTS))
    with ThreadPoolExecutor(4) as pool:
        without = list(pool.map(lambda p: complete(oa, p, False), PROMPTS))
    for a, b in zip(with_drafts, without):
        assert a.choices[0].text == b.choices[0].text
        assert a.usage.completion_tokens == b.usage.completion_tokens
    for reply in with_drafts:
        proposed, accepted = drafts_of(group, reply.id)
        assert accepted > MAX_TOKENS // 2, (proposed, accepted)
    for reply in without:
        assert drafts_of(group, reply.id) == (0, 0)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "tags", "n"], "additionalProperties": False}


def test_a_json_schema_constrained_reply_is_the_same_with_drafts(oa, group):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "Describe the mill as JSON."}]

    def chat(speculative: bool):
        return oa.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                          max_tokens=200, temperature=0,
                                          extra_body={"speculative": speculative})

    chat(True)
    with_drafts, without = chat(True), chat(False)
    text = with_drafts.choices[0].message.content
    assert text == without.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert drafts_of(group, with_drafts.id)[1] > 0


@pytest.fixture(scope="module")
def one_slot(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=4096, extra=SPECULATIVE) as running:
        yield running


def test_a_conversation_decoded_with_drafts_is_restored_and_continues_exactly(one_slot,
                                                                             tiny_qwen3):
    """Its pages hold only accepted tokens: after another conversation took the slot, its next
    turn restores them from disk and continues as mlx_lm continues the same tokens."""
    model, tokenizer = mlx_load(str(tiny_qwen3))
    first = tokenizer.encode(PROMPTS[3])
    reply = greedy_reference(model, tokenizer, first, MAX_TOKENS)
    follow = tokenizer.encode(" and then the mill" * 3, add_special_tokens=False)
    second = first + reply + follow
    expected = greedy_reference(model, tokenizer, second, MAX_TOKENS)
    with openai.OpenAI(base_url=one_slot.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        complete(c, first, True)
        turn = complete(c, first, True)  # decoded with the first one's reply as drafts
        assert drafts_of(one_slot, turn.id)[1] > 0
        assert_same_as_reference(turn, tokenizer, reply, MAX_TOKENS)
        complete(c, tokenizer.encode(PROMPTS[1]), True)  # takes the one slot
        nxt = complete(c, second, True)
    # Restored: at least the tail where the first prompt's context ended (all but its last
    # token; docs/design/kv-pages.md "Exact repeats and state marks").
    assert nxt.usage.prompt_tokens_details.cached_tokens >= len(first) - 1
    assert_same_as_reference(nxt, tokenizer, expected, MAX_TOKENS)


@pytest.fixture(scope="module")
def drafting(tiny_qwen3):
    """The twin as its own draft model (--speculative draft: every decoding row drafted)."""
    with ServerGroup(tiny_qwen3, slots=2, ctx=4096,
                     extra=("--speculative", "draft", "--draft-model", str(tiny_qwen3),
                            "--num-draft-tokens", "4")) as running:
        yield running


def test_a_draft_model_drafts_for_streams_together_and_the_output_is_unchanged(drafting,
                                                                              tiny_qwen3):
    """The model drafting for itself: every draft token is accepted (greedy), and the replies
    are those without drafts; a conversation restored from disk into a slot the draft model
    knows nothing of continues as mlx_lm continues it (the draft model catches up)."""
    model, tokenizer = mlx_load(str(tiny_qwen3))
    first = tokenizer.encode(PROMPTS[0])
    reply = greedy_reference(model, tokenizer, first, MAX_TOKENS)
    second = first + reply + tokenizer.encode(" and then the river" * 3,
                                              add_special_tokens=False)
    expected = greedy_reference(model, tokenizer, second, MAX_TOKENS)
    with openai.OpenAI(base_url=drafting.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        with ThreadPoolExecutor(2) as pool:
            with_drafts = list(pool.map(lambda p: complete(c, p, True), PROMPTS[:2]))
        without = [complete(c, p, False) for p in PROMPTS[:2]]
        for p in PROMPTS[2:]:  # both slots taken by other conversations
            complete(c, p, False)
        nxt = complete(c, second, True)
    # Restored: at least the tail where the first prompt's context ended (all but its last
    # token; docs/design/kv-pages.md "Exact repeats and state marks").
    assert nxt.usage.prompt_tokens_details.cached_tokens >= len(first) - 1
    assert_same_as_reference(nxt, tokenizer, expected, MAX_TOKENS)
    assert drafts_of(drafting, nxt.id)[1] > 0
    for a, b in zip(with_drafts, without):
        assert a.choices[0].text == b.choices[0].text
    for reply in with_drafts:
        proposed, accepted = drafts_of(drafting, reply.id)
        assert proposed > MAX_TOKENS // 2 and accepted >= proposed - 4, (proposed, accepted)
        [rec] = [r for r in drafting.wait_events("request.finished", rid=reply.id,
                                                 role="scheduler") if "proposers" in r]
        assert rec["proposers"] == "draft"
    [started] = drafting.wait_events("worker.started")
    assert started["draft_model"] == started["model"]
    [plan] = drafting.wait_events("worker.memory_plan")
    assert plan["draft"] > 0
