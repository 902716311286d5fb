"""The gateway's request model: the one internal shape every API translates its requests into
(the handlers in gateway/api/ build it; the turn driver, prompting and output read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchyard.gateway.errors import out_of_range
from switchyard.gateway.request.structured import Constraint
from switchyard.proto.base import PRIORITIES, PRIORITY_BACKGROUND, PRIORITY_INTERACTIVE
from switchyard.common.tenants import Tenant, Tenants

PRIORITY_HEADER = "x-switchyard-priority"


@dataclass(frozen=True)
class ToolChoice:
    """Whether the turn may, must or must not call a tool, as every API's tool_choice becomes
    (request/tools.py)."""

    mode: str = "auto"  # "auto" | "none" | "required" | "function"
    name: str | None = None  # with mode "function"


AUTO = ToolChoice()
NONE = ToolChoice("none")


@dataclass(frozen=True)
class Options:
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    priority: str | None = None
    user: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unchecked here
    speculative: bool = True  # False: no speculative decoding for this request
    # vLLM's `cache_salt`: the request's cached text (pages, drafts, remembered turns) is
    # shared only with requests of its tenant that give the same salt (common/tenants.py).
    cache_salt: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """The one internal shape of a chat turn: every API (Chat Completions, Anthropic Messages,
    Responses) translates its request into this.

    `messages` are OpenAI-style chat messages as chat templates take them: `role`, `content`
    (a string; None only for an assistant message with tool calls), for assistant messages
    `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments": str}}]`) and
    `reasoning_content`, for tool results `tool_call_id`. `tools` are OpenAI function tools.
    """

    messages: list[dict[str, Any]]
    options: Options
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Structured outputs: what the answer must match (None: free text), and the tools whose
    # calls must match their `parameters` schema (docs/design/requests.md "Structured outputs").
    constraint: Constraint | None = None
    strict_tools: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    options: Options
    constraint: Constraint | None = None


def parse_priority(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if value not in PRIORITIES:
        raise out_of_range(param, " or ".join(f"'{p}'" for p in PRIORITIES))
    return value


def header_priority(headers: Any) -> str | None:
    return parse_priority(headers.get(PRIORITY_HEADER), "X-Switchyard-Priority")


def request_priority(options: Options, headers: Any, background_models: tuple[str, ...]) -> str:
    """The body's priority, else the header's, else background for a `--background-model` name
    (an agent's sub-agents, which cannot send headers of their own), else interactive."""
    if options.priority is not None:
        return options.priority
    asked = header_priority(headers)
    if asked is None and options.model is not None and options.model in background_models:
        return PRIORITY_BACKGROUND
    return asked or PRIORITY_INTERACTIVE


@dataclass(frozen=True)
class TurnChoices:
    """What a turn's options and its HTTP request decide together, once per turn
    (`turn_choices`, by RequestContext.decide or decide_chat): the salt of its cached text, its
    priority, and whose share it counts against (its tenant's name and weight; "" and 1 with
    one tenant)."""

    salt: bytes
    priority: str
    tenant: str = ""
    tenant_weight: float = 1.0


def turn_choices(options: Options, headers: Any, background_models: tuple[str, ...],
                 tenants: Tenants, tenant: Tenant | None) -> TurnChoices:
    """A turn's priority (`request_priority`), its salt (its tenant's, and the body's
    `cache_salt`) and its tenant's share (`tenant`: whose API key the request gave)."""
    priority = request_priority(options, headers, background_models)
    name, weight = tenants.share_of(tenant)
    return TurnChoices(salt=tenants.salt(tenant, options.cache_salt), priority=priority,
                       tenant=name, tenant_weight=weight)
