"""The scheduler core with pages: write-through, restore, copy, eviction — no sockets, no MLX.

A scripted worker applies each step plan to mirrored slot contents and a scripted kvstore
keeps pages in a dict, so every message the core sends is checked against what it claims.
"""

from itertools import accumulate

from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.scheduler_kvstore import (
    DeletePages,
    InventoryDescribed,
    PageInfo,
    PagesRead,
    PagesWritten,
    ReadPages,
    TouchPages,
    WritePages,
)
from switchyard.proto.scheduler_worker import (
    RunStep,
    SampledToken,
    SlotContents,
    StepDone,
    WorkerReady,
)
from switchyard.proto.values import SamplingParams
from switchyard.proto.page_flags import PageFlags
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import KvstoreRestarted, PlanStep
from switchyard.scheduler.restore import RESTORE_FIRST_BATCH

P = 16
NS = b"n" * 16
EOS = 0


class Group:
    """The core plus scripted worker and kvstore peers, driven step by step."""

    def __init__(self, num_slots=1, budget_pages=10_000, trimmable=True, num_buffers=64,
                 prefill_chunk=64, missing=(), resident_slots=0, release_after_s=0.0,
                 kv_budget_tokens=0, state_marks=None, shared_pages=False, write_back=False):
        self.budget_bytes = budget_pages * (100 + 4096)
        self.core = SchedulerCore(CoreConfig(
            num_slots=num_slots, ctx=8192, prefill_chunk=prefill_chunk, max_queue=16,
            trimmable=trimmable, page_size=P, disk_budget_bytes=self.budget_bytes,
            write_back=write_back,
            state_interval=4 * P, resident_slots=resident_slots,
            release_after_s=release_after_s))
        self.outbox = []  # messages from the core not yet delivered
        self.log_lines = []  # (event, fields) the core logged
        self.records = {}  # rid -> FinishedRecord
        self.now = 1000.0
        self.do(InventoryDescribed("kv", ()))
        # A hybrid worker keeps each slot's state at its end and at its mark, where its
        # last prefill or restore ended (worker/state_marks.py), unless told otherwise.
        self.state_marks = not trimmable if state_marks is None else state_marks
        self.trimmable = trimmable
        self.do(worker_ready(self.core, num_buffers, state_bytes=0 if trimmable else 10,
                             kv_budget_tokens=kv_budget_tokens, state_marks=self.state_marks,
                             shared_pages=shared_pages))
        self.slots = [[] for _ in range(num_slots)]  # what the worker holds
        self.shelved = set()  # slots the worker holds as shared pages (RunStep.shelves)
        self.marks = [0] * num_slots
        # Hybrid slots whose end has no state: a load without one (a restore's earlier
        # batches) appends attention KV only; the restore's last page brings the state.
        self.stateless = set()
        self.buffers = {}  # buffer -> (slot tokens staged, with_state)
        self.disk = {}  # page_id -> PageInfo
        self.missing = set(missing)
        self.steps: list[RunStep] = []
        self.msgs = []
        self.held = []  # kvstore's replies to writes it was busy with until the next write

    def do(self, event):
        effects = self.core.handle(event, self.now)
        self.outbox += effects.messages
        self.log_lines += effects.logs
        self.records.update((r.rid, r) for r in effects.finished)
        return effects

    def logs(self, event):
        return [fields for name, fields in self.log_lines if name == event]

    def submit(self, rid, prompt, max_tokens=4, priority="interactive"):
        self.do(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (EOS,),
                              priority))

    def _states(self, slot):
        """Where the worker has the slot's state: its end (unless a load without its state
        ended there), and its mark (hybrid models)."""
        end = set() if slot in self.stateless else {len(self.slots[slot])}
        return end | ({self.marks[slot]} if self.state_marks else set())

    def _cut(self, slot, n, state_follows=False):
        """The worker trims the slot to `n` tokens: any `n` for attention KV; a hybrid
        slot only back to a point where it has the state (or to nothing), unless a load
        bringing the state follows (then its end has none until it does)."""
        assert len(self.slots[slot]) >= n
        stateless = not self.trimmable and n != 0 and n not in self._states(slot)
        if stateless and not state_follows:
            assert n == len(self.slots[slot]), "recurrent state cannot be rewound"
        if n != len(self.slots[slot]) or stateless:
            self.stateless.discard(slot)  # back to where it has its state
            if stateless:
                self.stateless.add(slot)
        self.slots[slot] = self.slots[slot][:n]
        if n < self.marks[slot]:
            self.marks[slot] = 0

    def _worker(self, plan: RunStep):
        self.shelved |= set(plan.shelves)  # until used again (worker/shared_pages.py)
        self.shelved -= {c.dst_slot for c in plan.copies} | set(plan.releases) | {
            x.slot for x in (*plan.loads, *plan.decodes, *plan.prefills)}
        for st in plan.stages:
            n = st.num_tokens or P
            assert len(self.slots[st.slot]) >= st.start + n
            if st.with_state:
                assert st.start + n in self._states(st.slot), "no state there"
            self.buffers[st.buffer] = (tuple(self.slots[st.slot][st.start:st.start + n]),
                                       st.with_state)
        for cp in plan.copies:
            stateless = not self.trimmable and cp.num_tokens not in self._states(cp.src_slot)
            assert not stateless or cp.state_follows, "no state to copy there"
            self.slots[cp.dst_slot] = self.slots[cp.src_slot][:cp.num_tokens]
            mark = self.marks[cp.src_slot]
            self.marks[cp.dst_slot] = mark if mark <= cp.num_tokens else 0
            self.stateless.discard(cp.dst_slot)
            if stateless:
                self.stateless.add(cp.dst_slot)
        for slot in plan.releases:
            self.slots[slot] = []
            self.marks[slot] = 0
            self.stateless.discard(slot)
        for cut in plan.cuts:  # the front stays, shelved (docs/design/kv-pages.md "Cut slots")
            assert cut.num_tokens % P == 0  # a hybrid's state is void there: a restore brings it
            self._cut(cut.slot, cut.num_tokens, state_follows=True)
            self.shelved.add(cut.slot)
        for ld in plan.loads:
            self._cut(ld.slot, ld.start, state_follows=True)
            for b in ld.buffers:
                self.slots[ld.slot] += list(self.buffers[b][0])
            assert self.slots[ld.slot][ld.start:] == list(ld.token_ids)
            if ld.with_state:
                assert self.buffers[ld.buffers[-1]][1], "a state load from a page without one"
                self.marks[ld.slot] = len(self.slots[ld.slot])
                self.stateless.discard(ld.slot)
            elif not self.trimmable:
                self.stateless.add(ld.slot)
        sampled = []
        for d in plan.decodes:
            self._cut(d.slot, d.position)
            assert d.slot not in self.stateless, "a decode on a slot without its state"
            self.slots[d.slot] = self.slots[d.slot] + [d.token_id]
            for i in range(min(plan.num_decode_steps, d.burst_limit)):
                token = 3000 + d.position + i
                sampled.append(SampledToken(d.slot, token))
                if i + 1 < min(plan.num_decode_steps, d.burst_limit):
                    self.slots[d.slot].append(token)  # fed back within the burst
        for c in plan.prefills:
            self._cut(c.slot, c.start)
            assert c.slot not in self.stateless, "a prefill on a slot without its state"
            self.slots[c.slot] = self.slots[c.slot] + list(c.token_ids)
            self.marks[c.slot] = len(self.slots[c.slot])
        return StepDone(plan.step, tuple(sampled), 0, len(plan.decodes), 0.0)

    def _kvstore(self, msg):
        if isinstance(msg, WritePages):
            while self.held:
                self.do(self.held.pop(0))
            infos = []
            for w in msg.writes:
                assert self.buffers[w.buffer][0] == w.token_ids
                infos.append(PageInfo(w.page_id, w.parent_id, NS, len(w.token_ids),
                                      4096 + 100, self.now, w.flags))
                self.disk[w.page_id] = infos[-1]
            # The rule: page bytes on disk never exceed the budget, whatever happened before.
            assert self.disk_bytes() <= self.budget_bytes
            self.do(PagesWritten(tuple(infos), (), tuple(w.buffer for w in msg.writes)))
        elif isinstance(msg, ReadPages):
            ok, missing = [], []
            for r in msg.reads:
                if r.page_id in self.disk and r.page_id not in self.missing:
                    ok.append(r.page_id)
                    self.buffers[r.buffer] = (r.token_ids, bool(
                        self.disk[r.page_id].flags & PageFlags.RECURRENT_STATE))
                else:
                    missing.append(r.page_id)
                    self.disk.pop(r.page_id, None)
            self.do(PagesRead(tuple(ok), tuple(missing)))
        elif isinstance(msg, DeletePages):
            for pid in msg.page_ids:
                del self.disk[pid]

    def disk_bytes(self):
        return sum(i.nbytes for i in self.disk.values())

    def pump(self):
        """Deliver queued messages until quiet; returns True if anything was delivered."""
        delivered = False
        while True:
            out, self.outbox = self.outbox, []
            if not out:
                return delivered
            delivered = True
            for msg in out:
                self.msgs.append(msg)
                if isinstance(msg, RunStep):
                    self.steps.append(msg)
                    self.do(self._worker(msg))
                elif isinstance(msg, (WritePages, ReadPages, DeletePages, TouchPages)):
                    self._kvstore(msg)

    def turn(self, rid, prompt, max_tokens=4, priority="interactive"):
        """Submit a request and run until the group settles: its RequestFinished."""
        self.submit(rid, prompt, max_tokens, priority)
        self.run()
        return self.finished(rid)

    def restart_core(self, slots=1):
        """A new scheduler core: it learns the disk from kvstore and finds the worker's
        slots empty (a whole-group restart keeps the disk only)."""
        pages = tuple(self.disk.values())
        self.core = SchedulerCore(self.core.config)
        self.do(InventoryDescribed("kv", pages))
        self.do(worker_ready(self.core, slots=tuple(SlotContents(i, ()) for i in range(slots))))
        self.slots, self.marks = [[] for _ in range(slots)], [0] * slots

    def run(self, limit=2000):
        for _ in range(limit):
            self.now += 1.0
            self.do(PlanStep())
            if not self.pump():
                return
        raise AssertionError("did not settle")

    def run_steps(self, n):
        """`n` plans a second apart, each delivered until quiet."""
        for _ in range(n):
            self.now += 1.0
            self.do(PlanStep())
            self.pump()

    def newcomer_waits(self, seed):
        """A request of 20 tokens generating 30, and behind it a newcomer of 300, run until
        quiet: whether the newcomer was placed only once the first was done."""
        self.submit("r", conv(seed, 20), max_tokens=30)
        prompt = conv(seed + 1, 300)
        self.submit("c", prompt)
        self.run()
        placed = next(i for i, m in enumerate(self.msgs) if isinstance(m, RunStep) and any(
            c.token_ids[:8] == tuple(prompt[:8]) for c in m.prefills))
        return placed > self.msgs.index(self.finished("r"))

    def finished(self, rid):
        return next(m for m in self.msgs if isinstance(m, RequestFinished) and m.rid == rid)

    def reply(self, rid):
        return [t for m in self.msgs if isinstance(m, TokensGenerated) and m.rid == rid
                for t in m.token_ids]

    def prefilled_in(self, since):
        return sum(len(c.token_ids) for s in self.steps[since:] for c in s.prefills)


