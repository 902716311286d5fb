"""Pages from a peer over real sockets, without a model (docs/design/kv-pages.md "Pages from a
peer"): the kvstore's fetcher asks over HTTP, the gateway's route checks the ask and forwards
it over the ipc socket to the kvstore's page server, which reads and verifies the pages from a
real page store; the fetcher verifies what came back. An ask under another peer key gets 403,
and a chain asked under another root nothing.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import structlog
import uvicorn
from starlette.applications import Starlette

from switchyard.gateway import peer_pages_api
from switchyard.kvstore.peers import PeerFetcher, PeerPageServer
from switchyard.kvstore.store import PageStore
from switchyard.common.endpoints import Endpoints
from switchyard.proto.scheduler_kvstore import FetchPeerPages
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, chain_root
from switchyard.common.settings import Settings
from switchyard.testing.group import free_port, short_tmp_dir

NS = b"n" * 16
P = 16
KEY = b"k" * 32
ALICE = chain_root(b"alice-salt-16byt")


@pytest.fixture(scope="module")
def peer():
    """A peer: its page store holding one chain of Alice's, its kvstore's page server, and its
    gateway's route on a real port."""
    runtime = short_tmp_dir("sypeer")
    key_file = runtime / "peer.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    store = PageStore(runtime / "kv", sync=False, key=b"p" * 32)
    tokens = [100 + i for i in range(6 * P)]
    ids = chain_page_ids(NS, tokens, P, ALICE)
    parent = ALICE
    for k, pid in enumerate(ids):
        store.write(NS, parent, tokens[k * P:(k + 1) * P], bytes([k]) * (P * 8), page_id=pid)
        parent = pid
    server = PeerPageServer(Endpoints(runtime).peer_pages, store, KEY, structlog.get_logger())
    server.start()
    app = Starlette()
    port = free_port()
    peer_pages_api.mount(app, Settings(peer=(f"http://127.0.0.1:{free_port()}",),
                                       peer_key_file=str(key_file), runtime_dir=str(runtime)))
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", ids
    finally:
        http.should_exit = True
        thread.join(10)
        server.stop()
        store.close()


def fetch(url: str, key: bytes, root: bytes, ids, start: int = 0, deadline_s: float = 5.0):
    fetcher = PeerFetcher((url,), key, structlog.get_logger())
    fetcher.start(FetchPeerPages("r", root, tuple(ids), start, 1 << 30, deadline_s), NS, None)
    deadline = time.monotonic() + 30
    while not (done := fetcher.finished()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    fetcher.close()
    return done[0]


def test_a_fetcher_gets_the_pages_it_lacks_from_its_peer(peer):
    url, ids = peer
    got = fetch(url, KEY, ALICE, ids, start=2)
    assert [p.header.page_id for p in got.pages] == ids[2:]
    assert all(bytes(p.payload) == bytes([k + 2]) * (P * 8) for k, p in enumerate(got.pages))
    (result,) = got.results
    assert result.error == "" and result.num_pages == 4 and result.num_bytes == 4 * P * 8


def test_another_root_gets_nothing(peer):
    url, ids = peer
    got = fetch(url, KEY, ROOT_ID, ids)
    assert got.pages == [] and got.results[0].error == ""


def test_an_ask_under_another_peer_key_is_refused(peer):
    url, ids = peer
    got = fetch(url, b"x" * 32, ALICE, ids)
    assert got.pages == [] and got.results[0].error == "HTTP 403"


def test_a_silent_peer_is_no_answer_within_the_deadline_whichever_wait_ends_first(peer):
    """A peer that accepts and never answers: the wait for all peers and the peer's own socket
    time out at the same deadline, and either way the failure reads the same."""
    _, ids = peer
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nobody ever reads them
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        got = fetch(url, KEY, ALICE, ids, deadline_s=0.3)
        assert got.pages == [] and got.results[0].error == "no answer within 0.3 s"
        fetcher = PeerFetcher((url,), KEY, structlog.get_logger())
        msg = FetchPeerPages("r", ALICE, tuple(ids), 0, 1 << 30, 0.3)
        _, alone = fetcher._ask(url, b"", "00", msg, NS, None, 0.3)  # the socket's own timeout
        fetcher.close()
        assert alone.error == "no answer within 0.3 s"


@pytest.mark.parametrize("reply", [b"SSH-2.0-OpenSSH_9.6\r\n",
                                   b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\nshort"])
def test_a_garbled_answer_is_a_failure_not_a_crash(reply):
    """A peer that answers something else, or a cut-short body, and hangs up: one failed
    answer, and the fetch still ends."""
    with socket.socket() as liar:
        liar.bind(("127.0.0.1", 0))
        liar.listen(1)

        def answer() -> None:
            conn, _ = liar.accept()
            conn.recv(65536)
            conn.sendall(reply)
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        got = fetch(f"http://127.0.0.1:{liar.getsockname()[1]}", KEY, ALICE, [b"a" * 16])
    assert got.pages == [] and got.results[0].error
