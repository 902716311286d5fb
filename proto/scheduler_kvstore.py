"""Messages between the scheduler and the kvstore: the disk's inventory, the worker's shared page
buffers, page writes, reads, deletes and touches (the bytes stay in shared memory), and the pages a
request asks the peer servers for."""

from __future__ import annotations

from switchyard.proto.base import Message, Value, name_kinds, pack_tokens
from switchyard.proto.page_flags import PageFlags
from switchyard.proto.tokens import TokenIds


class PageInfo(Value):
    page_id: bytes
    parent_id: bytes
    namespace: bytes
    num_tokens: int
    nbytes: int
    last_used: float
    flags: PageFlags = PageFlags.NONE


class PageWrite(Value):
    page_id: bytes
    parent_id: bytes
    token_ids: TokenIds
    buffer: int
    payload_len: int  # bytes of the buffer that belong to the page (state included)
    flags: PageFlags = PageFlags.NONE
    # The ids of the images whose placeholders the page covers, 16 bytes each, in order: part
    # of the page id (common/page_ids.py) and of the page's header.
    image_ids: bytes = b""

    def __post_init__(self):
        pack_tokens(self, "token_ids")


class PageRead(Value):
    page_id: bytes
    token_ids: TokenIds
    buffer: int

    def __post_init__(self):
        pack_tokens(self, "token_ids")


class DescribeInventory(Message, tag="describe_inventory"):
    """Ask kvstore for every page it holds."""


class InventoryDescribed(Message, tag="inventory_described"):
    boot_id: str
    pages: tuple[PageInfo, ...] = ()
    scan_s: float = 0.0
    writable: bool = True
    error: str = ""


class AttachBuffers(Message, tag="attach_buffers"):
    """Use this page buffer pool (a worker start created it) and this namespace.

    The geometry of the namespace's pages (0: not said, nothing checked): a page of n tokens
    (1 to page_size) holds n * token_bytes, plus state_bytes with PageFlags.RECURRENT_STATE;
    a page that says otherwise is corrupt (docs/design/kv-pages.md "KV pages")."""

    shm_name: str
    num_buffers: int
    buffer_bytes: int
    namespace: bytes
    page_size: int = 0
    token_bytes: int = 0
    state_bytes: int = 0


class WritePages(Message, tag="write_pages"):
    writes: tuple[PageWrite, ...]


class PagesWritten(Message, tag="pages_written"):
    written: tuple[PageInfo, ...]
    failed: tuple[bytes, ...]
    buffers: tuple[int, ...]  # every buffer of the WritePages, free again
    error: str = ""  # set when the disk cannot take pages (full, read-only)


class ReadPages(Message, tag="read_pages"):
    reads: tuple[PageRead, ...]


class PagesRead(Message, tag="pages_read"):
    ok: tuple[bytes, ...]
    missing: tuple[bytes, ...]  # absent, corrupt (and removed) or unreadable


class DeletePages(Message, tag="delete_pages"):
    page_ids: tuple[bytes, ...]


class PagesDeleted(Message, tag="pages_deleted"):
    page_ids: tuple[bytes, ...]
    freed_bytes: int


class TouchPages(Message, tag="touch_pages"):
    """A conversation used these pages now: keep their recency across restarts."""

    page_ids: tuple[bytes, ...]



class FetchPeerPages(Message, tag="fetch_peer_pages"):
    """Ask the peers for `page_ids[start:]` of a chain from `root` (proto/peer_pages.py);
    answered by PeerPagesFetched within `deadline_s` (docs/design/kv-pages.md "Pages from a
    peer")."""

    rid: str
    root: bytes
    page_ids: tuple[bytes, ...]
    start: int
    max_bytes: int
    deadline_s: float


class PeerFetchResult(Value):
    peer: str  # its URL
    num_pages: int
    num_bytes: int
    fetch_s: float
    error: str = ""  # "": it answered (with pages or none)


class PeerPagesFetched(Message, tag="peer_pages_fetched"):
    rid: str
    pages: tuple[PageInfo, ...]  # written to disk here, in chain order
    results: tuple[PeerFetchResult, ...]


MESSAGES: tuple[type[Message], ...] = (
    DescribeInventory, InventoryDescribed, AttachBuffers, WritePages, PagesWritten, ReadPages,
    PagesRead, DeletePages, PagesDeleted, TouchPages, FetchPeerPages, PeerPagesFetched)
name_kinds(MESSAGES)
