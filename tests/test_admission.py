"""Admission that keeps room for the good peers: a full stream listener
closes the peers that have done least (no message < spoke but not useful <
useful) to admit a newcomer, and bounds the connections of one address.
The broker says which peers are useful; floods come from a process of their
own (tests/flood_connections.py)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport

from mdp import Broker, Client, Limits, Worker
from mdp.majordomo import broker_machine, codec
from mdp.majordomo.broker_machine import BrokerMachine, MarkUseful
from mdp.sp.peers import SPClient, SPServer
from mdp.transport import stream
from mdp.transport.framing import encode_greeting, encode_record
from mdp.transport.router import _leastUseful, _RouterConnection, _routers
from mdp.transport.spframing import REP, REQ, SPFraming, encode_message, header
from tests.conftest import Net, RawRouter
from tests.procs import ENV, Process, bounded, python, reactor, wait_until
from tests.test_limits import binding_of, raw_stream
from tests.test_mdp_behaviour import FAST, echo, make_client, start_broker, start_worker

C, W = codec.CLIENT_HEADER, codec.WORKER_HEADER


def marked(actions: list[Any], useful: bool = True) -> list[Any]:
    """The peers *actions* mark useful (or, with *useful* false, useful no more)."""
    return [a.key for a in actions if type(a) is MarkUseful and a.useful is useful]


# --- the broker's judgement: which peers are useful ------------------------------------

def test_the_broker_machine_lists_the_peers_that_do_useful_work_once_each() -> None:
    machine = BrokerMachine(heartbeat=FAST)
    route = "binding"
    junk, stranger, worker, client = ((route, name) for name in (b"J", b"S", b"W", b"C"))

    def useful(key: Any, frames: list[bytes], now: float = 0.0) -> list[Any]:
        return marked(machine.handleMessage(key, frames, now))

    assert useful(junk, [W, codec.W_READY, b"junk"]) == []  # a READY for a service nobody calls
    assert useful(stranger, [C, codec.C_REQUEST, b"nobody", b"x"]) == []  # no one serves it
    assert useful(stranger, [C, codec.C_REQUEST, b"mmi.service", b"echo"]) == []
    assert useful(worker, [W, codec.W_READY, b"echo"]) == []
    assert useful(client, [C, codec.C_REQUEST, b"echo", b"1"]) == [worker, client]  # served
    assert useful(worker, [W, codec.W_FINAL, b"C" + (1).to_bytes(8, "big"), b"", b"1"]) == []
    assert useful(client, [C, codec.C_REQUEST, b"echo", b"2"]) == []  # once each
    second = (route, b"W2")
    assert useful(second, [W, codec.W_READY, b"echo"]) == [second]  # its service has clients
    # the workers go; a client waiting for a service that has had workers is useful
    for key in (worker, second):
        assert marked(machine.handlePeerGone(key, 1.0), False) == [key]
    waiting = (route, b"C2")
    assert useful(waiting, [C, codec.C_REQUEST, b"echo", b"3"], 1.0) == [waiting]
    machine.handlePeerGone(client, 1.0)  # forgotten with its connection
    assert useful(client, [C, codec.C_REQUEST, b"echo", b"4"], 1.0) == [client]
    restarted = (route, b"W3")
    assert useful(restarted, [W, codec.W_READY, b"echo"], 1.5) == [restarted]


def test_a_client_is_useful_while_it_has_a_request_and_a_grace_after() -> None:
    """Marked useful no more between ``USEFUL_GRACE`` and twice that (and a
    tick) after its last request left the broker, never while one is queued
    or served; a worker once it is removed; listed again when it asks again."""
    machine = BrokerMachine(heartbeat=FAST)
    grace = broker_machine.USEFUL_GRACE
    worker, quick, slow = (("route", name) for name in (b"W", b"C", b"S"))
    listed = marked(machine.handleMessage(worker, [W, codec.W_READY, b"echo"], 0.0))
    listed += marked(machine.handleMessage(quick, [C, codec.C_REQUEST, b"echo", b"1"], 0.0))  # served
    listed += marked(machine.handleMessage(slow, [C, codec.C_REQUEST, b"echo", b"2"], 0.0))  # queued
    assert {quick, slow, worker} == set(listed)
    left = {quick: 1.0, slow: 21.0}  # when their last request leaves
    unlisted: dict[Any, float] = {}
    for now in range(1, 50):
        actions = []
        if now == 1:
            actions += machine.handleMessage(worker, [W, codec.W_FINAL, b"C" + (1).to_bytes(8, "big"),
                                                      b"", b"1"], now)
        if now == 21:  # served for 20 s
            actions += machine.handleMessage(worker, [W, codec.W_FINAL, b"S" + (2).to_bytes(8, "big"),
                                                      b"", b"2"], now)
        if now <= 40:
            actions += machine.handleMessage(worker, [W, codec.W_HEARTBEAT], now)
        for key in marked(actions + machine.handleTick(now), False):
            unlisted.setdefault(key, now)
    for key in left:
        assert left[key] + grace <= unlisted[key] <= left[key] + 2 * grace + 1
    assert 40 < unlisted[worker] < 42  # silent: removed
    listed = marked(machine.handleMessage(worker, [W, codec.W_READY, b"echo"], 50.0))
    listed += marked(machine.handleMessage(quick, [C, codec.C_REQUEST, b"echo", b"3"], 50.0))
    assert set(listed) == {quick, worker}


# --- the listener's ranking ------------------------------------------------------------

class JudgingRouter(RawRouter):
    marksUseful = True


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["connect", "message", "useful", "idle", "drop"]),
                          st.integers(0, 5)), max_size=40))
def test_the_connection_closed_for_a_newcomer_is_one_that_did_least(
        events: list[tuple[str, int]]) -> None:
    """Whatever the peers did, in whatever order: none that is useful is
    chosen; one that has sent no message for a second (oldest first) goes
    before one that has spoken (least recently heard first), and that one
    before one just connected.  (Event *i* happens at *i*/8 s.)"""
    router = stream.StreamRouter(JudgingRouter(), Clock())
    _routers.discard(router)  # (its connections have no transport: no other listener's room)
    connections: dict[int, _RouterConnection] = {}
    model: dict[int, tuple[int, int]] = {}  # open connection -> (rank, when it last did something)
    for when, (event, n) in enumerate(events):
        connection = connections.get(n)
        if event == "connect":
            if connection is not None:
                continue
            connection = connections[n] = _RouterConnection()
            connection.router, connection.since = router, when / 8
            connection.hostRanks = router.hostRanks.setdefault(None, ({}, {}))
            router.ungreeted[connection] = connection.hostRanks[0][connection] = None
            model[n] = (0, when)
        elif connection is None or n not in model:
            continue
        elif event == "message":
            if not connection.useful:  # (as a message is delivered to a judging router)
                connection.markUseful(False)
            if model[n][0] < 2:
                model[n] = (1, when)
        elif event == "useful":
            connection.markUseful()
            model[n] = (2, when)
        elif event == "idle":  # (the broker unmarks only what it marked)
            if connection.useful:
                connection.markUseful(False)
                model[n] = (1, when)
        else:
            connection._unrank()  # (what drop does first)
            connection.dropped = True
            del model[n]
    now = len(events) / 8
    chosen = _leastUseful([router.ranks], now)
    if connections:  # the address's ranking is the same (all from one here)
        assert _leastUseful([router.hostRanks[None]], now) is chosen
    candidates = [(rank if rank or when <= len(events) - 8 else 1.5, when, n)
                  for n, (rank, when) in model.items() if rank < 2]
    if not candidates:
        assert chosen is None
    else:
        assert chosen is connections[min(candidates)[2]]


class Counted(OrderedDict):  # type: ignore[type-arg]
    """An ordered dict that counts the times it is walked."""

    walks = 0

    def __iter__(self) -> Any:
        Counted.walks += 1
        return super().__iter__()


def test_at_an_address_cap_only_that_address_connections_are_looked_at() -> None:
    """Making room for a newcomer from an address at its cap walks that
    address's candidates, not every connection of the listener."""
    receiver = JudgingRouter()
    receiver.clock = clock = Clock()
    router = stream.StreamRouter(receiver, clock, limits=Limits(maxConnectionsPerAddress=2))
    _routers.discard(router)
    router.ungreeted, router.spoken = Counted(), Counted()
    router.ranks = (router.ungreeted, router.spoken)
    opened = []
    for n in range(202):
        connection = router.buildProtocol(IPv4Address("TCP", f"10.1.0.{n}" if n < 200 else "10.2.0.1", 5))
        connection.makeConnection(StringTransport())
        connection.dataReceived(encode_record([b"hello"]))
        opened.append(connection)
    crowded = opened[-1].host
    router.markUseful(opened[-1].peer)
    assert router._crowded(crowded) == (f"2 connections from {crowded} open "
                                        "(maxConnectionsPerAddress)", opened[-2])
    router.markUseful(opened[-2].peer)
    Counted.walks = 0
    assert router._crowded(crowded)[1] is None
    assert Counted.walks == 0
    for connection in opened:
        connection.transport.loseConnection()
        connection.connectionLost(None)
    assert router.hostRanks == {} and router.hosts == {}


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_full_broker_closes_the_peers_that_did_least_to_admit_newcomers(net: Net) -> None:
    broker, endpoint = await start_broker(net, limits=Limits(maxConnections=4))
    bound = binding_of(broker)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("echo", b"in")) == [b"in"]  # both useful now
    junk = await raw_stream(net, endpoint)
    junk.sendFrames(W, codec.W_READY, b"junk")
    await net.until(lambda: len(broker.workers) == 2)
    silent = await raw_stream(net, endpoint)
    await net.until(lambda: len(bound.connections) == 4)
    newcomer = make_client(net, endpoint)  # the one whose READY no client wants goes
    assert await net.wait(newcomer.request("echo", b"new")) == [b"new"]
    await net.wait(junk.lost)
    assert not silent.lost.called  # (it has had no time to speak)
    late = make_client(net, endpoint)  # then the one that sent nothing
    assert await net.wait(late.request("echo", b"late")) == [b"late"]
    await net.wait(silent.lost)
    assert bound.evicted == 2 and bound.refused == 0 and len(broker.workers) == 1
    last = await raw_stream(net, endpoint)  # every peer useful: refused
    await net.wait(last.lost)
    assert bound.refused == 1
    assert await net.wait(client.request("echo", b"still")) == [b"still"]


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_client_reconnecting_with_its_identity_stays_useful(net: Net) -> None:
    """A newer connection that takes over a useful client's identity is
    useful at once (the broker hears of no new peer), and greeted: a newcomer
    closes the junk, not the client, and no handshake timeout ends it."""
    broker, endpoint = await start_broker(net, limits=Limits(maxConnections=3, handshakeTimeout=1.0))
    bound = binding_of(broker)
    start_worker(net, endpoint, "echo", echo)
    await net.until(lambda: b"echo" in broker.services)
    ask = encode_greeting(b"ME") + encode_record([C, codec.C_REQUEST, b"echo", b"x"])
    first = await raw_stream(net, endpoint)
    first.transport.write(ask)
    await net.until(lambda: first.received)
    second = await raw_stream(net, endpoint)  # the same client, reconnected
    second.transport.write(ask)
    await net.wait(first.lost)
    await net.until(lambda: second.received)
    assert bound.connections[b"ME"].useful
    junk = await raw_stream(net, endpoint)
    junk.sendFrames(W, codec.W_READY, b"junk")
    await net.until(lambda: len(broker.workers) == 2)
    await raw_stream(net, endpoint)  # the newcomer
    await net.wait(junk.lost)
    assert not second.lost.called and bound.evicted == 1
    await net.wait(deferLater(reactor(), 1.2, lambda: None))
    assert not second.lost.called


