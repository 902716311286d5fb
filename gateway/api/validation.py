"""Parse and validate OpenAI request bodies into plain dataclasses.

Unknown fields are ignored, as OpenAI does; a known field of the wrong type or out of range is a
400 that names the field. Nothing here touches the tokenizer or the network.
"""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

import structlog

from switchyard.gateway.api.models.common import INT32_MAX, MAX_STOP
from switchyard.gateway.request import structured
from switchyard.gateway.request.model import (ChatRequest, CompletionRequest, Options,
                                              parse_cache_salt, parse_priority)
from switchyard.gateway.errors import invalid, invalid_type, out_of_range
from switchyard.gateway.output.tools import (parse_openai_tool_choice, parse_openai_tools,
                                  strict_tool_names)
from switchyard.gateway.vision.parts import has_part, mixed_parts, openai_image_part

_SEED_MODULUS = 2**63
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
# `chat_template_kwargs` are the template's variables (enable_thinking, reasoning_effort, ...).
# A key that is an argument of `apply_chat_template` itself would let a request replace the
# model's template (`chat_template`: the client's own Jinja, run with no time or memory
# bound) or what the gateway passes it: refused (issue 23, finding 1). Templates come from the
# model or the operator, never a request.
RESERVED_TEMPLATE_KEYS = frozenset({
    "chat_template", "messages", "conversation", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
# The variables' JSON: enough for flags and short strings, never a second prompt (a value the
# template prints or loops over is bounded by it).
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

log = structlog.get_logger()


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity are not JSON and are refused. (Large bodies
    are parsed by api/json_body.py, which yields to the event loop.)"""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        # Decoded strictly: json.loads(bytes) decodes with 'surrogatepass', which lets a raw
        # encoded surrogate (b"\xed\xa0\x80") through as a lone surrogate (issue 23, finding 4).
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise invalid_json(exc) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    if SURROGATE_ESCAPE.search(raw):  # only a \\uD800-\\uDFFF escape can make one
        _refuse_lone_surrogates(body)
    return body


def invalid_json(exc: Exception) -> Exception:
    return invalid(f"We could not parse the JSON body of your request: {exc}",
                   code="invalid_json")


# JSON may spell a lone UTF-16 surrogate ("\\ud800"), which Python keeps in its str but which is
# not text: no tokenizer or encoder takes it (issue 12, finding 11).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(text: str) -> None:
    """A 400 if `text` holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("The JSON body holds a lone UTF-16 surrogate (an unpaired "
                      "\\ud800-\\udfff escape), which is not text.",
                      code="invalid_json") from None


def _refuse_lone_surrogates(body: Any) -> None:
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            lone_surrogate(item)


# --- fields clients send that this server does not read ------------------------------------

# Clients change faster than servers: a top-level field this server does not know is accepted
# and logged once per name (the names seen are bounded, so junk keys cannot grow memory).
MAX_NOTED_NAMES = 256
_noted: set[str] = set()
_noted_lock = threading.Lock()


def note_ignored(name: str) -> None:
    """Log `request.field_ignored` the first time `name` is seen."""
    name = "".join(c if c.isprintable() else "?" for c in name[:80])
    with _noted_lock:
        if name in _noted or len(_noted) >= MAX_NOTED_NAMES:
            return
        _noted.add(name)
    log.info("request.field_ignored", field=name)


def note_unknown_fields(body: dict[str, Any], known: frozenset[str], api: str) -> None:
    for key in body:
        if key not in known:
            note_ignored(f"{api}.{key}")


# Reasoning effort as chat templates take it (`reasoning_effort`: gpt-oss's low/medium/high);
# the other APIs' names for the ends of the scale map to the nearest.
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high", "max": "high"}


def reasoning_effort(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(param, "a string")
    if value == "none":
        return None
    effort = EFFORTS.get(value)
    if effort is None:
        note_ignored(f"{param}={value[:32]}")
    return effort


class Fields:
    """Typed access to the fields of one JSON object; every error names its field."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def get(self, key: str) -> Any:
        return self.body.get(key)

    def integer(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        value = as_integer(self.body.get(key))
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(self.name(key), "an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise out_of_range(self.name(key), _range_text(lo, hi))
        return value

    def number(self, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type(self.name(key), "a number")
        value = float(value)
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            low = f"> {lo}" if lo_open else f">= {lo}"
            raise out_of_range(self.name(key), f"{low} and <= {hi}")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise invalid_type(self.name(key), "a boolean")
        return value

    def string(self, key: str) -> str | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise invalid_type(self.name(key), "a string")
        return value

    def obj(self, key: str) -> dict[str, Any] | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid_type(self.name(key), "an object")
        return value

    def array(self, key: str) -> list[Any] | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise invalid_type(self.name(key), "an array")
        return value

    def reject_unsupported(self, key: str, allowed: tuple[Any, ...] = (None, False)) -> None:
        value = self.body.get(key)
        if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
            raise invalid(f"'{self.name(key)}' is not supported by this server",
                          param=self.name(key), code="unsupported_parameter")


def as_integer(value: Any) -> Any:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema and OpenAI's API take
    it), however large: 1e20 is judged by the field's range as 10**20 would be. Anything else
    is returned as it is, for the caller to judge."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def parse_options(f: Fields) -> Options:
    """Sampling, limits and streaming options shared by both endpoints."""
    n = f.integer("n")
    if n is not None and n != 1:
        raise invalid("Only n=1 is supported", param="n", code="invalid_value")
    # max_completion_tokens wins over the older max_tokens; both are checked.
    legacy = f.integer("max_tokens", lo=1)
    max_tokens = f.integer("max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = legacy
    stream = bool(f.boolean("stream"))
    stream_options = f.obj("stream_options") or {}
    include_usage = Fields(stream_options, "stream_options.").boolean("include_usage")
    seed = f.integer("seed", lo=_INT64_MIN, hi=_UINT64_MAX)
    return Options(
        model=f.string("model"),
        max_tokens=max_tokens,
        temperature=_default(f.number("temperature", 0.0, 2.0), 1.0),
        top_p=_default(f.number("top_p", 0.0, 1.0, lo_open=True), 1.0),
        top_k=_default(f.integer("top_k", lo=0, hi=INT32_MAX), 0),
        min_p=_default(f.number("min_p", 0.0, 1.0), 0.0),
        seed=None if seed is None else seed % _SEED_MODULUS,
        stop=parse_stop(f),
        stream=stream,
        include_usage=bool(include_usage),
        priority=parse_priority(f.get("priority"), "priority"),
        user=f.string("user"),
        logit_bias=parse_logit_bias(f),
        speculative=f.boolean("speculative") is not False,
        cache_salt=parse_cache_salt(f.get("cache_salt")),
    )


MAX_LOGIT_BIAS = 1024


def parse_logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}; the worker adds each bias to
    its token's logit. Token ids are checked against the vocabulary by the caller."""
    value = f.obj("logit_bias")
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens",
                      param="logit_bias", code="invalid_value")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid(f"'logit_bias' keys must be token ids, got {key[:40]!r}",
                          param="logit_bias", code="invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise out_of_range("logit_bias", "a map of token ids to numbers from -100 to 100")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def parse_stop(f: Fields) -> tuple[str, ...]:
    value = f.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid_type("stop", "a string or an array of strings")
    if len(value) > MAX_STOP:
        raise out_of_range("stop", f"at most {MAX_STOP} strings")
    return tuple(s for s in value if s)


# Fields every OpenAI endpoint reads (the options), vLLM's structured-output fields, and those
# ignored by design (README "Agent clients"); any other top-level field is logged once.
GUIDED_FIELDS = frozenset({"guided_json", "guided_regex", "guided_grammar", "guided_choice",
                           "structured_outputs"})
OPTION_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "n", "seed", "stop", "stream", "stream_options", "priority", "user", "logit_bias",
    "speculative", "logprobs", "top_logprobs", "response_format", "frequency_penalty",
    "presence_penalty", "metadata", "store", "service_tier", "prompt_cache_key",
    "safety_identifier", "cache_salt"}) | GUIDED_FIELDS
CHAT_FIELDS = OPTION_FIELDS | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "chat_template", "reasoning_effort", "verbosity", "modalities", "prediction", "audio",
    "web_search_options"}