def worker_ready(core, num_buffers=64, slots=(), state_bytes=0, kv_budget_tokens=0,
                 state_marks=None, shared_pages=False):
    c = core.config
    marks = not c.trimmable if state_marks is None else state_marks
    return WorkerReady("w", NS, "tiny", c.num_slots, c.ctx, c.page_size, 100, c.trimmable,
                       slots, "shm", num_buffers, 100, state_bytes,
                       kv_budget_tokens=kv_budget_tokens, state_marks=marks,
                       shared_pages=shared_pages)


def conv(seed, n):
    return [100 + (seed * 7919 + i * 31) % 2000 for i in range(n)]


def test_full_pages_are_written_through():
    g = Group()
    g.submit("a", conv(1, 5 * P + 3))
    g.run()
    full = [i for i in g.disk.values() if i.num_tokens == P]
    tails = [i for i in g.disk.values() if i.num_tokens < P]
    assert len(full) == 5  # every full page of the prompt, written through
    # ...and the partial page where the prompt's context ended (all but its last token: a
    # repeat resumes there) and where the turn ended (3 replied).
    assert sorted(t.num_tokens for t in tails) == [2, 3 + 3]
    assert g.core.pages.tree.total_bytes == 7 * (4096 + 100)
    assert g.core.pages.allocator.num_free == 64, "every buffer comes back"


