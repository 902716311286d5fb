"""Scripted replies on the gateway's side: what of a request a script's rules read, and the reply
a rule gives as the served model writes it (common/script.py has the format;
docs/design/requests.md "Scripted replies").

The reply is text in the model's own chat format (its tool-call syntax), tokenized as the
template's rendering of it would be, and every one of its tokens is forced through the same
constrained-decoding path as strict tool calls: a grammar of exactly those tokens, after which
only end-of-sequence is allowed. Prefill, decode, KV pages, parsing, streaming and every API's
response shape stay the real ones.
"""

from __future__ import annotations

from typing import Any

from switchyard.gateway.errors import APIError
from switchyard.gateway.output.tools import ToolSyntax, tool_names
from switchyard.gateway.request.model import ChatRequest
from switchyard.gateway.request.structured import Constraint, checked
from switchyard.common.script import Rule, Script

SYSTEM_ROLES = ("system", "developer")


def content_text(content: Any) -> str:
    """A message's text: a string, or its text parts joined by newlines (images skipped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def request_texts(chat: ChatRequest) -> tuple[str, str, list[str]]:
    """(system prompt, last user turn, tool names) of a chat, as the rules read them: system
    messages anywhere belong to the system prompt; the last turn is what follows the last
    assistant message (its user text and tool results)."""
    system, last = [], []
    for message in chat.messages:
        text = content_text(message.get("content"))
        if message.get("role") in SYSTEM_ROLES:
            system.append(text)
        elif message.get("role") == "assistant":
            last = []
        elif text:
            last.append(text)
    return "\n".join(system), "\n".join(last), tool_names(chat.tools)


def scripted_rule(script: Script | None, chat: ChatRequest) -> Rule | None:
    if script is None:
        return None
    return script.reply(*request_texts(chat))


def reply_text(rule: Rule, syntax: ToolSyntax | None) -> str:
    """The rule's reply as the model writes it: its text, then each call in the model's own
    call syntax."""
    parts = [rule.say] if rule.say else []
    for call in rule.calls:
        if syntax is None or syntax.render is None:
            raise APIError(500, "The script's rule calls a tool, but the served model's call "
                           f"format ({syntax.family if syntax else 'none'}) cannot be written "
                           "by a script", type="server_error", code="script_unsupported")
        parts.append(syntax.render(call.name, call.arguments))
    return "\n".join(parts)


def forced_reply(tokenizer: Any, text: str) -> Constraint:
    """A grammar that is exactly `text`'s tokens, each one forced, then the end of the turn."""
    import llguidance

    ids = tokenizer.encode(text, add_special_tokens=False)
    grammar = "start: " + " ".join(f"<[{i}]>" for i in ids) + "\n"
    return checked(llguidance.LLMatcher.grammar_from_lark(grammar), "script")
