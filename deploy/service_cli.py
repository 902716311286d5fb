"""`switchyard launchd ...` and `switchyard systemd ...`: install the group as service units.

    switchyard launchd render [--dir DIR] [settings flags]       print (or write) the plists
    switchyard launchd install [--dry-run] [settings flags]      write to ~/Library/LaunchAgents,
                                                                 launchctl bootstrap gui/$UID
    switchyard launchd uninstall [--dry-run]                     launchctl bootout, remove files
    switchyard launchd status [COMPONENT]                        launchctl print
    switchyard launchd restart COMPONENT|all [--dry-run]         launchctl kickstart -k
    switchyard systemd render|install|uninstall|status|restart   the same with systemctl --user

    switchyard launchd|systemd install --router --worker-url URL [--worker-url URL ...]
        [--port 8000] [--smg PATH] [--model-alias NAME=SERVED]   SMG in front of the servers
        (deploy/router_unit.py); `uninstall --router`, `restart router`, `status router`

`--label-suffix S` names a second group's units (com.switchyard.<role>.S,
switchyard-S-<role>.service); give that group its own --port and --runtime-dir too. render and
--dry-run work on any system; the others exit 2 with a message where the service manager is
missing (launchctl off macOS, systemctl without systemd). A failing launchctl/systemctl
command exits 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from switchyard.common.settings import Settings, add_arguments
from switchyard.deploy import launchd, router_unit, systemd
from switchyard.deploy.service_units import (ROLES, UnitError, UnitPlan, check_second_group,
                                             check_suffix, parse_env, unit_plan, write_files,
                                             write_key_file)

EXIT_FAILED = 1
EXIT_USAGE = 2
COMMANDS = ("launchd", "systemd")
ACTIONS = ("render", "install", "uninstall", "status", "restart")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for manager, help_text in (("launchd", "macOS launchd user agents for the components"),
                               ("systemd", "systemd user units for the components (Linux)")):
        parser = sub.add_parser(manager, help=help_text, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        for action in ACTIONS:
            p = actions.add_parser(action, help=_ACTION_HELP[action])
            p.add_argument("--label-suffix", default="",
                           help="suffix of the labels/unit names, for a second group")
            if action == "restart":
                p.add_argument("component", choices=(*ROLES, router_unit.ROLE, "all"))
            if action == "status":
                p.add_argument("component", nargs="?", choices=(*ROLES, router_unit.ROLE))
            if action in ("render", "install", "uninstall"):
                p.add_argument("--router", action="store_true",
                               help="the unit of SMG (the Shepherd Model Gateway, pip install "
                               "smg) in front of the servers of --worker-url, listening on "
                               "--host and --port")
            if action in ("render", "install"):
                p.add_argument("--worker-url", action="append", metavar="URL",
                               help="with --router: a server, http://HOST:PORT (repeat for each)")
                p.add_argument("--smg", metavar="PATH", help="with --router: the smg "
                               "executable (default: smg on PATH)")
                p.add_argument("--model-alias", action="append", metavar="NAME=SERVED",
                               help="with --router: SMG routes NAME as the servers' SERVED name "
                               "(repeatable)")
                p.add_argument("--smg-arg", action="append", metavar="ARG",
                               help="with --router: one more word for `smg launch`, appended "
                               "(repeatable; --smg-arg=--policy --smg-arg=round_robin)")
            if action in ("install", "uninstall", "restart"):
                p.add_argument("--dry-run", action="store_true",
                               help="print what would be written and run; change nothing")
            if action == "render":
                p.add_argument("--dir", type=Path, help="write the files here (default: print)")
            if action in ("render", "install"):
                p.add_argument("--env", action="append", metavar="NAME=VALUE",
                               help="extra environment for every component (repeatable)")
                add_arguments(p)


_ACTION_HELP = {
    "render": "print the unit files for these settings (or write them with --dir)",
    "install": "write the unit files and load them (the group starts)",
    "uninstall": "stop and unload the units and remove their files",
    "status": "what the service manager says about each component",
    "restart": "restart one component (or all)",
}


# -- the two service managers ----------------------------------------------------------------------

@dataclass(frozen=True)
class Manager:
    name: str
    tool: str
    missing: str  # why the tool is missing, and what to do instead
    render: Callable[[UnitPlan], dict[str, str]]
    units_dir: Callable[[str], Path]
    install: Callable[[list[Path], str, tuple[str, ...]], list[list[str]]]
    uninstall: Callable[[str, tuple[str, ...]], list[list[str]]]
    restart: Callable[[str, str, tuple[str, ...]], list[list[str]]]


def _launchd_install(paths: list[Path], suffix: str,
                     roles: tuple[str, ...] = ROLES) -> list[list[str]]:
    uid = os.getuid()
    by_role = {p.name: p for p in paths}
    commands = []
    for role in roles:
        path = by_role[launchd.plist_name(role, suffix)]
        commands += [launchd.enable(uid, role, suffix), launchd.bootstrap(uid, path)]
    return commands


def _launchd_restart(component: str, suffix: str,
                     roles: tuple[str, ...] = ROLES) -> list[list[str]]:
    roles = roles if component == "all" else (component,)
    return [launchd.kickstart(os.getuid(), role, suffix) for role in roles]


def _systemd_restart(component: str, suffix: str, roles: tuple[str, ...] = ROLES
                     ) -> list[list[str]]:
    unit = systemd.target_name(suffix) if component == "all" else systemd.unit_name(component,
                                                                                      suffix)
    return [systemd.systemctl("restart", unit)]


LAUNCHD = Manager(
    name="launchd", tool="launchctl",
    missing="launchctl not found: launchd is the macOS service manager. On Linux use "
            "`switchyard systemd ...`; `switchyard launchd render` and `--dry-run` work anywhere.",
    render=launchd.render,
    units_dir=launchd.agents_dir,
    install=_launchd_install,
    uninstall=lambda suffix, roles=ROLES: [launchd.bootout(os.getuid(), role, suffix)
                                           for role in reversed(roles)],
    restart=_launchd_restart,
)

SYSTEMD = Manager(
    name="systemd", tool="systemctl",
    missing="systemctl not found: systemd user units need a Linux system running systemd. "
            "On macOS use `switchyard launchd ...`; `switchyard systemd render` and `--dry-run` "
            "work anywhere.",
    render=systemd.render,
    units_dir=systemd.units_dir,
    install=lambda paths, suffix, roles=ROLES: [
        systemd.systemctl("daemon-reload"),
        systemd.systemctl("enable", "--now", *systemd.all_units(suffix, roles))],
    uninstall=lambda suffix, roles=ROLES: [
        systemd.systemctl("disable", "--now", *systemd.all_units(suffix, roles))],
    restart=_systemd_restart,
)

MANAGERS = {"launchd": LAUNCHD, "systemd": SYSTEMD}


# -- actions (I/O) ---------------------------------------------------------------------------

def main(args: argparse.Namespace, settings: Settings) -> int:
    manager = MANAGERS[args.command]
    if getattr(args, "router", False):
        return router_main(manager, args, settings)
    try:
        suffix = args.label_suffix
        if args.action in ("render", "install"):
            check_second_group(settings, suffix)
            plan = unit_plan(settings, label_suffix=suffix, extra_env=parse_env(args.env))
        else:
            # names only (a worker group's hostfile and rank say which units this host has)
            plan = unit_plan(Settings(hostfile=settings.hostfile, rank=settings.rank),
                             label_suffix=suffix)
    except UnitError as exc:
        print(f"switchyard: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    handler = {"render": render, "install": install, "uninstall": uninstall,
               "status": status, "restart": restart}[args.action]
    return handler(manager, plan, args)


def render(manager: Manager, plan: UnitPlan, args: argparse.Namespace) -> int:
    files = manager.render(plan)
    if args.dir is None:
        _print_files(files, None)
        return 0
    for path in write_files(files, args.dir):
        print(path)
    return 0


def install(manager: Manager, plan: UnitPlan, args: argparse.Namespace) -> int:
    files = manager.render(plan)
    directory = manager.units_dir(plan.home)
    paths = [directory / name for name in files]
    commands = manager.install(paths, plan.label_suffix, plan.roles)
    if args.dry_run:
        _print_files(files, directory)
        if plan.api_key:
            print(f"would write the API key to {plan.api_key_file} (mode 0600)")
        _print_commands(commands)
        return 0
    if not _have(manager):
        return EXIT_USAGE
    if plan.api_key:  # given inline: the units name this file, never the key
        write_key_file(Path(plan.api_key_file), plan.api_key)
    if manager is LAUNCHD:
        launchd.log_dir(plan).mkdir(parents=True, exist_ok=True)
        for role in plan.roles:  # reload: an agent already loaded would make bootstrap fail
            _run(launchd.bootout(os.getuid(), role, plan.label_suffix), check=False)
    write_files(files, directory)
    if not _run_all(commands):
        return EXIT_FAILED
    where = (f"logs in {launchd.log_dir(plan)}" if manager is LAUNCHD
             else f"logs: journalctl --user -u '{systemd.target_name(plan.label_suffix)[:-7]}-*'")
    print(f"installed {len(files)} {manager.name} units into {directory}; {where}\n"
          f"status: switchyard status --runtime-dir {plan.settings.runtime_dir}")
    return 0


def router_main(manager: Manager, args: argparse.Namespace, settings: Settings) -> int:
    """render, install or uninstall the router's unit (deploy/router_unit.py)."""
    try:
        suffix = check_suffix(args.label_suffix)
        plan = None if args.action == "uninstall" else router_unit.router_plan(
            settings, args.worker_url, smg=args.smg, model_aliases=args.model_alias,
            smg_args=args.smg_arg, label_suffix=suffix)
    except UnitError as exc:
        print(f"switchyard: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    directory = manager.units_dir(str(Path.home()))
    if manager is LAUNCHD:
        name = launchd.plist_name(router_unit.ROLE, suffix)
        install_commands = router_unit.launchd_install(os.getuid(), directory / name, suffix)
        uninstall_commands = [launchd.bootout(os.getuid(), router_unit.ROLE, suffix)]
    else:
        name = systemd.unit_name(router_unit.ROLE, suffix)
        install_commands = router_unit.systemd_install(suffix)
        uninstall_commands = router_unit.systemd_uninstall(suffix)
    if args.action == "uninstall":
        if args.dry_run:
            _print_commands(uninstall_commands)
            return 0
        if not _have(manager):
            return EXIT_USAGE
        for argv in uninstall_commands:  # a unit that is not loaded is fine
            _run(argv, check=False)
        path = directory / name
        if path.exists():
            path.unlink()
            print(f"removed {path}")
        return 0
    files = (router_unit.launchd_files if manager is LAUNCHD else router_unit.systemd_files)(plan)
    if args.action == "render":
        if args.dir is None:
            _print_files(files, None)
        else:
            print("\n".join(map(str, write_files(files, args.dir))))
        return 0
    if args.dry_run:
        _print_files(files, directory)
        _print_commands(install_commands)
        return 0
    if not _have(manager):
        return EXIT_USAGE
    if manager is LAUNCHD:
        launchd.log_dir(plan).mkdir(parents=True, exist_ok=True)
        _run(uninstall_commands[0], check=False)  # reload: bootstrap fails on a loaded agent
    write_files(files, directory)
    if not _run_all(install_commands):
        return EXIT_FAILED
    where = (f"log in {launchd.log_dir(plan)}/router.log" if manager is LAUNCHD
             else f"log: journalctl --user -u {name}")
    print(f"installed {directory / name}: SMG on http://{plan.host}:{plan.port} in front of "
          f"{' '.join(plan.worker_urls)}; {where}")
    return 0


def uninstall(manager: Manager, plan: UnitPlan, args: argparse.Namespace) -> int:
    directory = manager.units_dir(plan.home)
    paths = [directory / name for name in manager.render(plan)]
    commands = manager.uninstall(plan.label_suffix, plan.roles)
    if args.dry_run:
        _print_commands(commands)
        print("\n".join(f"would remove {p}" for p in paths if p.exists()))
        return 0
    if not _have(manager):
        return EXIT_USAGE
    for argv in commands:  # a unit that is not loaded is fine
        _run(argv, check=False)
    for path in paths:
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    if manager is SYSTEMD:
        _run(systemd.systemctl("daemon-reload"), check=False)
    return 0


def restart(manager: Manager, plan: UnitPlan, args: argparse.Namespace) -> int:
    commands = manager.restart(args.component, plan.label_suffix, plan.roles)
    if args.dry_run:
        _print_commands(commands)
        return 0
    if not _have(manager):
        return EXIT_USAGE
    return 0 if _run_all(commands) else EXIT_FAILED


def status(manager: Manager, plan: UnitPlan, args: argparse.Namespace) -> int:
    if not _have(manager):
        return EXIT_USAGE
    roles = (args.component,) if args.component else plan.roles
    suffix = plan.label_suffix
    rows = []
    for role in roles:
        if manager is LAUNCHD:
            name = launchd.label(role, suffix)
            done = _run(launchd.print_service(os.getuid(), role, suffix), check=False)
            fields = launchd.parse_print(done.stdout) if done.returncode == 0 else {}
            rows.append(launchd_row(name, fields))
        else:
            name = systemd.unit_name(role, suffix)
            done = _run(systemd.show(name), check=False)
            rows.append(systemd_row(name, systemd.parse_show(done.stdout)))
    print(format_rows(rows))
    return 0


# -- formatting (pure) -----------------------------------------------------------------------------

def launchd_row(name: str, fields: dict[str, str]) -> list[str]:
    if not fields:
        return [name, "not loaded", "-", "-", "-"]
    return [name, fields.get("state", "?"), fields.get("pid", "-"), fields.get("runs", "-"),
            fields.get("last exit code", "-")]


def systemd_row(name: str, fields: dict[str, str]) -> list[str]:
    if fields.get("LoadState") == "not-found" or not fields:
        return [name, "not installed", "-", "-", "-"]
    pid = fields.get("MainPID", "0")
    return [name, f"{fields.get('ActiveState', '?')} ({fields.get('SubState', '?')})",
            pid if pid != "0" else "-", fields.get("NRestarts", "-"),
            fields.get("ExecMainStatus", "-")]


def format_rows(rows: list[list[str]]) -> str:
    header = ["unit", "state", "pid", "runs/restarts", "last exit"]
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in table)


def _print_files(files: dict[str, str], directory: Path | None) -> None:
    for name, text in files.items():
        print(f"# ==> {directory / name if directory else name} <==")
        print(text.rstrip("\n"))
        print()


def _print_commands(commands: list[list[str]]) -> None:
    for argv in commands:
        print("would run: " + shlex.join(argv))


# -- running the service manager --------------------------------------------------------------------

def _have(manager: Manager) -> bool:
    if shutil.which(manager.tool) is None:
        print(f"switchyard: error: {manager.missing}", file=sys.stderr)
        return False
    return True


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        print(f"switchyard: error: `{shlex.join(argv)}` exited {done.returncode}: "
              f"{(done.stderr or done.stdout).strip()}", file=sys.stderr)
    return done


def _run_all(commands: list[list[str]]) -> bool:
    return all(_run(argv).returncode == 0 for argv in commands)
