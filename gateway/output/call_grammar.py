"""Grammars for tool calls in the model's own call format (structured outputs).

A grammar here is llguidance's Lark dialect: `%json {schema}` embeds a JSON schema, `<[id]>`
names a single token (chat markers such as `</tool_call>` are added tokens, which llguidance
never matches as text). Each grammar describes what follows the text the prompt already holds:

- forced, named: the prompt ends with the call's opening up to its arguments
  (`ToolSyntax.forced_opening(name)`): the grammar is the arguments and the call's end;
- forced, the model picks (`required` with several tools): the opening ends before the name;
- auto: the grammar is the call after its start marker, which the worker waits for (trigger).

Arguments follow the tool's `parameters` schema when the tool is strict, any JSON object
otherwise: either way a call always parses (docs/design.md "Structured outputs").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.output.tools import JSON_FAMILY, ToolSyntax

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON inside calls too: no whitespace runs for a model to fill.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict[str, Any]) -> str:
    """`%json` of a schema, with llguidance's compact-JSON options attached."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


class UnsupportedCallFormat(Exception):
    """The model's call format has no grammar here; calls stay unconstrained."""


@dataclass(frozen=True)
class CallGrammar:
    lark: str
    trigger: str = ""  # text after which the grammar applies ("" = from the first token)


def call_grammar(syntax: ToolSyntax, tools: list[dict[str, Any]], strict: frozenset[str],
                 mode: str, name: str | None, parallel: bool, marker) -> CallGrammar:
    """`mode` is "forced" (the prompt holds the opening) or "auto"; `marker(text)` writes a
    literal for `text` (a token reference when it is one added token)."""
    functions = {t["function"]["name"]: (t["function"].get("parameters") or ANY_OBJECT)
                 if t["function"]["name"] in strict else ANY_OBJECT for t in tools}
    if syntax.family == JSON_FAMILY:
        return _json_family(syntax, functions, mode, name, parallel, marker)
    if syntax.family == "qwen3_coder":
        return _qwen3_coder(syntax, functions, mode, name, parallel, marker)
    raise UnsupportedCallFormat(syntax.family)


def _json_family(syntax, functions, mode, name, parallel, marker) -> CallGrammar:
    end = marker(syntax.end)
    if mode == "forced" and name is not None:
        schema = functions[name]
        return CallGrammar(f'start: args "}}\\n" {end}\nargs: {_json(schema)}\n')
    if mode == "forced":
        # The opening ends with `{"name": "`: each alternative is a name and its arguments.
        rules = [f'start: {" | ".join(f"call{i}" for i in range(len(functions)))}']
        for i, (fname, schema) in enumerate(functions.items()):
            head = json.dumps(json.dumps(fname)[1:] + ', "arguments": ')
            rules.append(f'call{i}: {head} args{i} "}}\\n" {end}')
            rules.append(f"args{i}: {_json(schema)}")
        return CallGrammar("\n".join(rules) + "\n")
    calls = [{"type": "object",
              "properties": {"name": {"const": fname}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for fname, schema in functions.items()]
    body = f'"\\n" call "\\n" {end}'
    more = f' ("\\n" {marker(syntax.start)} {body})*' if parallel else ""
    lark = f"start: {body}{more}\ncall: {_json({'anyOf': calls})}\n"
    return CallGrammar(lark, trigger=syntax.start)


def _raw_string_rule(rule: str, schema: dict[str, Any]) -> str:
    """A string parameter written raw up to its closing tag: its enum, or its length range."""
    if schema.get("enum"):
        options = " | ".join(json.dumps(f"{v}\n</parameter>") for v in schema["enum"])
        return f"{rule}: {options}"
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    count = f"{{{lo},{int(hi)}}}" if hi is not None else ("*" if lo == 0 else f"{{{lo},}}")
    return f"{rule}[lazy]: /(.|\\n){count}\\n<\\/parameter>/"


def _qwen3_coder(syntax, functions, mode, name, parallel, marker) -> CallGrammar:
    """`<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n`: a string
    value is raw text up to its closing tag, any other value is JSON."""
    end = marker(syntax.end)
    rules, alternatives = [], []
    for i, (fname, schema) in enumerate(functions.items()):
        if name is not None and fname != name:
            continue
        params = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = [] if params else ["any_param*"]
        if not params:  # not strict: any parameters, each a raw value
            rules.append('any_param: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" any_value "\\n"')
            rules.append("any_value[lazy]: /(.|\\n)*\\n<\\/parameter>/")
        for j, (key, param) in enumerate(params.items()):
            value = f"v{i}_{j}"
            item = f'"<parameter={key}>\\n" {value}'
            if param.get("type") == "string":
                rules.append(_raw_string_rule(value, param))
                item += ' "\\n"'
            else:
                rules.append(f"{value}: {_json(param)}")
                item += ' "\\n</parameter>\\n"'
            parts.append(item if key in required else f"({item})?")
        opening = "" if (mode == "forced" and name is not None) else f'"{fname}>\\n" '
        alternatives.append(f"call{i}")
        rules.append(f'call{i}: {opening}{" ".join(parts)} "</function>\\n" {end}')
    if mode == "forced" and name is None:
        # The opening ends with `<function=`: the name comes first.
        start = f'start: {" | ".join(alternatives)}'
        return CallGrammar("\n".join([start, *rules]) + "\n")
    if mode == "forced":
        return CallGrammar("\n".join([f"start: {alternatives[0]}", *rules]) + "\n")
    body = f'"\\n<function=" ({" | ".join(alternatives)})'
    more = f' ("\\n" {marker(syntax.start)} {body})*' if parallel else ""
    return CallGrammar("\n".join([f"start: {body}{more}", *rules]) + "\n",
                       trigger=syntax.start)
