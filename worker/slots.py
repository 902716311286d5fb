"""Slot KV memory: one mlx-lm prompt cache per slot, batched for decode on demand.

A slot's KV lives either in its own cache list ("parked") or, while several slots decode
together, as a row of one merged batch cache (mlx-lm's BatchKVCache / ArraysCache merge;
quantized KV: worker/kv_layout.py's BatchQuantizedKVCache, which mlx-lm lacks).
The batch is kept while its membership is unchanged and split back into parked caches when
it changes, so the copy cost is paid per join/leave, not per step. A lone decoding slot runs
on its parked cache directly: the same code path as mlx_lm.generate, hence the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from switchyard.proto.messages import PrefillChunk
from switchyard.worker.cache_kinds import drops_last_token, rewindable
from switchyard.worker.kv_layout import is_attention_kv
from switchyard.worker.page_io import copy_prefix


class SlotError(RuntimeError):
    """A command inconsistent with the slot's contents: a scheduler bug, not bad input."""


class SlotStore:
    def __init__(self, model: nn.Module, make_cache: Callable[[], list], num_slots: int,
                 ctx: int):
        self.model = model
        self._make_cache = make_cache
        self.ctx = ctx
        self._parked: dict[int, list] = {i: make_cache() for i in range(num_slots)}
        self._batch_slots: tuple[int, ...] = ()
        self._batch: list | None = None
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]
        # Recurrent states and sliding-window rings exist only at the slot's end: such a slot
        # is never cut back (mlx-lm's is_trimmable() is True for a ring that has not wrapped).
        self.trimmable = rewindable(self._parked[0])
        self.drops_last_token = drops_last_token(self._parked[0])

    @property
    def num_slots(self) -> int:
        return len(self.tokens)

    # --- contents --------------------------------------------------------------------------

    def truncate(self, slot: int, length: int) -> None:
        """Make the slot hold exactly its first `length` tokens."""
        held = len(self.tokens[slot])
        if length > held:
            raise SlotError(f"slot {slot} holds {held} tokens; cannot start at {length}")
        if length == held:
            return
        self._unbatch()
        if length == 0:
            self._parked[slot] = _emptied(self._parked[slot], self._make_cache())
        elif self.trimmable:
            for c in self._parked[slot]:
                c.trim(held - length)
        else:
            raise SlotError(f"slot {slot}: recurrent state or window cannot be rewound to {length}")
        del self.tokens[slot][length:]

    def prefill_chunk(self, chunk: PrefillChunk) -> None:
        """A step's prefill chunk (a vision store adds its images: worker/vision/slots.py)."""
        self.prefill(chunk.slot, chunk.start, list(chunk.token_ids))

    def prefill(self, slot: int, start: int, token_ids: list[int], **model_inputs) -> None:
        """`model_inputs`: more keyword inputs of the model (input embeddings, positions)."""
        self.truncate(slot, start)
        self._check_room(slot, len(token_ids))
        self._unbatch_slot(slot)
        cache = self._parked[slot]
        self.model(mx.array(token_ids)[None], cache=cache, **model_inputs)
        # Evaluate the cache only: the chunk's logits are never needed, so the lazy graph
        # skips the lm_head for prefill.
        mx.eval([c.state for c in cache])
        self.tokens[slot].extend(token_ids)

    def decode(self, slots: list[int], positions: list[int], token_ids: list[int]) -> mx.array:
        """Append one token per slot and return the next-token logits, [len(slots), vocab]."""
        for slot, pos in zip(slots, positions):
            self.truncate(slot, pos)
            self._check_room(slot, 1)
        cache = self._cache_for(tuple(slots))
        logits = self.model(mx.array(token_ids)[:, None], cache=cache)[:, -1, :]
        for slot, tok in zip(slots, token_ids):
            self.tokens[slot].append(tok)
        return logits

    def record(self, slot: int, token_ids: list[int]) -> None:
        """Note tokens a caller fed into the slot's parked cache itself."""
        self.tokens[slot].extend(token_ids)

    def parked(self, slot: int) -> list:
        """The slot's own cache list (taken out of the decode batch if it is in it)."""
        self._unbatch_slot(slot)
        return self._parked[slot]

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        if num_tokens > len(self.tokens[src]):
            raise SlotError(f"slot {src} holds {len(self.tokens[src])} tokens, not {num_tokens}")
        if not self.trimmable and num_tokens != len(self.tokens[src]):
            raise SlotError("recurrent state exists only at the end of a slot")
        source = self.parked(src)
        self._unbatch_slot(dst)
        self._parked[dst] = copy_prefix(source, num_tokens, self._make_cache())
        self.tokens[dst] = self.tokens[src][:num_tokens]

    def loaded(self, slot: int, start: int, token_ids: list[int], images=()) -> list:
        """Truncate to `start` and return the cache to load pages into; records the tokens
        (and, in a vision store, the `images` among them)."""
        self.truncate(slot, start)
        self._check_room(slot, len(token_ids))
        self.tokens[slot].extend(token_ids)
        return self.parked(slot)

    # --- batching --------------------------------------------------------------------------

    def _cache_for(self, slots: tuple[int, ...]) -> list:
        if len(slots) == 1:
            self._unbatch_slot(slots[0])
            return self._parked[slots[0]]
        if slots != self._batch_slots:
            self._unbatch()
            caches = [self._parked.pop(s) for s in slots]
            self._batch = [type(layer[0]).merge(list(layer)) if hasattr(layer[0], "merge")
                           else _not_batchable(layer[0]) for layer in zip(*caches)]
            self._batch_slots = slots
        return self._batch

    def _unbatch_slot(self, slot: int) -> None:
        if slot in self._batch_slots:
            self._unbatch()

    def _unbatch(self) -> None:
        if self._batch is None:
            return
        for row, slot in enumerate(self._batch_slots):
            self._parked[slot] = [layer.extract(row) for layer in self._batch]
        self._batch, self._batch_slots = None, ()

    def _check_room(self, slot: int, num_new: int) -> None:
        if len(self.tokens[slot]) + num_new > self.ctx:
            raise SlotError(f"slot {slot} would exceed the context of {self.ctx} tokens")

    def contents(self) -> list[tuple[int, ...]]:
        return [tuple(t) for t in self.tokens]

    def slot_images(self, slot: int) -> tuple:
        """The images among the slot's tokens (ImageSpan; a text model has none)."""
        return ()

    def take_encode_stats(self) -> tuple[float, int]:
        """Seconds the vision encoder ran and tokens it encoded since the last call."""
        return 0.0, 0


def _emptied(old: list, fresh: list) -> list:
    """A cache list holding no tokens. Attention KV layers keep their buffers: the slot's next
    conversation, or a restore, writes into memory the slot already has instead of faulting
    in new memory (docs/design.md "Restores"); every other kind starts fresh."""
    for c in old:
        if is_attention_kv(c):
            c.offset = 0
    return [o if is_attention_kv(o) else f for o, f in zip(old, fresh)]


def _not_batchable(cache) -> None:
    raise SlotError(f"{type(cache).__name__} cannot be batched; run with --slots 1")
