"""A draft model drafting in the worker (--draft-model; docs/design/speculative-decoding.md "Speculative decoding"),
in-process on the tiny twins: batched over rows of different lengths, its drafts verified by
the model's one pass, greedy output token for token that of plain decode steps; a twin as its
own draft has every draft accepted; a slot whose contents change (a copy, a restore) makes
the drafter catch up in bounded steps; tokenizers that differ are refused in one line.

A verify pass multiplies several rows at once, so its float rounding may differ from single
steps: a divergence is accepted only where the reference's top-2 logit gap is below 1e-4
(a measured near-tie), and reported as a warning.
"""

from __future__ import annotations

import json
import shutil
import warnings
from types import SimpleNamespace

import jsonschema
import mlx.core as mx
from mlx.utils import tree_map
import numpy as np
import pytest

from switchyard.gateway.request import structured
from switchyard.proto.scheduler_worker import CopyPrefix, DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.common.speculation import num_accepted
from switchyard.common.tokenizer_loading import load_tokenizer
from switchyard.worker.constraints import ConstraintEngine, llguidance_tokenizer
from switchyard.worker.draft_model import DraftModelDrafter, load_drafter
from switchyard.worker.drafters import DraftRow
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.executor import StepExecutor
from switchyard.worker.model_loading import load_model
from switchyard.worker.slots import SlotStore
from tests.helpers.speculation import NEAR_TIE, STOP, assert_same_or_near_tie, decode_plainly

PROMPTS = [[20 + (i * 37 + s * 11) % 900 for i in range(40 + 23 * s)] for s in range(4)]


class Driver:
    """Slots 0..n-1 decode plainly (the reference); slots n..2n-1 the same prompts, drafted by
    the draft model and verified."""

    def __init__(self, main_path, draft_path, num_seqs: int, catch_up: int = 512,
                 noise: float = 0.0, constraints=None):
        main = load_model(str(main_path))
        draft = main if draft_path == main_path and not noise else load_model(str(draft_path))
        if noise:  # the model with its weights disturbed: drafts accepted partly
            rng = np.random.default_rng(0)
            draft.model.update(tree_map(
                lambda w: w + mx.array(rng.normal(0, noise, w.shape).astype(np.float32))
                * mx.abs(w).mean(), draft.model.parameters()))
        self.n = n = num_seqs
        self.store = SlotStore(main.model, main.make_cache, 2 * n + 1, 2048)
        self.drafter = DraftModelDrafter(
            SlotStore(draft.model, draft.make_cache, 2 * n + 1, 2048), catch_up, 1 << 20)
        self.ex = StepExecutor(self.store, None, None, constraints, drafter=self.drafter)
        self.step = 0
        for s in range(n):
            for slot in (s, n + s):
                self.run(prefills=(PrefillChunk(slot, 0, tuple(PROMPTS[s][:-1])),))

    def run(self, **kw):
        self.step += 1
        return self.ex.run(RunStep(self.step, **kw))

    def plain(self, length: int, sampling=SamplingParams()):
        """The reference: slots 0..n-1 decoded plainly (tests/helpers/speculation.py)."""
        return decode_plainly(self.store, self.run, PROMPTS[:self.n], length, sampling)

    def drafted(self, length: int, k: int, slots=None, prompts=None, done_before=None,
                sampling=SamplingParams()):
        """Steps whose rows ask the drafter for k tokens; the tokens and the counts."""
        slots = slots or [self.n + s for s in range(self.n)]
        prompts = prompts or PROMPTS[:self.n]
        out = [list(d) for d in done_before] if done_before else [[] for _ in slots]
        inputs = [o[-1] if o else p[-1] for o, p in zip(out, prompts)]
        stats = {"proposed": 0, "accepted": 0, "steps": 0, "undrafted_steps": 0}
        while any(len(o) < length and (not o or o[-1] not in STOP) for o in out):
            items = []
            for r, slot in enumerate(slots):
                m = len(out[r])
                if m >= length or (out[r] and out[r][-1] in STOP):
                    continue
                items.append(DecodeItem(slot, len(prompts[r]) - 1 + m, inputs[r],
                                        sampling, m, burst_limit=min(k + 1, length - m),
                                        stop_token_ids=STOP, draft_tokens=k))
            done = self.run(decodes=tuple(items))
            stats["steps"] += 1
            sampled = {}
            for t in done.sampled:
                sampled.setdefault(t.slot, []).append(t.token_id)
            stats["undrafted_steps"] += not done.drafts
            for d in done.drafts:
                stats["proposed"] += len(d.token_ids)
                stats["accepted"] += num_accepted(d.token_ids, sampled[d.slot])
            # At most k tokens a row, one batched pass per token (plus catch-up prefills).
            assert all(len(d.token_ids) <= k for d in done.drafts)
            assert done.num_draft_passes >= max((len(d.token_ids) for d in done.drafts),
                                                default=0)
            for r, slot in enumerate(slots):
                out[r].extend(sampled.get(slot, []))
                if sampled.get(slot):
                    inputs[r] = out[r][-1]
            for item in items:
                r = slots.index(item.slot)
                held = self.store.tokens[item.slot]
                assert held == prompts[r] + out[r][:-1]  # nothing rejected stays in the slot
                ahead = self.drafter.store.tokens[item.slot]  # the drafter trails the slot
                assert ahead == held[:len(ahead)]
        return out, stats


