"""Running requests sized by what they hold (docs/design/kv-pages.md "Memory plan"), driven without
sockets or MLX: the core with scripted worker and kvstore (tests/unit/test_scheduler_pages.py)
and a KV budget. Requests that grow past it are staged to disk, the newest or lowest-priority
first, and resume by restoring their pages; none fails, none prefills again what it had."""

import dataclasses

from switchyard.common.held_kv import SlotHold, held_tokens
from switchyard.proto.values import SamplingParams
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.scheduler.events import PlanStep
from switchyard.scheduler.kv_memory import Relief, relieve, room_for
from switchyard.scheduler.requests import Request, Slot

from tests.unit.test_scheduler_pages import EOS, Group, P, conv

CTX = 8192


def worker_held(g, plan) -> int:
    """What the scripted worker's slots hold as the step ran, counted as the worker plans
    memory: every slot's tokens, and the decode batch's rows; a shelved slot's tokens exactly,
    a page several shelved slots hold (the same tokens up to its end) once."""
    decoding = {d.slot for d in plan.decodes}
    return held_tokens([SlotHold(len(t), 0, i in decoding) if i not in g.shelved else
                        SlotHold(len(t), pages=tuple(tuple(t[:e]) for e in range(P, len(t) + 1, P)),
                                 page_size=P)
                        for i, t in enumerate(g.slots) if t], CTX)


def run_checked(g, budget, limit=5000):
    """Run to the end, checking after every step that the worker held no more than the
    budget."""
    for _ in range(limit):
        g.now += 1.0
        g.do(PlanStep())
        before = len(g.steps)
        if not g.pump():
            return
        for plan in g.steps[before:]:
            assert worker_held(g, plan) <= budget
    raise AssertionError("did not settle")


def submit(g, rid, prompt, max_tokens, priority="interactive"):
    g.do(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,), priority))


def test_growing_requests_that_outgrow_memory_are_staged_and_none_rereads():
    """Four requests start together at 300 tokens and grow to 700: together they would hold
    about 9.2K tokens of KV; the budget holds 7K. The newest are staged to disk and resume by
    restoring their pages: every reply is whole, nothing is prefilled twice."""
    budget = 7000
    g = Group(num_slots=4, kv_budget_tokens=budget)
    prompts = {f"r{i}": conv(i, 300) for i in range(4)}
    for rid, prompt in prompts.items():
        g.now += 0.1  # r3 is the newest
        g.submit(rid, prompt, max_tokens=400)
    run_checked(g, budget)
    assert max(len(s.decodes) for s in g.steps) == 4, "all four ran at once while they fit"
    preempted = [f for f in g.logs("request.preempted") if f["reason"] == "memory"]
    assert preempted, "memory ran short"
    assert {f["rid"] for f in preempted} <= {"r2", "r3"}, "the newest went first"
    assert all(f["held_tokens"] > budget == f["budget_tokens"] for f in preempted)
    for rid in prompts:
        assert g.finished(rid).finish_reason == "length"
        assert len(g.reply(rid)) == 400
        assert g.records[rid].num_reread_tokens == 0
    resumed = g.logs("request.resumed")
    assert len(resumed) == len(preempted)
    assert all(f["num_reread"] == 0 and f["num_restored"] > 0 for f in resumed)
    # Every prompt token was prefilled once; the resumed requests restored theirs.
    assert g.prefilled_in(0) == sum(len(p) - 1 for p in prompts.values())
    assert g.core.snapshot(g.now).kv_memory.num_preempted == len(preempted)


def test_a_background_request_is_staged_before_a_newer_interactive_one():
    budget = 5000
    g = Group(num_slots=3, kv_budget_tokens=budget)
    g.core.config = dataclasses.replace(g.core.config, background_wait_s=1e6)
    submit(g, "bg", conv(1, 300), 400, priority="background")
    g.now += 1.0
    g.do(PlanStep())
    g.pump()
    submit(g, "a", conv(2, 300), 400)
    submit(g, "b", conv(3, 300), 400)
    run_checked(g, budget)
    preempted = [f["rid"] for f in g.logs("request.preempted") if f["reason"] == "memory"]
    assert preempted and preempted[0] == "bg"
    assert all(len(g.reply(r)) == 400 for r in ("bg", "a", "b"))


