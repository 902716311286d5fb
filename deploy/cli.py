"""The `switchyard` command.

    switchyard serve [settings flags]          the whole group under one supervisor
    switchyard run ROLE [settings flags]       one component in the foreground (launchd/systemd,
                                               and what `serve` starts for each child)
    switchyard rank --hostfile F --rank R ...  rank R of a worker group on another host (its
                                               worker, under a supervisor of its own)
    switchyard status [--json]                 slots, queue, disk cache, components (deploy.status)
    switchyard group-key --out PATH            a new key file for --group-key-file (mode 0600)
    switchyard launchd|systemd ACTION          service units per component (deploy.service_cli)

Settings come from common.settings (defaults < --config TOML < flags). Exit codes: 0 after a stop
signal, 1 when a component kept crashing (or crashed, for `run`), 2 for bad settings or usage
(for `serve`: also when a component refused to start), 3 when another group already runs in the
runtime directory.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

from switchyard.deploy import service_cli
from switchyard.deploy import status as status_cli
from switchyard.deploy.cache_cli import add_cache_parser, run_cache
from switchyard.deploy.default_model import TINY, TINY_TERSE, DefaultModelUnavailable
from switchyard.deploy.resolve import with_concrete_paths, with_model
from switchyard.deploy.supervisor import ROLES, Supervisor
from switchyard.common.endpoints import Endpoints, RuntimeDirError
from switchyard.common.secret_keys import SecretKeyError
from switchyard.common.settings import (
    Settings,
    SettingsError,
    add_arguments,
    format_size,
    from_namespace,
)

EXIT_GAVE_UP = 1
EXIT_USAGE = 2
EXIT_GROUP_RUNNING = 3


ServiceRun = Callable[[Settings], None]
ROLES_WITH_MODEL = ("gateway", "worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchyard", description="A local LLM server for agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="start the whole server (gateway, scheduler, worker, "
                                         "kvstore) under one supervisor")
    add_arguments(serve)
    rank = sub.add_parser("rank", help="run rank --rank of a worker group (--hostfile) on "
                                       "this host; rank 0's host runs `serve`")
    add_arguments(rank)
    run = sub.add_parser("run", help="run one component in the foreground")
    run.add_argument("role", choices=ROLES)
    add_arguments(run)
    group_key = sub.add_parser("group-key", help="write a new key file that authenticates a "
                                                 "worker group's hosts (--group-key-file)")
    group_key.add_argument("--out", required=True, help="the file to create (mode 0600; an "
                                                        "existing file is not overwritten)")
    add_cache_parser(sub)
    status_cli.add_parser(sub)
    service_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "cache":
        return run_cache(args)
    if args.command == "group-key":
        return write_group_key_file(args.out)
    if getattr(args, "api_key", None):
        print("switchyard: warning: --api-key on a command line is visible to every local user "
              "(ps); use --api-key-file (mode 0600) or $SWITCHYARD_API_KEY", file=sys.stderr)
    try:
        settings = from_namespace(args)
    except SettingsError as exc:
        return _usage_error(str(exc))
    except TypeError as exc:  # a TOML value of the wrong type
        return _usage_error(f"invalid setting: {exc}")
    if args.command == "serve":
        return serve(settings)
    if args.command == "rank":
        return serve(settings, rank_host=True)
    if args.command == "status":
        return status_cli.main(args, settings)
    if args.command in service_cli.COMMANDS:
        return service_cli.main(args, settings)
    return run_component(args.role, settings)


def write_group_key_file(path: str) -> int:
    from switchyard.common.group_key import write_group_key

    try:
        write_group_key(path)
    except SettingsError as exc:
        return _usage_error(str(exc))
    print(f"wrote {path} (mode 0600): copy it to every host of the group (e.g. scp -p) and "
          f"give it as --group-key-file to `serve` and `rank`")
    return 0


def _usage_error(message: str) -> int:
    print(f"switchyard: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _say(message: str) -> None:
    print(f"switchyard: {message}", file=sys.stderr, flush=True)


def _no_default_model(exc: Exception) -> int:
    return _usage_error(f"no default model: {exc}. `--model tiny` serves a generated "
                        f"random-weight model (no download), or give `--model PATH`")


# -- serve ----------------------------------------------------------------------------------

def _model_note(requested: str) -> str:
    if not requested:
        return "  (the default model; `--model tiny` for a generated one, `--model PATH` for yours)"
    if requested == TINY:
        return "  (generated random-weight model: fast nonsense)"
    if requested == TINY_TERSE:
        return "  (generated random-weight model that ends its replies: short nonsense)"
    return ""


def banner(settings: Settings, requested_model: str, roles: tuple[str, ...] = ROLES) -> str:
    """`requested_model`: --model as given ('' or 'tiny' get a note), settings.model the path."""
    url = f"http://{_url_host(settings.host)}:{settings.port}/v1"
    model = settings.model + _model_note(requested_model)
    rows = [
        ("model", model),
        ("slots", f"{settings.slots} x {settings.ctx} tokens"
                  + (f"; up to {settings.auto_running} running at once, as the memory plan holds"
                     if not settings.max_running else
                     f"; {settings.worker_slots} running at once"
                     if settings.worker_slots > settings.slots else "")),
        ("HTTP", url),
        ("runtime dir", f"{settings.runtime_path}  (sockets, pid files)"),
        ("kv dir", str(settings.kv_path)),
        ("disk budget", f"{format_size(settings.kv_disk_budget_bytes)} of KV pages "
                        f"(--kv-disk-budget {settings.kv_disk_budget})"),
    ]
    if settings.draft_model:
        rows.insert(1, ("draft model", f"{settings.draft_model}  (--speculative "
                                       f"{settings.speculative})"))
    if settings.hostfile:
        workers = [r for r in roles if r.startswith("worker")]
        rows.insert(2, ("worker group", f"{settings.parallel} parallel, local ranks: "
                                        f"{', '.join(workers)}  (--hostfile {settings.hostfile})"))
    lines = [f"switchyard {_version()} serving"]
    if "gateway" not in roles:  # `switchyard rank`: this host serves no HTTP, rank 0's does
        lines = [f"switchyard {_version()} rank {settings.rank} of a worker group"]
        rows = [row for row in rows if row[0] in ("model", "worker group", "runtime dir")]
    lines += [f"  {name:<12} {value}" for name, value in rows]
    return "\n".join(lines)


def serve(settings: Settings, rank_host: bool = False) -> int:
    """The whole group; with `rank_host`, only rank --rank's children of a worker group."""
    from switchyard.deploy.group_roles import rank_roles, serve_roles
    from switchyard.deploy.runtime import GroupRunningError, RuntimeDirClaim
    from switchyard.common.hostfile import HostfileError
    from switchyard.proto.ids import new_boot_id
    from switchyard.common.logs import configure_logging

    settings = with_concrete_paths(settings)
    endpoints = Endpoints(settings.runtime_path)
    try:
        roles = rank_roles(settings) if rank_host else serve_roles(settings)
    except HostfileError as exc:
        return _usage_error(str(exc))
    try:
        endpoints.scheduler  # checks the ipc path length before any work
        claim = RuntimeDirClaim(endpoints, roles).acquire()
    except GroupRunningError as exc:
        print(f"switchyard: error: {exc}", file=sys.stderr)
        return EXIT_GROUP_RUNNING
    except RuntimeDirError as exc:
        return _usage_error(str(exc))
    try:
        requested_model = settings.model
        try:
            _private_cache_dir(settings, roles)
        except SecretKeyError as exc:
            return _usage_error(str(exc))
        try:
            settings = with_model(settings, announce=_say)
        except DefaultModelUnavailable as exc:
            return _no_default_model(exc)
        log = configure_logging("supervisor", new_boot_id(), settings.log_level,
                                settings.log_format, settings.log_content)
        print(banner(settings, requested_model, roles), flush=True)
        log.info("group.starting", model=settings.model, slots=settings.slots, ctx=settings.ctx,
                 host=settings.host, port=settings.port,
                 runtime_dir=settings.runtime_dir, kv_dir=settings.kv_dir,
                 kv_disk_budget_bytes=settings.kv_disk_budget_bytes)
        return Supervisor(settings, claim=claim, roles=roles).run()
    finally:
        claim.release()


