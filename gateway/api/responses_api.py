"""OpenAI Responses API (`POST /v1/responses`), for Codex-style clients.

A request is decoded against its model (request/wire/responses.py). `input` (a string, or
items: messages, `function_call`, `function_call_output`, `reasoning`) and `instructions` are
translated into the gateway's one chat shape (request.model.ChatRequest):
consecutive assistant items (reasoning, an output message, function calls) become one assistant
message, function-call outputs become tool messages. `previous_response_id` prepends the stored
conversation of that response (response_store.py); one the server no longer has is a 400 asking
for the full input. Streaming follows the Responses event lifecycle: response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta/done,
reasoning_text.delta/done, function_call_arguments.delta/done, output_item.done, and
response.completed (response.incomplete when max_output_tokens cut the output).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from switchyard.gateway.context import RequestContext
from switchyard.gateway.driver import respond, start_chat
from switchyard.gateway.errors import APIError, invalid
from switchyard.gateway.output.parser import Event, ReasoningDelta, TextDelta, ToolCallDone, ToolCallStart
from switchyard.gateway.prompting.prompts import check_model
from switchyard.gateway.request import structured
from switchyard.gateway.request.response_store import ResponseStore
from switchyard.gateway.streaming import EventStreamResponse, sse_event
from switchyard.gateway.request.tools import function_tool, openai_tool_choice
from switchyard.gateway.turn import ChatTurn, TurnResult, assistant_message
from switchyard.gateway.api.json_body import chat_limits, read_json
from switchyard.gateway.request import wire
from switchyard.gateway.request.wire.decoding import decode, decode_body, note_ignored
from switchyard.gateway.vision.parts import from_url, image_part
from switchyard.gateway.request.model import ChatRequest, Options, ToolChoice
from switchyard.proto.ids import new_rid

def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# --- request ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    instructions: str | None
    previous_response_id: str | None
    store: bool
    namespaces: dict[str, str] = dataclasses.field(default_factory=dict)


def _text(content: wire.responses.TextContent | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content)


def _content(content: wire.responses.Content | None, param: str) -> str | list[dict[str, Any]]:
    """A user message's or a function call output's text; with `input_image` parts, its parts
    in order (gateway/vision/parts.py)."""
    if not isinstance(content, list) \
            or not any(type(p) is wire.responses.InputImage for p in content):
        return _text(content)
    return [image_part(from_url(p.image_url, f"{param}[{j}].image_url"))
            if type(p) is wire.responses.InputImage else {"type": "text", "text": p.text}
            for j, p in enumerate(content)]


class _InputBuilder:
    """Turns input items into chat messages, merging consecutive assistant items."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._assistant: dict[str, Any] | None = None

    def _open_assistant(self) -> dict[str, Any]:
        if self._assistant is None:
            self._assistant = {"role": "assistant", "content": ""}
        return self._assistant

    def _flush(self) -> None:
        if self._assistant is not None:
            self.messages.append(self._assistant)
            self._assistant = None

    def add(self, item: wire.responses.Item, param: str) -> None:
        if isinstance(item, wire.responses.MessageItem):
            text = _content(item.content, f"{param}.content")
            if item.role == "assistant":
                message = self._open_assistant()
                message["content"] = (message["content"] + "\n" + text) \
                    if message["content"] else text
                return
            self._flush()
            self.messages.append({"role": "system" if item.role == "developer" else item.role,
                                  "content": text})
        elif isinstance(item, wire.responses.FunctionCallItem):
            message = self._open_assistant()
            message.setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"}})
        elif isinstance(item, wire.responses.FunctionCallOutputItem):
            self._flush()
            self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                                  "content": _content(item.output, f"{param}.output")})
        elif isinstance(item, wire.responses.ReasoningItem):
            text = _text(item.content) or _text(item.summary)
            message = self._open_assistant()  # even empty: the input is never no messages
            if text:
                previous = message.get("reasoning_content")
                message["reasoning_content"] = f"{previous}\n{text}" if previous else text

    def done(self) -> list[dict[str, Any]]:
        self._flush()
        return self.messages