def test_switching_turns_prefill_only_new_tokens():
    """One slot, A and B alternating with growing history: every turn after the first of
    each conversation prefills only its new tokens plus at most one partial page."""
    g = Group(num_slots=1)
    hist = {"A": conv(1, 6 * P + 5), "B": conv(2, 7 * P + 9)}
    prev_len: dict[str, int] = {}  # each conversation's previous prompt + reply
    for turn in range(8):
        name = "AB"[turn % 2]
        rid = f"{name}{turn}"
        before = len(g.steps)
        new = len(hist[name]) - (0 if turn < 2 else prev_len[name])
        g.submit(rid, hist[name])
        g.run()
        fin = g.finished(rid)
        if turn >= 2:
            # Stored tails: exactly the new tokens, plus the last reply token never fed back.
            assert g.prefilled_in(before) <= new + 1, (turn, g.prefilled_in(before), new)
            assert fin.num_cached_tokens >= len(hist[name]) - new - P
        prev_len[name] = len(hist[name]) + len(g.reply(rid))
        # next turn: the reply, then a ~tool result of 3 pages
        hist[name] = hist[name] + g.reply(rid) + conv(10 + turn, 3 * P + 1)


def test_restore_reads_then_loads_before_prefill():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 2)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P))
    g.run()
    g.submit("a2", a + g.reply("a1") + [5, 6, 7])
    before = len(g.steps)
    g.run()
    first = g.steps[before]
    assert first.loads and not first.prefills, "restore completes before any prefill"
    # 4 full pages and the tail where a1's turn ended (its prompt and 3 of its 4 replies).
    assert first.loads[0].start == 0 and len(first.loads[0].buffers) == 5
    reads = [m for m in g.msgs if isinstance(m, ReadPages)]
    assert len(reads) == 1 and len(reads[0].reads) == 5
    assert g.finished("a2").num_cached_tokens == len(a) + 3


def test_missing_page_falls_back_to_prefill():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 2)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P))
    g.run()
    third = g.core.pages.chain(a)[2]
    g.missing.add(third)
    g.submit("a2", a + [9])
    g.run()
    assert g.finished("a2").num_cached_tokens == 2 * P  # pages 0 and 1 loaded, rest prefilled
    # The missing page was forgotten, re-prefilled, and written again by write-through.
    assert third in g.core.pages.tree and third in g.disk


