"""Every message that crosses a process boundary.

Messages are frozen dataclasses with a unique `kind` tag (a class attribute, not a field).
`proto.codec` maps tags to types through `MESSAGE_TYPES`; nothing is looked up by class name.
KV bytes never travel here: page payloads live in shared memory and messages name buffer indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

PROTOCOL_VERSION = 1

ROLE_GATEWAY = "gateway"
ROLE_SCHEDULER = "scheduler"
ROLE_WORKER = "worker"
ROLE_KVSTORE = "kvstore"
ROLES = (ROLE_GATEWAY, ROLE_SCHEDULER, ROLE_WORKER, ROLE_KVSTORE)

PRIORITY_INTERACTIVE = "interactive"
PRIORITY_BACKGROUND = "background"
PRIORITIES = (PRIORITY_INTERACTIVE, PRIORITY_BACKGROUND)


# --- shared value types (nested inside messages) ---------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Always set: the gateway draws one when the client gives none, so the worker samples
    # statelessly (key = f(seed, index)) and any step can be replayed after a restart.
    seed: int = 0
    # Structured outputs: an llguidance grammar the gateway compiled and checked ("" = none),
    # in force from the first token, or from the token after `grammar_trigger` appears.
    grammar: str = ""
    grammar_trigger: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PrefillChunk:
    """Feed `token_ids` into `slot` starting at position `start`.

    The worker first truncates the slot to `start` tokens (the scheduler only asks for that
    when the slot's cache can be trimmed), so a resident prefix is reused by starting past it.
    """

    slot: int
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class DecodeItem:
    """Append `token_id` at `position` in `slot`, then sample the next token.

    In a step of several decode iterations (`RunStep.num_decode_steps`) each sampled token
    is fed back in turn, until `max_tokens` are sampled or one is in `stop_token_ids`.
    """

    slot: int
    position: int
    token_id: int
    sampling: SamplingParams
    # Index of the token being sampled within its request; feeds the stateless sampling key.
    sample_index: int
    max_tokens: int = 1
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    slot: int
    token_id: int


@dataclass(frozen=True)
class SlotContents:
    slot: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PageInfo:
    page_id: bytes
    parent_id: bytes
    namespace: bytes
    num_tokens: int
    nbytes: int
    last_used: float
    flags: int = 0  # bit 0: the page carries the recurrent state at its end (hybrid models)


@dataclass(frozen=True)
class StagePage:
    """Copy tokens [start, start + page_size) of `slot` into page buffer `buffer`.

    Runs before the step's compute, on the slot's contents as the previous step left them.
    `with_state` also copies the recurrent state, which exists only at the slot's end, so the
    scheduler asks for it only when the page ends exactly there.
    """

    slot: int
    start: int
    buffer: int
    with_state: bool = False
    num_tokens: int = 0  # 0: a full page; fewer: the tail of a conversation


@dataclass(frozen=True)
class CopyPrefix:
    """Replace `dst_slot`'s contents with the first `num_tokens` of `src_slot`."""

    src_slot: int
    dst_slot: int
    num_tokens: int


@dataclass(frozen=True)
class LoadPages:
    """Truncate `slot` to `start` tokens, then append the pages in `buffers`, in order.

    Every page is full except perhaps the last (a stored tail): `token_ids` says how many
    tokens they hold together. With `with_state`, the last buffer also carries the recurrent
    state at its end.
    """

    slot: int
    start: int
    buffers: tuple[int, ...]
    token_ids: tuple[int, ...]  # the pages' tokens, so the worker knows what its slot holds
    with_state: bool = False


@dataclass(frozen=True)
class PageWrite:
    page_id: bytes
    parent_id: bytes
    token_ids: tuple[int, ...]
    buffer: int
    payload_len: int  # bytes of the buffer that belong to the page (state included)
    flags: int = 0


@dataclass(frozen=True)
class PageRead:
    page_id: bytes
    token_ids: tuple[int, ...]
    buffer: int


# --- every peer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    kind: ClassVar[str] = "hello"
    protocol_version: int
    boot_id: str
    role: str
    pid: int


@dataclass(frozen=True)
class Heartbeat:
    kind: ClassVar[str] = "heartbeat"
    boot_id: str


# --- gateway -> scheduler ---------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitRequest:
    kind: ClassVar[str] = "submit_request"
    rid: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    priority: str = PRIORITY_INTERACTIVE


@dataclass(frozen=True)
class CancelRequest:
    kind: ClassVar[str] = "cancel_request"
    rid: str


# --- scheduler -> gateway ---------------------------------------------------------------------


@dataclass(frozen=True)
class TokensGenerated:
    kind: ClassVar[str] = "tokens_generated"
    rid: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestFinished:
    kind: ClassVar[str] = "request_finished"
    rid: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


@dataclass(frozen=True)
class RequestFailed:
    kind: ClassVar[str] = "request_failed"
    rid: str
    code: str  # "queue_full" | "context_length_exceeded" | "component_restarted" | "internal"
    message: str
    retryable: bool
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class GroupState:
    """Sent to the gateway every heartbeat and on change; doubles as the scheduler's heartbeat."""

    kind: ClassVar[str] = "group_state"
    boot_id: str
    worker_ready: bool
    kvstore_ready: bool
    num_waiting: int
    num_running: int


# --- scheduler -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunStep:
    """One forward step. The worker runs, in order: stages, copies, loads, decodes, prefills."""

    kind: ClassVar[str] = "run_step"
    step: int
    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeItem, ...] = ()
    stages: tuple[StagePage, ...] = ()
    copies: tuple[CopyPrefix, ...] = ()
    loads: tuple[LoadPages, ...] = ()
    # Decode iterations in this step: more than one only when nothing else waits, so the
    # round trip to the scheduler is paid once per burst rather than once per token.
    num_decode_steps: int = 1


