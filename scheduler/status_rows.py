"""What the status document says of a slot beyond its numbers: which conversation it holds,
as a label no tenant can turn back into text, and whose it is (docs/design/security.md "Tenants").

A page id is `blake2b(namespace, parent, tokens)`: shown to a tenant, even a prefix of it lets
whoever can compute the chain's root test guesses of the text offline. So a slot's conversation
is shown as a keyed hash of its first page id under a key this scheduler process draws at
start: equal for slots that hold the same prefix (what the dashboard needs), meaningless
outside this process, and changed by a restart.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict

_LABEL_KEY = secrets.token_bytes(32)
LABEL_HEX_DIGITS = 12
MAX_ROOTS = 4096  # chain roots whose tenant is remembered, for idle slots


def conversation_label(first_page_id: bytes, key: bytes = _LABEL_KEY) -> str:
    """The status's name for a conversation whose first page is `first_page_id`."""
    return hashlib.blake2b(first_page_id, digest_size=LABEL_HEX_DIGITS // 2, key=key,
                           person=b"sy-conv-label").hexdigest()


class RootTenants:
    """Whose text a chain root (a cache salt's, proto/page_ids.chain_root) is: an idle slot
    keeps its last request's root, and is shown to that request's tenant alone. Bounded: a
    root forgotten is nobody's ("": shown to the operator only, with several keys)."""

    def __init__(self, limit: int = MAX_ROOTS) -> None:
        self.limit = limit
        self._tenants: OrderedDict[bytes, str] = OrderedDict()

    def note(self, root: bytes, tenant: str) -> None:
        self._tenants[root] = tenant
        self._tenants.move_to_end(root)
        while len(self._tenants) > self.limit:
            self._tenants.popitem(last=False)

    def of(self, root: bytes) -> str:
        return self._tenants.get(root, "")