def test_a_twin_as_its_own_draft_model_has_every_draft_accepted(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    d = Driver(path, path, 4)
    ref, gaps = d.plain(30)
    spec, stats = d.drafted(30, 4)
    for s in range(4):
        assert_same_or_near_tie(spec[s], ref[s], gaps[s], f"row {s}")
    assert stats["proposed"] > 0
    if stats["accepted"] < stats["proposed"]:  # only a near-tie can reject a token of itself
        assert any(g < NEAR_TIE for row in gaps for g in row), stats
        warnings.warn(f"own draft: {stats}")
    # Every step after the first yields several tokens per row.
    assert stats["steps"] < 30 / 2, stats


def test_a_disturbed_twin_drafts_partly_accepted_and_the_output_is_plain_decode(
        tiny_model_dir):
    path = tiny_model_dir("qwen3")
    d = Driver(path, path, 4, noise=0.03)
    ref, gaps = d.plain(40)
    spec, stats = d.drafted(40, 5)
    for s in range(4):
        assert_same_or_near_tie(spec[s], ref[s], gaps[s], f"row {s}")
    assert 0 < stats["accepted"] < stats["proposed"], stats


def test_a_seeded_sampled_request_gives_the_same_tokens_with_draft_model_drafts(
        tiny_model_dir):
    """The drafts are greedy point masses: each verify position samples the model's token
    with the plain step's key, so a seeded request's tokens do not depend on them."""
    path = tiny_model_dir("qwen3")
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=1234)
    d = Driver(path, path, 2, noise=0.01)
    ref, _ = d.plain(30, sampling)
    spec, stats = d.drafted(30, 4, sampling=sampling)
    assert spec == ref
    assert stats["proposed"] > 0 and stats["accepted"] > 0


SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tags", "n"], "additionalProperties": False}


def test_a_json_schema_constrained_reply_is_the_same_with_draft_model_drafts(tiny_model_dir):
    """The draft model knows nothing of the grammar: its drafts are cut before the first
    token the grammar rejects, and every verify position is masked as a plain step is."""
    pytest.importorskip("llguidance")
    path = tiny_model_dir("qwen3")
    engine = ConstraintEngine(lambda: llguidance_tokenizer(str(path)))
    sampling = SamplingParams(grammar=structured.json_schema(SCHEMA, "s").grammar)
    d = Driver(path, path, 2, noise=0.03, constraints=engine)
    ref, _ = d.plain(60, sampling)
    spec, stats = d.drafted(60, 4, sampling=sampling)
    assert spec == ref
    assert stats["proposed"] > 0
    text = load_tokenizer(str(path)).decode([t for t in spec[0] if t not in STOP])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.num_errors == 0


