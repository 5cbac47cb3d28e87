"""Memory and CPU bounded in bytes, no poison message, no lockout: a test for
every limit (docs/reliability.md lists them), over the transports it concerns."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, protocol
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionAborted
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from mdp import (
    Broker,
    Final,
    Limits,
    MessageTooLarge,
    RemoteError,
    ReplyTooLarge,
    RequestTooLarge,
    ServiceOverloaded,
    WorkerError,
)
from mdp.freelance import FreelanceServer, SequentialClient
from mdp.majordomo import codec, mmi
from mdp.transport import endpoints, stream
from mdp.transport import router as stream_router
from mdp.transport.framing import encode_record
from tests.conftest import LoopbackNet, Net, RawPeer, RawRouter, warnings_logged
from tests.test_mdp_behaviour import FAST, echo, make_client, start_broker, start_worker

W = codec.WORKER_HEADER
KiB = 1024
MiB = 1024 * KiB


def binding_of(broker: Broker) -> Any:
    return broker.bindings[0].transport


class RawStream(protocol.Protocol):
    """A TCP peer of our own making: sends what it is told, reads nothing
    once ``stopReading()`` is called."""

    def __init__(self) -> None:
        self.lost: defer.Deferred[None] = defer.Deferred()
        self.received = b""

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: object = None) -> None:
        self.lost.callback(None)

    def sendFrames(self, *frames: bytes) -> None:
        self.transport.write(encode_record(list(frames)))

    def stopReading(self) -> None:
        self.transport.pauseProducing()


async def raw_stream(net: Net, endpoint: str, proto: Any = None) -> Any:
    """Connect a :class:`RawStream` (or *proto*) to ``tcp:host=…:port=…``;
    closed after the test."""
    port = int(endpoint.rpartition("port=")[2])
    proto = RawStream() if proto is None else proto
    await net.wait(connectProtocol(TCP4ClientEndpoint(net.reactor, "127.0.0.1", port), proto))
    net.addCleanup(lambda: proto.transport.abortConnection())
    return proto


class LogLines:
    """Collects the formatted log lines whose format contains *needle*."""

    def __init__(self, net: Net, needle: str) -> None:
        from twisted.logger import formatEvent

        self.lines: list[str] = []

        def observe(event: dict) -> None:
            if needle in (event.get("log_format") or ""):
                self.lines.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        net.addCleanup(lambda: globalLogPublisher.removeObserver(observe))


# --- roles never send what the other side would refuse ------------------------------

@pytest_twisted.ensureDeferred
async def test_client_refuses_an_oversized_request_without_sending_it(clocknet: LoopbackNet) -> None:
    from tests.test_client import broker_and_client, requests

    router, client = await broker_and_client(clocknet, limits=Limits(maxMessageBytes=1000))
    with pytest.raises(RequestTooLarge, match="1010 bytes exceeds the limit of 1000") as info:
        client.request("svc", b"x" * 1000)  # a caller mistake: raised at once
    assert isinstance(info.value, ValueError)
    with pytest.raises(RequestTooLarge):
        client.request("svc", *[b""] * Limits().maxFrames)
    clocknet.advance(0)
    assert requests(router) == []


def sized(frames: list[bytes]) -> bytes:
    return b"r" * int(frames[0])


@pytest_twisted.ensureDeferred
async def test_worker_answers_413_for_a_reply_too_large_and_keeps_serving(net: Net) -> None:
    limits = Limits(maxMessageBytes=64 * KiB)
    broker, endpoint = await start_broker(net, limits=limits)
    worker = start_worker(net, endpoint, "sized", sized, limits=limits)
    client = make_client(net, endpoint, timeout=10, retries=1, limits=limits)
    for _ in range(3):
        with pytest.raises(MessageTooLarge, match="reply too large to send"):
            await net.wait(client.request("sized", b"70000"))
        assert await net.wait(client.request("sized", b"10")) == [b"r" * 10]
    assert len(broker.workers) == 1 and worker.connected
    assert worker.generation == 1  # never reconnected


@pytest_twisted.ensureDeferred
async def test_worker_closes_a_stream_whose_part_is_too_large(net: Net) -> None:
    limits = Limits(maxMessageBytes=64 * KiB)
    _, endpoint = await start_broker(net, limits=limits)
    closed: list[bool] = []

    async def parts(frames: list[bytes]) -> Any:
        try:
            yield b"small"
            yield b"p" * 70_000
            yield b"never"
            yield Final(b"never")
        finally:
            closed.append(True)

    start_worker(net, endpoint, "parts", parts, limits=limits)
    client = make_client(net, endpoint, timeout=10, retries=1)
    got: list[list[bytes]] = []
    with pytest.raises(MessageTooLarge):
        await net.wait(client.request("parts", b"go", onPartial=got.append))
    assert got == [[b"small"]] and closed == [True]


@pytest_twisted.ensureDeferred
async def test_broker_answers_413_for_a_request_too_large_for_a_worker(net: Net) -> None:
    limits = Limits(maxMessageBytes=4096)
    broker, endpoint = await start_broker(net, limits=limits)
    worker = RawPeer(net, endpoint)
    worker.send(W, codec.W_READY, b"s")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=10, retries=1)
    # fits in the client's REQUEST (8 bytes of header, command and name), not in
    # the worker REQUEST (a longer envelope)
    with pytest.raises(MessageTooLarge, match="request too large for a worker"):
        await net.wait(client.request("s", b"b" * 4086))
    assert [m for m in worker.received if m[1] == codec.W_REQUEST] == []


@pytest_twisted.ensureDeferred
async def test_broker_answers_413_for_a_reply_too_large_for_the_client(net: Net) -> None:
    limits = Limits(maxMessageBytes=4096)
    service = "s" * 200  # the client's FINAL carries the name: 200 bytes more than the worker's
    broker, endpoint = await start_broker(net, limits=limits)
    start_worker(net, endpoint, service, sized, limits=Limits())  # a worker with bigger limits
    client = make_client(net, endpoint, timeout=10, retries=1)
    with pytest.raises(MessageTooLarge, match="reply too large for the client"):
        await net.wait(client.request(service, b"4000"))
    assert await net.wait(client.request(service, b"5")) == [b"r" * 5]


@pytest.mark.parametrize("net", ["loopback", "tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_reply_over_the_clients_own_limits_fails_the_request_without_a_rerun(net: Net) -> None:
    """A client configured with smaller limits than the broker: its transport
    ends the connection that brought the reply, and the request fails instead
    of going out again (which would run it again)."""
    _, endpoint = await start_broker(net)
    runs: list[bytes] = []

    def big(frames: list[bytes]) -> bytes:
        runs.append(frames[0])
        return b"r" * 10_000

    start_worker(net, endpoint, "big", big)
    client = make_client(net, endpoint, timeout=30, retries=3, limits=Limits(maxMessageBytes=4096))
    with pytest.raises(ReplyTooLarge, match="reply from service 'big' too large for this client"
                       ) as raised:
        await net.wait(client.request("big", b"once"))
    # a local condition, not an error reply from a peer
    assert not isinstance(raised.value, RemoteError)
    assert runs == [b"once"]


@pytest_twisted.ensureDeferred
async def test_request_whose_workers_keep_being_lost_fails_after_max_deliveries(net: Net) -> None:
    """Workers whose limits are smaller than the broker's lose their connection
    on a request too large for them; after maxDeliveries the request fails
    instead of going round the workers, and other requests are still served."""
    broker, endpoint = await start_broker(net, heartbeat=FAST, maxDeliveries=3)
    for _ in range(3):
        start_worker(net, endpoint, "echo", echo, heartbeat=FAST,
                     limits=Limits(maxMessageBytes=1000))
    await net.until(lambda: len(broker.workers) == 3)
    client = make_client(net, endpoint, timeout=30, retries=1)
    with pytest.raises(WorkerError, match="the 3 workers given it were each lost"):
        await net.wait(client.request("echo", b"p" * 2000))
    await net.until(lambda: len(broker.workers) == 3, timeout=30)
    assert await net.wait(client.request("echo", b"fine")) == [b"fine"]


# --- queues in bytes ------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_empty_frames_are_not_free(clocknet: LoopbackNet) -> None:
    """300 requests of 9,990 empty frames used to count as 0 bytes queued."""
    broker, endpoint = await start_broker(clocknet, maxQueueBytes=4 * MiB)
    crowd = RawPeer(clocknet, endpoint)
    for _ in range(300):
        crowd.send(codec.CLIENT_HEADER, codec.C_REQUEST, b"svc", *[b""] * 9990)
    clocknet.advance(0)
    assert broker.queued == 6  # 6 x 639,360 bytes fit in 4 MiB; the rest were refused
    assert broker.queuedBytes == 6 * 9990 * 64


@pytest_twisted.ensureDeferred
async def test_queue_bytes_are_bounded_per_service_and_in_all(net: Net) -> None:
    """Bodies count their bytes plus FRAME_OVERHEAD (64) per frame."""
    broker, endpoint = await start_broker(net, maxServiceQueueBytes=1000, maxQueueBytes=1700)
    client = make_client(net, endpoint, timeout=30, retries=1)
    queued = [client.request("a", b"x" * 400) for _ in range(2)]  # 2 x 464 bytes for "a"
    await net.until(lambda: broker.queued == 2)
    with pytest.raises(ServiceOverloaded, match="928 bytes queued for it"):
        await net.wait(client.request("a", b"x" * 400))
    queued.append(client.request("b", b"y" * 600))  # 1592 in all
    await net.until(lambda: broker.queued == 3)
    with pytest.raises(ServiceOverloaded, match="1592 bytes in all"):
        await net.wait(client.request("c", b"z" * 200))
    assert broker.queuedBytes == 1592
    start_worker(net, endpoint, "a", echo)
    start_worker(net, endpoint, "b", echo)
    replies = await net.wait(defer.gatherResults(queued))
    assert replies == [[b"x" * 400], [b"x" * 400], [b"y" * 600]]  # accepted work is served
    assert broker.queuedBytes == 0


# --- what a peer that does not read may cost -----------------------------------------

async def fast_stream(frames: list[bytes]) -> Any:
    for _ in range(int(frames[0])):
        yield b"s" * (64 * KiB)
    yield Final(b"end")


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_stream_broker_disconnects_a_client_that_does_not_read(net: Net) -> None:
    limit = 1 * MiB
    broker, endpoint = await start_broker(net, limits=Limits(maxOutputBytes=limit))
    start_worker(net, endpoint, "stream", fast_stream)
    start_worker(net, endpoint, "echo", echo)
    lines = LogLines(net, "reads slower than it is sent to")
    slow = await raw_stream(net, endpoint)
    slow.stopReading()
    slow.sendFrames(codec.CLIENT_HEADER, codec.C_REQUEST, b"stream", b"2000")  # 125 MiB of reply
    client = make_client(net, endpoint, timeout=10, retries=1)
    assert await net.wait(client.request("echo", b"meanwhile")) == [b"meanwhile"]
    bound = binding_of(broker)
    await net.until(lambda: bound.overflows == 1, timeout=30)
    assert len(lines.lines) == 1
    assert all(c.backlogBytes <= limit for c in bound.connections.values())
    slow.transport.resumeProducing()  # it reads again, and finds its connection gone
    await net.wait(slow.lost, timeout=10)
    assert await net.wait(client.request("echo", b"after")) == [b"after"]


@pytest.mark.parametrize("net", ["zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_freelance_server_cuts_off_a_zmq_client_that_does_not_read(net: Net) -> None:
    """1 MiB requests from a client that never reads: replies pile up in the
    server's pipe to it (64 messages) and then in its backlog, until that
    passes maxOutputBytes (it used to reach 3 GB in 6 s)."""
    import zmq

    server = FreelanceServer(echo, net.reactor, limits=Limits(maxOutputBytes=8 * MiB))
    bound = await net.wait(server.listen(net.bindEndpoint()))
    net.addCleanup(server.close)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVHWM, 1)
    raw.connect(bound.endpoint.removeprefix("zmq:"))
    net.addCleanup(raw.close)
    sent = 0
    while not bound.overflows and sent < 400:  # up to 400 MiB, never read
        raw.send_multipart([str(sent).encode(), b"q" * MiB])
        sent += 1
        await net.until(lambda n=sent: server.served == n or bound.overflows > 0)
    assert bound.overflows == 1 and sent < 200
    assert bound.backlogs == {}  # dropped with the peer
    client = SequentialClient([bound.endpoint], net.reactor, timeout=5, deadline=10)
    net.addCleanup(client.close)
    assert await net.wait(client.request(b"hi")) == [b"hi"]


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_freelance_server_disconnects_a_client_that_does_not_read(net: Net) -> None:
    server = FreelanceServer(echo, net.reactor, limits=Limits(maxOutputBytes=1 * MiB))
    bound = await net.wait(server.listen(net.bindEndpoint()))
    net.addCleanup(server.close)
    slow = await raw_stream(net, bound.endpoint)
    slow.stopReading()
    sent = 0
    while not bound.overflows and sent < 400:  # up to 400 MiB, never read
        slow.sendFrames(str(sent).encode(), b"q" * MiB)
        sent += 1
        await net.until(lambda n=sent: server.served == n or bound.overflows > 0)
    assert bound.overflows == 1 and sent < 400
    slow.transport.resumeProducing()
    await net.wait(slow.lost, timeout=10)
    # the server still answers others
    client = SequentialClient([bound.endpoint], net.reactor, timeout=5, deadline=10)
    net.addCleanup(client.close)
    assert await net.wait(client.request(b"hi")) == [b"hi"]


@pytest_twisted.ensureDeferred
async def test_freelance_server_bounds_requests_in_hand_and_replies(clocknet: LoopbackNet) -> None:
    held: list[defer.Deferred] = []

    def handler(frames: list[bytes]) -> Any:
        if frames[0] == b"big":
            return b"B" * 5000
        held.append(defer.Deferred())
        return held[-1]

    server = FreelanceServer(handler, clocknet.reactor, maxPending=2,
                             limits=Limits(maxMessageBytes=4096))
    bound = await clocknet.wait(server.listen(clocknet.bindEndpoint()))
    clocknet.addCleanup(server.close)
    client = SequentialClient([bound.endpoint], clocknet.reactor, timeout=30, deadline=30)
    clocknet.addCleanup(client.close)
    waiting = [client.request(b"slow") for _ in range(2)]
    await clocknet.until(lambda: server.pending == 2)
    with pytest.raises(ServiceOverloaded):
        await clocknet.wait(client.request(b"one more"))
    for d in held:
        d.callback(b"done")
    assert await clocknet.wait(defer.gatherResults(waiting)) == [[b"done"], [b"done"]]
    with pytest.raises(MessageTooLarge):
        await clocknet.wait(client.request(b"big"))
    assert server.pending == 0 and server.pendingBytes == 0


# --- stream connections ----------------------------------------------------------------

@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_connection_that_says_nothing_is_dropped_after_the_handshake_timeout(net: Net) -> None:
    broker, endpoint = await start_broker(net, limits=Limits(handshakeTimeout=0.3))
    silent = await raw_stream(net, endpoint)
    await net.wait(silent.lost, timeout=10)
    assert binding_of(broker).connections == {}
    greeted = await raw_stream(net, endpoint)
    greeted.sendFrames(codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"x")
    await net.until(lambda: b"404" in greeted.received)
    assert len(binding_of(broker).connections) == 1  # a peer that spoke may stay idle


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_record_left_incomplete_is_dropped_after_the_record_timeout(net: Net) -> None:
    broker, endpoint = await start_broker(net, limits=Limits(recordTimeout=0.3))
    peer = await raw_stream(net, endpoint)
    peer.sendFrames(codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"x")
    await net.until(lambda: b"404" in peer.received)
    peer.transport.write(struct.pack(">I", 10 * MiB) + b"a trickle that never ends")
    await net.wait(peer.lost, timeout=10)
    assert binding_of(broker).connections == {}


def accepted_by(router: stream.StreamRouter, wire: StringTransport) -> Any:
    """A connection *router* accepts over *wire* (no socket)."""
    connection = router.buildProtocol(None)
    connection.makeConnection(wire)
    return connection


def test_a_disconnected_peer_that_does_not_read_is_aborted_after_the_record_timeout() -> None:
    """disconnectPeer closes once what was written is sent; a peer that does
    not read would keep its slot and all that was written to it for good, its
    loss never reported: after ``recordTimeout`` the connection is aborted."""
    clock = Clock()
    receiver = RawRouter()
    receiver.clock = clock
    bound = stream.StreamRouter(receiver, clock, limits=Limits(recordTimeout=5))
    wire = StringTransport()
    connection = accepted_by(bound, wire)
    try:
        connection.dataReceived(encode_record([b"hello"]))
        ((_, peer, _),) = receiver.received
        connection.pauseProducing()  # Twisted's buffer is full: the peer reads nothing
        bound.sendMessage(peer, [b"x" * 1000])
        bound.disconnectPeer(peer)
        assert wire.disconnecting and not wire.disconnected
        clock.advance(4.9)
        assert not wire.disconnected
        clock.advance(0.1)
        assert wire.disconnected  # aborted
    finally:
        connection.connectionLost(Failure(ConnectionAborted()))
    assert receiver.disconnected == [peer] and bound.connections == {}
    assert clock.getDelayedCalls() == []


def test_a_router_made_without_a_reactor_throttles_its_warnings_on_the_global_one() -> None:
    from twisted.internet import reactor

    receiver = RawRouter()
    receiver.clock = reactor
    bound = stream.StreamRouter(receiver, limits=Limits(maxMessageBytes=64))
    wire = StringTransport()
    connection = accepted_by(bound, wire)
    try:
        with warnings_logged() as events:
            connection.dataReceived(struct.pack(">I", 10 * MiB))  # an oversized record
        assert connection.dropped and wire.disconnected
        assert ["dropping stream peer" in event["log_format"] for event in events] == [True]
    finally:
        connection.connectionLost(Failure(ConnectionAborted()))


#: the first 40 bytes of a record of one 100-byte frame
HALF_A_RECORD = encode_record([b"x" * 100])[:40]


class CutShort(protocol.Protocol):
    """A stream listener of our own making that sends half a record to
    whoever connects, then closes."""

    def connectionMade(self) -> None:
        self.transport.write(HALF_A_RECORD)
        self.transport.loseConnection()


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_peer_that_closes_in_the_middle_of_a_message_is_logged_as_such(net: Net) -> None:
    """A plain disconnect would hide that a message was lost on the way;
    a close after whole messages, or one this side makes, says nothing of it."""
    broker, endpoint = await start_broker(net)
    bound = binding_of(broker)
    unfinished = LogLines(net, "in the middle of a message")
    peers = [await raw_stream(net, endpoint) for _ in range(3)]
    for peer in peers:
        peer.sendFrames(codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"x")
    await net.until(lambda: all(b"404" in peer.received for peer in peers))
    whole, cut, ours = peers
    whole.transport.loseConnection()
    await net.wait(whole.lost)
    await net.until(lambda: len(bound.connections) == 2)
    assert unfinished.lines == []
    where = f"host='127.0.0.1', port={cut.transport.getHost().port})"
    cut.transport.write(HALF_A_RECORD)  # then gone
    cut.transport.loseConnection()
    await net.until(lambda: len(unfinished.lines) == 1)
    assert where in unfinished.lines[0] and "(36 bytes of it received)" in unfinished.lines[0]
    ours.transport.write(HALF_A_RECORD)
    await net.until(lambda: bound.connections[next(iter(bound.connections))].decoder.inRecord)
    await bound.close()  # the broker's own close: the peer lost nothing it knows of
    await net.wait(ours.lost)
    assert len(unfinished.lines) == 1
    # the connecting side says the same of a listener that closes mid-message
    port = net.reactor.listenTCP(0, protocol.Factory.forProtocol(CutShort), interface="127.0.0.1")
    net.addCleanup(port.stopListening)
    RawPeer(net, f"tcp:host=127.0.0.1:port={port.getHost().port}")
    await net.until(lambda: len(unfinished.lines) >= 2)
    assert f"port={port.getHost().port})" in unfinished.lines[1], unfinished.lines


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_stream_peer_announcing_an_oversized_record_is_dropped_at_once(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    vandal = await raw_stream(net, endpoint)
    vandal.transport.write(struct.pack(">I", 1 << 30))  # 1 GiB announced
    await net.wait(vandal.lost, timeout=10)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("echo", b"unharmed")) == [b"unharmed"]


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_connection_cap_makes_room_from_silent_connections_then_refuses(net: Net) -> None:
    broker, endpoint = await start_broker(net, limits=Limits(maxConnections=2))
    bound = binding_of(broker)
    silent = [await raw_stream(net, endpoint) for _ in range(2)]
    await net.until(lambda: len(bound.connections) == 2)
    worker = start_worker(net, endpoint, "echo", echo)  # a third: the oldest silent one goes
    await net.until(lambda: len(broker.workers) == 1)
    await net.wait(silent[0].lost)
    assert not silent[1].lost.called
    client = make_client(net, endpoint)  # the other silent one makes room
    assert await net.wait(client.request("echo", b"in")) == [b"in"]
    await net.wait(silent[1].lost)
    late = await raw_stream(net, endpoint)  # two peers that spoke: no room
    await net.wait(late.lost)
    assert bound.refused == 1 and worker.connected


class Greeter:
    """A dealer's receiver that says hello as each connection is made."""

    def __init__(self) -> None:
        self.dealer: Any = None
        self.received: list[list[bytes]] = []

    def connectionMade(self) -> None:
        self.dealer.sendMessage([b"hello"])

    def connectionLost(self, reason: object) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        self.received.append(frames)


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_dealer_turned_away_at_a_listeners_cap_backs_off(net: Net) -> None:
    """A listener at maxConnections accepts a newcomer and closes it at
    once: each such connection is a failed attempt, so the delays grow as
    for a refused connect (ClientService alone starts its backoff again at
    every connect); a connection over which the far side spoke starts it
    again."""
    receiver = RawRouter()
    receiver.clock = net.reactor
    bound = await net.wait(stream.StreamRouter.listen(
        net.bindEndpoint(), receiver, net.reactor, limits=Limits(maxConnections=1)))
    net.addCleanup(bound.close)
    first = await raw_stream(net, bound.endpoint)
    first.sendFrames(b"first")  # the one slot, held by a peer that spoke
    await net.until(lambda: len(receiver.received) == 1)
    asked: list[int] = []

    def policy(attempt: int) -> float:
        asked.append(attempt)
        return 0.001 * 2 ** min(attempt, 8)

    greeter = Greeter()
    greeter.dealer = stream.StreamDealer(bound.endpoint, greeter, net.reactor, retryPolicy=policy)
    net.addCleanup(greeter.dealer.close)
    await net.until(lambda: len(asked) >= 4, timeout=10)
    assert asked[:4] == [1, 2, 3, 4] and bound.refused >= 4
    first.transport.loseConnection()  # room for it
    await net.until(lambda: len(receiver.received) == 2, timeout=10)
    _, peer, _ = receiver.received[1]
    bound.sendMessage(peer, [b"welcome"])
    await net.until(lambda: greeter.received == [[b"welcome"]], timeout=10)
    count = len(asked)
    bound.disconnectPeer(peer)
    await net.until(lambda: len(asked) > count, timeout=10)
    assert asked[count] == 1


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_connections_this_side_closes_are_no_failed_attempts(net: Net) -> None:
    """A client's channels to a broker that has not answered yet, each
    closed here soon after it was opened (a request given up): no one
    turned them away, so the backoff of the next loss starts at its first
    step, not at 32 s."""
    receiver = RawRouter()
    receiver.clock = net.reactor
    bound = await net.wait(stream.StreamRouter.listen(net.bindEndpoint(), receiver, net.reactor))
    net.addCleanup(bound.close)
    link = stream.StreamChannels(bound.endpoint, net.reactor)
    net.addCleanup(link.close)

    class Pipe:
        made = 0

        def connectionMade(self) -> None:
            self.made += 1

        def messageReceived(self, frames: list[bytes]) -> None:
            pass

        def connectionLost(self, reason: object) -> None:
            pass

    for n in range(4):
        receiver_ = Pipe()
        pipe = link.open(receiver_)
        pipe.sendMessage([b"request %d" % n])
        await net.until(lambda n=n: len(receiver.received) == n + 1, timeout=10)
        pipe.close()
        await net.until(lambda: link.protocol is None, timeout=10)
    assert link._unproven == 0


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_the_descriptor_budget_caps_connections_as_max_connections_does(net: Net) -> None:
    """Below maxConnections, what the process's descriptor limit leaves
    (:func:`mdp.transport.stream.descriptor_budget`) is the cap: silent
    connections make room, then newcomers are refused, saying why."""
    broker, endpoint = await start_broker(net)
    bound = binding_of(broker)
    base = stream.StreamRouter.accepted  # open elsewhere in the process
    bound.descriptorBudget = lambda: base + 2
    silent = [await raw_stream(net, endpoint) for _ in range(2)]
    await net.until(lambda: len(bound.connections) == 2)
    worker = start_worker(net, endpoint, "echo", echo)
    await net.until(lambda: len(broker.workers) == 1)
    await net.wait(silent[0].lost)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("echo", b"in")) == [b"in"]
    await net.wait(silent[1].lost)
    refusals = LogLines(net, "refused a connection")
    late = await raw_stream(net, endpoint)
    await net.wait(late.lost)
    assert bound.refused == 1 and worker.connected
    assert any("all that its descriptor limit leaves room for" in line
               for line in refusals.lines), refusals.lines
    # closed connections give their room back: two that speak get in, neither refused
    await worker.stop()
    await client.close()
    await net.until(lambda: stream.StreamRouter.accepted == base)
    for n in range(2):
        start_worker(net, endpoint, "echo", echo)
        await net.until(lambda n=n: len(broker.workers) == n + 1)
    assert bound.refused == 1


