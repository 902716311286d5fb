"""The scheduler core, driven without sockets or MLX: a scripted worker answers each step."""

from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.scheduler_worker import SampledToken, SlotContents, StepDone, WorkerReady
from switchyard.proto.values import SamplingParams
from switchyard.proto.status import QueuedRequest
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import FailAll, GatewayRestarted, PlanStep

EOS = 0


def make_core(**kw):
    cfg = dict(num_slots=2, ctx=4096, prefill_chunk=64, max_queue=4, decode_burst=1)
    cfg.update(kw)
    return SchedulerCore(CoreConfig(**cfg))


def submit(core, rid, prompt, max_tokens=3, priority="interactive", now=0.0):
    return core.handle(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,),
                                     priority), now).messages


def worker_ready(core, slots=()):
    """A worker (re)started holding `slots` (SlotContents); no page store."""
    c = core.config
    return core.handle(WorkerReady("w", b"", "tiny", c.num_slots, c.ctx, c.page_size, 100,
                                   c.trimmable, slots), 0.0)


class ScriptedWorker:
    """Mirrors slot contents like the real worker; samples `next_token(slot, position)`."""

    def __init__(self, core, next_token=lambda slot, pos: 1000 + pos):
        self.core, self.next_token = core, next_token
        self.steps = []
        self.logs = []  # (event, fields) the core recorded
        self.finished = []  # FinishedRecord of every request that ended

    def step(self, now=1.0):
        effects = self.core.handle(PlanStep(), now)
        self.logs += effects.logs
        self.finished += effects.finished
        plan = effects.step
        if plan is None:
            return None, effects.messages
        self.steps.append(plan)
        sampled = []
        for i in range(plan.num_decode_steps):  # like the worker: burst, stop at stop tokens
            for d in plan.decodes:
                mine = [t for t in sampled if t.slot == d.slot]
                if len(mine) == i and (i == 0 or (i < d.burst_limit
                                                  and mine[-1].token_id not in d.stop_token_ids)):
                    sampled.append(SampledToken(d.slot, self.next_token(d.slot, d.position + i)))
        done = StepDone(plan.step, tuple(sampled), sum(len(c.token_ids) for c in plan.prefills),
                        len(plan.decodes), 0.001)
        after = self.core.handle(done, now)
        self.logs += after.logs
        self.finished += after.finished
        return plan, effects.messages + after.messages

    def run(self, max_steps=1000):
        out = []
        for _ in range(max_steps):
            plan, msgs = self.step()
            out += msgs
            if plan is None:
                break
        return out


def finished(msgs):
    return {m.rid: m for m in msgs if isinstance(m, RequestFinished)}


def generated(msgs, rid):
    return [t for m in msgs if isinstance(m, TokensGenerated) and m.rid == rid for t in m.token_ids]


def test_prefill_holds_back_last_token_then_decodes():
    core = make_core()
    submit(core, "a", range(1, 101), max_tokens=3)
    w = ScriptedWorker(core)
    msgs = w.run()
    # 99 tokens prefilled in chunks of 64, the 100th is the first decode input.
    assert [sum(len(c.token_ids) for c in s.prefills) for s in w.steps[:2]] == [64, 35]
    assert w.steps[2].decodes[0].token_id == 100 and w.steps[2].decodes[0].position == 99
    assert generated(msgs, "a") == [1099, 1100, 1101]
    fin = finished(msgs)["a"]
    assert (fin.finish_reason, fin.num_prompt_tokens, fin.num_generated_tokens) == ("length", 100, 3)


def test_stop_token_finishes_without_emitting_it():
    core = make_core()
    submit(core, "a", [5, 6, 7], max_tokens=10)
    w = ScriptedWorker(core, next_token=lambda s, pos: EOS if pos == 4 else 50 + pos)
    msgs = w.run()
    assert generated(msgs, "a") == [52, 53]
    assert finished(msgs)["a"].finish_reason == "stop"


