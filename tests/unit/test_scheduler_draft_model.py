"""A draft model in the scheduler core, driven without sockets or MLX
(docs/design/speculative-decoding.md "Speculative decoding"): the core asks the worker's draft model
for draft tokens per row (`DecodeItem.draft_tokens`), chooses how many from the measured acceptance
and costs, uses copied drafts where they match better, and counts what the worker's drafts kept. The
scripted worker verifies as the real one does (common/speculation.py)."""

from switchyard.proto.scheduler_worker import SampledToken, SlotDraft, StepDone, WorkerReady
from switchyard.proto.values import SamplingParams
from switchyard.proto.gateway_scheduler import SubmitRequest, TokensGenerated
from switchyard.common.speculation import verified
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import PlanStep
from switchyard.scheduler.proposer import Proposal, Proposer, ProposerConfig

EOS = 0
PROMPT = [1, 2, 3, 4, 5]
REPLY = [100 + (i * 7919) % 5000 for i in range(60)]  # nothing in it repeats: no copies


def make_core(draft_only=False, draft_cost=0.2, **kw):
    cfg = dict(num_slots=2, ctx=4096, prefill_chunk=512, max_queue=4, decode_burst=1,
               num_draft_tokens=6, draft_only=draft_only)
    cfg.update(kw)
    core = SchedulerCore(CoreConfig(**cfg))
    c = core.config
    core.handle(WorkerReady("w", b"", "tiny", c.num_slots, c.ctx, c.page_size, 100, True,
                            speculation="batched", drafter="draft", draft_cost=draft_cost),
                0.0)
    return core


def submit(core, rid, prompt=PROMPT, max_tokens=60, speculative=True):
    core.handle(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,),
                              speculative=speculative), 0.0)


class DraftingWorker:
    """The model writes `replies[rid]`; its draft model drafts the reply with every
    `wrong_every`-th token wrong (0: never). A plain pass takes 1 s for any batch, a draft
    pass `draft_s`, a verify pass 1 s plus `row_s` per extra token per row."""

    def __init__(self, core, replies, wrong_every=0, draft_s=0.2, row_s=0.05):
        self.core, self.replies, self.wrong_every = core, replies, wrong_every
        self.draft_s, self.row_s = draft_s, row_s
        self.steps, self.msgs, self.finished = [], [], []
        self.clock = 1.0

    def token_at(self, rid, position):
        i = position - (len(self.core.requests[rid].prompt) - 1)
        reply = self.replies[rid]
        return reply[i] if i < len(reply) else 77

    def step(self) -> bool:
        effects = self.core.handle(PlanStep(), self.clock)
        plan = effects.step
        self.msgs += effects.messages
        if plan is None:
            return False
        self.steps.append(plan)
        sampled, drafts, width = [], [], 1
        num_passes = max((d.draft_tokens for d in plan.decodes if not d.draft), default=0)
        for d in plan.decodes:
            rid = self.core.slots[d.slot].rid
            draft = d.draft
            if d.draft_tokens and not draft:  # the worker's draft model
                k = min(d.draft_tokens, d.burst_limit - 1)
                draft = tuple(
                    self.token_at(rid, d.position + i)
                    + (1 if self.wrong_every and (d.position + i) % self.wrong_every == 0
                       else 0) for i in range(k))
                drafts.append(SlotDraft(d.slot, draft))
            width = max(width, 1 + len(draft))
            targets = [self.token_at(rid, d.position + i) for i in range(len(draft) + 1)]
            emitted = verified(draft, targets, d.stop_token_ids, d.burst_limit)
            sampled += [SampledToken(d.slot, t) for t in emitted]
        verify_s = 1.0 + self.row_s * len(plan.decodes) * (width - 1) if plan.decodes else 0
        draft_s = self.draft_s * num_passes
        duration = verify_s + draft_s
        self.clock += duration
        done = StepDone(plan.step, tuple(sampled), sum(len(c.token_ids) for c in plan.prefills),
                        len(plan.decodes), duration, decode_s=duration, drafts=tuple(drafts),
                        draft_s=draft_s, num_draft_passes=num_passes)
        after = self.core.handle(done, self.clock)
        self.msgs += after.messages
        self.finished += after.finished
        for slot in self.core.slots:
            if slot.rid is not None:
                assert slot.tokens == list(self.core.requests[slot.rid].feed[:-1])
        return True

    def run(self, max_steps=500):
        for _ in range(max_steps):
            if not self.step():
                return

    def generated(self, rid):
        return [t for m in self.msgs if isinstance(m, TokensGenerated) and m.rid == rid
                for t in m.token_ids]