class FakeLimits:
    """``resource``'s descriptor-limit calls over a soft and a hard limit,
    granting soft limits up to *most*."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int, most: int) -> None:
        self.limits = (soft, hard)
        self.most = most

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == self.RLIMIT_NOFILE and limits[1] == self.limits[1]
        if limits[0] > self.most:
            raise ValueError("not allowed to raise maximum limit")
        self.limits = limits


@pytest.mark.parametrize("soft, hard, most, raised", [
    (1024, 4096, 1 << 20, 4096),  # to the hard limit
    (1024, 1 << 30, 1 << 20, 1024),  # a hard limit the kernel will not grant: as it was
    (256, -1, 1 << 20, 65536),  # unlimited (macOS): a large finite one
    (256, -1, 24576, 10240),  # ... or OPEN_MAX, which macOS grants
    (256, -1, 200, 256),  # ... or nothing
    (65536, 65536, 1 << 20, 65536),
    (-1, -1, 1 << 20, -1),  # no limit at all
])
def test_servers_raise_the_soft_descriptor_limit_as_far_as_it_goes(
        monkeypatch: Any, soft: int, hard: int, most: int, raised: int) -> None:
    fake = FakeLimits(soft, hard, most)
    monkeypatch.setattr(endpoints, "resource", fake)
    assert endpoints.raise_descriptor_limit() == raised
    assert fake.limits[0] == raised


def test_a_select_reactor_caps_the_descriptor_budget_at_what_select_can_watch(
        monkeypatch: Any) -> None:
    """select() (Twisted's default reactor on macOS) cannot watch a descriptor
    of 1,024 or more, whatever the limit was raised to."""
    import sys

    from twisted.internet.selectreactor import SelectReactor

    monkeypatch.setattr(endpoints, "resource", FakeLimits(65536, 65536, 65536))
    assert stream.descriptor_budget() == 65536 - 8192
    monkeypatch.setitem(sys.modules, "twisted.internet.reactor", object.__new__(SelectReactor))
    assert stream.descriptor_budget() == 1024 - 128
    monkeypatch.setattr(endpoints, "resource", None)  # no descriptor limit at all
    assert stream.descriptor_budget() == 1024 - 128


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_a_router_on_a_port_of_the_applications_warns_of_its_descriptor_budget(
        net: Net, monkeypatch: Any) -> None:
    """Embedded with :meth:`StreamRouter.factory` on a port the application
    opens, a router warns at start, as :meth:`StreamRouter.listen` does, when
    the descriptor limit caps it below maxConnections; once each."""
    warnings = LogLines(net, "descriptor limit leaves room for")
    router = stream.StreamRouter(RawRouter(), net.reactor, limits=Limits(maxConnections=500))
    router.descriptorBudget = lambda: 100
    port = net.reactor.listenTCP(0, router.factory(), interface="127.0.0.1")
    net.addCleanup(port.stopListening)
    net.addCleanup(router.close)
    assert len(warnings.lines) == 1 and "leaves room for 100 connections" in warnings.lines[0]
    monkeypatch.setattr(stream_router, "descriptor_budget", lambda: 10)
    listened = await net.wait(stream.StreamRouter.listen(
        "tcp:host=127.0.0.1:port=0", RawRouter(), net.reactor, limits=Limits(maxConnections=50)))
    net.addCleanup(listened.close)
    # listen() warns once, naming the address its port got
    assert len(warnings.lines) == 2 and f"{listened.endpoint}:" in warnings.lines[1]


@pytest.mark.parametrize("net", ["tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_connections_that_send_garbage_hold_no_slot(net: Net) -> None:
    """Four bytes (an empty record) used to greet a connection for good, so
    10,000 x 4 bytes locked workers out; garbage, or a command answered with
    DISCONNECT, now costs the sender its connection."""
    broker, endpoint = await start_broker(net, limits=Limits(maxConnections=3))
    vandals = [await raw_stream(net, endpoint) for _ in range(3)]
    vandals[0].transport.write(b"\x00\x00\x00\x00")  # an empty record
    vandals[1].sendFrames(b"garbage")
    vandals[2].sendFrames(W, codec.W_HEARTBEAT)  # before READY: DISCONNECT
    for vandal in vandals:
        await net.wait(vandal.lost)
    assert b"\x06" in vandals[2].received  # it was told why, then closed
    start_worker(net, endpoint, "echo", echo)
    await net.until(lambda: len(broker.workers) == 1)
    assert binding_of(broker).refused == 0


# --- ZeroMQ message limits -------------------------------------------------------------

@pytest.mark.parametrize("net", ["zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_zmq_drops_messages_over_the_limits_without_keeping_them(net: Net) -> None:
    import zmq

    limits = Limits(maxMessageBytes=4096, maxFrames=16)
    broker, endpoint = await start_broker(net, limits=limits)
    bound = binding_of(broker)
    assert bound.connection.socket.get(zmq.MAXMSGSIZE) == 4096
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint.removeprefix("zmq:"))
    net.addCleanup(raw.close)
    raw.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service"] + [b"f"] * 100)
    raw.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service"] + [b"b" * 1000] * 5)
    raw.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"x"])
    await net.until(lambda: raw.poll(0))
    assert raw.recv_multipart() == [codec.CLIENT_HEADER, codec.C_FINAL, b"mmi.service", b"404"]
    assert bound.oversizedCount == 2 and broker.invalid == 0


@pytest.mark.parametrize("net", ["zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_zmq_reads_off_a_huge_message_over_many_reactor_turns(net: Net, monkeypatch: Any) -> None:
    """A message of very many frames is dropped a bounded number of frames per
    reactor turn (it used to stall the reactor for seconds)."""
    import zmq

    from mdp.transport import zmqio

    monkeypatch.setattr(zmqio, "FRAMES_PER_TURN", 100)
    broker, endpoint = await start_broker(net, limits=Limits(maxFrames=16))
    bound = binding_of(broker)
    turns: list[int] = []
    connection = bound.connection
    original = connection.doRead

    def counted() -> None:
        turns.append(1)
        original()

    monkeypatch.setattr(connection, "doRead", counted)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint.removeprefix("zmq:"))
    net.addCleanup(raw.close)
    raw.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service"] + [b""] * 20_000)
    raw.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"x"])
    await net.until(lambda: raw.poll(0))
    assert raw.recv_multipart()[-1] == b"404"
    assert bound.oversizedCount == 1
    assert len(turns) >= 20_000 // 100


# --- logs, tables, MMI -------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_bad_input_logs_are_throttled(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet)
    lines = LogLines(clocknet, "dropped invalid message")
    vandal = RawPeer(clocknet, endpoint)
    for n in range(1000):
        vandal.send(b"garbage", str(n).encode())
    clocknet.advance(0)
    assert broker.invalid == 1000 and len(lines.lines) == 1
    clocknet.advance(1.0)
    vandal.send(b"garbage")
    clocknet.advance(0)
    assert len(lines.lines) == 2 and "999 similar held back" in lines.lines[1]


@pytest_twisted.ensureDeferred
async def test_a_departing_client_costs_only_the_services_it_used(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet)
    crowd = RawPeer(clocknet, endpoint)
    for n in range(3000):
        crowd.send(codec.CLIENT_HEADER, codec.C_REQUEST, b"svc-%d" % n, b"x")
    leaver = RawPeer(clocknet, endpoint)
    for name in (b"svc-1", b"svc-2"):
        leaver.send(codec.CLIENT_HEADER, codec.C_REQUEST, name, b"y")
    await clocknet.until(lambda: broker.queued == 3002)
    calls: list[bytes] = []

    class WatchedPending(OrderedDict):  # type: ignore[type-arg]
        """A queue's requests by client, telling which queue was asked
        (compiled, ServiceQueue is an extension type: its methods cannot
        be replaced, its fields can)."""

        queue = b""

        def get(self, key: Any, default: Any = None) -> Any:
            calls.append(self.queue)
            return super().get(key, default)

    for queue in broker.services.values():
        watched = WatchedPending(queue.pending)
        watched.queue = queue.name
        queue.pending = watched
    await clocknet.wait(leaver.transport.close())
    await clocknet.until(lambda: broker.queued == 3000)
    assert sorted(calls) == [b"svc-1", b"svc-2"]


@pytest_twisted.ensureDeferred
async def test_mmi_listings_are_bounded(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet)
    crowd = RawPeer(clocknet, endpoint)
    total = mmi.MAX_ENTRIES + 200
    for n in range(total):
        crowd.send(codec.CLIENT_HEADER, codec.C_REQUEST, b"svc-%04d" % n, b"x")
    await clocknet.until(lambda: len(broker.services) == total)
    client = make_client(clocknet, endpoint)
    listing, more = await clocknet.wait(client.request("mmi.services", b""))
    services = json.loads(listing)
    assert len(services) == mmi.MAX_ENTRIES and min(services) == "svc-0000"
    assert json.loads(more) == {"truncated": True, "total": total}
    (workers,) = await clocknet.wait(client.request("mmi.workers", b""))
    assert json.loads(workers) == []


# --- workers: no lockout, no reconnect storm --------------------------------------------

@pytest_twisted.ensureDeferred
async def test_refused_worker_backs_off(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet, maxWorkers=1)
    start_worker(clocknet, endpoint, "a", echo)
    await clocknet.until(lambda: len(broker.workers) == 1)
    refused = start_worker(clocknet, endpoint, "b", echo)
    readies: list[float] = []
    original = refused.connectionMade

    def counted() -> None:
        readies.append(clocknet.reactor.seconds())
        original()

    refused.connectionMade = counted  # type: ignore[method-assign]
    clocknet.advance(20)
    # at once, then after 1, 2, 4 and 8 s of backoff (it used to be ~1,100 a second)
    assert len(readies) <= 6
    assert broker.workers.keys() == {k for k, w in broker.workers.items() if w.service.name == b"a"}


@pytest_twisted.ensureDeferred
async def test_per_service_worker_limit(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet, maxServiceWorkers=2)
    for _ in range(3):
        start_worker(clocknet, endpoint, "crowded", echo)
    other = start_worker(clocknet, endpoint, "other", echo)
    clocknet.advance(5)
    assert broker.services[b"crowded"].workers == 2
    assert broker.services[b"other"].workers == 1 and other.connected


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        Limits(maxMessageBytes=0)
    with pytest.raises(ValueError):
        Broker(maxDeliveries=0)
    with pytest.raises(ValueError, match="maxConnections must be a number, got True"):
        Limits(maxConnections=True)
    with pytest.raises(ValueError, match="must be finite, got inf"):
        Limits(handshakeTimeout=float("inf"))
    assert Limits().oversize(10, 2) is None


