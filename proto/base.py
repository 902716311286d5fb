"""What every message shares: the base classes, the protocol's version, the roles, and the two
messages every peer sends (Hello, Heartbeat).

Messages are frozen `msgspec.Struct`s with a unique, explicit `kind` tag (written on the wire
as the `kind` field; `Cls.kind` reads it). They live in one module per direction:
`gateway_scheduler`, `scheduler_worker`, `scheduler_kvstore`; `values` holds the value types
more than one direction nests. `proto.codec` decodes exactly the union of them; unknown kinds
and unknown fields are rejected. Token lists are `TokenIds` (packed uint32 on the wire). KV
bytes never travel in messages: page payloads live in shared memory and messages name buffer
indexes. docs/design.md "Protocol".
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

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
# 15: FetchPeerPages / PeerPagesFetched (pages from a peer server).
# 16: ReplyEnded (how a reply ended, for the scheduler's residency).
# 17: WorkerReady.state_marks (window and hybrid slots keep their state at the prompt's end).
# 18: RunStep.shelves, WorkerReady.shared_pages (idle slots' KV as pages shared between slots).
# 19: RunStep.cuts; CopyPrefix.state_follows, and a hybrid load that starts where the slot has
# no state (its restore's last page brings it). 20: WorkerStopping / WorkerMayStop (a worker
# that writes back is written before it stops).
PROTOCOL_VERSION = 20

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


def pack_tokens(struct, *names: str) -> None:
    """Token lists given as tuples or lists are packed once, when the message is built."""
    for name in names:
        value = getattr(struct, name)
        if not isinstance(value, TokenIds):
            msgspec.structs.force_setattr(struct, name, as_token_ids(value))


def name_kinds(messages: tuple[type[Message], ...]) -> None:
    """`Cls.kind` reads each message's tag (msgspec keeps it in the struct's config)."""
    for cls in messages:
        cls.kind = cls.__struct_config__.tag


class Hello(Message, tag="hello"):
    protocol_version: int
    boot_id: str
    role: str
    pid: int


class Heartbeat(Message, tag="heartbeat"):
    boot_id: str


MESSAGES: tuple[type[Message], ...] = (Hello, Heartbeat)
name_kinds(MESSAGES)
