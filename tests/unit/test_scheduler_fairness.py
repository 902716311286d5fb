"""Prefill order, slot admission and the background bound, driven without sockets
or MLX; and admission waiting for the page index after a start."""

from switchyard.proto.scheduler_kvstore import AttachBuffers, InventoryDescribed
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import IndexOverdue, KvstoreRestarted
from switchyard.scheduler.fairness import oldest_waiting_s
from tests.unit.test_scheduler_core import ScriptedWorker, make_core, submit
from tests.unit.test_scheduler_pages import P, Group, conv, worker_ready

R = 200  # the waiting request's tokens to prefill


def newcomer_stream(overtake_limit: float, num_newcomers: int = 12):
    """x decodes all along (so the prefill budget is small); `old` waits to prefill R tokens;
    newcomers, each 1-3 tokens shorter than `old`, keep two slots busy (a new one arrives as
    soon as one finishes). Returns the core, `old`, `old`'s waited tokens when each newcomer
    arrived, and the newcomers that got a prefill chunk before `old`'s prefill was done."""
    core = make_core(num_slots=4, prefill_chunk=64, overtake_limit=overtake_limit,
                     max_queue=64)
    w = ScriptedWorker(core)
    submit(core, "x", [1, 2, 3], max_tokens=100_000)
    w.step()
    w.step()
    core.budget.observe(1, 0.010, 100, 0.1)  # 10 ms decode, 1 ms per prefill token: ~8/step
    submit(core, "old", range(10_000, 10_000 + R + 1), max_tokens=1)
    old = core.requests["old"]
    waited_at_arrival, ahead = {}, []
    sent = 0
    for _ in range(5000):
        if old.prefilled_at is not None or sent > num_newcomers:
            break
        while sum(rid.startswith("n") for rid in core.requests) < 2:
            rid = f"n{sent}"
            sent += 1
            length = R - 1 - sent % 3  # slightly shorter than `old`
            submit(core, rid, range(20_000 * (sent + 1), 20_000 * (sent + 1) + length + 1),
                   max_tokens=1)
            waited_at_arrival[rid] = old.num_waited_tokens
        plan, _ = w.step()
        for chunk in plan.prefills:
            rid = core.slots[chunk.slot].rid
            if rid != "old" and rid not in ahead:
                ahead.append(rid)
    return core, old, waited_at_arrival, ahead


def test_waiting_request_is_served_within_its_bound_while_shorter_newcomers_keep_coming():
    core, old, waited_at_arrival, ahead = newcomer_stream(overtake_limit=1.0)
    assert old.prefilled_at is not None, "the waiting request was starved"
    # The bound (docs/design/scheduling.md "Scheduling"): only requests that became ready before others
    # had been prefilled overtake_limit x R tokens (+ one step's chunk) past it go first.
    assert all(waited_at_arrival[rid] < 1.0 * R + 64 for rid in ahead), \
        (ahead, waited_at_arrival)
    assert len(ahead) <= 3


def test_shortest_first_without_aging_starves_the_waiting_request():
    """The same stream without aging (the order before aging): the test above can fail."""
    core, old, _, ahead = newcomer_stream(overtake_limit=1e12)
    assert old.prefilled_at is None and old.first_chunk_at is None
    assert len(ahead) >= 12


def test_nearly_resident_turn_still_goes_before_a_cold_prompt():
    core = make_core(num_slots=3, prefill_chunk=16)
    w = ScriptedWorker(core)
    submit(core, "warm0", range(1, 40), max_tokens=1)
    w.run()
    submit(core, "cold", range(500, 900), max_tokens=1)
    w.step()  # the cold prompt starts alone
    submit(core, "warm", list(range(1, 40)) + [1039, 77, 78], max_tokens=1)
    plan, _ = w.step()
    assert plan.prefills[0].slot == core.requests["warm"].slot


def test_background_waits_for_interactive_work_but_not_past_its_bound():
    # Without time slicing: the order of whole requests in the one slot.
    core = make_core(num_slots=1, background_wait_s=30.0, slice_tokens=0)
    w = ScriptedWorker(core)
    submit(core, "fg0", range(1, 20), max_tokens=10, now=0.0)
    submit(core, "bg", range(100, 120), max_tokens=2, priority="background", now=1.0)
    submit(core, "fg1", range(200, 220), max_tokens=30, now=5.0)
    submit(core, "fg2", range(300, 320), max_tokens=30, now=25.0)
    order = []
    for t in range(0, 120):
        w.step(now=float(t))
        rid = core.slots[0].rid
        if rid and (not order or order[-1] != rid):
            order.append(rid)
    # Before its bound bg waits for fg1, which arrived later; after it (t >= 31) it is
    # scheduled as interactive: it goes before fg2, which arrived before fg1 finished.
    assert order == ["fg0", "fg1", "bg", "fg2"]


