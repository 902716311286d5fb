"""Time slicing of slots (docs/design/scheduling.md "Scheduling"), driven without sockets or MLX: a request
past its first token and its quantum gives its slot to one waiting for its first token, resumes
from its pages, and is never starved."""

import dataclasses

from switchyard.proto.scheduler_worker import RunStep
from switchyard.scheduler.events import PlanStep
from switchyard.scheduler.step_budget import PrefillBudget
from tests.unit.test_scheduler_core import ScriptedWorker, finished, generated, make_core, submit
from tests.unit.test_scheduler_pages import P, Group, conv


def sliced(group: Group, slice_tokens: int) -> Group:
    group.core.config = dataclasses.replace(group.core.config, slice_tokens=slice_tokens)
    return group


def decodes_of(steps: list[RunStep], first_position: int) -> list[tuple[int, int]]:
    """(position, input token) of the decodes at or past `first_position`, in step order."""
    return [(d.position, d.token_id) for s in steps for d in s.decodes
            if d.position >= first_position]


def test_a_yielding_request_resumes_from_its_pages_token_for_token():
    a, b = conv(1, 5 * P + 3), conv(2, 2 * P + 5)
    alone = sliced(Group(num_slots=1), 2)
    alone.submit("a", a, max_tokens=12)
    alone.run()

    g = sliced(Group(num_slots=1), 2)
    g.submit("a", a, max_tokens=12)
    while len(g.core.requests["a"].generated) < 2:
        g.now += 1.0
        g.do(PlanStep())
        g.pump()
    g.submit("b", b, max_tokens=3)
    g.run()
    assert g.finished("b").finish_reason == "length"
    assert g.core.requests == {}
    # b got the slot after a's second token; a came back and finished its reply: the same
    # tokens from the same inputs at the same positions as alone.
    assert g.reply("a") == alone.reply("a") and len(g.reply("a")) == 12
    assert decodes_of(g.steps, len(a) - 1) == decodes_of(alone.steps, len(a) - 1)
    # Its pages and the tail staged when it yielded hold its whole context: nothing of it is
    # prefilled again, and its usage still tells how its prompt came in (cold, once).
    assert g.prefilled_in(0) == (len(a) - 1) + (len(b) - 1)
    fin = g.finished("a")
    assert fin.num_cached_tokens == 0 and fin.num_generated_tokens == 12


def test_no_yield_before_the_first_token_and_the_quantum():
    core = make_core(num_slots=1, slice_tokens=3, max_queue=8)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 200), max_tokens=20)  # 4 prefill steps of 64
    w.step()
    submit(core, "b", range(300, 310), max_tokens=1)
    while len(core.requests["a"].generated) < 3:
        w.step()
        assert core.requests["a"].slot == 0 and "b" in core.waiting
    w.step()  # a generated its quantum: b takes the slot
    assert core.requests["b"].slot == 0 and "a" in core.waiting
    assert ("request.preempted", {"rid": "a", "reason": "slot", "num_held": 198 + 3,
                                  "num_generated": 3, "num_yields": 1}) in w.logs
    msgs = w.run()
    assert finished(msgs)["a"].num_generated_tokens == 20
    assert generated(msgs, "a")[-1] == 1000 + 198 + 19  # 3 before the yield, 17 after


def test_a_background_request_waiting_does_not_slice_an_interactive_one():
    core = make_core(num_slots=1, slice_tokens=1, background_wait_s=0.0)
    w = ScriptedWorker(core)
    submit(core, "fg", range(1, 20), max_tokens=10)
    w.step()
    submit(core, "bg", range(100, 110), max_tokens=1, priority="background")
    for _ in range(5):
        w.step()
        assert core.requests["fg"].slot == 0 and "bg" in core.waiting


def test_the_quantum_doubles_with_every_yield():
    """A reply under constant pressure yields after 1, 2, 4 and 8 tokens of its placements
    (slice_tokens 1): at most log2(n / slice_tokens) + 1 times for n tokens."""
    core = make_core(num_slots=1, slice_tokens=1, max_queue=64)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 20), max_tokens=16)
    sent = 0
    for _ in range(500):
        if "a" not in core.requests:
            break
        if not core.waiting or core.waiting == ["a"]:
            submit(core, f"n{sent}", range(1000 * (sent + 1), 1000 * (sent + 1) + 10),
                   max_tokens=1)
            sent += 1
        w.step()
    yields = [f["num_generated"] for e, f in w.logs
              if e == "request.preempted" and f["rid"] == "a"]
    assert yields == [1, 3, 7, 15]
    assert [r.num_generated_tokens for r in w.finished if r.rid == "a"] == [16]


def test_a_yielded_request_is_overtaken_by_at_most_num_slots_later_requests():
    """The starvation bound: newcomers keep both slots busy and the queue full of requests
    waiting for their first token (each ranks above a yielded request), yet a yielded request
    is placed again before all but num_slots of those that entered the queue after it."""
    core = make_core(num_slots=2, slice_tokens=1, max_queue=10_000, prefill_chunk=512)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 20), max_tokens=40, now=0.0)
    submit(core, "x", range(50, 70), max_tokens=40, now=0.0)
    sent, t = 0, 0.0
    holders = {}
    later = []  # for each of a's waits: requests placed that entered the queue after it
    while "a" in core.requests and t < 500:
        t += 1.0
        while sum(not core.requests[r].generated for r in core.waiting) < 3:
            sent += 1  # a stream of newcomers: always 3 waiting for their first token
            submit(core, f"n{sent}", range(100 * sent, 100 * sent + 10), max_tokens=40, now=t)
        was_waiting = "a" in core.waiting
        w.step(now=t)
        if "a" in core.waiting and not was_waiting:
            later.append([])
        for slot in core.slots:
            req = core.requests.get(slot.rid) if slot.rid else None
            if req is not None and holders.get(slot.index) != slot.rid:
                holders[slot.index] = slot.rid
                a = core.requests.get("a")
                if a is not None and a.slot is None and req.queued_at > a.queued_at:
                    later[-1].append(slot.rid)
    assert "a" not in core.requests, "a finished while newcomers kept coming"
    assert later and max(len(placed) for placed in later) <= 2, later


def test_a_burst_lasts_about_the_window_at_most():
    budget = PrefillBudget(512, 0.5)
    assert budget.burst(8) == 8  # nothing measured yet
    budget.observe(1, 0.002, 0, 0.0)
    assert budget.burst(8) == 8  # 2 ms a token: 8 fit in the window
    budget.decode_s = 0.02
    assert budget.burst(8) == 2
    budget.decode_s = 0.5
    assert budget.burst(8) == 1
