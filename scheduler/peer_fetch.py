"""Pages from a peer, the core's side: which page ids a waiting request lacks, the ask for them,
and what came back (docs/design/kv-pages.md "Pages from a peer"). No sockets: the kvstore asks
the peers (kvstore/peers.py) and writes what they give into its store; the pages then join the
disk index here, and the request is placed like any other and restores them from disk.

A waiting request is looked at once, before its first placement: the full pages of its context
past the longest prefix this server holds (in a slot, on disk, or on their way there) are asked
for, at most what the disk budget has room for (eviction makes the room, as for a write; the
bytes stay reserved while the ask is out). The request is not placed while the ask is out;
`PeerPagesFetched` ends the wait, and so does the deadline (the kvstore's, plus a grace for its
answer to come back): past it, the request is placed with what is here and prefills the rest.
A peer can make a request wait, never fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.proto.base import ROLE_KVSTORE
from switchyard.proto.scheduler_kvstore import FetchPeerPages, PeerPagesFetched
from switchyard.proto.status import PeerServerStatus
from switchyard.scheduler.core_state import CoreState
from switchyard.scheduler.requests import Request, Slot

# How long past the kvstore's deadline the core waits for its answer (it writes the pages).
ANSWER_GRACE_S = 2.0


def held_pages(chain: list[bytes], slots: list[Slot], root: bytes, here) -> int:
    """Pages at the front of `chain` (a context's full pages from `root`) this server holds: the
    longest run a slot of the same root has, or the longest run `here` (on disk, or on their
    way there) has."""
    in_slot = 0
    for slot in slots:
        if slot.root != root:
            continue
        k = 0
        for mine, theirs in zip(chain, slot.page_ids):
            if mine != theirs:
                break
            k += 1
        in_slot = max(in_slot, k)
    on_disk = 0
    while on_disk < len(chain) and here(chain[on_disk]):
        on_disk += 1
    return max(in_slot, on_disk)


@dataclass
class PeerCounts:
    """What one peer gave this server since the scheduler started."""

    num_asks: int = 0
    num_pages: int = 0
    num_bytes: int = 0
    fetch_s: float = 0.0
    num_failures: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class _Ask:
    until: float
    reserved: int  # bytes of disk budget held for the answer


@dataclass
class PeerFetches:
    state: CoreState
    asks: dict[str, _Ask] = field(default_factory=dict)
    counts: dict[str, PeerCounts] = field(default_factory=dict)
    num_overdue: int = 0

    def __post_init__(self) -> None:
        self.counts = {url: PeerCounts() for url in self.state.config.peers}

    def ask(self, now: float) -> None:
        """Ask the peers for what the waiting requests not yet looked at lack."""
        st, cfg = self.state, self.state.config
        if not cfg.peers or not cfg.trimmable or not st.pages.enabled:
            return  # hybrid models restore to state pages: not fetched (yet)
        P = cfg.page_size
        for rid in st.waiting:
            req = st.requests[rid]
            if req.peer_asked:
                continue
            req.peer_asked = True
            if req.generated:
                continue  # preempted: its own pages are here
            chain = req.context_chain(st.pages.chain_namespace, P)
            have = held_pages(chain, st.slots, req.root, st.pages.here)
            per_page = st.pages.page_file_bytes(P, False)
            want = len(chain) - have
            if want < 1 or not per_page:
                continue
            room = st.pages.make_room_for_fetch(want * per_page, now, st.pinned)
            num = min(want, room // per_page)
            if num < 1:
                continue
            self._send(req, chain[:have + num], have, num * per_page, now)

    def _send(self, req: Request, chain: list[bytes], have: int, max_bytes: int,
              now: float) -> None:
        st, cfg = self.state, self.state.config
        st.pages.fetching_bytes += max_bytes
        self.asks[req.rid] = _Ask(now + cfg.peer_deadline_s + ANSWER_GRACE_S, max_bytes)
        req.fetching = True
        st.outbox.send_to(ROLE_KVSTORE, FetchPeerPages(req.rid, req.root, tuple(chain), have,
                                                       max_bytes, cfg.peer_deadline_s))
        st.outbox.log("peer.asked", rid=req.rid, num_held=have,
                      num_asked=len(chain) - have)

    def fetched(self, msg: PeerPagesFetched, now: float) -> None:
        """The kvstore's answer: the pages it wrote join the index (even for a request that
        is gone or gave up: they are on disk)."""
        st = self.state
        self._end(msg.rid)
        st.pages.add_fetched(msg.pages)
        for result in msg.results:
            counts = self.counts.setdefault(result.peer, PeerCounts())
            counts.num_asks += 1
            counts.num_pages += result.num_pages
            counts.num_bytes += result.num_bytes
            counts.fetch_s += result.fetch_s
            if result.error:
                counts.num_failures += 1
                counts.last_error = result.error
        st.outbox.log("peer.pages", rid=msg.rid, num_pages=len(msg.pages),
                      num_bytes=sum(p.nbytes for p in msg.pages),
                      num_failures=sum(1 for r in msg.results if r.error))

    def expire(self, now: float) -> None:
        """Asks past their deadline: their requests are placed with what is here."""
        for rid, ask in list(self.asks.items()):
            if rid not in self.state.requests:
                self._end(rid)
            elif now >= ask.until:
                self._end(rid)
                self.num_overdue += 1
                self.state.outbox.log("peer.overdue", rid=rid)

    def kvstore_restarted(self) -> None:
        """Its asks are lost with it: nobody waits for them."""
        for rid in list(self.asks):
            self._end(rid)

    def _end(self, rid: str) -> None:
        ask = self.asks.pop(rid, None)
        if ask is not None:
            self.state.pages.fetching_bytes -= ask.reserved
        req = self.state.requests.get(rid)
        if req is not None:
            req.fetching = False

    def status(self) -> list[PeerServerStatus]:
        return [PeerServerStatus(url=url, num_asks=c.num_asks, num_pages=c.num_pages,
                                 num_bytes=c.num_bytes, fetch_s=round(c.fetch_s, 4),
                                 num_failures=c.num_failures, last_error=c.last_error)
                for url, c in self.counts.items()]