def test_shared_prefix_is_copied_into_the_empty_slot():
    """Empty slots first, with pages: B shares A's system prompt, goes to the empty slot, copies
    it."""
    g = Group(num_slots=2)
    system = conv(9, 5 * P)
    g.submit("a", system + conv(1, 40))
    g.run()
    before = len(g.steps)
    g.submit("b", system + conv(2, 30))
    g.run()
    step = g.steps[before]
    assert step.copies and step.copies[0].num_tokens == len(system)
    assert step.copies[0].dst_slot != step.copies[0].src_slot
    assert g.prefilled_in(before) == 29
    assert g.finished("b").num_cached_tokens == len(system)
    for slot in g.core.slots:  # the copy took the source's page ids along: still exact
        assert slot.page_ids == g.core.pages.chain(slot.tokens)


def test_budget_is_never_exceeded_and_lru_tail_goes_first():
    g = Group(num_slots=1, budget_pages=12)
    system = conv(9, 2 * P)
    a, b = system + conv(1, 4 * P + 1), system + conv(2, 4 * P + 1)
    g.submit("a", a)
    g.run()
    g.submit("b", b)
    g.run()
    assert sum(1 for i in g.disk.values() if i.num_tokens == P) == 10
    g.submit("c", system + conv(3, 4 * P + 1))
    g.run()
    assert g.core.pages.tree.total_bytes <= 12 * (4096 + 100)
    chain_a, chain_b = g.core.pages.chain(a), g.core.pages.chain(b)
    assert all(pid in g.disk for pid in chain_a[:2]), "the shared system prompt survives"
    assert chain_a[-1] not in g.disk, "the least recently used conversation loses its tail"
    assert all(pid in g.disk for pid in chain_b), "the more recent conversation is kept"


def a_waits_behind_b(a_tokens, b_tokens):
    """A's turn, then B's on the only slot while A's next turn waits for it, B's pages filling
    a disk of 14 pages (half of it: 7). Returns the group and A's first prompt."""
    g = Group(num_slots=1, budget_pages=14)
    a = conv(1, a_tokens)
    g.submit("a1", a)
    g.run()
    g.submit("b", conv(2, b_tokens))
    g.submit("a2", a + g.reply("a1") + conv(3, 5))  # waits: B has the slot
    g.run()
    assert g.core.pages.num_evicted > 0
    return g, a


def test_a_waiting_requests_pages_are_not_evicted():
    """A's pages are the least recently used, but they are about to be read: eviction takes
    others (B's, in its slot anyway), and A comes back with everything it had (seen in the
    soak: background agents, waiting behind interactive ones, re-read their whole history
    every turn). A's 6 pages fit in half the disk."""
    g, a = a_waits_behind_b(5 * P + 1, 11 * P + 1)
    assert g.finished("a2").num_cached_tokens == len(a) + len(g.reply("a1")) - 1


def test_a_waiting_context_past_half_the_disk_keeps_its_leading_pages():
    """As above, but A's context is larger than the half of the disk waiting requests may
    hold: its leading pages, up to that half, are kept (its tail goes first anyway), and A
    comes back with all of them, re-reading only the rest."""
    g, _ = a_waits_behind_b(9 * P + 1, 13 * P + 1)
    assert g.finished("a2").num_cached_tokens == 7 * P


def test_a_waiting_context_no_slot_holds_is_kept_before_one_a_slot_holds():
    """X's next turn and then Y's wait; each context is 6 pages on disk, and half the disk
    (7 pages) holds one of them. X's slot holds X's context, so X restores nothing unless
    that slot leaves first, while Y's is on disk alone: Y's pages are the ones kept, though
    X's turn came first."""
    g = Group(num_slots=1, budget_pages=14)
    y, x = conv(1, 5 * P + 1), conv(2, 5 * P + 1)
    g.turn("y1", y)
    g.turn("x1", x)  # takes the only slot: Y's context is on disk alone
    y_pages = [pid for pid in g.core.pages.chain(y + g.reply("y1")) if pid in g.disk]
    x_pages = [pid for pid in g.core.pages.chain(x + g.reply("x1")) if pid in g.disk]
    assert len(y_pages) == len(x_pages) == 5
    assert g.core.slots[0].page_ids[-1] == x_pages[-1]
    g.submit("x2", x + g.reply("x1") + conv(3, 5))
    g.submit("y2", y + g.reply("y1") + conv(4, 5))
    pinned = g.core.pinned()
    assert set(y_pages) <= pinned
    assert not set(x_pages) <= pinned