def typed_items(value: Any) -> Any:
    """`input` with each message's `type` filled in (OpenAI's EasyInputMessage leaves it out,
    or null)."""
    if not isinstance(value, list):
        return value
    return [{**item, "type": "message"} if isinstance(item, dict) and item.get("type") is None
            and "role" in item else item for item in value]


def parse_input(value: Any) -> list[dict[str, Any]]:
    return chat_messages(decode(typed_items(value), wire.responses.Input, "input"))


def chat_messages(value: str | list[wire.responses.Item]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    builder = _InputBuilder()
    for i, item in enumerate(value):
        builder.add(item, f"input[{i}]")
    return builder.done()


@dataclass(frozen=True)
class ResponsesTools:
    functions: list[dict[str, Any]] | None  # as chat tools
    namespaces: dict[str, str]  # a function's name -> the namespace it was offered in
    strict: frozenset[str]  # the functions that ask for strict arguments


def parse_tools(value: Any) -> ResponsesTools:
    return offered_tools(decode(value, list[dict[str, Any]] | None, "tools"))


def offered_tools(tools: list[dict[str, Any]] | None) -> ResponsesTools:
    """Responses tools are flat: `{"type": "function", "name", "description", "parameters"}`;
    a `namespace` groups functions (Codex's sub-agent tools), offered to the model as functions
    of their own names and returned as calls with their `namespace`. Built-in tool types
    (web search, file search, code interpreter, ...) run on OpenAI's servers, not here: they
    are left out of the prompt, logged once per type, and a `tool_choice` forcing one is a
    400."""
    functions: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    strict: set[str] = set()
    names: set[str] = set()
    builtins: set[str] = set()
    if tools is None:
        return ResponsesTools(None, namespaces, frozenset())

    def add(tool: wire.responses.FunctionTool | str, param: str, namespace: str | None) -> None:
        if isinstance(tool, str):
            builtins.add(tool[:64])
            return
        if tool.name in names:
            raise invalid(f"'{param}.name': the function '{tool.name}' is offered twice",
                          param=f"{param}.name", code="invalid_value")
        names.add(tool.name)
        functions.append(function_tool(tool.name, tool.description, tool.parameters))
        if namespace is not None:
            namespaces[tool.name] = namespace
        if tool.strict:
            strict.add(tool.name)

    for i, value in enumerate(tools):
        tool = wire.responses.tool(value, f"tools[{i}]")
        if not isinstance(tool, wire.responses.NamespaceTool):
            add(tool, f"tools[{i}]", None)
            continue
        for j, inner in enumerate(tool.tools or ()):
            param = f"tools[{i}].tools[{j}]"
            add(wire.responses.tool(inner, param, in_namespace=True), param, tool.name)
    for kind in builtins:
        note_ignored(f"responses.tools[].type={kind}")
    return ResponsesTools(functions or None, namespaces, frozenset(strict))


def previous_not_found(response_id: str) -> APIError:
    return invalid(
        f"Previous response with id '{response_id}' not found. This server keeps only recent "
        "responses in memory; send the full conversation in 'input' instead of "
        "'previous_response_id'.", param="previous_response_id",
        code="previous_response_not_found")


def parse_responses_request(body: dict[str, Any], store: ResponseStore) -> ResponsesRequest:
    typed = {**body, "input": typed_items(body.get("input"))} \
        if isinstance(body.get("input"), list) else body
    request = decode_body(typed, wire.responses.ResponsesRequest, "responses")
    text_format = request.text.format if request.text is not None else None
    answer_format = structured.format_constraint(text_format, "text.format")
    instructions = request.instructions
    previous_id = request.previous_response_id
    history: list[dict[str, Any]] = []
    if previous_id:
        stored = store.get(previous_id)
        if stored is None:
            raise previous_not_found(previous_id)
        history = list(stored)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) \
        + history + chat_messages(request.input)
    offered = offered_tools(request.tools)
    effort = request.reasoning.effort if request.reasoning else None  # as templates take it
    options = Options(
        model=request.model, max_tokens=request.max_output_tokens,
        temperature=_default(request.temperature, 1.0), top_p=_default(request.top_p, 1.0),
        stream=bool(request.stream), priority=request.priority, user=request.user,
        speculative=request.speculative is not False, cache_salt=request.cache_salt)
    chat = ChatRequest(messages=messages, options=options, tools=offered.functions,
                       tool_choice=openai_tool_choice(request.tool_choice, offered.functions),
                       parallel_tool_calls=request.parallel_tool_calls is not False,
                       template_kwargs={"reasoning_effort": effort} if effort else {},
                       constraint=structured.one_of(answer_format, structured.guided(body),
                                                    param="text.format"),
                       strict_tools=offered.strict)
    return ResponsesRequest(chat, instructions, previous_id, request.store is not False,
                            offered.namespaces)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


