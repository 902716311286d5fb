"""Switchyard's own residency replayed over a trace: the scheduler core driven through its public
entry point (`SchedulerCore.handle`), with a scripted worker and kvstore, no sockets, no MLX.

Like the core's unit tests (tests/unit/test_scheduler_pages.py), the scripted worker applies
each step plan to mirrored slot contents (refusing, as the worker does, a command that starts
past what a slot holds, and, for a hybrid model, one that needs a recurrent state where the slot
has none: only at its end and its mark, docs/design/kv-pages.md "Exact repeats and state
marks") and the scripted kvstore keeps pages in a dict; time
is virtual: a step takes its prefill tokens at `PREFILL_TOKENS_PER_S` plus `DECODE_STEP_S`, and
a request is submitted at its trace arrival, or when its conversation's previous reply ended
if that is later (a client sends its next turn only after the reply). The memory budget is the
core's KV budget (`kv_budget_tokens`, every slot may stay resident within it: the core's own
rule for what leaves memory, with `--release-after-s`); the disk budget its
`disk_budget_bytes`. After each reply the core is told how it ended (`ReplyEnded`, the trace's
`end`), as the gateway tells it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from switchyard.proto.page_flags import PageFlags
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
from switchyard.proto.gateway_scheduler import ReplyEnded, SubmitRequest
from switchyard.proto.scheduler_worker import RunStep, SampledToken, StepDone, WorkerReady
from switchyard.proto.values import SamplingParams
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import PlanStep

from bench.residency_oracle import Oracle, told_the_future
from bench.residency_trace import Trace, synthesize

NAMESPACE = b"r" * 16
STOP = 0
REPLY_IDS = 3_000_000_000  # generated ids: never in a prompt (ids are < 2**32)
PREFILL_TOKENS_PER_S = 4000.0
DECODE_STEP_S = 0.02
HEARTBEAT_S = 1.0  # the service plans a step at least this often (--heartbeat-s)
SLOTS = 32
TOKEN_BYTES = 1024  # on the scripted disk; the figures are counted in tokens
HEADER_BYTES = 4096  # what the core allows for a page file's header
# A hybrid model's recurrent-state snapshot, stored with a page that carries one: about a
# page's attention KV (Qwen3.5-class: three linear-attention layers in four).
STATE_BYTES = 256 * TOKEN_BYTES
CTX = 131072


@dataclass
class CoreCosts:
    tokens_reread: int = 0
    tokens_restored: int = 0
    tokens_written: int = 0
    requests: int = 0
    peak_memory_tokens: int = 0  # the most the scripted worker's slots held at once
    # The most the core counted its slots holding, with the running requests' reserves, as
    # it planned a step: what it keeps within the memory budget (`MemoryManager.held_tokens`).
    peak_held_tokens: int = 0
    order: tuple[int, ...] = ()  # the trace's requests in the order the core admitted them


class ScriptedGroup:
    """The core plus a worker and a kvstore that do what its messages say."""

    def __init__(self, page_size: int, memory_tokens: int, disk_tokens: int,
                 release_after_s: float, hybrid: bool = False,
                 write_back: bool = False) -> None:
        self.page_size = page_size
        self.hybrid = hybrid  # recurrent state at a slot's end and mark only (not trimmable)
        self.core = SchedulerCore(CoreConfig(
            num_slots=SLOTS, ctx=CTX, prefill_chunk=2048, max_queue=1024,
            page_size=page_size, decode_burst=8,
            disk_budget_bytes=disk_tokens * TOKEN_BYTES + -(-disk_tokens // page_size) * HEADER_BYTES,
            release_after_s=release_after_s, write_back=write_back))
        self.now = 0.0
        self.outbox: list = []
        self.finished: dict[str, object] = {}
        self.slots: list[list[int]] = [[] for _ in range(SLOTS)]
        self.marks = [0] * SLOTS  # a hybrid slot's second state (worker/state_marks.py)
        self.stateless: set[int] = set()  # hybrid slots whose end a load without state reached
        self.shelved: set[int] = set()  # slots held as shared pages (worker/shared_pages.py)
        # A shelved slot's full pages' keys, hashed once: its tokens do not change while it
        # is shelved (any use but a stage makes it whole first).
        self.shelved_pages: dict[int, list[int]] = {}
        self.buffers: dict[int, tuple[tuple[int, ...], bool]] = {}  # tokens, with a state
        self.disk: dict[bytes, PageInfo] = {}
        self.written_tokens = 0
        self.peak_memory_tokens = 0
        self.peak_held_tokens = 0
        self.submitted: dict[str, float] = {}
        self.next_reply_id = REPLY_IDS
        self.replies: dict[str, list[int]] = {}  # rid -> the tokens its reply is made of
        self.do(InventoryDescribed("kv", ()))
        state_bytes = STATE_BYTES if hybrid else 0
        self.do(WorkerReady("w", NAMESPACE, "trace", SLOTS, CTX, page_size, TOKEN_BYTES,
                            not hybrid, (), "shm", 256, page_size * TOKEN_BYTES + state_bytes,
                            state_bytes, kv_budget_tokens=memory_tokens, shared_pages=True,
                            state_marks=hybrid))

    def do(self, event) -> None:
        effects = self.core.handle(event, self.now)
        self.outbox += effects.messages
        self.finished.update((r.rid, r) for r in effects.finished)

    def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.submitted[rid] = self.now
        self.do(SubmitRequest(rid, tuple(prompt), max_tokens, SamplingParams(), (STOP,),
                              "interactive"))

    def step(self) -> bool:
        """Plan and run one step; False when the core had nothing to do."""
        self.do(PlanStep())
        self.peak_held_tokens = max(self.peak_held_tokens, self.core.memory.held_tokens())
        ran = False
        while self.outbox:
            out, self.outbox = self.outbox, []
            for msg in out:
                if isinstance(msg, RunStep):
                    ran = True
                    self.do(self._work(msg))
                elif isinstance(msg, (WritePages, ReadPages, DeletePages, TouchPages)):
                    self._store(msg)
        return ran

    def _work(self, plan: RunStep) -> StepDone:
        p = self.page_size
        self.shelved.update(plan.shelves)
        self.shelved -= {c.dst_slot for c in plan.copies} | set(plan.releases) | {
            x.slot for x in (*plan.loads, *plan.decodes, *plan.prefills)}
        self.shelved_pages = {i: k for i, k in self.shelved_pages.items() if i in self.shelved}
        for st in plan.stages:
            n = st.num_tokens or p
            if st.with_state:
                self._has_state(st.slot, st.start + n, "a stage with its state")
            self.buffers[st.buffer] = (tuple(self.slots[st.slot][st.start:st.start + n]),
                                       st.with_state)
        for cp in plan.copies:
            stateless = self.hybrid and not self._state_at(cp.src_slot, cp.num_tokens)
            if not cp.state_follows:  # else its attention KV only: a restore brings the state
                self._has_state(cp.src_slot, cp.num_tokens, "a copy")
            self.slots[cp.dst_slot] = self.slots[cp.src_slot][:cp.num_tokens]
            self.stateless.discard(cp.dst_slot)
            if stateless:
                self.stateless.add(cp.dst_slot)
            mark = self.marks[cp.src_slot]
            self.marks[cp.dst_slot] = mark if mark <= cp.num_tokens else 0
        for slot in plan.releases:
            self.slots[slot] = []
            self.marks[slot] = 0
            self.stateless.discard(slot)
        for cut in plan.cuts:  # a hybrid's state is void at the cut (the restore brings it)
            self._truncate(cut.slot, cut.num_tokens, "a cut", state_follows=True)
            self.shelved.add(cut.slot)
            self.shelved_pages.pop(cut.slot, None)
        for ld in plan.loads:
            self._truncate(ld.slot, ld.start, "a load", state_follows=True)
            for b in ld.buffers:
                self.slots[ld.slot] += list(self.buffers[b][0])
            if self.slots[ld.slot][ld.start:] != list(ld.token_ids):
                raise RuntimeError(f"slot {ld.slot}: the pages loaded are not the tokens named")
            if ld.with_state:
                if not self.buffers[ld.buffers[-1]][1]:
                    raise RuntimeError(f"slot {ld.slot}: a state load from a page without one")
                self.marks[ld.slot] = len(self.slots[ld.slot])
                self.stateless.discard(ld.slot)
            elif self.hybrid:
                self.stateless.add(ld.slot)  # attention KV only: the last page brings the state
        sampled = []
        for d in plan.decodes:
            self._truncate(d.slot, d.position, "a decode")
            held = self.slots[d.slot]
            held.append(d.token_id)
            steps = min(plan.num_decode_steps, d.burst_limit)
            said = self.replies.get(self.core.slots[d.slot].rid, [])
            for i in range(steps):
                token = said.pop(0) if said else self.next_reply_id
                self.next_reply_id += not said and token == self.next_reply_id
                sampled.append(SampledToken(d.slot, token))
                if i + 1 < steps:
                    self.slots[d.slot].append(token)
        prefilled = 0
        for c in plan.prefills:
            self._truncate(c.slot, c.start, "a prefill")
            self.slots[c.slot].extend(c.token_ids)
            self.marks[c.slot] = len(self.slots[c.slot])
            prefilled += len(c.token_ids)
        self.peak_memory_tokens = max(self.peak_memory_tokens, self._memory_tokens())
        self.now += prefilled / PREFILL_TOKENS_PER_S + DECODE_STEP_S * plan.num_decode_steps
        return StepDone(plan.step, tuple(sampled), 0, len(plan.decodes), 0.0)

    def _truncate(self, slot: int, at: int, what: str, state_follows: bool = False) -> None:
        """The slot cut back to `at` for a command starting there, as the worker does
        (worker/slots.py `truncate`), refusing as it does: a command starting past what the
        slot holds, or, on a hybrid model, where the slot has no state, means the core's view
        of its slots is wrong. `state_follows` (a load, a cut) may cut anywhere: a restore's
        last page brings the state (LoadPages)."""
        held = self.slots[slot]
        if at > len(held):
            raise RuntimeError(f"slot {slot} holds {len(held)} tokens; the core "
                               f"planned {what} at {at}")
        if state_follows:
            stateless = self.hybrid and not self._state_at(slot, at)
        else:
            self._has_state(slot, at, what)
            stateless = False
        if at < len(held) or stateless:
            self.stateless.discard(slot)
            if stateless:
                self.stateless.add(slot)
        del held[at:]  # in place: slots hold tens of thousands of tokens
        if at < self.marks[slot]:
            self.marks[slot] = 0

    def _state_at(self, slot: int, at: int) -> bool:
        """Whether a hybrid slot has its recurrent state after its first `at` tokens: at its
        end (unless a load without the state reached it) and its mark (none is needed at 0)."""
        end = () if slot in self.stateless else (len(self.slots[slot]),)
        return at in (0, *end, self.marks[slot])

    def _has_state(self, slot: int, at: int, what: str) -> None:
        """Anywhere but where a hybrid slot has its state, a command cannot start."""
        if self.hybrid and not self._state_at(slot, at):
            raise RuntimeError(f"slot {slot} has no state at {at} (it holds "
                               f"{len(self.slots[slot])}, mark {self.marks[slot]}); the core "
                               f"planned {what} there")

    def _memory_tokens(self) -> int:
        """Tokens the slots hold: a full page several shelved slots hold, once."""
        whole = sum(len(t) for i, t in enumerate(self.slots) if i not in self.shelved)
        pages, tails = set(), 0
        for i in self.shelved:
            if i not in self.shelved_pages:
                self.shelved_pages[i] = self._page_keys(self.slots[i])
            pages.update(self.shelved_pages[i])
            tails += len(self.slots[i]) % self.page_size
        return whole + len(pages) * self.page_size + tails

    def _page_keys(self, tokens: list[int]) -> list[int]:
        """Keys of the full pages of `tokens`, each naming its whole prefix."""
        keys, key = [], 0
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            key = hash((key, tuple(tokens[end - self.page_size:end])))
            keys.append(key)
        return keys

    def _store(self, msg) -> None:
        if isinstance(msg, WritePages):
            infos = []
            for w in msg.writes:
                nbytes = len(w.token_ids) * TOKEN_BYTES + HEADER_BYTES + (
                    STATE_BYTES if w.flags & PageFlags.RECURRENT_STATE else 0)
                infos.append(PageInfo(w.page_id, w.parent_id, NAMESPACE, len(w.token_ids),
                                      nbytes, self.now, w.flags))
                self.disk[w.page_id] = infos[-1]
                self.written_tokens += len(w.token_ids)
            self.do(PagesWritten(tuple(infos), (), tuple(w.buffer for w in msg.writes)))
        elif isinstance(msg, ReadPages):
            ok, missing = [], []
            for r in msg.reads:
                if r.page_id in self.disk:
                    ok.append(r.page_id)
                    self.buffers[r.buffer] = (tuple(r.token_ids), bool(
                        self.disk[r.page_id].flags & PageFlags.RECURRENT_STATE))
                else:
                    missing.append(r.page_id)
            self.do(PagesRead(tuple(ok), tuple(missing)))
        elif isinstance(msg, DeletePages):
            for pid in msg.page_ids:
                self.disk.pop(pid, None)


def replay_core(trace: Trace, memory_tokens: int, disk_tokens: int,
                release_after_s: float = 10.0, max_steps: int = 200_000,
                tell_ends: bool = True, oracle: bool = False, hybrid: bool = False,
                write_back: bool = False) -> CoreCosts:
    """Run the trace through the core; re-reads are the prompt tokens earlier prompts held that
    were prefilled again (the shared prefix past what was cached, plus any request's re-read
    after it gave its slot up). `tell_ends` False: the core is never told how a reply ended
    (an older gateway), so its residency order is least recently used alone. `oracle`: its
    residency, displacement and disk eviction know the future (bench/residency_oracle.py).
    `hybrid`: the worker is a hybrid model's (a recurrent state at a slot's end and its mark,
    snapshots stored with pages; not trimmable, so no cut)."""
    prompts = synthesize(trace)
    g = ScriptedGroup(trace.page_size, memory_tokens, disk_tokens, release_after_s, hybrid,
                      write_back)
    pending = list(trace.requests)
    last_of: dict[str, str] = {}  # conversation -> rid of its latest request
    ends = {f"r{r.i}": r.end for r in trace.requests}
    told: set[str] = set()

    def ready(r) -> bool:
        before = last_of.get(r.conv or f"#{r.i}")
        return r.t <= g.now and (before is None or before in g.finished) and (
            f"r{waits_for[r.i]}" in g.finished if r.i in waits_for else True)

    # A recorded request arrived after the reply of the one it shares with had ended (the
    # client waited for it: a compaction's summary, a main session's next turn): so here.
    waits_for = {r.i: r.shared[0] for r in trace.requests if r.shared
                 and trace.requests[r.shared[0]].took is not None
                 and trace.requests[r.shared[0]].t + trace.requests[r.shared[0]].took <= r.t}

    # A reply is what the conversation's next prompt holds after this one (the gateway renders
    # a turn's generated tokens back as they were: docs/design/requests.md), so the next turn
    # extends its slot; replies nothing extends are tokens no prompt has.
    for r in trace.requests:
        if r.shared and r.shared[1] == trace.requests[r.shared[0]].prompt:
            j = r.shared[0]
            n = r.shared[1]
            g.replies.setdefault(f"r{j}", prompts[r.i][n:n + max(1, trace.requests[j].reply)])
    future = contextlib.nullcontext()
    if oracle:
        chains = [g.core.pages.chain(p) for p in prompts]
        future = told_the_future(Oracle(chains, lambda i: f"r{i}" in g.finished))
    with future:
        for _ in range(max_steps):
            for r in list(pending):  # in order: a conversation's next turn waits for this one
                if not ready(r):
                    continue
                pending.remove(r)
                g.submit(f"r{r.i}", prompts[r.i], max(1, r.reply))
                last_of[r.conv or f"#{r.i}"] = f"r{r.i}"
            ran = g.step()
            for rid in [rid for rid in g.finished if rid not in told and tell_ends]:
                told.add(rid)  # the gateway's word on the reply's end, after its last token
                g.do(ReplyEnded(rid, ends[rid]))
            if len(g.finished) == len(trace.requests):
                break
            if not ran:
                # Nothing to do until the next arrival (a step may still be waiting on pages),
                # or, with requests waiting, the service's next plan (it plans at least once a
                # heartbeat: room made by this plan, slots marked to leave, is used by that one).
                nxt = min((r.t for r in pending), default=g.now)
                if g.core.waiting:
                    nxt = min(nxt, g.now + HEARTBEAT_S)
                g.now = max(g.now + DECODE_STEP_S, nxt)
        else:
            raise RuntimeError(f"{trace.name}: the core did not finish in {max_steps} steps")
    costs = CoreCosts(tokens_written=g.written_tokens, requests=len(g.finished),
                      peak_memory_tokens=g.peak_memory_tokens,
                      peak_held_tokens=g.peak_held_tokens)
    costs.order = tuple(sorted(range(len(trace.requests)),
                               key=lambda i: g.submitted[f"r{i}"] + g.finished[f"r{i}"].queue_s))
    for r in trace.requests:
        rec = g.finished[f"r{r.i}"]
        costs.tokens_reread += max(0, r.num_shared - rec.num_cached_tokens)
        costs.tokens_reread += rec.num_reread_tokens
        costs.tokens_restored += rec.num_restored_tokens
    return costs

