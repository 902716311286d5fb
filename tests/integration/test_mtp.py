"""Multi-token-prediction drafts in the worker, in-process on the qwen3_5 twins that carry an
MTP head (`--mtp`; docs/design/speculative-decoding.md "Speculative decoding", worker/mtp.py):

- the head loads with mlx-vlm's drafter class, and the main model is the one without it;
- for the same hidden states it proposes what mlx-vlm's own loop proposes (its
  prefill_from_target_hidden, set_shared_kv, draft_block);
- greedy decoding whose drafts come from the head and are verified by the main model gives
  the plain greedy tokens, batched, with plain decode steps, bursts and verify steps mixed;
- a head made to agree with its model (the model made a near-bigram predictor, the head a
  copy of that bigram) has most drafts accepted, and the output still equals plain greedy.

A divergence is accepted only at a measured near-tie (top-2 logit gap below 1e-4), as in
tests/integration/test_speculative_executor.py.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from switchyard.proto.scheduler_worker import DecodeItem, PrefillChunk, RunStep
from switchyard.proto.values import SamplingParams
from switchyard.common.speculation import num_accepted
from switchyard.worker.drafters import DraftRow
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.executor import StepExecutor
from switchyard.worker.model_loading import load_model
from switchyard.worker.mtp import load_mtp_drafter, mtp_drafter_for, ships_mtp
from switchyard.worker.slots import SlotStore

NEAR_TIE = 1e-4
STOP = (4087, 4089)  # the twins' eos ids
PROMPTS = [[20 + (i * 37 + s * 11) % 900 for i in range(40 + 9 * s)] for s in range(2)]


def mtp_twin(tiny_model_dir, arch="qwen3_5", **kw):
    return tiny_model_dir(arch, mtp=True, **kw)


class Driver:
    """Slots 0..n-1 decode plainly (the reference); slots n..2n-1 the same prompts with the
    head's drafts."""

    def __init__(self, path, num_seqs: int = 2, edit=None):
        loaded = load_model(str(path))
        self.drafter = load_mtp_drafter(loaded.path, loaded.config, loaded.model)
        if edit is not None:
            edit(loaded.model, self.drafter.head)
        self.store = SlotStore(loaded.model, loaded.make_cache, 2 * num_seqs, 1024)
        self.store.attach_mtp(self.drafter)
        self.ex = StepExecutor(self.store, None, None, drafter=self.drafter)
        self.n = num_seqs
        self.step = 0
        for s in range(num_seqs):
            for slot in (s, num_seqs + s):  # two chunks: the pairs span a chunk boundary
                p = PROMPTS[s][:-1]
                self.run(prefills=(PrefillChunk(slot, 0, tuple(p[:17])),))
                self.run(prefills=(PrefillChunk(slot, 17, tuple(p[17:])),))

    def run(self, **kw):
        self.step += 1
        return self.ex.run(RunStep(self.step, **kw))

    def plain(self, length: int):
        out, gaps = [[] for _ in range(self.n)], [[] for _ in range(self.n)]
        inputs = [p[-1] for p in PROMPTS[:self.n]]
        for i in range(length):
            slots = list(range(self.n))
            positions = [len(PROMPTS[s]) - 1 + i for s in slots]
            logits = np.array(self.store.decode(slots, positions, [inputs[s] for s in slots]))
            for s in slots:
                top = np.sort(logits[s])[-2:]
                gaps[s].append(float(top[1] - top[0]))
                inputs[s] = int(np.argmax(logits[s]))
                out[s].append(inputs[s])
        return out, gaps

    def with_drafts(self, length: int, k: int = 4):
        """Steps of three kinds in turn: drafted and verified (batched), a plain batched
        step, a lone burst of 3 (pipelined) for the first sequence then drafted again."""
        out = [[] for _ in range(self.n)]
        inputs = [p[-1] for p in PROMPTS[:self.n]]
        stats = {"proposed": 0, "accepted": 0, "steps": 0}
        greedy = SamplingParams()
        turn = 0
        while any(len(o) < length for o in out):
            turn += 1
            live = [s for s in range(self.n) if len(out[s]) < length]
            if turn % 4 == 2:  # plain, batched
                items = [DecodeItem(self.n + s, len(PROMPTS[s]) - 1 + len(out[s]), inputs[s],
                                    greedy, len(out[s])) for s in live]
                done = self.run(decodes=tuple(items))
            elif turn % 4 == 3:  # a burst of the first live sequence alone
                s = live[0]
                items = [DecodeItem(self.n + s, len(PROMPTS[s]) - 1 + len(out[s]), inputs[s],
                                    greedy, len(out[s]), burst_limit=min(3, length - len(out[s])))]
                done = self.run(decodes=tuple(items), num_decode_steps=3)
            else:  # the worker's drafter drafts for the rows that ask (draft_tokens)
                for s in live:
                    assert self.drafter.catch_up(self.n + s, self.store.tokens[self.n + s]
                                                 + [inputs[s]])
                items = [DecodeItem(self.n + s, len(PROMPTS[s]) - 1 + len(out[s]), inputs[s],
                                    greedy, len(out[s]), burst_limit=length - len(out[s]),
                                    stop_token_ids=STOP, draft_tokens=k) for s in live]
                done = self.run(decodes=tuple(items))
            stats["steps"] += 1
            emitted = {item.slot: [] for item in items}
            for t in done.sampled:
                emitted[t.slot].append(t.token_id)
                out[t.slot - self.n].append(t.token_id)
                inputs[t.slot - self.n] = t.token_id
            for draft in done.drafts:
                stats["proposed"] += len(draft.token_ids)
                stats["accepted"] += num_accepted(draft.token_ids, emitted[draft.slot])
            for item in items:
                s = item.slot - self.n
                assert self.store.tokens[item.slot] == PROMPTS[s] + out[s][:-1]
        return [o[:length] for o in out], stats


