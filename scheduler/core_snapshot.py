"""The core's part of the status document (proto/status.py), read from its state: slots,
queue, oldest wait, disk, speculation, the prefill share and the KV memory. No prompt or
output text, never a page id.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.common.held_kv import held_tokens
from switchyard.proto.status import (DiskStatus, KvMemoryStatus, PeerServerStatus,
                                     PrefillShareStatus, QueuedRequest, SlotState, SlotStatus,
                                     SpeculationStatus)
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.fairness import oldest_waiting_s
from switchyard.scheduler.kv_memory import holds, idle_hold
from switchyard.scheduler.requests import Request
from switchyard.scheduler.status_rows import conversation_label


@dataclass(frozen=True)
class CoreSnapshot:
    """The core's part of the status document (proto/status.py)."""

    slots: list[SlotStatus]
    queue: list[QueuedRequest]
    oldest_waiting_s: float
    disk: DiskStatus
    speculation: SpeculationStatus
    prefill_share: PrefillShareStatus | None = None
    kv_memory: KvMemoryStatus | None = None
    peer_servers: list[PeerServerStatus] | None = None  # scheduler/peer_fetch.py


def snapshot(st: CoreState, now: float,
             peer_servers: list[PeerServerStatus] | None = None) -> CoreSnapshot:
    slots = []
    for slot in st.slots:
        req = st.requests.get(slot.rid) if slot.rid else None
        slots.append(SlotStatus(
            slot=slot.index, num_tokens=len(slot.tokens),
            conversation=conversation_label(slot.page_ids[0]) if slot.page_ids else None,
            tenant=req.tenant if req else st.root_tenants.of(slot.root),
            last_used=slot.last_used or None, rid=slot.rid,
            priority=req.priority if req else None,
            state=_slot_state(st, req) if req else "idle",
            waiting_s=now - req.arrived_at if req and req.first_token_at is None
            else None))
    queue = [QueuedRequest(rid=rid, priority=st.requests[rid].priority,
                           waiting_s=now - st.requests[rid].arrived_at,
                           prompt_tokens=len(st.requests[rid].prompt),
                           tenant=st.requests[rid].tenant)
             for rid in st.waiting]
    speculation = SpeculationStatus(
        mode=(st.config.speculation or "off") if st.proposer is not None else "off",
        max_draft_tokens=st.config.num_draft_tokens, proposers=_proposer_kinds(st))
    share = None
    if st.prefill_share is not None:
        at, split = st.prefill_share
        share = PrefillShareStatus(decode_share=round(split.decode_share, 3),
                                   num_protected=split.num_protected,
                                   num_waiting=split.num_waiting, age_s=now - at)
    return CoreSnapshot(slots, queue, oldest_waiting_s(st.requests.values(), now),
                        st.pages.disk_status(), speculation, share, _kv_memory(st),
                        peer_servers)


def _slot_state(st: CoreState, req: Request) -> SlotState:
    # Queued, restoring or prefilling: what a starving request shows as.
    if req.restoring:
        return "restoring"
    if st.remaining_prefill(req) > 0:
        return "prefilling"
    return "decoding"


def _kv_memory(st: CoreState) -> KvMemoryStatus | None:
    """The KV the slots hold against the worker's budget, in tokens
    (docs/design/kv-pages.md "Memory plan")."""
    budget = st.config.kv_budget_tokens
    if not budget:
        return None
    shelved = [s for s in st.slots if s.shelved and s.free]
    return KvMemoryStatus(
        held_tokens=held_tokens(holds(st.slots, st.requests, st.config.page_size),
                                st.config.ctx),
        budget_tokens=budget, num_tokens=sum(len(s.tokens) for s in st.slots),
        num_running=st.num_running, num_resident=sum(1 for s in st.slots if s.tokens),
        num_preempted=st.num_memory_preemptions,
        num_shelved=len(shelved), shelved_tokens=held_tokens(
            [idle_hold(s, st.config.page_size) for s in shelved], st.config.ctx),
        num_cut=st.num_cut, cut_kept_tokens=st.cut_kept_tokens)


def _proposer_kinds(st: CoreState) -> str:
    """Whose drafts this group verifies: "suffix", the worker's drafter ("draft": a draft
    model, "mtp": MTP heads) or both."""
    if not st.config.drafter:
        return "suffix"
    return st.config.drafter if st.config.draft_only else f"suffix,{st.config.drafter}"