def test_interactive_newcomer_does_not_preempt_background_past_its_bound():
    core = make_core(num_slots=1, background_wait_s=30.0)
    w = ScriptedWorker(core)
    submit(core, "bg", range(100, 120), max_tokens=500, priority="background", now=0.0)
    w.step(now=40.0)
    w.step(now=40.0)
    submit(core, "fg", range(1, 20), max_tokens=2, now=41.0)
    w.step(now=41.0)
    assert core.requests["bg"].slot == 0 and "fg" in core.waiting


def test_finished_record_tells_queue_prefill_wait_and_prefill_apart():
    core = make_core(num_slots=2, prefill_chunk=64)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 101), max_tokens=1, now=0.0)
    submit(core, "b", range(200, 401), max_tokens=1, now=0.0)
    submit(core, "c", range(500, 530), max_tokens=1, now=0.0)  # waits for a slot
    for t in range(1, 20):
        w.step(now=float(t))
    recs = {r.rid: r for r in w.finished}
    a, b, c = recs["a"], recs["b"], recs["c"]
    assert a.queue_s == b.queue_s == 1.0 and c.queue_s > 1.0
    # One 64-token chunk a step, shortest first: a (99 tokens) takes step 1 and 35 of step 2.
    assert a.prefill_wait_s == 0.0 and a.prefill_s == 2.0
    assert b.prefill_wait_s == 1.0 and b.num_waited_tokens == 64  # a took step 1 whole
    assert b.prefill_s > 0.0 and a.num_waited_tokens == 0


def test_oldest_waiting_counts_requests_in_slots_without_a_first_token():
    core = make_core(num_slots=1, prefill_chunk=16)
    w = ScriptedWorker(core)
    submit(core, "a", range(1, 200), max_tokens=1, now=0.0)
    submit(core, "b", range(300, 310), max_tokens=1, now=2.0)
    w.step(now=3.0)
    assert oldest_waiting_s(core.requests.values(), 10.0) == 10.0  # a, prefilling in its slot


# --- nothing is placed before the page index is known ---------------------------


def test_requests_wait_for_the_page_index_after_a_restart():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 2)
    g.submit("a1", a)
    g.run()
    pages = tuple(g.disk.values())
    # The whole group restarts: the worker is ready before kvstore's inventory arrives.
    fresh = SchedulerCore(g.core.config.__class__(**{**g.core.config.__dict__,
                                                     "wait_for_index": True}))
    g.core, g.slots = fresh, [[]]
    g.do(worker_ready(fresh))
    g.submit("a2", a + [4])
    g.run()
    assert fresh.requests["a2"].slot is None, "placed before the page index was known"
    g.outbox.clear()  # sent to the kvstore that is gone
    msgs = g.do(KvstoreRestarted()).messages + g.do(InventoryDescribed("kv", pages)).messages
    attach = [m for m in msgs if isinstance(m, AttachBuffers)]
    assert attach, "kvstore must learn of the worker's buffers that came before its index"
    g.run()
    assert g.finished("a2").num_cached_tokens == len(a) - 1  # the prompt context's tail


def test_index_overdue_places_without_disk_pages():
    g = Group(num_slots=1)
    fresh = SchedulerCore(g.core.config.__class__(**{**g.core.config.__dict__,
                                                     "wait_for_index": True}))
    g.core, g.slots = fresh, [[]]
    g.do(worker_ready(fresh))
    g.submit("a", conv(2, 40))
    g.run()
    assert "a" in fresh.waiting
    g.do(IndexOverdue(True))  # kvstore stayed away: serve, prefilling
    g.run()
    assert g.finished("a").num_cached_tokens == 0


def test_pages_on_their_way_to_a_killed_kvstore_are_written_by_its_successor():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 5)
    g.submit("a1", a, max_tokens=1)
    dead = []  # kvstore was killed: what is sent to it is never answered
    real_kvstore, g._kvstore = g._kvstore, dead.append
    g.run()
    assert any(m.__class__.__name__ == "WritePages" for m in dead)
    g.submit("b1", conv(2, 3 * P))
    g.run()  # b1 takes the slot at once: a1's pages now exist only in the page buffers
    assert g.slots[0][:len(a)] != a
    # The new kvstore greets: the writes in flight are sent again from their buffers.
    g._kvstore = real_kvstore
    g.do(KvstoreRestarted())
    g.do(InventoryDescribed("kv2", tuple(g.disk.values())))
    g.pump()
    g.run()
    assert g.finished("b1")
    g.submit("a2", a + [3000 + len(a), 7, 8])
    g.run()
    assert g.finished("a2").num_cached_tokens == len(a)  # full pages and the tail
