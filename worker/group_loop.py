"""A worker group's part of serving (docs/design/worker-groups.md "Worker groups"): rank 0's share of each
step (`GroupLead`: broadcast it, run it, the idle PING, the STOP), the other ranks' loop
(`follow`), what the ranks exchange once they are ready (`gather_ranks`, `log_comm_probe`), and
the watchdog that ends a rank whose collective outlasts --group-timeout-s (`start_watchdog`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import msgspec

from switchyard.proto.codec import decode, encode
from switchyard.proto.scheduler_worker import RankInfo, RunStep, StepDone
from switchyard.proto.service_loop import StopFlag
from switchyard.worker.executor import StepExecutor
from switchyard.worker.group import IDLE_TICK_S, PING, STEP, STOP, GroupError, RankGroup
from switchyard.worker.model_loading import LoadedModel
from switchyard.worker.page_io import PageLayout
from switchyard.worker.watchdog import CollectiveWatch


def start_watchdog(group: RankGroup, limit_s: float, log,
                   before_exit: Callable[[], None]) -> CollectiveWatch:
    """Watch this rank's collectives from here on. An overdue one logs `group.peer_timeout`,
    runs `before_exit` (removing what a restart would otherwise find stale) and exits 1, so
    the supervisor restarts this machine's ranks, which then wait for the lost peer as at
    start-up (docs/design/worker-groups.md "Worker groups", "Failures")."""
    hosts = [h.ssh for h in group.hostfile.hosts]

    def timed_out(operation: str, waited_s: float) -> None:
        log.error("group.peer_timeout", operation=operation, waited_s=round(waited_s, 1),
                  limit_s=limit_s, hosts=hosts,
                  reason=f"{operation} waited {waited_s:.1f} s for the group's other ranks "
                         f"(--group-timeout-s {limit_s:g}): a peer stopped answering without "
                         f"closing its connection (powered off, frozen, cable pulled); this "
                         f"rank exits so the group restarts")
        try:
            before_exit()
        finally:
            sys.stderr.flush()
            os._exit(1)  # the serving thread is blocked in MLX: it cannot be unwound

    watch = CollectiveWatch(limit_s)
    watch.start(timed_out)
    return watch


class GroupLead:
    """Rank 0's part of the group in the worker's loop: every step goes to the other ranks
    before rank 0 runs it; while idle a PING every IDLE_TICK_S (it also finds a lost rank);
    a STOP at the end."""

    tick_s = IDLE_TICK_S

    def __init__(self, group: RankGroup, executor: StepExecutor,
                 watch: CollectiveWatch) -> None:
        self.group = group
        self.executor = executor
        self.watch = watch

    def run(self, step: RunStep) -> StepDone:
        with self.watch.watching(f"broadcast of step {step.step}"):
            self.group.send(STEP, encode(step))
        with self.watch.watching(f"step {step.step}"):
            return self.executor.run(step)

    def step_fields(self) -> dict:
        """The step's own broadcast time, for its `step.done` line."""
        comm_s, _ = self.group.stats.take()
        return {"broadcast_ms": round(comm_s * 1e3, 3)}

    def idle(self) -> None:
        with self.watch.watching("ping"):
            self.group.send(PING)
        self.group.stats.take()  # idle ticks are not a step's communication

    def stop(self) -> None:
        try:
            with self.watch.watching("stop"):
                self.group.send(STOP)
        except (GroupError, RuntimeError):
            pass  # a peer already gone: nothing to stop


def follow(group: RankGroup, executor: StepExecutor, stop: StopFlag, log,
           watch: CollectiveWatch) -> None:
    """Ranks > 0: execute every step rank 0 broadcasts, on this rank's share."""
    while True:
        with watch.watching("waiting for rank 0's next broadcast"):
            kind, payload = group.receive()
        if kind == STOP:
            log.info("worker.group_stopped")
            return
        if kind == STEP:
            step = decode(payload)
            with watch.watching(f"step {step.step}"):
                executor.run(step)
        elif kind == PING:  # idle: sleep until just before rank 0's next tick, not spin
            time.sleep(IDLE_TICK_S - 0.002)
        if stop.requested:  # a stop signal while rank 0 runs: the group restarts without us
            return


def gather_ranks(group: RankGroup, namespace: bytes, pool, loaded: LoadedModel,
                 layout: PageLayout | None, watch: CollectiveWatch) -> tuple[RankInfo, ...]:
    mine = RankInfo(rank=group.rank, host=group.host, namespace=namespace,
                    shm_name=pool.name if pool else "",
                    num_buffers=pool.num_buffers if pool else 0,
                    buffer_bytes=pool.buffer_bytes if pool else 0,
                    kv_bytes_per_token=loaded.kv_bytes_per_token,
                    state_bytes=layout.state_bytes if layout else 0)
    with watch.watching("gather of the ranks' pools"):
        return tuple(msgspec.msgpack.decode(b, type=RankInfo)
                     for b in group.gather_bytes(msgspec.msgpack.encode(mine)))


def log_comm_probe(group: RankGroup, loaded: LoadedModel, log, watch: CollectiveWatch) -> None:
    """Measured once at start on every rank: one all_sum of a hidden vector (what tensor
    parallelism pays twice per layer per token) and of one token (the token share)."""
    text_cfg = loaded.config.get("text_config", loaded.config)
    hidden = int(text_cfg.get("hidden_size", 0)) or 1
    with watch.watching("all_sum probe"):
        hidden_s, token_s = group.time_all_sum(hidden), group.time_all_sum(1)
    log.info("worker.group_ready", size=group.size, parallel=group.parallel,
             all_sum_hidden_us=round(hidden_s * 1e6, 1),
             all_sum_token_us=round(token_s * 1e6, 1), hidden=hidden)