def assert_same(reference, gaps, got):
    for s, (ref, out) in enumerate(zip(reference, got)):
        for i, (a, b) in enumerate(zip(ref, out)):
            if a != b:
                assert gaps[s][i] < NEAR_TIE, (s, i, a, b, gaps[s][i])
                break
        else:
            assert out == ref


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_twin_head_loads_and_main_model_is_the_same(tiny_model_dir, arch):
    """qwen3_5: an MLX-layout checkpoint; qwen3_next: Hugging Face's layout, main model and
    head (twins/models.py)."""
    with_head = load_model(str(mtp_twin(tiny_model_dir, arch)))
    without = load_model(str(tiny_model_dir(arch)))
    assert ships_mtp(with_head.path, with_head.model_type)
    assert not ships_mtp(without.path, without.model_type)
    x = mx.array([PROMPTS[0]])
    assert mx.array_equal(with_head.model(x), without.model(x))  # mlx-lm dropped mtp.*
    drafter = load_mtp_drafter(with_head.path, with_head.config, with_head.model)
    assert type(drafter.head).__module__.startswith("mlx_vlm.speculative.drafters.qwen3_5_mtp")
    # the head's weights are the drawn ones, whichever layout stored them
    from mlx.utils import tree_flatten

    from switchyard.twins.models import make_mtp_weights

    drawn = make_mtp_weights(with_head.config, 1)  # the twin's seed 0 + 1, MLX layout
    for name, w in tree_flatten(drafter.head.parameters()):
        assert mx.allclose(w, drawn[f"mtp.{name}"]), name
    assert drafter.nbytes > 0 and drafter.kv_bytes_per_token() > 0
    with pytest.raises(ModelLoadError, match="ships no MTP heads"):
        load_mtp_drafter(without.path, without.config, without.model)