def test_a_peer_id_on_two_routes_is_two_useful_clients() -> None:
    machine = BrokerMachine(heartbeat=FAST)
    for route in ("zeromq", "stream"):
        machine.handleMessage((route, b"W"), [W, codec.W_READY, b"echo"], 0.0)
    listed = []
    for route in ("zeromq", "stream"):
        listed += marked(machine.handleMessage((route, b"C"), [C, codec.C_REQUEST, b"echo", b"x"], 0.0))
    assert ("stream", b"C") in listed


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_connections_from_one_address_are_bounded(net: Net) -> None:
    """At ``maxConnectionsPerAddress`` the address's silent connection makes
    room; if all its connections have spoken, the newcomer is refused."""
    receiver = RawRouter()
    receiver.clock = net.reactor
    bound = await net.wait(stream.StreamRouter.listen(
        net.bindEndpoint(), receiver, net.reactor,
        limits=Limits(maxConnections=100, maxConnectionsPerAddress=2)))
    net.addCleanup(bound.close)
    first, second = [await raw_stream(net, bound.endpoint) for _ in range(2)]
    second.sendFrames(b"hello")
    await net.until(lambda: len(receiver.received) == 1)
    third = await raw_stream(net, bound.endpoint)
    await net.wait(first.lost)
    third.sendFrames(b"hello")
    await net.until(lambda: len(receiver.received) == 2)
    fourth = await raw_stream(net, bound.endpoint)
    await net.wait(fourth.lost)
    assert bound.evicted == 1 and bound.refused == 1 and bound.hosts == {"127.0.0.1": 2}
    assert not second.lost.called and not third.lost.called


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_an_sp_peer_that_sent_only_its_header_makes_room_first(net: Net) -> None:
    receiver = RawRouter()
    receiver.clock = net.reactor
    bound = await net.wait(stream.StreamRouter.listen(
        net.bindEndpoint(), receiver, net.reactor, limits=Limits(maxConnections=2),
        framing=SPFraming(REP)))
    net.addCleanup(bound.close)
    headerOnly = await raw_stream(net, bound.endpoint)
    headerOnly.transport.write(header(REQ))
    asking = await raw_stream(net, bound.endpoint)
    asking.transport.write(header(REQ) + encode_message(b"\x80\x00\x00\x01hi"))
    await net.until(lambda: len(receiver.received) == 1)
    newcomer = await raw_stream(net, bound.endpoint)
    await net.wait(headerOnly.lost)
    assert not asking.lost.called and not newcomer.lost.called and bound.evicted == 1


