"""The scheduler as the gateway sees it, and the gateway's open requests (pure, no sockets).

`PeerMonitor` decides from message arrival times and boot ids whether the scheduler is
connected, restarted or gone. `RequestTable` holds one asyncio.Queue per in-flight rid and can
fail all of them at once. `SchedulerClient` wires both to a DEALER socket.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

from switchyard.proto.gateway_scheduler import (
    GroupState,
    RequestFailed,
    RequestFinished,
    TokensGenerated,
)
from switchyard.proto.base import Hello

RequestEvent = TokensGenerated | RequestFinished | RequestFailed


class PeerChange(enum.Enum):
    NONE = "none"
    FIRST_CONTACT = "first_contact"  # first boot id seen
    RESTARTED = "restarted"  # a boot id different from the one we knew
    REVIVED = "revived"  # messages again after a timeout, same boot id
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class SchedulerStatus:
    connected: bool
    ever_connected: bool
    worker_ready: bool
    kvstore_ready: bool
    boot_id: str | None
    num_waiting: int
    num_running: int


class PeerMonitor:
    """Liveness and restart detection for one peer, driven by `now` from the caller's clock."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.boot_id: str | None = None
        self.greeted = False  # the peer answered our Hello since its boot
        self.alive = False
        self.ever_connected = False
        self.last_seen = 0.0
        self.state: GroupState | None = None

    @property
    def connected(self) -> bool:
        return self.alive and self.greeted

    def status(self) -> SchedulerStatus:
        state = self.state if self.connected else None
        return SchedulerStatus(
            connected=self.connected, ever_connected=self.ever_connected,
            worker_ready=bool(state and state.worker_ready),
            kvstore_ready=bool(state and state.kvstore_ready), boot_id=self.boot_id,
            num_waiting=state.num_waiting if state else 0,
            num_running=state.num_running if state else 0)

    def on_message(self, message: Any, now: float) -> PeerChange:
        """Any message proves the peer alive; Hello and GroupState also carry its boot id."""
        self.last_seen = now
        change = PeerChange.NONE
        if not self.alive:
            self.alive = True
            change = PeerChange.REVIVED
        boot_id = getattr(message, "boot_id", None)
        if isinstance(message, (Hello, GroupState)) and boot_id != self.boot_id:
            change = PeerChange.FIRST_CONTACT if self.boot_id is None else PeerChange.RESTARTED
            self.boot_id = boot_id
            self.greeted = False
            self.state = None
        if isinstance(message, Hello):
            self.greeted = True
            self.ever_connected = True
        if isinstance(message, GroupState):
            self.state = message
        return change

    def lost(self) -> bool:
        """The connection dropped (an ipc peer only does that when its process ends); True if
        it counted as alive until now."""
        was_alive, self.alive, self.greeted = self.alive, False, False
        return was_alive

    def check(self, now: float) -> PeerChange:
        """Call every heartbeat: TIMED_OUT once when the peer falls silent."""
        if self.alive and now - self.last_seen > self.timeout_s:
            self.alive = False
            self.greeted = False  # say Hello again when it is back
            return PeerChange.TIMED_OUT
        return PeerChange.NONE


class RequestTable:
    """rid -> queue of that request's events, until its final event is delivered."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestEvent]] = {}

    def __len__(self) -> int:
        return len(self._queues)

    def __contains__(self, rid: str) -> bool:
        return rid in self._queues

    def open(self, rid: str) -> asyncio.Queue[RequestEvent]:
        if rid in self._queues:
            raise KeyError(f"request {rid} is already in flight")
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    def forget(self, rid: str) -> bool:
        """Stop routing events to `rid`; True if it was still in flight."""
        return self._queues.pop(rid, None) is not None

    def deliver(self, event: RequestEvent) -> bool:
        """Route an event to its request; the final event closes the entry."""
        if isinstance(event, (RequestFinished, RequestFailed)):
            queue = self._queues.pop(event.rid, None)
        else:
            queue = self._queues.get(event.rid)
        if queue is None:
            return False
        queue.put_nowait(event)
        return True

    def fail_all(self, code: str, message: str, retry_after_s: float) -> list[str]:
        """End every in-flight request with a retryable failure; return their rids."""
        rids = list(self._queues)
        for rid in rids:
            self.deliver(RequestFailed(rid, code, message, True, retry_after_s))
        return rids