def test_speculative_mtp_loads_the_head_or_is_refused_in_one_line(tiny_model_dir):
    from switchyard.common.settings import Settings
    from switchyard.worker.service import plan_memory

    with_head = load_model(str(mtp_twin(tiny_model_dir)))
    drafter = mtp_drafter_for(with_head, "mtp", False)
    assert mtp_drafter_for(with_head, "auto", False) is not None  # auto: where shipped
    assert mtp_drafter_for(with_head, "suffix", False) is None
    assert mtp_drafter_for(with_head, "auto", True) is None  # a group: not there
    with pytest.raises(ModelLoadError, match="single worker"):
        mtp_drafter_for(with_head, "mtp", True)
    settings = Settings(model=str(with_head.path), slots=2, ctx=1024, speculative="mtp")
    plan = plan_memory(with_head, settings, None, 0, mtp=drafter)
    assert plan.draft == drafter.nbytes + 2 * 1024 * drafter.kv_bytes_per_token()
    # `runtime` is the process's resident size, measured at each call (it moves with what
    # ran before in this process): compared with it the same, the draft is all that differs.
    plain = dataclasses.replace(plan_memory(with_head, settings, None, 0), runtime=plan.runtime)
    assert plan.fixed == plain.fixed + plan.draft
    for arch in ("qwen3_5", "qwen3"):
        without = load_model(str(tiny_model_dir(arch)))
        assert mtp_drafter_for(without, "auto", False) is None
        with pytest.raises(ModelLoadError) as exc:
            mtp_drafter_for(without, "mtp", False)
        assert str(exc.value) == (f"--speculative mtp: {without.path.name} ships no MTP heads; "
                                  f"serve it with --speculative auto, suffix or off")


def test_first_draft_is_mlx_vlms(tiny_model_dir):
    """The same prompt hidden states and first token: mlx-vlm's drafter, driven as its own
    loop drives it, and ours propose the same tokens."""
    loaded = load_model(str(mtp_twin(tiny_model_dir)))
    ours = load_mtp_drafter(loaded.path, loaded.config, loaded.model)
    store = SlotStore(loaded.model, loaded.make_cache, 1, 512)
    store.attach_mtp(ours)
    theirs = load_mtp_drafter(loaded.path, loaded.config, loaded.model).head
    for prompt in PROMPTS:
        store.truncate(0, 0)
        store.prefill(0, 0, prompt[:-1])
        first = int(mx.argmax(store.decode([0], [len(prompt) - 1], [prompt[-1]]), -1).item())
        [draft] = ours.propose([DraftRow(0, prompt + [first], 5)])

        lm = loaded.model.language_model
        hidden = lm.model(mx.array([prompt]), cache=loaded.make_cache())
        assert int(mx.argmax(lm.model.embed_tokens.as_linear(hidden[:, -1]), -1).item()) == first
        theirs.reset(loaded.model)
        theirs.prefill_from_target_hidden(mx.array([prompt]), hidden, first, None, greedy=True)
        theirs.set_shared_kv({}, len(prompt))
        block = theirs.draft_block(first, hidden[:, -1:], None, 6, None, greedy=True)
        assert list(draft) == block[0].tolist()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_with_mtp_drafts_equals_plain(tiny_model_dir, arch):
    d = Driver(mtp_twin(tiny_model_dir, arch))
    reference, gaps = d.plain(24)
    got, stats = d.with_drafts(24)
    assert stats["proposed"] > 0
    assert_same(reference, gaps, got)


def agree(model, head, eps: float = 0.05, seed: int = 0):
    """Make the model a near-bigram predictor, next = perm[token] (its layers' outputs scaled
    by `eps`, the lm_head the embedding rows permuted), and the head predict that bigram for
    the token it is given (fc passes the token's embedding, its layer adds nothing): the head
    then agrees with the model wherever the layers' small context term does not decide."""
    lm = model.language_model
    embed = lm.model.embed_tokens.weight
    vocab, hidden = embed.shape
    perm = np.random.RandomState(seed).permutation(vocab)
    head_w = np.zeros(embed.shape, dtype=np.float32)
    head_w[perm] = np.array(embed)
    lm.lm_head.weight = mx.array(head_w)
    for layer in lm.model.layers:
        mixer = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
        mixer.weight = mixer.weight * eps
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * eps
    head.fc.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    for layer in head.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def test_agreeing_head_gets_drafts_accepted(tiny_model_dir):
    d = Driver(mtp_twin(tiny_model_dir, tie_word_embeddings=False), edit=agree)
    reference, gaps = d.plain(32)
    got, stats = d.with_drafts(32)
    assert_same(reference, gaps, got)
    assert stats["accepted"] >= stats["proposed"] // 2 > 0, stats


