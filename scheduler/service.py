"""The scheduler process: the ZeroMQ shell around `SchedulerCore`.

It binds the group's ROUTER socket on its runtime dir's ipc path. Gateway, worker and kvstore
connect as DEALERs with their role as identity and open with `Hello`. A peer's restart shows
as a new `boot_id`; a peer that is silent past `--peer-timeout-s` is treated as gone. The core
decides everything; this module only moves messages, keeps time and writes logs.

A worker group with another host also binds `--scheduler-address`, a second ROUTER socket
(CURVE, the group key). The key lets in the kvstores of the other hosts' ranks and nothing else
(docs/design/security.md "Security"): a peer there whose identity is not one of those kvstores is never
heard, and, the identities of the two sockets being apart, never takes the gateway's or the
worker's route. An identity that is not UTF-8 is dropped and logged, on either socket.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from switchyard.proto import codec
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.common.group_key import bind_curve, read_group_key, start_authenticator
from switchyard.proto.ids import new_boot_id
from switchyard.common.logs import configure_logging
from switchyard.proto.base import (
    PROTOCOL_VERSION,
    ROLE_GATEWAY,
    ROLE_KVSTORE,
    ROLE_SCHEDULER,
    ROLE_WORKER,
    Heartbeat,
    Hello,
)
from switchyard.proto.scheduler_kvstore import (
    WritePages,
    AttachBuffers,
    DeletePages,
    DescribeInventory,
    InventoryDescribed,
    PagesDeleted,
    PagesRead,
    PagesWritten,
    PeerPagesFetched,
    ReadPages,
    TouchPages,
)
from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    GroupState,
    ReplyEnded,
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.scheduler_worker import (
    GrammarPrepared,
    PrepareGrammar,
    ReleaseGrammar,
    RunStep,
    StepDone,
    WorkerMayStop,
    WorkerReady,
    WorkerStopping,
)
from switchyard.proto.service_loop import StopFlag
from switchyard.common.settings import Settings, SettingsError, format_size
from switchyard.proto.status import write_status
from switchyard.proto.sockets import bind_router, send_to
from switchyard.scheduler.config import CoreConfig
from switchyard.scheduler.core import SchedulerCore
from switchyard.scheduler.events import (
    Effects,
    FailAll,
    GatewayRestarted,
    IndexOverdue,
    KvstoreRestarted,
    PlanStep,
    WorkerLost,
)
from switchyard.scheduler.eviction import budget_report
from switchyard.scheduler.outbox import Addressed
from switchyard.scheduler.page_stores import PageStores, kvstore_identity, kvstore_rank
from switchyard.scheduler.stats import SchedulerStats
from switchyard.scheduler.status import build_status

# What each role may send besides Hello and Heartbeat; a peer of no known role is not heard.
_SENT_BY = {ROLE_GATEWAY: (SubmitRequest, CancelRequest, ReplyEnded),
            ROLE_WORKER: (StepDone, WorkerReady, GrammarPrepared, WorkerStopping)}
# The core's lines logged at debug: a request's hashed page ids (bench/residency_record.py).
_DEBUG_EVENTS = ("request.pages",)
_SENT_BY_KVSTORES = (PagesWritten, PagesRead, InventoryDescribed, PagesDeleted,
                     PeerPagesFetched)


def may_send(role: str, kind: type) -> bool:
    """Whether a peer of `role` may send a message of type `kind`."""
    if kvstore_rank(role) is not None:
        allowed = _SENT_BY_KVSTORES
    elif role in _SENT_BY:
        allowed = _SENT_BY[role]
    else:
        return False
    return issubclass(kind, (Hello, Heartbeat, *allowed))


# Where each outgoing message type goes.
_DESTINATION = {
    TokensGenerated: ROLE_GATEWAY, RequestFinished: ROLE_GATEWAY, RequestFailed: ROLE_GATEWAY,
    RunStep: ROLE_WORKER, PrepareGrammar: ROLE_WORKER, ReleaseGrammar: ROLE_WORKER,
    WorkerMayStop: ROLE_WORKER,
    AttachBuffers: ROLE_KVSTORE, DescribeInventory: ROLE_KVSTORE, ReadPages: ROLE_KVSTORE,
    WritePages: ROLE_KVSTORE, DeletePages: ROLE_KVSTORE, TouchPages: ROLE_KVSTORE,
}

# A worker that is gone this long (not restarted by its supervisor) fails what it held.
_WORKER_GRACE_FACTOR = 6
# A step may legitimately take long (a prefill chunk at full context on a CPU).
_STEP_SILENCE_LIMIT_S = 60.0


class SchedulerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.boot_id = new_boot_id()
        self.log = configure_logging(ROLE_SCHEDULER, self.boot_id, settings.log_level,
                                     settings.log_format, settings.log_content)
        self.core = SchedulerCore(CoreConfig(
            num_slots=settings.worker_slots, resident_slots=settings.slots,
            release_after_s=settings.release_after_s,
            ctx=settings.ctx, prefill_chunk=settings.prefill_chunk,
            max_queue=settings.max_queue, page_size=settings.page_size,
            disk_budget_bytes=settings.kv_disk_budget_bytes, write_back=settings.kv_write_back,
            protect_window_s=settings.kv_protect_hours * 3600,
            state_interval=settings.state_interval, decode_share=settings.decode_share,
            decode_burst=settings.decode_burst, overtake_limit=settings.overtake_limit,
            background_wait_s=settings.background_wait, slice_tokens=settings.slice_tokens,
            wait_for_index=True,
            num_draft_tokens=settings.num_draft_tokens if settings.speculative != "off" else 0,
            always_draft=settings.speculative == "suffix",
            draft_only=settings.speculative in ("draft", "mtp"),
            peers=tuple(settings.peer), peer_deadline_s=settings.peer_fetch_timeout_s))
        self.started_at = time.time()
        self.stats = SchedulerStats()
        self.peer_boot: dict[str, str] = {}
        self.peer_pid: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}
        self.worker_boot_synced: str | None = None
        self.worker_down_since: float | None = time.time()
        self.kvstore_ready = False
        self.kvstore_silent = False  # ready, then silent past the timeout (kvstore_readiness)
        self._plan_s = 0.0  # planning time of the step in flight (logged when it is done)
        self.kvstore_down_since: float | None = time.time()  # no page index yet
        # A worker group's kvstores (one per rank) are one page store to the core.
        self.stores = PageStores(group=bool(settings.hostfile), outbox=self.core.outbox)
        self.tcp_address = remote_kvstore_address(settings)
        # The identities the group key lets in over TCP: the other hosts' ranks' kvstores.
        self.tcp_identities = remote_kvstore_identities(settings) if self.tcp_address \
            else frozenset()
        self.endpoints = Endpoints(ensure_runtime_dir(settings.runtime_path))
        group_key = read_group_key(settings.group_key_file) if self.tcp_address else None
        self.ctx = zmq.Context()
        self.auth = None
        self.sock = bind_router(self.ctx, self.endpoints.scheduler)
        self.tcp_sock = None
        self.refusals = None  # handshakes the TCP endpoint refused, reported in the log
        self.unknown_peers: dict[str, int] = {}  # frames dropped per peer, reported per beat
        if group_key:  # other hosts' kvstores, CURVE only (docs/design/worker-groups.md "Pages per rank")
            self.auth = start_authenticator(self.ctx, group_key)
            self.tcp_sock = bind_router(self.ctx, None)
            self.refusals = self.tcp_sock.get_monitor_socket(REFUSED_EVENTS)
            bind_curve(self.tcp_sock, self.tcp_address, group_key)
        self.poller = zmq.Poller()
        for sock in (self.sock, self.tcp_sock):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)

    @property
    def worker_ready(self) -> bool:
        return self.worker_boot_synced is not None and self.worker_down_since is None

    # --- sending ---------------------------------------------------------------------------

    def _send(self, role: str, message) -> bool:
        sock = self.tcp_sock if role in self.tcp_identities else self.sock
        try:
            send_to(sock, role.encode(), message)
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False  # that peer is not connected (now); heartbeats will find it
            raise

    def apply(self, effects: Effects) -> None:
        """Carry out what the core decided: each message to its peer, logs, finished records."""
        for msg in effects.messages:
            if isinstance(msg, Addressed):
                self._send(msg.to, msg.message)
                continue
            if isinstance(msg, RequestFailed):
                self.stats.request_failed(msg.code)
            if _DESTINATION[type(msg)] == ROLE_KVSTORE:
                self._send_kvstores(msg)
            elif not self._send(_DESTINATION[type(msg)], msg) and isinstance(msg, RunStep):
                # The worker is not connected: wait for it to greet us again (a restarted
                # worker resets the slots and buffers this plan referred to).
                self.worker_down_since = self.worker_down_since or time.time()
                self.apply(self.core.handle(WorkerLost(), time.time()))
        for event, fields in effects.logs:
            level = "warning" if event in ("kv.thrash", "kv.persistence_off",
                                           "kv.budget_exhausted") else \
                "debug" if event in _DEBUG_EVENTS else "info"
            getattr(self.log, level)(event, **fields)
        now = time.time()
        for rec in effects.finished:
            self.stats.request_finished(rec, now)
            self.log.info("request.finished", **dataclasses.asdict(rec))

    def _send_kvstores(self, msg) -> None:
        """A page command to the kvstore, or cloned to every rank's (scheduler/page_stores.py)."""
        clones = self.stores.outgoing(msg)
        sent = [(identity, clone, self._send(identity, clone)) for identity, clone in clones]
        for reply in self.stores.sent(msg, sent):  # what no kvstore could be sent is answered
            self._to_core(reply, time.time())

    def _from_kvstore(self, role: str, msg, now: float) -> None:
        for merged in self.stores.incoming(role, msg):
            self._to_core(merged, now)
        self._send_orphan_deletes()

    def _send_orphan_deletes(self) -> None:
        """Shares other ranks lost are orphans on this one: the fan-out queues their deletes
        in the core's outbox at any merge (a merge also happens when the worker group becomes
        ready after every inventory came in); sent now."""
        self.apply(self.core.outbox.take())

    def _to_core(self, msg, now: float) -> None:
        if isinstance(msg, InventoryDescribed):
            self._on_inventory(msg, now)
        else:
            self.apply(self.core.handle(msg, now))

    def _heartbeat(self) -> None:
        self._send(ROLE_GATEWAY, GroupState(self.boot_id, self.worker_ready, self.kvstore_ready,
                                            self.core.num_waiting, self.core.num_running))
        self._send(ROLE_WORKER, Heartbeat(self.boot_id))
        for identity in self.stores.identities():
            self._send(identity, Heartbeat(self.boot_id))

    # --- receiving -------------------------------------------------------------------------

    def handle(self, role: str, msg, now: float) -> None:
        self.last_seen[role] = now
        if isinstance(msg, Hello):
            self._on_hello(role, msg, now)
        elif role not in self.peer_boot:
            # A peer from before our start: make it greet us first.
            self._send(role, Hello(PROTOCOL_VERSION, self.boot_id, ROLE_SCHEDULER, os.getpid()))
        elif isinstance(msg, (SubmitRequest, CancelRequest, ReplyEnded)):
            self.apply(self.core.handle(msg, now))
        elif isinstance(msg, (PagesWritten, PagesRead, InventoryDescribed)):
            self._from_kvstore(role, msg, now)
        elif isinstance(msg, PeerPagesFetched):  # rank 0's kvstore alone (no worker group)
            self.apply(self.core.handle(msg, now))
        elif isinstance(msg, StepDone):
            t0 = time.perf_counter()
            effects = self.core.handle(msg, now)
            done_s = time.perf_counter() - t0
            self.apply(effects)
            self.stats.step_done(msg.duration_s)
            # plan_ms + done_ms: the scheduler's own time per step (docs/design/scheduling.md "Scheduling").
            self.log.debug("step.finished", step=msg.step, batch=msg.num_decode_tokens,
                           num_verified_tokens=msg.num_verified_tokens,
                           num_prefill_tokens=msg.num_prefill_tokens,
                           forward_passes=msg.num_forward_passes,
                           prefill_passes=msg.num_prefill_passes,
                           tokens_per_pass=msg.tokens_per_pass,
                           step_ms=round(msg.duration_s * 1e3, 2),
                           decode_ms=round(msg.decode_s * 1e3, 2),
                           prefill_ms=round(msg.prefill_s * 1e3, 2),
                           plan_ms=round(self._plan_s * 1e3, 3), done_ms=round(done_s * 1e3, 3))
        elif isinstance(msg, WorkerReady):
            self._on_worker_ready(msg)
        elif isinstance(msg, (GrammarPrepared, WorkerStopping)):
            self.apply(self.core.handle(msg, now))
        elif isinstance(msg, PagesDeleted):
            self.log.debug("kv.deleted", num_pages=len(msg.page_ids),
                           freed_bytes=msg.freed_bytes)

    def _on_hello(self, role: str, msg: Hello, now: float) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self.log.error("peer.protocol_mismatch", peer=role, version=msg.protocol_version)
            return
        previous = self.peer_boot.get(role)
        self._send(role, Hello(PROTOCOL_VERSION, self.boot_id, ROLE_SCHEDULER, os.getpid()))
        if previous == msg.boot_id:
            return
        self.peer_boot[role] = msg.boot_id
        self.peer_pid[role] = msg.pid
        if previous is not None:
            self.stats.restarts[role] += 1
        self.log.info("peer.connected", peer=role, peer_boot_id=msg.boot_id, peer_pid=msg.pid,
                      restarted=previous is not None)
        if role == ROLE_GATEWAY and previous is not None:
            self.apply(self.core.handle(GatewayRestarted(), now))  # its requests are gone
        elif role == ROLE_WORKER and previous is not None:
            self.worker_down_since = self.worker_down_since or now
            self.apply(self.core.handle(WorkerLost(), now))
        elif kvstore_rank(role) is not None:  # any rank's kvstore: the group's page store
            self.stores.restarted(role)
            self.kvstore_ready = self.kvstore_silent = False
            self.kvstore_down_since = self.kvstore_down_since or now
            self.apply(self.core.handle(KvstoreRestarted(), now))  # attach, ask inventory

    def _on_inventory(self, msg: InventoryDescribed, now: float) -> None:
        self.kvstore_ready = True
        self.kvstore_down_since = None
        self.apply(self.core.handle(msg, now))

    def _on_worker_ready(self, msg: WorkerReady) -> None:
        if msg.boot_id == self.worker_boot_synced and self.worker_down_since is None:
            return
        inventory = self.stores.worker_ready(msg)  # the ranks' pools, before any page command
        msg = self.stores.for_core(msg)  # a group's pages: sized by the largest share
        self.apply(self.core.handle(msg, time.time()))
        for merged in inventory:  # every rank's came before the group was ready
            self._on_inventory(merged, time.time())
        self._send_orphan_deletes()
        self.worker_boot_synced = msg.boot_id
        self.worker_down_since = None
        self.log.info("worker.ready", worker_boot_id=msg.boot_id, model_type=msg.model_type,
                      slots=msg.num_slots, ctx=msg.ctx, trimmable=msg.trimmable,
                      speculation=msg.speculation or "off", drafter=msg.drafter,
                      draft_cost=round(msg.draft_cost, 4),
                      resident_tokens=sum(len(s.token_ids) for s in msg.slots),
                      num_page_buffers=msg.num_buffers, page_buffer_bytes=msg.buffer_bytes)
        if not msg.num_buffers:  # the model's cache cannot be paged: nothing goes to disk
            print("switchyard: KV pages off for this model (see the worker's start-up line); "
                  "the disk budget is unused", flush=True)
            return
        report = budget_report(msg.kv_bytes_per_token, self.settings.kv_disk_budget_bytes)
        writes_back = self.core.config.writes_back
        self.log.info("kv.budget", kv_bits=self.settings.kv_bits, writes_back=writes_back,
                      **report)
        bits = f", {self.settings.kv_bits}-bit KV" if self.settings.kv_bits else ""
        back = ("; smaller than memory: pages are written as their conversation leaves it"
                if writes_back else self.core.config.write_back_unused)
        print(f"switchyard: KV disk budget {format_size(report['budget_bytes'])} = "
              f"{report['budget_tokens']:,} tokens = {report['budget_conversations']} "
              f"conversations of {report['conversation_tokens']:,} tokens "
              f"({msg.kv_bytes_per_token:,} bytes/token{bits}){back}; size it with "
              f"`switchyard cache plan`", flush=True)

    # --- time ------------------------------------------------------------------------------

    def check_peers(self, now: float) -> None:
        timeout = self.settings.peer_timeout_s
        silent = now - self.last_seen.get(ROLE_WORKER, 0.0)
        limit = _STEP_SILENCE_LIMIT_S if self.core.step_in_flight else timeout
        if self.worker_down_since is None and silent > limit:
            self.log.warning("worker.lost", silent_s=round(silent, 1))
            self.worker_down_since = now
            self.apply(self.core.handle(WorkerLost(), now))
        if (self.worker_down_since is not None
                and now - self.worker_down_since > timeout * _WORKER_GRACE_FACTOR):
            self._fail_everything("the model worker is unavailable", now)
        silent = [i for i in self.stores.identities()
                  if now - self.last_seen.get(i, 0.0) > timeout]
        self.kvstore_ready, self.kvstore_silent, event = kvstore_readiness(
            self.kvstore_ready, self.kvstore_silent, bool(silent))
        if event == "kvstore.lost":
            self.log.warning(event, kvstores=silent)
        elif event is not None:
            self.log.info(event)
        # Requests wait for the page index while kvstore starts (docs/design.md "Processes");
        # one that stays away this long is not waited for: serve without disk pages.
        overdue = (self.kvstore_down_since is not None
                   and now - self.kvstore_down_since > timeout * _WORKER_GRACE_FACTOR)
        if overdue != self.core.index_overdue:
            if overdue:
                self.log.warning("kvstore.index_overdue",
                                 waited_s=round(now - self.kvstore_down_since, 1))
            self.apply(self.core.handle(IndexOverdue(overdue), now))

    def _fail_everything(self, reason: str, now: float) -> None:
        self.apply(self.core.handle(FailAll("component_restarted", reason,
                                            self.settings.heartbeat_s * 2), now))

    def log_refusals(self) -> None:
        """One line per heartbeat for connections to --scheduler-address that did not hold
        the group key (refused peers retry, so one line per attempt would flood the log)."""
        if self.refusals is None:
            return
        reasons: dict[str, int] = {}
        while self.refusals.poll(0):
            event = recv_monitor_message(self.refusals)["event"]
            reason = ("client key not this group's" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                      else "not this group's scheduler key, or no CURVE")
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, count in reasons.items():
            self.log.warning("scheduler.connection_refused", address=self.tcp_address,
                             reason=reason, count=count)
        for peer, count in self.unknown_peers.items():
            self.log.warning("scheduler.peer_refused", peer=peer, num_frames=count,
                             reason="not a role this endpoint's key allows")
        self.unknown_peers.clear()

    def write_status(self) -> None:
        write_status(self.endpoints.status_file, build_status(self, time.time()))

    # --- loop ------------------------------------------------------------------------------

    def serve(self, stop: StopFlag) -> None:
        self.log.info("scheduler.started", endpoint=self.endpoints.scheduler,
                      slots=self.settings.slots,
                      max_running=self.settings.max_running or "auto", ctx=self.settings.ctx)
        next_heartbeat = 0.0
        self.poller.register(stop.fileno(), zmq.POLLIN)  # a stop signal ends the wait
        while not stop.requested:
            now = time.time()
            if now >= next_heartbeat:
                self._heartbeat()
                self.check_peers(now)
                self.log_refusals()
                self.write_status()
                next_heartbeat = now + self.settings.heartbeat_s
            timeout_ms = max(0, int((next_heartbeat - now) * 1000))
            for sock, _ in self.poller.poll(timeout_ms):
                if isinstance(sock, zmq.Socket):
                    self._receive_all(sock)
            if self.worker_ready:
                t0 = time.perf_counter()
                effects = self.core.handle(PlanStep(), time.time())
                if effects.step is not None:
                    self._plan_s = time.perf_counter() - t0
                self.apply(effects)

    def _receive_all(self, sock: zmq.Socket) -> None:
        while True:
            try:
                identity, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [identity, frame]: no peer of ours sends that
                continue
            role = self._peer_role(sock, identity)
            if role is None:
                continue
            try:
                msg = codec.decode(frame)
            except codec.ProtocolError as exc:
                self.log.error("peer.bad_frame", peer=role, error=str(exc))
                continue
            if not may_send(role, type(msg)):
                name = f"{role[:64]} ({type(msg).__name__})"
                self.unknown_peers[name] = self.unknown_peers.get(name, 0) + 1
                continue
            self.handle(role, msg, time.time())

    def _peer_role(self, sock: zmq.Socket, identity: bytes) -> str | None:
        """The peer's role, or None when a frame from it is dropped: an identity that is not
        UTF-8 (one crashed the scheduler once), or on the TCP endpoint one the
        group key does not allow there (only the other hosts' kvstores)."""
        try:
            role = identity.decode()
        except UnicodeDecodeError:
            self.log.warning("peer.bad_identity", identity=identity[:64].hex())
            return None
        if sock is self.tcp_sock and role not in self.tcp_identities:
            name = role[:64]
            self.unknown_peers[name] = self.unknown_peers.get(name, 0) + 1
            return None
        return role

    def close(self) -> None:
        self.endpoints.status_file.unlink(missing_ok=True)
        if self.refusals is not None:
            self.tcp_sock.disable_monitor()
            self.refusals.close(0)
        if self.tcp_sock is not None:
            self.tcp_sock.close(0)
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self.log.info("scheduler.stopped")


REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def kvstore_readiness(ready: bool, silent: bool, now_silent: bool
                      ) -> tuple[bool, bool, str | None]:
    """(ready, silent, the event to log) after a heartbeat check of the kvstores. One silent
    past the timeout is not ready; heard from again without restarting (starved by a long
    prefill on a loaded machine, a slow disk), it is ready again: the page index the core
    holds is still its index. A restart goes through its inventory instead."""
    if ready and now_silent:
        return False, True, "kvstore.lost"
    if silent and not now_silent:
        return True, False, "kvstore.back"
    return ready, silent, None


def remote_kvstore_address(settings: Settings) -> str:
    """The TCP address to bind for kvstores of other hosts: --scheduler-address when the
    hostfile names a machine other than this one (none otherwise: ipc only). A group with
    another host and no address refuses to start (exit 2)."""
    if not settings.hostfile:
        return ""
    from switchyard.common.hostfile import HostfileError, is_local, read_hostfile

    try:
        remote = [h for h in read_hostfile(settings.hostfile).hosts if not is_local(h)]
    except HostfileError as exc:
        raise SettingsError(str(exc)) from None
    if remote and not settings.scheduler_address:
        raise SettingsError(
            f"--hostfile {settings.hostfile}: {remote[0].ssh} (rank {remote[0].rank}) is "
            f"another machine; give --scheduler-address tcp://IP:PORT with this machine's IP "
            f"on the link to it (a Thunderbolt bridge)")
    return settings.scheduler_address if remote else ""


def remote_kvstore_identities(settings: Settings) -> frozenset[str]:
    """The identities of the kvstores of the hostfile's ranks on other machines."""
    from switchyard.common.hostfile import is_local, read_hostfile

    return frozenset(kvstore_identity(h.rank) for h in read_hostfile(settings.hostfile).hosts
                     if not is_local(h))


def run(settings: Settings) -> None:
    stop = StopFlag()
    try:
        service = SchedulerService(settings)
    except SettingsError as exc:  # refuse to start: exit 2 ends the group with a message
        print(f"switchyard scheduler: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        service.serve(stop)
    finally:
        service.close()
