"""What launchd and systemd units share: the command line and environment of each component.

    plan = unit_plan(settings, label_suffix="b")   # I/O: venv, checkout, OpenBLAS, home dir
    program_arguments(plan, "worker")              # pure from here on
    environment(plan, "worker")

Every component runs as `switchyard run ROLE <settings flags>` from the virtual environment
that renders the units (its `switchyard` script, or `python -m switchyard.deploy.cli` in a source
checkout that is not installed). The flags are the settings that differ from the defaults,
with the runtime, KV and cache directories made absolute, so all four components agree on them
whatever environment the service manager gives them. `--config` files are read at render time:
re-render (install again) after changing one.

The API key is never in a unit: the gateway alone reads it from a file (`--api-key-file`, mode
0600; under systemd through `LoadCredential=`). A key given inline when installing is written
to `key_file_path(home, suffix)` first (docs/design/security.md "Security").
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from switchyard.deploy.group_roles import rank_roles, serve_roles, split_role
from switchyard.deploy.resolve import with_concrete_paths
from switchyard.deploy.supervisor import ROLES  # noqa: F401  (start order; re-exported)
from switchyard.common.settings import GATEWAY_ONLY, SECRET_FIELDS, Settings, flag_args

_SUFFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")


class UnitError(ValueError):
    """Bad arguments for rendering units (exit 2)."""


@dataclass(frozen=True)
class UnitPlan:
    """Everything the unit files depend on, resolved; rendering is a pure function of it."""

    settings: Settings  # directories absolute
    command: tuple[str, ...]  # `switchyard`, or python -m switchyard.deploy.cli
    working_dir: str
    home: str
    label_suffix: str = ""
    env: tuple[tuple[str, str], ...] = ()  # every component
    worker_env: tuple[tuple[str, str], ...] = ()  # the worker only (LD_PRELOAD of OpenBLAS)
    api_key_file: str = ""  # absolute; the gateway reads its key here ("" : no key)
    api_key: str = ""  # a key given inline, written to api_key_file at install ("" : none)
    # The components this host runs: all four, plus `worker.R` for a worker group's other
    # local ranks; on a worker group's other host, its rank's `worker.R` alone.
    roles: tuple[str, ...] = ROLES


def check_suffix(suffix: str) -> str:
    if suffix and not _SUFFIX_RE.fullmatch(suffix):
        raise UnitError(f"--label-suffix {suffix!r}: use up to 32 letters, digits, '-' or '_'")
    return suffix


def check_second_group(settings: Settings, suffix: str) -> None:
    """A second group's units must not share the first one's runtime directory."""
    if suffix and not settings.runtime_dir:
        raise UnitError("a second group (--label-suffix) needs its own --runtime-dir, and "
                        "usually its own --port and --kv-dir")


def settings_flags(settings: Settings, role: str = "gateway") -> list[str]:
    """Flags for the settings that differ from the defaults, in schema order; never the API
    key, and the HTTP address only for the gateway."""
    defaults = Settings()
    args: list[str] = []
    for f in dataclasses.fields(settings):
        if f.name in SECRET_FIELDS or (role != "gateway" and f.name in GATEWAY_ONLY):
            continue
        value = getattr(settings, f.name)
        if value != getattr(defaults, f.name):
            args += flag_args(f.name, value)
    return args


def program_arguments(plan: UnitPlan, role: str, key_file: str | None = None) -> list[str]:
    """The component's argv; the gateway's names its key file (`key_file`, by default the
    plan's: systemd passes its credentials directory instead)."""
    base, rank = split_role(role)
    settings = plan.settings
    if settings.hostfile:  # a worker group's rank: `run worker --rank R`
        settings = dataclasses.replace(settings, rank=rank)
    argv = [*plan.command, "run", base, *settings_flags(settings, base)]
    if role == "gateway" and plan.api_key_file:
        argv += ["--api-key-file", key_file or plan.api_key_file]
    return argv


def key_file_path(home: str, suffix: str = "") -> Path:
    """Where an inline --api-key is kept for the units: ~/.config/switchyard/api-key[-S]."""
    return Path(home) / ".config" / "switchyard" / ("api-key" + (f"-{suffix}" if suffix else ""))


def write_key_file(path: Path, key: str) -> None:
    """The key, mode 0600, in a directory only we can enter (created 0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    os.replace(tmp, path)


def environment(plan: UnitPlan, role: str) -> dict[str, str]:
    env = dict(plan.env)
    if split_role(role)[0] == "worker":
        env.update(plan.worker_env)
    return env


def describe(role: str) -> str:
    base, rank = split_role(role)
    return {
        "gateway": "HTTP gateway (OpenAI API)",
        "scheduler": "scheduler (admission, slots, KV page index)",
        "worker": "model worker (MLX, slot KV memory)",
        "kvstore": "KV page store daemon",
    }[base] + (f", rank {rank} of a worker group" if rank else "")


def unit_roles(settings: Settings) -> tuple[str, ...]:
    """The components whose units this host gets (docs/design/worker-groups.md "Worker groups")."""
    if not settings.hostfile:
        return ROLES
    return rank_roles(settings) if settings.rank else serve_roles(settings)


# -- resolution (I/O) ---------------------------------------------------------------------------

def project_root() -> Path | None:
    """The source checkout this code runs from, if it is one."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").exists() else None


def launcher(python: str | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command that starts `switchyard`, and the environment it needs.

    The venv's interpreter path is kept as it is (not resolved): a venv's python is a symlink
    and resolving it would leave the venv."""
    python = python or sys.executable
    script = Path(python).parent / "switchyard"
    if script.exists():
        return (str(script),), {}
    return (python, "-m", "switchyard.deploy.cli"), {}


def unit_plan(settings: Settings, *, label_suffix: str = "", extra_env: dict[str, str] | None = None,
              python: str | None = None, home: str | None = None,
              openblas: Path | None = None, linux: bool | None = None) -> UnitPlan:
    from switchyard.deploy.blas import THREAD_TIMEOUT, openblas_path

    command, env = launcher(python)
    env = {"PYTHONUNBUFFERED": "1", **env, **(extra_env or {})}
    linux = sys.platform.startswith("linux") if linux is None else linux
    worker_env = {}
    lib = openblas if openblas is not None else (openblas_path() if linux else None)
    if linux and lib is not None:
        worker_env["LD_PRELOAD"] = str(lib)
        name, value = THREAD_TIMEOUT
        if name not in env:  # an operator's --env value stands
            worker_env[name] = value
    home = home or str(Path.home())
    root = project_root()
    suffix = check_suffix(label_suffix)
    key_file, inline_key = "", ""
    if settings.api_key_file:
        key_file = str(Path(settings.api_key_file).expanduser().absolute())
    elif settings.api_key:
        key_file, inline_key = str(key_file_path(home, suffix)), settings.api_key
    try:
        roles = unit_roles(settings)
    except ValueError as exc:  # HostfileError
        raise UnitError(str(exc)) from None
    return UnitPlan(settings=with_concrete_paths(settings), command=command, roles=roles,
                    working_dir=str(root) if root else home, home=home,
                    label_suffix=suffix, env=tuple(env.items()),
                    worker_env=tuple(worker_env.items()), api_key_file=key_file,
                    api_key=inline_key)


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    env = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UnitError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def write_files(files: dict[str, str], directory: Path) -> list[Path]:
    """Write rendered files (mode 0600: the flags may hold --api-key)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = directory / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
        written.append(path)
    return written
