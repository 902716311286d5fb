"""Images end to end on the tiny Qwen2.5-VL twin (mlx-vlm's classes), one group, `--slots 1`.

- Greedy output through each API (Chat Completions, Anthropic Messages, Responses) equals
  mlx-vlm's own generation in this process for the same image and text; a text-only request
  to the vision model too.
- An A/B/A switch where A carries an image and ~2K tokens of text: A's next turn re-reads only
  its new tokens (cached >= its previous prompt + reply - one page) and the encoder never runs
  for A's image again (the worker's `vision.encoded` lines); after a restart of the whole group
  too, from the pages on disk.
- The same history with another image shares nothing from where the image starts: the pages
  before it come back from disk, the page covering it does not.
- Every bad image input is a 400 in the API's own format naming the problem, and the pages
  already stored are still there afterwards.
"""

from __future__ import annotations

import base64
import io
import shutil

import anthropic
import openai
import pytest

from switchyard.testing.group import ServerGroup, short_tmp_dir
from switchyard.testing.vision import (
    Reference,
    anthropic_content,
    data_url,
    openai_content,
    picture,
    responses_content,
    short_id,
)

ARCH = "qwen2_5_vl"
PAGE = 256
MAX_TOKENS = 24
MAX_PIXELS = 200 * 200
LIMITS = ("--max-images", "3", "--max-image-pixels", str(MAX_PIXELS))
HISTORY = " ".join(f"Note {i}: the {w} crane lifts the {w} crate onto the dock."
                   for i, w in enumerate(["red", "blue", "green", "grey"] * 40))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir(ARCH)


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


@pytest.fixture(scope="module")
def group(model_dir):
    # Its own runtime and KV dirs, kept across the restart test's stop and start (the log too).
    runtime_dir, kv_dir = short_tmp_dir("syv"), short_tmp_dir("syvkv")
    try:
        with ServerGroup(model_dir, slots=1, ctx=8192, runtime_dir=runtime_dir, kv_dir=kv_dir,
                         extra=LIMITS) as running:
            yield running
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(kv_dir, ignore_errors=True)


def chat(group, messages, max_tokens=MAX_TOKENS):
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0) as client:
        return client.chat.completions.create(model=client.models.list().data[0].id,
                                              messages=messages, max_tokens=max_tokens,
                                              temperature=0)


def template_messages(text_before, text_after, role="user"):
    return [{"role": role, "content": [{"type": "text", "text": text_before}, {"type": "image"},
                                       {"type": "text", "text": text_after}]}]


def encodes_of(group, image: bytes) -> int:
    return sum(1 for e in group.log_events("vision.encoded") if e.get("image") == short_id(image))


# --- parity --------------------------------------------------------------------------------


def test_greedy_output_matches_mlx_vlm_in_every_api(group, reference):
    image = picture(1, 60, 44)
    before, after = "Look at this: ", "What is in the picture?"
    expected, prompt_len = reference.generate(template_messages(before, after), [image],
                                              MAX_TOKENS)
    assert len(expected) >= 8, "the reference stops too early to compare anything"
    text = reference.text(expected)

    reply = chat(group, [{"role": "user", "content": openai_content(before, image, after)}])
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == len(expected)

    with anthropic.Anthropic(base_url=group.url, api_key="none", max_retries=0) as client:
        message = client.messages.create(
            model="any", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": anthropic_content(before, image, after)}])
    assert "".join(b.text for b in message.content if b.type == "text") == text

    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0) as client:
        response = client.responses.create(
            model=client.models.list().data[0].id, max_output_tokens=MAX_TOKENS,
            temperature=0,
            input=[{"role": "user", "content": responses_content(before, image, after)}])
    assert response.output_text == text


def test_text_only_request_to_the_vision_model_matches_mlx_vlm(group, reference):
    messages = [{"role": "user", "content": "Tell me about the harbour at dawn."}]
    expected, prompt_len = reference.generate(messages, [], MAX_TOKENS)
    reply = chat(group, messages)
    assert reply.choices[0].message.content == reference.text(expected)
    assert reply.usage.prompt_tokens == prompt_len


def test_image_in_a_tool_result_matches_mlx_vlm(group, reference):
    image = picture(5, 40, 40)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "screenshot", "arguments": "{}"}}
    sent = [{"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1",
             "content": openai_content("Here it is: ", image, "")}]
    rendered = [sent[0], {**sent[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "screenshot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [
            {"type": "text", "text": "Here it is: "}, {"type": "image"},
            {"type": "text", "text": ""}]}]
    expected, prompt_len = reference.generate(rendered, [image], MAX_TOKENS)
    reply = chat(group, sent)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == reference.text(expected)


# --- caching -------------------------------------------------------------------------------


def a_turn(image: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": openai_content("Screenshot: ", image,
                                                        HISTORY + " " + question)}]


def test_switch_rereads_only_new_tokens_and_encodes_the_image_once(group):
    image = picture(11, 64, 64)
    first = a_turn(image, "What changed?")
    reply = chat(group, first)
    assert reply.usage.prompt_tokens > 2000
    answer = reply.choices[0].message.content
    chat(group, [{"role": "user", "content": "Something else entirely: " + HISTORY[:3000]}])
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "And now?"}]
    again = chat(group, second)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.prompt_tokens + reply.usage.completion_tokens - PAGE
    assert encodes_of(group, image) == 1


