"""Tool calls as a model writes them: the model family's call syntax, and parsing (with repair
for forced calls) of the calls a model writes. The tools a request offers and its tool_choice
are request/tools.py's.

How a model writes a call is its family's `ToolSyntax`; formats.py holds one per family and
picks it from the chat template (Hermes `<tool_call>{json}</tool_call>` when nothing else
matches).

Forcing a call (`tool_choice` naming a function, or `required`) is done by writing the opening
of the call into the prompt (`forced_opening`) and parsing opening + continuation. Forced calls
are always returned as calls: when the model's continuation does not parse, `repair_forced`
keeps what can be recovered and falls back to arguments `{}` (the client asked for a call;
text would break its contract). A forced call cut by the token limit is never repaired: it is
returned incomplete, with the arguments as far as the model wrote them (`partial_arguments`),
and the turn ends with "length", as OpenAI does. Unforced calls that do
not parse are returned as text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
JSON_FAMILY = "json_tools"
HARMONY_FAMILY = "harmony"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (complete: False: as far as it was written)
    complete: bool = True

    @property
    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's `input`); of an incomplete call, the
        members written in full."""
        if not self.complete:
            return partial_object(self.arguments)
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


_SEPARATOR = re.compile(r"\s*,?\s*")
_COLON = re.compile(r"\s*:\s*")


def partial_object(text: str) -> dict[str, Any]:
    """The members of a JSON object cut short that were written in full, never a guess:
    `{"path": "a", "line": 12` -> {"path": "a"} (the number may have more digits)."""
    text = text.strip()
    if not text.startswith("{"):
        return {}
    decoder, out, pos = json.JSONDecoder(), {}, 1
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        try:
            key, pos = decoder.raw_decode(text, pos)
            colon = _COLON.match(text, pos)
            if not isinstance(key, str) or colon is None:
                return out
            value, pos = decoder.raw_decode(text, colon.end())
        except ValueError:
            return out
        if pos == len(text) and not isinstance(value, (str, dict, list)):
            return out  # a number or literal at the cut may be cut itself
        out[key] = value


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    """The names of a request's function tools (request/tools.py made them)."""
    return [t["function"]["name"] for t in tools or ()]


# --- the model's call syntax -------------------------------------------------------------------


ParseFn = Callable[[str, Any], Any]
RenderFn = Callable[[str, dict], str]