def test_speculative_draft_asks_the_draft_model_for_every_row_and_counts_what_it_kept():
    core = make_core(draft_only=True)
    submit(core, "a")
    submit(core, "b", prompt=[9, 8, 7])
    w = DraftingWorker(core, {"a": REPLY[:40] + [EOS], "b": REPLY[10:50] + [EOS]})
    w.run()
    assert w.generated("a") == REPLY[:40] and w.generated("b") == REPLY[10:50]
    decodes = [d for s in w.steps for d in s.decodes]
    assert all(d.draft == () for d in decodes)  # no copied drafts with --speculative draft
    later = [d for d in decodes if d.sample_index > 0]
    assert later and all(d.draft_tokens == 6 and d.burst_limit == 7 for d in later)
    assert all(d.draft_tokens == 0 for d in decodes if d.sample_index == 0)  # first alone
    assert len([s for s in w.steps if s.decodes]) < 15  # 40 tokens each, ~7 per step
    for rec in w.finished:
        assert rec.proposers == "draft"
        # Every draft token accepted but the one after the reply's end (the model stops).
        assert rec.num_accepted_tokens == rec.num_proposed_tokens - 1 > 30


def test_auto_drafts_where_the_draft_model_pays_and_stops_where_it_does_not():
    core = make_core()
    submit(core, "a")
    w = DraftingWorker(core, {"a": REPLY[:50] + [EOS]}, wrong_every=0)
    w.run()
    assert w.generated("a") == REPLY[:50]
    [rec] = w.finished
    assert rec.proposers == "draft" and rec.num_accepted_tokens > 30
    # A draft model that is always wrong: after a few rejected drafts nothing is drafted
    # (plain steps) for a while.
    core = make_core()
    submit(core, "b")
    w = DraftingWorker(core, {"b": REPLY[:50] + [EOS]}, wrong_every=1)
    w.run()
    assert w.generated("b") == REPLY[:50]
    asked = [bool(d.draft_tokens) for s in w.steps for d in s.decodes]
    assert asked.count(True) < len(asked) / 3
    assert not any(asked[-10:])


def test_an_expensive_draft_model_is_not_asked_where_plain_steps_are_faster():
    # A draft pass as dear as the model's own pass, and the first drafts half accepted.
    core = make_core(draft_cost=1.0)
    submit(core, "a")
    w = DraftingWorker(core, {"a": REPLY[:30] + [EOS]}, wrong_every=2, draft_s=1.0)
    w.run()
    assert w.generated("a") == REPLY[:30]
    assert not any(d.draft_tokens for s in w.steps for d in s.decodes)


def test_a_request_that_opts_out_gets_no_draft_model_drafts():
    core = make_core(draft_only=True)
    submit(core, "a", speculative=False)
    w = DraftingWorker(core, {"a": REPLY[:20] + [EOS]})
    w.run()
    assert w.generated("a") == REPLY[:20]
    assert not any(d.draft_tokens or d.draft for s in w.steps for d in s.decodes)
    [rec] = w.finished
    assert rec.proposers == "" and rec.num_proposed_tokens == 0


def proposer(**kw) -> Proposer:
    p = Proposer(ProposerConfig(max_draft=8, table_bits=10, **kw))
    for rid in ("a", "b"):
        p.start(rid, [1, 2, 3])
    return p


def test_draft_plan_width_follows_acceptance_and_cost():
    p = proposer(draft_cost=0.1)
    p.use_draft_model(0.1)
    width, ks = p.draft_plan(["a", "b"], [None, None], [8, 8])
    assert width >= 2 and ks == [width - 1] * 2
    for _ in range(40):  # both accept every token: longer drafts pay
        p.observe_draft("a", 4, 4)
        p.observe_draft("b", 4, 4)
    longer, ks = p.draft_plan(["a", "b"], [None, None], [8, 8])
    assert longer > width and ks == [longer - 1] * 2
    for _ in range(20):  # request a's drafts are all rejected
        p.observe_draft("a", 4, 0)
    assert p.draft_acceptance("a") < 0.1 < p.draft_acceptance("b")
    assert p.draft_plan(["a"], [None], [8]) == (1, [0])
    assert p.draft_plan(["b"], [None], [8])[1] != [0]
    # The same acceptance with a draft pass as dear as a plain pass: no drafts.
    dear = proposer()
    dear.use_draft_model(1.0)
    assert dear.draft_plan(["a", "b"], [None, None], [8, 8]) == (1, [0, 0])


def test_draft_plan_prefers_a_copied_draft_that_matches_well_and_skips_rows_without_room():
    p = proposer()
    p.use_draft_model(0.1)
    copied = Proposal(tuple(range(10, 18)), 0.95)
    width, ks = p.draft_plan(["a", "b"], [copied, None], [8, 8])
    assert width > 4 and ks[0] == 0 and 0 < ks[1] < width - 1  # short draft beside a copy
    for _ in range(20):
        p.observe_draft("b", 4, 4)
    _, ks = p.draft_plan(["a", "b"], [None, None], [0, 8])
    assert ks[0] == 0 and ks[1] > 0  # a has no room (or opted out)
    only = proposer(draft_only=True)
    assert only.draft_plan(["a", "b"], [copied, None], [3, 0]) == (4, [3, 0])


def test_a_draft_model_turned_off_by_rejections_is_tried_again_after_a_while():
    p = proposer()
    p.use_draft_model(0.1)
    for _ in range(30):
        p.observe_draft("a", 4, 0)
    assert p.draft_plan(["a"], [None], [8]) == (1, [0])
    tried = next(i for i in range(2000) if p.draft_plan(["a"], [None], [8])[0] > 1)
    assert tried > 10
