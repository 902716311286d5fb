"""Every message that crosses a process boundary.

Messages are frozen `msgspec.Struct`s with a unique, explicit `kind` tag (written on the wire
as the `kind` field; `Cls.kind` reads it). `proto.codec` decodes exactly the union of
`MESSAGE_TYPES`; unknown kinds and unknown fields are rejected. Token lists are `TokenIds`
(packed uint32 on the wire). KV bytes never travel here: page payloads live in shared memory
and messages name buffer indexes. docs/design.md "Protocol".
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from switchyard.proto.page_flags import PageFlags
from switchyard.proto.tokens import TokenIds, as_token_ids

# 2: msgspec structs, token lists packed uint32 (a msgpack ext). 3: DecodeItem.burst_limit.
# 4: images (ImageSpan, ImageData) in requests, prefill chunks, loads and slot contents;
# page writes' image ids. 5: speculative decoding (DecodeItem.draft, SubmitRequest.speculative,
# WorkerReady.speculation). 6: grammars are compiled by the worker before their request is
# placed (PrepareGrammar, GrammarPrepared, ReleaseGrammar). 7: drafts made in the worker (a draft
# model: DecodeItem.draft_tokens, StepDone.drafts/draft_s, WorkerReady.drafter/draft_cost).
# 8: idle slots release their KV (RunStep.releases). 9: tenants (SubmitRequest.cache_salt).
# 10: AttachBuffers carries the pages' geometry (kvstore checks every page against it).
# 11: the worker's KV budget (WorkerReady.kv_budget_tokens), which the scheduler keeps to.
# 12: StepDone.num_forward_passes/num_forward_tokens/num_prefill_passes (packed prefill).
# 13: SubmitRequest.tenant (whose request: status views and speculation per tenant).
# 14: SubmitRequest.tenant_weight (fair shares between tenants).
PROTOCOL_VERSION = 14

ROLE_GATEWAY = "gateway"
ROLE_SCHEDULER = "scheduler"
ROLE_WORKER = "worker"
ROLE_KVSTORE = "kvstore"
ROLES = (ROLE_GATEWAY, ROLE_SCHEDULER, ROLE_WORKER, ROLE_KVSTORE)

PRIORITY_INTERACTIVE = "interactive"
PRIORITY_BACKGROUND = "background"
PRIORITIES = (PRIORITY_INTERACTIVE, PRIORITY_BACKGROUND)


class Value(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A value type nested inside messages."""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """A message: a subclass names its tag with `tag="..."`."""

    kind: ClassVar[str]


def _pack_tokens(struct, *names: str) -> None:
    """Token lists given as tuples or lists are packed once, when the message is built."""
    for name in names:
        value = getattr(struct, name)
        if not isinstance(value, TokenIds):
            msgspec.structs.force_setattr(struct, name, as_token_ids(value))


# --- shared value types (nested inside messages) ---------------------------------------------


class SamplingParams(Value):
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


class ImageSpan(Value):
    """An image in a token sequence: its placeholder tokens are [start, start + num_tokens),
    where the vision encoder's features of the image go (docs/design/images.md "Images").

    `image_id` is the image's content hash (16 bytes, of its decoded pixels), which page ids
    chain for every page the span covers. `grid` is the encoder's patch grid (t, h, w) for
    the families whose positions follow it (Qwen-VL's M-RoPE); empty for the others.
    """

    image_id: bytes
    start: int
    num_tokens: int
    grid: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ImageData(Value):
    """The bytes of an image file (PNG, JPEG, ...) as the client sent it, for the encoder."""

    image_id: bytes
    data: bytes


class PrefillChunk(Value):
    """Feed `token_ids` into `slot` starting at position `start`.

    The worker first truncates the slot to `start` tokens (the scheduler only asks for that
    when the slot's cache can be trimmed), so a resident prefix is reused by starting past it.
    `images`: the request's images that start before the chunk's end (the worker places
    positions and features by them); `image_data`: the files of those the chunk covers.
    """

    slot: int
    start: int
    token_ids: TokenIds
    images: tuple[ImageSpan, ...] = ()
    image_data: tuple[ImageData, ...] = ()

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


