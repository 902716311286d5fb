"""Messages between the scheduler and the worker: one step's work out (prefill chunks, decode
items, page stages, copies and loads), what the step did back, and the worker's grammars and
readiness."""

from __future__ import annotations

from switchyard.proto.base import Message, Value, name_kinds, pack_tokens
from switchyard.proto.tokens import TokenIds
from switchyard.proto.values import ImageData, ImageSpan, SamplingParams

# --- what a step asks for (nested in RunStep) -------------------------------------------------


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
        pack_tokens(self, "token_ids")


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
    """Replace `dst_slot`'s contents with the first `num_tokens` of `src_slot`. A hybrid or
    window model's copy needs the source's state there (its end or mark) unless
    `state_follows`: a restore into `dst_slot` whose last page brings the state comes next,
    so only the attention KV is wanted (docs/design/kv-pages.md "Hybrid models")."""

    src_slot: int
    dst_slot: int
    num_tokens: int
    state_follows: bool = False


class LoadPages(Value):
    """Truncate `slot` to `start` tokens, then append the pages in `buffers`, in order.

    Every page is full except perhaps the last (a stored tail): `token_ids` says how many
    tokens they hold together. With `with_state`, the last buffer also carries the recurrent
    state at its end. A hybrid or window model's restore ends with such a load, so its first
    load may start where the slot has no state: the attention KV before it stays.
    """

    slot: int
    start: int
    buffers: tuple[int, ...]
    token_ids: TokenIds  # the pages' tokens, so the worker knows what its slot holds
    with_state: bool = False
    reserve: int = 0  # tokens that will follow (later loads, then prefill): room made once
    images: tuple[ImageSpan, ...] = ()  # the request's images that start before the end

    def __post_init__(self):
        pack_tokens(self, "token_ids")


class CutSlot(Value):
    """Idle `slot` keeps its first `num_tokens` (whole pages) as shared pages and drops the
    rest (docs/design/kv-pages.md "Cut slots"): the disk holds it, and its next turn loads it
    back after them. Only where slots can be trimmed and shelved (`WorkerReady.trimmable`,
    `WorkerReady.shared_pages`)."""

    slot: int
    num_tokens: int


# --- scheduler -> worker ----------------------------------------------------------------------


class RunStep(Message, tag="run_step"):
    """One forward step. The worker runs, in order: shelves, stages, copies, releases and
    cuts, loads, decodes, prefills."""

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
    # Idle slots whose KV the worker holds as pages shared between slots until they are used
    # again, first thing in the step (WorkerReady.shared_pages; docs/design/kv-pages.md
    # "Shared pages in memory").
    shelves: tuple[int, ...] = ()
    # Idle slots cut back to their first pages, with the releases.
    cuts: tuple[CutSlot, ...] = ()


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


class GrammarPrepared(Message, tag="grammar_prepared"):
    """The worker compiled request `rid`'s grammar (`error` empty) or could not (why)."""

    rid: str
    error: str = ""
    compile_s: float = 0.0


class WorkerStopping(Message, tag="worker_stopping"):
    """The worker was asked to stop (SIGTERM) while pages are written back (--kv-write-back):
    it runs steps on until `WorkerMayStop`, so what only its memory holds is written first
    (docs/design/kv-pages.md "A disk smaller than memory")."""


class WorkerMayStop(Message, tag="worker_may_stop"):
    """Every slot's pages are on disk (or as far as the disk takes them): the worker stops."""


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


class SlotContents(Value):
    slot: int
    token_ids: TokenIds
    images: tuple[ImageSpan, ...] = ()  # the images among those tokens

    def __post_init__(self):
        pack_tokens(self, "token_ids")


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
    # common/held_kv.py counts them (docs/design/kv-pages.md "Memory plan"); 0: not counted.
    kv_budget_tokens: int = 0
    # Such a worker keeps each slot's state where its last prefill or restore ended (its
    # mark): a slot is cut back, copied and staged there too (docs/design/kv-pages.md "Exact
    # repeats and state marks").
    state_marks: bool = False
    # Such a worker can hold an idle slot's KV as pages shared with other slots
    # (RunStep.shelves): a page several shelved slots hold takes memory once.
    shared_pages: bool = False


class SampledToken(Value):
    slot: int
    token_id: int


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
        pack_tokens(self, "token_ids")


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


MESSAGES: tuple[type[Message], ...] = (
    RunStep, PrepareGrammar, ReleaseGrammar, GrammarPrepared, WorkerReady, StepDone,
    WorkerStopping, WorkerMayStop)
name_kinds(MESSAGES)
