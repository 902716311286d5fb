"""Images at the gateway: each API's parts, the checks before and while decoding, the
placeholder counts and spans, and what a URL fetch refuses. No sockets, no MLX."""

import asyncio
import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from switchyard.gateway.api.anthropic_api import parse_messages_request
from switchyard.gateway.api.responses_api import parse_input
from switchyard.gateway.api.openai_request import parse_chat_request
from switchyard.gateway.errors import APIError
from switchyard.gateway.vision.fetch import FetchLimits, fetch_image, is_public
from switchyard.gateway.vision.images import decode
from switchyard.gateway.vision.inputs import ImageInputs
from switchyard.gateway.vision.parts import ImageRef, image_refs, template_messages
from switchyard.gateway.vision.prompt import Gemma3, ImageTokens, QwenVL
from switchyard.common.images import image_id, open_rgb

MAX_PIXELS = 200 * 200


def png(width=32, height=24, fmt="PNG", color=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, fmt)
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def error_of(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as raised:
        fn(*args, **kw)
    assert raised.value.status == 400
    return raised.value


# --- each API's parts ---------------------------------------------------------------------------


def test_openai_image_parts_keep_their_place_among_the_text():
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url(png())}},
        {"type": "text", "text": "b"}, {"type": "image_url", "image_url": url(png(8, 8))}]}]})
    refs = image_refs(chat.messages)
    assert [r.param for r in refs] == ["messages[0].content[1].image_url.url",
                                       "messages[0].content[3].image_url"]
    assert refs[0].data == png()
    assert template_messages(chat.messages)[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"},
        {"type": "image"}]


def test_text_parts_alone_are_joined_as_before():
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat.messages[0]["content"] == "a\nb"


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_images_only_in_user_messages_and_tool_results(role):
    error = error_of(parse_chat_request, {"messages": [{"role": role, "content": [
        {"type": "image_url", "image_url": {"url": url(png())}}]}]})
    assert error.param == "messages[0].content"


@pytest.mark.parametrize("bad,code", [
    ("data:image/png,abcd", "invalid_image_url"),  # not base64
    ("data:image/png;base64", "invalid_image_url"),  # no comma
    ("data:image/png;base64,@@@@", "invalid_image_data"),
    ("data:image/png;base64,", "invalid_image_data"),
    ("ftp://example.com/a.png", "invalid_image_url"),
    ("", "invalid_type"),
])
def test_bad_image_urls(bad, code):
    error = error_of(parse_chat_request, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": bad}}]}]})
    assert error.code == code and error.param == "messages[0].content[0].image_url.url"


def test_detail_is_checked_as_openai_does():
    """The published spec says auto, low or high (an image's `detail`): anything else is a
    400, in Chat and in Responses (schemathesis: a schema-violating request is refused)."""
    for detail in ("auto", "low", "high", None):
        parse_chat_request({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url(png()), "detail": detail}}]}]})
        parse_input([{"role": "user", "content": [
            {"type": "input_image", "image_url": url(png()), "detail": detail}]}])
    error = error_of(parse_chat_request, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(png()), "detail": "ultra"}}]}]})
    assert error.param == "messages[0].content[0].image_url.detail"
    error = error_of(parse_input, [{"role": "user", "content": [
        {"type": "input_image", "image_url": url(png()), "detail": 3}]}])
    assert error.param == "input[0].content[0].detail"


def test_anthropic_image_blocks_in_user_turns_and_tool_results():
    data = base64.b64encode(png()).decode()
    parsed = parse_messages_request({"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image",
                                     "source": {"type": "base64", "media_type": "image/png",
                                                "data": data}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "here"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]}]}]})
    refs = image_refs(parsed.chat.messages)
    assert refs[0].data == png() and refs[0].param == "messages[0].content[1].source.data"
    assert refs[1].url == "https://example.com/x.png"
    assert parsed.chat.messages[-1]["role"] == "tool"


