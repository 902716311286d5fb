"""The gateway's side of the scheduler connection: one DEALER socket, owned by asyncio tasks.

- Opens with `Hello` (again on every socket reconnection) and repeats it every heartbeat
  until the scheduler answers with its own `Hello`; after that sends `Heartbeat` every
  `heartbeat_s`.
- A `Hello`/`GroupState` with a new boot id means the scheduler restarted: every in-flight
  request fails with a retryable `component_restarted`, and the gateway says Hello again.
- A dropped connection, or silence for `peer_timeout_s`: in-flight requests fail with
  `scheduler_unavailable`, and `submit` refuses new ones (503) until the scheduler is back.
- `submit` returns a `RequestStream`, an async iterator of that request's events; closing it
  before its final event sends `CancelRequest`.

All sends go through one outbox queue, so cancelling from a `finally` block never awaits.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from switchyard.gateway.errors import (CODE_COMPONENT_RESTARTED, CODE_SCHEDULER_UNAVAILABLE,
                            CODE_SHUTTING_DOWN, unavailable)
from switchyard.gateway.peer import PeerChange, PeerMonitor, RequestEvent, RequestTable, SchedulerStatus
from switchyard.proto import codec
from switchyard.proto.base import PROTOCOL_VERSION, ROLE_GATEWAY, Heartbeat, Hello
from switchyard.proto.gateway_scheduler import (
    REPLY_ENDS,
    CancelRequest,
    GroupState,
    ReplyEnded,
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.sockets import connect_dealer

GATEWAY_IDENTITY = b"gateway"

log = structlog.get_logger()


def _crash_on_failure(task: asyncio.Task[None]) -> None:
    """A socket task that dies is a bug; without it no request could ever finish, so the
    process exits non-zero and the supervisor restarts it."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    log.critical("gateway.task_crashed", task=task.get_name(), error_type=type(exc).__name__,
                 error=str(exc))
    os._exit(70)  # EX_SOFTWARE


class RequestStream:
    """The events of one submitted request, ending with its final event."""

    def __init__(self, client: "SchedulerClient", rid: str,
                 queue: asyncio.Queue[RequestEvent]) -> None:
        self.rid = rid
        self._client = client
        self._queue = queue
        self.finished = False
        self._cancel_sent = False

    async def get(self, timeout: float | None = None) -> RequestEvent | None:
        """The next event, or None after `timeout` seconds without one."""
        if self.finished:
            raise StopAsyncIteration
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(event, (RequestFinished, RequestFailed)):
            self.finished = True
        return event

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestEvent:
        event = await self.get()
        assert event is not None  # no timeout given
        return event

    def cancel(self) -> None:
        """Ask the scheduler to stop generating; its final event still arrives here."""
        if not self.finished and not self._cancel_sent:
            self._cancel_sent = True
            self._client.send(CancelRequest(self.rid))

    def reply_ended(self, side_call: bool, finish_reason: str) -> str:
        """Tell the scheduler how the reply ended (ReplyEnded), once its final event came, for
        its residency: a side call (the client forced the reply's shape), or the API's finish
        reason (a stop sequence, a content filter: the end of a turn). Returns what it said."""
        end = "side_call" if side_call else (
            finish_reason if finish_reason in REPLY_ENDS else "stop")
        self._client.send(ReplyEnded(self.rid, end))
        return end

    def close(self) -> None:
        """Stop listening; cancels the request if it is still running. Never blocks."""
        if not self.finished:
            self.finished = True
            if self._client.forget(self.rid) and not self._cancel_sent:
                self._cancel_sent = True
                self._client.send(CancelRequest(self.rid))

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()


