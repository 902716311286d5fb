"""The scheduler's view of one request and one slot. Plain data, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from switchyard.proto.base import PRIORITY_INTERACTIVE
from switchyard.proto.values import ImageData, ImageSpan, SamplingParams
from switchyard.common.page_ids import ROOT_ID, chain_page_ids
from switchyard.scheduler.turns import Anchor


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
    # The prompt's images (their placeholder tokens are in `prompt`) and their files, by id
    # (docs/design/images.md "Images").
    images: tuple[ImageSpan, ...] = ()
    image_data: dict[bytes, ImageData] = field(default_factory=dict)
    speculative: bool = True  # drafts may be proposed for it (docs/design/speculative-decoding.md "Speculative decoding")
    # The parent id of its first page: its cache salt's chain root (proto/page_ids.chain_root),
    # so its pages, and slots holding them, are shared only with requests of the same salt.
    root: bytes = ROOT_ID
    tenant: str = ""  # its key's name with several keys (SubmitRequest.tenant)
    # The status's label of its conversation, set at its first placement
    # (scheduler/conversation_threads.py).
    conversation: str = ""
    num_proposed: int = 0  # draft tokens verified for it, and how many of them it kept
    num_accepted: int = 0
    proposers: set = field(default_factory=set)  # whose drafts were verified ("suffix", "draft", "mtp")
    slot: int | None = None
    cancelled: bool = False
    grammar_ready: bool = True  # False while the worker compiles its grammar (PrepareGrammar)
    # Pages from a peer (scheduler/peer_fetch.py): looked at once; not placed while asked.
    peer_asked: bool = False
    fetching: bool = False
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
    # Time slicing (scheduler.fairness): when it last entered the queue (its arrival, or when
    # it last gave its slot up), the tokens it had generated when it was last placed, how
    # often it gave a slot up after its first token, and how many requests that entered the
    # queue after it were placed while it waited since.
    queued_at: float = -1.0
    placed_generated: int = 0
    num_yields: int = 0
    num_overtaken: int = 0
    # The running request it waits for, prefilling a prefix they share (scheduler.admission).
    waits_for: str | None = None
    # Memory (scheduler.kv_memory): it waits for room for its KV (logged once per wait); the
    # tokens its slot held when it last gave the slot up, and the tokens of those it had to
    # prefill again when placed after that (0 unless its pages were lost).
    waits_for_memory: bool = False
    # It waits for idle conversations due back that the disk does not hold (alone, nothing
    # running: scheduler/memory_manager.py `_waits_for_return`): those behind it are placed
    # meanwhile, their next turns among them.
    waits_aside: bool = False
    held_when_preempted: int = 0
    num_reread: int = 0
    # Every token the model must see: the prompt, then what it generated so far. All but the
    # last are prefilled into the slot; the last is the next decode input, so there is always
    # at least one token to run and the first output token comes from a one-token
    # forward pass, exactly as mlx_lm.generate does. Grown in place (`add_token`), never
    # rebuilt: per-step work must not depend on the context's length (docs/design/scheduling.md
    # "Scheduling").
    feed: list[int] = field(init=False)
    # Ids of the full pages of the context (`feed[:-1]`) under `chain_namespace`, extended as
    # pages fill: each page is hashed once.
    page_ids: list[bytes] = field(init=False, default_factory=list)
    chain_namespace: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        self.feed = [*self.prompt, *self.generated]
        if self.queued_at < 0:
            self.queued_at = self.arrived_at

    @property
    def restoring(self) -> bool:
        return bool(self.restore_pages or self.reading or self.loading)

    @property
    def num_context(self) -> int:
        """Tokens whose KV the slot must hold before the next decode: all but the last."""
        return len(self.feed) - 1

    def add_token(self, token: int) -> None:
        self.generated.append(token)
        self.feed.append(token)

    def context_chain(self, namespace: bytes, page_size: int) -> list[bytes]:
        """The page ids of the context's full pages, hashing only pages filled since the
        last call (the way vLLM's block hashes and nano-vllm's Sequence do it)."""
        if namespace != self.chain_namespace:
            self.page_ids, self.chain_namespace = [], namespace
        full, have = self.num_context // page_size, len(self.page_ids)
        if have < full:
            parent = self.page_ids[-1] if have else self.root
            self.page_ids += chain_page_ids(
                namespace, self.feed[have * page_size:full * page_size], page_size, parent,
                self.images, have * page_size)
        return self.page_ids

    def images_before(self, end: int) -> tuple[ImageSpan, ...]:
        """The images that start before token `end` (what a command up to there needs)."""
        return tuple(im for im in self.images if im.start < end)

    def image_files(self, start: int, end: int) -> tuple[ImageData, ...]:
        """The files of the images whose placeholders overlap tokens [start, end)."""
        ids = dict.fromkeys(im.image_id for im in self.images if im.start < end and im.end > start)
        return tuple(self.image_data[i] for i in ids if i in self.image_data)

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
    # The disk let go of pages counted in `num_persisted` (scheduler/disk_copy.py): they are
    # written again once the slot must leave memory (`leaving`: the KV budget or a newcomer
    # wants the room; `disk_wanted`: past --slots). `removals_seen`: PageCache.removals at
    # the last recount.
    disk_gap: bool = False
    disk_wanted: bool = False
    disk_tried: bool = False  # written again as far as the disk took it: it may leave
    removals_seen: int = 0
    # A prompt or a turn ended here: store the partial last page too (next step's stages).
    tail_wanted: bool = False
    # A prompt's context (all its tokens but the last) ended at this token: store the partial
    # page that ends here (next step's stages), where a retry of the prompt resumes. 0: none.
    prompt_tail_at: int = 0
    # A hybrid request's branch point inside a page: once the slot's prefill reaches it, store
    # the partial page that ends there with the state (docs/design/kv-pages.md "Branch points").
    branch_tail_at: int = 0
    # Where the worker keeps this slot's state besides its end (a hybrid or sliding-window
    # model's mark: the end of its last prefill or restore; docs/design/kv-pages.md "Exact
    # repeats and state marks"): the slot can be cut back or copied there. 0: none.
    state_mark: int = 0
    # A hybrid slot whose end has no state: a restore's batch was loaded without it (only the
    # restore's last page brings it). Nothing may stage, copy or continue from that end;
    # left so (a restore cancelled or preempted), the slot goes back to its mark.
    stateless_end: bool = False
    # The turn whose tokens these are (scheduler.turns): the tails stored from here are its.
    turn: Anchor | None = None
    # The images among (and past) `tokens`: the request's that filled the slot last (its
    # tokens agree with that request's up to the slot's length); their ids are in page ids.
    images: tuple[ImageSpan, ...] = ()
    # The chain root of the request that filled it (its cache salt's): its page ids start
    # there, and only requests of that root share its tokens.
    root: bytes = ROOT_ID
    # Idle, its KV leaves memory as soon as its tokens are on disk or on their way: the KV
    # budget wants the room (scheduler.kv_memory).
    leaving: bool = False
    # Leaving, it keeps its first `cut_to` tokens (whole pages; held as shared pages) and
    # only the rest leaves (RunStep.cuts; docs/design/kv-pages.md "Cut slots"). 0: it all goes.
    cut_to: int = 0
    # Idle, the worker holds its KV as pages shared with other slots (RunStep.shelves) until
    # it is used again: a page other shelved slots hold counts once (scheduler.kv_memory).
    shelved: bool = False
    # The request that ran here last, and how its reply ended as the gateway told
    # (ReplyEnded.end; "" until it does): how soon its conversation is expected back
    # (scheduler/residency.py).
    last_rid: str | None = None
    reply_end: str = ""
    # That request was background: an interactive newcomer does not wait for its
    # conversation to come back (MemoryManager._waits_for_return).
    background: bool = False
    # How long after its conversation's previous reply the turn that ran here last came
    # (None: its first turn, or not known): when the conversation is expected back
    # (scheduler/residency.py `expected_back`).
    return_gap: float | None = None

    @property
    def free(self) -> bool:
        return self.rid is None

    def has_state_at(self, end: int) -> bool:
        """Whether a hybrid slot's worker has its state after its first `end` tokens: at its
        mark, and at its end unless a restore's batch reached it without the state."""
        return end == self.state_mark or (end == len(self.tokens) and not self.stateless_end)

    def take_tails(self) -> list[int]:
        """The ends of the partial pages to store now (next step's stages), each once: a
        branch point the prefill reached (the slot's turn owns it), where the prompt's
        context ended (the next turn, whatever the client made of the reply, and the same
        prompt again resume there), where the turn ended (the next turn, if its history
        carries the reply's exact tokens)."""
        ends = [e for e in (self.branch_tail_at, self.prompt_tail_at)
                if 0 < e <= len(self.tokens)]
        if self.branch_tail_at <= len(self.tokens):
            self.branch_tail_at = 0
        self.prompt_tail_at = 0
        if self.tail_wanted:
            self.tail_wanted = False
            ends.append(len(self.tokens))
        return ends

    def truncate(self, length: int, page_size: int, state_follows: bool = False) -> None:
        """Keep the first `length` tokens. A hybrid slot is cut back only to where it has its
        state, unless `state_follows` (as the worker's `SlotStore.truncate`): a restore whose
        last page brings the state comes next, and until then the end has none."""
        stateless = state_follows and not self.has_state_at(length)
        if length < self.state_mark:
            self.state_mark = 0
        if length < len(self.tokens) or stateless:
            self.stateless_end = stateless
        if length < self.prompt_tail_at:
            self.prompt_tail_at = 0
        del self.tokens[length:]
        del self.page_ids[length // page_size:]
        self.num_persisted = min(self.num_persisted, len(self.page_ids))
        self.images = tuple(im for im in self.images if im.start < length)

    def replace(self, tokens, page_ids=(), images=(), root: bytes = ROOT_ID) -> None:
        """New contents; `page_ids`: ids of its leading full pages, when known; `images`:
        the images among them; `root`: the chain root they were computed from."""
        self.tokens = list(tokens)
        self.page_ids = list(page_ids)
        self.num_persisted = 0
        self.state_mark = self.prompt_tail_at = self.branch_tail_at = 0
        self.stateless_end = False
        self.images = tuple(images)
        self.turn = None
        self.root = root
        self.leaving = self.shelved = False
        self.cut_to = 0
        self.disk_gap = self.disk_wanted = self.disk_tried = False

    def shared_prefix(self, chain: list[bytes], tokens: list[int], n: int,
                      page_size: int, images: tuple[ImageSpan, ...] = (),
                      root: bytes = ROOT_ID) -> int:
        """Tokens this slot shares with `tokens[:n]`, whose full pages are `chain` (from
        `root`) and whose images are `images`; none under another root (another cache salt:
        not even the tokens of a first, partial page).

        Page ids name their whole prefix (docs/design/kv-pages.md "KV pages"): if page k matches, so
        does every page before it. So a binary search finds the first differing page, and at
        most one page of tokens is compared, and its images: two images' placeholders are
        the same token ids, so the shared part ends where the first differing image starts.
        `page_ids` must cover every full page (synced).
        """
        if root != self.root:
            return 0
        ids = self.page_ids
        lo, hi = 0, min(len(ids), len(chain))
        while lo < hi:
            mid = (lo + hi) // 2
            if ids[mid] == chain[mid]:
                lo = mid + 1
            else:
                hi = mid
        start = lo * page_size
        end = min(len(self.tokens), n, start + page_size)
        end = start + common_prefix_len(self.tokens[start:end], tokens[start:end])
        return images_agree(self.images, images, start, end) if (self.images or images) else end


def images_agree(a: tuple[ImageSpan, ...], b: tuple[ImageSpan, ...], start: int, end: int) -> int:
    """The end of [start, end) up to where sequences with images `a` and `b` (and the same
    tokens there) hold the same images: the first image that is in one and not the other
    starts where they part."""
    def near(images):
        return {(im.start, im.num_tokens, im.image_id) for im in images
                if im.start < end and im.end > start}

    differing = near(a) ^ near(b)
    return min([end, *(max(start, s) for s, _, _ in differing)])


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    i = 0
    for x, y in zip(a, b):  # iterating beats indexing, for a TokenIds above all
        if x != y:
            break
        i += 1
    return i
