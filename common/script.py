"""Scripted replies (`switchyard serve --script FILE`): rules that decide the model's words while
everything else stays real (docs/design/requests.md "Scripted replies").

The file is a contract that outside checks use:

    {"rules": [
      {"when": {"last": "REGEX" | ["REGEX", ...], "system": "REGEX", "tools": ["NAME", ...]},
       "say": "TEXT",
       "calls": [{"name": "NAME", "arguments": {...}}]}
    ]}

- `last`: regexes searched (`re.search`) in the text of the request's last user turn (its text
  and its tool results' text, joined by newlines); a list means every regex must be found.
- `system`: a regex searched in the whole system prompt (every system or developer message).
- `tools`: names that must all be among the request's tools.

The first rule whose conditions all hold gives the reply: `say`, then `calls`. When no rule
holds, the model replies on its own. This module is the format alone: parsing, with one clear
line naming the rule a bad script breaks, and matching on plain text. The gateway extracts the
texts from each API's request and has the model produce the reply, each token forced
(gateway/request/scripted.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SCRIPT_BYTES = 4 * 1024 * 1024
_WHEN_KEYS = frozenset({"last", "system", "tools"})
_RULE_KEYS = frozenset({"when", "say", "calls"})
_CALL_KEYS = frozenset({"name", "arguments"})


class ScriptError(Exception):
    """A script that cannot be used; the message is one line naming the file and the rule."""


@dataclass(frozen=True)
class ScriptedCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Rule:
    number: int  # 1-based, as the error messages and logs name it
    last: tuple[re.Pattern[str], ...] = ()
    system: re.Pattern[str] | None = None
    tools: frozenset[str] = frozenset()
    say: str = ""
    calls: tuple[ScriptedCall, ...] = ()

    def holds(self, system: str, last: str, tools: Collection[str]) -> bool:
        return (all(p.search(last) for p in self.last)
                and (self.system is None or self.system.search(system) is not None)
                and self.tools.issubset(tools))


@dataclass(frozen=True)
class Script:
    rules: tuple[Rule, ...]

    def reply(self, system: str, last: str, tools: Collection[str]) -> Rule | None:
        """The first rule whose conditions all hold (None: the model replies on its own)."""
        return next((r for r in self.rules if r.holds(system, last, tools)), None)


def load_script(path: str | Path) -> Script:
    """The script in file `path`, or ScriptError naming what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as exc:
        raise ScriptError(f"--script {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_SCRIPT_BYTES:
        raise ScriptError(f"--script {path}: larger than {MAX_SCRIPT_BYTES} bytes")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ScriptError(f"--script {path}: not valid JSON ({exc})") from None
    try:
        return parse_script(value)
    except ScriptError as exc:
        raise ScriptError(f"--script {path}: {exc}") from None


def parse_script(value: Any) -> Script:
    if not isinstance(value, dict) or not isinstance(value.get("rules"), list):
        raise ScriptError('the script must be an object {"rules": [...]}')
    extra = set(value) - {"rules"}
    if extra:
        raise ScriptError(f"unknown top-level key {sorted(extra)[0]!r} (only 'rules')")
    return Script(tuple(_rule(n, item) for n, item in enumerate(value["rules"], 1)))


def _rule(number: int, item: Any) -> Rule:
    where = f"rule {number}"
    if not isinstance(item, dict):
        raise ScriptError(f"{where}: must be an object with 'when', 'say' and/or 'calls'")
    _known(item, _RULE_KEYS, where)
    when = item.get("when", {})
    if not isinstance(when, dict):
        raise ScriptError(f"{where}: 'when' must be an object")
    _known(when, _WHEN_KEYS, f"{where}: 'when'")
    last = when.get("last", [])
    if isinstance(last, str):
        last = [last]
    if not isinstance(last, list) or not all(isinstance(p, str) for p in last):
        raise ScriptError(f"{where}: 'when.last' must be a regex or a list of regexes")
    system = when.get("system")
    if system is not None and not isinstance(system, str):
        raise ScriptError(f"{where}: 'when.system' must be a regex")
    tools = when.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
        raise ScriptError(f"{where}: 'when.tools' must be a list of tool names")
    say = item.get("say", "")
    if not isinstance(say, str):
        raise ScriptError(f"{where}: 'say' must be a string")
    calls = item.get("calls", [])
    if not isinstance(calls, list):
        raise ScriptError(f"{where}: 'calls' must be a list")
    parsed_calls = tuple(_call(where, n, call) for n, call in enumerate(calls, 1))
    if not say and not parsed_calls:
        raise ScriptError(f"{where}: says nothing (give 'say', 'calls' or both)")
    return Rule(number, tuple(_regex(where, "last", p) for p in last),
                _regex(where, "system", system) if system is not None else None,
                frozenset(tools), say, parsed_calls)


def _call(where: str, number: int, call: Any) -> ScriptedCall:
    at = f"{where}: call {number}"
    if not isinstance(call, dict):
        raise ScriptError(f"{at}: must be an object with 'name' and 'arguments'")
    _known(call, _CALL_KEYS, at)
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ScriptError(f"{at}: has no 'name'")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ScriptError(f"{at} ({name}): 'arguments' must be an object")
    return ScriptedCall(name, arguments)


def _regex(where: str, key: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ScriptError(f"{where}: 'when.{key}' {pattern!r} is not a valid regex ({exc})") \
            from None


def _known(item: dict, keys: frozenset[str], where: str) -> None:
    extra = set(item) - keys
    if extra:
        raise ScriptError(f"{where}: unknown key {sorted(extra)[0]!r} "
                          f"(known: {', '.join(sorted(keys))})")
