"""Whether a reply is the model's greedy reply up to float ties.

Greedy replies are compared exactly between runs (bench/soak.py), but one conversation turn
can be computed along different paths: prefilled whole or restored and prefilled in part,
decoded one token at a time or verified with speculated tokens. Each path sums in its own
order, so two tokens whose logits lie within float rounding of each other can swap. A
generated random-weight model has flat logits: in the soak, one turn's sixth token had two
candidates 5e-6 apart in float32, and the reply differed by path.

A reply is judged greedy up to ties when each of its tokens is the model's greedy choice or
within `TIE` of its logit (`follows_greedy`); a reply that differs from the reference is wrong
only if it, or the reference, is not. A wrong page or state gives far more than a tie's
difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

TIE = 1e-3  # logits (about 10 to 20 here) this close are a tie in float32


def follows_greedy(reply: str, next_logits: Callable[[list[int]], np.ndarray],
                   decode: Callable[[list[int]], str], max_tokens: int,
                   tie: float = TIE) -> bool:
    """Whether `reply` is some path of at most `max_tokens` tokens whose every token is within
    `tie` of the best logit after the tokens before it (`next_logits(path)`). Text is matched
    as decoded so far; a path's last token may end in an incomplete character."""

    def walk(path: list[int]) -> bool:
        if decode(path) == reply:
            return True
        if len(path) >= max_tokens:
            return False
        logits = next_logits(path)
        for token in np.flatnonzero(logits >= logits.max() - tie).tolist():
            text = decode(path + [token])
            if _may_start(reply, text) and walk(path + [token]):
                return True
        return False

    return walk([])


def _may_start(reply: str, text: str) -> bool:
    return reply.startswith(text) or (text.endswith("\ufffd") and reply.startswith(text[:-1]))


class GreedyJudge:
    """The model (mlx-lm) judging replies to chat prompts, loaded in this process the first
    time a pair is judged (a run without different replies never loads it)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self._loaded = None

    def tie(self, messages: list[dict], num_prompt_tokens: int, replies, max_tokens: int
            ) -> bool:
        """Whether different `replies` to `messages` are each greedy up to a tie; judged
        only where the chat template here gives the prompt the server counted."""
        if self._loaded is None:
            from mlx_lm import load

            self._loaded = load(str(self.model_dir))
        model, tokenizer = self._loaded
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if len(prompt) != num_prompt_tokens:
            return False
        next_logits = _next_logits(model, prompt)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return all(follows_greedy(reply, next_logits, decode, max_tokens) for reply in replies)


def _next_logits(model, prompt: Sequence[int]) -> Callable[[list[int]], np.ndarray]:
    """The logits after `prompt` and a path of tokens, the prompt prefilled once: each call
    runs its last token and the path on the prompt's cache, then cuts the cache back."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(prompt[:-1])]), cache=cache))

    def next_logits(path: list[int]) -> np.ndarray:
        logits = model(mx.array([[prompt[-1], *path]]), cache=cache)[0, -1]
        out = np.array(logits.astype(mx.float32))
        trim_prompt_cache(cache, len(path) + 1)
        return out

    return next_logits