class DecodeItem(Value):
    """Append `token_id` at `position` in `slot`, then sample the next token.

    In a step of several decode iterations (`RunStep.num_decode_steps`) each sampled token
    is fed back in turn, until `burst_limit` are sampled or one is in `stop_token_ids`. (The
    request's own limit is `SubmitRequest.max_tokens`; the scheduler caps every burst by it.)
    """

    slot: int
    position: int
    token_id: int
    sampling: SamplingParams
    # Index of the token being sampled within its request; feeds the stateless sampling key.
    sample_index: int
    burst_limit: int = 1
    stop_token_ids: tuple[int, ...] = ()
    # Speculative decoding: tokens proposed to follow `token_id`, checked in this step's one
    # forward pass; the worker keeps the longest accepted prefix plus the model's next token
    # (docs/design/speculative-decoding.md "Speculative decoding"). A step with drafts runs one decode iteration.
    draft: tuple[int, ...] = ()
    # Drafts made in the worker (its drafter: a draft model): at most this many tokens, made
    # for this row when `draft` is empty; the step's StepDone.drafts says what was proposed.
    draft_tokens: int = 0


class SampledToken(Value):
    slot: int
    token_id: int


class SlotContents(Value):
    slot: int
    token_ids: TokenIds
    images: tuple[ImageSpan, ...] = ()  # the images among those tokens

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


class PageInfo(Value):
    page_id: bytes
    parent_id: bytes
    namespace: bytes
    num_tokens: int
    nbytes: int
    last_used: float
    flags: PageFlags = PageFlags.NONE


class StagePage(Value):
    """Copy tokens [start, start + page_size) of `slot` into page buffer `buffer`.

    Runs before the step's compute, on the slot's contents as the previous step left them.
    `with_state` also copies the recurrent state, which exists only at the slot's end and at
    its mark (`WorkerReady.state_marks`), so the scheduler asks for it only when the page
    ends exactly at one of them.
    """

    slot: int
    start: int
    buffer: int
    with_state: bool = False
    num_tokens: int = 0  # 0: a full page; fewer: the tail of a conversation


class CopyPrefix(Value):
    """Replace `dst_slot`'s contents with the first `num_tokens` of `src_slot`."""

    src_slot: int
    dst_slot: int
    num_tokens: int


class LoadPages(Value):
    """Truncate `slot` to `start` tokens, then append the pages in `buffers`, in order.

    Every page is full except perhaps the last (a stored tail): `token_ids` says how many
    tokens they hold together. With `with_state`, the last buffer also carries the recurrent
    state at its end.
    """

    slot: int
    start: int
    buffers: tuple[int, ...]
    token_ids: TokenIds  # the pages' tokens, so the worker knows what its slot holds
    with_state: bool = False
    reserve: int = 0  # tokens that will follow (later loads, then prefill): room made once
    images: tuple[ImageSpan, ...] = ()  # the request's images that start before the end

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


class PageWrite(Value):
    page_id: bytes
    parent_id: bytes
    token_ids: TokenIds
    buffer: int
    payload_len: int  # bytes of the buffer that belong to the page (state included)
    flags: PageFlags = PageFlags.NONE
    # The ids of the images whose placeholders the page covers, 16 bytes each, in order: part
    # of the page id (proto/page_ids.py) and of the page's header.
    image_ids: bytes = b""

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


class PageRead(Value):
    page_id: bytes
    token_ids: TokenIds
    buffer: int

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


# --- every peer -------------------------------------------------------------------------------


class Hello(Message, tag="hello"):
    protocol_version: int
    boot_id: str
    role: str
    pid: int


class Heartbeat(Message, tag="heartbeat"):
    boot_id: str


# --- gateway -> scheduler ---------------------------------------------------------------------


class SubmitRequest(Message, tag="submit_request"):
    rid: str
    prompt_token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    priority: str = PRIORITY_INTERACTIVE
    # Images in the prompt, in order (their placeholder tokens are in prompt_token_ids), and
    # one file per distinct image.
    images: tuple[ImageSpan, ...] = ()
    image_data: tuple[ImageData, ...] = ()
    speculative: bool = True  # False: this request opts out of speculative decoding
    # The request's cache salt (proto/tenants.py: its tenant's, and its `cache_salt`; 16
    # bytes, or empty: unsalted). Its page chain starts from a root made of it, and the
    # proposer copies drafts only from text of the same salt.
    cache_salt: bytes = b""
    # Whose request: its key's name with several keys, "" with one or none. The status shows
    # each key its own requests by it, and the proposer keeps each tenant's n-grams apart.
    # The queue, the slots and the prefill are divided between tenants by `tenant_weight`
    # (the key file's; scheduler/tenant_shares.py).
    tenant: str = ""
    tenant_weight: float = 1.0

    def __post_init__(self):
        _pack_tokens(self, "prompt_token_ids")


