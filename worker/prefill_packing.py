"""Which prefill chunks of a step share one forward pass (docs/design.md "Packed prefill").

A step's chunks belong to different slots. Run one pass per chunk and every pass reads all
the weights; run them as rows of one pass and the weights are read once. Rows of one pass are
right-padded to its longest row, so chunks of very different lengths would compute mostly
padding: a group takes a chunk only if padding is at most `MAX_PADDING` of its row. Pure: no
MLX here, so the grouping is unit-tested on its own.
"""

from __future__ import annotations

# Of a row of a packed pass (as long as the pass's longest chunk), at most this share is
# padding: a row costs its padding's compute, and compute, not the weight read, is what
# a long chunk is bound by.
MAX_PADDING = 0.25


def pack_groups(lengths: list[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """The chunks' indexes in groups, one forward pass each: longest chunks first, each chunk
    in the first group whose longest chunk (its first) it pads by at most `max_padding` of
    that length. A group of one runs as a plain prefill."""
    if not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be in [0, 1), not {max_padding}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            if lengths[i] >= (1 - max_padding) * lengths[group[0]]:
                group.append(i)
                break
        else:
            groups.append([i])
    return groups