def _private_cache_dir(settings: Settings, roles: tuple[str, ...]) -> None:
    """The cache dir 0700 and ours, and the gateway's salt key made or refused, before any
    component starts (docs/design/security.md "Security"). SecretKeyError, naming the path, if not."""
    from switchyard.common.secret_keys import ensure_cache_dir
    from switchyard.common.tenants import load_salt_key

    ensure_cache_dir(settings.cache_path)
    if "gateway" in roles:
        load_salt_key(settings.cache_path)


# -- run ------------------------------------------------------------------------------------

def service_for(role: str) -> ServiceRun:
    return importlib.import_module(f"switchyard.{role}.service").run


def run_component(role: str, settings: Settings, service: ServiceRun | None = None) -> int:
    """Run one component until it returns (0) or raises (the exception propagates: non-zero).
    Standalone (no supervisor), it keeps its own pid file and returns 3 if another copy runs."""
    from switchyard.deploy.lifeline import parent_pid_from_env, watch_parent
    from switchyard.deploy.runtime import pid_alive, read_pid_file, remove_pid_file, write_pid_file
    from switchyard.common.endpoints import ensure_runtime_dir

    parent = parent_pid_from_env()
    if parent is not None:
        watch_parent(parent)
    settings = with_concrete_paths(settings)
    if role in ROLES_WITH_MODEL:  # the scheduler and kvstore never read it
        try:
            settings = with_model(settings, announce=_say)
        except DefaultModelUnavailable as exc:
            return _no_default_model(exc)
    if role == "worker" and service is None:
        _reexec_with_openblas(settings)
    run = service or service_for(role)
    pid_file = None
    if parent is None:  # standalone (launchd/systemd): the component keeps its own pid file
        from switchyard.deploy.group_roles import role_name

        # A worker group's rank R: `worker.R.pid`, as under a supervisor.
        named = role_name(role, settings.rank) if settings.hostfile else role
        pid_file = Endpoints(ensure_runtime_dir(settings.runtime_path)).pid_file(named)
        other = read_pid_file(pid_file)
        if other is not None and other != os.getpid() and pid_alive(other):
            print(f"switchyard: error: a {named} (pid {other}, {pid_file}) already runs in "
                  f"{settings.runtime_path}", file=sys.stderr)
            return EXIT_GROUP_RUNNING
        write_pid_file(pid_file, os.getpid())
    try:
        run(settings)
    finally:
        if pid_file is not None:
            remove_pid_file(pid_file, os.getpid())
    return 0


