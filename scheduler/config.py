"""The scheduler core's settings, read by the core and by the planners below it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreConfig:
    num_slots: int  # the worker's slots: as many requests run at once
    ctx: int
    prefill_chunk: int
    max_queue: int
    trimmable: bool = True
    # The worker keeps each slot's state where its last prefill or restore ended (a slot
    # mark: WorkerReady.state_marks; docs/design/kv-pages.md "Exact repeats and state marks").
    state_marks: bool = False
    # The worker holds idle slots as pages shared between them on request (RunStep.shelves,
    # WorkerReady.shared_pages; docs/design/kv-pages.md "Shared pages in memory").
    shared_pages: bool = False
    retry_after_s: float = 1.0
    page_size: int = 256
    disk_budget_bytes: int = 32 << 30
    # --kv-write-back: a disk smaller than memory is written as slots leave (`writes_back`).
    write_back: bool = False
    protect_window_s: float = 86400.0
    # Hybrid models snapshot their recurrent state every this many tokens of a prefill.
    state_interval: int = 4096
    decode_share: float = 0.5
    decode_burst: int = 8
    # Prefill order and background bound (scheduler.fairness, docs/design/scheduling.md "Scheduling").
    overtake_limit: float = 1.0
    background_wait_s: float = 30.0
    # Time slicing (scheduler.fairness): tokens a request generates in a slot before it gives
    # the slot to a request waiting for its first token (0: never, the default: measured, it
    # cost agent traffic more than it gave; docs/design/scheduling.md "Scheduling").
    slice_tokens: int = 0
    # Speculative decoding: drafts of at most this many tokens (0: off), when the worker
    # can verify them ("batched", "alone": WorkerReady.speculation).
    num_draft_tokens: int = 0
    speculation: str = ""
    always_draft: bool = False  # --speculative suffix: every proposal whole, cost unweighed
    # A drafter in the worker ("draft": a draft model, "mtp": MTP heads; WorkerReady.drafter;
    # "" none) and --speculative draft or mtp (every decoding row drafted by it, cost
    # unweighed; no copied drafts).
    drafter: str = ""
    draft_only: bool = False
    # Idle slots kept in memory, running ones counted (--slots where --max-running holds more
    # slots; 0: every slot): the rest are released once their pages are on disk.
    resident_slots: int = 0
    # ...each released once idle this long: a tool call's result comes back within seconds.
    release_after_s: float = 10.0
    # ...or this long after a reply that ended in a tool call (its result, or a main session's
    # sub-agents, come back), and at once after the end of a turn or a side call
    # (scheduler/residency.py).
    tool_return_s: float = 60.0
    # Tokens of KV the slots may hold (WorkerReady.kv_budget_tokens; 0: not counted), kept by
    # scheduler.kv_memory (docs/design/kv-pages.md "Memory plan").
    kv_budget_tokens: int = 0
    kv_bytes_per_token: int = 0  # WorkerReady.kv_bytes_per_token (0: not known yet)
    # Place nothing until kvstore's page index is known (the service sets it; a bare core, as
    # in unit tests, has no kvstore). `SchedulerCore.index_overdue` lifts it.
    wait_for_index: bool = False
    # Other servers asked for pages no slot or disk here holds (--peer), and how long
    # (docs/design/kv-pages.md "Pages from a peer").
    peers: tuple[str, ...] = ()
    peer_deadline_s: float = 2.0

    @property
    def kv_memory_bytes(self) -> int:
        """The KV memory budget in bytes (0 until the worker says)."""
        return self.kv_budget_tokens * self.kv_bytes_per_token

    @property
    def disk_holds_memory(self) -> bool:
        """Whether the disk budget holds all the KV memory may (a disk smaller than memory
        loses pages of resident slots: docs/design/kv-pages.md "A disk smaller than
        memory")."""
        return 0 < self.kv_memory_bytes <= self.disk_budget_bytes

    @property
    def writes_back(self) -> bool:
        """Whether a slot's pages go to disk when it leaves memory rather than as they are
        computed (`write_back`, --kv-write-back): on a disk smaller than memory, for a model
        whose KV can be staged at any point (attention-only), so the disk holds what memory
        does not instead of copies of what it does (docs/design/kv-pages.md "A disk smaller
        than memory"). A hybrid model's state snapshots exist only as its slot passes them:
        it writes through."""
        return (self.write_back and self.trimmable
                and 0 < self.disk_budget_bytes < self.kv_memory_bytes)

    @property
    def write_back_unused(self) -> str:
        """Why --kv-write-back, asked for, does not apply, for the start-up line ("" where
        it applies or was not asked for)."""
        if not self.write_back or self.writes_back:
            return ""
        if not self.trimmable:
            return ("; --kv-write-back does not apply: a hybrid model's state snapshots are "
                    "written as its slots pass them")
        return "; --kv-write-back does not apply: the disk budget holds what memory does"
