"""Speculative decoding in the worker, in-process on the family twins
(docs/design/speculative-decoding.md "Speculative decoding"): a decode step that verifies proposed
tokens gives, token for token, the greedy output of plain decode steps, for every cache kind,
batched (rows keeping different numbers of tokens in one pass, recurrent states included) and alone
(sliding-window rings), under a JSON-schema constraint, and with --kv-bits 8; a seeded sampled
request gives the same tokens with or without drafts.

A verify pass multiplies several rows at once, so its float rounding may differ from single
steps: a divergence is accepted only where the reference's top-2 logit gap is below 1e-4
(a measured near-tie), and reported as a warning.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from switchyard.gateway.request import structured
from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.worker.cache_kinds import verifiable
from switchyard.worker.constraints import ConstraintEngine, llguidance_tokenizer
from switchyard.worker.executor import StepExecutor
from switchyard.worker.kv_layout import kv_quant
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore
from tests.helpers.speculation import STOP, assert_same_or_near_tie, decode_plainly

# Longer than the sliding-window twins' window (128): their rings have wrapped.
PROMPTS = [[20 + (i * 37 + s * 11) % 900 for i in range(140 + 9 * s)] for s in range(4)]
# Attention KV (cut back per row) and hybrids (a row's recurrent state taken back and its kept
# tokens fed again): every decoding sequence verifies in one pass.
BATCHED = ["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe", "minimax", "mistral3",
           "deepseek_v3", "deepseek_v32", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
# Sliding-window rings: a lone decoding sequence.
ALONE = ["gpt_oss", "gemma3_text", "gemma4_text"]


class Driver:
    """Slots 0..n-1 decode plainly (the reference); slots n..2n-1 the same prompts with drafts."""

    def __init__(self, path, num_seqs: int, kv_bits: int = 0, constraints=None):
        loaded = load_model(str(path), kv_quant(kv_bits, 64))
        self.store = SlotStore(loaded.model, loaded.make_cache, 2 * num_seqs, 2048)
        self.ex = StepExecutor(self.store, None, None, constraints)
        self.n = num_seqs
        self.step = 0
        for s in range(num_seqs):
            for slot in (s, num_seqs + s):
                self.run(prefills=(PrefillChunk(slot, 0, tuple(PROMPTS[s][:-1])),))

    def run(self, **kw):
        self.step += 1
        return self.ex.run(RunStep(self.step, **kw))

    def plain(self, length: int, sampling=SamplingParams()):
        """The reference: slots 0..n-1 decoded plainly (tests/helpers/speculation.py)."""
        return decode_plainly(self.store, self.run, PROMPTS[:self.n], length, sampling)

    def speculative(self, reference, length: int, sampling=SamplingParams(), seed: int = 0,
                    corrupt=lambda d, rng: d):
        """Steps with drafts taken from `reference`: of random lengths, some cut short by a
        wrong token (accepted partly), some wrong from the start (not at all)."""
        rng = random.Random(seed)
        out = [[] for _ in range(self.n)]
        inputs = [p[-1] for p in PROMPTS[:self.n]]
        stats = {"proposed": 0, "accepted": 0, "steps": 0}
        while any(len(o) < length and (not o or o[-1] not in STOP) for o in out):
            items = []
            for s in range(self.n):
                n = len(out[s])
                if n >= length or (out[s] and out[s][-1] in STOP):
                    continue
                draft = list(reference[s][n:n + rng.choice([0, 1, 3, 5, 8])])
                if draft and rng.random() < 0.4:
                    j = rng.randrange(len(draft))
                    draft[j] = (draft[j] + 1 + rng.randrange(50)) % 4000
                draft = corrupt(draft, rng)
                stats["proposed"] += len(draft)
                items.append(DecodeItem(self.n + s, len(PROMPTS[s]) - 1 + n, inputs[s],
                                        sampling, n, burst_limit=length - n,
                                        stop_token_ids=STOP, draft=tuple(draft)))
            done = self.run(decodes=tuple(items))
            stats["steps"] += 1
            for t in done.sampled:
                out[t.slot - self.n].append(t.token_id)
                inputs[t.slot - self.n] = t.token_id
            for item in items:  # the slot holds the prompt and what was kept, nothing else
                s = item.slot - self.n
                assert self.store.tokens[item.slot] == PROMPTS[s] + out[s][:-1]
        return out, stats


@pytest.mark.parametrize("arch", BATCHED)
def test_batched_verification_gives_the_greedy_tokens_of_plain_decode(tiny_model_dir, arch):
    d = Driver(tiny_model_dir(arch), 4)
    assert d.store.verifiable == "batched"
    ref, gaps = d.plain(24)
    spec, stats = d.speculative(ref, 24)
    for s in range(4):
        assert_same_or_near_tie(spec[s], ref[s], gaps[s], f"{arch} row {s}")
    assert stats["steps"] < 24  # drafts were accepted: fewer passes than tokens


@pytest.mark.parametrize("arch", ALONE)
def test_a_lone_sequence_verifies_on_sliding_window_rings(tiny_model_dir, arch):
    d = Driver(tiny_model_dir(arch), 1)
    assert d.store.verifiable == "alone"
    ref, gaps = d.plain(24)
    spec, stats = d.speculative(ref, 24)
    assert_same_or_near_tie(spec[0], ref[0], gaps[0], arch)
    assert stats["steps"] < 24


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_quantized_kv_rows_verify_exactly(tiny_model_dir, arch):
    """--kv-bits 8: attention rows quantized as written, alone and beside recurrent states
    (hybrid). (The MLA twin's 16-wide heads take no quantization group MLX supports.)"""
    d = Driver(tiny_model_dir(arch), 4, kv_bits=8)
    assert d.store.verifiable == "batched"
    ref, gaps = d.plain(24)
    spec, stats = d.speculative(ref, 24)
    for s in range(4):
        assert_same_or_near_tie(spec[s], ref[s], gaps[s], f"{arch} kv8 row {s}")
    assert stats["steps"] < 24


def test_a_cache_kind_without_an_undo_is_not_verified(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("deepseek_v41")))
    assert verifiable(loaded.make_cache()) == ""


