"""Speculative decoding in the scheduler core, driven without sockets or MLX: a scripted worker
verifies drafts the way the real one does (common/speculation.py) against a "model" that
copies text; the core proposes, keeps only accepted tokens in its slots, and never emits
past a stop token or max_tokens."""

from switchyard.proto.status import SpeculationStatus
from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.scheduler_worker import SampledToken, StepDone, WorkerReady
from switchyard.proto.values import SamplingParams
from switchyard.common.speculation import verified
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import PlanStep

EOS = 0
FILE = [100 + (i * 7919) % 5000 for i in range(80)]  # no n-gram repeats inside
PROMPT = [1, 2, 3] + FILE + [4]


def make_core(speculation="batched", num_draft_tokens=8, **kw):
    cfg = dict(num_slots=2, ctx=4096, prefill_chunk=512, max_queue=4, decode_burst=1,
               num_draft_tokens=num_draft_tokens)
    cfg.update(kw)
    core = SchedulerCore(CoreConfig(**cfg))
    c = core.config
    core.handle(WorkerReady("w", b"", "tiny", c.num_slots, c.ctx, c.page_size, 100, True,
                            speculation=speculation), 0.0)
    return core


def submit(core, rid, prompt=PROMPT, max_tokens=60, speculative=True):
    core.handle(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,),
                              speculative=speculative), 0.0)


class CopyingWorker:
    """The model writes `reply` after the prompt, whatever it was fed; drafts are verified
    as the real worker verifies them. Checks after every step that each slot holds exactly
    its request's prompt and the tokens it kept (never a rejected draft token)."""

    def __init__(self, core, replies: dict[str, list[int]]):
        self.core, self.replies = core, replies
        self.steps, self.msgs, self.finished = [], [], []

    def token_at(self, slot: int, position: int) -> int:
        rid = self.core.slots[slot].rid
        reply = self.replies[rid]
        i = position - (len(self.core.requests[rid].prompt) - 1)
        return reply[i] if i < len(reply) else 77  # past a stop: whatever, never emitted

    def step(self) -> bool:
        effects = self.core.handle(PlanStep(), 1.0)
        plan = effects.step
        self.msgs += effects.messages
        if plan is None:
            return False
        self.steps.append(plan)
        sampled = []
        for d in plan.decodes:
            targets = [self.token_at(d.slot, d.position + i) for i in range(len(d.draft) + 1)]
            emitted = verified(d.draft, targets, d.stop_token_ids, d.burst_limit)
            sampled += [SampledToken(d.slot, t) for t in emitted]
        done = StepDone(plan.step, tuple(sampled), sum(len(c.token_ids) for c in plan.prefills),
                        len(plan.decodes), 0.001)
        after = self.core.handle(done, 1.0)
        self.msgs += after.messages
        self.finished += after.finished
        for slot in self.core.slots:
            if slot.rid is not None:
                req = self.core.requests[slot.rid]
                assert slot.tokens == list(req.feed[:-1])
        return True

    def run(self, max_steps=500):
        for _ in range(max_steps):
            if not self.step():
                return

    def generated(self, rid):
        return [t for m in self.msgs if isinstance(m, TokensGenerated) and m.rid == rid
                for t in m.token_ids]

    def finish(self, rid):
        return next(m for m in self.msgs if isinstance(m, RequestFinished) and m.rid == rid)

    def drafts(self):
        return [d.draft for s in self.steps for d in s.decodes]


def test_a_reply_that_copies_its_prompt_takes_few_steps_and_only_accepted_tokens_are_kept():
    core = make_core()
    submit(core, "a")
    w = CopyingWorker(core, {"a": FILE[:60] + [EOS]})
    w.run()
    assert w.generated("a") == FILE[:60]
    decode_steps = [s for s in w.steps if s.decodes]
    assert len(decode_steps) < 20  # 60 tokens
    [rec] = w.finished
    assert rec.num_accepted_tokens > 40 and rec.num_proposed_tokens >= rec.num_accepted_tokens
    first = next(s for s in w.steps if s.decodes).decodes[0]
    assert first.draft == ()  # a request's first token comes alone


def test_rejected_drafts_leave_nothing_behind():
    """The reply copies the file but changes one token in three places: each draft across a
    change is cut there, and what the slot holds is the reply as emitted."""
    reply = list(FILE[:60])
    for i in (10, 25, 40):
        reply[i] = 9000 + i
    core = make_core()
    submit(core, "a")
    w = CopyingWorker(core, {"a": reply + [EOS]})
    w.run()
    assert w.generated("a") == reply
    [rec] = w.finished
    assert rec.num_accepted_tokens < rec.num_proposed_tokens


