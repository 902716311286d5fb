"""How many prompt tokens a step may prefill without starving the sequences that decode.

A step runs every decoding sequence's token, then prefill chunks. If prefill makes a step
cycle k times longer than a decode-only cycle, every decoding stream runs at 1/k of its speed.
The budget keeps decoding streams at `decode_share` of their solo speed: prefill may take
`decode_cycle_s * (1/share - 1)` per step on average, converted to tokens with the measured
prefill cost per token. Both are moving averages (the cycle as the scheduler sees it, the
prefill cost as the worker reports it), so the budget follows the machine and the context
length (attention makes long-context tokens dearer).

With speculative decoding a step may verify several draft tokens per stream in one pass: the
decode cycle measured is that pass, however many tokens it kept, so the verified tokens' time
counts as decode time and a prefill chunk stretches it by no more than the share allows.

The allowance accrues in a bucket: when a step's allowance is smaller than a useful chunk
(`min_tokens`; tiny chunks waste the matmuls), decode-only steps alternate with chunk steps,
which keeps the average. With nothing decoding there is no one to protect: full chunks.

An image's encoding (a vision model) counts as prefill tokens of the same cost: its measured
seconds per placeholder token over the prefill's. It cannot be split, so while streams are
protected, an encoding that costs more than a step's grant waits until the bucket has saved its
whole cost (decode-only steps first, the stall after them): paying afterwards kept the average
too, but a neighbour's request that ended right after an encoding left its stall unpaid inside
its own window (bench/vision_interference.py measured 0.40 of solo speed). With nothing to
protect it runs at once, and the bucket takes the debt (docs/design/images.md "Images").
"""

from __future__ import annotations

_ALPHA = 0.2  # weight of the newest measurement in the moving averages
# Spend a little less than the computed allowance: the prefill cost per token grows with the
# prefilling request's own context, and the moving average lags behind it.
_MARGIN = 0.85
# A decode burst runs at most about this long: a request arriving meanwhile waits no longer
# for its step (bursts save round trips, which matter only while steps take milliseconds).
BURST_WINDOW_S = 0.05
# A step's prefill takes about this long at most, whatever `max_tokens` allows: on a slow
# machine a full chunk deep in a long context takes tens of seconds, and a worker silent for
# a minute inside a step is taken for lost.
MAX_STEP_PREFILL_S = 10.0


class PrefillBudget:
    def __init__(self, max_tokens: int, decode_share: float, min_tokens: int = 16):
        self.max_tokens = max_tokens
        self.decode_share = decode_share
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode_s: float | None = None
        self.prefill_token_s: float | None = None
        self.encode_token_s: float | None = None
        self.credit = 0.0
        self.limited = False  # this step's grant protects decoding streams
        self.saving = 0  # an encoding's cost the bucket saves up for (afford), 0: none

    def observe(self, num_decodes: int, decode_cycle_s: float, num_prefill: int,
                prefill_s: float, num_encoded: int = 0, encode_s: float = 0.0) -> None:
        """`decode_cycle_s`: token-to-token time of a decode-only step (0: not one);
        `num_encoded`, `encode_s`: the placeholder tokens of the images encoded, and the time."""
        if num_decodes and decode_cycle_s > 0:
            self.decode_s = _ewma(self.decode_s, decode_cycle_s)
        if num_prefill and prefill_s > 0:
            self.prefill_token_s = _ewma(self.prefill_token_s, prefill_s / num_prefill)
        if num_encoded and encode_s > 0:
            self.encode_token_s = _ewma(self.encode_token_s, encode_s / num_encoded)

    def encode_tokens(self, num_placeholders: int) -> int:
        """What encoding an image of this many placeholder tokens costs, in prefill tokens
        (the same as prefilling them until both are measured)."""
        if self.encode_token_s is None or not self.prefill_token_s:
            return num_placeholders
        return int(num_placeholders * self.encode_token_s / self.prefill_token_s + 0.5)

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one step prefills: `max_tokens`, fewer where the measured cost per
        token would make them take longer than `MAX_STEP_PREFILL_S`."""
        if not self.prefill_token_s:
            return self.max_tokens
        return max(self.min_tokens,
                   min(self.max_tokens, int(MAX_STEP_PREFILL_S / self.prefill_token_s)))

    def allowance(self, num_protected_decodes: int, share: float | None = None) -> float:
        """Prefill tokens per step, on average, that keep this many streams at `share` of
        their solo speed (`decode_share` unless given; prefill_plan.prefill_share)."""
        share = self.decode_share if share is None else share
        largest = float(self.chunk_tokens)
        if (num_protected_decodes == 0 or share <= 0 or self.decode_s is None
                or self.prefill_token_s is None):
            return largest
        allowed_s = _MARGIN * self.decode_s * (1.0 / share - 1.0)
        return min(largest, allowed_s / self.prefill_token_s)

    def grant(self, num_protected_decodes: int, share: float | None = None) -> int:
        """Tokens this step may prefill; call `spend` with what was used."""
        allowance = self.allowance(num_protected_decodes, share)
        largest = self.chunk_tokens
        self.limited = allowance < largest
        saving, self.saving = self.saving, 0  # asked for again by `afford` while it waits
        if not self.limited:
            self.credit = 0.0
            return largest
        self.credit = min(self.credit + allowance, float(max(largest, saving)))
        return min(int(self.credit), largest) if self.credit >= self.min_tokens else 0

    def afford(self, cost: int) -> bool:
        """Whether an encoding of `cost` tokens that starts a chunk may run in this step:
        the bucket holds its cost, or no stream is protected (then it takes the debt).
        Otherwise the bucket saves up for it beyond a step's chunk, and it waits."""
        if not self.limited or self.credit >= cost:
            return True
        self.saving = max(self.saving, cost)
        return False

    def burst(self, max_burst: int) -> int:
        """Decode iterations one step may run while nothing else waits: `max_burst`, fewer
        when the measured decode cycle would make a burst outlast `BURST_WINDOW_S`."""
        if self.decode_s is None or self.decode_s <= 0:
            return max_burst
        return max(1, min(max_burst, int(BURST_WINDOW_S / self.decode_s)))

    def spend(self, num_tokens: int) -> None:
        """Tokens used, of this step's grant or beyond it (an image's encoding: a debt)."""
        self.credit -= num_tokens


def _ewma(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - _ALPHA) * previous + _ALPHA * value