def test_drafts_accepted_fully_partly_and_not_at_all(tiny_model_dir):
    d = Driver(tiny_model_dir("qwen3"), 3)
    ref, _ = d.plain(6)
    n = d.n
    prompt_ends = [len(PROMPTS[s]) - 1 for s in range(3)]
    drafts = [ref[0][:5], ref[1][:2] + [9, 9, 9], [9] + ref[2][1:5]]
    items = tuple(DecodeItem(n + s, prompt_ends[s], PROMPTS[s][-1], SamplingParams(), 0,
                             burst_limit=10, draft=tuple(drafts[s])) for s in range(3))
    done = d.run(decodes=items)
    got = {s: [t.token_id for t in done.sampled if t.slot == n + s] for s in range(3)}
    assert got[0] == ref[0][:6]  # all five kept, plus the model's next
    assert got[1] == ref[1][:3]  # two kept, the third replaced by the model's
    assert got[2] == ref[2][:1]  # none kept: the model's own token
    for s in range(3):
        assert d.store.tokens[n + s] == PROMPTS[s] + got[s][:-1]


def test_a_stop_token_or_the_limit_ends_what_a_verify_pass_emits(tiny_model_dir):
    d = Driver(tiny_model_dir("qwen3"), 2)
    ref, _ = d.plain(6)
    items = (DecodeItem(2, len(PROMPTS[0]) - 1, PROMPTS[0][-1], SamplingParams(), 0,
                        burst_limit=10, stop_token_ids=(ref[0][2],), draft=tuple(ref[0][:5])),
             DecodeItem(3, len(PROMPTS[1]) - 1, PROMPTS[1][-1], SamplingParams(), 0,
                        burst_limit=2, draft=tuple(ref[1][:5])))
    done = d.run(decodes=items)
    assert [t.token_id for t in done.sampled if t.slot == 2] == ref[0][:3]
    assert [t.token_id for t in done.sampled if t.slot == 3] == ref[1][:2]
    assert d.store.tokens[2] == PROMPTS[0] + ref[0][:2]
    assert d.store.tokens[3] == PROMPTS[1] + ref[1][:1]


def test_seeded_sampling_gives_the_same_tokens_with_or_without_drafts(tiny_model_dir):
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=1234)
    d = Driver(tiny_model_dir("qwen3"), 2)
    ref, _ = d.plain(20, sampling)
    spec, _ = d.speculative(ref, 20, sampling)
    assert spec == ref


SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tags", "n"], "additionalProperties": False}


def test_constrained_drafts_are_cut_where_the_grammar_rejects_them(tiny_model_dir):
    pytest.importorskip("llguidance")
    path = tiny_model_dir("qwen3")
    engine = ConstraintEngine(lambda: llguidance_tokenizer(str(path)))
    sampling = SamplingParams(grammar=structured.json_schema(SCHEMA, "s").grammar)
    d = Driver(path, 2, constraints=engine)
    ref, _ = d.plain(60, sampling)

    def with_a_foreign_token(draft, rng):  # 17 is never valid JSON here: cut before it
        return draft[:2] + [17] + draft[2:] if draft and rng.random() < 0.5 else draft

    spec, stats = d.speculative(ref, 60, sampling, corrupt=with_a_foreign_token)
    assert spec == ref
    from switchyard.common.tokenizer_loading import load_tokenizer

    text = load_tokenizer(str(path)).decode([t for t in spec[0] if t not in STOP])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.num_errors == 0