def test_placing_a_request_is_a_use_of_its_pages():
    """A2 resumes in the slot A1 left (it restores nothing, so nothing pins A's pages), and
    A's pages on disk were last used when A1 ended, before B's. Placing A2 is a use: while
    it runs, the room its new pages need must come from B, not from the conversation in use
    (seen in the soak: a background turn that waited 30 s lost its history as it ran)."""
    g = Group(num_slots=2)
    a = conv(1, 5 * P + 1)
    g.submit("a1", a)
    g.run()
    g.submit("b", conv(2, 6 * P + 1))
    g.run()
    tree = g.core.pages.tree
    on_disk = [pid for pid in g.core.pages.chain(a) if pid in tree]
    assert len(on_disk) == 5 and max(map(tree.last_used, on_disk)) < g.now
    g.submit("a2", a + g.reply("a1") + conv(3, 4 * P))
    g.now += 1.0
    g.do(PlanStep())  # A2 is placed
    assert [tree.last_used(pid) for pid in on_disk] == [g.now] * 5

def test_hybrid_restores_only_to_state_snapshots():
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 6 * P + 3)
    g.submit("a1", a, max_tokens=2)
    g.run()
    with_state = {m.page_id for m in g.disk.values() if m.flags}
    chain = g.core.pages.chain(a)
    # snapshots at every 4 pages (state_interval) and at the last page end of the context
    assert chain[3] in with_state and chain[5] in with_state
    g.submit("b1", conv(2, 2 * P))
    g.run()
    before = len(g.steps)
    g.submit("a2", a + g.reply("a1") + [7])
    g.run()
    load = next(s for s in g.steps[before:] if s.loads).loads[0]
    # 6 full pages and the tail with the state where a1's turn ended.
    assert load.with_state and load.start == 0 and len(load.buffers) == 7


def test_hybrid_without_a_tail_restores_to_the_last_snapshot():
    g = Group(num_slots=1, trimmable=False)
    a = conv(1, 6 * P + 3)
    g.submit("a1", a, max_tokens=2)
    g.run()
    g.submit("b1", conv(2, 2 * P))
    g.run()
    before = len(g.steps)
    g.submit("a2", a[:6 * P] + [7, 8, 9])  # diverges inside the tail
    g.run()
    load = next(s for s in g.steps[before:] if s.loads).loads[0]
    assert load.with_state and len(load.buffers) == 6


def test_scheduler_restart_rebuilds_from_inventory():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 2)
    g.submit("a1", a)
    g.run()
    g.restart_core()
    g.submit("a2", a + [4])
    g.run()
    # The tail of the prompt's context was stored too: all but the prompt's last token.
    assert g.finished("a2").num_cached_tokens == len(a) - 1


def test_hybrid_shared_prefix_gets_a_snapshot_for_the_next_conversation():
    """A writes the shared prefix without state; B stops where it parts from A (inside a
    page) and stores the state there as a tail; C restores to that token: only the tail,
    with the state, as its slot (B's) holds the attention KV of the pages before it."""
    g = Group(num_slots=1, trimmable=False)
    shared = conv(9, 2 * P + 5)
    g.submit("a", shared + conv(1, 3 * P + 7), max_tokens=1)
    g.run()
    chain = g.core.pages.chain(shared)
    assert chain[1] in g.disk and not g.disk[chain[1]].flags
    g.submit("b", shared + conv(2, 3 * P), max_tokens=1)
    g.run()
    branch = [i for i in g.disk.values() if i.parent_id == chain[1] and i.num_tokens == 5]
    assert branch and branch[0].flags, "B stored the end of the shared prefix with its state"
    g.submit("c", shared + conv(3, 2 * P), max_tokens=1)
    before = len(g.steps)
    g.run()
    load = next(s for s in g.steps[before:] if s.loads).loads[0]
    assert load.with_state and load.start == 2 * P and len(load.buffers) == 1
    assert g.finished("c").num_cached_tokens == len(shared)


def test_pages_lost_with_a_kvstore_restart_are_written_again():
    g = Group(num_slots=1)
    a = conv(1, 4 * P + 2)
    g.submit("a", a)
    # The prefill step runs; its pages are staged in the next step and handed to kvstore...
    g.do(g._worker(g.do(PlanStep()).step))
    step = g.do(PlanStep()).step
    assert step.stages
    writes = [m for m in g.do(g._worker(step)).messages if isinstance(m, WritePages)]
    assert writes
    g.do(g._worker(g.do(PlanStep()).step))  # meanwhile the slot counts them as on their way
    # ...but kvstore dies before writing them. The new kvstore gets them again.
    g.outbox.clear()
    g.do(KvstoreRestarted())
    g.do(InventoryDescribed("kv2", ()))
    g.run()
    assert sum(1 for i in g.disk.values() if i.num_tokens == P) == 4


def _step_until_eviction(g):
    """Run steps by hand (nothing delivered) until one makes room on disk and writes."""
    for _ in range(100):
        g.now += 1.0
        step = g.do(PlanStep()).step
        if step is None:
            continue
        sent = g.do(g._worker(step)).messages
        if any(isinstance(m, DeletePages) for m in sent) and \
                any(isinstance(m, WritePages) for m in sent):
            return
    raise AssertionError("no eviction")


def _fill_disk(g):
    g.submit("a", conv(1, 6 * P + 2))
    g.run()
    assert g.disk_bytes() > g.budget_bytes - 2 * (4096 + 100)
    g.submit("b", conv(2, 4 * P + 1))


