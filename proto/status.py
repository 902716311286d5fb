"""The status document: what the scheduler rewrites every heartbeat (`<runtime dir>/status.json`)
for `switchyard status`, the gateway's /metrics and its dashboard (docs/design.md "Protocol").

The second protocol of the group, beside the messages: typed here, written by the scheduler
alone (`write_status`), read by everyone through `read_status`. Plain data: no text of prompts
or outputs. The JSON keeps these field names (the dashboard's script reads them as served by
/v1/switchyard/status). A new field needs no bump (readers skip fields they do not know); a
field removed or changed in meaning bumps STATUS_VERSION, and a reader of another version sees
no status rather than a wrong one.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Literal

import msgspec

STATUS_VERSION = 1

SlotState = Literal["idle", "prefilling", "restoring", "decoding"]
SLOT_STATES: tuple[str, ...] = typing.get_args(SlotState)
# Where a request's TTFT went: its prefix kept in memory, restored from disk, or prefilled.
TtftCause = Literal["reused", "restored", "prefilled"]
# A rank's kvstore: not connected, connected but silent past the peer timeout, sending its
# inventory, or ready.
KvstoreState = Literal["absent", "silent", "scanning", "ready"]


class _Doc(msgspec.Struct, frozen=True, kw_only=True):
    """A part of the document. Fields are required (counters aside), so a document cut short
    or of another shape reads as none."""


class PeerStatus(_Doc):
    boot_id: str
    pid: int | None
    last_seen: float | None  # unix time of its last message


class PeerServerStatus(_Doc):
    """Another server this one asks for pages (--peer), and what it gave since the scheduler
    started (docs/design/kv-pages.md "Pages from a peer")."""

    url: str
    num_asks: int  # asks it answered or let time out
    num_pages: int  # pages it sent that verified
    num_bytes: int
    fetch_s: float  # seconds its answers took, summed
    num_failures: int  # asks it refused, failed or did not answer in time
    last_error: str = ""


class SlotStatus(_Doc):
    slot: int
    num_tokens: int  # tokens whose KV the slot holds
    # Which prefix it holds: 12 hex digits, equal for slots of one first page, a keyed hash
    # that changes when the scheduler restarts (never a page id: scheduler/status_rows.py).
    conversation: str | None
    last_used: float | None
    rid: str | None
    priority: str | None
    state: SlotState
    waiting_s: float | None  # its request's wait so far, until its first token
    tenant: str = ""  # whose text it holds, with several keys ("": one key, or not known)


class QueuedRequest(_Doc):
    rid: str
    priority: str
    waiting_s: float
    prompt_tokens: int
    tenant: str = ""  # with several keys: whose request


class DiskStatus(_Doc):
    bytes: int  # of page files the scheduler accounts for
    budget_bytes: int
    num_pages: int
    writable: bool  # False while page writes are paused after disk errors
    num_evicted: int
    num_thrash: int  # evictions that took pages of recently active conversations
    num_writing: int
    # Why writes are paused (kvstore's words: "... (No space left on device) ..."), "" while
    # writable; and pages the disk refused since the scheduler started (only not cached).
    error: str = ""
    num_unwritten: int = 0


class RankStatus(_Doc):
    """One rank of a worker group (docs/design/worker-groups.md "Pages per rank")."""

    rank: int
    host: str
    namespace: str  # the first 8 hex digits of its page namespace
    shm_name: str
    num_buffers: int
    buffer_bytes: int
    kvstore: str  # its kvstore's identity
    kvstore_state: KvstoreState
    num_pages: int  # pages that kvstore holds


class Histogram(_Doc):
    bounds: list[float]  # upper bounds; counts has one more, for values above them all
    counts: list[int]
    sum: float
    count: int


class TokenCounts(_Doc):
    """Tokens of finished requests: the prompt, where its KV came from (reused in the slot,
    copied from another slot, restored from disk, prefilled), and the tokens generated."""

    prompt: int = 0
    reused: int = 0
    copied: int = 0
    restored: int = 0
    prefilled: int = 0
    generated: int = 0
    # Speculative decoding: draft tokens verified, and those kept (
    # docs/design/speculative-decoding.md "Speculative decoding").
    draft_proposed: int = 0
    draft_accepted: int = 0


# The prompt's sources and the generated tokens (the draft counts are reported apart).
TOKEN_KINDS: tuple[str, ...] = ("prompt", "reused", "copied", "restored", "prefilled",
                                "generated")


class SpeculationStatus(_Doc):
    """How this group speculates: "off", "batched" (every decoding sequence) or "lone" (only
    a sequence decoding alone), the most draft tokens a step proposes, and whose drafts:
    "suffix" (copied from the conversations' text), "draft" (a draft model) or both."""

    mode: str
    max_draft_tokens: int
    proposers: str = "suffix"


class PrefillShareStatus(_Doc):
    """How the latest step that prefilled split its time (scheduler/prefill_plan.py
    `prefill_share`): each of `num_protected` decoding streams kept `decode_share` of its solo
    speed while `num_waiting` requests waited for their first token; `age_s` ago."""

    decode_share: float
    num_protected: int
    num_waiting: int
    age_s: float


class KvMemoryStatus(_Doc):
    """The KV that slots hold against the worker's budget, in tokens (docs/design.md "Memory
    plan"): `held_tokens` counts what their caches may take, running requests' reserves for
    growth and the decode batch included; `num_tokens` is the tokens themselves."""

    held_tokens: int
    budget_tokens: int
    num_tokens: int
    num_running: int
    num_resident: int  # slots holding KV, running or idle
    num_preempted: int  # running requests staged to disk for memory since the start
    # Idle slots held as pages shared between them (docs/design/kv-pages.md "Shared pages in
    # memory"), and the tokens they hold, each shared page once.
    num_shelved: int = 0
    shelved_tokens: int = 0
    # Idle slots cut for memory since the start (docs/design/kv-pages.md "Cut slots"), and
    # the tokens they kept in memory that a whole release would have sent to disk.
    num_cut: int = 0
    cut_kept_tokens: int = 0


class RecentRequest(_Doc):
    """A finished request, for the TTFT plot and the timeline of conversations: when it
    arrived (`started_at`), got its first token (`started_at + ttft_s`) and finished (`at`),
    and where its prompt's KV came from (the slot it ran in, another slot, the disk, or
    prefilled), besides what it decoded."""

    at: float
    ttft_s: float
    cause: TtftCause
    prompt_tokens: int
    cached_tokens: int
    priority: str
    tenant: str = ""  # with several keys: whose request
    rid: str = ""
    # Its conversation, as the status may name one (scheduler/conversation_threads.py).
    conversation: str = ""
    started_at: float = 0.0
    reused_tokens: int = 0
    copied_tokens: int = 0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0


class TenantStats(_Doc):
    """One tenant's own counters (several keys): what its key is shown in place of everyone's
    (gateway/tenant_view.py), so no counter it sees moves with another tenant's text."""

    requests_finished: dict[str, int]  # by finish reason
    tokens: TokenCounts
    ttft: Histogram


class Stats(_Doc):
    """Counters since the scheduler started (a restart starts them from zero)."""

    requests_finished: dict[str, int]  # by finish reason
    requests_failed: dict[str, int]  # by error code
    tokens: TokenCounts
    ttft: Histogram
    step_time: Histogram
    num_steps: int
    restarts: dict[str, int]  # by peer role: new boot ids seen
    recent_requests: list[RecentRequest]
    by_tenant: dict[str, TenantStats] = {}  # with several keys: each tenant's own


class Status(_Doc):
    version: int
    at: float  # when the scheduler wrote it (unix time)
    boot_id: str  # the scheduler's
    pid: int
    started_at: float
    worker_ready: bool
    kvstore_ready: bool
    peers: dict[str, PeerStatus]  # by role
    slots: list[SlotStatus]
    queue: list[QueuedRequest]
    oldest_waiting_s: float  # the oldest request without its first token (queued or not)
    disk: DiskStatus
    ranks: list[RankStatus]  # a worker group's ranks; empty for a single worker
    stats: Stats
    speculation: SpeculationStatus | None = None
    prefill_share: PrefillShareStatus | None = None
    kv_memory: KvMemoryStatus | None = None  # None when the worker's budget is not counted
    peer_servers: list[PeerServerStatus] = []  # --peer: the servers pages come from


_decoder = msgspec.json.Decoder(Status)


def encode_status(status: Status) -> bytes:
    return msgspec.json.encode(status)


def decode_status(data: bytes | str) -> Status | None:
    """The document in `data`, or None when it is not one of this version."""
    try:
        status = _decoder.decode(data)
    except msgspec.DecodeError:  # not JSON, cut short, or another shape (ValidationError)
        return None
    return status if status.version == STATUS_VERSION else None


def write_status(path: Path, status: Status) -> None:
    """Replace the file atomically: a reader sees the old document or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(encode_status(status))
    os.replace(tmp, path)


def read_status(path: Path) -> Status | None:
    """The status document at `path`; None when it is missing, unreadable, partial or of
    another version. Never raises: every reader treats "no status" as one case."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return decode_status(data)