class SchedulerClient:
    def __init__(self, endpoint: str, *, boot_id: str, heartbeat_s: float,
                 peer_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.boot_id = boot_id
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._clock = clock
        self.peer = PeerMonitor(peer_timeout_s)
        self.requests = RequestTable()
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = connect_dealer(self._ctx, self.endpoint, GATEWAY_IDENTITY)
        # Hello now, on every (re)connection (`_monitor_loop`), and each tick until answered.
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._say_hello()
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("scheduler.recv", self._recv_loop()),
            ("scheduler.send", self._send_loop()),
            ("scheduler.tick", self._tick_loop()),
            ("scheduler.monitor", self._monitor_loop()),
        )]
        for task in self._tasks:
            task.add_done_callback(_crash_on_failure)
        log.info("scheduler.connecting", endpoint=self.endpoint)

    def fail_in_flight(self, code: str = CODE_SHUTTING_DOWN,
                       message: str = "The gateway is shutting down; retry the request.",
                       retry_after_s: float = 1.0) -> int:
        """End every open request with a retryable failure and cancel it upstream."""
        rids = self.requests.fail_all(code, message, retry_after_s)
        self._cancel_all(rids)
        return len(rids)

    async def close(self, flush_s: float = 0.5) -> None:
        self.fail_in_flight()
        deadline = time.monotonic() + flush_s
        while not self._outbox.empty() and self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # let the send task pass the cancels on
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = self._monitor = None

    # --- requests ---------------------------------------------------------------------------

    def status(self) -> SchedulerStatus:
        return self.peer.status()

    def submit(self, request: SubmitRequest) -> RequestStream:
        """Send the request; raises a 503 APIError while the scheduler is not connected."""
        if not self.peer.connected:
            raise unavailable("The scheduler is not available; retry shortly.")
        queue = self.requests.open(request.rid)
        self.send(request)
        return RequestStream(self, request.rid, queue)

    def forget(self, rid: str) -> bool:
        return self.requests.forget(rid)

    def send(self, message: Any) -> None:
        self._outbox.put_nowait(codec.encode(message))

    # --- socket tasks -----------------------------------------------------------------------

    def _say_hello(self) -> None:
        self.send(Hello(PROTOCOL_VERSION, self.boot_id, ROLE_GATEWAY, os.getpid()))

    async def _send_loop(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._outbox.get()
            await self._sock.send(frame)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            try:
                message = codec.decode(frame)
            except codec.ProtocolError as exc:
                log.warning("scheduler.bad_frame", error=str(exc), num_bytes=len(frame))
                continue
            self.on_message(message)

    async def _monitor_loop(self) -> None:
        """Socket events: a dropped connection means the scheduler process ended (fail its
        requests now, not after `peer_timeout_s`); each new connection opens with Hello."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.on_disconnected()
            elif event == zmq.EVENT_CONNECTED:
                self._say_hello()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.on_tick()

    # --- protocol logic (called by the tasks; no awaits) ---------------------------------

    def on_message(self, message: Any) -> None:
        if isinstance(message, Hello) and message.protocol_version != PROTOCOL_VERSION:
            log.error("scheduler.protocol_mismatch", theirs=message.protocol_version,
                      ours=PROTOCOL_VERSION)
            return
        change = self.peer.on_message(message, self._clock())
        if change is PeerChange.RESTARTED:
            rids = self.requests.fail_all(CODE_COMPONENT_RESTARTED,
                                          "The scheduler restarted; retry the request.", 1.0)
            self._cancel_all(rids)
            log.warning("scheduler.restarted", boot_id=self.peer.boot_id,
                        num_failed=len(rids))
        elif change is not PeerChange.NONE:
            log.info(f"scheduler.{change.value}", boot_id=self.peer.boot_id)
        if change in (PeerChange.RESTARTED, PeerChange.FIRST_CONTACT, PeerChange.REVIVED) \
                and not self.peer.greeted:
            self._say_hello()
        if isinstance(message, (TokensGenerated, RequestFinished, RequestFailed)):
            self.requests.deliver(message)
        elif not isinstance(message, (Hello, GroupState, Heartbeat)):
            log.warning("scheduler.unexpected_message", kind=type(message).kind)

    def on_disconnected(self) -> None:
        if self.peer.lost() or len(self.requests):
            num_failed = self.fail_in_flight(CODE_SCHEDULER_UNAVAILABLE,
                                             "Lost the connection to the scheduler; retry.")
            log.warning("scheduler.disconnected", num_failed=num_failed)

    def _cancel_all(self, rids: list[str]) -> None:
        """Requests failed here may still sit in the socket's queue or in a stalled scheduler;
        a CancelRequest right behind them keeps them from running for nobody."""
        for rid in rids:
            self.send(CancelRequest(rid))

    def on_tick(self) -> None:
        if self.peer.check(self._clock()) is PeerChange.TIMED_OUT:
            rids = self.requests.fail_all(CODE_SCHEDULER_UNAVAILABLE,
                                          "Lost contact with the scheduler; retry shortly.",
                                          self.peer_timeout_s)
            self._cancel_all(rids)
            log.warning("scheduler.timed_out", silent_s=self.peer_timeout_s,
                        num_failed=len(rids))
        if self.peer.greeted:
            self.send(Heartbeat(self.boot_id))
        else:
            self._say_hello()