def test_max_tokens_is_never_exceeded_and_drafts_leave_room_for_the_next_token():
    core = make_core()
    submit(core, "a", max_tokens=13)
    w = CopyingWorker(core, {"a": FILE[:60]})
    w.run()
    assert w.generated("a") == FILE[:13]
    assert w.finish("a").finish_reason == "length"
    for s in w.steps:
        for d in s.decodes:
            assert len(d.draft) < d.burst_limit


def test_nothing_is_emitted_past_a_stop_token_inside_an_accepted_draft():
    core = make_core()
    submit(core, "a")
    reply = FILE[:30] + [EOS] + FILE[31:60]  # the model stops where the file goes on
    w = CopyingWorker(core, {"a": reply})
    w.run()
    assert w.generated("a") == FILE[:30]
    assert w.finish("a").finish_reason == "stop"


def test_every_decoding_sequence_speculates_in_one_step():
    core = make_core()
    submit(core, "a")
    submit(core, "b", prompt=[7, 8] + FILE + [9])
    w = CopyingWorker(core, {"a": FILE[:50] + [EOS], "b": FILE[:50] + [EOS]})
    w.run()
    assert w.generated("a") == w.generated("b") == FILE[:50]
    assert any(all(d.draft for d in s.decodes) and len(s.decodes) == 2 for s in w.steps)


def test_a_worker_that_verifies_alone_gets_drafts_only_for_a_lone_sequence():
    core = make_core(speculation="alone")
    submit(core, "a")
    submit(core, "b", prompt=[7, 8] + FILE + [9], max_tokens=20)
    w = CopyingWorker(core, {"a": FILE[:50] + [EOS], "b": FILE[:20]})
    w.run()
    assert w.generated("a") == FILE[:50] and w.generated("b") == FILE[:20]
    for s in w.steps:
        if len(s.decodes) > 1:
            assert all(not d.draft for d in s.decodes)
    assert any(len(s.decodes) == 1 and s.decodes[0].draft for s in w.steps)


def test_a_request_may_opt_out_and_off_proposes_nothing():
    for core, speculative in ((make_core(), False), (make_core(speculation=""), True),
                              (make_core(num_draft_tokens=0), True)):
        submit(core, "a", speculative=speculative)
        w = CopyingWorker(core, {"a": FILE[:30] + [EOS]})
        w.run()
        assert w.generated("a") == FILE[:30]
        assert not any(w.drafts())
        assert w.finished[0].num_proposed_tokens == 0


def test_cancelling_a_speculating_request_ends_it_after_its_step():
    core = make_core()
    submit(core, "a")
    w = CopyingWorker(core, {"a": FILE[:60] + [EOS]})
    while not any(w.drafts()):
        assert w.step()
    w.msgs += core.handle(CancelRequest("a"), 1.0).messages
    w.run()
    assert w.finish("a").finish_reason == "cancelled"
    assert len(w.generated("a")) < 60


def test_the_status_snapshot_says_how_speculation_runs():
    assert make_core().snapshot(0.0).speculation == SpeculationStatus(mode="batched",
                                                                       max_draft_tokens=8)
    assert make_core(num_draft_tokens=0).snapshot(0.0).speculation.mode == "off"


def test_a_verify_step_is_one_pass_to_the_prefill_budget():
    """Decode-first fairness: the budget protects a stream's token-to-token cycle. A verify
    step is one pass however many tokens it kept, so its whole duration is the cycle a
    prefill chunk must not stretch; a burst of plain steps is that many passes."""
    core = make_core()
    submit(core, "a")
    w = CopyingWorker(core, {"a": FILE[:60] + [EOS]})
    while not any(w.drafts()):
        w.step()
    plan = core.handle(PlanStep(), 10.0).step
    assert plan.decodes[0].draft
    kept = verified(plan.decodes[0].draft, plan.decodes[0].draft + (77,), (), 99)
    done = StepDone(plan.step, tuple(SampledToken(plan.decodes[0].slot, t) for t in kept), 0, 1,
                    0.3, decode_s=0.3)
    core.handle(done, 10.3)
    assert abs(core.budget.decode_s - 0.3) < 1e-9
