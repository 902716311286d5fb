"""Chat Completions and Completions requests: decoded against their models
(request/wire/openai.py: the shape, its checks and limits) and translated into the gateway's
request shapes.

Unknown fields are ignored, as OpenAI does; a known field of the wrong type or out of range is a
400 that names the field. Nothing here touches the tokenizer or the network.
"""

from __future__ import annotations

import json
from typing import Any

from switchyard.gateway.request import wire
from switchyard.gateway.request import structured
from switchyard.gateway.request.model import ChatRequest, CompletionRequest, Options
from switchyard.gateway.errors import invalid, invalid_type
from switchyard.gateway.request.tools import chat_function_tools, openai_tool_choice
from switchyard.gateway.vision.parts import from_url, image_part
from switchyard.gateway.request.wire.common import (MAX_TEMPLATE_KWARGS_BYTES,
                                                    RESERVED_TEMPLATE_KEYS)
from switchyard.gateway.request.wire.decoding import decode_body

_SEED_MODULUS = 2**63


def _options(request: wire.openai.OptionsRequest) -> Options:
    """Sampling, limits and streaming options shared by both endpoints."""
    max_tokens = request.max_completion_tokens  # wins over the older max_tokens
    stop = request.stop
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return Options(
        model=request.model,
        max_tokens=request.max_tokens if max_tokens is None else max_tokens,
        temperature=_default(request.temperature, 1.0),
        top_p=_default(request.top_p, 1.0),
        top_k=_default(request.top_k, 0),
        min_p=_default(request.min_p, 0.0),
        seed=None if request.seed is None else request.seed % _SEED_MODULUS,
        stop=tuple(s for s in stop if s),
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        priority=request.priority,
        user=request.user,
        # the worker adds each bias to its token's logit; ids are checked by the caller
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in (request.logit_bias or {}).items())),
        speculative=request.speculative is not False,
        cache_salt=request.cache_salt,
    )


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def response_format(value: wire.openai.ResponseFormat | None, body: dict[str, Any]
                    ) -> structured.Constraint | None:
    """`response_format`, or vLLM's guided fields (read as the body gives them)."""
    return structured.one_of(structured.format_constraint(value, "response_format"),
                             structured.guided(body), param="response_format")


def template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs"
                    ) -> dict[str, Any]:
    """The template variables a request sets; a reserved key or oversized values are a 400."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KEYS:
            raise invalid(f"'{param}.{key}' is not accepted: '{param}' sets the chat "
                          f"template's variables, not the template or its arguments",
                          param=f"{param}.{key}", code="invalid_value")
    size = len(json.dumps(kwargs, ensure_ascii=False, default=str)) if kwargs else 0
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(f"'{param}' is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes",
                      param=param, code="invalid_value")
    return dict(kwargs)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    request = decode_body(body, wire.openai.ChatCompletionRequest, "chat.completions")
    constraint = response_format(request.response_format, body)
    tools = chat_function_tools(request.tools)
    kwargs = request.chat_template_kwargs or {}
    effort = request.reasoning_effort  # the template's value (wire/common.py EffortLevel)
    if effort and "reasoning_effort" not in kwargs:
        kwargs = {**kwargs, "reasoning_effort": effort}
    return ChatRequest(
        messages=[chat_message(m, raw, i)
                  for i, (m, raw) in enumerate(zip(request.messages, body["messages"]))],
        options=_options(request),
        tools=tools,
        tool_choice=openai_tool_choice(request.tool_choice, tools),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        template_kwargs=template_kwargs(kwargs),
        constraint=constraint,
        strict_tools=frozenset(t.function.name for t in request.tools or ()
                               if t.function.strict),
    )


def chat_message(message: wire.openai.ChatMessage, raw: dict[str, Any], index: int
                 ) -> dict[str, Any]:
    """One chat message as the template takes it: the client's members as it sent them
    (the template may read any), content parts flattened to a string (with images: the parts,
    gateway/vision/parts.py), `developer` as `system`, reasoning under one name."""
    role = message.__struct_config__.tag
    out = dict(raw)
    if role == "developer":  # OpenAI's newer name for system; chat templates know "system"
        out["role"] = "system"
    out["content"] = _content(message.content, f"messages[{index}].content")
    reasoning = message.reasoning_content  # reasoning_content wins
    if reasoning is None:
        reasoning = message.reasoning
    out.pop("reasoning", None)
    if reasoning is not None:
        if role == "assistant" and reasoning:
            out["reasoning_content"] = reasoning
        else:
            out.pop("reasoning_content", None)
    if message.tool_calls is not None:
        out["tool_calls"] = [_tool_call(c) for c in message.tool_calls] or None
        if out["tool_calls"] is None:
            del out["tool_calls"]
    return out


def _tool_call(call: wire.openai.ToolCall) -> dict[str, Any]:
    """An assistant message's tool call; arguments become a JSON string."""
    arguments = call.function.arguments
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.id or "", "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def _content(content: wire.openai.Content | None, param: str) -> str | list[dict[str, Any]] | None:
    if content is None or isinstance(content, str):
        return content
    if not any(isinstance(p, wire.openai.ImageUrlPart) for p in content):
        return "\n".join(p.text for p in content)
    return [_image(p, f"{param}[{j}]") if isinstance(p, wire.openai.ImageUrlPart)
            else {"type": "text", "text": p.text} for j, p in enumerate(content)]


def _image(part: wire.openai.ImageUrlPart, param: str) -> dict[str, Any]:
    value = part.image_url
    if isinstance(value, str):
        return image_part(from_url(value, f"{param}.image_url"))
    return image_part(from_url(value.url, f"{param}.image_url.url"))


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    request = decode_body(body, wire.openai.CompletionRequest, "completions")
    constraint = response_format(request.response_format, body)
    return CompletionRequest(prompt=parse_prompt(request.prompt), options=_options(request),
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
        # JSON has one number type: 5.0 is the token id 5 (as JSON Schema takes it)
        ids = [int(t) if isinstance(t, float) and t.is_integer() else t for t in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return tuple(ids)
    if prompt is None:
        raise invalid("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise invalid("Only one prompt per request is supported", param="prompt",
                      code="invalid_value")
    raise invalid_type("prompt", "a non-empty string or a non-empty array of token ids")