COMPLETION_FIELDS = OPTION_FIELDS | {"prompt", "echo", "suffix", "best_of"}


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    f = Fields(body)
    note_unknown_fields(body, CHAT_FIELDS, "chat.completions")
    f.reject_unsupported("logprobs")
    f.reject_unsupported("top_logprobs", allowed=(None, 0))
    if body.get("chat_template") is not None:
        raise invalid("'chat_template' is not accepted: the chat template is the model's, "
                      "never a request's",
                      param="chat_template", code="unsupported_parameter")
    constraint = structured.one_of(structured.openai_response_format(f.get("response_format")),
                                   structured.guided(body), param="response_format")
    messages = f.array("messages")
    if not messages:
        raise invalid("'messages' must be a non-empty array", param="messages",
                      code="invalid_value" if messages == [] else "missing_required_parameter")
    tools = parse_openai_tools(f.get("tools"))
    tool_choice = parse_openai_tool_choice(f.get("tool_choice"), tools)
    parallel = f.boolean("parallel_tool_calls")
    kwargs = f.obj("chat_template_kwargs") or {}
    f.string("prompt_cache_key")
    effort = reasoning_effort(f.get("reasoning_effort"), "reasoning_effort")
    if effort and "reasoning_effort" not in kwargs:
        kwargs = {**kwargs, "reasoning_effort": effort}
    return ChatRequest(
        messages=[parse_message(m, i) for i, m in enumerate(messages)],
        options=parse_options(f),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel is not False,
        template_kwargs=template_kwargs(kwargs),
        constraint=constraint,
        strict_tools=strict_tool_names(f.get("tools"), lambda t: t.get("function")),
    )


