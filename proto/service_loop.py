"""What every process around the scheduler does the same way: stop on a signal, and keep a
link to the scheduler (greet it, heartbeat, greet again whenever it restarted)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import zmq

from switchyard.proto import codec
from switchyard.common.endpoints import Endpoints, ensure_runtime_dir
from switchyard.common.group_key import curve_client, read_group_key
from switchyard.proto.base import PROTOCOL_VERSION, Heartbeat, Hello
from switchyard.common.settings import Settings, SettingsError
from switchyard.proto.sockets import connect_dealer, send


class StopFlag:
    """Set by SIGTERM or SIGINT; a service loop checks it between messages. `fileno()` turns
    readable at the same moment: a loop that polls it with its sockets stops at once instead
    of at the end of its poll's timeout (up to a heartbeat)."""

    def __init__(self) -> None:
        self.requested = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, *_) -> None:
        self.requested = True
        try:
            os.write(self._wake_write, b"\0")
        except OSError:  # the pipe is full: it is readable already
            pass

    def fileno(self) -> int:
        return self._wake_read


def scheduler_endpoint(settings: Settings, endpoints: Endpoints) -> str:
    """The scheduler's ipc socket on its own machine; from another host of a worker group
    (rank 0, where the scheduler runs, is not this machine) its TCP `--scheduler-address`."""
    if settings.scheduler_address and settings.hostfile:
        from switchyard.common.hostfile import is_local, read_hostfile

        if not is_local(read_hostfile(settings.hostfile).hosts[0]):
            return settings.scheduler_address
    return endpoints.scheduler


class SchedulerLink:
    """A DEALER connection to the scheduler for a worker or kvstore process.

    `greeting()` gives the messages that follow `Hello` (a worker's `WorkerReady`). They are
    sent at start and to every scheduler incarnation met later, recognised by a boot id not
    seen before; the scheduler ignores a repeated greeting. `receive` hands the caller every
    other message and keeps the heartbeat going; with `stop`, its wait ends at a stop signal.
    """

    def __init__(self, settings: Settings, role: str, boot_id: str, log,
                 greeting: Callable[[], list] = list, stop: StopFlag | None = None):
        self.settings = settings
        self.role = role
        self.boot_id = boot_id
        self.log = log
        self.greeting = greeting
        self.ctx = zmq.Context()
        endpoints = Endpoints(ensure_runtime_dir(settings.runtime_path))
        endpoint = scheduler_endpoint(settings, endpoints)
        # Another host's scheduler admits only holders of the group key (CURVE;
        # docs/design/worker-groups.md "Pages per rank"); the local ipc socket needs none.
        key = read_group_key(settings.group_key_file) if endpoint.startswith("tcp://") else None
        self.endpoint = endpoint
        self.refusals = None
        self.sock = connect_dealer(self.ctx, endpoint, role.encode(),
                                   lambda sock: self._secure(sock, key) if key else sock)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.stop = stop
        if stop is not None:
            self.poller.register(stop.fileno(), zmq.POLLIN)
        self.scheduler_boot: str | None = None
        self.next_heartbeat = 0.0
        self._greet()

    def _greet(self) -> None:
        self.send(Hello(PROTOCOL_VERSION, self.boot_id, self.role, os.getpid()))
        for message in self.greeting():
            self.send(message)

    def _secure(self, sock: zmq.Socket, key) -> zmq.Socket:
        # A scheduler that refuses our client key ends the connection for good: the socket
        # then has no peer and a send would block, so sends time out and the refusal is told.
        self.refusals = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.setsockopt(zmq.SNDTIMEO, max(1000, int(self.settings.heartbeat_s * 1000)))
        return curve_client(sock, key)

    def _check_refused(self) -> None:
        if self.refusals is not None and self.refusals.poll(0):
            raise GroupKeyRefused(
                f"the scheduler at {self.endpoint} refused this host's group key "
                f"({self.settings.group_key_file}): copy the key file of the scheduler's "
                f"host here and restart")

    def send(self, message) -> None:
        try:
            send(self.sock, message)
        except zmq.Again:  # not connected (now): the next greeting restates what matters
            self._check_refused()

    def ignore_stop(self) -> None:
        """Waits no longer end at the stop signal (given already): the caller has work left."""
        if self.stop is not None:
            self.poller.unregister(self.stop.fileno())
            self.stop = None

    def receive(self, timeout_s: float):
        """The next message for the caller, or None after `timeout_s` (at most a heartbeat)."""
        self._check_refused()
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.send(Heartbeat(self.boot_id))
            self.next_heartbeat = now + self.settings.heartbeat_s
        wait_s = min(timeout_s, max(0.0, self.next_heartbeat - now))
        if self.sock not in dict(self.poller.poll(int(wait_s * 1000))):
            return None
        message = codec.decode(self.sock.recv())
        if isinstance(message, (Hello, Heartbeat)):
            if message.boot_id != self.scheduler_boot:
                self.log.info(f"{self.role}.scheduler_met", scheduler_boot_id=message.boot_id,
                              restarted=self.scheduler_boot is not None)
                self._greet()
                self.scheduler_boot = message.boot_id
            return None
        return message

    def close(self) -> None:
        if self.refusals is not None:
            self.sock.disable_monitor()
            self.refusals.close(0)
            self.refusals = None
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()


class GroupKeyRefused(SettingsError):
    """The scheduler's TCP endpoint refused this host's group key (docs/design.md "Pages per
    rank")."""
