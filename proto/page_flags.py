"""Page flags: the bits of a KV page's `flags`, one definition for the page file's header
(kvstore), the page messages (`PageWrite`, `PageInfo`) and the scheduler that asks for them.

The values are the page file's on-disk bits (docs/design/kv-pages.md "KV pages"): never renumber one.
"""

from __future__ import annotations

import enum


class PageFlags(enum.IntFlag):
    NONE = 0
    RECURRENT_STATE = 1  # the payload ends with a recurrent-state snapshot (hybrid models)


_KNOWN = sum(int(flag) for flag in PageFlags)  # iterating yields the single bits only


def unknown_page_flags(flags: int) -> int:
    """The bits of `flags` this build does not know, as a plain int (0: none). Computed on
    ints: `~` of an IntFlag keeps known bits only, so `flags & ~KNOWN` would hide them."""
    return int(flags) & ~_KNOWN