# --- worker -> scheduler ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    kind: ClassVar[str] = "worker_ready"
    boot_id: str
    namespace: bytes
    model_type: str
    num_slots: int
    ctx: int
    page_size: int
    kv_bytes_per_token: int
    trimmable: bool  # False for hybrid models: recurrent state cannot be cut at a token
    # What each slot holds now: empty after a worker start, kept across a scheduler restart.
    slots: tuple[SlotContents, ...] = ()
    # The page buffer pool this worker created (shared with kvstore).
    shm_name: str = ""
    num_buffers: int = 0
    buffer_bytes: int = 0
    state_bytes: int = 0  # recurrent-state bytes appended to a restore-point page


@dataclass(frozen=True)
class StepDone:
    kind: ClassVar[str] = "step_done"
    step: int
    sampled: tuple[SampledToken, ...]  # in order; a slot appears once per decode iteration
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    decode_s: float = 0.0  # the batched decode (forward and sampling)
    prefill_s: float = 0.0  # the prefill chunks


# --- scheduler <-> kvstore --------------------------------------------------------------------


@dataclass(frozen=True)
class DescribeInventory:
    kind: ClassVar[str] = "describe_inventory"


@dataclass(frozen=True)
class InventoryDescribed:
    kind: ClassVar[str] = "inventory_described"
    boot_id: str
    pages: tuple[PageInfo, ...] = field(default_factory=tuple)
    scan_s: float = 0.0
    writable: bool = True
    error: str = ""


@dataclass(frozen=True)
class AttachBuffers:
    """Use this page buffer pool (a worker start created it) and this namespace."""

    kind: ClassVar[str] = "attach_buffers"
    shm_name: str
    num_buffers: int
    buffer_bytes: int
    namespace: bytes


@dataclass(frozen=True)
class WritePages:
    kind: ClassVar[str] = "write_pages"
    writes: tuple[PageWrite, ...]


@dataclass(frozen=True)
class PagesWritten:
    kind: ClassVar[str] = "pages_written"
    written: tuple[PageInfo, ...]
    failed: tuple[bytes, ...]
    buffers: tuple[int, ...]  # every buffer of the WritePages, free again
    error: str = ""  # set when the disk cannot take pages (full, read-only)


@dataclass(frozen=True)
class ReadPages:
    kind: ClassVar[str] = "read_pages"
    reads: tuple[PageRead, ...]


@dataclass(frozen=True)
class PagesRead:
    kind: ClassVar[str] = "pages_read"
    ok: tuple[bytes, ...]
    missing: tuple[bytes, ...]  # absent, corrupt (and removed) or unreadable


@dataclass(frozen=True)
class DeletePages:
    kind: ClassVar[str] = "delete_pages"
    page_ids: tuple[bytes, ...]


@dataclass(frozen=True)
class PagesDeleted:
    kind: ClassVar[str] = "pages_deleted"
    page_ids: tuple[bytes, ...]
    freed_bytes: int


@dataclass(frozen=True)
class TouchPages:
    """A conversation used these pages now: keep their recency across restarts."""

    kind: ClassVar[str] = "touch_pages"
    page_ids: tuple[bytes, ...]


MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    Heartbeat,
    SubmitRequest,
    CancelRequest,
    TokensGenerated,
    RequestFinished,
    RequestFailed,
    GroupState,
    RunStep,
    WorkerReady,
    StepDone,
    DescribeInventory,
    InventoryDescribed,
    AttachBuffers,
    WritePages,
    PagesWritten,
    ReadPages,
    PagesRead,
    DeletePages,
    PagesDeleted,
    TouchPages,
)
