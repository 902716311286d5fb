"""Tools for chat templates that do not render them (SmolLM2's ChatML and many small models).

Such a template drops the tool list, the calls of an assistant turn and the tool role's meaning:
the model would never see its tools, its own calls or their results, and a replayed call would
not match what the model generated (history.py needs the call's text in the rendering). The
gateway then writes them into the messages as text, the way Qwen2.5's template does for Hermes
(docs/design/requests.md "Chat formats"):

- the tool list and how to call ends the system message (one is added when there is none);
- an assistant turn's calls become its text, each written as the model writes a call
  (`ToolSyntax.render`: what the output parser and a forced call expect);
- consecutive tool results become one user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

import json
from typing import Any

from switchyard.gateway.output.tools import JSON_FAMILY, ToolSyntax

_PROBE_TOOL = "switchyard_probe_tool"
_PROBE_MESSAGES = [{"role": "user", "content": "x"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_TOOL, "parameters": {"type": "object", "properties": {}}}}]

_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                 "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
                 "\n<tools>")
_HERMES_HOW = ("For each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes a tool list it is given (a template that raises on
    one is left alone)."""
    try:
        text = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS,
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # any template error: not ours to work around
        return True
    return not isinstance(text, str) or _PROBE_TOOL in text


def text_syntax(tokenizer: Any, syntax: ToolSyntax) -> ToolSyntax | None:
    """The syntax to write tools as text with, or None when the template renders them itself
    (or the syntax cannot write a call)."""
    if syntax.render is None or template_renders_tools(tokenizer):
        return None
    return syntax


def tools_prompt(tools: list[dict[str, Any]], syntax: ToolSyntax) -> str:
    listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    if syntax.family == JSON_FAMILY:
        how = _HERMES_HOW
    else:
        example = syntax.render("function_name", {"argument": "value"})
        how = f"For each function call, write it as in this example:\n{example}"
    return f"{_TOOLS_HEADER}{listing}\n</tools>\n\n{how}"


def _call_text(call: dict[str, Any], syntax: ToolSyntax) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    return syntax.render(str(function.get("name")), arguments if arguments is not None else {})


def messages_with_tools_as_text(messages: list[dict[str, Any]],
                                tools: list[dict[str, Any]] | None,
                                syntax: ToolSyntax) -> list[dict[str, Any]]:
    """`messages` (as history.template_messages gives them) with tools, calls and results
    written as text; the template is then applied without tools."""
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn the current run of results goes to
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if results is not None:
                results["content"] += "\n" + block
            else:
                results = {"role": "user", "content": block}
                out.append(results)
            continue
        results = None
        if role == "assistant" and message.get("tool_calls"):
            content = message.get("content") or ""
            calls = "\n".join(_call_text(c, syntax) for c in message["tool_calls"])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{calls}" if content else calls
        out.append(message)
    if tools:
        prompt = tools_prompt(tools, syntax)
        if out and out[0].get("role") == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{prompt}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
