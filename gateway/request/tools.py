"""The tools a request offers and its tool_choice, in the gateway's one shape.

Definitions from every API become OpenAI function tools, `{"type": "function", "function":
{"name", "description", "parameters"}}`, the shape chat templates expect; every API's
tool_choice becomes a `ToolChoice` (request/model.py), checked against those tools here.
"""

from __future__ import annotations

from typing import Any

from switchyard.gateway.errors import invalid
from switchyard.gateway.output.tools import tool_names
from switchyard.gateway.request.wire import openai
from switchyard.gateway.request.model import AUTO, NONE, ToolChoice
from switchyard.gateway.request.wire.decoding import decode


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {
        "type": "object", "properties": {}}
    return {"type": "function", "function": function}


def parse_openai_tools(value: Any, param: str = "tools") -> list[dict[str, Any]] | None:
    """Chat Completions tools: `[{"type": "function", "function": {...}}]`."""
    return chat_function_tools(decode(value, openai.ChatTools | None, param))


def chat_function_tools(tools: list[openai.ChatTool] | None
                        ) -> list[dict[str, Any]] | None:
    return [function_tool(t.function.name, t.function.description, t.function.parameters)
            for t in tools or ()] or None


def parse_openai_tool_choice(value: Any, tools: list[dict[str, Any]] | None,
                             param: str = "tool_choice") -> ToolChoice:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name"}} (Chat) or
    {"type": "function", "name"} (Responses)."""
    return openai_tool_choice(decode(value, openai.ChatToolChoice | None, param), tools,
                              param)


def openai_tool_choice(value: str | openai.NamedToolChoice | None,
                       tools: list[dict[str, Any]] | None,
                       param: str = "tool_choice") -> ToolChoice:
    if value is None:
        return AUTO if tools else NONE
    choice = ToolChoice(value) if isinstance(value, str) \
        else ToolChoice("function", value.function_name)
    return check_tool_choice(choice, tools, param)


def check_tool_choice(choice: ToolChoice, tools: list[dict[str, Any]] | None,
                      param: str) -> ToolChoice:
    """A 400 unless the tools can answer the choice: one to call, and the one it names."""
    if choice.mode in ("required", "function") and not tools:
        raise invalid(f"'{param}' requires a tool call but no tools were given", param=param,
                      code="invalid_value")
    if choice.mode == "function" and choice.name not in tool_names(tools):
        raise invalid(f"'{param}' names the function '{choice.name}', which is not in 'tools'",
                      param=param, code="invalid_value")
    return choice