def test_an_interactive_request_takes_the_memory_of_a_background_one():
    """A free slot is not enough: an interactive request with no room for its KV takes the
    memory of a running background request, as it would take its slot."""
    budget = 3000
    g = Group(num_slots=3, kv_budget_tokens=budget)
    g.core.config = dataclasses.replace(g.core.config, background_wait_s=1e6)
    submit(g, "bg", conv(1, 800), 300, priority="background")
    for _ in range(3):
        g.now += 1.0
        g.do(PlanStep())
        g.pump()
    submit(g, "fg", conv(2, 900), 20)
    g.now += 1.0
    g.do(PlanStep())
    g.pump()
    assert g.core.requests["fg"].slot is not None and "bg" in g.core.waiting
    assert [(f["rid"], f["reason"], f["for_rid"]) for f in g.logs("request.preempted")] == [
        ("bg", "memory", "fg")]
    run_checked(g, budget)
    assert len(g.reply("bg")) == 300 and len(g.reply("fg")) == 20
    assert g.records["bg"].num_reread_tokens == 0
    finished_order = [r for r in g.records]
    assert finished_order.index("fg") < finished_order.index("bg")


def test_the_last_running_request_is_never_staged():
    """One request alone may fill its budget (the worker's plan checked one at full context
    fits); it is never preempted for memory."""
    g = Group(num_slots=2, kv_budget_tokens=1000)
    g.submit("a", conv(1, 500), max_tokens=600)
    g.run()
    assert len(g.reply("a")) == 600
    assert not g.logs("request.preempted")


def test_idle_conversations_leave_memory_before_a_running_request_is_staged():
    """Resident idle slots (kept for their next turn) go first, once their pages are on disk,
    whatever --release-after-s says."""
    budget = 2000
    g = Group(num_slots=3, resident_slots=3, release_after_s=1000.0, kv_budget_tokens=budget)
    g.submit("idle", conv(1, 600), max_tokens=4)
    g.run()
    assert [len(t) > 0 for t in g.slots].count(True) == 1
    g.submit("grow", conv(2, 300), max_tokens=700)
    run_checked(g, budget)
    assert len(g.reply("grow")) == 700
    assert not g.logs("request.preempted")
    released = [slot for s in g.steps for slot in s.releases]
    assert released, "the idle conversation left memory for the growing one"


def test_a_request_that_does_not_fit_waits_in_order_and_runs_once_room_is_made():
    budget = 3000
    g = Group(num_slots=3, kv_budget_tokens=budget)
    g.submit("a", conv(1, 1000), max_tokens=40)
    g.now += 1.0
    g.do(PlanStep())
    g.pump()
    g.submit("big", conv(2, 1500), max_tokens=8)
    g.submit("small", conv(3, 20), max_tokens=8)
    g.now += 1.0
    g.do(PlanStep())
    g.pump()
    assert "big" in g.core.waiting and "small" in g.core.waiting, "order is kept"
    assert [f["rid"] for f in g.logs("request.waits_for_memory")] == ["big"]
    run_checked(g, budget)
    assert all(g.finished(r).finish_reason == "length" for r in ("a", "big", "small"))
    waits = [f["rid"] for f in g.logs("request.waits_for_memory")]
    assert len(waits) == len(set(waits)), "logged once per wait"


# --- the pure decisions --------------------------------------------------------------------

def request(rid, prompt_len, max_tokens=100, arrived=0.0, priority="interactive"):
    return Request(rid=rid, prompt=tuple(range(1, prompt_len + 1)), max_tokens=max_tokens,
                   sampling=SamplingParams(), stop_token_ids=frozenset(), priority=priority,
                   arrived_at=arrived)


def running(slots, requests, index, req, held):
    slots[index].rid, slots[index].tokens = req.rid, list(range(held))
    req.slot = index
    requests[req.rid] = req


def test_relieve_takes_idle_slots_least_recent_first_then_the_newest_request():
    slots = [Slot(i) for i in range(4)]
    requests = {}
    old, new = request("old", 1000, arrived=1.0), request("new", 1000, arrived=2.0)
    running(slots, requests, 0, old, 1000)
    running(slots, requests, 1, new, 1000)
    slots[2].tokens, slots[2].last_used = list(range(900)), 5.0
    slots[3].tokens, slots[3].last_used = list(range(900)), 3.0
    newest_first = lambda r: (r.priority != "interactive", r.arrived_at)  # noqa: E731
    everything = held_tokens([SlotHold(1000, 100, True)] * 2 + [SlotHold(900)] * 2, CTX)
    assert relieve(slots, requests, everything, CTX, newest_first).leave == []
    one_less = relieve(slots, requests, everything - 1, CTX, newest_first)
    assert one_less.leave == [3] and one_less.preempt == []
    tight = relieve(slots, requests, 3000, CTX, newest_first)
    assert tight.leave == [3, 2, 1] and tight.preempt == ["new"]
    nothing = relieve(slots, requests, 1, CTX, newest_first)
    assert nothing.preempt == ["new"], "never the last one running"