class CancelRequest(Message, tag="cancel_request"):
    rid: str


# --- scheduler -> gateway ---------------------------------------------------------------------


class TokensGenerated(Message, tag="tokens_generated"):
    rid: str
    token_ids: tuple[int, ...]


class RequestFinished(Message, tag="request_finished"):
    rid: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


class RequestFailed(Message, tag="request_failed"):
    rid: str
    code: str  # "queue_full" | "context_length_exceeded" | "component_restarted" | "internal"
    message: str
    retryable: bool
    retry_after_s: float = 0.0


class GroupState(Message, tag="group_state"):
    """Sent to the gateway every heartbeat and on change; doubles as the scheduler's heartbeat."""

    boot_id: str
    worker_ready: bool
    kvstore_ready: bool
    num_waiting: int
    num_running: int


# --- scheduler -> worker ----------------------------------------------------------------------


class RunStep(Message, tag="run_step"):
    """One forward step. The worker runs, in order: stages, copies, releases, loads, decodes,
    prefills."""

    step: int
    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeItem, ...] = ()
    stages: tuple[StagePage, ...] = ()
    copies: tuple[CopyPrefix, ...] = ()
    loads: tuple[LoadPages, ...] = ()
    # Decode iterations in this step: more than one only when nothing else waits, so the
    # round trip to the scheduler is paid once per burst rather than once per token.
    num_decode_steps: int = 1
    # Idle slots whose KV leaves memory (--max-running past --slots): the worker drops it and
    # they hold nothing from here.
    releases: tuple[int, ...] = ()


# --- worker -> scheduler ----------------------------------------------------------------------


class PrepareGrammar(Message, tag="prepare_grammar"):
    """Compile `grammar` (a request's SamplingParams.grammar) for request `rid`, off the step
    loop; answered with GrammarPrepared. The request is placed only after that, so no step
    ever compiles a grammar (docs/design/requests.md "Structured outputs")."""

    rid: str
    grammar: str


class ReleaseGrammar(Message, tag="release_grammar"):
    """Request `rid` ended: its grammar need not be kept for it any longer."""

    rid: str


class RankInfo(Value):
    """One rank of a worker group: its share's page namespace and buffer pool
    (docs/design/worker-groups.md "Worker groups")."""
    rank: int
    host: str  # the hostfile entry's ssh name
    namespace: bytes  # this rank's share namespace
    shm_name: str
    num_buffers: int
    buffer_bytes: int
    kv_bytes_per_token: int
    state_bytes: int


class WorkerReady(Message, tag="worker_ready"):
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
    # A worker group (sent by rank 0; the fields above are rank 0's): every rank in rank
    # order, rank 0 included. Empty for a single worker.
    ranks: tuple[RankInfo, ...] = ()
    parallel: str = ""  # "tensor" | "pipeline" for a group
    # Speculative decoding (docs/design/speculative-decoding.md "Speculative decoding"): "batched" (every decoding
    # sequence may carry a draft), "alone" (only a lone decoding sequence: sliding-window
    # rings) or "" (off: the setting, or a cache kind without an undo).
    speculation: str = ""
    # Drafts made in the worker: "draft" (--draft-model) or "" (none), and what one draft
    # pass costs relative to a plain pass of the model (its weights' share: a prior the
    # scheduler replaces by measurement).
    drafter: str = ""
    draft_cost: float = 0.0
    # Tokens of KV its slots may hold, reserves and the decode batch counted as
    # proto/held_kv.py counts them (docs/design/kv-pages.md "Memory plan"); 0: not counted.
    kv_budget_tokens: int = 0
    # Such a worker keeps each slot's state where its last prefill or restore ended (its
    # mark): a slot is cut back, copied and staged there too (docs/design/kv-pages.md "Exact
    # repeats and state marks").
    state_marks: bool = False


class SlotFailure(Value):
    """A step command the worker could not run for the request in `slot` (an image its
    processor refuses): that request fails with `code`, the others go on."""

    slot: int
    code: str
    message: str


