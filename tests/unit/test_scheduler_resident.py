"""--max-running past --slots: more requests run at once than conversations stay in memory.

The core with scripted worker and kvstore (tests/unit/test_scheduler_pages.py): every running
request has a slot of its own, and once idle, slots past --slots give their KV up, each only
when all its tokens are on disk or on their way, so the conversation's next turn restores
them instead of prefilling them again (docs/design/scheduling.md "Running past the resident slots").
Slots are released as soon as they may be (`release_after_s` 0) unless a test says otherwise.
"""

from switchyard.proto.scheduler_kvstore import WritePages
from switchyard.scheduler.events import PlanStep

from tests.unit.test_scheduler_pages import Group, P, conv


def holding(g):
    """Slots holding tokens, in the core's view (asserted equal to the worker's)."""
    assert [s.tokens for s in g.core.slots] == g.slots
    return [s.index for s in g.core.slots if s.tokens]


def fan_out(g, n, system, max_tokens=6):
    for i in range(n):
        g.submit(f"sub{i}", system + conv(i, 20 + i), max_tokens=max_tokens)
    g.run()
    return {f"sub{i}": system + conv(i, 20 + i) for i in range(n)}


def test_every_request_runs_at_once_and_only_the_resident_slots_stay():
    g = Group(num_slots=6, resident_slots=2)
    system = conv(99, 4 * P)
    prompts = fan_out(g, 6, system, max_tokens=16)
    widest = max(len(s.decodes) for s in g.steps)
    assert widest == 6, "all six decode in one batch, not two at a time"
    assert len(holding(g)) == 2, "idle, only --slots conversations stay in memory"
    released = [slot for s in g.steps for slot in s.releases]
    assert len(released) == 4
    # The released conversations come back: their next turn restores every token it had
    # (prompt and reply but its last token, which was never fed) and prefills only its own.
    for rid, prompt in prompts.items():
        before = len(g.steps)
        g.submit(rid + "'", prompt + g.reply(rid) + [7, 8, 9], max_tokens=2)
        g.run()
        assert g.finished(rid + "'").num_cached_tokens >= len(prompt) + len(g.reply(rid)) - 1
        assert g.prefilled_in(before) <= 4
        assert len(holding(g)) <= 2


def test_running_requests_count_against_the_resident_slots():
    """While --slots or more requests run, no idle slot keeps its KV for long: each goes a
    step or two after it finished (its last full page and tail are staged first)."""
    g = Group(num_slots=5, resident_slots=2)
    system = conv(98, 3 * P)
    for i in range(5):
        g.submit(f"r{i}", system + conv(i, 10), max_tokens=2 + 6 * i)  # finishing in turn
    idle_for = {}  # slot -> consecutive steps idle with tokens while >= --slots run
    for _ in range(400):
        g.now += 1.0
        g.do(PlanStep())
        if not g.pump():
            break
        crowded = g.core.num_running >= 2
        idle_for = {s.index: idle_for.get(s.index, 0) + 1 for s in g.core.slots
                    if crowded and s.free and s.tokens}
        assert max(idle_for.values(), default=0) <= 3, idle_for
    assert len(holding(g)) == 2


def test_a_slot_is_released_only_once_its_pages_are_on_disk():
    """A slow disk holds every page buffer: finished slots keep their KV until their pages
    are staged, then go, and their conversations restore all they had."""
    g = Group(num_slots=3, resident_slots=1, num_buffers=4)
    held_back, deliver = [], g._kvstore
    g._kvstore = lambda msg: (held_back.append(msg) if isinstance(msg, WritePages)
                              else deliver(msg))
    prompts = fan_out(g, 3, conv(97, 2 * P), max_tokens=3)
    assert len(holding(g)) == 3, "nothing released while its pages wait for a buffer"
    g._kvstore = deliver
    for msg in held_back:
        deliver(msg)
    g.run()
    assert len(holding(g)) == 1
    for rid, prompt in prompts.items():
        g.submit(rid + "'", prompt + g.reply(rid) + [5], max_tokens=1)
        g.run()
        assert g.finished(rid + "'").num_cached_tokens >= len(prompt) + len(g.reply(rid)) - 1


def test_without_max_running_every_slot_stays():
    g = Group(num_slots=3)
    fan_out(g, 3, conv(96, 2 * P))
    assert len(holding(g)) == 3
    assert not any(s.releases for s in g.steps)


