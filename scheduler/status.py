"""The status document the scheduler rewrites every heartbeat (runtime_dir/status.json): built
here from the shell's view (peers, readiness), the core's snapshot, the ranks and the counters.
Its types, writer and the one reader are proto/status.py."""

from __future__ import annotations

import os

from switchyard.proto.status import STATUS_VERSION, PeerStatus, Status


def build_status(service, now: float) -> Status:
    core = service.core.snapshot(now)
    return Status(
        version=STATUS_VERSION, at=now, boot_id=service.boot_id, pid=os.getpid(),
        started_at=service.started_at, worker_ready=service.worker_ready,
        kvstore_ready=service.kvstore_ready,
        peers={role: PeerStatus(boot_id=boot, pid=service.peer_pid.get(role),
                                last_seen=service.last_seen.get(role))
               for role, boot in service.peer_boot.items()},
        slots=core.slots, queue=core.queue, oldest_waiting_s=core.oldest_waiting_s,
        disk=core.disk,
        # A worker group: every rank, its pool and its kvstore (docs/design/worker-groups.md "Pages per rank").
        ranks=service.stores.rank_status(now, service.last_seen,
                                         service.settings.peer_timeout_s),
        stats=service.stats.snapshot(),
        speculation=core.speculation, prefill_share=core.prefill_share,
        kv_memory=core.kv_memory, peer_servers=core.peer_servers or [],
    )
