"""The timeline of a session in the status (docs/design/scheduling.md "A picture of a session"), without
sockets: the core labels each request's conversation (a main agent's turns share one label;
sub-agents started together under one system prompt are each their own, numbered after the
first page's label), the status's recent requests carry each request's times and tokens by
source, and a tenant's view keeps only its own rows."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from switchyard.gateway.tenant_view import status_for
from switchyard.proto.scheduler_worker import SampledToken, StepDone
from switchyard.proto.values import SamplingParams
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.common.page_ids import chain_page_ids
from switchyard.common.tenants import Tenants, parse_keys
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.conversation_threads import ConversationThreads
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import PlanStep
from switchyard.scheduler.stats import SchedulerStats
from switchyard.scheduler.status_rows import conversation_label
from switchyard.scheduler.turns import Anchor
from tests.unit.test_tenant_secrets import two_tenants_status

EOS = 0
PAGE = 16
SYSTEM_MAIN = tuple(range(1, 50))
SYSTEM_SUB = tuple(range(200, 260))  # sub-agents' own system prompt, shared by all three


def drive(core: SchedulerCore, submits: list[tuple[str, tuple[int, ...]]], now: float,
          finished: list) -> float:
    """Submit requests together and run steps until they end (a worker that samples 900 +
    position, three tokens each); returns the time after."""
    for rid, prompt in submits:
        core.handle(SubmitRequest(rid, prompt, 3, SamplingParams(), (EOS,), "interactive"), now)
    for _ in range(200):
        now += 0.01
        effects = core.handle(PlanStep(), now)
        finished += effects.finished
        plan = effects.step
        if plan is None:
            break
        sampled = tuple(SampledToken(d.slot, 900 + d.position) for d in plan.decodes)
        done = core.handle(StepDone(plan.step, sampled, sum(len(c.token_ids) for c in
                                                           plan.prefills),
                                    len(plan.decodes), 0.001), now)
        finished += done.finished
    return now


def first_page_id(core: SchedulerCore, tokens: tuple[int, ...]) -> bytes:
    return chain_page_ids(core.pages.chain_namespace, tokens[:PAGE], PAGE)[0]


def reply(prompt: tuple[int, ...]) -> tuple[int, ...]:
    """What the scripted worker generated for `prompt` (its three tokens)."""
    return tuple(900 + len(prompt) - 1 + i for i in range(3))


def test_a_main_agent_and_three_sub_agents_are_four_conversations():
    core = SchedulerCore(CoreConfig(num_slots=4, ctx=4096, prefill_chunk=64, max_queue=8,
                                    decode_burst=1, page_size=PAGE))
    done: list = []
    main1 = SYSTEM_MAIN + (7, 7, 7)
    now = drive(core, [("main.1", main1)], 1.0, done)
    subs1 = {n: SYSTEM_SUB + (300 + n, 301, 302) for n in range(3)}
    now = drive(core, [(f"sub{n}.1", p) for n, p in subs1.items()], now, done)
    subs2 = {n: p + reply(p) + (400 + n, 401) for n, p in subs1.items()}
    now = drive(core, [(f"sub{n}.2", p) for n, p in subs2.items()], now, done)
    main2 = main1 + reply(main1) + (500, 501, 502)
    drive(core, [("main.2", main2)], now, done)

    label = {rec.rid: rec.conversation for rec in done}
    assert label["main.1"] == label["main.2"]
    first_sub = conversation_label(first_page_id(core, SYSTEM_SUB))
    assert sorted(label[f"sub{n}.1"] for n in range(3)) == [
        first_sub, f"{first_sub}#2", f"{first_sub}#3"]
    for n in range(3):
        assert label[f"sub{n}.2"] == label[f"sub{n}.1"]
    assert len(set(label.values())) == 4
    # The slot table names a slot by its first page's label: the main agent's is its own.
    assert label["main.1"] == conversation_label(first_page_id(core, SYSTEM_MAIN))

    stats = SchedulerStats()
    for rec in done:
        stats.request_finished(rec, 100.0)
    rows = {r.rid: r for r in stats.snapshot().recent_requests}
    again = rows["sub1.2"]
    assert again.conversation == label["sub1.2"]
    assert again.prompt_tokens == len(subs2[1])
    # What its slot held (its first turn, prompt and reply) is reused; the rest prefilled.
    assert again.reused_tokens + again.copied_tokens + again.restored_tokens == \
        again.cached_tokens > len(subs1[1])
    assert again.prefilled_tokens == again.prompt_tokens - again.cached_tokens
    assert again.generated_tokens == 3
    assert again.started_at < again.started_at + again.ttft_s <= again.at == 100.0


def test_a_sibling_that_copies_the_shared_prefix_counts_it_as_copied():
    core = SchedulerCore(CoreConfig(num_slots=4, ctx=4096, prefill_chunk=64, max_queue=8,
                                    decode_burst=1, page_size=PAGE))
    done: list = []
    now = drive(core, [("a", SYSTEM_SUB + (301, 302))], 1.0, done)
    drive(core, [("b", SYSTEM_SUB + (311, 312))], now, done)
    b = next(r for r in done if r.rid == "b")
    assert b.num_copied_tokens >= PAGE * (len(SYSTEM_SUB) // PAGE) - PAGE
    a_label, b_label = (next(r.conversation for r in done if r.rid == rid) for rid in "ab")
    assert b_label == f"{a_label}#2"


def test_labels_are_remembered_within_bounds_and_counted_per_tenant():
    threads = ConversationThreads(capacity=2)
    turns = [Anchor(10 * n, bytes([n]) * 16, b"") for n in range(1, 4)]
    first = b"p" * 16
    one = threads.place(turns[0], [], first, "alice")
    assert threads.place(turns[1], [turns[0]], first, "alice") == one  # its next turn
    assert threads.place(None, [], first, "bob") == one  # bob's own count starts at 1
    assert threads.place(turns[2], [], first, "alice") == f"{one}#2"
    assert len(threads) == 2  # the oldest turn is forgotten: its next request starts anew
    assert threads.place(None, [turns[0]], first, "alice") == f"{one}#3"


def _row(tenant: str, rid: str, conversation: str) -> SimpleNamespace:
    return SimpleNamespace(
        rid=rid, tenant=tenant, conversation=conversation, finish_reason="stop",
        priority="interactive",        num_prompt_tokens=40, num_cached_tokens=32, num_reused_tokens=32, num_copied_tokens=0,
        num_restored_tokens=0, num_prefilled_tokens=8, num_generated_tokens=3, ttft_s=0.1,
        duration_s=0.5, num_proposed_tokens=0, num_accepted_tokens=0)


def test_a_tenant_sees_the_timeline_of_its_own_requests_only():
    stats = SchedulerStats()
    for tenant, rid, conv in (("alice", "r1", "aaaaaaaaaaaa"), ("bob", "r2", "bbbbbbbbbbbb"),
                              ("alice", "r3", "aaaaaaaaaaaa#2")):
        stats.request_finished(_row(tenant, rid, conv), 50.0)
    status = msgspec.structs.replace(two_tenants_status(), stats=stats.snapshot())
    tenants = Tenants(parse_keys("alice sk-a\nbob sk-b\nops,role=operator sk-o\n"))
    alice, bob, ops = tenants.tenants
    rows = status_for(status, alice, tenants).stats.recent_requests
    assert [(r.rid, r.conversation, r.started_at) for r in rows] == [
        ("r1", "aaaaaaaaaaaa", 49.5), ("r3", "aaaaaaaaaaaa#2", 49.5)]
    assert [r.rid for r in status_for(status, bob, tenants).stats.recent_requests] == ["r2"]
    assert len(status_for(status, ops, tenants).stats.recent_requests) == 3