def test_evictions_lost_with_a_kvstore_restart_are_made_again_before_the_writes():
    """kvstore dies with an eviction and the writes it made room for queued: the new one
    still has the evicted pages on disk. The writes sent again must not exceed the budget."""
    g = Group(num_slots=1, budget_pages=9)
    _fill_disk(g)
    _step_until_eviction(g)
    g.outbox.clear()  # lost with kvstore: the deletes and the writes
    g.do(KvstoreRestarted())
    g.do(InventoryDescribed("kv2", tuple(g.disk.values())))
    g.run()  # the invariant is checked at every write (Group._kvstore)
    assert g.core.pages.tree.total_bytes == g.disk_bytes() <= g.budget_bytes
    assert sum(1 for i in g.disk.values() if i.num_tokens == P) >= 4  # b's pages got there


def test_writes_from_a_dead_workers_pool_count_until_kvstore_answers():
    """The worker restarts while kvstore writes pages from its old buffers: they reach the
    disk after the scheduler forgot the old pool. Room for new pages must count them."""
    g = Group(num_slots=1, budget_pages=9)
    _fill_disk(g)
    _step_until_eviction(g)
    msgs, g.outbox = g.outbox, []
    # kvstore writes the old pool's pages; the scheduler hears of it after the worker restart
    for m in msgs:
        if isinstance(m, DeletePages):
            for pid in m.page_ids:
                del g.disk[pid]
        elif isinstance(m, WritePages):
            infos = tuple(PageInfo(w.page_id, w.parent_id, NS, len(w.token_ids), 4096 + 100,
                                   g.now, w.flags) for w in m.writes)
            g.disk.update((i.page_id, i) for i in infos)
            g.held.append(PagesWritten(infos, (), tuple(w.buffer for w in m.writes)))
    assert g.held
    g.slots = [[]]
    g.do(worker_ready(g.core))  # a new worker, a new pool, empty slots
    g.do(CancelRequest("b"))  # its client left: only other pages are written next
    g.submit("c", conv(3, 4 * P + 1))
    g.run()  # c's pages are written: the invariant holds with the old pool's pages on disk
    assert g.core.pages.tree.total_bytes == g.disk_bytes() <= g.budget_bytes


def test_a_read_answered_after_a_worker_restart_is_not_taken_for_a_later_one():
    """kvstore answers every read in order, also those sent before the worker died (into its
    old pool). The answer to such a read must not pass for the read of the same pages the
    restored request makes again into the new pool: that one is loaded only once read."""
    g = Group(num_slots=1)
    a = conv(1, 6 * P + 3)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P))
    g.run()  # b takes the only slot: a comes back from disk
    held, deliver = [], g._kvstore
    g._kvstore = lambda m: held.append(m) if isinstance(m, ReadPages) else deliver(m)
    g.submit("a2", a + g.reply("a1") + [5, 6, 7])
    g.run()
    assert len(held) == 1  # the first batch is being read...
    g.slots = [[]]
    g.do(worker_ready(g.core))  # ...when the worker restarts: a new pool, empty slots
    g.run()
    assert len(held) == 2  # a2 is placed again and reads the same pages into the new pool
    old, new = held
    assert [r.page_id for r in old.reads] == [r.page_id for r in new.reads]
    for r in new.reads:  # nothing has been read into the new buffers yet
        g.buffers[r.buffer] = ((-1,) * len(r.token_ids), False)
    g.do(PagesRead(tuple(r.page_id for r in old.reads), ()))  # the old read's answer
    g.run()  # (a load of the unread buffers fails in the scripted worker)
    g._kvstore = deliver
    deliver(new)
    g.run()
    assert g.finished("a2").num_cached_tokens >= len(a)


def test_tails_passed_by_a_conversation_are_deleted():
    """Disk stays linear in unique tokens: only the tails at a conversation's frontier stay."""
    g = Group(num_slots=1)
    hist = conv(1, 2 * P + 5)
    for turn in range(5):
        g.submit(f"t{turn}", hist)
        g.run()
        hist = hist + g.reply(f"t{turn}") + conv(20 + turn, P + 3)
    tails = [i for i in g.disk.values() if i.num_tokens < P]
    assert 1 <= len(tails) <= 2
    assert any(isinstance(m, DeletePages) for m in g.msgs)


def test_the_next_batch_is_read_while_the_last_one_loads():
    g = Group(num_slots=1, num_buffers=8)  # batches of 4 pages: half the pool
    a = conv(1, 20 * P + 2)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P))
    g.run()
    since = len(g.msgs)
    g.submit("a2", a + g.reply("a1") + [5, 6, 7])
    g.run()
    msgs = g.msgs[since:]
    reads = [i for i, m in enumerate(msgs) if isinstance(m, ReadPages)]
    loads = [(i, ld) for i, m in enumerate(msgs) if isinstance(m, RunStep) for ld in m.loads]
    assert all(len(msgs[i].reads) <= 4 for i in reads)
    assert reads[1] < loads[0][0], "batch 2 is read before batch 1 is loaded"
    # Loads follow each other; the first makes room for the whole context.
    restored = sum(len(ld.token_ids) for _, ld in loads)
    context = len(a) + len(g.reply("a1")) + 3 - 1
    assert loads[0][1].reserve == context - len(loads[0][1].token_ids)
    assert [ld.start for _, ld in loads] == [0] + list(
        accumulate(len(ld.token_ids) for _, ld in loads[:-1]))
    assert restored == len(a) + 3 and g.finished("a2").num_cached_tokens == len(a) + 3
    assert g.core.pages.allocator.num_free == 8, "every buffer comes back"


