"""The worker's step executor on a tiny model: decode bursts equal single steps, token for
token, and a burst that meets a stop token leaves the slot exactly as single steps would."""

import mlx.core as mx
import pytest

from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.worker.executor import StepExecutor
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore

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
    item = DecodeItem(1, len(PROMPT) - 1, PROMPT[-1], SamplingParams(), 0, burst_limit=10)
    done = ex.run(RunStep(1, decodes=(item,), num_decode_steps=10))
    assert [s.token_id for s in done.sampled] == reference
    assert ex.store.tokens[1] == ex.store.tokens[0]


def test_burst_stops_at_a_stop_token_and_the_slot_continues_correctly(tiny_model_dir):
    ex = _executor(tiny_model_dir("qwen3"))
    _prefill(ex, 0)
    _prefill(ex, 1)
    first = _single_steps(ex, 0, 3)
    stop = first[2]
    item = DecodeItem(1, len(PROMPT) - 1, PROMPT[-1], SamplingParams(), 0, burst_limit=8,
                      stop_token_ids=(stop,))
    done = ex.run(RunStep(1, decodes=(item,), num_decode_steps=8))
    assert [s.token_id for s in done.sampled] == first
    # The slot holds the prompt and the tokens fed back, not the speculative one past the stop.
    assert ex.store.tokens[1] == PROMPT + first[:2]
    # Both slots continue identically from there.
    a = ex.run(RunStep(9, decodes=(DecodeItem(0, len(PROMPT) + 2, first[2], SamplingParams(), 3),)))
    b = ex.run(RunStep(10, decodes=(DecodeItem(1, len(PROMPT) + 2, first[2], SamplingParams(), 3),)))
    assert a.sampled[0].token_id == b.sampled[0].token_id


# A long prompt for the sliding-window twins (window 128): their rings have wrapped before
# the burst starts, and the burst writes over the ring's oldest slots. Hybrids (recurrent
# state), sliding windows (gemma4_text: also KV shared between layers) and a compound cache
# (deepseek_v32's CacheList).
RING_PROMPT = [20 + (i * 37) % 900 for i in range(200)]
UNDO_ARCHS = ["qwen3_5", "qwen3_next", "gpt_oss", "gemma3_text", "gemma4_text", "deepseek_v32"]


def _undo_executor(model_dir):
    loaded = load_model(str(model_dir))
    store = SlotStore(loaded.model, loaded.make_cache, 2, 1024)
    assert store.drops_last_token  # these families take the pipelined burst
    ex = StepExecutor(store, None, None)
    for slot in (0, 1):
        ex.run(RunStep(0, prefills=(PrefillChunk(slot, 0, tuple(RING_PROMPT[:-1])),)))
    return ex


def _steps_until_new(ex, slot, limit=7):
    """Single (unpipelined) steps until a token not sampled before comes: that token is the
    stop token of the burst of 8 that follows, which then stops early, before its last token
    (so a speculative token was fed past it). The slot holds the prompt and the tokens before
    it."""
    out, token = [], RING_PROMPT[-1]
    for i in range(limit):
        item = DecodeItem(slot, len(RING_PROMPT) - 1 + i, token, SamplingParams(), i)
        [s] = ex.run(RunStep(1 + i, decodes=(item,))).sampled
        out.append(s.token_id)
        token = s.token_id
        if i and token not in out[:-1]:
            return out
    pytest.fail(f"no new token in {limit} steps: {out}")


def _assert_same_continuation(ex, fed):
    """Slots 0 and 1 give bit-identical logits for the next token, for a decode after it, as
    two rows of one batch (merged caches), and after a prefill chunk (a ring's chunk path
    reorders it)."""
    store, pos = ex.store, len(RING_PROMPT) + len(fed) - 1
    assert store.tokens[0] == store.tokens[1] == RING_PROMPT + fed[:-1]
    for slot in (0, 1):
        store.parked(slot)
    for token in (fed[-1], 7):
        a = store.decode([0], [pos], [token])
        b = store.decode([1], [pos], [token])
        assert mx.array_equal(a, b).item()
        pos += 1
    rows = store.decode([0, 1], [pos, pos], [5, 5])
    assert mx.array_equal(rows[0], rows[1]).item()
    pos += 1
    chunk = list(range(300, 340))
    for slot in (0, 1):
        store.prefill(slot, pos, chunk)
    a = store.decode([0], [pos + len(chunk)], [11])
    b = store.decode([1], [pos + len(chunk)], [11])
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("arch", UNDO_ARCHS)
def test_burst_stopped_by_a_stop_token_leaves_the_state_of_single_steps(tiny_model_dir, arch):
    """The speculative token fed past the stop is undone exactly: recurrent layers get their
    state back, attention layers and rings drop it (docs/design/kv-pages.md "Hybrid models")."""
    ex = _undo_executor(tiny_model_dir(arch))
    first = _steps_until_new(ex, 0)
    item = DecodeItem(1, len(RING_PROMPT) - 1, RING_PROMPT[-1], SamplingParams(), 0,
                      burst_limit=8, stop_token_ids=(first[-1],))
    done = ex.run(RunStep(20, decodes=(item,), num_decode_steps=8))
    assert [s.token_id for s in done.sampled] == first
    _assert_same_continuation(ex, first)


@pytest.mark.parametrize("arch", UNDO_ARCHS)
def test_burst_stopped_by_its_limit_leaves_the_state_of_single_steps(tiny_model_dir, arch):
    """A burst cut short by its burst_limit queues nothing past its last token."""
    ex = _undo_executor(tiny_model_dir(arch))
    first = _steps_until_new(ex, 0)
    item = DecodeItem(1, len(RING_PROMPT) - 1, RING_PROMPT[-1], SamplingParams(), 0,
                      burst_limit=len(first))
    done = ex.run(RunStep(20, decodes=(item,), num_decode_steps=8))
    assert [s.token_id for s in done.sampled] == first
    _assert_same_continuation(ex, first)