def test_anthropic_image_source_is_checked():
    error = error_of(parse_messages_request, {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "text/plain", "data": "aGk="}}]}]})
    assert error.param == "messages[0].content[0].source.media_type"
    error = error_of(parse_messages_request, {"max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "aGk="}}]}]})
    assert error.param == "messages[0].content[0].type"


def test_responses_input_image():
    messages = parse_input([{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": url(png())}]}])
    assert image_refs(messages)[0].param == "input[0].content[1].image_url"
    error = error_of(parse_input, [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}])
    assert error.param == "input[0].content[0].file_id"
    error = error_of(parse_input, [{"role": "system", "content": [
        {"type": "input_image", "image_url": url(png())}]}])
    assert error.param == "input[0].content"


# --- decoding ----------------------------------------------------------------------------------


def ref(data: bytes) -> ImageRef:
    return ImageRef("img", data=data)


def bomb(width: int, height: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                             0, 0, 0)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data,code", [
    (png()[:40], "invalid_image_data"),  # truncated
    (b"not an image", "invalid_image_data"),
    (png(fmt="TIFF"), "unsupported_image_format"),
    (png(300, 300), "image_too_large"),  # 90000 pixels > 40000
    (bomb(100_000, 100_000), "image_too_large"),  # refused from its header
    (bomb(150, 150), "invalid_image_data"),  # a header that fits, then no pixels
])
def test_bad_images_are_refused(data, code):
    error = error_of(decode, ref(data), MAX_PIXELS, None)
    assert error.code == code and error.param == "img"


@pytest.mark.parametrize("fmt,name", [("TIFF", "TIFF"), ("ICO", "ICO"), ("PPM", None),
                                      ("TGA", None), ("PCX", None)])
def test_only_the_allowed_formats_plugins_read_the_bytes(monkeypatch, fmt, name):
    from PIL import Image as PILImage

    PILImage.init()  # every plugin registered, as a server that opened any image before
    opened = []
    for kind, (factory, _accept) in list(PILImage.OPEN.items()):
        if kind not in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
            monkeypatch.setitem(PILImage.OPEN, kind, (
                lambda *a, _k=kind, **kw: opened.append(_k), _accept))
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, fmt)
    error = error_of(decode, ref(buf.getvalue()), MAX_PIXELS, None)
    assert opened == []  # no other plugin's factory was asked to open them
    if name:  # a common format is named from its signature, with the same 400 as before
        assert error.code == "unsupported_image_format" and error.message.startswith(
            f"'img': {name} images are not supported; send PNG, JPEG, WebP, GIF or BMP")
    else:
        assert error.code == "invalid_image_data" and "PNG, JPEG, WebP, GIF, BMP" in error.message
    with pytest.raises(Image.UnidentifiedImageError):  # the worker's opening too
        open_rgb(buf.getvalue())


def test_an_image_is_named_by_its_pixels_not_its_file_format():
    pixels = Image.new("RGB", (20, 10), (1, 2, 3))
    files = []
    for fmt in ("PNG", "BMP", "WEBP"):
        buf = io.BytesIO()
        pixels.save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        files.append(buf.getvalue())
    ids = {decode(ref(f), MAX_PIXELS, None).image_id for f in files}
    assert ids == {image_id(open_rgb(files[0]))}
    assert decode(ref(png(color=(9, 9, 9))), MAX_PIXELS, None).image_id not in ids


def test_images_for_a_text_only_model_are_refused_naming_it():
    inputs = ImageInputs(None, "tiny-qwen3", max_images=4, max_pixels=MAX_PIXELS, fetch=None)
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(png())}}]}]})
    with pytest.raises(APIError) as raised:
        asyncio.run(inputs.prepare(chat))
    assert "'tiny-qwen3' is a text-only model" in raised.value.message
    assert raised.value.code == "images_not_supported"


def test_more_images_than_allowed_are_refused():
    prompt = QwenVL("qwen2_5_vl", 7, {}, 14)
    inputs = ImageInputs(prompt, "m", max_images=2, max_pixels=MAX_PIXELS, fetch=None)
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(png())}}] * 3}]})
    with pytest.raises(APIError) as raised:
        asyncio.run(inputs.prepare(chat))
    assert raised.value.code == "too_many_images"
    assert raised.value.param == "messages[0].content[2].image_url.url"


# --- placeholders ------------------------------------------------------------------------------


