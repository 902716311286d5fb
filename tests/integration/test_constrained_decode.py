"""Constrained decoding in the worker, in-process on the tiny model: a matcher rebuilt from the
generated tokens (a worker restart, a preemption, a restore) continues exactly as the one that
ran all along; constrained and free rows share a batch; a burst stops where the grammar ends."""

from __future__ import annotations

import json

import jsonschema
import pytest

from switchyard.gateway.request import structured
from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.worker.constraints import ConstraintEngine, llguidance_tokenizer
from switchyard.worker.executor import StepExecutor
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore

pytest.importorskip("llguidance")
PROMPT = list(range(20, 70))
SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    return path, load_model(str(path))


def executor(model, num_slots=2) -> StepExecutor:
    path, loaded = model
    engine = ConstraintEngine(lambda: llguidance_tokenizer(str(path)))
    return StepExecutor(SlotStore(loaded.model, loaded.make_cache, num_slots, 2048), None, None,
                        engine)


def decode(ex, slot, prompt, sampling, generated, n, burst=1):
    """Continue the slot's request (prompt + generated so far) for up to n tokens."""
    out = list(generated)
    while len(out) - len(generated) < n:
        token = out[-1] if out else prompt[-1]
        item = DecodeItem(slot, len(prompt) - 1 + len(out), token, sampling, len(out),
                          burst_limit=burst, stop_token_ids=(4087, 4089))
        sampled = [s.token_id for s in ex.run(RunStep(len(out), decodes=(item,),
                                                      num_decode_steps=burst)).sampled]
        out += sampled
        if sampled[-1] in (4087, 4089):
            break
    return out


def test_rebuilt_matcher_continues_exactly(model):
    grammar = structured.json_schema(SCHEMA, "s").grammar
    sampling = SamplingParams(grammar=grammar)
    ex = executor(model)
    ex.run(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(PROMPT[:-1])),)))
    whole = decode(ex, 0, PROMPT, sampling, [], 200)
    assert whole[-1] in (4087, 4089)
    text = ex_decode(model, whole[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
    # A new worker (no matcher) gets the slot back with the first 7 tokens generated.
    fresh = executor(model)
    head = whole[:7]
    fresh.run(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(PROMPT + head[:-1])),)))
    assert decode(fresh, 0, PROMPT, sampling, head, 200) == whole


def test_constrained_and_free_rows_share_a_batch_and_bursts_stop_at_the_end(model):
    grammar = structured.choice(["alpha", "beta"], "c").grammar
    ex = executor(model)
    for slot in (0, 1):
        ex.run(RunStep(0, prefills=(PrefillChunk(slot, 0, tuple(PROMPT[:-1])),)))
    items = (DecodeItem(0, len(PROMPT) - 1, PROMPT[-1], SamplingParams(grammar=grammar), 0,
                        burst_limit=8, stop_token_ids=(4087, 4089)),
             DecodeItem(1, len(PROMPT) - 1, PROMPT[-1], SamplingParams(), 0, burst_limit=8))
    done = ex.run(RunStep(1, decodes=items, num_decode_steps=8))
    constrained = [s.token_id for s in done.sampled if s.slot == 0]
    free = [s.token_id for s in done.sampled if s.slot == 1]
    assert constrained[-1] in (4087, 4089)
    assert ex_decode(model, constrained[:-1]) in ("alpha", "beta")
    assert len(free) == 8
    # The free row is what it would have been alone.
    alone = executor(model)
    alone.run(RunStep(0, prefills=(PrefillChunk(1, 0, tuple(PROMPT[:-1])),)))
    assert decode(alone, 1, PROMPT, SamplingParams(), [], 8) == free


def ex_decode(model, tokens) -> str:
    from switchyard.common.tokenizer_loading import load_tokenizer

    path, _ = model
    return load_tokenizer(str(path)).decode(tokens)


def test_a_constrained_burst_equals_single_steps(model):
    """A lone constrained sequence decodes a burst pipelined (its mask computed while the next
    forward pass runs): the same tokens as one step at a time."""
    sampling = SamplingParams(grammar=structured.json_schema(SCHEMA, "s").grammar)
    single, burst = executor(model), executor(model)
    for ex in (single, burst):
        ex.run(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(PROMPT[:-1])),)))
    one_by_one = decode(single, 0, PROMPT, sampling, [], 200)
    assert decode(burst, 0, PROMPT, sampling, [], 200, burst=8) == one_by_one
    assert burst.store.tokens[0] == single.store.tokens[0]


def test_grammars_are_compiled_off_the_step_and_released(model):
    """PrepareGrammar compiles on the grammar thread; a step of that
    request finds it compiled; a grammar no request holds stays only among the few kept for
    reuse; one that does not compile is reported, not raised."""
    import time

    from switchyard.worker.constraints import MAX_UNUSED_GRAMMARS, grammar_key

    ex = executor(model)
    engine = ex.constraints
    grammar = structured.json_schema(SCHEMA, "s").grammar
    engine.prepare("r1", grammar)
    assert engine.busy
    deadline = time.monotonic() + 120
    done = []
    while not done:
        assert time.monotonic() < deadline
        done = engine.prepared()
        time.sleep(0.01)
    assert done[0][:2] == ("r1", "") and not engine.busy
    ex.run(RunStep(0, prefills=(PrefillChunk(0, 0, tuple(PROMPT[:-1])),)))
    out = decode(ex, 0, PROMPT, SamplingParams(grammar=grammar), [], 200)
    jsonschema.validate(json.loads(ex_decode(model, out[:-1])), SCHEMA)
    assert engine.num_compiled_in_step == 0
    engine.release("r1")
    assert grammar_key(grammar) in engine._compiled  # kept for reuse, not held
    for i in range(MAX_UNUSED_GRAMMARS + 1):
        engine._compiled[bytes([i % 256, i // 256]) * 8] = object()
        engine._keep_unused(bytes([i % 256, i // 256]) * 8)
    assert grammar_key(grammar) not in engine._compiled
    engine.prepare("bad", '{"grammars": [{"lark_grammar": "start: ("}]}')
    while engine.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        done = engine.prepared() or done
    assert done[0][0] == "bad" and done[0][1]