# --- floods from another process -------------------------------------------------------

async def flood(kind: str, port: int, count: int, rate: float = 200.0) -> Process:
    """The flooding process, once it has opened *count* connections (reopening
    at most *rate* a second)."""
    attacker = Process(reactor(), python("-m", "tests.flood_connections", kind, str(port),
                                         str(count), str(rate)), ENV)
    try:
        await attacker.waitFor("holding", timeout=30)
    except BaseException:
        await attacker.stop()
        raise
    return attacker


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_flood_of_cheap_connections_keeps_no_client_or_restarting_worker_out() -> None:
    """300 connections, each sending a READY for a service nobody calls or a
    request nobody serves, reopened as they are closed, against a broker
    capped at 200: a new client is answered and a worker restarting for a
    service with a client waiting is registered and serves it, within
    seconds, during the flood."""
    r = reactor()
    broker = Broker(r, limits=Limits(maxConnections=200))
    stoppers: list[Any] = [broker.close]
    try:
        bound = await broker.listen("tcp:host=127.0.0.1:port=0")
        endpoint = bound.endpoint
        worker = Worker(endpoint, "echo", echo, r)
        worker.start()
        stoppers.append(worker.stop)
        client = Client(endpoint, r)
        stoppers.append(client.close)
        assert await bounded(client.request("echo", b"before"), 10) == [b"before"]
        attacker = await flood("mdp", bound.port.getHost().port, 300)
        stoppers.append(attacker.stop)
        await attacker.waitFor("reopened [1-9]", 10)  # the cap is reached
        newcomer = Client(endpoint, r)
        stoppers.append(newcomer.close)
        assert await bounded(newcomer.request("echo", b"new"), 5) == [b"new"]
        await worker.stop()
        waiting = client.request("echo", b"waiting")
        await wait_until(lambda: b"echo" in broker.services
                         and broker.services[b"echo"].size == 1, 5)
        restarted = Worker(endpoint, "echo", echo, r)
        restarted.start()
        stoppers.append(restarted.stop)
        assert await bounded(waiting, 5) == [b"waiting"]
        assert attacker.running and len(bound.connections) >= 150  # the flood went on
    finally:
        for stop in reversed(stoppers):
            await stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_connections_that_asked_once_make_room_once_idle(monkeypatch: Any) -> None:
    """60 connections, each with one real request to a served service, then
    idle, reopened as they are closed (20 a second: a client in a reconnect
    loop, not a stream of real requests, which is useful traffic), against a
    broker capped at 40: once their grace is over, a new client is answered."""
    monkeypatch.setattr(broker_machine, "USEFUL_GRACE", 0.5)
    r = reactor()
    broker = Broker(r, heartbeat=FAST, limits=Limits(maxConnections=40))
    stoppers: list[Any] = [broker.close]
    try:
        bound = await broker.listen("tcp:host=127.0.0.1:port=0")
        worker = Worker(bound.endpoint, "echo", echo, r, heartbeat=FAST)
        worker.start()
        stoppers.append(worker.stop)
        await wait_until(lambda: b"echo" in broker.services, 5)
        attacker = await flood("echo", bound.port.getHost().port, 60, rate=20.0)
        stoppers.append(attacker.stop)
        await attacker.waitFor("reopened [1-9]", 10)  # the cap is reached
        newcomer = Client(bound.endpoint, r)
        stoppers.append(newcomer.close)
        assert await bounded(newcomer.request("echo", b"new"), 8) == [b"new"]
        assert attacker.running and len(bound.connections) >= 30  # the flood went on
    finally:
        for stop in reversed(stoppers):
            await stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_flood_of_sp_headers_keeps_no_requester_out() -> None:
    """300 connections sending only the SP header, reopened as they are
    closed, against an SP REP server capped at 200: a new requester is
    answered within seconds, during the flood."""
    r = reactor()
    server = SPServer(lambda payload: payload.upper(), r, limits=Limits(maxConnections=200))
    stoppers: list[Any] = [server.close]
    try:
        router = await server.listen("tcp://127.0.0.1:0")
        port = router.port.getHost().port
        attacker = await flood("sp", port, 300)
        stoppers.append(attacker.stop)
        await attacker.waitFor("reopened [1-9]", 10)
        client = SPClient(f"tcp://127.0.0.1:{port}", r)
        stoppers.append(client.close)
        assert await bounded(client.request(b"hi"), 5) == b"HI"
        assert attacker.running and len(router.connections) >= 150
    finally:
        for stop in reversed(stoppers):
            await stop()
