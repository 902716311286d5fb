"""Which prefill chunks of a step share one forward pass (docs/design/scheduling.md "Packed prefill").

A step's chunks belong to different slots. Run one pass per chunk and every pass reads all
the weights; run them as rows of one pass and the weights are read once. Rows of one pass are
right-padded to its longest row, so chunks of very different lengths would compute mostly
padding: a group takes a chunk only if padding is at most `MAX_PADDING` of its row. And a
packed pass copies each row's context (its slot's KV) into the batch: a group takes a chunk
only while those copies move fewer bytes than the weight reads the group saves, so a long
conversation's chunk keeps its own pass. Pure: no MLX here, so the grouping is
unit-tested on its own.
"""

from __future__ import annotations

# Of a row of a packed pass (as long as the pass's longest chunk), at most this share is
# padding: a row costs its padding's compute, and compute, not the weight read, is what
# a long chunk is bound by.
MAX_PADDING = 0.25


def pack_groups(lengths: list[int], contexts: list[int] | None = None,
                context_per_read: int = 0, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """The chunks' indexes in groups, one forward pass each: longest chunks first, each chunk
    in the first group whose longest chunk (its first) it pads by at most `max_padding` of
    that length, and whose rows' contexts (tokens before their chunks, `contexts`) stay
    within `context_per_read` per weight read saved (a group of n saves n - 1). A group of
    one runs as a plain prefill. `contexts` None: no bound on the copies."""
    if not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be in [0, 1), not {max_padding}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            if lengths[i] < (1 - max_padding) * lengths[group[0]]:
                continue
            if contexts is not None and \
                    sum(contexts[j] for j in group) + contexts[i] > len(group) * context_per_read:
                continue
            group.append(i)
            break
        else:
            groups.append([i])
    return groups


def context_per_weight_read(weight_bytes: int, kv_bytes_per_token: int) -> int:
    """Context tokens whose KV, copied into a packed pass's batch (worker/batch_kv.py merge:
    read once, written once), moves the bytes of one read of the weights. Only the chunk's
    own tokens go back to the slot (worker/page_io.py `write_back_row`), as a pass per chunk
    writes them too."""
    return weight_bytes // max(1, 2 * kv_bytes_per_token)
