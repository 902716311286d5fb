"""The kvstore's side of pages from a peer (docs/design/kv-pages.md "Pages from a peer").

- `PeerPageServer`: a thread that answers the asks the gateway forwards (on the runtime dir's
  `peer-pages.sock`): the pages of the asked chain it holds, read from their files and
  verified with the page key, re-MAC'd with the peer key (kvstore/peer_wire.py). It serves a
  page only when every page before it in the chain, back to the ask's root, is in its index
  (`pages_to_serve`): a chain from another salt's root is another tenant's, and gets nothing.
- `PeerFetcher`: for the scheduler's `FetchPeerPages`, asks every peer at once over HTTP on
  threads, takes the longest run of verified pages that came back within the deadline, and
  hands it to the daemon's loop, which writes the pages into the store and answers
  `PeerPagesFetched`. A peer that is slow, gone or wrong costs at most the deadline.
"""

from __future__ import annotations

import http.client
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import msgspec
import structlog
import zmq

from switchyard.kvstore.page_file import PageGeometry
from switchyard.kvstore.peer_wire import WirePage, decode_pages, encode_page, read_local_page
from switchyard.kvstore.store import IndexEntry, PageStore
from switchyard.proto.scheduler_kvstore import FetchPeerPages, PeerFetchResult
from switchyard.proto.peer_pages import MAC_HEADER, PEER_PAGES_PATH, PeerAsk, encode_ask
from switchyard.proto.sockets import bind_router

# Answer bytes beyond the pages asked for (headers): an answer longer than this is refused.
_HEADER_ALLOWANCE = 4096


def pages_to_serve(lookup: Callable[[bytes], IndexEntry | None],
                   ask: PeerAsk) -> list[tuple[bytes, IndexEntry]]:
    """The pages of `ask.page_ids[ask.start:]` to send: in chain order, each with its whole
    chain back to `ask.root` held here, up to the first gap and within `ask.max_bytes`."""
    parent, served, num_bytes = ask.root, [], 0
    for k, pid in enumerate(ask.page_ids):
        entry = lookup(pid)
        if entry is None or entry.namespace != ask.namespace or entry.parent_id != parent:
            break
        parent = pid
        if k >= ask.start:
            num_bytes += entry.nbytes
            if num_bytes > ask.max_bytes:
                break
            served.append((pid, entry))
    return served


class PeerPageServer(threading.Thread):
    """Answers forwarded asks: frames [identity, ask body] in, [identity, count, records] out."""

    def __init__(self, endpoint: str, store: PageStore, peer_key: bytes, log):
        super().__init__(name="peer-pages", daemon=True)
        self.endpoint, self.store, self.peer_key, self.log = endpoint, store, peer_key, log
        self.stopping = threading.Event()
        self.ctx = zmq.Context()
        self.log_context = structlog.contextvars.get_contextvars()  # role, boot id, pid

    def run(self) -> None:
        structlog.contextvars.bind_contextvars(**self.log_context)
        sock = bind_router(self.ctx, self.endpoint)
        try:
            while not self.stopping.is_set():
                if not sock.poll(200):
                    continue
                identity, body = sock.recv_multipart()[:2]
                count, blob = self.answer(body)
                try:
                    sock.send_multipart([identity, str(count).encode(), blob])
                except zmq.ZMQError:
                    pass  # the gateway gave up waiting: nobody to answer
        finally:
            sock.close(0)
            self.ctx.term()

    def answer(self, body: bytes) -> tuple[int, bytes]:
        started = time.perf_counter()
        try:
            ask = msgspec.msgpack.decode(body, type=PeerAsk)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return 0, b""  # the gateway checked it: never happens
        records = []
        for pid, entry in pages_to_serve(self.store.get, ask):
            page = read_local_page(entry.path, ask.namespace, pid, self.store.key)
            if page is None:
                break  # evicted meanwhile, or bad: the daemon's next read removes it
            records.append(encode_page(*page, self.peer_key))
        blob = b"".join(records)
        self.log.info("peer.served", num_asked=len(ask.page_ids) - ask.start,
                      num_pages=len(records), num_bytes=len(blob),
                      serve_s=round(time.perf_counter() - started, 4))
        return len(records), blob

    def stop(self) -> None:
        self.stopping.set()
        self.join(2)


@dataclass(frozen=True)
class Fetched:
    """What the peers gave for one FetchPeerPages: the longest verified run, and each answer."""

    msg: FetchPeerPages
    pages: list[WirePage]
    results: tuple[PeerFetchResult, ...]


