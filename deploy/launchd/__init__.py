"""launchd user agents for the four components (macOS), rendered from the plist templates here.

    files = render(plan)                 # {"com.switchyard.gateway.plist": "<?xml ...", ...}
    bootstrap(uid, path)                 # argv lists for launchctl; nothing here runs them

One agent per component, labelled `com.switchyard.<role>` (`com.switchyard.<role>.<suffix>`
with a label suffix, so two groups can coexist), installed into ~/Library/LaunchAgents. Each
runs `switchyard run ROLE <flags>`, keeps its own pid file in the runtime directory and logs
to `~/Library/Logs/switchyard[-suffix]/<role>.log`. Rendering is pure: templates + plan.
"""

from __future__ import annotations

import plistlib
import re
from pathlib import Path
from typing import Any

from switchyard.deploy.group_roles import split_role
from switchyard.deploy.service_units import ROLES, UnitPlan, environment, program_arguments

TEMPLATE_DIR = Path(__file__).resolve().parent
LABEL_PREFIX = "com.switchyard"
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")


def label(role: str, suffix: str = "") -> str:
    return f"{LABEL_PREFIX}.{role}" + (f".{suffix}" if suffix else "")


def plist_name(role: str, suffix: str = "") -> str:
    return label(role, suffix) + ".plist"


def agents_dir(home: str | Path) -> Path:
    return Path(home) / "Library" / "LaunchAgents"


def log_dir(plan: UnitPlan) -> Path:
    name = "switchyard" + (f"-{plan.label_suffix}" if plan.label_suffix else "")
    return Path(plan.home) / "Library" / "Logs" / name


def template(role: str) -> bytes:
    return (TEMPLATE_DIR / plist_name(split_role(role)[0])).read_bytes()


def render_one(plan: UnitPlan, role: str, template_bytes: bytes | None = None) -> dict[str, Any]:
    """The agent of `role` as a plist dictionary."""
    raw = plistlib.loads(template_bytes if template_bytes is not None else template(role))
    words = {"@LABEL@": label(role, plan.label_suffix), "@WORKING_DIRECTORY@": plan.working_dir,
             "@HOME@": plan.home, "@LOG_DIR@": str(log_dir(plan))}
    agent = _fill(raw, words, program_arguments(plan, role))
    agent["EnvironmentVariables"] = {**agent.get("EnvironmentVariables", {}),
                                     **environment(plan, role)}
    base = split_role(role)[0]
    if base != role:  # a worker group's rank: its own log file
        for key in ("StandardOutPath", "StandardErrorPath"):
            if key in agent:
                agent[key] = agent[key].replace(f"/{base}.log", f"/{role}.log")
    return agent


def render(plan: UnitPlan, roles: tuple[str, ...] | None = None) -> dict[str, str]:
    """File name -> plist text, for every component of the plan."""
    return {plist_name(role, plan.label_suffix):
            plistlib.dumps(render_one(plan, role), sort_keys=False).decode()
            for role in roles or plan.roles}


def _fill(value: Any, words: dict[str, str], argv: list[str]) -> Any:
    if isinstance(value, dict):
        return {key: _fill(item, words, argv) for key, item in value.items()}
    if isinstance(value, list):
        if value == ["@PROGRAM_ARGUMENTS@"]:
            return list(argv)
        return [_fill(item, words, argv) for item in value]
    if isinstance(value, str):
        unknown = set(_PLACEHOLDER.findall(value)) - set(words)
        if unknown:
            raise ValueError(f"unknown placeholder in a launchd template: {sorted(unknown)}")
        return _PLACEHOLDER.sub(lambda m: words[m.group(0)], value)
    return value


# -- launchctl command lines (pure) -------------------------------------------------------------

def domain(uid: int) -> str:
    return f"gui/{uid}"


def service_target(uid: int, role: str, suffix: str = "") -> str:
    return f"{domain(uid)}/{label(role, suffix)}"


def bootstrap(uid: int, path: Path) -> list[str]:
    return ["launchctl", "bootstrap", domain(uid), str(path)]


def bootout(uid: int, role: str, suffix: str = "") -> list[str]:
    return ["launchctl", "bootout", service_target(uid, role, suffix)]


def enable(uid: int, role: str, suffix: str = "") -> list[str]:
    return ["launchctl", "enable", service_target(uid, role, suffix)]


def print_service(uid: int, role: str, suffix: str = "") -> list[str]:
    return ["launchctl", "print", service_target(uid, role, suffix)]


def kickstart(uid: int, role: str, suffix: str = "") -> list[str]:
    """Kill (SIGTERM) the running instance if any and start it again."""
    return ["launchctl", "kickstart", "-k", service_target(uid, role, suffix)]


def parse_print(text: str) -> dict[str, str]:
    """The top-level `key = value` lines of `launchctl print` (state, pid, runs, last exit
    code, ...); nested blocks are skipped."""
    fields: dict[str, str] = {}
    depth = 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{"):
            depth += 1
            continue
        if stripped == "}":
            depth = max(0, depth - 1)
            continue
        if depth == 1 and " = " in stripped:
            key, _, value = stripped.partition(" = ")
            fields.setdefault(key.strip(), value.strip())
    return fields