# --- response --------------------------------------------------------------------------------


def responses_usage(result: TurnResult) -> dict[str, Any]:
    usage = result.usage
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _tool_choice_json(choice: ToolChoice) -> Any:
    return {"type": "function", "name": choice.name} if choice.mode == "function" \
        else choice.mode


class ResponsesFormat:
    keepalive = b": keepalive\n\n"

    def __init__(self, response_id: str, model: str, parsed: ResponsesRequest) -> None:
        self.response_id = response_id
        self.model = model
        self.parsed = parsed
        self.created_at = int(time.time())
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items so far (done or open)
        self._open: dict[str, Any] | None = None
        self._pending_space = ""

    # --- the response object ----------------------------------------------------------------

    def response(self, status: str, output: list[dict[str, Any]],
                 result: TurnResult | None = None, error: dict | None = None) -> dict[str, Any]:
        chat = self.parsed.chat
        tools = [{"type": "function", "name": t["function"]["name"],
                  "description": t["function"].get("description"),
                  "parameters": t["function"].get("parameters"), "strict": False}
                 for t in chat.tools or ()]
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": self.parsed.instructions,
            "max_output_tokens": chat.options.max_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": self.parsed.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": self.parsed.store,
            "temperature": chat.options.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": _tool_choice_json(chat.tool_choice), "tools": tools,
            "top_p": chat.options.top_p, "truncation": "disabled",
            "usage": responses_usage(result) if result else None,
            "user": chat.options.user, "metadata": {},
        }

    @staticmethod
    def status_of(result: TurnResult) -> str:
        return "incomplete" if result.finish_reason == "length" else "completed"

    def output_items(self, result: TurnResult) -> list[dict[str, Any]]:
        items = []
        if result.reasoning:
            items.append(_reasoning_item(_new_id("rs_"), result.reasoning))
        if result.content.strip():
            items.append(_message_item(_new_id("msg_"), result.content, "completed"))
        for call in result.tool_calls:
            items.append(_call_item(_new_id("fc_"), call.id, call.name, call.arguments,
                                    "completed" if call.complete else "incomplete",
                                    self.parsed.namespaces.get(call.name)))
        return items

    def body(self, result: TurnResult) -> dict[str, Any]:
        return self.response(self.status_of(result), self.output_items(result), result)

    # --- the stream -------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)

    def head(self) -> list[bytes]:
        snapshot = self.response("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._items.append(item)
        self._open = item
        shown = {**item}
        if item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "reasoning":
            shown["content"] = []
        elif item["type"] == "function_call":
            shown["arguments"] = ""
        frames.append(self._event("response.output_item.added",
                                  output_index=len(self._items) - 1, item=shown))
        if item["type"] == "message":
            frames.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._items) - 1, content_index=0,
                                      part={"type": "output_text", "text": "",
                                            "annotations": []}))
        return frames

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items) - 1
        frames = []
        if item["type"] == "message":
            part = item["content"][0]
            frames.append(self._event("response.output_text.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      text=part["text"], logprobs=[]))
            frames.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))
        elif item["type"] == "reasoning":
            frames.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            frames.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        item["status"] = "incomplete" if item.get("status") == "incomplete" else "completed"
        frames.append(self._event("response.output_item.done", output_index=index,
                                  item=item))
        return frames

    def frames(self, events: list[Event]) -> list[bytes]:
        frames: list[bytes] = []
        for event in events:
            open_type = self._open["type"] if self._open else None
            index = len(self._items) - 1
            if isinstance(event, ReasoningDelta):
                if open_type != "reasoning":
                    frames += self._add(_reasoning_item(_new_id("rs_"), ""))
                    index = len(self._items) - 1
                self._open["content"][0]["text"] += event.text
                frames.append(self._event("response.reasoning_text.delta",
                                          item_id=self._open["id"], output_index=index,
                                          content_index=0, delta=event.text))
            elif isinstance(event, TextDelta):
                if open_type != "message":
                    if not event.text.strip():
                        self._pending_space += event.text
                        continue
                    frames += self._add(_message_item(_new_id("msg_"), "", "in_progress"))
                    index = len(self._items) - 1
                text, self._pending_space = self._pending_space + event.text, ""
                self._open["content"][0]["text"] += text
                frames.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                          output_index=index, content_index=0, delta=text,
                                          logprobs=[]))
            elif isinstance(event, ToolCallStart):
                self._pending_space = ""
                frames += self._add(_call_item(_new_id("fc_"), event.id, event.name, "",
                                               "in_progress",
                                               self.parsed.namespaces.get(event.name)))
            elif isinstance(event, ToolCallDone):
                item = self._open
                item["arguments"] = event.call.arguments
                if not event.call.complete:  # cut by max_output_tokens
                    item["status"] = "incomplete"
                frames.append(self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=index,
                                          delta=event.call.arguments))
                frames += self._close()
        return frames

    def tail(self, result: TurnResult) -> list[bytes]:
        frames = self._close()
        status = self.status_of(result)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        frames.append(self._event(kind, response=self.response(status, self._items, result)))
        return frames

    def error_frames(self, error: APIError) -> list[bytes]:
        failed = self.response("failed", self._items,
                               error={"code": error.code or "server_error",
                                      "message": error.message})
        return [self._event("response.failed", response=failed)]


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str, namespace: str | None = None) -> dict[str, Any]:
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


