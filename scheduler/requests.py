"""The scheduler's view of one request and one slot. Plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import PRIORITY_INTERACTIVE, SamplingParams


@dataclass
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    priority: str
    arrived_at: float
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False
    # Prompt tokens that were already in KV when the request was placed (not prefilled).
    num_cached: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None

    @property
    def feed(self) -> tuple[int, ...]:
        """Every token the model must see: the prompt, then what it generated so far.

        All but the last are prefilled into the slot; the last is the next decode input, so
        there is always at least one token to run (F11) and the first output token comes from a
        one-token forward pass, exactly as mlx_lm.generate does.
        """
        return self.prompt + tuple(self.generated)

    @property
    def interactive(self) -> bool:
        return self.priority == PRIORITY_INTERACTIVE


@dataclass
class Slot:
    index: int
    # Tokens whose KV the worker holds in this slot, in order. Mirrors the worker exactly
    # after every StepDone; the worker trims to a command's start when it holds more.
    tokens: list[int] = field(default_factory=list)
    rid: str | None = None
    last_used: float = 0.0

    @property
    def free(self) -> bool:
        return self.rid is None


def common_prefix_len(a: list[int] | tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