def test_empty_slot_first_and_continuation_returns_to_its_slot():
    """Empty slots first: A, then B sharing only the system prompt, then A again, with 2 slots."""
    system = list(range(1, 200))
    core = make_core(prefill_chunk=1000)
    w = ScriptedWorker(core)
    submit(core, "a1", system + [900, 901])
    msgs = w.run()
    a_slot = next(s.index for s in core.slots if s.tokens)
    a_reply = generated(msgs, "a1")
    submit(core, "b1", system + [700, 701, 702])
    w.run()
    b_slot = [s.index for s in core.slots if s.tokens and s.index != a_slot]
    assert b_slot, "B must go to the empty slot, not displace A"
    # A continues: everything it had is reused, only the new turn is prefilled.
    a_next = system + [900, 901] + a_reply + [902, 903]
    submit(core, "a2", a_next)
    before = len(w.steps)
    msgs = w.run()
    first = w.steps[before]
    assert first.prefills[0].slot == a_slot
    resident = len(system) + 2 + len(a_reply) - 1  # the last reply token was never fed back
    assert first.prefills[0].start == resident
    assert finished(msgs)["a2"].num_cached_tokens == resident


def test_displacement_prefers_least_valuable_slot():
    core = make_core(prefill_chunk=10_000)
    w = ScriptedWorker(core)
    submit(core, "long", range(1, 1001))
    submit(core, "short", range(5000, 5011))
    w.run()
    short_slot = next(s.index for s in core.slots if s.tokens[0] == 5000)
    submit(core, "new", range(9000, 9050))
    plan, _ = w.step()
    assert plan.prefills[0].slot == short_slot


def test_decode_first_every_step_while_another_prefills():
    core = make_core(prefill_chunk=32)
    w = ScriptedWorker(core)
    submit(core, "x", [1, 2, 3], max_tokens=20)
    w.step()  # prefill x
    submit(core, "y", range(10, 300), max_tokens=1)
    for _ in range(5):
        plan, _ = w.step()
        assert any(d.slot == core.requests["x"].slot for d in plan.decodes)
        assert sum(len(c.token_ids) for c in plan.prefills) <= 32


def test_warm_request_prefills_before_cold_one():
    core = make_core(num_slots=3, prefill_chunk=16)
    w = ScriptedWorker(core)
    submit(core, "warm0", range(1, 40), max_tokens=1)
    w.run()
    submit(core, "cold", range(500, 900), max_tokens=1)
    submit(core, "warm", list(range(1, 40)) + [1039, 77, 78], max_tokens=1)
    plan, _ = w.step()
    warm_slot = core.requests["warm"].slot
    assert plan.prefills[0].slot == warm_slot


def test_background_prefill_yields_to_interactive():
    core = make_core(prefill_chunk=16)
    w = ScriptedWorker(core)
    submit(core, "bg", range(1, 200), priority="background")
    submit(core, "fg", range(300, 400))
    plan, _ = w.step()
    assert plan.prefills[0].slot == core.requests["fg"].slot
    assert len(plan.prefills) == 1


def test_queue_limit_and_context_limit():
    core = make_core(num_slots=1, max_queue=1, ctx=100)
    assert submit(core, "a", [1]) == []
    [full] = submit(core, "b", [1])
    assert isinstance(full, RequestFailed) and full.code == "queue_full" and full.retryable
    [long] = submit(core, "c", range(100))
    assert long.code == "context_length_exceeded" and not long.retryable


def test_cancel_waiting_and_running():
    core = make_core(num_slots=1)
    w = ScriptedWorker(core)
    submit(core, "run", range(1, 10), max_tokens=100)
    submit(core, "wait", range(20, 30))
    w.step()
    [c] = core.handle(CancelRequest("wait"), 1.0).messages
    assert c.finish_reason == "cancelled"
    plan = core.handle(PlanStep(), 1.0).step
    assert core.handle(CancelRequest("run"), 1.0).messages == []  # ends when the step is back
    msgs = core.handle(StepDone(plan.step, (SampledToken(0, 5),), 0, 1, 0.0), 1.0).messages
    assert finished(msgs)["run"].finish_reason == "cancelled"
    assert core.slots[0].rid is None and core.slots[0].tokens  # pages stay cached