# --- handler ---------------------------------------------------------------------------------


def seen_messages(messages: list[dict[str, Any]], unseen: frozenset[int]
                  ) -> list[dict[str, Any]]:
    """The conversation as the model saw it: reasoning the template did not render dropped
    (the store keeps only that). Messages kept as they are stay the same
    objects (the store counts a history shared between responses once)."""
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if i in unseen else m
            for i, m in enumerate(messages)]


async def create_response(request: Request) -> Response:
    ctx = RequestContext.of(request)
    gw, store = ctx.gateway, ctx.responses()
    limits = chat_limits(gw.settings.ctx, "input")
    body = await read_json(ctx, limits)
    parsed = parse_responses_request(body, store)
    check_model(parsed.chat.options.model, gw.model_id, gw.model_aliases)
    response_id = _new_id("resp_")
    fmt = ResponsesFormat(response_id, gw.model_id, parsed)
    # The scheduler's rid is shown in status snapshots: never the response id, which is a
    # capability (previous_response_id).
    try:
        turn, submit = await start_chat(ctx, parsed.chat, rid=new_rid("resp"),
                                        param="input", note_unseen=parsed.store)
    except APIError as error:
        if parsed.chat.options.stream and error.code == "context_length_exceeded":
            return _failed_stream(ctx, fmt, error)
        raise
    if parsed.store:
        instructions = 1 if parsed.instructions else 0
        conversation = seen_messages(parsed.chat.messages,
                                     turn.plan.rendered.unseen_reasoning)[instructions:]

        def keep(_: ChatTurn, result: TurnResult) -> None:
            store.put(response_id, conversation + [assistant_message(result)])

        turn.on_result = keep
    return await respond(ctx, turn, submit, fmt, stream=parsed.chat.options.stream)


def _failed_stream(ctx: RequestContext, fmt: ResponsesFormat, error: APIError) -> Response:
    """A streamed response that fails at once: created, then `response.failed` with the
    error's code. Codex learns that its context is full only from such a stream (an HTTP 400
    is an invalid request to it), and then compacts (docs/design/requests.md "The context limit")."""
    ctx.record.fail(error)

    async def frames():
        for frame in fmt.head() + fmt.error_frames(error):
            yield frame

    return EventStreamResponse(frames())
