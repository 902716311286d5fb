"""The other vision twins end to end: Qwen3-VL (deepstack features into the first language
layers, interleaved M-RoPE) and Gemma 3 (SigLIP, pooled image tokens, sliding-window layers
paged as snapshots). One group per family (`--slots 1`), started on first use.

For each: greedy output with an image through Chat Completions equals mlx-vlm's generation in
this process, a text-only request too, and an image-bearing conversation switched away and back
re-reads only its new tokens with one encoder run for its image. (All three APIs, bad inputs
and restarts: tests/e2e/test_vision_qwen2_5_vl.py.)
"""

from __future__ import annotations

import openai
import pytest

from switchyard.testing.group import ServerGroup, stop_all
from switchyard.testing.vision import Reference, openai_content, picture, short_id

FAMILIES = ("qwen3_vl", "gemma3")
PAGE = 256
MAX_TOKENS = 24
HISTORY = " ".join(f"Row {i}: the {w} lamp hangs over the {w} door." for i, w in
                   enumerate(["amber", "teal", "plum"] * 20))


@pytest.fixture(scope="module")
def family(tiny_model_dir):
    """arch -> (ServerGroup, Reference), each made on first use, stopped at the end."""
    made: dict[str, tuple[ServerGroup, Reference]] = {}

    def get(arch: str):
        if arch not in made:
            model_dir = tiny_model_dir(arch)
            made[arch] = (ServerGroup(model_dir, slots=1, ctx=4096).start(), Reference(model_dir))
        return made[arch]

    yield get
    stop_all(group for group, _ in made.values())


def chat(group, messages):
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0) as client:
        return client.chat.completions.create(model=client.models.list().data[0].id,
                                              messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_output_with_an_image_matches_mlx_vlm(family, arch):
    group, reference = family(arch)
    image = picture(7, 52, 40)
    before, after = "Here: ", "Describe the picture, please."
    rendered = [{"role": "user", "content": [{"type": "text", "text": before},
                                             {"type": "image"},
                                             {"type": "text", "text": after}]}]
    expected, prompt_len = reference.generate(rendered, [image], MAX_TOKENS)
    assert len(expected) >= 8, "the reference stops too early to compare anything"
    reply = chat(group, [{"role": "user", "content": openai_content(before, image, after)}])
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == reference.text(expected)


@pytest.mark.parametrize("arch", FAMILIES)
def test_text_only_request_matches_mlx_vlm(family, arch):
    group, reference = family(arch)
    messages = [{"role": "user", "content": "Say something about lanterns."}]
    expected, prompt_len = reference.generate(messages, [], MAX_TOKENS)
    reply = chat(group, messages)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == reference.text(expected)


@pytest.mark.parametrize("arch", FAMILIES)
def test_image_history_switched_away_and_back(family, arch):
    group, _ = family(arch)
    image = picture(17, 64, 64)
    first = [{"role": "user", "content": openai_content("Look: ", image, HISTORY)}]
    reply = chat(group, first)
    assert reply.usage.prompt_tokens > 2 * PAGE
    chat(group, [{"role": "user", "content": "Another thing: " + HISTORY[:900]}])
    again = chat(group, first + [{"role": "assistant",
                                  "content": reply.choices[0].message.content},
                                 {"role": "user", "content": "Go on."}])
    assert again.usage.prompt_tokens_details.cached_tokens >= \
        reply.usage.prompt_tokens + reply.usage.completion_tokens - PAGE
    encoded = [e for e in group.log_events("vision.encoded") if e.get("image") == short_id(image)]
    assert len(encoded) == 1
