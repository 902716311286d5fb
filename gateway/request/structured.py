"""Structured outputs: what a request asks its output to match, compiled to one llguidance grammar.

Every API's spelling lands here: OpenAI `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` and their newer
`structured_outputs` object, the Responses API's `text.format`, Anthropic's `output_format`
(and `output_config.format`). Tool calls get their grammars from `gateway.output.call_grammar`.

Building a grammar here is cheap and bounded (inputs of at most 64 KB, `guided_choice` at most
1024 options); checking it is not, and happens later, off the event loop, under a time bound and
the same resource limits the worker uses (grammar_check.py), so an invalid or unsupported
schema is a 400 naming what is wrong, and a hostile one never reaches the worker
(docs/design/requests.md "Structured outputs").
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from switchyard.gateway.errors import invalid
from switchyard.gateway.request.wire.decoding import decode
from switchyard.gateway.request.wire.openai import (JsonObjectFormat, ResponseFormat,
                                                    ResponseFormats, TextFormat)
from switchyard.gateway.request.wire.responses import TextFormats
from switchyard.common.grammar_limits import parser_limits

# A schema's compile time grows with its size (measured: 240 KB, 3,000 patterned properties,
# 0.4 s); 64 KB keeps one unique schema well under 0.1 s of the gateway's time, and compiled
# grammars are cached, so a repeated schema (an agent's tools, every turn) costs nothing.
MAX_SCHEMA_BYTES = 64 * 1024
CACHED_GRAMMARS = 256
# Compact JSON, as OpenAI's structured outputs write it: no whitespace runs for the model to
# fill, so an output's length is bounded by its schema.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_CHOICES = 1024  # guided_choice options (their text: MAX_SCHEMA_BYTES in all)


@dataclass(frozen=True)
class Constraint:
    grammar: str  # llguidance grammar (its JSON form), not yet checked (grammar_check.py)
    trigger: str = ""  # text after which the grammar applies ("" = from the first token)
    param: str = ""  # the request field it came from, for the 400 when it does not check


def _llg():
    import llguidance

    return llguidance


def validation_error(grammar: str) -> str:
    """Why llguidance refuses `grammar` under the group's limits ("" if it does not), at once
    and without a time bound: the gateway uses grammar_check.py instead."""
    return _llg().LLMatcher.validate_grammar(grammar, None, limits=parser_limits())


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _json_grammar(schema_text: str) -> str:
    return _llg().LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)


def checked(grammar: str, param: str, trigger: str = "") -> Constraint:
    """The constraint of a grammar built from field `param` (checked later)."""
    return Constraint(grammar, trigger, param)


def check_now(constraint: Constraint) -> Constraint:
    """`constraint` if its grammar validates, else the 400 grammar_check gives: at once,
    unbounded (tests, and grammars the gateway builds itself)."""
    error = validation_error(constraint.grammar)
    if error:
        param = constraint.param
        raise invalid(f"Unsupported or invalid '{param}': {error.splitlines()[0]}",
                      param=param, code="invalid_grammar")
    return constraint


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"'{param}' must be a JSON schema object", param=param,
                      code="invalid_type")
    text = json.dumps(schema)
    _bounded(text, param)
    return text


def json_schema(schema: Any, param: str) -> Constraint:
    text = _schema_text(schema, param)
    try:
        grammar = _json_grammar(text)
    except ValueError as exc:
        raise invalid(f"Invalid '{param}': {exc}", param=param, code="invalid_grammar") from None
    return checked(grammar, param)


def _bounded(text: str, param: str, what: str = "") -> None:
    """`what`: the text, when it is not `param` itself but made from it (a call grammar)."""
    if len(text) > MAX_SCHEMA_BYTES:
        subject = f"'{param}': {what}" if what else f"'{param}'"
        raise invalid(f"{subject} is larger than {MAX_SCHEMA_BYTES} bytes", param=param,
                      code="invalid_value")


def regex(pattern: Any, param: str) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise invalid(f"'{param}' must be a non-empty string", param=param, code="invalid_type")
    _bounded(pattern, param)
    return checked(_llg().LLMatcher.grammar_from_regex(pattern), param)


def lark(text: Any, param: str, trigger: str = "", what: str = "") -> Constraint:
    """A Lark grammar (llguidance's dialect), or GBNF as llama.cpp writes it; `what` names it
    when it is made from `param` (the tools' call grammar)."""
    if not isinstance(text, str) or not text.strip():
        raise invalid(f"'{param}' must be a non-empty string", param=param, code="invalid_type")
    _bounded(text, param, what)
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions on bad GBNF
            raise invalid(f"Invalid GBNF in '{param}': {exc}", param=param,
                          code="invalid_grammar") from None
    return checked(_llg().LLMatcher.grammar_from_lark(text), param, trigger)


def choice(options: Any, param: str) -> Constraint:
    if (not isinstance(options, list) or not options
            or not all(isinstance(o, str) and o for o in options)):
        raise invalid(f"'{param}' must be a non-empty array of non-empty strings", param=param,
                      code="invalid_type")
    if len(options) > MAX_CHOICES:  # 100,000 options held /health for 3.6 s
        raise invalid(f"'{param}' has more than {MAX_CHOICES} options", param=param,
                      code="invalid_value")
    _bounded("".join(options), param)
    alternatives = " | ".join(json.dumps(o) for o in options)
    return checked(_llg().LLMatcher.grammar_from_lark(f"start: {alternatives}\n"), param)


def openai_response_format(value: Any, param: str = "response_format") -> Constraint | None:
    """Chat Completions' `response_format`."""
    return format_constraint(decode(value, ResponseFormats | None, param), param)


def responses_text_format(value: Any, param: str = "text.format") -> Constraint | None:
    """Responses' `text.format`: the json_schema fields sit on the format itself."""
    return format_constraint(decode(value, TextFormats | None, param), param)


def format_constraint(value: ResponseFormat | None, param: str) -> Constraint | None:
    """What a decoded response format asks the answer to match (None: free text)."""
    if isinstance(value, JsonObjectFormat):
        return json_schema({"type": "object"}, param)
    if value is None or isinstance(value, TextFormat):
        return None
    return json_schema(*value.spec(param))


_GUIDED = {"json": json_schema, "regex": regex, "grammar": lark, "choice": choice}


def guided(body: dict[str, Any]) -> Constraint | None:
    """vLLM's extra-body fields: `guided_json|regex|grammar|choice`, or `structured_outputs`."""
    found = [(f"guided_{k}", body[f"guided_{k}"], fn) for k, fn in _GUIDED.items()
             if body.get(f"guided_{k}") is not None]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise invalid("'structured_outputs' must be an object", param="structured_outputs",
                          code="invalid_type")
        found += [(f"structured_outputs.{k}", outputs[k], fn) for k, fn in _GUIDED.items()
                  if outputs.get(k) is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise invalid(f"Give one structured-output constraint, not several ({names})",
                      param=found[1][0], code="invalid_value")
    if not found:
        return None
    name, value, compile_fn = found[0]
    if compile_fn is json_schema and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"'{name}' is not valid JSON", param=name,
                          code="invalid_value") from None
    return compile_fn(value, name)


def one_of(*constraints: Constraint | None, param: str) -> Constraint | None:
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise invalid("Give either a response format or a guided constraint, not both",
                      param=param, code="invalid_value")
    return given[0] if given else None
