"""A draft model (`--draft-model`): a smaller model with the model's tokenizer drafts tokens
greedily for every decoding row together (docs/design/speculative-decoding.md "Speculative decoding").

It has slots of its own, one per slot of the model (a SlotStore: rows of their own lengths in
one batch, as the verify pass has), holding a prefix of the slot's tokens. Per step: a row is
brought to its slot's tokens (what differs is cut back, at most `catch_up_tokens` missing
tokens are prefilled; a row further behind gets no draft this step), then one batched pass
feeds each row's last few tokens (its input, and the last accepted draft token) and k - 1
batched single-token passes follow, each feeding the previous pass's greedy token, all queued
before a token is read back. The draft model's KV is never paged: it is rebuilt from tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from switchyard.common.tokenizer_loading import TokenizerLoadError, load_tokenizer
from switchyard.worker.cache_kinds import leaves
from switchyard.worker.drafters import DraftRow, draft_end, vocab_difference
from switchyard.worker.errors import ModelLoadError
from switchyard.worker.model_loading import LoadedModel, load_model
from switchyard.worker.slots import SlotStore

# Tokens a row may lack and still be drafted for: the draft pass feeds them (after a fully
# accepted draft a row lacks its last draft token and the model's own next token).
_TAIL = 4


class DraftModelDrafter:
    kind = "draft"

    def __init__(self, store: SlotStore, catch_up_tokens: int, vocab_limit: int):
        self.store = store
        # Most tokens prefilled to catch rows up in one step, all rows together (a step
        # then costs at most about one more prefill chunk).
        self.catch_up_tokens = max(1, catch_up_tokens)
        self._budget = self.catch_up_tokens  # what is left of it in this step
        self._caught_up = 0  # tokens prefilled to catch up since the last take
        # Ids past the model's embedding (a draft model's padded vocabulary) are never drafted.
        self.vocab_limit = vocab_limit
        self._seconds = 0.0
        self._passes = 0

    def catch_up(self, slot: int, tokens: Sequence[int]) -> bool:
        store = self.store
        held = store.tokens[slot]
        common = min(_common_prefix(held, tokens), len(tokens) - 1)
        store.cut_back(slot, common)
        missing = len(tokens) - common
        if missing <= _TAIL:
            return True
        fed = min(self._budget, missing - 1)
        if fed > 0:
            store.prefill(slot, common, list(tokens[common:common + fed]))
            self._budget -= fed
            self._caught_up += fed
        return missing - fed <= _TAIL

    def propose(self, rows: Sequence[DraftRow]) -> list[tuple[int, ...]]:
        started = time.perf_counter()
        store = self.store
        self._budget = self.catch_up_tokens
        ready = [r for r in rows if r.max_tokens > 0 and self.catch_up(r.slot, r.tokens)]
        self._budget = self.catch_up_tokens
        drafts: dict[int, list[int]] = {}
        if ready:
            slots = [r.slot for r in ready]
            positions = [len(store.tokens[s]) for s in slots]
            tails = [list(r.tokens[p:]) for r, p in zip(ready, positions)]
            logits = store.verify(slots, positions, tails)
            last = logits[mx.arange(len(tails)), mx.array([len(t) - 1 for t in tails])]
            first = mx.argmax(last, axis=-1)
            store.keep(slots, tails, [len(t) for t in tails])
            longest = max(r.max_tokens for r in ready)
            # Every pass is queued before a token is read back (no sync per pass).
            rest = store.decode_greedy(slots, first, longest - 1) if longest > 1 else None
            self._passes += longest
            drafted = first[:, None] if rest is None else \
                mx.concatenate([first[:, None], rest], axis=1)
            out = drafted.tolist()
            drafts = {r.slot: self._cut(o, r) for o, r in zip(out, ready)}
        self._seconds += time.perf_counter() - started
        return [tuple(drafts.get(r.slot, ())) for r in rows]

    def _cut(self, draft: list[int], row: DraftRow) -> list[int]:
        draft = draft[:row.max_tokens]
        draft = draft[:draft_end(draft, row.stop_token_ids)]
        for i, t in enumerate(draft):
            if t >= self.vocab_limit:
                return draft[:i]
        return draft

    def cut(self, slot: int, length: int) -> None:
        self.store.cut_back(slot, length)

    def release(self, slot: int) -> None:
        self.store.truncate(slot, 0)

    def take_stats(self) -> tuple[float, int]:
        stats = (self._seconds, self._passes)
        self._seconds, self._passes = 0.0, 0
        return stats

    def take_catch_up_tokens(self) -> int:
        caught_up, self._caught_up = self._caught_up, 0
        return caught_up


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix; a list comparison first (the usual case: `a` is a prefix
    of `b`), numpy only to find where they part."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    differ = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(differ[0]) if len(differ) else n


def load_drafter(settings, loaded: LoadedModel) -> tuple[DraftModelDrafter, LoadedModel]:
    """Load --draft-model for `loaded` and its slots, or raise ModelLoadError in one line:
    tokenizers that differ (both models named), a vision-language model, or layer caches
    that cannot be cut back at a token (a draft row is cut back every step)."""
    draft = load_model(settings.draft_model)
    name = f"--draft-model {draft.path}"
    if draft.processor is not None:
        raise ModelLoadError(f"{name}: a vision-language model cannot draft; use a text model")
    why = vocab_difference(*_vocab(str(loaded.path)), *_vocab(str(draft.path)))
    if why:
        raise ModelLoadError(f"{name} cannot draft for {loaded.path}: their tokenizers differ "
                             f"({why})")
    store = SlotStore(draft.model, draft.make_cache, settings.worker_slots, settings.ctx)
    if not store.trimmable or store.verifiable != "batched":
        kinds = sorted({type(c).__name__ for c in leaves(draft.make_cache())})
        raise ModelLoadError(f"{name}: its layer caches ({', '.join(kinds)}) cannot be cut "
                             f"back at a token; a draft model needs attention layers only")
    vocab = int(loaded.config.get("text_config", loaded.config).get("vocab_size", 0)) or 1 << 31
    return DraftModelDrafter(store, settings.prefill_chunk, vocab), draft


def _vocab(ref: str) -> tuple[dict[str, int], set[int]]:
    try:
        tokenizer = load_tokenizer(ref)
    except TokenizerLoadError as exc:
        raise ModelLoadError(f"{ref}: its tokenizer could not be loaded: {exc}") from exc
    return tokenizer.get_vocab(), set(tokenizer.eos_token_ids)
