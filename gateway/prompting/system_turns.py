"""System messages after the conversation has begun, rendered where they stand.

Agent clients now send system messages between turns: Claude Code's list of agent types after
the first user turn (Anthropic `role: "system"` in `messages`), a Responses `developer` item
between turns. Moving such a message into the leading system block, as several servers do,
changes the prefix of every later turn, and every turn re-reads the conversation. So it stays
at its position (docs/design/requests.md "Chat formats"):

- where the template writes a system turn at that position (ChatML, Qwen3, Llama 3, GLM, Gemma
  4; found once per template by `renders_system_in_place`), the message is left as it is;
- otherwise (a template that drops it, raises on it or hoists it to the start: gpt-oss,
  Mistral, MiniMax, DeepSeek), its text joins the user side at the same place, the way such
  templates fold a leading system prompt into the first user turn: appended to the user
  message before it, else put before the user message after it, else a user message of its
  own.

Leading system messages (several `developer` items before the first user turn) are left to
the template when it renders system turns in place, and joined into one otherwise.
"""

from __future__ import annotations

from typing import Any

_BEFORE, _SYSTEM, _AFTER = "switchyard-probe-user", "switchyard-probe-system", "switchyard-probe-next"
_PROBES = (
    [{"role": "user", "content": _BEFORE}, {"role": "system", "content": _SYSTEM}],
    [{"role": "user", "content": _BEFORE}, {"role": "assistant", "content": "a"},
     {"role": "system", "content": _SYSTEM}, {"role": "user", "content": _AFTER}],
)
SEPARATOR = "\n\n"


def renders_system_in_place(tokenizer: Any) -> bool:
    """Whether the chat template writes a system message after the first user turn where it
    stands (after the messages before it, before the ones after it)."""
    for messages in _PROBES:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception:  # any template error: it does not take a system message there
            return False
        if not isinstance(text, str):
            return False
        at = text.find(_SYSTEM)
        if at < 0 or not 0 <= text.find(_BEFORE) < at \
                or (_AFTER in messages[-1]["content"] and text.find(_AFTER) < at):
            return False
    return True


def place_system_messages(messages: list[dict[str, Any]], in_place: bool
                          ) -> tuple[list[dict[str, Any]], list[int]]:
    """The messages as the template is given them, and for each the index of the message it
    comes from (a user message that took in a system message keeps its own index)."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if in_place or (lead <= 1 and not any(m.get("role") == "system" for m in messages[lead:])):
        return messages, list(range(len(messages)))
    out: list[dict[str, Any]] = []
    origin: list[int] = []
    if lead:
        out.append({"role": "system", "content": SEPARATOR.join(
            _text(m.get("content")) for m in messages[:lead])})
        origin.append(0)
    pending: list[str] = []  # system texts waiting for the user message after them
    for i in range(lead, len(messages)):
        message = messages[i]
        role = message.get("role")
        if role == "system":
            text = _text(message.get("content"))
            if out and out[-1].get("role") == "user" and not pending:
                out[-1] = _joined(out[-1], text, after=True)
            else:
                pending.append(text)
            continue
        if pending and role == "user":
            message = _joined(message, SEPARATOR.join(pending), after=False)
        elif pending:
            out.append({"role": "user", "content": SEPARATOR.join(pending)})
            origin.append(i - 1)
        pending = []
        out.append(message)
        origin.append(i)
    if pending:
        out.append({"role": "user", "content": SEPARATOR.join(pending)})
        origin.append(len(messages) - 1)
    return out, origin


def _text(content: Any) -> str:
    return content if isinstance(content, str) else ""


def _joined(message: dict[str, Any], text: str, *, after: bool) -> dict[str, Any]:
    """A user message with `text` after (or before) its own content, string or parts."""
    content = message.get("content")
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        content = [*content, part] if after else [part, *content]
    else:
        own = content or ""
        content = (own + SEPARATOR + text if own else text) if after \
            else (text + SEPARATOR + own if own else text)
    return {**message, "content": content}
