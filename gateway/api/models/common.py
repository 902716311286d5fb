"""Fields more than one API declares: sampling, scheduling and cache options, each with its
range stated once (the validators and /openapi.json both read it from here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from switchyard.gateway.api.models.base import integer
from switchyard.proto.messages import PRIORITIES
from switchyard.proto.tenants import MAX_CACHE_SALT_CHARS

INT32_MAX = 2**31 - 1  # every integer that reaches the wire must fit msgpack
MAX_STOP = 16  # stop strings (Chat, Completions) and stop_sequences (Messages)

ModelName = Annotated[str, Meta(description="null: the served model")]
MaxTokens = integer(lo=1)
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = integer(lo=0, hi=INT32_MAX)
Priority = Literal[PRIORITIES]
Speculative = Annotated[bool, Meta(description=(
    "false: no speculative decoding for this request (the output is the same either way; "
    "this only changes speed)"))]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
    "vLLM's cache_salt: cached text (prefix pages, speculative drafts) is shared only with "
    "requests of the same API key giving the same salt"))]
Effort = Annotated[str, Meta(description=(
    "the chat template's reasoning_effort: low, medium or high (minimal is low; xhigh and max "
    "are high); another value is logged and not applied"))]
JsonObject = dict[str, Any]
AnyValue = Any  # accepted and not used
