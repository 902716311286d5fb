"""systemd user units for the four components (Linux), rendered from the templates here.

    files = render(plan)        # {"switchyard-gateway.service": "...", "switchyard.target": ...}
    systemctl("restart", unit)  # argv lists for systemctl --user; nothing here runs them

One service per component (`switchyard-<role>.service`, `switchyard-<suffix>-<role>.service`
with a label suffix) and `switchyard[-<suffix>].target` that wants them all; each service is
`PartOf=` the target, so stopping or restarting the target stops or restarts the group.
Services restart on failure (`Restart=on-failure`, `RestartSec`), log to the journal, and the
worker gets Debian's OpenBLAS in `LD_PRELOAD`. The gateway's API key comes through
`LoadCredential=` (systemd copies the 0600 key file to a private directory, `%d`). Rendering is pure: templates + plan.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from switchyard.deploy.group_roles import split_role
from switchyard.deploy.service_units import (ROLES, UnitPlan, describe, environment,
                                  program_arguments)

TEMPLATE_DIR = Path(__file__).resolve().parent
# The gateway reads its key from systemd's credentials directory (%d), never from ExecStart.
CREDENTIAL = "api-key"
CREDENTIAL_PATH = f"%d/{CREDENTIAL}"
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
_SAFE = re.compile(r"[A-Za-z0-9_./:=,+@%-]+")


def _stem(suffix: str) -> str:
    return "switchyard" + (f"-{suffix}" if suffix else "")


def unit_name(role: str, suffix: str = "") -> str:
    return f"{_stem(suffix)}-{role}.service"


def target_name(suffix: str = "") -> str:
    return f"{_stem(suffix)}.target"


def units_dir(home: str | Path, env: dict[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/systemd/user`, by default ~/.config/systemd/user."""
    env = os.environ if env is None else env
    config = env.get("XDG_CONFIG_HOME") or str(Path(home) / ".config")
    return Path(config) / "systemd" / "user"


# -- quoting (systemd.syntax(7), systemd.service(5) "Command lines") ----------------------------

def quote(word: str, *, expands_variables: bool = True) -> str:
    """One word of ExecStart= (which expands $VARIABLES) or Environment= (which does not),
    with specifiers (%) escaped and quotes where needed."""
    word = word.replace("%", "%%")
    if _SAFE.fullmatch(word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"')
    if expands_variables:
        escaped = escaped.replace("$", "$$")
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def exec_line(argv: list[str]) -> str:
    return " ".join(quote(arg) for arg in argv)


def environment_lines(env: dict[str, str]) -> str:
    return "\n".join(f"Environment={quote(f'{k}={v}', expands_variables=False)}"
                     for k, v in env.items())


# -- rendering ----------------------------------------------------------------------------------

def template(name: str) -> str:
    return (TEMPLATE_DIR / name).read_text()


def fill(text: str, words: dict[str, str]) -> str:
    unknown = set(_PLACEHOLDER.findall(text)) - set(words)
    if unknown:
        raise ValueError(f"unknown placeholder in a systemd template: {sorted(unknown)}")
    return _PLACEHOLDER.sub(lambda m: words[m.group(0)], text)


def _common_words(plan: UnitPlan) -> dict[str, str]:
    suffix = plan.label_suffix
    words = {f"@{role.upper()}_UNIT@": unit_name(role, suffix) for role in ROLES}
    words["@TARGET@"] = target_name(suffix)
    return words


def render_service(plan: UnitPlan, role: str, text: str | None = None) -> str:
    words = _common_words(plan) | {
        "@DESCRIPTION@": describe(role) + (f" [{plan.label_suffix}]" if plan.label_suffix else ""),
        "@EXEC_START@": exec_line(program_arguments(plan, role, CREDENTIAL_PATH))
                        .replace(quote(CREDENTIAL_PATH), CREDENTIAL_PATH),
        "@CREDENTIALS@": (f"LoadCredential={CREDENTIAL}:{quote(plan.api_key_file)}"
                          if role == "gateway" and plan.api_key_file else ""),
        "@WORKING_DIRECTORY@": plan.working_dir.replace("%", "%%"),  # taken as it is
        "@ENVIRONMENT@": environment_lines(environment(plan, role)),
        "@UNIT_STEM@": unit_name(role, plan.label_suffix).removesuffix(".service"),
    }
    base = split_role(role)[0]
    return fill(text if text is not None else template(f"switchyard-{base}.service"), words)


def render_target(plan: UnitPlan, text: str | None = None) -> str:
    filled = fill(text if text is not None else template("switchyard.target"), _common_words(plan))
    if plan.roles == ROLES:
        return filled
    wants = " ".join(unit_name(role, plan.label_suffix) for role in plan.roles)
    return re.sub(r"^Wants=.*$", f"Wants={wants}", filled, flags=re.MULTILINE)


def render(plan: UnitPlan) -> dict[str, str]:
    """File name -> unit text: the four services and the target."""
    files = {unit_name(role, plan.label_suffix): render_service(plan, role)
             for role in plan.roles}
    files[target_name(plan.label_suffix)] = render_target(plan)
    return files


# -- systemctl command lines (pure) -------------------------------------------------------------

def systemctl(*args: str) -> list[str]:
    return ["systemctl", "--user", *args]


def all_units(suffix: str = "", roles: tuple[str, ...] = ROLES) -> list[str]:
    return [target_name(suffix), *(unit_name(role, suffix) for role in roles)]


SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "NRestarts", "ExecMainStartTimestamp",
                   "ExecMainStatus", "UnitFileState")


def show(unit: str) -> list[str]:
    return systemctl("show", "--property=" + ",".join(SHOW_PROPERTIES), unit)


def parse_show(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    return fields
