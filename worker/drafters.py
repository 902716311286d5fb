"""Drafts made in the worker (docs/design/speculative-decoding.md "Speculative decoding"): proposers that need the
model's machinery (a draft model, multi-token-prediction heads) rather than the text alone.

The scheduler asks for them per decoding row (`DecodeItem.draft_tokens`: at most that many);
the executor hands the rows to its drafter, puts the drafts in the rows and runs the one
verify pass of the main model that every draft goes through, whoever made it
(common/speculation.py decides). A drafter's drafts are greedy (a point mass), which keeps the
verifier exact for sampled requests too.

A drafter keeps its own state per slot (a draft model's KV, say). That state covers a prefix
of the slot's tokens and trails it: `propose` first brings each row's state to the row's
tokens (a bounded number of tokens per step: a row further behind gets no draft this step),
and `cut` takes it back when the slot is cut (rejected draft tokens). Nothing of it is paged:
it is rebuilt from tokens, so a restored slot simply catches up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRow:
    """One decoding row that wants a draft."""

    slot: int
    # The slot's tokens up to and including this step's input token (the draft follows it).
    tokens: Sequence[int]
    max_tokens: int  # most draft tokens wanted (the drafter may make fewer, or none)
    stop_token_ids: tuple[int, ...] = ()  # a draft ends at (and includes) the first of these


class Drafter(Protocol):
    # What the drafts are, for logs and `request.finished`: "draft" (a draft model), "mtp".
    kind: str

    def propose(self, rows: Sequence[DraftRow]) -> list[tuple[int, ...]]:
        """One draft per row (empty: none this step, e.g. the row is still catching up),
        computed for all rows together (batched)."""
        ...

    def catch_up(self, slot: int, tokens: Sequence[int]) -> bool:
        """Bring the slot's state toward `tokens` (cutting what differs, feeding at most the
        drafter's per-step bound); True when the row can be drafted for in this step (what
        it still lacks is a few tokens the draft pass itself feeds)."""
        ...

    def cut(self, slot: int, length: int) -> None:
        """The slot now holds only its first `length` tokens: drop state past them."""
        ...

    def release(self, slot: int) -> None:
        """The slot's conversation is gone: free its state."""
        ...

    def take_stats(self) -> tuple[float, int]:
        """Seconds spent drafting (catching up included) and batched draft passes run since
        the last call."""
        ...

    # Optional (the executor asks with getattr): `take_catch_up_tokens() -> int`, tokens
    # prefilled to catch rows up since the last call; a step that caught up is not a measure
    # of what a draft pass costs.


def draft_end(draft: Sequence[int], stop_token_ids: Sequence[int]) -> int:
    """How much of a draft is worth verifying: up to and including its first stop token."""
    for i, token in enumerate(draft):
        if token in stop_token_ids:
            return i + 1
    return len(draft)


def vocab_difference(model_vocab: dict[str, int], model_eos: set[int],
                     draft_vocab: dict[str, int], draft_eos: set[int]) -> str:
    """Why a draft model's tokenizer cannot draft for the model ('' when it can): its drafts
    are token ids the model must read as the same text, and it must stop where the model does.
    Compared: the vocabulary's size, its token -> id map, and the end-of-sequence ids."""
    if len(model_vocab) != len(draft_vocab):
        return f"vocabularies of {len(draft_vocab)} and {len(model_vocab)} tokens"
    if model_vocab != draft_vocab:
        token = next(t for t, i in sorted(draft_vocab.items(), key=lambda kv: kv[1])
                     if model_vocab.get(t) != i)
        return (f"token {token!r} is id {draft_vocab[token]} in the draft model's vocabulary "
                f"and {model_vocab.get(token)} in the model's")
    if set(model_eos) != set(draft_eos):
        return (f"end-of-sequence ids {sorted(draft_eos)} (draft model) and "
                f"{sorted(model_eos)} (model)")
    return ""
