"""Every model family end to end through the HTTP API, on its tiny twin.

One process group per family (`--slots 1`, pages of 32 tokens so that short prompts span
several pages and the sliding windows of 128 wrap), all its checks in one test. The next
family's group starts while this one's checks run and the last one stops, so their waits
overlap:

- greedy output equals mlx_lm's `generate_step` in this process;
- the start-up line says paging is on and names the family's cache kinds;
- an A/B/A switch on the one slot: A comes back with its reply and a few new tokens, and
  re-reads only those (`cached_tokens` = prompt - new; restored from disk, since B took the
  slot), with mlx_lm's greedy tokens for the whole prompt;
- exact repeats (a retried request): A again at once, from its slot, and B again after the
  switch, from disk, each cached up to its last token with mlx_lm's greedy tokens; for the
  window and hybrid families (whose state exists only at a slot's end and at its mark) also
  after the worker and kvstore restarted (docs/design/kv-pages.md "Exact repeats and state
  marks"), and two sub-agents that part from A's prompt inside a page: the second resumes
  where they part (the first stored the state there: "Branch points").

DeepSeek-V4.1, whose cache cannot be paged, is served without pages (its own test below).

qwen3 is covered the same way in test_parity.py and test_kv_persistence.py.
Bit-identical restores per family are in tests/integration/test_page_io.py.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import openai
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import wait_ready

FAMILIES = ["qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text",
            "gemma4_text", "glm4_moe", "deepseek_v3", "deepseek_v32", "minimax", "mistral3",
            "qwen2", "llama"]
# State only at a slot's end and its mark: sliding windows, recurrent layers.
WINDOW_OR_HYBRID = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma3_text",
                    "gemma4_text"}
P = 32
MAX_TOKENS = 16
A_TEXT = " ".join(f"Line {i}: the {w} river runs past the {w} hill." for i, w in
                  enumerate(["north", "south", "east", "west"] * 5))
B_TEXT = " ".join(f"Step {i}: carry the {w} stone up the {w} stair." for i, w in
                  enumerate(["red", "green", "blue"] * 6))


def greedy(model, tokenizer, prompt_ids: list[int]) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=MAX_TOKENS):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def complete(client: openai.OpenAI, prompt_ids: list[int]):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                     temperature=0)


@pytest.fixture(scope="module")
def family_groups(request, tiny_model_dir):
    """arch -> its running group. Asking for one also starts the next selected family's group
    in the background; `retire(group)` stops a group in the background; all are stopped at
    the end."""
    selected = [item.callspec.params["arch"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=2)
    starting: dict[str, Future] = {}
    stopping: list[Future] = []

    def launch(arch: str) -> None:
        if arch not in starting:
            model_dir = tiny_model_dir(arch)  # generated here: MLX's random state is global
            group = ServerGroup(model_dir, slots=1, ctx=2048,
                                extra=("--page-size", str(P), "--prefill-chunk", "64"))
            starting[arch] = pool.submit(group.start)

    def get(arch: str) -> ServerGroup:
        launch(arch)
        following = selected[selected.index(arch) + 1:] if arch in selected else []
        if following:
            launch(following[0])
        return starting[arch].result()

    get.retire = lambda group: stopping.append(pool.submit(group.stop))
    yield get
    errors = []
    for future in [*stopping, *starting.values()]:
        try:
            group = future.result()
            if isinstance(group, ServerGroup):
                group.stop()  # no-op when already stopped
        except Exception as exc:  # stop every group before reporting
            errors.append(str(exc))
    pool.shutdown()
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_serves_pages_and_switches(tiny_model_dir, family_groups, arch):
    model, tokenizer = mlx_load(str(tiny_model_dir(arch)))
    a_ids, b_ids = tokenizer.encode(A_TEXT), tokenizer.encode(B_TEXT)
    assert len(a_ids) > 4 * P + 10 and len(b_ids) > 2 * P
    group = family_groups(arch)
    try:
        started = [e for e in group.log_events("worker.started")][-1]
        assert started["paging"] == "on", started
        client = openai.OpenAI(base_url=group.base_url, api_key="none", timeout=120,
                               max_retries=0)

        expected_a = greedy(model, tokenizer, a_ids)
        assert len(expected_a) >= 8, "the reference stops too early to compare anything"
        a = complete(client, a_ids)
        assert a.choices[0].text == tokenizer.decode(expected_a, skip_special_tokens=True)
        assert a.usage.completion_tokens == len(expected_a)
        assert_repeat(client, a_ids, expected_a, tokenizer)  # retried: from its slot

        complete(client, b_ids)  # takes the only slot

        # A again: its prompt, its reply and new tokens. The slot held A's prompt and all of
        # the reply but its last token (never fed back), so that much is cached.
        follow = a_ids + expected_a + tokenizer.encode(" Then the miller said")
        held = len(a_ids) + len(expected_a) - 1
        expected_follow = greedy(model, tokenizer, follow)
        again = complete(client, follow)
        assert again.usage.prompt_tokens_details.cached_tokens == held
        assert again.choices[0].text == tokenizer.decode(expected_follow,
                                                         skip_special_tokens=True)
        [done] = group.wait_events("request.finished", rid=again.id, role="scheduler")
        assert done["num_restored_tokens"] == held, done

        # B again, its slot taken by A: from the tail stored where its prompt's context ended.
        b_back = assert_repeat(client, b_ids, greedy(model, tokenizer, b_ids), tokenizer)
        [done] = group.wait_events("request.finished", rid=b_back.id, role="scheduler")
        assert done["num_restored_tokens"] == len(b_ids) - 1, done

        if arch in WINDOW_OR_HYBRID:
            # Worker and kvstore restart: the slot is gone, the page index is read from disk.
            # A's pages were written before B's restore was read (kvstore answers in order).
            old = {role: group.kill(role) for role in ("worker", "kvstore")}
            for role, pid in old.items():
                wait_ready(group, role, group.wait_restarted(role, pid))
            after = assert_repeat(client, follow, expected_follow, tokenizer)
            [done] = group.wait_events("request.finished", rid=after.id, role="scheduler")
            assert done["num_restored_tokens"] == len(follow) - 1, done

            shared = a_ids[:3 * P + 7]  # sub-agents under A's first pages, parting mid-page
            complete(client, shared + b_ids[:P])
            second = shared + b_ids[P:2 * P]
            sub = complete(client, second)
            assert sub.usage.prompt_tokens_details.cached_tokens == len(shared)
            assert sub.choices[0].text == tokenizer.decode(greedy(model, tokenizer, second),
                                                           skip_special_tokens=True)
    finally:
        family_groups.retire(group)


def assert_repeat(client: openai.OpenAI, prompt_ids: list[int], expected: list[int],
                  tokenizer):
    """The prompt sent again is cached up to its last token and answers mlx_lm's tokens."""
    reply = complete(client, prompt_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) - 1
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    return reply


