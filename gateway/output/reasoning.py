"""Reasoning (`<think>` ... `</think>`) markers and how earlier reasoning is rendered.

Markers come from the model's chat format (formats.py: `<think>`, Mistral's `[THINK]`, Gemma
4's thought channel; gpt-oss's analysis channel is parsed in harmony.py). Reasoning is
recognised only where a reasoning model writes it: at the very start of the output, or from the
start when the prompt itself opened a think block (templates of thinking-only models end their
generation prompt with `<think>\n`). Elsewhere the markers are plain text.

Earlier reasoning in the history: with `keep_reasoning` (the default) an assistant turn the
gateway remembers is rendered with its reasoning exactly as generated (prefix-stable, see
history.py), and a client's `reasoning_content` / thinking blocks are passed to the template.
Without it reasoning is dropped from every earlier turn before rendering: shorter prompts, but
each turn's cache ends where its previous answer began.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_KEEP_REASONING = True


@dataclass(frozen=True)
class ThinkSyntax:
    start: str
    end: str


def prompt_opens_reasoning(prompt_tail: str, syntax: ThinkSyntax | None) -> bool:
    """Whether the prompt ends inside an open think block (the output starts as reasoning)."""
    if syntax is None:
        return False
    start = prompt_tail.rfind(syntax.start)
    return start >= 0 and prompt_tail.find(syntax.end, start) < 0


def without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"}
            if "reasoning_content" in m else m for m in messages]
