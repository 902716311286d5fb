"""The vision encoder, run once per distinct image: its features are kept in memory by image id.

A prefill chunk that covers an image's placeholder tokens takes the image's features from here;
the first time, the image is opened (common/images.py), turned into pixels by the model's own
mlx-vlm processor and encoded by the model's vision tower. Kept features are evicted least
recently used first when they outgrow `budget_bytes`. A conversation restored from pages needs
no features for the tokens its pages hold: the encoder does not run for them at all.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from switchyard.common.images import open_rgb
from switchyard.worker.errors import ImageInputError
from switchyard.worker.vision.families import Family, Features


class ImageEncoder:
    def __init__(self, family: Family, processor, budget_bytes: int, log):
        self.family = family
        self.processor = processor
        self.budget_bytes = budget_bytes
        self.log = log
        self._kept: OrderedDict[bytes, Features] = OrderedDict()
        self._kept_bytes = 0
        self.num_runs = 0

    def __contains__(self, image_id: bytes) -> bool:
        return image_id in self._kept

    def features(self, span, data: bytes | None) -> tuple[Features, float]:
        """The image's features and the seconds spent encoding them now (0: kept)."""
        kept = self._kept.get(span.image_id)
        if kept is not None:
            self._kept.move_to_end(span.image_id)
            return kept, 0.0
        if data is None:
            raise ImageInputError(f"image {span.image_id.hex()[:12]} is neither kept nor sent")
        started = time.perf_counter()
        try:
            image = open_rgb(data)
        except Exception as exc:  # Pillow raises many types; the gateway opened it before
            raise ImageInputError(f"image {span.image_id.hex()[:12]} does not open: "
                                  f"{type(exc).__name__}") from None
        try:
            inputs = self.processor(text=self.family.marker, images=[image])
        except ValueError as exc:  # the processor refuses the image (an extreme shape)
            raise ImageInputError(f"image {span.image_id.hex()[:12]}: {exc}") from None
        placeholders = int(np.sum(np.asarray(inputs["input_ids"]) == self.family.image_token_id))
        grid = self.family.grid(inputs)
        if placeholders != span.num_tokens or (span.grid and tuple(span.grid) != grid):
            raise ImageInputError(
                f"image {span.image_id.hex()[:12]}: the processor makes {placeholders} tokens "
                f"(grid {grid}), the prompt holds {span.num_tokens} (grid {tuple(span.grid)})")
        features = self.family.encode(inputs)
        mx.eval(features.embeds, *features.deepstack)
        if features.num_tokens != span.num_tokens:
            raise ImageInputError(f"image {span.image_id.hex()[:12]}: the encoder made "
                                  f"{features.num_tokens} rows for {span.num_tokens} tokens")
        took = time.perf_counter() - started
        self.num_runs += 1
        self._keep(span.image_id, features)
        self.log.info("vision.encoded", image=span.image_id.hex()[:12],
                      num_tokens=span.num_tokens, encode_ms=round(took * 1e3, 2),
                      num_kept=len(self._kept), kept_bytes=self._kept_bytes)
        return features, took

    def _keep(self, image_id: bytes, features: Features) -> None:
        self._kept[image_id] = features
        self._kept_bytes += features.nbytes
        while self._kept_bytes > self.budget_bytes and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= old.nbytes