@pytest.mark.parametrize("draft_arch", ["llama", "qwen3_next"])
def test_another_twin_with_the_same_tokenizer_drafts_and_the_output_is_plain_decode(
        tiny_model_dir, draft_arch):
    main = tiny_model_dir("qwen3")
    draft = tiny_model_dir(draft_arch, seed=1) if draft_arch == "llama" else None
    if draft is None:  # a hybrid model cannot be cut back at a token: refused as a draft
        settings = SimpleNamespace(draft_model=str(tiny_model_dir(draft_arch)), worker_slots=2,
                                   ctx=2048, prefill_chunk=64)
        with pytest.raises(ModelLoadError, match="cannot be cut back at a token"):
            load_drafter(settings, load_model(str(main)))
        return
    d = Driver(main, draft, 3)
    ref, gaps = d.plain(40)
    for k in (1, 3, 6):
        d = Driver(main, draft, 3)
        spec, stats = d.drafted(40, k)
        for s in range(3):
            assert_same_or_near_tie(spec[s], ref[s], gaps[s], f"k={k} row {s}")
        assert stats["proposed"] > 0


def test_a_slot_whose_contents_change_makes_the_drafter_catch_up_in_bounded_steps(
        tiny_model_dir):
    path = tiny_model_dir("qwen3")
    d = Driver(path, path, 2, catch_up=16)
    ref, gaps = d.plain(24)
    # Two rows far behind share one step's bound: 16 tokens prefilled in all, no drafts yet.
    rows = [DraftRow(slot, d.store.tokens[slot] + [PROMPTS[s][-1]], 3, STOP)
            for s, slot in ((0, 2), (1, 3))]
    assert d.drafter.propose(rows) == [(), ()]
    assert sum(len(d.drafter.store.tokens[slot]) for slot in (2, 3)) == 16
    assert d.drafter.take_catch_up_tokens() == 16
    # Row 0 decodes 8 tokens with drafts; its drafter state reaches the slot (40 tokens:
    # 16 held, a step of 16 more without a draft first).
    first, stats = d.drafted(8, 3, slots=[2], prompts=[PROMPTS[0]])
    assert first[0] == ref[0][:len(first[0])]
    assert stats["undrafted_steps"] == 1
    # The conversation moves to slot 4 (a copy, as a restore or a fork brings it): the
    # drafter has nothing of it there and catches up, 16 tokens a step, then drafts again.
    held = len(d.store.tokens[2])
    d.run(copies=(CopyPrefix(2, 4, held),))
    assert d.drafter.store.tokens[4] == []
    spec, stats = d.drafted(24, 3, slots=[4], prompts=[PROMPTS[0]], done_before=first)
    assert_same_or_near_tie(spec[0], ref[0], gaps[0], "copied slot")
    assert stats["undrafted_steps"] >= held // 16 - 1
    assert stats["proposed"] > 0
    assert d.drafter.store.tokens[4] == d.store.tokens[4][:len(d.drafter.store.tokens[4])]


def test_load_drafter_checks_the_tokenizers(tiny_model_dir, tmp_path):
    main = load_model(str(tiny_model_dir("qwen3")))
    settings = SimpleNamespace(draft_model=str(tiny_model_dir("llama", seed=1)), worker_slots=2,
                               ctx=2048, prefill_chunk=64)
    drafter, draft = load_drafter(settings, main)
    assert drafter.kind == "draft" and draft.model_type == "llama"
    # The same model with two tokens' ids swapped: refused in one line naming both models.
    other = tmp_path / "swapped"
    shutil.copytree(tiny_model_dir("llama", seed=1), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    settings.draft_model = str(other)
    with pytest.raises(ModelLoadError) as err:
        load_drafter(settings, main)
    message = str(err.value)
    assert "\n" not in message and "tokenizers differ" in message
    assert str(other) in message and str(main.path) in message
