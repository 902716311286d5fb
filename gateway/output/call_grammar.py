"""Grammars for tool calls in the model's own call format (structured outputs).

A grammar here is llguidance's Lark dialect: `%json {schema}` embeds a JSON schema, `<[id]>`
names a single token (chat markers such as `</tool_call>` are added tokens, which llguidance
never matches as text). Each grammar describes what follows the text the prompt already holds:

- forced, named: the prompt ends with the call's opening up to its arguments
  (`ToolSyntax.forced_opening(name)`): the grammar is the arguments and the call's end;
- forced, the model picks (`required` with several tools): the opening ends before the name;
- auto: the grammar is the call after its start marker, which the worker waits for (trigger).

Arguments follow the tool's `parameters` schema when the tool is strict, any JSON object
otherwise: either way a call always parses (docs/design/requests.md "Structured outputs").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from switchyard.gateway.output.tools import ToolSyntax

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON inside calls too: no whitespace runs for a model to fill.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict[str, Any]) -> str:
    """`%json` of a schema, with llguidance's compact-JSON options attached."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


def token_literals(added_vocab: dict[str, int]):
    """`literal(text)`: `text` as grammar items, each added token in it (a chat marker such as
    `</tool_call>` or `<|call|>`) as a token reference: llguidance never matches those as
    text. The empty text is no items."""
    markers = sorted(added_vocab, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(m) for m in markers)) if markers else None

    def literal(text: str) -> str:
        items, pos = [], 0
        for match in pattern.finditer(text) if pattern else ():
            if match.start() > pos:
                items.append(json.dumps(text[pos:match.start()]))
            items.append(f"<[{added_vocab[match.group()]}]>")
            pos = match.end()
        if pos < len(text):
            items.append(json.dumps(text[pos:]))
        return " ".join(items)
    return literal


class UnsupportedCallFormat(Exception):
    """The model's call format has no grammar here; calls stay unconstrained."""


@dataclass(frozen=True)
class CallGrammar:
    lark: str
    trigger: str = ""  # text after which the grammar applies ("" = from the first token)


def call_grammar(syntax: ToolSyntax, tools: list[dict[str, Any]], strict: frozenset[str],
                 mode: str, name: str | None, parallel: bool, literal) -> CallGrammar:
    """`mode` is "forced" (the prompt holds the opening) or "auto"; `literal(text)` writes
    `text` as grammar items (added tokens such as `</tool_call>` as token references)."""
    functions = {t["function"]["name"]: (t["function"].get("parameters") or ANY_OBJECT)
                 if t["function"]["name"] in strict else ANY_OBJECT for t in tools}
    if syntax.family == "qwen3_coder":
        return _qwen3_coder(syntax, functions, mode, name, parallel, literal)
    if syntax.arguments == "json" and syntax.render is not None:
        return _json_arguments(syntax, functions, mode, name, parallel, literal)
    raise UnsupportedCallFormat(syntax.family)


def _json_arguments(syntax, functions, mode, name, parallel, literal) -> CallGrammar:
    """Formats whose call is `opening(name)`, a JSON object of arguments, `closing(name)`
    (Hermes/Qwen, harmony, DeepSeek, Mistral, Llama 3): derived from the format itself."""
    if mode == "forced":
        prefix = syntax.forced_opening(name)  # what the prompt already holds
    else:
        if syntax.keep_start or syntax.only_at_start:
            raise UnsupportedCallFormat(syntax.family)  # no marker to wait for
        prefix = syntax.start
    names = [name] if name is not None else list(functions)
    rules, alternatives = [], []
    for i, fname in enumerate(names):
        head = syntax.forced_opening(fname)
        if not head.startswith(prefix):
            raise UnsupportedCallFormat(syntax.family)
        rules.append(f"args{i}: {_json(functions[fname])}")
        rules.append(f"call{i}: {literal(head[len(prefix):])} args{i} "
                     f"{literal(syntax.closing(fname))}")
        alternatives.append(f"call{i}")
    body = f'({" | ".join(alternatives)})'
    if mode == "auto" and parallel:
        body += f' (/\\s*/ {literal(syntax.start)} ({" | ".join(alternatives)}))*'
    return CallGrammar("\n".join([f"start: {body}", *rules]) + "\n",
                       trigger=syntax.start if mode == "auto" else "")


def _raw_string_rule(rule: str, schema: dict[str, Any]) -> str:
    """A string parameter written raw up to its closing tag: its enum, or its length range."""
    if schema.get("enum"):
        options = " | ".join(json.dumps(f"{v}\n</parameter>") for v in schema["enum"])
        return f"{rule}: {options}"
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    count = f"{{{lo},{int(hi)}}}" if hi is not None else ("*" if lo == 0 else f"{{{lo},}}")
    return f"{rule}[lazy]: /(.|\\n){count}\\n<\\/parameter>/"


def _qwen3_coder(syntax, functions, mode, name, parallel, literal) -> CallGrammar:
    """`<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n`: a string
    value is raw text up to its closing tag, any other value is JSON."""
    end = literal(syntax.end)
    rules, alternatives = [], []
    any_param_rules = False
    for i, (fname, schema) in enumerate(functions.items()):
        if name is not None and fname != name:
            continue
        params = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = [] if params else ["any_param*"]
        if not params and not any_param_rules:  # not strict: any parameters (rules once)
            any_param_rules = True
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
    more = f' ("\\n" {literal(syntax.start)} {body})*' if parallel else ""
    return CallGrammar("\n".join([f"start: {body}{more}", *rules]) + "\n",
                       trigger=syntax.start)
