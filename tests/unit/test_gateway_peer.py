"""Scheduler liveness, restart detection and request bookkeeping, without sockets."""

import pytest

from switchyard.gateway.errors import APIError
from switchyard.gateway.peer import PeerChange, PeerMonitor, RequestTable
from switchyard.gateway.scheduler_client import SchedulerClient
from switchyard.proto import codec
from switchyard.proto.base import PROTOCOL_VERSION, Heartbeat, Hello
from switchyard.proto.gateway_scheduler import (
    CancelRequest,
    GroupState,
    RequestFailed,
    RequestFinished,
    SubmitRequest,
    TokensGenerated,
)
from switchyard.proto.values import SamplingParams


@pytest.fixture
def anyio_backend():
    return "asyncio"


def hello(boot="s1", version=PROTOCOL_VERSION):
    return Hello(version, boot, "scheduler", 123)


def state(boot="s1", ready=True):
    return GroupState(boot, ready, True, 0, 0)


def test_connected_only_after_hello_and_until_silence():
    peer = PeerMonitor(timeout_s=5)
    assert not peer.connected and peer.status().connected is False
    assert peer.on_message(state(), now=0) is PeerChange.FIRST_CONTACT
    assert not peer.connected  # no Hello answer yet
    assert peer.on_message(hello(), now=1) is PeerChange.NONE
    assert peer.connected and peer.status().worker_ready
    assert peer.check(now=5.5) is PeerChange.NONE
    assert peer.check(now=6.5) is PeerChange.TIMED_OUT
    assert not peer.connected and peer.status().ever_connected
    assert peer.check(now=7) is PeerChange.NONE  # reported once
    assert peer.on_message(state(), now=8) is PeerChange.REVIVED
    assert not peer.connected  # must be greeted again


def test_new_boot_id_is_a_restart():
    peer = PeerMonitor(timeout_s=5)
    peer.on_message(hello("a"), now=0)
    assert peer.on_message(state("a"), now=1) is PeerChange.NONE
    assert peer.on_message(state("b"), now=2) is PeerChange.RESTARTED
    assert peer.boot_id == "b" and not peer.connected
    assert peer.on_message(hello("b"), now=3) is PeerChange.NONE
    assert peer.connected


def test_worker_not_ready_is_reported():
    peer = PeerMonitor(timeout_s=5)
    peer.on_message(hello(), now=0)
    peer.on_message(state(ready=False), now=0)
    assert peer.connected and not peer.status().worker_ready


def test_request_table_routes_and_closes():
    table = RequestTable()
    queue = table.open("r1")
    with pytest.raises(KeyError):
        table.open("r1")
    assert table.deliver(TokensGenerated("r1", (1, 2)))
    assert table.deliver(RequestFinished("r1", "stop", 3, 0, 2))
    assert "r1" not in table
    assert not table.deliver(TokensGenerated("r1", (3,)))  # late events are dropped
    assert [queue.get_nowait().kind for _ in range(2)] == ["tokens_generated",
                                                           "request_finished"]


def test_fail_all_ends_every_request_retryably():
    table = RequestTable()
    queues = [table.open(f"r{i}") for i in range(3)]
    assert sorted(table.fail_all("component_restarted", "x", 1.0)) == ["r0", "r1", "r2"]
    assert len(table) == 0
    for queue in queues:
        failed = queue.get_nowait()
        assert isinstance(failed, RequestFailed) and failed.retryable


# --- the client's protocol logic, driven by hand (its socket tasks are never started) ---------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def sent(client):
    out = []
    while not client._outbox.empty():
        out.append(codec.decode(client._outbox.get_nowait()))
    return out


def make_client():
    clock = Clock()
    client = SchedulerClient("ipc:///nonexistent", boot_id="g1", heartbeat_s=1,
                             peer_timeout_s=3, clock=clock)
    client.on_message(hello("s1"))
    client.on_message(state("s1"))
    sent(client)
    return client, clock


def submit(rid="r1"):
    return SubmitRequest(rid, (1, 2, 3), 10, SamplingParams(seed=1))


def test_submit_is_refused_until_connected():
    client = SchedulerClient("ipc:///x", boot_id="g1", heartbeat_s=1, peer_timeout_s=3)
    with pytest.raises(APIError) as info:
        client.submit(submit())
    assert info.value.status == 503 and "Retry-After" in info.value.headers


