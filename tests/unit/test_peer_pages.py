"""Pages from a peer, the pure parts (docs/design/kv-pages.md "Pages from a peer"): the ask and
its MAC, the pages on the wire and their checks, which pages a peer serves (never another
root's), and the scheduler core asking for what it lacks, placing the request once the pages
came or the deadline passed. No sockets, no MLX.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest

from switchyard.deploy.status import format_peers
from switchyard.gateway.tenant_view import status_for
from switchyard.kvstore.peer_wire import decode_pages, encode_page, read_local_page
from switchyard.kvstore.peers import pages_to_serve
from switchyard.kvstore.store import PageStore
from switchyard.proto.scheduler_kvstore import (
    FetchPeerPages,
    PageInfo,
    PeerFetchResult,
    PeerPagesFetched,
)
from switchyard.common.page_ids import ROOT_ID, chain_page_ids, chain_root
from switchyard.proto.peer_pages import PeerAsk, PeerAskError, decode_ask, encode_ask
from switchyard.common.secret_keys import load_peer_key
from switchyard.common.secret_files import SettingsError
from switchyard.common.settings import Settings
from switchyard.proto.status import PeerServerStatus
from switchyard.common.tenants import Tenants, parse_keys
from switchyard.scheduler.events import PlanStep
from switchyard.scheduler.outbox import Addressed
from switchyard.scheduler.peer_fetch import ANSWER_GRACE_S, held_pages
from switchyard.scheduler.requests import Slot
from tests.unit.test_ops_metrics import exposition, samples
from tests.unit.test_ops_metrics import snapshot as metrics_snapshot
from tests.unit.test_ops_status import snapshot as status_snapshot
from tests.unit.test_scheduler_pages import NS, Group, conv

KEY = b"k" * 32
PAGE_KEY = b"p" * 32
P = 16
URL = "http://peer:8000"


def ask_for(ids, root=ROOT_ID, start=0, max_bytes=1 << 30, sent_at=None):
    return PeerAsk(NS, root, tuple(ids), start, max_bytes,
                   time.time() if sent_at is None else sent_at, 2.0)


# --- the ask -------------------------------------------------------------------------------

def test_an_ask_round_trips_under_the_peer_key():
    ask = ask_for([b"a" * 16, b"b" * 16], start=1)
    body, mac = encode_ask(ask, KEY)
    assert decode_ask(body, mac, KEY) == ask


@pytest.mark.parametrize("case", ["other key", "no mac", "tampered", "stale", "bad start"])
def test_an_ask_that_is_not_one_is_refused(case):
    ask = ask_for([b"a" * 16], sent_at=time.time() - 3600 if case == "stale" else None,
                  start=5 if case == "bad start" else 0)
    body, mac = encode_ask(ask, b"x" * 32 if case == "other key" else KEY)
    if case == "tampered":
        body = body[:-1] + bytes([body[-1] ^ 1])
    with pytest.raises(PeerAskError) as err:
        decode_ask(body, None if case == "no mac" else mac, KEY)
    assert err.value.status == (400 if case == "bad start" else 403)


# --- the pages on the wire -----------------------------------------------------------------

def stored_chain(tmp_path, tokens, root=ROOT_ID):
    """A page store holding the full pages of `tokens` from `root`, and their ids."""
    store = PageStore(tmp_path / "kv", sync=False, key=PAGE_KEY)
    ids = chain_page_ids(NS, tokens, P, root)
    parent = root
    for k, pid in enumerate(ids):
        page = tokens[k * P:(k + 1) * P]
        store.write(NS, parent, page, bytes([k]) * (len(page) * 8), page_id=pid)
        parent = pid
    return store, ids


def answer(store, ask):
    records = []
    for pid, entry in pages_to_serve(store.get, ask):
        records.append(encode_page(*read_local_page(entry.path, NS, pid, PAGE_KEY), KEY))
    return b"".join(records)


def test_a_peer_serves_the_pages_asked_for_and_they_verify(tmp_path):
    store, ids = stored_chain(tmp_path, conv(1, 5 * P))
    blob = answer(store, ask_for(ids, start=2))
    pages, problem = decode_pages(blob, KEY, NS, ROOT_ID, ids, 2)
    assert problem == "" and [p.header.page_id for p in pages] == ids[2:]
    assert bytes(pages[0].payload) == bytes([2]) * (P * 8)


def test_a_page_damaged_or_of_another_key_ends_the_answer(tmp_path):
    store, ids = stored_chain(tmp_path, conv(2, 4 * P))
    blob = bytearray(answer(store, ask_for(ids)))
    blob[-5] ^= 1  # the last page's payload
    pages, problem = decode_pages(bytes(blob), KEY, NS, ROOT_ID, ids, 0)
    assert len(pages) == 3 and "MAC" in problem
    pages, problem = decode_pages(bytes(blob), b"x" * 32, NS, ROOT_ID, ids, 0)
    assert pages == [] and "MAC" in problem


def test_pages_out_of_chain_order_are_refused(tmp_path):
    store, ids = stored_chain(tmp_path, conv(3, 3 * P))
    blob = answer(store, ask_for(ids, start=1))
    pages, problem = decode_pages(blob, KEY, NS, ROOT_ID, ids, 0)  # told they start at 0
    assert pages == [] and "not the page asked for" in problem


def test_another_roots_ask_gets_nothing(tmp_path):
    """A tenant's pages (a chain from its salt's root) are served to an ask from that root
    only: the same ids asked under another root (another tenant) get nothing."""
    alice = chain_root(b"alice-salt-16byt")
    store, ids = stored_chain(tmp_path, conv(4, 4 * P), root=alice)
    assert len(pages_to_serve(store.get, ask_for(ids, root=alice))) == 4
    assert pages_to_serve(store.get, ask_for(ids, root=chain_root(b"mallory-salt-16b"))) == []
    assert pages_to_serve(store.get, ask_for(ids, root=ROOT_ID)) == []


def test_a_peer_serves_up_to_the_first_gap_and_within_the_bytes_asked(tmp_path):
    store, ids = stored_chain(tmp_path, conv(5, 6 * P))
    store.delete([ids[4]])
    assert [pid for pid, _ in pages_to_serve(store.get, ask_for(ids, start=1))] == ids[1:4]
    one = store.get(ids[0]).nbytes
    assert len(pages_to_serve(store.get, ask_for(ids, max_bytes=2 * one))) == 2


# --- the scheduler core --------------------------------------------------------------------

def test_held_pages_counts_a_slot_of_the_same_root_or_the_disk():
    chain = [bytes([i]) * 16 for i in range(6)]
    slot = Slot(0)
    slot.page_ids = chain[:3]
    assert held_pages(chain, [slot], ROOT_ID, lambda pid: pid in chain[:2]) == 3
    assert held_pages(chain, [slot], b"r" * 16, lambda pid: pid in chain[:2]) == 2
    assert held_pages(chain, [], ROOT_ID, lambda pid: pid in chain[:5]) == 5


def peer_group() -> Group:
    g = Group()
    g.core.config = dataclasses.replace(g.core.config, peers=(URL,), peer_deadline_s=2.0)
    return g


def fetches(g: Group) -> list[FetchPeerPages]:
    return [m.message for m in g.msgs
            if isinstance(m, Addressed) and isinstance(m.message, FetchPeerPages)]


def test_a_request_waits_for_its_pages_from_a_peer_then_restores_them():
    g = peer_group()
    prompt = conv(6, 5 * P + 3)
    g.submit("r", prompt)
    g.do(PlanStep())
    g.pump()
    asks = fetches(g)
    assert len(asks) == 1 and asks[0].start == 0 and len(asks[0].page_ids) == 5
    assert not any(s.prefills or s.loads for s in g.steps), "not placed while asked"
    g.now += 0.5
    g.do(PlanStep())  # still waiting: nothing placed before the answer or the deadline
    g.pump()
    assert not g.steps
    ids, parent, infos = asks[0].page_ids, ROOT_ID, []
    for pid in ids:
        infos.append(PageInfo(pid, parent, NS, P, 4096 + 100, g.now))
        parent = pid
    g.disk.update((i.page_id, i) for i in infos)  # the kvstore wrote them
    g.do(PeerPagesFetched("r", tuple(infos), (PeerFetchResult(URL, 5, 5 * 4096, 0.1),)))
    g.run()
    record = g.records["r"]
    assert record.num_restored_tokens == 5 * P and record.num_prefilled_tokens == 3
    assert g.core.snapshot(g.now).peer_servers[0].num_pages == 5


def test_past_the_deadline_a_request_prefills_without_its_peer():
    g = peer_group()
    g.submit("r", conv(7, 4 * P + 1))
    g.do(PlanStep())
    g.pump()
    assert len(fetches(g)) == 1
    g.now += 2.0 + ANSWER_GRACE_S
    g.run()
    record = g.records["r"]
    assert record.num_prefilled_tokens == 4 * P + 1 and g.logs("peer.overdue")
    assert g.core.pages.fetching_bytes == 0  # the room held for the answer is given back


def test_what_this_server_holds_is_not_asked_for():
    g = peer_group()
    prompt = conv(8, 4 * P + 1)
    g.submit("a", prompt)
    g.do(PlanStep())
    g.pump()
    g.do(PeerPagesFetched("a", (), ()))  # the peer had nothing
    g.run()
    g.submit("b", prompt + conv(9, 2 * P))
    g.run()
    asks = fetches(g)
    assert len(asks) == 2 and asks[1].start == 4 and len(asks[1].page_ids) == 6


# --- what status and /metrics show -----------------------------------------------------------

def with_peers(status):
    return msgspec.structs.replace(status, peer_servers=[
        PeerServerStatus(url=URL, num_asks=3, num_pages=40, num_bytes=5 << 20, fetch_s=0.75,
                         num_failures=1, last_error="no answer within 2.0 s")])


def test_switchyard_status_lists_each_peer_and_what_it_gave():
    lines = format_peers(with_peers(status_snapshot(time.time())))
    assert lines[0] == "peers: 1 (pages fetched from each)"
    assert URL in lines[-1] and "5.0 MiB" in lines[-1] and "no answer within" in lines[-1]
    assert format_peers(status_snapshot(time.time())) == []


def test_metrics_count_pages_bytes_time_and_failures_per_peer():
    now = time.time()
    got = samples(exposition(with_peers(metrics_snapshot(now)), now))
    assert got[("switchyard_peer_pages_total", (("peer", URL),))] == 40
    assert got[("switchyard_peer_bytes_total", (("peer", URL),))] == 5 << 20
    assert got[("switchyard_peer_fetch_seconds_total", (("peer", URL),))] == 0.75
    assert got[("switchyard_peer_fetch_failures_total", (("peer", URL),))] == 1


# --- the flags -------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, problem", [
    (dict(peer=("127.0.0.1:8001",)), "--peer must be a server's base URL"),
    (dict(peer=("http://h:1/v1",)), "--peer must be a server's base URL"),
    (dict(peer=("http://h:1",), hostfile="hosts.json"), "serve without --hostfile"),
    (dict(peer=("http://h:1",), peer_fetch_timeout_s=0), "--peer-fetch-timeout-s"),
])
def test_bad_peer_flags_are_refused_in_one_line(flags, problem):
    with pytest.raises(SettingsError, match=problem):
        Settings(**flags).validate()


def test_a_peer_key_file_must_be_private_and_a_key(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(SettingsError, match="is not a peer key"):
        load_peer_key(str(path), tmp_path)
    path.write_bytes(KEY)
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="accessible"):
        load_peer_key(str(path), tmp_path)
    path.chmod(0o600)
    assert load_peer_key(str(path), tmp_path) == KEY
    made = load_peer_key("", tmp_path / "cache")  # the default: made once, then the same
    assert len(made) == 32 and load_peer_key("", tmp_path / "cache") == made


def test_a_tenant_key_is_not_shown_the_peers():
    """Any tenant's turns move the peers' counts: the operator's alone."""
    tenants = Tenants(parse_keys("alice sk-a\nops,role=operator sk-o\n"))
    alice, ops = tenants.tenants
    status = with_peers(status_snapshot(time.time()))
    assert status_for(status, alice, tenants).peer_servers == []
    assert status_for(status, ops, tenants).peer_servers[0].url == URL