def _parse_json(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolSyntax:
    """How one family writes a call (formats.py has them all).

    `start`/`end` delimit a call in the output (`end` "" when a call runs to the end of the
    output); `parse(text between them, tools)` gives `{"name", "arguments"}` or a list of them;
    `render(name, arguments)` writes a call exactly as the model is taught to; `opening(name)`
    is the text a forced call starts from (name None: the model picks the name), which the
    model completes. `name_after`/`name_before` bracket the name in a call's text (to repair a
    forced call). `keep_start`: the start marker is part of the call (Llama 3's `{`);
    `only_at_start`: a call is the whole output; `alt_starts`: other markers that start one.
    `arguments`: how the arguments are written, for a grammar: "json" (one JSON object right
    after `opening(name)`, then `closing(name)`), "xml" (a tag per argument, values as text or
    JSON), "python" (keyword arguments) or "gemma4" (Gemma 4's object syntax).
    """

    family: str
    start: str
    end: str
    parse: ParseFn
    opening: Callable[[str | None], str] | None = None
    render: RenderFn | None = None
    name_after: str = '"name": "'
    name_before: str = '"'
    keep_start: bool = False
    only_at_start: bool = False
    alt_starts: tuple[str, ...] = ()
    arguments: str = "json"

    def closing(self, name: str) -> str:
        """What follows the JSON arguments of a "json" call up to its end."""
        if self.render is None or self.arguments != "json":
            return self.end
        return self.render(name, {})[len(self.forced_opening(name)) + len("{}"):]

    def forced_opening(self, name: str | None) -> str:
        """Text that starts a call the model must finish (name None: the model picks)."""
        if self.opening is not None:
            return self.opening(name)
        return self.start

    def forced_call_text(self, opening: str) -> str:
        """What of a forced opening belongs to the call's text (after the start marker)."""
        if self.keep_start or not opening.startswith(self.start):
            return opening
        return opening[len(self.start):]

    def guess_name(self, text: str) -> str:
        """The name in a call's text that does not parse (a forced call cut short)."""
        at = text.find(self.name_after) if self.name_after else 0
        rest = text[at + len(self.name_after):] if at >= 0 else text
        rest = rest.lstrip(" \n{[\"")
        cut = rest.find(self.name_before) if self.name_before else -1
        return (rest[:cut] if cut >= 0 else rest).split("\n", 1)[0].strip()


def _render_hermes(name: str, arguments: dict) -> str:
    return (f'{HERMES_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
            f'{json.dumps(arguments, ensure_ascii=False)}}}\n{HERMES_END}')


def _hermes_opening(name: str | None) -> str:
    if name is None:
        return f'{HERMES_START}\n{{"name": "'
    return f'{HERMES_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


HERMES = ToolSyntax(JSON_FAMILY, HERMES_START, HERMES_END, _parse_json, opening=_hermes_opening,
                    render=_render_hermes)


# --- parsing ---------------------------------------------------------------------------------


def _arguments_text(arguments: Any) -> str | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def parse_calls(syntax: ToolSyntax, text: str,
                tools: list[dict[str, Any]] | None) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) for each call in the text between the markers; None when the
    text is not a well-formed call of a known tool shape (the parser raised or returned junk)."""
    try:
        parsed = syntax.parse(text, tools)
    except Exception:  # parsers raise ValueError, JSONDecodeError, KeyError, IndexError...
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        arguments = _arguments_text(item.get("arguments", item.get("parameters")))
        if not isinstance(name, str) or not name or arguments is None:
            return None
        calls.append((name, arguments))
    return calls or None


def best_tool(guess: str, names: Sequence[str]) -> str:
    """The tool whose name shares the longest prefix with what the model wrote."""
    def shared(name: str) -> int:
        n = 0
        for a, b in zip(name, guess):
            if a != b:
                break
            n += 1
        return n

    return max(names, key=lambda name: (name == guess, shared(name)))


def partial_arguments(syntax: ToolSyntax, text: str, opening: str, named: bool) -> str:
    """The arguments of a forced call the token limit cut, as far as the model wrote them, for
    the formats whose arguments are one JSON object: what follows the opening when it named the
    function (the object starts right after it), else what follows the arguments key (the
    model was writing the name too). Other formats: the call's text."""
    if syntax.arguments != "json":
        return text
    if named and text.startswith(opening):
        return text[len(opening):].strip()
    for key in ('"arguments"', '"parameters"'):
        at = text.find(key)
        colon = _COLON.match(text, at + len(key)) if at >= 0 else None
        if colon is not None:
            return text[colon.end():].strip()
    return ""


def _json_arguments_after(text: str, key: str = '"arguments"') -> str | None:
    at = text.find(key)
    if at < 0:
        return None
    rest = text[at + len(key):].lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    return _arguments_text(value)


def repair_forced(syntax: ToolSyntax, text: str, name: str | None,
                  tools: list[dict[str, Any]]) -> tuple[tuple[str, str], bool]:
    """One call from a forced call's text (between the markers): ((name, arguments), repaired).

    `name` is the forced function, or None for `required` (the model picked the name, which
    is matched to the closest tool). Arguments that do not parse become `{}`.
    """
    names = tool_names(tools)
    calls = parse_calls(syntax, text, tools)
    if calls:
        got_name, arguments = calls[0]
        if (name is None and got_name in names) or got_name == name:
            return (got_name, arguments), False
    if name is None:
        name = best_tool(syntax.guess_name(text), names)
    arguments = None
    if syntax.family == JSON_FAMILY:
        arguments = _json_arguments_after(text)
    elif syntax.family == "llama3_json":
        arguments = _json_arguments_after(text, '"parameters"')
    return (name, arguments or "{}"), True