def test_the_heads_state_follows_the_slot_through_gaps_and_cuts(tiny_model_dir):
    """Pairs exist only with the model's own hidden states: a slot whose tokens arrive
    without them (pages loaded) drafts again once a pass gives one; a cut drops the pairs
    past it and the hidden state it cut; a released slot starts over."""
    loaded = load_model(str(mtp_twin(tiny_model_dir)))
    drafter = load_mtp_drafter(loaded.path, loaded.config, loaded.model)

    def hidden(n: int) -> mx.array:  # hidden states of n positions (the twin's hidden size)
        return mx.random.normal((1, n, 256))

    drafter.observe(0, 0, list(range(10, 20)), hidden(10))  # a prefill: pairs 0..8, h_9 kept
    assert drafter.ready(0, 11) and not drafter.ready(0, 12)
    assert drafter._slots[0].ids == list(range(9))
    [draft] = drafter.propose([DraftRow(0, list(range(10, 21)), 3)])
    assert len(draft) == 3 and drafter._slots[0].ids == list(range(9))  # taken back
    drafter.observe(0, 10, [20], hidden(1))  # a decode step: pair 9, h_10 kept
    assert drafter.ready(0, 12) and drafter._slots[0].ids == list(range(10))
    drafter.observe(0, 30, [5, 6, 7], hidden(3))  # tokens 11..29 came from pages
    assert drafter._slots[0].ids == list(range(10)) + [30, 31]
    assert drafter.ready(0, 34) and drafter.catch_up(0, list(range(34)))
    drafter.cut(0, 31)  # the slot keeps 31 tokens: pairs 30+ and h_32 go
    assert drafter._slots[0].ids == list(range(10)) and not drafter.ready(0, 32)
    assert drafter.propose([DraftRow(0, list(range(32)), 3)]) == [()]
    drafter.observe(0, 31, [8], hidden(1))  # h_30 was cut: no pair 30, h_31 kept
    assert drafter._slots[0].ids == list(range(10)) and drafter.ready(0, 33)
    assert drafter.cache_tokens(0) == 10
    drafter.cut(0, 5)
    assert drafter._slots[0].ids == [0, 1, 2, 3] and drafter.cache_tokens(0) == 4
    drafter.release(0)
    assert not drafter.ready(0, 33) and drafter.cache_tokens(0) == 0
    drafter.observe(0, 0, [1, 2], hidden(2))  # from the start again
    assert drafter._slots[0].ids == [0] and drafter.ready(0, 3)


def test_a_quantized_checkpoint_with_its_quantized_head(tmp_path, tiny_model_dir):
    """An MLX 4-bit checkpoint that kept its head, quantized too (mlx-lm's converter for the
    model, which drops the head; the head quantized as its module and stored beside it, as
    mlx-vlm's own conversion keeps it): the head loads quantized, and greedy decoding with its
    drafts gives the plain greedy tokens of the quantized model."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.convert import convert

    src = mtp_twin(tiny_model_dir)
    out = tmp_path / "q4"
    convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64)
    loaded = load_model(str(src))
    head = load_mtp_drafter(loaded.path, loaded.config, loaded.model).head
    nn.quantize(head, group_size=64, bits=4)
    [shard] = out.glob("*.safetensors")
    weights, meta = mx.load(str(shard), return_metadata=True)
    assert not any(k.startswith("mtp.") for k in weights)  # mlx-lm dropped it
    weights |= {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(shard), weights, metadata=meta)

    d = Driver(out)
    assert isinstance(d.drafter.head.fc, nn.QuantizedLinear)
    reference, gaps = d.plain(16)
    got, stats = d.with_drafts(16)
    assert stats["proposed"] > 0
    assert_same(reference, gaps, got)
