"""Fair shares between tenants (scheduler.tenant_shares), driven through the core without
sockets or MLX: one key's flood of long streams leaves another key a queue place, a slot and
its first token within a few steps; one key's interactive prefills leave another key's
background work its share; weights divide the shares; nothing changes hands back and forth;
and with one tenant the order is what it was."""

from switchyard.proto.gateway_scheduler import RequestFailed, SubmitRequest, TokensGenerated
from switchyard.proto.values import SamplingParams
from switchyard.scheduler.tenant_shares import TenantShares
from tests.unit.test_scheduler_core import EOS, ScriptedWorker, make_core


def send(core, rid, prompt, *, tenant, weight=1.0, max_tokens=100_000,
         priority="interactive", now=0.0):
    return core.handle(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,),
                                     priority, tenant=tenant, tenant_weight=weight),
                       now).messages


def refused(messages):
    return [m for m in messages if isinstance(m, RequestFailed)]


def running(core, tenant):
    return sum(1 for s in core.slots if s.rid and core.requests[s.rid].tenant == tenant)


def flood(core, tenant, count, weight=1.0, now=0.0):
    """`count` long streams of `tenant`; the refusals they got."""
    out = []
    for i in range(count):
        out += refused(send(core, f"{tenant}{i}", range(1000 * i + 1, 1000 * i + 9),
                            tenant=tenant, weight=weight, now=now))
    return out


def first_token_step(core, w, rid, max_steps=50, start=1.0, dt=0.1):
    """The step (1-based) that gave `rid` its first token, or None within `max_steps`."""
    for n in range(1, max_steps + 1):
        _, messages = w.step(now=start + n * dt)
        if any(isinstance(m, TokensGenerated) and m.rid == rid for m in messages):
            return n
    return None


def test_one_keys_hundred_streams_leave_another_key_served():
    """The 100-stream shut-out: bob's streams fill every slot and the queue; alice's request
    is queued (bob's next one is refused with Retry-After instead), takes half the slots and
    has its first token within a few steps."""
    core = make_core(num_slots=4, max_queue=8)
    w = ScriptedWorker(core)
    bob_refused = []
    for i in range(100):
        bob_refused += refused(send(core, f"bob{i}", range(1000 * i + 1, 1000 * i + 9),
                                    tenant="bob"))
        if i == 3:
            w.step()  # the first four are placed
    w.step()
    assert running(core, "bob") == 4 and len(core.waiting) == 8
    assert len(bob_refused) == 88
    assert all(f.code == "queue_full" and f.retryable and f.retry_after_s > 0
               for f in bob_refused)
    assert not refused(send(core, "alice", range(50_000, 50_040), tenant="alice",
                            max_tokens=4, now=1.0))
    assert refused(send(core, "bob-more", range(60_000, 60_008), tenant="bob", now=1.0))
    step = first_token_step(core, w, "alice")
    assert step is not None and step <= 3, step
    assert "alice" in core.requests and running(core, "bob") == 3  # one slot given, no more


def test_a_tenant_gets_no_more_than_its_share_of_the_slots():
    core = make_core(num_slots=4, max_queue=16)
    w = ScriptedWorker(core)
    flood(core, "bob", 8)
    w.step()
    flood(core, "alice", 8, now=1.0)
    for n in range(30):
        w.step(now=1.0 + n)
    assert running(core, "alice") == running(core, "bob") == 2
    preempted = [f for event, f in w.logs if event == "request.preempted"]
    assert len(preempted) == 2  # once, not back and forth
    assert all(f["rid"].startswith("bob") for f in preempted)


def test_weights_divide_the_slots_and_the_queue():
    core = make_core(num_slots=4, max_queue=8)
    w = ScriptedWorker(core)
    flood(core, "bob", 12, weight=3.0)
    w.step()
    alice_refused = flood(core, "alice", 6, now=1.0)
    for n in range(30):
        w.step(now=1.0 + n)
    assert (running(core, "bob"), running(core, "alice")) == (3, 1)
    # Beside bob (3), alice's share of the 8 places is 2: her 3rd and later are refused.
    assert len(alice_refused) == 4


def test_another_keys_interactive_prefills_leave_background_work_its_share():
    """Bob's interactive prompts keep both slots prefilling; alice's background
    request is placed at once (her share) and prefilled beside them, long before the
    background bound, where before it waited for every interactive request of anyone."""
    core = make_core(num_slots=2, prefill_chunk=32, max_queue=16, background_wait_s=30.0)
    w = ScriptedWorker(core)
    for i in range(6):
        send(core, f"bob{i}", range(1000 * (i + 1), 1000 * (i + 1) + 600), tenant="bob",
             max_tokens=50)
    w.step()
    send(core, "alice-bg", range(90_000, 90_100), tenant="alice", max_tokens=2,
         priority="background", now=1.0)
    step = first_token_step(core, w, "alice-bg", max_steps=100, dt=0.2)
    assert step is not None and step * 0.2 < 5.0, step  # the bound is 30 s


def test_prefill_alternates_between_tenants_by_weight():
    shares = TenantShares()
    shares.note("bob", 1.0)
    shares.note("alice", 2.0)

    class Req:
        def __init__(self, tenant):
            self.tenant = tenant

    bob, alice = Req("bob"), Req("alice")
    got = {"bob": 0, "alice": 0}
    for _ in range(30):
        first = shares.prefill_order([(bob, 100), (alice, 100)])[0][0]
        shares.charge(first.tenant, 64)  # the whole step's chunk goes to the first
        got[first.tenant] += 64
    assert abs(got["alice"] - 2 * got["bob"]) <= 64


def test_a_tenant_back_from_idle_banks_no_prefill_credit():
    shares = TenantShares()

    class Req:
        def __init__(self, tenant):
            self.tenant = tenant

    bob, alice = Req("bob"), Req("alice")
    for _ in range(50):
        shares.prefill_order([(bob, 100)])
        shares.charge("bob", 64)
    order = []
    for _ in range(4):
        first = shares.prefill_order([(bob, 100), (alice, 100)])[0][0]
        shares.charge(first.tenant, 64)
        order.append(first.tenant)
    assert order.count("alice") == 2, order  # alternate, not alice's 50 steps in a row


def test_one_tenant_keeps_the_order_and_the_whole_queue():
    """Single-key use is unchanged: the whole queue is the one tenant's, and the admission
    order is the one scheduler.fairness gives."""
    core = make_core(num_slots=1, max_queue=4)
    w = ScriptedWorker(core)
    failed = flood(core, "", 6)
    assert len(failed) == 2 and failed[0].message == "4 requests are waiting; try again shortly"
    w.step()
    shares = TenantShares()
    order = ["c", "a", "b"]
    assert shares.admission_order(order, lambda rid: "", {"": 3}) == order