def test_relieve_cuts_the_last_idle_slot_to_leave_to_the_pages_that_fit():
    slots = [Slot(i) for i in range(3)]
    requests = {}
    running(slots, requests, 0, request("a", 1000), 1000)
    slots[1].tokens, slots[1].last_used = list(range(40 * P + 3)), 1.0
    slots[1].page_ids = [bytes([1, k]) for k in range(40)]
    everything = held_tokens([SlotHold(1000, 100), SlotHold(40 * P + 3)], CTX)
    budget = everything - 20 * P
    newest_first = lambda r: r.arrived_at  # noqa: E731
    assert relieve(slots, requests, budget, CTX, newest_first, page_size=P) == Relief([1])
    relief = relieve(slots, requests, budget, CTX, newest_first, page_size=P, cut=True)
    pages = (budget - held_tokens([SlotHold(1000, 100)], CTX)) // P
    assert relief == Relief([1], [], (1, pages * P)) and 0 < pages < 40
    slots[2].tokens, slots[2].page_ids = list(range(40 * P)), slots[1].page_ids  # a sibling's
    assert relieve(slots, requests, budget, CTX, newest_first, page_size=P, cut=True).cut is None


def test_room_for_releases_only_idle_slots_on_disk():
    slots = [Slot(i) for i in range(3)]
    requests = {}
    running(slots, requests, 0, request("a", 1000), 1000)
    slots[1].tokens, slots[1].last_used = list(range(2000)), 1.0
    hold = SlotHold(0, 1100)
    with_idle = held_tokens([SlotHold(1000, 100), SlotHold(2000), hold], CTX)
    assert room_for(hold, 2, slots, requests, with_idle, CTX, lambda s: False).leave == []
    assert room_for(hold, 2, slots, requests, with_idle - 1, CTX, lambda s: False) is None
    assert room_for(hold, 2, slots, requests, with_idle - 1, CTX, lambda s: True).leave == [1]


