"""Messages between the gateway and the scheduler: requests in, their tokens and ends out, and
the group's state for the gateway's readiness."""

from __future__ import annotations

from switchyard.proto.base import PRIORITY_INTERACTIVE, Message, name_kinds, pack_tokens
from switchyard.proto.tokens import TokenIds
from switchyard.proto.values import ImageData, ImageSpan, SamplingParams

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
    # The request's cache salt (common/tenants.py: its tenant's, and its `cache_salt`; 16
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
        pack_tokens(self, "prompt_token_ids")


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


MESSAGES: tuple[type[Message], ...] = (
    SubmitRequest, CancelRequest, TokensGenerated, RequestFinished, RequestFailed, GroupState)
name_kinds(MESSAGES)
