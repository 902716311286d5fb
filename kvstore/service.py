"""The kvstore checkpoint daemon: owns page files and their index (pages come with issue 3).

It chooses nothing: it answers `DescribeInventory` with what is on disk, greets every
scheduler incarnation it meets, and sends heartbeats.
"""

from __future__ import annotations

import os
import signal
import time

import zmq

from proto import codec
from proto.endpoints import Endpoints, ensure_runtime_dir
from proto.ids import new_boot_id
from proto.logs import configure_logging
from proto.messages import (
    PROTOCOL_VERSION,
    ROLE_KVSTORE,
    DescribeInventory,
    Heartbeat,
    Hello,
    InventoryDescribed,
)
from proto.settings import Settings
from proto.sockets import connect_dealer, send


class _Stop:
    requested = False

    def __call__(self, *_):
        self.requested = True


def run(settings: Settings) -> None:
    boot_id = new_boot_id()
    log = configure_logging(ROLE_KVSTORE, boot_id, settings.log_level, settings.log_format,
                            settings.log_content)
    kv_dir = settings.kv_path
    kv_dir.mkdir(parents=True, exist_ok=True)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    endpoints = Endpoints(ensure_runtime_dir(settings.runtime_path))
    ctx = zmq.Context()
    sock = connect_dealer(ctx, endpoints.scheduler, ROLE_KVSTORE.encode())
    hello = Hello(PROTOCOL_VERSION, boot_id, ROLE_KVSTORE, os.getpid())
    send(sock, hello)
    log.info("kvstore.started", kv_dir=str(kv_dir))
    scheduler_boot = None
    next_heartbeat = 0.0
    try:
        while not stop.requested:
            now = time.monotonic()
            if now >= next_heartbeat:
                send(sock, Heartbeat(boot_id))
                next_heartbeat = now + settings.heartbeat_s
            if not sock.poll(int(settings.heartbeat_s * 1000)):
                continue
            msg = codec.decode(sock.recv())
            if isinstance(msg, DescribeInventory):
                scan_started = time.perf_counter()
                send(sock, InventoryDescribed(boot_id, (), time.perf_counter() - scan_started))
            elif isinstance(msg, (Hello, Heartbeat)) and msg.boot_id != scheduler_boot:
                log.info("kvstore.scheduler_met", scheduler_boot_id=msg.boot_id,
                         restarted=scheduler_boot is not None)
                send(sock, hello)
                scheduler_boot = msg.boot_id
    finally:
        sock.close(0)
        ctx.term()
        log.info("kvstore.stopped")