def test_another_image_shares_nothing_from_where_it_starts(group):
    """The same history with another image: the pages before the image come back, nothing
    from the image on (its placeholder tokens are the same ids)."""
    lead = HISTORY[:2500]  # the image lands a few pages in
    first, second = picture(21), picture(22)
    reply = chat(group, [{"role": "user", "content": openai_content(lead, first, "Which?")}])
    chat(group, [{"role": "user", "content": "Unrelated: " + HISTORY[2500:5000]}])
    other = chat(group, [{"role": "user", "content": openai_content(lead, second, "Which?")}])
    image_start = reply.usage.prompt_tokens - 6 - 4  # " Which?" and the turn's end, 4 tokens
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached <= image_start
    assert cached >= (image_start // PAGE) * PAGE
    assert encodes_of(group, second) == 1


# --- bad input -----------------------------------------------------------------------------


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height: refused before any pixel is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(
        b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def _tiff() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    return buf.getvalue()


BAD_URLS = {
    "corrupt bytes": (data_url(picture(3)[:60]), "invalid_image_data"),
    "not an image": (data_url(b"hello, world"), "invalid_image_data"),
    "unsupported format": (data_url(_tiff(), "image/tiff"), "unsupported_image_format"),
    "too many pixels": (data_url(picture(4, 256, 256)), "image_too_large"),
    "decompression bomb": (data_url(_bomb_png(60000, 60000)), "image_too_large"),
    "data URL not base64": ("data:image/png,not-base64-at-all", "invalid_image_url"),
    "bad base64": ("data:image/png;base64,***", "invalid_image_data"),
    "remote URL, fetching off": ("https://example.com/cat.png", "image_fetch_disabled"),
}


@pytest.mark.parametrize("problem", list(BAD_URLS))
def test_bad_image_is_a_400_naming_it(group, problem):
    url, code = BAD_URLS[problem]
    with pytest.raises(openai.BadRequestError) as raised:
        chat(group, [{"role": "user", "content": [
            {"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": url}}]}])
    error = raised.value.body
    assert error["code"] == code
    assert error["param"].startswith("messages[0].content[1].image_url")


def test_more_images_than_allowed_is_a_400(group):
    parts = [{"type": "image_url", "image_url": {"url": data_url(picture(i))}} for i in range(4)]
    with pytest.raises(openai.BadRequestError) as raised:
        chat(group, [{"role": "user", "content": parts}])
    assert raised.value.body["code"] == "too_many_images"
    assert "at most 3" in raised.value.body["message"]


def test_bad_image_in_anthropic_format(group):
    with anthropic.Anthropic(base_url=group.url, api_key="none", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model="any", max_tokens=4, messages=[{
                "role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png",
                    "data": base64.b64encode(b"garbage").decode()}}]}])
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "not an image" in body["error"]["message"]


def test_bad_input_loses_nothing_stored(group):
    """After every refusal above, a conversation stored before still comes back whole."""
    image = picture(31, 48, 48)
    turn = [{"role": "user", "content": openai_content("Keep: ", image, HISTORY[:1500])}]
    reply = chat(group, turn)
    for url, _ in BAD_URLS.values():
        with pytest.raises(openai.BadRequestError):
            chat(group, [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])
    chat(group, [{"role": "user", "content": "Unrelated: " + HISTORY[4000:6000]}])
    again = chat(group, turn + [{"role": "assistant",
                                 "content": reply.choices[0].message.content},
                                {"role": "user", "content": "More?"}])
    assert again.usage.prompt_tokens_details.cached_tokens >= \
        reply.usage.prompt_tokens + reply.usage.completion_tokens - PAGE
    assert encodes_of(group, image) == 1


# --- restart -------------------------------------------------------------------------------


def test_restart_keeps_image_histories(group, model_dir):
    """A restarted group finds an image-bearing history on disk: the next turn re-reads only
    its new tokens, and the encoder does not run for the image (its pages hold it)."""
    image = picture(41, 64, 48)
    first = a_turn(image, "Remember this.")
    reply = chat(group, first)
    group.stop()
    group.start()
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "What was it?"}]
    again = chat(group, second)
    assert again.usage.prompt_tokens_details.cached_tokens >= \
        reply.usage.prompt_tokens + reply.usage.completion_tokens - PAGE
    assert encodes_of(group, image) == 1  # the log spans both runs: the first run's only


# --- the other paths an image takes ----------------------------------------------------------


def test_count_tokens_counts_the_images_placeholders(group, reference):
    image = picture(51, 90, 60)
    with anthropic.Anthropic(base_url=group.url, api_key="none", max_retries=0) as client:
        counted = client.messages.count_tokens(model="any", messages=[
            {"role": "user", "content": anthropic_content("Count ", image, "this.")}])
    inputs = reference.prompt(template_messages("Count ", "this."), [image])
    assert counted.input_tokens == inputs["input_ids"].shape[1]


def test_a_previous_response_with_an_image_is_continued_from_its_pages(group):
    image = picture(61, 48, 64)
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, max_output_tokens=8, temperature=0,
                                        input=[{"role": "user", "content": responses_content(
                                            "Kept: ", image, HISTORY[:1200])}])
        second = client.responses.create(model=model, max_output_tokens=8, temperature=0,
                                         previous_response_id=first.id, input="And then?")
    assert second.usage.input_tokens_details.cached_tokens >= \
        first.usage.input_tokens + first.usage.output_tokens - PAGE
    assert encodes_of(group, image) == 1
