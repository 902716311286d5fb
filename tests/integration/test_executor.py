"""The worker's step executor on a tiny model: decode bursts equal single steps, token for
token, and a burst that meets a stop token leaves the slot exactly as single steps would."""

import pytest

from proto.messages import DecodeItem, PrefillChunk, RunStep, SamplingParams
from worker.executor import StepExecutor
from worker.model_loading import load_model
from worker.slots import SlotStore

PROMPT = list(range(20, 80))


def _executor(model_dir, num_slots=2):
    loaded = load_model(str(model_dir))
    return StepExecutor(SlotStore(loaded.model, loaded.make_cache, num_slots, 1024), None, None)


def _prefill(ex, slot):
    ex.run(RunStep(0, prefills=(PrefillChunk(slot, 0, tuple(PROMPT[:-1])),)))


def _single_steps(ex, slot, n, stop=()):
    out, token = [], PROMPT[-1]
    for i in range(n):
        item = DecodeItem(slot, len(PROMPT) - 1 + i, token, SamplingParams(), i,
                          stop_token_ids=stop)
        [s] = ex.run(RunStep(1 + i, decodes=(item,))).sampled
        out.append(s.token_id)
        token = s.token_id
        if token in stop:
            break
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_burst_equals_single_steps(tiny_model_dir, arch):
    ex = _executor(tiny_model_dir(arch))
    _prefill(ex, 0)
    _prefill(ex, 1)
    reference = _single_steps(ex, 0, 10)
    item = DecodeItem(1, len(PROMPT) - 1, PROMPT[-1], SamplingParams(), 0, max_tokens=10)
    done = ex.run(RunStep(1, decodes=(item,), num_decode_steps=10))
    assert [s.token_id for s in done.sampled] == reference
    assert ex.store.tokens[1] == ex.store.tokens[0]


def test_burst_stops_at_a_stop_token_and_the_slot_continues_correctly(tiny_model_dir):
    ex = _executor(tiny_model_dir("qwen3"))
    _prefill(ex, 0)
    _prefill(ex, 1)
    first = _single_steps(ex, 0, 3)
    stop = first[2]
    item = DecodeItem(1, len(PROMPT) - 1, PROMPT[-1], SamplingParams(), 0, max_tokens=8,
                      stop_token_ids=(stop,))
    done = ex.run(RunStep(1, decodes=(item,), num_decode_steps=8))
    assert [s.token_id for s in done.sampled] == first
    # The slot holds the prompt and the tokens fed back, not the speculative one past the stop.
    assert ex.store.tokens[1] == PROMPT + first[:2]
    # Both slots continue identically from there.
    a = ex.run(RunStep(9, decodes=(DecodeItem(0, len(PROMPT) + 2, first[2], SamplingParams(), 3),)))
    b = ex.run(RunStep(10, decodes=(DecodeItem(1, len(PROMPT) + 2, first[2], SamplingParams(), 3),)))
    assert a.sampled[0].token_id == b.sampled[0].token_id
