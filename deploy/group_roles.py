"""Which children a supervisor starts for a worker group (docs/design/worker-groups.md "Worker groups").

`switchyard serve --hostfile F` starts, besides scheduler and gateway, a worker rank (and its
kvstore) for every hostfile entry that is this machine: children `worker` / `kvstore` for rank
0, `worker.R` / `kvstore.R` for rank R > 0 (pid files alike). `switchyard rank --rank R` runs
rank R's children alone on another host. The worker ranks of one machine are restarted together.
"""

from __future__ import annotations

from switchyard.common.hostfile import HostfileError, local_ranks, read_hostfile
from switchyard.common.settings import Settings

BASE_ROLES = ("scheduler", "kvstore", "worker", "gateway")

def role_name(base: str, rank: int) -> str:
    return base if rank == 0 else f"{base}.{rank}"


def split_role(role: str) -> tuple[str, int]:
    """"worker.2" -> ("worker", 2); "worker" -> ("worker", 0)."""
    base, _, rank = role.partition(".")
    if base not in BASE_ROLES or (rank and not rank.isdigit()):
        raise ValueError(f"not a component: {role!r}")
    return base, int(rank or 0)


def serve_roles(settings: Settings, can_bind=None) -> tuple[str, ...]:
    """Children of `switchyard serve`, in start order (stop order is reversed: rank 0's worker
    stops before the other ranks, so it can tell them to stop)."""
    if not settings.hostfile:
        return BASE_ROLES
    hostfile = read_hostfile(settings.hostfile)
    local = local_ranks(hostfile, can_bind)
    if 0 not in local:
        raise HostfileError(
            f"--hostfile {settings.hostfile}: rank 0 ({hostfile.hosts[0].ssh}) is not this "
            f"machine; run `switchyard serve` there, and `switchyard rank` on the other hosts")
    others = [r for r in local if r]
    # One kvstore per rank (`run kvstore --rank R`: identity `kvstore.R`, its own page
    # directory), one page store to the scheduler (docs/design/worker-groups.md "Pages per rank").
    kvstores = ["kvstore", *(role_name("kvstore", r) for r in others)]
    workers = [*(role_name("worker", r) for r in others), "worker"]
    return ("scheduler", *kvstores, *workers, "gateway")


def rank_roles(settings: Settings) -> tuple[str, ...]:
    """Children of `switchyard rank --rank R` (R > 0) on another host."""
    if not settings.hostfile:
        raise HostfileError("switchyard rank needs --hostfile")
    hostfile = read_hostfile(settings.hostfile)
    if not 0 < settings.rank < hostfile.size:
        raise HostfileError(f"--rank must be 1..{hostfile.size - 1} for {settings.hostfile} "
                            f"(rank 0 runs `switchyard serve`)")
    return (role_name("kvstore", settings.rank), role_name("worker", settings.rank))


def restarted_together(roles: tuple[str, ...]) -> tuple[str, ...]:
    """The worker ranks among `roles`: when one exits, a collective fails on the others."""
    workers = tuple(r for r in roles if split_role(r)[0] == "worker")
    return workers if len(workers) > 1 else ()