def test_a_restore_starts_with_a_small_batch_then_reads_larger_ones():
    g = Group(num_slots=1, num_buffers=64)
    a = conv(1, 60 * P + 2)
    g.submit("a1", a)
    g.run()
    g.submit("b1", conv(2, 3 * P))
    g.run()
    since = len(g.msgs)
    g.submit("a2", a + g.reply("a1") + [5])
    g.run()
    sizes = [len(m.reads) for m in g.msgs[since:] if isinstance(m, ReadPages)]
    assert sizes[0] == RESTORE_FIRST_BATCH and max(sizes) == 32  # then half the pool
    assert sum(sizes) == 61 and g.finished("a2").num_cached_tokens == len(a) + 3


def _writes_held_back(g):
    """A slow disk: the scripted kvstore keeps every WritePages (acknowledging nothing) in
    the returned list; `deliver` hands one over when the test says."""
    held_back, deliver = [], g._kvstore

    def slow_kvstore(msg):
        if isinstance(msg, WritePages):
            held_back.append(msg)
        else:
            deliver(msg)
    g._kvstore = slow_kvstore
    return held_back, deliver


def test_a_conversation_back_before_its_pages_land_waits_for_them():
    """A's slot is taken by B while A's pages are still being written (a slow disk: kvstore
    acknowledges nothing yet). A's next turn arrives: it is not placed (and its pages not
    re-read) until the writes land, then it restores everything it had."""
    g = Group(num_slots=1)
    held_back, deliver = _writes_held_back(g)
    a = conv(1, 5 * P + 3)
    g.submit("a1", a)
    g.run()
    _back_before_its_writes_land(g, a, held_back, deliver)


def test_back_before_its_pages_land_waits_though_a_sibling_shares_more_than_whole_pages():
    """Sub-agents under a system prompt that ends inside a page: A's slot is taken while its
    pages are still being written, and sibling X's slot shares the system prompt with A's next
    turn, a few tokens past its last whole page: more than the disk holds yet. A waits for
    its own pages (which reach much further) instead of copying the prefix from X and
    re-reading the rest."""
    g = Group(num_slots=2)
    held_back, deliver = _writes_held_back(g)
    system = conv(5, 2 * P + 40)
    a = system + conv(7, 2 * P)
    g.turn("a1", a)
    g.turn("x1", system + conv(6, 4 * P))  # the sibling: it holds more, A's slot goes
    g.turn("b", conv(2, 3 * P + 1))
    follow = a + g.reply("a1") + conv(3, 5)
    before = len(g.steps)
    g.submit("a2", follow)
    g.run()
    assert g.prefilled_in(before) == 0  # waiting for its pages, not re-reading them
    g._kvstore = deliver
    for msg in held_back:
        deliver(msg)
    g.run()
    held = len(a) + len(g.reply("a1")) - 1
    assert g.finished("a2").num_cached_tokens == held


def _back_before_its_writes_land(g, a, held_back, deliver):
    """B takes the only slot, then A's next turn comes while the writes in `held_back` are
    late: it waits, prefilling nothing, until they land, then restores all A1 left."""
    g.submit("b", conv(2, 3 * P + 1))
    g.run()
    follow = a + g.reply("a1") + conv(3, 5)
    before = len(g.steps)
    g.submit("a2", follow)
    g.run()
    assert not [m for m in g.msgs if isinstance(m, RequestFinished) and m.rid == "a2"]
    assert g.prefilled_in(before) == 0  # waiting for its pages, not re-reading them
    g._kvstore = deliver
    for msg in held_back:
        deliver(msg)
    g.run()
    held = len(a) + len(g.reply("a1")) - 1
    assert g.finished("a2").num_cached_tokens == held
    assert g.prefilled_in(before) <= len(follow) - held  # only the new tokens


def test_a_hybrid_conversation_back_before_its_tail_lands_waits_for_it():
    """The same for a hybrid model when only the tail is late (seen in CI as gemma3_text
    restoring 320 of 364 tokens): the last full page, written without a snapshot, is not
    restorable on its own, so the late tail is what the turn resumes from; it must be waited
    for, not given up for the previous snapshot."""
    g = Group(num_slots=1, trimmable=False)
    held_back = []
    deliver = g._kvstore

    def tail_late(msg):
        if not isinstance(msg, WritePages):
            return deliver(msg)
        # The turn's tail (it holds reply tokens, 3000 + position) is late; the prompt's is not.
        late = tuple(w for w in msg.writes if len(w.token_ids) < P and max(w.token_ids) >= 3000)
        if len(late) < len(msg.writes):
            deliver(WritePages(tuple(w for w in msg.writes if w not in late)))
        if late:
            held_back.append(WritePages(late))
    g._kvstore = tail_late
    a = conv(1, 6 * P - 5)  # a burst of the reply fills page 5 and goes on into a tail
    g.submit("a1", a, max_tokens=8)
    g.run()
    chain = g.core.pages.chain(a + g.reply("a1"))
    assert chain[5] in g.disk and not g.disk[chain[5]].flags, "page 5 should be plain"
    _back_before_its_writes_land(g, a, held_back, deliver)


