"""What handlers share: the `Gateway` (settings, tokenizer, scheduler client); per HTTP request,
a `RequestRecord` that becomes its one `request.finished` log line; and the `RequestContext`
each handler takes from its Starlette request once, which is all that the turn's work below the
handlers (driver.py, turn.py) is given of it."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from switchyard.gateway.errors import Abandoned, APIError, context_length_exceeded, invalid
from switchyard.gateway.generation import Usage
from switchyard.gateway.http_limits import MAX_LARGE_BODIES, BodyBytes
from switchyard.gateway.prompting.history import DEFAULT_MAX_TURNS, RenderOptions, TurnMemory
from switchyard.gateway.output.reasoning import DEFAULT_KEEP_REASONING, ThinkSyntax
from switchyard.gateway.request.grammar_check import GrammarChecker
from switchyard.gateway.request.model import ChatRequest, Options, TurnChoices, turn_choices
from switchyard.gateway.request.response_store import ResponseStore, ResponseStores
from switchyard.gateway.request.structured import Constraint
from switchyard.gateway.scheduler_client import SchedulerClient
from switchyard.gateway.vision.inputs import PromptImages
from switchyard.gateway.streaming import ClientDisconnected, until_disconnect
from switchyard.gateway.turn import TurnUpdate
from switchyard.gateway.output.tools import HERMES, ToolSyntax
from switchyard.proto.gateway_scheduler import SubmitRequest
from switchyard.common.script import Script
from switchyard.common.settings import Settings
from switchyard.common.tenants import Tenant, Tenants
from switchyard.common.logs import content_allowed

T = TypeVar("T")

log = structlog.get_logger()

RECORD_SCOPE_KEY = "switchyard.record"
TENANT_SCOPE_KEY = "switchyard.tenant"  # the Tenant whose key the request gave (None: no keys)


@dataclass
class Gateway:
    settings: Settings
    tokenizer: Any
    client: SchedulerClient
    model_id: str
    model_aliases: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    keepalive_s: float
    created: int = field(default_factory=lambda: int(time.time()))
    tool_syntax: ToolSyntax = HERMES
    think: ThinkSyntax | None = None
    # Special tokens hidden from the output text; the others (the chat format's markers) are
    # decoded as text (formats.hidden_special_ids). Empty: decode with skip_special_tokens.
    hidden_ids: tuple[int, ...] | None = None
    turn_ends: tuple[str, ...] = ()  # the stop tokens as text (history.py)
    tools_as_text: ToolSyntax | None = None  # a template that ignores tools (tool_text.py)
    system_in_place: bool = True  # the template writes a later system turn (system_turns.py)
    message_tokens: int = 1  # the fewest tokens a chat message costs (prompts.py)
    # Prefix-stable rendering (history.py) and whether earlier reasoning is rendered.
    prefix_stable: bool = True
    keep_reasoning: bool = DEFAULT_KEEP_REASONING
    memory: TurnMemory = field(default_factory=lambda: TurnMemory(DEFAULT_MAX_TURNS))
    responses: ResponseStores = field(default_factory=ResponseStores)  # one per tenant
    # Images in requests (gateway/vision/inputs.py): refused for a text-only model.
    images: Any = None
    grammars: GrammarChecker = field(default_factory=GrammarChecker)
    # The API keys, one tenant each (common/tenants.py): whose cache a request's text salts.
    tenants: Tenants = field(default_factory=Tenants)
    # Large request bodies held at once (http_limits.py): MAX_LARGE_BODIES of the largest.
    bodies: BodyBytes = field(init=False)
    # --script: rules that decide the replies' words (common/script.py); None: the model's own.
    script: Script | None = None
    # Hugging Face fast tokenizers are not safe to call from several threads at once: each
    # lane (thread) has its own tokenizer. Prompts of LARGE_PROMPT_CHARS or more take the
    # large lane, so one huge prompt never delays everyone else's turn.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))
    large_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer-large"))
    _large_tokenizer: Any = None
    _max_token_chars: int | None = None

    def __post_init__(self) -> None:
        self.bodies = BodyBytes(MAX_LARGE_BODIES * self.settings.max_body_bytes)

    async def run_tokenizer(self, fn: Callable[..., T], tokenizer: Any, *args: Any,
                            size: int = 0, receive: Receive | None = None,
                            abandoned: threading.Event | None = None) -> T:
        """`fn(tokenizer, *args)` off the event loop (tokenizing a 100K-token conversation
        takes a while), on the large lane when the prompt has `size` >= LARGE_PROMPT_CHARS
        characters (there with that lane's own copy of `tokenizer`).

        With `receive` (the request's ASGI channel), the work is abandoned when its client
        leaves: not started if it still waits for its lane, and `abandoned` is set for `fn` to
        stop at its next step; the request then ends as disconnected (ClientDisconnect)."""
        loop = asyncio.get_running_loop()
        abandoned = abandoned or threading.Event()

        def job(lane_tokenizer: Any) -> T:
            if abandoned.is_set():
                raise Abandoned()
            return fn(lane_tokenizer, *args)

        if size < LARGE_PROMPT_CHARS or tokenizer is not self.tokenizer:
            work = loop.run_in_executor(self.executor, job, tokenizer)
        else:
            work = loop.run_in_executor(self.large_executor,
                                        lambda: job(self._large_lane_tokenizer()))
        if receive is None:
            return await work
        try:
            return await until_disconnect(receive, work)
        except ClientDisconnected:
            abandoned.set()
            raise ClientDisconnect() from None

    def _large_lane_tokenizer(self) -> Any:
        if self._large_tokenizer is None:  # made in the lane's own thread, on first use
            self._large_tokenizer = copy.deepcopy(self.tokenizer)
        return self._large_tokenizer

    def check_chat_fits(self, num_messages: int, num_chars: int, param: str) -> None:
        """Refuse, before rendering, a chat that cannot fit the context: each message takes a
        token at least, and its text (`num_chars`) as `check_prompt_chars` bounds it."""
        if num_messages > self.settings.ctx:
            raise context_length_exceeded(num_messages, self.settings.ctx, param,
                                          at_least=True)
        self.check_prompt_chars(num_chars, param)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt that cannot fit the context: no token of this
        vocabulary is longer than `max_token_chars` characters."""
        if num_chars > self.settings.ctx * self.max_token_chars():
            raise context_length_exceeded(-(-num_chars // self.max_token_chars()),
                                          self.settings.ctx, param, at_least=True)

    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            self._max_token_chars = longest_token_chars(self.tokenizer)
        return self._max_token_chars

    def shutdown(self) -> None:
        for executor in (self.executor, self.large_executor):
            executor.shutdown(wait=False, cancel_futures=True)
        if self.images is not None:
            self.images.shutdown()

    async def check_grammar(self, constraint: Constraint | None, receive: Receive) -> None:
        """A 400 unless `constraint`'s grammar checks (grammar_check.py: another process,
        bounded in time), abandoned when the client leaves (ClientDisconnect)."""
        if constraint is None:
            return
        try:
            await until_disconnect(receive, self.grammars.check(constraint))
        except ClientDisconnected:
            raise ClientDisconnect() from None


LARGE_PROMPT_CHARS = 100_000
_FALLBACK_TOKEN_CHARS = 256


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry
    (byte-level BPE spells each byte as one character, so entries are never shorter than the
    text they decode to)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: a generous bound
        return _FALLBACK_TOKEN_CHARS
    return max((len(token) for token in vocab), default=_FALLBACK_TOKEN_CHARS) or 1


@dataclass
class RequestRecord:
    """Fields only (ids, counts, times): never prompt or output text."""

    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    rid: str | None = None
    stream: bool | None = None
    priority: str | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_generated_tokens: int | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    ttft_s: float | None = None
    disconnected: bool = False
    num_tool_calls: int | None = None
    num_malformed_tool_calls: int | None = None
    num_repaired_tool_calls: int | None = None
    num_spliced_turns: int | None = None
    num_spliced_tokens: int | None = None
    tenant: str | None = None  # the key's name, with several keys
    body_bytes: int = 0  # of a large body, held in Gateway.bodies until the request ends
    script_rule: int | None = None  # --script: the rule that decided the reply
    reply_end: str | None = None  # what the scheduler was told of the reply's end (ReplyEnded)

    def start(self, submit: SubmitRequest, *, stream: bool) -> None:
        self.rid = submit.rid
        self.stream = stream
        self.priority = submit.priority
        self.num_prompt_tokens = len(submit.prompt_token_ids)

    def first_text(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.started

    def finish(self, reason: str, usage: Usage) -> None:
        self.finish_reason = reason
        self.num_prompt_tokens = usage.prompt_tokens
        self.num_cached_tokens = usage.cached_tokens
        self.num_generated_tokens = usage.completion_tokens

    def fail(self, error: APIError) -> None:
        self.error_code = error.code

    def note(self, update: TurnUpdate, turn: Any) -> None:
        """What a turn's update says for the record, streamed or not: its first text, its result
        (with the tool calls that `turn` found malformed or repaired), its error."""
        if update.has_text:
            self.first_text()
        if update.result is not None:
            self.finish(update.result.finish_reason, update.result.usage)
            self.num_tool_calls = len(update.result.tool_calls) or None
            if turn.num_malformed:
                self.num_malformed_tool_calls = turn.num_malformed
                content = {"texts": turn.malformed_texts} if content_allowed() else {}
                log.warning("tool_call.malformed", rid=self.rid,
                            num_malformed=turn.num_malformed, **content)
            if turn.num_repaired:
                self.num_repaired_tool_calls = turn.num_repaired
                log.info("tool_call.repaired", rid=self.rid, num_repaired=turn.num_repaired)
        if update.error is not None:
            self.fail(update.error)

    def closed(self, disconnected: bool) -> None:
        """The end of a streamed response (streaming.EventStreamResponse's `on_close`)."""
        self.disconnected = disconnected

    def fields(self) -> dict[str, Any]:
        out = {"endpoint": f"{self.method} {self.path}", "status": self.status,
               "duration_s": round(time.monotonic() - self.started, 4)}
        for name in ("rid", "stream", "priority", "num_prompt_tokens", "num_cached_tokens",
                     "num_generated_tokens", "finish_reason", "error_code", "num_tool_calls",
                     "num_malformed_tool_calls", "num_repaired_tool_calls",
                     "num_spliced_turns", "num_spliced_tokens", "tenant", "script_rule",
                     "reply_end"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.ttft_s is not None:
            out["ttft_s"] = round(self.ttft_s, 4)
        if self.disconnected:
            out["disconnected"] = True
        return out


# Per-request switch for prefix-stable rendering ("0"/"off" or "1"/"on"), for measurements.
PREFIX_STABLE_HEADER = "x-switchyard-prefix-stable"


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


@dataclass(frozen=True)
class RequestContext:
    """One HTTP request as the gateway's work sees it: taken from the Starlette request once, by
    its handler (`of`). The choices that depend on the body (the cache salt, the priority, the
    tenant's share) are made here once per turn (`decide`); the headers' switches are read
    where a turn needs them, so a request that does not use one is never refused for it."""

    gateway: Gateway
    record: RequestRecord
    tenant: Tenant | None  # whose API key it gave (None: no keys)
    headers: Mapping[str, str]
    receive: Receive  # the ASGI channel: watched for the client leaving
    body: Callable[[], AsyncIterator[bytes]]  # the body's chunks as they arrive

    @classmethod
    def of(cls, request: Request) -> RequestContext:
        record = request.scope.get(RECORD_SCOPE_KEY)
        if record is None:  # the app was called without its logging middleware
            record = request.scope[RECORD_SCOPE_KEY] = RequestRecord(request.method,
                                                                     request.url.path)
        return cls(gateway_of(request), record, request.scope.get(TENANT_SCOPE_KEY),
                   request.headers, request.receive, request.stream)

    def decide(self, options: Options) -> TurnChoices:
        """The turn's salt, priority and tenant's share (request/model.py turn_choices)."""
        return turn_choices(options, self.headers, self.gateway.settings.background_model,
                            self.gateway.tenants, self.tenant)

    def decide_chat(self, chat: ChatRequest, images: PromptImages | None, rendered_chars: int,
                    *, param: str, note_unseen: bool, abandoned: threading.Event
                    ) -> tuple[TurnChoices, RenderOptions]:
        """Everything a chat turn needs before it is rendered, decided once: a chat that cannot
        fit the context is refused (`rendered_chars`: its text as the template renders it),
        then come the turn's choices (as `decide` makes them) and how it is rendered: with the
        gateway's turn memory (its turns under the request's cache salt only), its images'
        markers expanded, bounded by the context (a rendering longer than ctx tokens can hold is
        refused before tokenizing). `note_unseen`: find the messages whose reasoning the
        template did not render."""
        gw = self.gateway
        max_chars = gw.settings.ctx * gw.max_token_chars()
        gw.check_chat_fits(len(chat.messages), rendered_chars, param)
        prefix_stable = self.prefix_stable()
        choices = turn_choices(chat.options, self.headers, gw.settings.background_model,
                               gw.tenants, self.tenant)
        return choices, RenderOptions(
            salt=choices.salt, memory=gw.memory, keep_reasoning=gw.keep_reasoning,
            prefix_stable=prefix_stable,
            think_start=gw.think.start if gw.think else None, turn_ends=gw.turn_ends,
            tools_as_text=gw.tools_as_text, system_in_place=gw.system_in_place,
            image_text=images.expand if images is not None else None,
            max_chars=max_chars, ctx=gw.settings.ctx, note_unseen=note_unseen,
            abandoned=abandoned)

    def prefix_stable(self) -> bool:
        """Whether the chat is rendered prefix-stable: the gateway's setting, unless the request's
        header says otherwise."""
        return header_flag(self.headers, PREFIX_STABLE_HEADER, self.gateway.prefix_stable)

    def responses(self) -> ResponseStore:
        """The Responses store of the request's tenant (its key's; "" with no keys)."""
        return self.gateway.responses.of(self.tenant.name if self.tenant is not None else "")


def header_flag(headers: Mapping[str, str], name: str, default: bool) -> bool:
    value = headers.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "on", "true", "yes"):
        return True
    if value.lower() in ("0", "off", "false", "no"):
        return False
    raise invalid(f"Header '{name}' must be 0/off or 1/on", param=name, code="invalid_value")