def test_without_pages_a_slot_past_the_resident_ones_is_released_at_once():
    g = Group(num_slots=3, resident_slots=1)
    g.core.pages.kvstore_attached = False  # kvstore gone: nothing can be kept on disk
    fan_out(g, 3, conv(95, 2 * P), max_tokens=3)
    assert len(holding(g)) == 1


def test_a_main_session_back_among_its_sub_agents_copies_their_prefix_and_restores_its_own():
    """Its slot was released while its sub-agents ran; they hold the shared system prompt, so
    its next turn copies those pages from one of them and restores only its own from disk."""
    g = Group(num_slots=4, resident_slots=1)
    system = conv(90, 4 * P)
    main = system + conv(1, 2 * P + 5)
    g.submit("main", main, max_tokens=2)
    g.run()
    for i in range(3):
        g.submit(f"sub{i}", system + conv(10 + i, 20), max_tokens=400)
    for _ in range(8):  # the sub-agents run; the main session's idle slot is released
        g.now += 1.0
        g.do(PlanStep())
        g.pump()
    assert g.core.num_running == 3 and len(holding(g)) == 3
    before = len(g.steps)
    g.submit("main2", main + g.reply("main") + [7, 8], max_tokens=2)
    g.run()
    steps = g.steps[before:]
    copies = [c for s in steps for c in s.copies]
    loads = [ld for s in steps for ld in s.loads]
    assert copies and copies[0].num_tokens == len(system)
    assert loads and loads[0].start == len(system)
    assert g.finished("main2").num_cached_tokens >= len(main) + len(g.reply("main")) - 1


def idle(g, seconds):
    """Let `seconds` pass with nothing new arriving (the shell plans a step every second)."""
    for _ in range(int(seconds)):
        g.now += 1.0
        g.do(PlanStep())
        g.pump()


def test_an_idle_slot_stays_a_while_for_its_tool_result():
    """A tool loop's next turn, back within `release_after_s`, finds its slot (reused, no
    restore); one that ended its turn leaves memory after that."""
    g = Group(num_slots=3, resident_slots=1, release_after_s=10.0)
    prompts = fan_out(g, 3, conv(94, 2 * P), max_tokens=3)
    assert len(holding(g)) == 3, "just finished: every slot is kept a while"
    idle(g, 3)
    rid, before = "sub1", len(g.steps)
    g.submit(rid + "'", prompts[rid] + g.reply(rid) + [5], max_tokens=1)
    g.run()
    assert g.finished(rid + "'").num_cached_tokens >= len(prompts[rid]) + len(g.reply(rid)) - 1
    assert not any(s.loads or s.copies for s in g.steps[before:]), "its own slot, kept"
    idle(g, 12)
    assert len(holding(g)) == 1, "idle past the grace: back to --slots conversations"


# --- a prefix a running request prefills is prefilled once ------------------------------------


def prefilled(g, rid):
    return g.records[rid].num_prefilled_tokens


def test_siblings_arriving_together_prefill_their_shared_prefix_once():
    """Six sub-agents under one system prompt arrive together: the first prefills it, the
    other five wait in the queue (no slot held) and copy it from the first one's slot."""
    g = Group(num_slots=6)
    system = conv(80, 6 * P)
    for i in range(6):
        g.submit(f"a{i}", system + conv(i, 20), max_tokens=2)
    g.run()
    copied = [g.records[f"a{i}"].num_copied_tokens for i in range(6)]
    assert copied[0] == 0 and all(c >= len(system) for c in copied[1:]), copied
    total = sum(prefilled(g, f"a{i}") for i in range(6))
    assert total <= len(system) + 6 * (20 + P), "the system prompt was prefilled once"
    waits = [e for e in g.logs("request.waits_for_sibling")]
    assert {e["rid"] for e in waits} == {f"a{i}" for i in range(1, 6)}
    assert all(e["sibling"] == "a0" for e in waits)


def test_a_sibling_far_behind_is_not_waited_for():
    """A request that holds more of the prefix than the prefilling sibling has written
    prefills on its own: waiting would be longer."""
    g = Group(num_slots=3)
    system = conv(81, 6 * P)
    g.submit("first", system + conv(1, 20), max_tokens=2)
    g.run()
    g.submit("long", conv(7, 8 * P) + system + conv(2, 20), max_tokens=2)  # unrelated start
    g.submit("again", system + conv(1, 20) + g.reply("first") + [9], max_tokens=2)
    g.run()
    assert not [e for e in g.logs("request.waits_for_sibling")]
    assert g.finished("again").num_cached_tokens >= len(system) + 20
