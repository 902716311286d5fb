"""What differs between the vision-language families: how an image is encoded, how its features
enter the language model's input, and how tokens are positioned. Everything else (the vision
tower, the projector, the language model, the image processor) is mlx-vlm's own.

Each family's prefill chunk merges features the way that family's `get_input_embeddings` does
for a whole prompt (its own merge function, on the chunk's tokens and the chunk's share of the
features), so a chunked prefill computes what mlx-vlm's generation computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from switchyard.worker.vision.positions import delta_before, positions


@dataclass(frozen=True)
class Features:
    """An image's encoder output: one row per placeholder token (`embeds`), and for Qwen3-VL
    the deepstack rows added to the first language layers' hidden states (`deepstack`)."""

    embeds: mx.array
    deepstack: tuple[mx.array, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes + sum(d.nbytes for d in self.deepstack)

    def rows(self, lo: int, hi: int) -> "Features":
        return Features(self.embeds[lo:hi], tuple(d[lo:hi] for d in self.deepstack))

    @staticmethod
    def concat(parts: list["Features"]) -> "Features":
        return Features(mx.concatenate([p.embeds for p in parts]),
                        tuple(mx.concatenate(list(layer))
                              for layer in zip(*(p.deepstack for p in parts))))


class Family:
    """A family's specifics over an mlx-vlm model `vlm`."""

    model_type: str
    # The text an image stands for in the processor's input, expanded by the processor into
    # the image's placeholder tokens (what the gateway does to the rendered prompt).
    marker: str
    merge: int | None = None  # M-RoPE families: the encoder's spatial merge

    def __init__(self, vlm):
        self.vlm = vlm

    @property
    def image_token_id(self) -> int:
        raise NotImplementedError

    @property
    def embed_tokens(self):
        return self.vlm.language_model.model.embed_tokens

    def encode(self, inputs: dict) -> Features:
        """The features of one image from the processor's output for it."""
        raise NotImplementedError

    def grid(self, inputs: dict) -> tuple[int, ...]:
        """The image's patch grid as the processor computed it ((): not used)."""
        return ()

    def chunk_inputs(self, ids: mx.array, features: Features | None) -> dict:
        """The language model's keyword inputs for a prefill chunk `ids` ([1, n]) of a sequence
        with images; `features`: the rows of the chunk's placeholder tokens, in order."""
        raise NotImplementedError

    # --- positions -------------------------------------------------------------------------

    def chunk_positions(self, spans, start: int, length: int) -> mx.array | None:
        """Explicit positions of a chunk ([3, 1, n] for M-RoPE), or None: the cache's."""
        if self.merge is None:
            return None
        return mx.array(positions(spans, start, length, self.merge))[:, None, :]

    def delta(self, spans, position: int) -> int:
        """How far text positions after `position` lie from their token index."""
        return delta_before(spans, position, self.merge) if self.merge is not None else 0


def _pixels(inputs: dict, dtype) -> mx.array:
    return mx.array(np.asarray(inputs["pixel_values"])).astype(dtype)


class Qwen25VL(Family):
    model_type = "qwen2_5_vl"
    marker = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, vlm):
        super().__init__(vlm)
        self.merge = vlm.config.vision_config.spatial_merge_size

    @property
    def image_token_id(self) -> int:
        return self.vlm.config.image_token_id

    def grid(self, inputs: dict) -> tuple[int, ...]:
        return tuple(int(x) for x in np.asarray(inputs["image_grid_thw"]).reshape(-1)[:3])

    def encode(self, inputs: dict) -> Features:
        tower = self.vlm.vision_tower
        grid = mx.array(np.asarray(inputs["image_grid_thw"]))
        out = tower(_pixels(inputs, tower.patch_embed.proj.weight.dtype), grid,
                    output_hidden_states=False)
        return Features(out)

    def chunk_inputs(self, ids: mx.array, features: Features | None) -> dict:
        embeds = self.embed_tokens(ids)
        if features is not None:
            cfg = self.vlm.config
            embeds = self.vlm.merge_input_ids_with_image_features(
                cfg.image_token_id, cfg.video_token_id, features.embeds, embeds, ids)
        return {"inputs_embeds": embeds}


class Qwen3VL(Qwen25VL):
    model_type = "qwen3_vl"

    @property
    def image_token_id(self) -> int:
        return self.vlm.config.image_token_index

    def encode(self, inputs: dict) -> Features:
        tower = self.vlm.vision_tower
        grid = mx.array(np.asarray(inputs["image_grid_thw"]))
        embeds, deepstack = tower(_pixels(inputs, tower.patch_embed.proj.weight.dtype), grid)
        return Features(embeds, tuple(deepstack or ()))

    def chunk_inputs(self, ids: mx.array, features: Features | None) -> dict:
        from mlx_vlm.models.qwen3_vl.qwen3_vl import masked_scatter

        embeds = self.embed_tokens(ids)
        if features is None:
            return {"inputs_embeds": embeds}
        cfg = self.vlm.config
        image = ids == cfg.image_token_index
        embeds = masked_scatter(embeds, mx.broadcast_to(image[..., None], embeds.shape),
                                features.embeds)
        out = {"inputs_embeds": embeds}
        if features.deepstack:
            out["visual_pos_masks"] = image | (ids == cfg.video_token_index)
            out["deepstack_visual_embeds"] = list(features.deepstack)
        return out


class Gemma3(Family):
    model_type = "gemma3"
    marker = "<start_of_image>"

    @property
    def image_token_id(self) -> int:
        return self.vlm.config.image_token_index

    def encode(self, inputs: dict) -> Features:
        vlm = self.vlm
        dtype = self.embed_tokens.weight.dtype
        pixels = _pixels(inputs, dtype)
        hidden, _, _ = vlm.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
        return Features(vlm.multi_modal_projector(hidden)[0])

    def chunk_inputs(self, ids: mx.array, features: Features | None) -> dict:
        vlm = self.vlm
        cfg = vlm.config
        embeds = self.embed_tokens(ids)
        rows = features.embeds[None] if features is not None \
            else mx.zeros((1, 0, embeds.shape[-1]), embeds.dtype)
        # With an image anywhere in the prompt, mlx-vlm builds the whole input this way (pad
        # tokens zeroed too), so every chunk of such a sequence does.
        embeds, _ = vlm.prepare_inputs_for_multimodal(
            cfg.hidden_size, cfg.pad_token_id, cfg.image_token_index, rows, embeds, ids,
            mx.ones(ids.shape, dtype=mx.int32))
        return {"inputs_embeds": embeds}


FAMILIES = {f.model_type: f for f in (Qwen25VL, Qwen3VL, Gemma3)}