def test_hello_is_repeated_until_answered_then_heartbeats():
    clock = Clock()
    client = SchedulerClient("ipc:///x", boot_id="g1", heartbeat_s=1, peer_timeout_s=3,
                             clock=clock)
    client.on_tick()
    assert [type(m) for m in sent(client)] == [Hello]
    client.on_message(state("s1"))
    assert [type(m) for m in sent(client)] == [Hello]  # first contact: say Hello at once
    client.on_message(hello("s1"))
    client.on_tick()
    assert sent(client) == [Heartbeat("g1")]


@pytest.mark.anyio
async def test_restart_fails_in_flight_requests_and_says_hello_again():
    client, clock = make_client()
    stream = client.submit(submit())
    assert sent(client) == [submit()]
    client.on_message(TokensGenerated("r1", (5,)))
    client.on_message(state("s2"))  # new boot id
    assert await stream.get() == TokensGenerated("r1", (5,))
    failed = await stream.get()
    assert failed.code == "component_restarted" and failed.retryable
    assert stream.finished
    messages = sent(client)
    assert CancelRequest("r1") in messages
    assert isinstance(messages[-1], Hello)
    with pytest.raises(APIError):  # not greeted by the new scheduler yet
        client.submit(submit("r2"))
    client.on_message(hello("s2"))
    client.submit(submit("r2"))


@pytest.mark.anyio
async def test_silence_fails_in_flight_requests_and_refuses_new_ones():
    client, clock = make_client()
    stream = client.submit(submit())
    clock.now = 2.0
    client.on_tick()
    assert client.status().connected
    clock.now = 3.5
    client.on_tick()
    failed = await stream.get()
    assert failed.code == "scheduler_unavailable" and failed.retryable
    assert not client.status().connected
    with pytest.raises(APIError):
        client.submit(submit("r2"))
    client.on_message(state("s1"))  # back, same boot
    assert isinstance(sent(client)[-1], Hello)
    client.on_message(hello("s1"))
    assert client.status().connected


@pytest.mark.anyio
async def test_dropped_connection_fails_requests_at_once():
    client, clock = make_client()
    stream = client.submit(submit())
    client.on_disconnected()
    failed = await stream.get()
    assert failed.code == "scheduler_unavailable" and failed.retryable
    assert not client.status().connected and client.status().ever_connected
    assert CancelRequest("r1") in sent(client)
    clock.now = 100.0
    client.on_tick()  # no second failure report; Hello until answered
    assert isinstance(sent(client)[-1], Hello)


@pytest.mark.anyio
async def test_closing_a_stream_cancels_once_and_only_while_running():
    client, _ = make_client()
    stream = client.submit(submit())
    sent(client)
    stream.close()
    stream.close()
    assert sent(client) == [CancelRequest("r1")]
    assert "r1" not in client.requests

    done = client.submit(submit("r2"))
    client.on_message(RequestFinished("r2", "stop", 3, 0, 1))
    assert isinstance(await done.get(), RequestFinished)
    sent(client)
    done.close()
    assert sent(client) == []


@pytest.mark.anyio
async def test_cancel_keeps_listening_for_the_final_event():
    client, _ = make_client()
    stream = client.submit(submit())
    sent(client)
    stream.cancel()
    stream.cancel()
    assert sent(client) == [CancelRequest("r1")]
    client.on_message(RequestFinished("r1", "cancelled", 3, 0, 4))
    assert (await stream.get()).finish_reason == "cancelled"
    stream.close()
    assert sent(client) == []


@pytest.mark.anyio
async def test_stream_get_times_out_and_iterates():
    client, _ = make_client()
    stream = client.submit(submit())
    assert await stream.get(timeout=0.01) is None
    client.on_message(TokensGenerated("r1", (1,)))
    client.on_message(RequestFinished("r1", "length", 3, 0, 1))
    assert [e.kind async for e in stream] == ["tokens_generated", "request_finished"]


def test_protocol_mismatch_is_not_a_greeting():
    client = SchedulerClient("ipc:///x", boot_id="g1", heartbeat_s=1, peer_timeout_s=3)
    client.on_message(hello("s1", version=PROTOCOL_VERSION + 1))
    assert not client.status().connected
