"""The scheduler's view of one request and one slot. Plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import PRIORITY_INTERACTIVE, SamplingParams


@dataclass
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    priority: str
    arrived_at: float
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False
    # Where the context's KV came from (tokens): kept in the slot, copied from another slot,
    # restored from disk. Set at the first placement; `num_cached` is what usage reports.
    num_reused: int = 0
    num_copied: int = 0
    num_restored: int = 0
    num_cached: int = 0
    cache_counted: bool = False
    prompt_tail_saved: bool = False
    admitted_at: float | None = None
    first_token_at: float | None = None
    restore_s: float = 0.0
    # Disk restore in progress: pages still to read (DiskPage), the batch being read and the
    # batch read and waiting for the next step to load it (DiskPage, buffer).
    restore_pages: list = field(default_factory=list)
    reading: list[tuple] = field(default_factory=list)
    loading: list[tuple] = field(default_factory=list)
    restore_started_at: float | None = None
    # Hybrid models: where the request's context leaves the pages on disk (snapshot there).
    branch_point: int = 0
    # Prefill fairness (scheduler.fairness): when its prefix was in the slot, when it got its
    # first prefill chunk and its last, and the tokens prefilled for others while it waited.
    ready_at: float | None = None
    first_chunk_at: float | None = None
    prefilled_at: float | None = None
    num_waited_tokens: int = 0

    @property
    def restoring(self) -> bool:
        return bool(self.restore_pages or self.reading or self.loading)

    @property
    def feed(self) -> tuple[int, ...]:
        """Every token the model must see: the prompt, then what it generated so far.

        All but the last are prefilled into the slot; the last is the next decode input, so
        there is always at least one token to run (F11) and the first output token comes from a
        one-token forward pass, exactly as mlx_lm.generate does.
        """
        return self.prompt + tuple(self.generated)

    @property
    def interactive(self) -> bool:
        return self.priority == PRIORITY_INTERACTIVE


@dataclass
class Slot:
    index: int
    # Tokens whose KV the worker holds in this slot, in order. Mirrors the worker exactly
    # after every StepDone; the worker trims to a command's start when it holds more.
    tokens: list[int] = field(default_factory=list)
    rid: str | None = None
    last_used: float = 0.0
    # Ids of the full pages of `tokens` computed so far (PageCache.sync_slot extends them),
    # and how many leading ones are known to be on disk or on their way.
    page_ids: list[bytes] = field(default_factory=list)
    num_persisted: int = 0
    # A prompt or a turn ended here: store the partial last page too (next step's stages).
    tail_wanted: bool = False

    @property
    def free(self) -> bool:
        return self.rid is None

    def truncate(self, length: int, page_size: int) -> None:
        del self.tokens[length:]
        del self.page_ids[length // page_size:]
        self.num_persisted = min(self.num_persisted, len(self.page_ids))

    def replace(self, tokens) -> None:
        self.tokens = list(tokens)
        self.page_ids = []
        self.num_persisted = 0


def common_prefix_len(a: list[int] | tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