def test_worker_restart_requeues_and_replays():
    core = make_core(num_slots=1)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 10), max_tokens=6)
    for _ in range(3):
        w.step()
    got = list(core.requests["a"].generated)
    worker_ready(core)
    assert core.slots[0].tokens == [] and core.waiting[0] == "a"
    msgs = w.run()
    plan = w.steps[3]
    # Re-prefills prompt + what was generated, minus the pending token.
    assert plan.prefills[0].token_ids == tuple(range(1, 10)) + tuple(got[:-1])
    assert len(got + generated(msgs, "a")) == 6


def test_scheduler_restart_adopts_worker_slots():
    core = make_core()
    worker_ready(core, (SlotContents(1, (1, 2, 3, 4)),))
    submit(core, "a", [1, 2, 3, 4, 5, 6])
    plan = core.handle(PlanStep(), 0.0).step
    assert plan.prefills[0].slot == 1 and plan.prefills[0].start == 4


def test_hybrid_slot_is_reused_only_as_pure_extension():
    core = make_core(num_slots=1, trimmable=False)
    worker_ready(core, (SlotContents(0, (1, 2, 3, 4)),))
    submit(core, "a", [1, 2, 9, 9, 9])
    plan = core.handle(PlanStep(), 0.0).step
    assert plan.prefills[0].start == 0


def test_interactive_request_preempts_background_slot():
    core = make_core(num_slots=1)
    w = ScriptedWorker(core)
    submit(core, "bg", range(1, 50), max_tokens=6, priority="background")
    for _ in range(3):
        w.step()
    done_before = list(core.requests["bg"].generated)
    submit(core, "fg", range(100, 120), max_tokens=2)
    plan, _ = w.step()
    assert core.requests["fg"].slot == 0 and "bg" in core.waiting
    assert ("request.preempted", {"rid": "bg", "reason": "slot", "num_held": 48 + 2,
                                  "num_generated": len(done_before),
                                  "num_yields": 1}) in w.logs
    msgs = w.run()
    assert finished(msgs)["fg"].finish_reason == "length"
    # The background request resumes where it stopped and still gets all its tokens.
    assert len(done_before + generated(msgs, "bg")) == 6
    assert finished(msgs)["bg"].num_generated_tokens == 6


def test_background_never_preempts():
    core = make_core(num_slots=1)
    w = ScriptedWorker(core)
    submit(core, "fg", range(1, 50), max_tokens=6)
    w.step()
    submit(core, "bg", range(100, 120), max_tokens=2, priority="background")
    w.step()
    assert core.requests["fg"].slot == 0 and "bg" in core.waiting


def test_background_prefill_takes_only_what_keeps_the_interactive_stream_at_pace():
    core = make_core(num_slots=2, prefill_chunk=512)
    w = ScriptedWorker(core)
    submit(core, "x", [1, 2, 3], max_tokens=200)
    w.step()
    submit(core, "y", range(10, 4000), max_tokens=1, priority="background")
    core.budget.observe(1, 0.010, 100, 0.1)  # 10 ms decode, 1 ms per prefill token
    prefilled = []
    for _ in range(40):
        plan, _ = w.step()
        assert any(d.slot == core.requests["x"].slot for d in plan.decodes)
        prefilled.append(sum(len(c.token_ids) for c in plan.prefills))
    # decode_share 0.5: prefill may take as long as the decode on average (less a margin).
    assert 7 <= sum(prefilled) / len(prefilled) <= 10


def test_bursts_when_nothing_waits_and_single_steps_otherwise():
    core = make_core(num_slots=2, decode_burst=8)
    w = ScriptedWorker(core)
    submit(core, "a", [1, 2, 3], max_tokens=20)
    w.step()  # prefill
    plan, msgs = w.step()
    assert plan.num_decode_steps == 1, "a first token comes alone (its prompt tail is staged)"
    plan, msgs = w.step()
    assert plan.num_decode_steps == 8 and plan.decodes[0].burst_limit == 8
    assert generated(msgs, "a") == [1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010]
    assert core.slots[0].tokens == [1, 2, 3, 1002] + [1003 + i for i in range(7)]
    submit(core, "b", range(50, 90), max_tokens=2)
    plan, _ = w.step()
    assert plan.num_decode_steps == 1, "a prefill is planned: one token per step"
    msgs = w.run()
    fin = finished(msgs)["a"]
    assert (fin.finish_reason, fin.num_generated_tokens) == ("length", 20)


