"""Worker groups: mlx.launch's hostfile, which entries are this machine, and the environment a
rank needs for `mx.distributed.init` (docs/design/worker-groups.md "Worker groups").

We start ranks ourselves (no mlx.launch at run time), so this writes what mlx.launch would: for
the ring backend a JSON list per rank of "ip:port" (ports counted up from --dist-port, one per
ip), pointed to by MLX_HOSTFILE, and MLX_RANK. Pure: no MLX, no sockets except `is_local`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("ring", "jaccl", "mpi")
PARALLEL_MODES = ("tensor", "pipeline")


class HostfileError(ValueError):
    """The hostfile cannot be used; the message says why."""


@dataclass(frozen=True)
class HostEntry:
    rank: int
    ssh: str
    ips: tuple[str, ...]
    rdma: tuple = ()


@dataclass(frozen=True)
class Hostfile:
    hosts: tuple[HostEntry, ...]
    backend: str = ""
    envs: tuple[str, ...] = field(default=())

    @property
    def size(self) -> int:
        return len(self.hosts)


def parse_hostfile(text: str, source: str = "hostfile") -> Hostfile:
    """mlx.launch's two forms: `[{"ssh": ..., "ips": [...]}, ...]` or
    `{"backend": ..., "envs": [...], "hosts": [...]}`."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise HostfileError(f"{source}: not JSON ({exc})") from None
    backend, envs = "", []
    if isinstance(data, dict):
        backend, envs = data.get("backend", ""), data.get("envs", [])
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise HostfileError(f"{source}: expected a non-empty list of hosts "
                            '([{"ssh": "mac1", "ips": ["10.0.0.1"]}, ...])')
    if backend and backend not in BACKENDS:
        raise HostfileError(f"{source}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError(f'{source}: "envs" must be a list of "NAME=value" strings')
    hosts = []
    for rank, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh", ""), str):
            raise HostfileError(f"{source}: host {rank} must be an object with \"ssh\" and \"ips\"")
        ips = entry.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(ip, str) and ip for ip in ips):
            raise HostfileError(f"{source}: host {rank}: \"ips\" must be a list of addresses")
        hosts.append(HostEntry(rank, entry.get("ssh") or (ips[0] if ips else ""), tuple(ips),
                               tuple(entry.get("rdma", []) or ())))
    return Hostfile(tuple(hosts), backend, tuple(envs))


def read_hostfile(path: str | Path) -> Hostfile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostfileError(f"--hostfile {path}: {exc.strerror}") from None
    hostfile = parse_hostfile(text, f"--hostfile {path}")
    if hostfile.size < 2:
        raise HostfileError(f"--hostfile {path} lists one host: a worker group needs two or "
                            f"more; for one machine, serve without --hostfile")
    return hostfile


def is_local(entry: HostEntry, can_bind=None) -> bool:
    """An entry is this machine when one of its ips can be bound here (loopback always)."""
    can_bind = can_bind or _can_bind
    return any(ip.startswith("127.") or ip == "::1" or can_bind(ip) for ip in entry.ips)


def local_ranks(hostfile: Hostfile, can_bind=None) -> list[int]:
    return [h.rank for h in hostfile.hosts if is_local(h, can_bind)]


def _can_bind(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
        return True
    except OSError:
        return False


def ring_hosts(hostfile: Hostfile, first_port: int) -> list[list[str]]:
    """The ring hostfile mlx.launch writes: per rank, "ip:port" for each of its ips, the ports
    counted up from `first_port` across all ranks."""
    port, ring = first_port, []
    for host in hostfile.hosts:
        if not host.ips:
            raise HostfileError(f"the ring backend needs ips for host {host.rank} ({host.ssh})")
        node = []
        for ip in host.ips:
            node.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
            port += 1
        ring.append(node)
    return ring


def rank_environment(hostfile: Hostfile, backend: str, rank: int, first_port: int,
                     runtime_dir: Path) -> dict[str, str]:
    """The environment variables mlx.launch would give rank `rank` (files it points to are
    written into `runtime_dir`)."""
    env = dict(e.split("=", 1) for e in hostfile.envs)
    env["MLX_RANK"] = str(rank)
    if backend == "ring":
        env["MLX_HOSTFILE"] = str(_write(runtime_dir / f"ring-hosts.{rank}.json",
                                         json.dumps(ring_hosts(hostfile, first_port))))
    elif backend == "jaccl":
        first = hostfile.hosts[0]
        if not first.ips:
            raise HostfileError("the jaccl backend needs an ip for host 0 (the coordinator)")
        env["MLX_JACCL_COORDINATOR"] = f"{first.ips[0]}:{first_port}"
        env["MLX_IBV_DEVICES"] = str(_write(runtime_dir / f"ibv-devices.{rank}.json",
                                            json.dumps([list(h.rdma) for h in hostfile.hosts])))
    elif backend == "mpi":
        # MPI ranks exist only when mpirun starts them; we start ranks ourselves.
        raise HostfileError("--backend mpi needs mpirun to start the ranks, and Switchyard "
                            "starts them itself: use --backend ring (TCP, e.g. over a "
                            "Thunderbolt bridge) or jaccl")
    else:
        raise HostfileError(f"unknown backend {backend!r}")
    return env


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def layout_tag(parallel: str, size: int, rank: int) -> str:
    """The page-namespace part of a rank's share, e.g. "tp2r1" (docs/design/worker-groups.md "Worker groups")."""
    return f"{'tp' if parallel == 'tensor' else 'pp'}{size}r{rank}"