class SlotDraft(Value):
    """A draft the worker's drafter made for the decoding row of `slot` (and verified)."""

    slot: int
    token_ids: TokenIds

    def __post_init__(self):
        _pack_tokens(self, "token_ids")


class StepDone(Message, tag="step_done"):
    step: int
    sampled: tuple[SampledToken, ...]  # in order; a slot appears once per decode iteration
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    decode_s: float = 0.0  # the batched decode (forward and sampling)
    prefill_s: float = 0.0  # the prefill chunks (without the image encoding)
    load_s: float = 0.0  # the page loads (disk restores) into slots
    encode_s: float = 0.0  # the vision encoder's runs for the prefill chunks
    num_encoded_tokens: int = 0  # the placeholder tokens of the images it encoded
    failed: tuple[SlotFailure, ...] = ()  # chunks not run: their slots are as before them
    num_verified_tokens: int = 0  # draft tokens fed to verify passes
    drafts: tuple[SlotDraft, ...] = ()  # drafts made in the worker (DecodeItem.draft_tokens)
    draft_s: float = 0.0  # the drafter's time in this step (within decode_s)
    num_draft_passes: int = 0  # the drafter's batched passes in this step
    num_catch_up_tokens: int = 0  # tokens the drafter prefilled to catch its rows up
    # The model's forward passes in this step (each one read of its weights) and the tokens
    # they computed, padding not counted (docs/design/scheduling.md "Packed prefill").
    num_forward_passes: int = 0
    num_forward_tokens: int = 0
    num_prefill_passes: int = 0  # of those, the passes that ran the prefill chunks

    @property
    def tokens_per_pass(self) -> float:
        """Tokens computed per read of the weights (0 in a step without a pass)."""
        return round(self.num_forward_tokens / self.num_forward_passes, 1) \
            if self.num_forward_passes else 0.0


# --- scheduler <-> kvstore --------------------------------------------------------------------


class GrammarPrepared(Message, tag="grammar_prepared"):
    """The worker compiled request `rid`'s grammar (`error` empty) or could not (why)."""

    rid: str
    error: str = ""
    compile_s: float = 0.0


class DescribeInventory(Message, tag="describe_inventory"):
    """Ask kvstore for every page it holds."""


class InventoryDescribed(Message, tag="inventory_described"):
    boot_id: str
    pages: tuple[PageInfo, ...] = ()
    scan_s: float = 0.0
    writable: bool = True
    error: str = ""


class AttachBuffers(Message, tag="attach_buffers"):
    """Use this page buffer pool (a worker start created it) and this namespace.

    The geometry of the namespace's pages (0: not said, nothing checked): a page of n tokens
    (1 to page_size) holds n * token_bytes, plus state_bytes with PageFlags.RECURRENT_STATE;
    a page that says otherwise is corrupt (docs/design/kv-pages.md "KV pages")."""

    shm_name: str
    num_buffers: int
    buffer_bytes: int
    namespace: bytes
    page_size: int = 0
    token_bytes: int = 0
    state_bytes: int = 0


class WritePages(Message, tag="write_pages"):
    writes: tuple[PageWrite, ...]


class PagesWritten(Message, tag="pages_written"):
    written: tuple[PageInfo, ...]
    failed: tuple[bytes, ...]
    buffers: tuple[int, ...]  # every buffer of the WritePages, free again
    error: str = ""  # set when the disk cannot take pages (full, read-only)


class ReadPages(Message, tag="read_pages"):
    reads: tuple[PageRead, ...]


class PagesRead(Message, tag="pages_read"):
    ok: tuple[bytes, ...]
    missing: tuple[bytes, ...]  # absent, corrupt (and removed) or unreadable


class DeletePages(Message, tag="delete_pages"):
    page_ids: tuple[bytes, ...]


class PagesDeleted(Message, tag="pages_deleted"):
    page_ids: tuple[bytes, ...]
    freed_bytes: int


class TouchPages(Message, tag="touch_pages"):
    """A conversation used these pages now: keep their recency across restarts."""

    page_ids: tuple[bytes, ...]


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Heartbeat,
    SubmitRequest,
    CancelRequest,
    TokensGenerated,
    RequestFinished,
    RequestFailed,
    GroupState,
    RunStep,
    PrepareGrammar,
    ReleaseGrammar,
    WorkerReady,
    StepDone,
    GrammarPrepared,
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

for _cls in MESSAGE_TYPES:
    _cls.kind = _cls.__struct_config__.tag