def test_burst_stops_at_a_stop_token_and_at_max_tokens():
    core = make_core(num_slots=1, decode_burst=8)
    w = ScriptedWorker(core, next_token=lambda s, pos: EOS if pos == 7 else 50 + pos)
    submit(core, "a", [1, 2, 3], max_tokens=10)
    msgs = w.run()
    assert generated(msgs, "a") == [52, 53, 54, 55, 56]
    assert finished(msgs)["a"].finish_reason == "stop"
    assert core.slots[0].tokens == [1, 2, 3, 52, 53, 54, 55, 56]


def test_snapshot_reports_slots_and_queue():
    core = make_core(num_slots=1, prefill_chunk=8)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 30), max_tokens=50)
    submit(core, "b", range(100, 110), now=0.5)
    w.step()
    snap = core.snapshot(2.0)
    [slot] = snap.slots
    assert (slot.rid, slot.state, slot.num_tokens, slot.waiting_s) == ("a", "prefilling", 8, 2.0)
    assert snap.queue == [QueuedRequest(rid="b", priority="interactive", waiting_s=1.5,
                                        prompt_tokens=10)]
    assert snap.oldest_waiting_s == 2.0 and snap.disk.num_pages == 0
    for _ in range(4):
        w.step()
    assert core.snapshot(3.0).slots[0].state == "decoding"


def test_fail_all_fails_every_request_once_with_a_retryable_error():
    core = make_core(num_slots=1)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 10), max_tokens=50)
    submit(core, "b", range(20, 30))
    w.step()
    effects = core.handle(FailAll("component_restarted", "worker gone", 2.0), 5.0)
    failed = {m.rid: m for m in effects.messages if isinstance(m, RequestFailed)}
    assert set(failed) == {"a", "b"} and all(m.retryable for m in failed.values())
    assert not finished(effects.messages), "a failed request is not also finished"
    assert {r.rid for r in effects.finished} == {"a", "b"}  # logged once each
    assert core.num_waiting == core.num_running == 0


def test_gateway_restart_ends_requests_without_answers():
    core = make_core(num_slots=1)
    submit(core, "a", range(1, 10))
    effects = core.handle(GatewayRestarted(), 1.0)
    assert effects.messages == [] and [r.finish_reason for r in effects.finished] == [
        "cancelled"]


def test_a_constrained_request_is_placed_only_once_its_grammar_is_compiled():
    """The worker compiles a grammar off its steps (PrepareGrammar);
    until GrammarPrepared the request waits (others are placed), its end releases the
    grammar, a restarted worker compiles it again, and one the worker cannot compile fails."""
    from switchyard.proto.scheduler_worker import GrammarPrepared, PrepareGrammar, ReleaseGrammar

    core = make_core()
    w = ScriptedWorker(core)
    grammar = 'start: "x"'
    sent = core.handle(SubmitRequest("g", (1, 2, 3), 2, SamplingParams(grammar=grammar),
                                     (EOS,)), 0.0).messages
    assert sent == [PrepareGrammar("g", grammar)]
    submit(core, "free", [4, 5, 6], max_tokens=1)
    plan, _ = w.step()
    assert [core.slots[c.slot].rid for c in plan.prefills] == ["free"]
    assert core.requests["g"].slot is None and "g" in core.waiting
    core.handle(GrammarPrepared("g", "", 0.01), 1.0)
    msgs = w.run()
    assert generated(msgs, "g") and ReleaseGrammar("g") in msgs
    # A worker restart: what still waits is compiled again before it is placed.
    sent = core.handle(SubmitRequest("h", (7, 8, 9), 2, SamplingParams(grammar=grammar),
                                     (EOS,)), 2.0).messages
    assert PrepareGrammar("h", grammar) in sent
    core.handle(GrammarPrepared("h", "", 0.0), 2.0)
    again = worker_ready(core).messages
    assert PrepareGrammar("h", grammar) in again and not core.requests["h"].grammar_ready
    failed = core.handle(GrammarPrepared("h", "too complex", 0.0), 3.0).messages
    assert any(isinstance(m, RequestFailed) and m.code == "invalid_grammar" for m in failed)
    assert ReleaseGrammar("h") in failed and "h" not in core.requests