def tails_on_disk(g):
    return {pid for pid, info in g.disk.items() if info.num_tokens < P}


def test_sub_agents_under_a_shared_page_leave_each_others_tails():
    """A main session M and sub-agents S0..S2 share their first page (a system prompt) and
    each ended a turn in a tail under it. Each sub-agent's next turn grows past that page:
    it supersedes its own tail there, never M's or another sub-agent's, so every next turn
    is restored, not re-read (found by bench/agent_traffic.py: a main session waiting on its
    sub-agents lost its tail to them, and the sub-agents each other's)."""
    g = Group(num_slots=1)  # every turn after the first of each conversation is a restore
    system = conv(1, P)
    m = system + conv(2, P // 4)
    subs = [system + conv(10 + i, P // 3 + i) for i in range(3)]
    for rid, hist in (("m1", m), *((f"s{i}a", s) for i, s in enumerate(subs))):
        g.submit(rid, hist)
        g.run()
        if rid == "m1":
            m_tails = tails_on_disk(g)
    sub_tails = tails_on_disk(g) - m_tails
    assert len(m_tails) == 2 and len(sub_tails) == 6  # each: where its prompt and turn ended
    for i, s in enumerate(subs):  # each past the shared page: tool result of a page and more
        g.submit(f"s{i}b", s + g.reply(f"s{i}a") + conv(20 + i, P + 7))
        g.run()
        assert g.finished(f"s{i}b").num_cached_tokens >= len(s) + len(g.reply(f"s{i}a")) - 1
    g.submit("m2", m + g.reply("m1") + conv(3, 5))
    g.run()
    assert g.finished("m2").num_cached_tokens >= len(m) + len(g.reply("m1")) - 1
    # The sub-agents' first tails were superseded by their own next turns and went with the
    # next one past the shared page; the last restored from stays until one passes again.
    assert len(sub_tails & tails_on_disk(g)) <= 1


def test_a_conversation_that_moved_to_a_new_branch_loses_its_old_tails():
    """A conversation whose client sent back a tool call of its own, not the model's reply,
    left the reply's branch: its next turn, past the shared page, deletes its old tails
    (disk stays linear in unique tokens) while a bystander's tail under that page stays."""
    g = Group(num_slots=1)
    system = conv(1, P)
    a, b = system + conv(2, P // 4), system + conv(3, P // 5)
    g.submit("a1", a)
    g.run()
    a_tails = tails_on_disk(g)
    assert len(a_tails) == 2  # where the prompt ended and where the turn ended
    left = max(a_tails, key=lambda pid: g.disk[pid].num_tokens)  # the reply's branch
    g.submit("b1", b)
    g.run()
    b_tails = tails_on_disk(g) - a_tails
    g.submit("a2", a + conv(4, 6) + conv(5, P + 10))  # not the reply: a branch of its own
    g.run()
    assert g.finished("a2").num_cached_tokens >= len(a) - 1
    on_disk = tails_on_disk(g)
    assert left not in on_disk
    assert b_tails <= on_disk  # the bystander's stay
    # Its prompt's tail, which a2 restored from, is nobody's now: the next turn past the
    # shared page takes it, the bystander's own next turn here.
    g.submit("b2", b + g.reply("b1") + conv(6, P + 4))
    g.run()
    assert g.finished("b2").num_cached_tokens >= len(b) + len(g.reply("b1")) - 1
    assert not a_tails & tails_on_disk(g)


def test_scheduler_restart_beside_held_kv_makes_room_for_another_conversation():
    """A restarted scheduler adopts what the worker holds; a new conversation that needs the
    KV budget's room then asks whether that held KV can leave, which needs its page ids
    (a restarted scheduler once crashed here, on a slot whose page ids were never computed)."""
    g = Group(num_slots=2, kv_budget_tokens=300)
    a = conv(1, 4 * P + 2)
    g.submit("a1", a)
    g.run()
    held = tuple(SlotContents(i, tuple(s)) for i, s in enumerate(g.slots))
    pages = tuple(g.disk.values())
    g.core = SchedulerCore(g.core.config)
    g.do(InventoryDescribed("kv", pages))
    g.do(worker_ready(g.core, slots=held, kv_budget_tokens=300))
    b = conv(2, 4 * P)
    g.submit("b1", b)
    g.run()
    assert g.finished("b1").finish_reason == "length"
    g.submit("a2", a + [4])
    g.run()
    assert g.finished("a2").num_cached_tokens >= len(a) - P
