"""Slots of a vision-language model: the slot store, plus the images each slot holds.

A prefill chunk of a sequence with images runs the language model on input embeddings: the
chunk's token embeddings with the features of the placeholder tokens it covers merged in (the
family's own merge), at explicit positions for multimodal-RoPE families. A chunk of a sequence
without images runs exactly as for a text model. Each slot keeps the spans of the images among
its tokens (`spans`): decoding positions its text after them (`VisionLanguageModel.bind`), a
copy takes them along, a truncation drops those past the cut, and a scheduler that restarts
gets them back with the slot's tokens (docs/design/images.md "Images").
"""

from __future__ import annotations

import mlx.core as mx

from switchyard.proto.values import ImageSpan
from switchyard.proto.scheduler_worker import PrefillChunk
from switchyard.worker.slots import SlotStore
from switchyard.worker.vision.encoder import ImageEncoder
from switchyard.worker.vision.families import Features
from switchyard.worker.vision.model import VisionLanguageModel


class VisionSlotStore(SlotStore):
    shelves_pages = False  # its images are not among the tokens that key shared pages

    def __init__(self, model: VisionLanguageModel, make_cache, num_slots: int, ctx: int,
                 encoder: ImageEncoder):
        super().__init__(model, make_cache, num_slots, ctx)
        self.family = model.family
        self.encoder = encoder
        self.spans: list[tuple[ImageSpan, ...]] = [() for _ in range(num_slots)]
        self._encode_s = 0.0
        self._num_encoded = 0
        # A chunk runs on input embeddings at explicit positions (`prefill_chunk`): one pass
        # per chunk (docs/design/scheduling.md "Packed prefill").
        self.packs_prefill = False

    # --- contents --------------------------------------------------------------------------

    def truncate(self, slot: int, length: int, state_follows: bool = False) -> None:
        super().truncate(slot, length, state_follows)
        self.spans[slot] = tuple(s for s in self.spans[slot] if s.start < length)

    def release(self, slot: int) -> None:
        super().release(slot)
        self.spans[slot] = ()

    def prefill_chunk(self, chunk: PrefillChunk) -> None:
        ids = list(chunk.token_ids)
        start, end = chunk.start, chunk.start + len(ids)
        inputs = {}
        if chunk.images:
            features = self._features(chunk, start, end)
            inputs = self.family.chunk_inputs(mx.array(ids)[None], features)
        # Explicit positions, always: the slot's cache may still be bound to the positions of
        # the conversation it held before (VisionLanguageModel.bind).
        positions = self.family.chunk_positions(chunk.images, start, len(ids))
        if positions is not None:
            inputs["position_ids"] = positions
        self.prefill(chunk.slot, start, ids, **inputs)
        self.spans[chunk.slot] = tuple(chunk.images)

    def _features(self, chunk: PrefillChunk, start: int, end: int) -> Features | None:
        """The feature rows of the placeholder tokens in [start, end), in order."""
        data = {d.image_id: d.data for d in chunk.image_data}
        parts = []
        for span in chunk.images:
            lo, hi = max(span.start, start), min(span.end, end)
            if lo >= hi:
                continue
            features, took = self.encoder.features(span, data.get(span.image_id))
            if took:
                self._encode_s += took
                self._num_encoded += span.num_tokens
            parts.append(features.rows(lo - span.start, hi - span.start))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else Features.concat(parts)

    def loaded(self, slot: int, start: int, token_ids: list[int], images=()) -> list:
        cache = super().loaded(slot, start, token_ids)
        self.spans[slot] = tuple(images)
        return cache

    def copy_prefix(self, src: int, dst: int, num_tokens: int,
                    state_follows: bool = False) -> None:
        super().copy_prefix(src, dst, num_tokens, state_follows)
        self.spans[dst] = tuple(s for s in self.spans[src] if s.start < num_tokens)

    def slot_images(self, slot: int) -> tuple[ImageSpan, ...]:
        return self.spans[slot]

    # --- the caches handed out for decoding ------------------------------------------------

    def parked(self, slot: int) -> list:
        cache = super().parked(slot)
        self.model.bind(cache, [self._delta(slot)])
        return cache

    def _cache_for(self, slots: tuple[int, ...]) -> list:
        cache = super()._cache_for(slots)
        self.model.bind(cache, [self._delta(s) for s in slots])
        return cache

    def _delta(self, slot: int) -> int:
        return self.family.delta(self.spans[slot], len(self.tokens[slot]))

    # --- what the step reports -------------------------------------------------------------

    def take_encode_stats(self) -> tuple[float, int]:
        out = (self._encode_s, self._num_encoded)
        self._encode_s, self._num_encoded = 0.0, 0
        return out
