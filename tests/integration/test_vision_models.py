"""The vision twins in process: the worker's pieces against mlx-vlm's own.

- A prefill split anywhere, inside an image too, then decode, gives mlx-vlm's greedy tokens
  (its generation embeds the whole prompt at once), with one encoder run per image.
- Multimodal RoPE positions of any chunk equal mlx-vlm's `get_rope_index` for the whole prompt.
- The gateway sizes an image's placeholders as mlx-vlm's processor does, over many sizes.
- A slot's images follow copies and truncation, and decode is positioned after them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import structlog

from switchyard.gateway.vision.prompt import image_prompt_for
from switchyard.common.images import image_id, open_rgb
from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import ImageData, ImageSpan, SamplingParams
from switchyard.worker.executor import StepExecutor
from switchyard.worker.model_loading import load_model
from switchyard.worker.vision.encoder import ImageEncoder
from switchyard.worker.vision.positions import positions
from switchyard.worker.vision.slots import VisionSlotStore
from switchyard.testing.vision import Reference, picture

ARCHS = ("qwen2_5_vl", "qwen3_vl", "gemma3")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def twins(tiny_model_dir):
    made = {}

    def get(arch):
        if arch not in made:
            path = tiny_model_dir(arch)
            made[arch] = (path, load_model(str(path)), Reference(path))
        return made[arch]

    return get


def prompt_of(reference, images: list[bytes]):
    parts = []
    for i, _ in enumerate(images):
        parts += [{"type": "text", "text": f"Picture {i}: "}, {"type": "image"}]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": "Compare."}]}]
    inputs = reference.prompt(messages, images)
    return messages, [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)], inputs


def spans_of(loaded, ids, images, inputs):
    family = loaded.model.family
    grids = np.asarray(inputs.get("image_grid_thw", np.zeros((len(images), 0)))).tolist()
    spans, i = [], 0
    for k, data in enumerate(images):
        while ids[i] != family.image_token_id:
            i += 1
        j = i
        while j < len(ids) and ids[j] == family.image_token_id:
            j += 1
        spans.append(ImageSpan(image_id(open_rgb(data)), i, j - i, tuple(grids[k])))
        i = j
    return tuple(spans)


def store_of(loaded, num_slots=2):
    encoder = ImageEncoder(loaded.model.family, loaded.processor, 1 << 28,
                           structlog.get_logger())
    return VisionSlotStore(loaded.model, loaded.make_cache, num_slots, 4096, encoder)


def run(store, slot, ids, spans, files, chunk):
    n = len(ids) - 1
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        store.prefill_chunk(PrefillChunk(slot, start, tuple(ids[start:end]),
                                         tuple(s for s in spans if s.start < end), files))
    out, last = [], ids[-1]
    for _ in range(MAX_TOKENS):
        logits = store.decode([slot], [len(store.tokens[slot])], [last])
        last = int(mx.argmax(logits[0]).item())
        out.append(last)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [5, 512])
def test_chunked_prefill_with_images_matches_mlx_vlm(twins, arch, chunk):
    _, loaded, reference = twins(arch)
    images = [picture(1, 60, 44), picture(2, 28, 70)]
    messages, ids, inputs = prompt_of(reference, images)
    expected, _ = reference.generate(messages, images, MAX_TOKENS)
    spans = spans_of(loaded, ids, images, inputs)
    files = tuple(ImageData(s.image_id, d) for s, d in zip(spans, images))
    store = store_of(loaded)
    got = run(store, 0, ids, spans, files, chunk)
    assert got[:len(expected)] == expected
    assert store.encoder.num_runs == 2  # once per image, however many chunks cover it
    assert store.take_encode_stats()[1] == sum(s.num_tokens for s in spans)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_equal_mlx_vlm(twins, arch):
    _, loaded, reference = twins(arch)
    images = [picture(3, 90, 40), picture(4, 40, 120)]
    _, ids, inputs = prompt_of(reference, images)
    spans = spans_of(loaded, ids, images, inputs)
    lm = loaded.model.vlm.language_model
    want, deltas = lm.get_rope_index(mx.array([ids]), mx.array(np.asarray(
        inputs["image_grid_thw"])))
    want = np.asarray(want)[:, 0, :]
    merge = loaded.model.family.merge
    assert (positions(spans, 0, len(ids), merge) == want).all()
    for start, length in ((0, 7), (5, 13), (spans[0].start + 1, 9), (len(ids) - 3, 3)):
        assert (positions(spans, start, length, merge) == want[:, start:start + length]).all()
    assert loaded.model.family.delta(spans, len(ids)) == int(np.asarray(deltas).item())


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_the_gateway_sizes_images_as_the_processor_does(twins, arch):
    path, loaded, reference = twins(arch)
    prompt = image_prompt_for(path, reference.tokenizer)
    family = loaded.model.family
    for width, height in [(1, 1), (27, 29), (56, 48), (64, 64), (100, 30), (300, 200),
                          (17, 400), (1000, 999)]:
        from PIL import Image

        image = Image.new("RGB", (width, height), (5, 6, 7))
        inputs = loaded.processor(text=family.marker, images=[image])
        count = int(np.sum(np.asarray(inputs["input_ids"]) == family.image_token_id))
        sized = prompt.tokens_for(width, height, "p")
        assert sized.num_tokens == count, (width, height)
        assert sized.grid == family.grid(inputs)


def test_a_slots_images_follow_copies_and_truncation(twins):
    _, loaded, reference = twins("qwen2_5_vl")
    images = [picture(5, 64, 64)]
    messages, ids, inputs = prompt_of(reference, images)
    expected, _ = reference.generate(messages, images, MAX_TOKENS)
    spans = spans_of(loaded, ids, images, inputs)
    files = (ImageData(spans[0].image_id, images[0]),)
    store = store_of(loaded)
    n = len(ids) - 1
    store.prefill_chunk(PrefillChunk(0, 0, tuple(ids[:n]), spans, files))
    store.copy_prefix(0, 1, n)
    assert store.slot_images(1) == spans
    # Decoding the copy is positioned after its image: mlx-vlm's tokens.
    out, last = [], ids[-1]
    for _ in range(MAX_TOKENS):
        logits = store.decode([1], [len(store.tokens[1])], [last])
        last = int(mx.argmax(logits[0]).item())
        out.append(last)
    assert out[:len(expected)] == expected
    store.truncate(0, spans[0].start)
    assert store.slot_images(0) == ()


def image_and_text_slots(loaded, reference, image):
    """A store whose slot 0 holds a prompt with `image` and slot 1 a text-only prompt, each
    prefilled up to its last token; with each prompt's ids and mlx-vlm's greedy tokens."""
    images = [image]
    messages, ids_a, inputs = prompt_of(reference, images)
    expected_a, _ = reference.generate(messages, images, MAX_TOKENS)
    text = [{"role": "user", "content": "A text-only question about boats."}]
    expected_b, _ = reference.generate(text, [], MAX_TOKENS)
    ids_b = [int(t) for t in np.asarray(reference.prompt(text, [])["input_ids"]).reshape(-1)]
    spans = spans_of(loaded, ids_a, images, inputs)
    store = store_of(loaded)
    store.prefill_chunk(PrefillChunk(0, 0, tuple(ids_a[:-1]), spans,
                                     (ImageData(spans[0].image_id, image),)))
    store.prefill_chunk(PrefillChunk(1, 0, tuple(ids_b[:-1])))
    return store, (ids_a, expected_a), (ids_b, expected_b)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
def test_batched_decode_positions_each_row_after_its_own_images(twins, arch):
    """A slot with images and a slot without decode in one batch: each row gives the tokens it
    gives alone (a Qwen-VL row's text positions are offset by its images, the other's not)."""
    _, loaded, reference = twins(arch)
    store, (ids_a, expected_a), (ids_b, expected_b) = image_and_text_slots(
        loaded, reference, picture(8, 80, 56))
    got, last = ([], []), [ids_a[-1], ids_b[-1]]
    for _ in range(MAX_TOKENS):
        logits = store.decode([0, 1], [len(store.tokens[0]), len(store.tokens[1])], last)
        last = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
        got[0].append(last[0])
        got[1].append(last[1])
    assert got[0][:len(expected_a)] == expected_a
    assert got[1][:len(expected_b)] == expected_b


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_verify_to_mlx_vlms_greedy_tokens(twins, arch):
    """Speculative decoding on a vision twin (docs/design/speculative-decoding.md "Speculative decoding"): verify
    passes position their rows after the images as plain decode does, so drafts accepted
    fully, partly and not at all give mlx-vlm's greedy tokens. A Qwen-VL slot with an image
    verifies in one pass with a text-only slot (their M-RoPE offsets differ); Gemma 3's
    sliding-window rings verify a lone sequence."""
    _, loaded, reference = twins(arch)
    store, (ids_a, expected_a), (ids_b, expected_b) = image_and_text_slots(
        loaded, reference, picture(9, 72, 52))
    batched = store.verifiable == "batched"
    assert store.verifiable == ("alone" if arch == "gemma3" else "batched")
    seqs = [(0, ids_a, expected_a)] + ([(1, ids_b, expected_b)] if batched else [])
    executor = StepExecutor(store, None, None)
    got = {slot: [] for slot, _, _ in seqs}
    drafts = iter([lambda e, n: e[n:n + 4],  # accepted fully
                   lambda e, n: e[n:n + 2] + [e[n + 2] + 1] if n + 2 < len(e) else [],  # partly
                   lambda e, n: [e[n] + 1] if n < len(e) else []])  # not at all
    step, proposed = 0, 0
    while any(len(got[s]) < len(e) for s, _, e in seqs):
        make = next(drafts, lambda e, n: e[n:n + 3])
        items = []
        for slot, ids, expected in seqs:
            n = len(got[slot])
            if n >= len(expected):
                continue
            draft = tuple(make(expected, n))
            proposed += len(draft)
            items.append(DecodeItem(slot, len(ids) - 1 + n, got[slot][-1] if n else ids[-1],
                                    SamplingParams(), n, burst_limit=len(expected) - n,
                                    draft=draft))
        step += 1
        for t in executor.run(RunStep(step, decodes=tuple(items))).sampled:
            got[t.slot].append(t.token_id)
    for slot, _, expected in seqs:
        assert got[slot] == expected, slot
    assert step < len(expected_a) and proposed  # drafts were verified and kept
