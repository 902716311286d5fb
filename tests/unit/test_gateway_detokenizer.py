"""Incremental detokenization never splits a UTF-8 character; stop strings are never emitted."""

import random

import pytest
from transformers import PreTrainedTokenizerFast

from switchyard.gateway.output.detokenizer import IncrementalDetokenizer, StopMatcher
from switchyard.gateway.generation import Generation
from switchyard.proto.gateway_scheduler import RequestFailed, RequestFinished, TokensGenerated

TEXTS = [
    "Hello 🦜 world",
    "日本語のテキストと中文混合",
    "emoji run 👩‍👩‍👧‍👦🏳️‍🌈🇯🇵 then ascii",
    "mixed: naïve café — «quotes» ∑ x² 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "def f(x):\n    return x  # 注释 ✓\n",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from switchyard.twins.tokenizer import tokenizer_files

    directory = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files().items():
        (directory / name).write_bytes(data)
    return PreTrainedTokenizerFast.from_pretrained(str(directory))  # no MLX in unit tests


def byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level token for one raw byte (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + shifted.index(byte))
    return tokenizer.convert_tokens_to_ids(char)


def stream(tokenizer, token_ids, chunks, **kw):
    detok = IncrementalDetokenizer(tokenizer, **kw)
    pieces, i = [], 0
    for size in chunks:
        pieces.append(detok.add(token_ids[i:i + size]))
        i += size
    pieces.append(detok.add(token_ids[i:]))
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunking_matches_full_decode(tokenizer, text):
    rng = random.Random(text)
    ids = tokenizer.encode(text)
    for _ in range(20):
        chunks = [rng.randint(0, 4) for _ in range(len(ids))]
        pieces = stream(tokenizer, ids, chunks)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_emoji_spelled_in_single_byte_tokens(tokenizer):
    emoji = "🦜".encode()
    ids = [byte_token(tokenizer, b) for b in emoji]
    assert len(set(ids)) == 4
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in ids] == ["", "", "", "🦜"]


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok ") + [byte_token(tokenizer, b) for b in "日".encode()[:2]]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_skipped_ids_and_special_tokens_produce_no_text(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("fine") + [start, eos]
    assert "".join(stream(tokenizer, ids, [1] * len(ids), skip_ids={eos})) == "fine"


def test_prompt_context_keeps_the_leading_space(tokenizer):
    prompt = tokenizer.encode("The cat")
    generated = tokenizer.encode(" sat down")
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    text = "".join(detok.add([t]) for t in generated) + detok.flush()
    assert text == " sat down"


def test_markup_tokens_stay_visible(tokenizer):
    ids = tokenizer.encode("<think>x</think>")
    assert "".join(stream(tokenizer, ids, [1] * len(ids))) == "<think>x</think>"


# --- stop strings ---------------------------------------------------------------------------


def run_stops(stops, pieces):
    matcher = StopMatcher(stops)
    out = [matcher.push(p) for p in pieces]
    return "".join(out) + matcher.flush(), matcher.matched


@pytest.mark.parametrize("stops,pieces,expected,matched", [
    ([], ["a", "b"], "ab", False),
    (["STOP"], ["hello ST", "OP world"], "hello ", True),
    (["STOP"], ["hello S", "T", "O", "P"], "hello ", True),
    (["STOP"], ["hello ST", "ill"], "hello STill", False),
    (["STOP"], ["end ST"], "end ST", False),  # flushed at the end: never became a stop
    (["\n\n", "END"], ["a\n", "b END\n\nc"], "a\nb ", True),
    (["ab", "b"], ["xab"], "x", True),  # the earliest match wins
    (["aaa"], ["aa", "aa"], "", True),
    (["日本"], ["こんにちは日", "本語"], "こんにちは", True),
])
def test_stop_strings(stops, pieces, expected, matched):
    assert run_stops(stops, pieces) == (expected, matched)


def test_partial_stop_is_held_back_not_emitted():
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("result </ans") == "result "
    assert matcher.push("wer> tail") == ""
    assert matcher.push("more") == ""


# --- a whole generation -----------------------------------------------------------------------


def finished(rid, reason, num_generated, cached=0):
    return RequestFinished(rid, reason, 5, cached, num_generated)


def test_generation_stop_string_cancels_and_reports_stop(tokenizer):
    ids = tokenizer.encode("one two STOP three")
    gen = Generation(tokenizer, prompt_ids=[1, 2, 3], stop=["STOP"])
    texts, cancels = [], []
    for t in ids:
        update = gen.on_event(TokensGenerated("r", (t,)))
        texts.append(update.text)
        cancels.append(update.cancel)
    assert "".join(texts) == "one two "
    assert cancels.count(True) == 1
    final = gen.on_event(finished("r", "cancelled", len(ids) + 2, cached=2))
    assert final.finish.reason == "stop"
    assert final.finish.usage.to_dict() == {
        "prompt_tokens": 5, "completion_tokens": len(ids) + 2, "total_tokens": len(ids) + 7,
        "prompt_tokens_details": {"cached_tokens": 2}}


def test_generation_flushes_held_text_at_the_end(tokenizer):
    gen = Generation(tokenizer, prompt_ids=[1], stop=["XYZ"])
    update = gen.on_event(TokensGenerated("r", tuple(tokenizer.encode("ab XY"))))
    final = gen.on_event(finished("r", "length", 3))
    assert update.text + final.text == "ab XY"
    assert final.finish.reason == "length" and final.done


def test_generation_failure_maps_to_an_api_error(tokenizer):
    gen = Generation(tokenizer, prompt_ids=[1])
    update = gen.on_event(RequestFailed("r", "queue_full", "busy", True, 2.5))
    assert update.error.status == 429 and update.error.headers["Retry-After"] == "3"


def test_failure_after_a_stop_match_is_still_a_stop(tokenizer):
    gen = Generation(tokenizer, prompt_ids=[1, 2], stop=["b"])
    assert gen.on_event(TokensGenerated("r", tuple(tokenizer.encode("a b")))).cancel
    update = gen.on_event(RequestFailed("r", "component_restarted", "x", True))
    assert update.error is None and update.finish.reason == "stop"