class PeerFetcher:
    def __init__(self, peers: tuple[str, ...], peer_key: bytes, log):
        self.peers, self.peer_key, self.log = peers, peer_key, log
        self.asks = ThreadPoolExecutor(max(4, 2 * len(peers)), thread_name_prefix="peer-ask")
        self.done: queue.Queue[Fetched] = queue.Queue()
        self.num_inflight = 0

    def start(self, msg: FetchPeerPages, namespace: bytes,
              geometry: PageGeometry | None) -> None:
        self.num_inflight += 1
        threading.Thread(target=self._fetch, args=(msg, namespace, geometry),
                         name="peer-fetch", daemon=True).start()

    def finished(self) -> list[Fetched]:
        """Fetches done since the last call (the daemon's loop writes their pages)."""
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                break
        self.num_inflight -= len(out)
        return out

    def _fetch(self, msg: FetchPeerPages, namespace: bytes,
               geometry: PageGeometry | None) -> None:
        best: list[WirePage] = []
        results: list[PeerFetchResult] = []
        try:
            best, results = self._ask_all(msg, namespace, geometry)
        finally:  # whatever happened, the daemon hears of this fetch
            self.done.put(Fetched(msg, best, tuple(results)))

    def _ask_all(self, msg: FetchPeerPages, namespace: bytes, geometry: PageGeometry | None
                 ) -> tuple[list[WirePage], list[PeerFetchResult]]:
        """Every peer asked at once; the longest verified run within the deadline."""
        ask = PeerAsk(namespace, msg.root, msg.page_ids, msg.start, msg.max_bytes, time.time(),
                      msg.deadline_s)
        body, mac = encode_ask(ask, self.peer_key)
        started = time.monotonic()
        futures = {self.asks.submit(self._ask, url, body, mac, msg, namespace, geometry,
                                    msg.deadline_s): url for url in self.peers}
        finished, _ = wait(futures, timeout=msg.deadline_s)
        best: list[WirePage] = []
        results = []
        for future, url in futures.items():
            if future not in finished:
                future.cancel()  # not started yet (the pool is busy with silent peers)
                results.append(PeerFetchResult(url, 0, 0, round(time.monotonic() - started, 4),
                                               no_answer(msg.deadline_s)))
                continue
            try:
                pages, result = future.result()
            except Exception as exc:  # noqa: BLE001 - one peer's answer: never the request
                pages, result = [], PeerFetchResult(url, 0, 0,
                                                    round(time.monotonic() - started, 4),
                                                    f"{type(exc).__name__}: {exc}")
            results.append(result)
            if len(pages) > len(best):
                best = pages
        return best, results

    def _ask(self, url: str, body: bytes, mac: str, msg: FetchPeerPages, namespace: bytes,
             geometry: PageGeometry | None, timeout_s: float
             ) -> tuple[list[WirePage], PeerFetchResult]:
        started = time.perf_counter()
        request = urllib.request.Request(
            url.rstrip("/") + PEER_PAGES_PATH, data=body, method="POST",
            headers={MAC_HEADER: mac, "Content-Type": "application/msgpack"})
        limit = msg.max_bytes + _HEADER_ALLOWANCE * (len(msg.page_ids) - msg.start)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                blob = response.read(limit + 1)
        except urllib.error.HTTPError as exc:
            return [], self._result(url, started, f"HTTP {exc.code}")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # refused, unreachable, timed out, reset, cut short, not HTTP
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):  # said as the deadline's wait says it
                return [], self._result(url, started, no_answer(timeout_s))
            return [], self._result(url, started, str(reason) or type(exc).__name__)
        if len(blob) > limit:
            return [], self._result(url, started, "answer larger than the pages asked for")
        pages, problem = decode_pages(blob, self.peer_key, namespace, msg.root, msg.page_ids,
                                      msg.start, geometry)
        return pages, PeerFetchResult(url, len(pages), sum(len(p.payload) for p in pages),
                                      round(time.perf_counter() - started, 4), problem)

    @staticmethod
    def _result(url: str, started: float, error: str) -> PeerFetchResult:
        return PeerFetchResult(url, 0, 0, round(time.perf_counter() - started, 4), error)

    def close(self) -> None:
        self.asks.shutdown(wait=False, cancel_futures=True)


def no_answer(deadline_s: float) -> str:
    """A peer that did not answer within the deadline, whether the wait for all peers or the
    peer's own socket timed out first."""
    return f"no answer within {deadline_s} s"