def test_qwen_vl_sizes_images_like_its_processor():
    prompt = QwenVL("qwen2_5_vl", 7, {"min_pixels": 28 * 28, "max_pixels": 224 * 224}, 14)
    assert prompt.tokens_for(56, 48, "p") == ImageTokens(4, (1, 4, 4))
    assert prompt.tokens_for(10, 10, "p") == ImageTokens(1, (1, 2, 2))  # up to min_pixels
    big = prompt.tokens_for(4000, 1000, "p")  # down to max_pixels
    assert big.num_tokens <= 64 and big.grid[1] * big.grid[2] == 4 * big.num_tokens
    assert error_of(prompt.tokens_for, 1000, 2, "p").code == "invalid_image"


def test_markers_expand_and_spans_are_found():
    prompt = QwenVL("qwen2_5_vl", 7, {}, 14)
    images = [ImageTokens(2, (1, 2, 4)), ImageTokens(1, (1, 2, 2))]
    text = "a<|image_pad|>b<|image_pad|>c"
    assert prompt.expand(text, images) == "a<|image_pad|><|image_pad|>b<|image_pad|>c"
    assert error_of(prompt.expand, text, images[:1]).code == "invalid_image_markers"
    spans = prompt.spans([1, 7, 7, 2, 7, 3], images, [b"x" * 16, b"y" * 16])
    assert [(s.start, s.num_tokens, s.grid) for s in spans] == [(1, 2, (1, 2, 4)),
                                                                (4, 1, (1, 2, 2))]
    # A placeholder typed into text, or a run of the wrong length: refused.
    assert error_of(prompt.spans, [7, 1, 7, 7, 2, 7], images, [b"x" * 16] * 2).code == \
        "invalid_image_markers"
    assert error_of(prompt.spans, [1, 7, 2], [], []).code == "invalid_image_markers"


def test_gemma3_expands_like_its_processor():
    prompt = Gemma3(9, 3)
    assert prompt.expand("x<start_of_image>y", [ImageTokens(3)]) == (
        "x\n\n<start_of_image><image_soft_token><image_soft_token><image_soft_token>"
        "<end_of_image>\n\ny")


# --- fetching ----------------------------------------------------------------------------------


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("192.168.0.1", False), ("172.16.5.4", False), ("169.254.169.254", False), ("::1", False),
    ("fe80::1", False), ("fc00::1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::ffff:127.0.0.1", False), ("100.64.0.1", False),
    # 6to4, Teredo and NAT64 are judged by the IPv4 address inside them
    ("2002:7f00:1::", False), ("2002:a00:1::1", False), ("2002:c0a8:101::", False),
    ("2002:808:808::1", True), ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),
    ("64:ff9b::7f00:1", False), ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::808:808", True),
    ("64:ff9b:1::7f00:1", False), ("64:ff9b:1:7f00:1::", False), ("64:ff9b:1:a:a:a9fe:a9fe:0", False),
])
def test_only_public_addresses_are_fetched(address, public):
    assert is_public(address) is public


def test_an_address_with_an_ipv4_inside_is_refused_before_connecting(monkeypatch):
    from switchyard.gateway.vision import fetch as fetch_module

    monkeypatch.setattr(fetch_module.socket, "getaddrinfo", lambda *a, **kw: [
        (0, 0, 0, "", ("2002:7f00:1::", 80, 0, 0))])
    error = error_of(fetch_image, ImageRef("u", url="http://six.example/a.png"),
                     FetchLimits(1000, 1.0))
    assert error.code == "image_url_not_allowed" and "2002:7f00:1::" in error.message


def test_fetching_is_off_unless_enabled():
    error = error_of(fetch_image, ImageRef("u", url="https://example.com/a.png"), None)
    assert error.code == "image_fetch_disabled" and "--image-fetch" in error.message


@pytest.mark.parametrize("target", ["http://localhost/a.png", "http://127.0.0.1:8000/v1/models",
                                    "http://[::1]/x", "https://user:pw@example.com/a.png"])
def test_fetching_refuses_local_targets_and_credentials(target):
    error = error_of(fetch_image, ImageRef("u", url=target), FetchLimits(1000, 1.0))
    assert error.code in ("image_url_not_allowed", "invalid_image_url")