def test_room_for_cuts_the_slot_most_worth_keeping_to_the_pages_that_fit():
    """With `cut`, the room left once the slots that fit whole stay goes to the most worth
    keeping of those that leave: its leading pages that fit stay (docs/design/kv-pages.md
    "Cut slots"); not where they are all held elsewhere too (the request's own pages)."""
    slots = [Slot(i) for i in range(4)]
    requests = {}
    running(slots, requests, 0, request("a", 1000), 1000)
    for index, n, used in ((1, 40 * P + 3, 2.0), (2, 10 * P, 1.0)):
        slots[index].tokens, slots[index].last_used = list(range(n)), used
        slots[index].page_ids = [bytes([index, k]) for k in range(n // P)]
    hold = SlotHold(0, 1100)
    fixed = held_tokens([SlotHold(1000, 100), hold], CTX)
    budget = fixed + 25 * P  # slot 2 (160 tokens, rounded up to 256) fits whole, not slot 1

    room = room_for(hold, 3, slots, requests, budget, CTX, lambda s: True, page_size=P)
    assert (room.leave, room.cut) == ([1], None)
    room = room_for(hold, 3, slots, requests, budget, CTX, lambda s: True, page_size=P, cut=True)
    kept = held_tokens([SlotHold(1000, 100), hold, SlotHold(10 * P)], CTX)
    pages = (budget - kept) // P
    assert room.leave == [1] and room.cut == (1, pages * P) and 0 < pages < 40
    room = room_for(hold, 3, slots, requests, budget, CTX, lambda s: True, page_size=P, cut=True,
                    its_pages=slots[1].page_ids[:pages])
    assert (room.leave, room.cut) == ([1], None)


def test_twenty_sub_agents_run_at_once_at_ctx_32768_on_a_24_gib_machine():
    """The agent traffic's case: SmolLM2-135M (f32 KV, 46080 bytes a token; its plan's fixed part as
    the worker measured it on the 24 GiB test machine) at --ctx 32768. --max-running 0 runs
    26 (it ran 7 when every slot counted at full context), and 20 sub-agents at 4-6.5K tokens
    all run and decode at once, none staged."""
    from switchyard.worker.memory_plan import make_plan, widest_running

    def smollm2(n):
        return make_plan(runtime=209_251_072, weights=653_075_712, kv_bytes_per_token=46080,
                         recurrent_bytes_per_slot=0, num_slots=n, ctx=32768,
                         prefill_chunk=512, num_heads=9, hidden=576, intermediate=1536,
                         vocab=49152, page_buffers=259_522_560, limit=25_276_203_008,
                         headroom=2**30)

    running = widest_running(smollm2, 4, 32)
    assert running == 26
    budget = smollm2(running).kv_budget_tokens
    g = Group(num_slots=running, resident_slots=4, prefill_chunk=8192,
              kv_budget_tokens=budget)
    g.core.config = dataclasses.replace(g.core.config, ctx=32768, max_queue=64)
    system = conv(99, 600)
    for i in range(20):
        g.submit(f"sub{i}", system + conv(i, 3400 + 150 * i), max_tokens=300)
    g.run()
    assert max(len(s.decodes) for s in g.steps) == 20, "all twenty decode in one batch"
    assert not g.logs("request.preempted") and not g.logs("request.waits_for_memory")
    assert all(len(g.reply(f"sub{i}")) == 300 for i in range(20))


def test_idle_siblings_are_shelved_and_hold_their_prefix_once():
    """Three sub-agents of one prompt, idle between turns, are shelved as shared pages
    (docs/design/kv-pages.md "Shared pages in memory"): their 40 shared pages count once, so a
    fourth conversation fits beside them where copies would send one to disk. A slot alone is
    not shelved; one used again is whole."""
    prefix = conv(9, 40 * P)
    siblings = {f"s{i}": prefix + conv(i, 2 * P + 5) for i in range(3)}

    def run(shared_pages):
        g = Group(num_slots=5, resident_slots=5, release_after_s=1000.0,
                  kv_budget_tokens=3000, shared_pages=shared_pages)
        g.submit("alone", conv(7, 3 * P), max_tokens=4)
        for rid, prompt in siblings.items():
            g.submit(rid, prompt, max_tokens=4)
            run_checked(g, 3000)
        g.submit("other", conv(8, 900), max_tokens=4)
        run_checked(g, 3000)
        return g

    g = run(shared_pages=True)
    shelved = {slot for s in g.steps for slot in s.shelves}
    assert shelved == {g.core.slots.index(s) for s in g.core.slots if s.last_rid in siblings}
    assert not any(s.releases for s in g.steps), "all of it stays in memory"
    assert g.finished("other").finish_reason == "length"
    kv = g.core.snapshot(g.now).kv_memory
    held = kv.held_tokens
    assert kv.num_shelved == 3
    sibs = [s for s in g.core.slots if s.last_rid in siblings]
    others = [SlotHold(len(s.tokens)) for s in g.core.slots if s.tokens and s not in sibs]
    assert held == len(prefix) + sum(len(s.tokens) - len(prefix) for s in sibs) \
        + held_tokens(others, CTX)

    g = run(shared_pages=False)  # copies: one goes to disk to make room
    assert not any(s.shelves for s in g.steps)
    assert any(s.releases for s in g.steps)


def test_a_slot_cut_for_a_newcomer_keeps_its_front_and_its_next_turn_restores_its_end_only():
    """A newcomer that needs part of an idle conversation's room cuts it (RunStep.cuts,
    docs/design/kv-pages.md "Cut slots"): its leading pages stay in memory, shelved, the rest
    is on disk; its next turn reuses the front, restores only the end, and re-reads nothing.
    The worker never holds more than the budget."""
    budget = 1600
    g = Group(num_slots=3, resident_slots=3, release_after_s=1000.0, kv_budget_tokens=budget,
              shared_pages=True)
    first = conv(1, 60 * P)
    g.submit("a1", first, max_tokens=4)
    run_checked(g, budget)
    home = next(s.index for s in g.core.slots if s.last_rid == "a1")
    g.submit("b", conv(2, 40 * P), max_tokens=4)
    run_checked(g, budget)
    cuts = [c for s in g.steps for c in s.cuts]
    assert [c.slot for c in cuts] == [home] and not any(s.releases for s in g.steps)
    kept = cuts[0].num_tokens
    assert 0 < kept < len(first) and g.slots[home] == first[:kept] and home in g.shelved
    kv = g.core.snapshot(g.now).kv_memory
    assert (kv.num_cut, kv.cut_kept_tokens, kv.num_shelved) == (1, kept, 1)

    since = len(g.steps)
    g.submit("a2", first + g.reply("a1") + conv(3, 20), max_tokens=4)
    run_checked(g, budget)
    loads = [ld for s in g.steps[since:] for ld in s.loads]
    assert loads and all(ld.slot == home for ld in loads) and loads[0].start == kept
    assert g.prefilled_in(since) == 20, "only its new tokens are read"
    assert g.finished("a2").num_cached_tokens == len(first) + 3  # the reply but its last
