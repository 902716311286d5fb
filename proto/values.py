"""Value types nested in the messages of more than one direction: a request's sampling
parameters and its images (gateway -> scheduler, and again scheduler -> worker)."""

from __future__ import annotations

from switchyard.proto.base import Value


class SamplingParams(Value):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Always set: the gateway draws one when the client gives none, so the worker samples
    # statelessly (key = f(seed, index)) and any step can be replayed after a restart.
    seed: int = 0
    # Structured outputs: an llguidance grammar the gateway compiled and checked ("" = none),
    # in force from the first token, or from the token after `grammar_trigger` appears.
    grammar: str = ""
    grammar_trigger: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()


class ImageSpan(Value):
    """An image in a token sequence: its placeholder tokens are [start, start + num_tokens),
    where the vision encoder's features of the image go (docs/design/images.md "Images").

    `image_id` is the image's content hash (16 bytes, of its decoded pixels), which page ids
    chain for every page the span covers. `grid` is the encoder's patch grid (t, h, w) for
    the families whose positions follow it (Qwen-VL's M-RoPE); empty for the others.
    """

    image_id: bytes
    start: int
    num_tokens: int
    grid: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ImageData(Value):
    """The bytes of an image file (PNG, JPEG, ...) as the client sent it, for the encoder."""

    image_id: bytes
    data: bytes