def template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs"
                    ) -> dict[str, Any]:
    """The template variables a request sets; a reserved key or oversized values are a 400."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KEYS:
            raise invalid(f"'{param}.{key}' is not accepted: '{param}' sets the chat "
                          f"template's variables, not the template or its arguments",
                          param=f"{param}.{key}", code="invalid_value")
    if kwargs and len(json.dumps(kwargs, ensure_ascii=False, default=str)) \
            > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(f"'{param}' is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes",
                      param=param, code="invalid_value")
    return dict(kwargs)


def parse_message(message: Any, index: int) -> dict[str, Any]:
    """One chat message, with content-part lists flattened to a string for the template."""
    prefix = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_type(prefix, "an object")
    f = Fields(message, prefix + ".")
    role = f.string("role")
    if role not in MESSAGE_ROLES:
        raise invalid(f"'{prefix}.role' must be one of {', '.join(MESSAGE_ROLES)}",
                      param=f"{prefix}.role", code="invalid_value")
    out = dict(message)
    if role == "developer":  # OpenAI's newer name for system; chat templates know "system"
        out["role"] = "system"
    out["content"] = parse_content(message.get("content"), f"{prefix}.content")
    if isinstance(out["content"], list) and role not in ("user", "tool"):
        raise invalid(f"'{prefix}.content': images are taken in user messages and tool "
                      f"results only", param=f"{prefix}.content", code="unsupported_content")
    if out["content"] is None and role != "assistant":
        raise invalid(f"'{prefix}.content' is required", param=f"{prefix}.content",
                      code="missing_required_parameter")
    f.string("name")
    f.string("tool_call_id")
    # Both names checked (either may be given, or null); reasoning_content wins.
    reasoning = f.string("reasoning_content")
    if reasoning is None:
        reasoning = f.string("reasoning")
    out.pop("reasoning", None)
    if reasoning is not None:
        if role == "assistant" and reasoning:
            out["reasoning_content"] = reasoning
        else:
            out.pop("reasoning_content", None)
    tool_calls = f.array("tool_calls")
    if tool_calls is not None:
        if tool_calls and role != "assistant":
            raise invalid(f"'{prefix}.tool_calls' is only allowed in assistant messages",
                          param=f"{prefix}.tool_calls", code="invalid_value")
        out["tool_calls"] = [parse_tool_call(c, f"{prefix}.tool_calls[{j}]")
                             for j, c in enumerate(tool_calls)] or None
        if out["tool_calls"] is None:
            del out["tool_calls"]
    return out


def parse_tool_call(call: Any, param: str) -> dict[str, Any]:
    """An assistant message's tool call; arguments become a JSON string."""
    if not isinstance(call, dict):
        raise invalid_type(param, "an object")
    if call.get("type") not in (None, "function"):
        raise invalid(f"'{param}.type' must be 'function'", param=f"{param}.type",
                      code="invalid_value")
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid_type(f"{param}.function", "an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{param}.function.name' must be a non-empty string",
                      param=f"{param}.function.name", code="invalid_value")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        if not isinstance(arguments, dict):
            raise invalid_type(f"{param}.function.arguments", "a JSON string")
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise invalid_type(f"{param}.id", "a string")
    return {"id": call_id or "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_content(content: Any, param: str) -> str | list[dict[str, Any]] | None:
    """A message's text; with `image_url` parts, its parts in order (gateway/vision/parts.py)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(param, "a string or an array of content parts")
    what = "'text' and 'image_url' parts"
    if has_part(content, ("image_url",)):
        return mixed_parts(content, param, {"text": "text"},
                           {"image_url": openai_image_part}, what)
    return join_text_parts(content, param, {"text": "text"}, what)


def join_text_parts(parts: list, param: str, text_keys: dict[str, str], what: str) -> str:
    """The text of a list of content parts, joined by newlines. `text_keys` maps each accepted
    part type to the key holding its text; any other type is a 400 naming `what` is taken."""
    texts = []
    for j, part in enumerate(parts):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(part_param, "an object")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in text_keys:  # {} is not hashable
            raise invalid(f"'{part_param}.type' {kind!r} is not supported; only {what} are",
                          param=f"{part_param}.type", code="unsupported_content")
        text = part.get(text_keys[kind])
        if not isinstance(text, str):
            raise invalid_type(f"{part_param}.text", "a string")
        texts.append(text)
    return "\n".join(texts)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    f = Fields(body)
    note_unknown_fields(body, COMPLETION_FIELDS, "completions")
    f.reject_unsupported("logprobs", allowed=(None, 0))
    f.reject_unsupported("echo")
    f.reject_unsupported("suffix", allowed=(None, ""))
    f.reject_unsupported("best_of", allowed=(None, 1))
    constraint = structured.one_of(structured.openai_response_format(f.get("response_format")),
                                   structured.guided(body), param="response_format")
    return CompletionRequest(prompt=parse_prompt(body.get("prompt")), options=parse_options(f),
                             constraint=constraint)


def parse_prompt(prompt: Any) -> str | tuple[int, ...]:
    """A string, an array of token ids, or a one-element batch of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", param="prompt", code="invalid_value")
        return prompt
    if isinstance(prompt, list) and prompt:
        ids = [as_integer(t) for t in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return tuple(ids)
    if prompt is None:
        raise invalid("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise invalid("Only one prompt per request is supported", param="prompt",
                      code="invalid_value")
    raise invalid_type("prompt", "a non-empty string or a non-empty array of token ids")