@pytest.mark.parametrize("arch", ["deepseek_v41"])
def test_family_without_pages_serves_and_reuses_its_slot(tiny_model_dir, family_groups, arch):
    """DeepSeek-V4.1 keeps its own per-layer cache (window, compressed groups, index keys) that
    cannot be paged: the start-up line says so and why; output is still mlx_lm's, a next turn
    reuses the resident slot, and a turn after a switch is re-read, never wrong."""
    model, tokenizer = mlx_load(str(tiny_model_dir(arch)))
    a_ids, b_ids = tokenizer.encode(A_TEXT), tokenizer.encode(B_TEXT)
    group = family_groups(arch)
    try:
        started = [e for e in group.log_events("worker.started")][-1]
        assert started["paging"].startswith("off: LayerCache layers cannot be stored as pages")
        assert started["cache_kinds"] == "LayerCache x4"
        client = openai.OpenAI(base_url=group.base_url, api_key="none", timeout=120,
                               max_retries=0)
        expected_a = greedy(model, tokenizer, a_ids)
        a = complete(client, a_ids)
        assert a.choices[0].text == tokenizer.decode(expected_a, skip_special_tokens=True)

        follow = a_ids + expected_a + tokenizer.encode(" Then the miller said")
        expected_follow = greedy(model, tokenizer, follow)
        again = complete(client, follow)  # extends all the slot holds: reused in memory
        assert again.usage.prompt_tokens_details.cached_tokens == len(a_ids) + len(expected_a) - 1
        assert again.choices[0].text == tokenizer.decode(expected_follow,
                                                         skip_special_tokens=True)

        complete(client, b_ids)  # takes the only slot; A has no pages to come back from
        back = complete(client, follow)
        assert back.usage.prompt_tokens_details.cached_tokens == 0
        assert back.choices[0].text == again.choices[0].text
    finally:
        family_groups.retire(group)