def _reexec_with_openblas(settings: Settings) -> None:
    """On Linux, re-execute this worker with Debian's OpenBLAS in LD_PRELOAD (once)."""
    from switchyard.deploy.blas import BLAS_PACKAGE, REEXEC_ENV, openblas_path, preload_env

    lib = openblas_path()
    if os.environ.get(REEXEC_ENV) or not sys.platform.startswith("linux"):
        return
    env = preload_env(dict(os.environ), lib) if lib is not None else None
    if lib is not None and env is None:
        return
    from switchyard.proto.ids import new_boot_id
    from switchyard.common.logs import configure_logging

    log = configure_logging("worker", new_boot_id(), settings.log_level, settings.log_format,
                            settings.log_content)
    if lib is None:
        if _mlx_runs_on_cpu():  # MLX's CUDA backend does not use the BLAS
            log.warning("worker.blas_missing", package=BLAS_PACKAGE,
                        effect="MLX's CPU matmul runs about 30x slower",
                        fix=f"sudo apt-get install {BLAS_PACKAGE}")
        return
    changed = sorted(name for name, value in env.items() if os.environ.get(name) != value)
    env = env | {REEXEC_ENV: "1"}
    log.info("worker.blas_preloaded", library=str(lib), action="re-exec", env=changed)
    argv = [sys.executable, "-m", "switchyard.deploy.cli", "run", "worker", *settings.to_args("worker")]
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def _mlx_runs_on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("switchyard")
    except Exception:  # not installed (source checkout)
        return "(source)"


if __name__ == "__main__":
    sys.exit(main())
