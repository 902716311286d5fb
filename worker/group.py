"""A worker group: N ranks of the worker over one `mx.distributed` group (
docs/design/worker-groups.md "Worker groups").

Rank 0 alone talks to the scheduler. It broadcasts every RunStep's encoded bytes through the
group itself (one all_sum of a frame of kind, length and the payload's head, to which the other
ranks add zeros; a second for a long payload's rest), a ping at each idle heartbeat (so a lost rank is found while idle: the
collective raises), and a stop on shutdown. Every rank executes every step on its share. Rank 0
samples; `share_tokens` puts the tokens through one all_sum inside the lazy graph, so all ranks
feed the same token and a pipelined burst still overlaps.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from switchyard.common.hostfile import Hostfile, HostfileError, rank_environment

# What rank 0 broadcasts (the header's first word).
STEP, PING, STOP = 1, 2, 3
KINDS = (STEP, PING, STOP)

# While idle, rank 0 meets the other ranks in a PING every IDLE_TICK_S and they sleep between
# ticks: a rank blocked in a ring collective spins a whole core (measured here: 8.0 s of CPU
# for an 8 s wait), so an idle group would burn a core on every other rank. The price: the
# first step after an idle spell waits at most one tick for the other ranks to wake.
IDLE_TICK_S = 0.05


class GroupError(RuntimeError):
    """The group cannot be formed or a collective failed (a peer was lost)."""


# One collective carries the header and up to this many payload bytes (a decode step's
# RunStep is a few hundred bytes); a longer payload's rest follows in a second one.
FRAME_BYTES = 4096
_HEADER = 8  # int32 kind, int32 length


def encode_frame(kind: int, payload: bytes) -> tuple[np.ndarray, bytes]:
    """The first collective's bytes (header, then the payload's head), and the rest."""
    if kind not in KINDS or len(payload) >= 2**31:
        raise ValueError(f"bad frame: kind {kind}, length {len(payload)}")
    frame = np.zeros(FRAME_BYTES, np.uint8)
    frame[:_HEADER] = np.array([kind, len(payload)], "<i4").view(np.uint8)
    head = payload[:FRAME_BYTES - _HEADER]
    frame[_HEADER:_HEADER + len(head)] = np.frombuffer(head, np.uint8)
    return frame, payload[len(head):]


def decode_frame(frame: np.ndarray) -> tuple[int, int, bytes]:
    """(kind, payload length, the payload's head) from a received frame."""
    kind, length = (int(x) for x in np.asarray(frame[:_HEADER], np.uint8).view("<i4"))
    if kind not in KINDS or length < 0:
        raise GroupError(f"corrupt broadcast frame {kind, length}: the ranks are out of step")
    return kind, length, np.asarray(frame, np.uint8)[_HEADER:_HEADER + length].tobytes()


class GroupMismatch(ValueError):
    """The ranks were started with settings that must agree but do not (exit 2)."""


def mismatch(values: list[dict], hosts: list[str]) -> str:
    """'' when every rank's `values` agree, else a line naming what differs where."""
    keys = sorted({k for v in values for k in v if any(w.get(k) != v.get(k) for w in values)})
    if not keys:
        return ""
    ranks = "; ".join(f"rank {r} ({hosts[r]}): " + ", ".join(f"{k} {v.get(k)}" for k in keys)
                      for r, v in enumerate(values))
    return f"the worker group's ranks disagree on {', '.join(keys)} ({ranks}); start every " \
           f"rank with the same model and settings"


def resolve_backend(setting: str, hostfile: Hostfile) -> str:
    return setting or hostfile.backend or "ring"


@dataclass
class CommStats:
    """Time spent in the group's own collectives (broadcasts), for the step log and the bench."""
    broadcast_s: float = 0.0
    num_broadcasts: int = 0

    def take(self) -> tuple[float, int]:
        taken = (self.broadcast_s, self.num_broadcasts)
        self.broadcast_s, self.num_broadcasts = 0.0, 0
        return taken


class RankGroup:
    def __init__(self, group, hostfile: Hostfile, parallel: str) -> None:
        self.group = group
        self.hostfile = hostfile
        self.parallel = parallel
        self.rank = group.rank()
        self.size = group.size()
        self.stats = CommStats()

    @classmethod
    def join(cls, hostfile: Hostfile, rank: int, backend: str, parallel: str,
             first_port: int, runtime_dir: Path) -> "RankGroup":
        """Set the environment mlx.launch would and initialize the group (blocks until every
        rank has joined)."""
        if not 0 <= rank < hostfile.size:
            raise HostfileError(f"--rank {rank} is not in the hostfile (ranks 0..{hostfile.size - 1})")
        os.environ.update(rank_environment(hostfile, backend, rank, first_port, runtime_dir))
        try:
            group = mx.distributed.init(backend=backend, strict=True)
        except RuntimeError as exc:
            raise GroupError(f"cannot join the {backend} group as rank {rank}: {exc}") from exc
        if group.size() != hostfile.size or group.rank() != rank:
            raise GroupError(f"the {backend} group has rank {group.rank()} of {group.size()}; "
                             f"expected {rank} of {hostfile.size}")
        return cls(group, hostfile, parallel)

    @property
    def host(self) -> str:
        return self.hostfile.hosts[self.rank].ssh

    # -- collectives ---------------------------------------------------------------------------

    def _from(self, source: int, array: mx.array) -> mx.array:
        """`array` of rank `source` on every rank (the others add zeros of its shape)."""
        mine = array if self.rank == source else mx.zeros(array.shape, dtype=array.dtype)
        return mx.distributed.all_sum(mine, group=self.group)

    def _eval(self, array: mx.array) -> np.ndarray:
        try:
            return np.array(array)
        except RuntimeError as exc:  # "[ring] connection to a peer was lost"
            raise GroupError(f"rank {self.rank}: a collective failed: {exc}") from exc

    def broadcast_bytes(self, source: int, payload: bytes | None, kind: int = STEP
                        ) -> tuple[int, bytes]:
        """`source` sends (kind, payload); every rank returns them. Others pass payload None.
        One all_sum for up to FRAME_BYTES, a second for a longer payload's rest."""
        started = time.perf_counter()
        mine = self.rank == source
        frame, rest = encode_frame(kind, payload) if mine else (np.zeros(FRAME_BYTES, np.uint8),
                                                                b"")
        kind, length, data = decode_frame(self._eval(self._from(source, mx.array(frame))))
        if length > len(data):
            tail = (np.frombuffer(rest, np.uint8) if mine
                    else np.zeros(length - len(data), np.uint8))
            data += self._eval(self._from(source, mx.array(tail))).tobytes()
        self.stats.broadcast_s += time.perf_counter() - started
        self.stats.num_broadcasts += 1
        return kind, data

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: a step, ping or stop for every other rank."""
        self.broadcast_bytes(0, payload, kind)

    def receive(self) -> tuple[int, bytes]:
        """Ranks > 0: the next thing rank 0 sent (blocks)."""
        return self.broadcast_bytes(0, None)

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order, on every rank."""
        return [self.broadcast_bytes(r, payload if r == self.rank else None)[1]
                for r in range(self.size)]

    def check_same(self, values: dict) -> None:
        """Raise GroupMismatch (on every rank alike) unless all ranks pass equal `values`."""
        mine = json.dumps(values, sort_keys=True).encode()
        gathered = [json.loads(b) for b in self.gather_bytes(mine)]
        problem = mismatch(gathered, [h.ssh for h in self.hostfile.hosts])
        if problem:
            raise GroupMismatch(problem)

    def all_max(self, value: int) -> int:
        values = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=self.group)
        return int(self._eval(values).max())

    def share_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled tokens on every rank, lazily (one all_sum in the graph). The other
        ranks add `tokens * 0`, not fresh zeros: their all_sum must depend on their own forward
        pass, or it would run before the forward pass's collectives and the ranks deadlock."""
        mine = tokens if self.rank == 0 else tokens * 0
        return mx.distributed.all_sum(mine, group=self.group)

    def time_all_sum(self, width: int, repeats: int = 50) -> float:
        """Median seconds of one all_sum of `width` floats (a hidden vector), for the start-up
        log and bench/distributed.py (the median: on a loaded machine a collective waits
        whenever a peer is not scheduled). Every rank must call it at the same point."""
        x = mx.ones((1, width), dtype=mx.float32)
        self._eval(mx.distributed.all_sum(x, group=self.group))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            self._eval(mx.distributed.all_sum(x, group=self.group))
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]
