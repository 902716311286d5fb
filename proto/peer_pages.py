"""Pages from a peer: the ask one server sends another for pages
(docs/design/kv-pages.md "Pages from a peer"; docs/design/security.md "Peers").

A server that lacks a request's prefix asks its peers (`--peer URL`) for the page ids it lacks,
in one `PeerAsk`: the model's namespace, the chain root of the request's cache salt (the
tenant, as pages know it), the ids of the context's full pages from that root, and from which
of them it wants pages. The ask travels as msgpack in a POST to `PEER_PAGES_PATH` with its MAC
(keyed BLAKE3 under the peer key) in `MAC_HEADER`; the answer's pages carry MACs under the same
key (kvstore/peer_wire.py). A peer serves a page only when its whole chain from that root is in
its own index, so it serves exactly what a request of that salt could restore from its disk.
"""

from __future__ import annotations

import hmac
import time

import blake3
import msgspec

from switchyard.common.page_ids import ID_BYTES

PEER_PAGES_PATH = "/switchyard/peer/pages"
MAC_HEADER = "x-switchyard-peer-mac"
# An ask older or newer than this is refused: a recorded ask cannot be replayed for long.
MAX_SKEW_S = 60.0
MAX_ASK_PAGES = 8192  # 2M tokens of 256-token pages: any context
MAX_ASK_BYTES = MAX_ASK_PAGES * (ID_BYTES + 2) + 1024


class PeerAskError(ValueError):
    """An ask that is not one (bad MAC, stale, malformed): the peer answers 403 or 400."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class PeerAsk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    namespace: bytes  # the model's page namespace (proto/page_ids.kv_namespace)
    root: bytes  # the chain root of the request's cache salt (proto/page_ids.chain_root)
    page_ids: tuple[bytes, ...]  # the context's full pages, from the root
    start: int  # the first page wanted; those before it are only checked
    max_bytes: int  # the most page bytes the asker has room for
    sent_at: float  # unix time: asks outside MAX_SKEW_S are refused
    deadline_s: float  # how long the asker waits: the peer gives up on it after that


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerAsk)


def ask_mac(key: bytes, body: bytes) -> str:
    return blake3.blake3(body, key=key).hexdigest(16)


def encode_ask(ask: PeerAsk, key: bytes) -> tuple[bytes, str]:
    """The POST body and its MAC header value."""
    body = _encoder.encode(ask)
    return body, ask_mac(key, body)


def decode_ask(body: bytes, mac: str | None, key: bytes, now: float | None = None) -> PeerAsk:
    """The ask in `body`, checked: its MAC first (403), then its shape and age (400, 403)."""
    if not mac or not _equal(ask_mac(key, body), mac):
        raise PeerAskError(403, "not a peer: the ask's MAC does not verify under this "
                                "server's peer key")
    try:
        ask = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerAskError(400, f"not a peer ask: {exc}") from None
    now = time.time() if now is None else now
    if abs(now - ask.sent_at) > MAX_SKEW_S:
        raise PeerAskError(403, "the ask is stale (or the clocks differ by over "
                                f"{MAX_SKEW_S:.0f} s)")
    ids = (ask.namespace, ask.root, *ask.page_ids)
    if any(len(i) != ID_BYTES for i in ids) or len(ask.page_ids) > MAX_ASK_PAGES \
            or not 0 <= ask.start < max(1, len(ask.page_ids)) or ask.max_bytes < 0 \
            or not 0 < ask.deadline_s <= 60:
        raise PeerAskError(400, "not a peer ask: ids of 16 bytes, at most "
                                f"{MAX_ASK_PAGES} pages, 0 <= start < pages, a deadline "
                                "of at most 60 s")
    return ask


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.strip().lower().encode())
