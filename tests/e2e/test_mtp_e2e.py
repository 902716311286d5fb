"""MTP drafts end to end (docs/design/speculative-decoding.md "Speculative decoding", MTP heads): the qwen3_5 twin
with its MTP head served with `--speculative mtp`; one greedy request through the official
`openai` client gives mlx_lm's greedy tokens (mlx-lm loads the model without the head), and
the scheduler's request.finished says the MTP head drafted for it. (Exactness batched, with
an agreeing head, and against mlx-vlm's drafter: tests/integration/test_mtp.py.)
"""

from __future__ import annotations

import pytest
from mlx_lm import load as mlx_load

from tests.e2e.test_parity import assert_same_as_reference, greedy_reference, served_completion
from switchyard.testing.group import ServerGroup

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def twin(tiny_model_dir):
    return tiny_model_dir("qwen3_5", mtp=True)


@pytest.fixture(scope="module")
def group(twin):
    with ServerGroup(twin, slots=2, ctx=2048, extra=("--speculative", "mtp")) as running:
        yield running


def test_a_greedy_reply_drafted_by_the_mtp_head_is_mlx_lms(group, twin):
    model, tokenizer = mlx_load(str(twin))
    prompt_ids = tokenizer.encode("The river stone lamp mill " * 6)
    expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
    reply = served_completion(group, prompt_ids, MAX_TOKENS)
    assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)
    [done] = [r for r in group.wait_events("request.finished", rid=reply.id, role="scheduler")
              if "num_proposed_tokens" in r]
    assert done["proposers"] == "mtp" and done["num_proposed_tokens"] > 0, done
