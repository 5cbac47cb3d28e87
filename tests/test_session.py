"""Sessions as a transport: on loopback with a Clock (pacing, dead server,
expiry, the queue's bound), and over real TCP and ZeroMQ through a proxy the
test cuts and restores while thousands of messages flow both ways."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, task
from zope.interface import implementer

from mdp import transport
from mdp.interfaces import IDealerReceiver, IRouterReceiver
from mdp.session import codec
from tests.procs import Proxy, reactor, wait_until


@implementer(IRouterReceiver)
class Server:
    """Answers every message with ``re:`` + its first frame; records what
    each session sent, in order."""

    def __init__(self) -> None:
        self.bound: Any = None
        self.got: dict[bytes, list[bytes]] = {}
        self.gone: list[bytes] = []

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.got.setdefault(peer, []).append(frames[0])
        self.bound.sendMessage(peer, [b"re:" + frames[0]])

    def peerDisconnected(self, peer: bytes) -> None:
        self.gone.append(peer)


@implementer(IDealerReceiver)
class Client:
    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.made = 0
        self.lost = 0

    def connectionMade(self) -> None:
        self.made += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        self.got.append(frames[0])

    def connectionLost(self, reason: object) -> None:
        self.lost += 1


# --- loopback, Clock ---------------------------------------------------------------------


async def loopback_pair(net: Any, name: str, **dealer: Any) -> tuple[Server, Any, Client, Any]:
    from mdp.session.transport import SessionDealer

    server = Server()
    server.bound = await net.wait(transport.listen(f"session+loopback:{name}", server, net.reactor))
    net.addCleanup(server.bound.close)
    client = Client()
    pipe = SessionDealer(server.bound.endpoint, client, net.reactor, **dealer)
    net.addCleanup(pipe.close)
    await net.until(lambda: client.made == 1)
    return server, server.bound, client, pipe


@pytest_twisted.ensureDeferred
async def test_cuts_are_invisible_and_lose_nothing(clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "cuts")
    for n in range(300):
        pipe.sendMessage([b"%d" % n])
        if n % 50 == 25:
            for inner in list(bound.machine.byPeer):
                bound.inner.disconnectPeer(inner)
            clocknet.advance(0.05)
            assert pipe.connected  # a session is usable while it re-attaches
    await clocknet.until(lambda: len(client.got) == 300)
    assert list(server.got.values()) == [[b"%d" % n for n in range(300)]]
    assert client.got == [b"re:%d" % n for n in range(300)]
    assert (client.made, client.lost) == (1, 0)


@pytest_twisted.ensureDeferred
async def test_an_idle_client_pings_once_an_interval(clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "pings", pingInterval=1.0)
    seen: list[float] = []
    original = bound.machine.handleMessage

    def spy(peer: Any, frames: list[bytes], now: float, **options: Any) -> Any:
        if frames[1:2] == [codec.PING]:
            seen.append(now)
        return original(peer, frames, now, **options)

    bound.machine.handleMessage = spy
    clocknet.advance(10)
    assert 9 <= len(seen) <= 10
    assert all(1.0 <= b - a <= 1.3 for a, b in zip(seen, seen[1:]))


@pytest_twisted.ensureDeferred
async def test_a_silent_server_is_left_and_the_session_goes_on(clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "silent", pingInterval=1.0,
                                                      liveness=3)
    first = pipe.inner
    deaf = bound.messageReceived
    bound.messageReceived = lambda peer, frames: None  # it hears nothing, says nothing
    pings = []
    original = pipe.inner.sendMessage
    pipe.inner.sendMessage = lambda frames: (pings.append(frames[1]), original(frames))
    pipe.sendMessage([b"while deaf"])
    clocknet.advance(3.5)
    assert pipe.inner is not first  # after interval x liveness: a new connection
    assert pings.count(codec.PING) <= 3  # never more than liveness unanswered
    bound.messageReceived = deaf
    await clocknet.until(lambda: client.got == [b"re:while deaf"])
    assert client.made == 1


@pytest_twisted.ensureDeferred
async def test_a_session_expires_after_its_client_is_gone(clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "expiry")
    pipe.sendMessage([b"x"])
    await clocknet.until(lambda: server.got)
    peer = list(server.got)[0]
    await clocknet.wait(pipe.close())
    clocknet.advance(29)
    assert server.gone == []
    clocknet.advance(1.5)
    assert server.gone == [peer]


@pytest_twisted.ensureDeferred
async def test_a_restarted_server_gets_a_new_session_and_what_was_not_acknowledged(
        clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "restart")
    await clocknet.wait(bound.close())
    pipe.sendMessage([b"while down"])
    clocknet.advance(2)
    again = Server()
    listening: list[Any] = []
    transport.listen("session+loopback:restart", again, clocknet.reactor).addCallback(
        listening.append)  # at once on loopback, before anything is delivered
    again.bound = listening[0]
    clocknet.addCleanup(again.bound.close)
    await clocknet.until(lambda: client.got == [b"re:while down"])
    assert list(again.got.values()) == [[b"while down"]]


@pytest_twisted.ensureDeferred
async def test_the_queue_while_away_is_bounded(clocknet: Any) -> None:
    from mdp.session.transport import SessionDealer

    client = Client()
    pipe = SessionDealer("session+loopback:nobody-here", client, clocknet.reactor, maxQueued=5)
    clocknet.addCleanup(pipe.close)
    for n in range(8):
        pipe.sendMessage([b"%d" % n])  # the last three are refused, logged, never raised
    assert len(pipe.machine.seq.unacked) == 5


# --- real sockets, a proxy cut and restored ------------------------------------------------


MESSAGES = 10_000
CLIENTS = 3
CUTS = 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("medium", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_ten_thousand_messages_both_ways_across_cuts(medium: str) -> None:
    """Three clients send 10,000 messages in all through a TCP proxy that is
    cut and restored five times; the server answers each.  Every message and
    every answer arrives exactly once, in order, per session."""
    server = Server()
    bind = "session+tcp:host=127.0.0.1:port=0" if medium == "tcp" else \
        "session+zmq:tcp://127.0.0.1:*"
    server.bound = await transport.listen(bind, server, reactor())
    proxy = Proxy()
    proxy.port = int(server.bound.endpoint.rpartition(":")[2].rpartition("=")[2])
    via = (f"session+tcp:host=127.0.0.1:port={proxy.address}" if medium == "tcp"
           else f"session+zmq:tcp://127.0.0.1:{proxy.address}")
    clients = [Client() for _ in range(CLIENTS)]
    pipes = [transport.connect(via, c, reactor(), retryPolicy=lambda attempt: 0.05)
             for c in clients]
    each = MESSAGES // CLIENTS
    try:
        await wait_until(lambda: all(c.made == 1 for c in clients), 10)
        cutAt = {each * (k + 1) // (CUTS + 1) for k in range(CUTS)}
        for n in range(each):
            for pipe in pipes:
                pipe.sendMessage([b"%d" % n])
            if n in cutAt:
                await task.deferLater(reactor(), 0.01)  # some in flight, some delivered
                before = proxy.accepted
                proxy.cut()
                await task.deferLater(reactor(), 0.2)
                proxy.restore()
                await wait_until(lambda before=before: proxy.accepted >= before + CLIENTS, 10)
            elif n % 100 == 0:
                await task.deferLater(reactor(), 0)
        await wait_until(lambda: all(len(c.got) >= each for c in clients), 90)
        expected = [b"%d" % n for n in range(each)]
        assert len(server.got) == CLIENTS  # one session per client, whatever the cuts
        assert proxy.accepted >= CLIENTS * (CUTS + 1)  # every cut made every client reconnect
        if medium == "tcp":
            assert server.bound.attaches >= CLIENTS * (CUTS + 1)
        for got in server.got.values():
            assert got == expected
        for client in clients:
            assert client.got == [b"re:" + e for e in expected]
            assert (client.made, client.lost) == (1, 0)
    finally:
        for pipe in pipes:
            await pipe.close()
        await proxy.close()
        await server.bound.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_mdp_client_and_broker_over_sessions_ride_out_cuts_without_retrying() -> None:
    """An MDP broker and a client over ``session+tcp``, the client through a
    proxy cut and restored three times while requests are in flight: every
    request completes, its handler ran once, and the client never retried
    (one attempt each)."""
    from twisted.internet import defer

    from mdp import Broker, Client, Worker

    calls: dict[bytes, int] = {}

    def handler(frames: list[bytes]) -> list[bytes]:
        calls[frames[0]] = calls.get(frames[0], 0) + 1
        return [b"done " + frames[0]]

    broker = Broker(reactor())
    bound = await broker.listen("session+tcp:host=127.0.0.1:port=0")
    worker = Worker(bound.endpoint, "work", handler, reactor())
    worker.start()
    proxy = Proxy()
    proxy.port = int(bound.endpoint.rpartition("=")[2])
    client = Client(f"session+tcp:host=127.0.0.1:port={proxy.address}", reactor(),
                    timeout=30.0, retries=1)
    try:
        pending = []
        for n in range(300):
            pending.append(client.request("work", b"%d" % n))
            if n % 100 == 50:
                await task.deferLater(reactor(), 0.02)
                proxy.cut()
                await task.deferLater(reactor(), 0.3)
                proxy.restore()
        replies = await defer.gatherResults(pending).addTimeout(60, reactor())
        assert replies == [[b"done %d" % n] for n in range(300)]
        assert calls == {b"%d" % n: 1 for n in range(300)}
        assert proxy.accepted >= 4  # the first connection and one after each cut
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
        await proxy.close()


@pytest_twisted.ensureDeferred
async def test_messages_over_the_limits_are_refused_before_they_enter_a_session(
        clocknet: Any) -> None:
    """A message the far side would refuse would be resent after every
    reconnection: it is refused at once instead, with a typed error."""
    from mdp.errors import ReplyTooLarge, RequestTooLarge
    from mdp.policy import Limits
    from mdp.session import SessionClient, SessionServer

    limits = Limits(maxMessageBytes=1000)
    got: list[list[bytes]] = []
    server = SessionServer(lambda routingId, frames: got.append(frames), clocknet.reactor,
                           limits=limits)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:limits")))
    clocknet.addCleanup(server.close)
    client = SessionClient(endpoint, clocknet.reactor, limits=limits)
    clocknet.addCleanup(client.close)
    await clocknet.wait(client.attached())
    with pytest.raises(RequestTooLarge, match="exceeds the limit of 1000"):
        client.send(b"x" * 1001)
    client.send(b"fits")
    await clocknet.until(lambda: got == [[b"fits"]])
    with pytest.raises(ReplyTooLarge):
        server.reply(1, b"y" * 1001)
    assert client.dealer.machine.seq.sent == 1


@pytest_twisted.ensureDeferred
async def test_a_client_the_full_server_refuses_is_told_and_gets_in_once_there_is_room(
        clocknet: Any) -> None:
    """At maxSessions a HELLO is answered REFUSED: attached() fails with
    SessionRefused, and the client goes on asking; once a session expires it
    gets in."""
    from mdp.errors import ClientClosed
    from mdp.session import SessionClient, SessionRefused, SessionServer

    server = SessionServer(lambda routingId, frames: None, clocknet.reactor, maxSessions=1)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:full")))
    clocknet.addCleanup(server.close)
    first = SessionClient(endpoint, clocknet.reactor)
    await clocknet.wait(first.attached())
    second = SessionClient(endpoint, clocknet.reactor)
    clocknet.addCleanup(second.close)
    with pytest.raises(SessionRefused, match="maxSessions"):
        await clocknet.wait(second.attached())
    await clocknet.wait(first.close())
    with pytest.raises(ClientClosed):  # closed is not attached, though it once was
        await clocknet.wait(first.attached())
    for _ in range(31):  # its session expires (30 s), the second asking meanwhile
        clocknet.advance(1)
    assert server.router.refused >= 10
    later = second.attached()  # the next HELLO gets in
    for _ in range(3):
        clocknet.advance(1)
    await clocknet.wait(later)


@pytest_twisted.ensureDeferred
async def test_closing_a_client_that_waits_to_attach_ends_the_wait(clocknet: Any) -> None:
    """Nobody answers; the client is closed: ``attached()`` fails with
    ClientClosed, before and after the close (it never fired)."""
    from mdp.errors import ClientClosed
    from mdp.session import SessionClient

    client = SessionClient("session+loopback:nobody-here", clocknet.reactor)
    waiting = client.attached()
    clocknet.advance(1)
    assert not waiting.called
    await clocknet.wait(client.close())
    with pytest.raises(ClientClosed):
        await clocknet.wait(waiting)
    with pytest.raises(ClientClosed):
        await clocknet.wait(client.attached())
    assert not clocknet.reactor.getDelayedCalls()


async def small_client(net: Any, name: str, *replies: bytes) -> tuple[Any, Any, list]:
    """A server answering each message with *replies*, and a client with
    limits of 1,000 bytes that keeps what it receives."""
    from mdp.policy import Limits
    from mdp.session import SessionClient, SessionServer

    def handler(routingId: int, frames: list[bytes]) -> None:
        for reply in replies:
            server.reply(routingId, reply)

    server = SessionServer(handler, net.reactor)
    endpoint = await net.wait(defer.ensureDeferred(server.listen(f"loopback:{name}")))
    net.addCleanup(server.close)
    client = SessionClient(endpoint, net.reactor, limits=Limits(maxMessageBytes=1000))
    net.addCleanup(client.close)
    got: list[list[bytes]] = []
    client.subscribe(got.append)
    return server, client, got


def saying_no_limits(monkeypatch: Any) -> None:
    """Session ends made from now on say no limits in their HELLO or
    WELCOME (as a peer of another make may not)."""
    import mdp.session.transport

    monkeypatch.setattr(mdp.session.transport, "payload_limits", lambda limits: (0, 0))


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("size", [1020, 5000])
async def test_a_reply_over_the_limits_the_client_said_is_refused_at_once(
        clocknet: Any, size: int) -> None:
    """The client's HELLO says the payload it takes: a reply over it, a few
    bytes (within the room the inner transport leaves for the session's own
    frames) or far (which would close the inner connection), is refused by
    ``reply`` with ReplyTooLarge, as one over the server's own limits is;
    it never enters the session, and what follows comes through."""
    from mdp.errors import ReplyTooLarge

    refused: list[str] = []

    def handler(routingId: int, frames: list[bytes]) -> None:
        try:
            server.reply(routingId, b"x" * size)
        except ReplyTooLarge as e:
            refused.append(str(e))
        server.reply(routingId, b"after")

    server, client, got = await small_client(clocknet, f"refused-{size}")
    server.handler = handler
    client.send(b"hi")
    clocknet.advance(10)
    assert got == [[b"after"]]
    assert refused == [f"not sent to session 1: the session's client takes no message of "
                       f"{size} bytes, and it takes at most 1000"]
    (session,) = server.router.machine.sessions.values()
    assert session.seq.sent == 1 and not session.seq.unacked


@pytest_twisted.ensureDeferred
async def test_a_message_far_over_the_limits_of_a_client_that_said_none_stalls_without_a_spin(
        clocknet: Any, monkeypatch: Any) -> None:
    """A client that says no limits (another make): the server's reply is
    over them by more than the room its inner pipe leaves, which closes on
    it; the session never sees which message it was, and the server resends
    it at each attach. The client says why and attaches again only after
    its backoff (it did so at once, in a loop as fast as both could go: a
    Clock never got past it), which stops short of the server's expiry: the
    session and what it holds outlive the stall."""
    from tests.conftest import warnings_logged

    saying_no_limits(monkeypatch)
    server, client, got = await small_client(clocknet, "over-limits", b"x" * 5000, b"small")
    with warnings_logged() as warnings:
        client.send(b"hi")
        clocknet.advance(0.5)
        (session,) = server.router.machine.sessions.values()
        clocknet.advance(120)  # four times the server's expiry (30 s)
    assert got == []
    assert list(server.router.machine.sessions.values()) == [session]  # not expired
    assert len(session.seq.unacked) == 2  # and it still holds both replies
    # the backoff: 1 s, 2 s, then every pingInterval * liveness (3 s)
    assert 20 <= server.router.attaches <= 60
    assert any("over this side's limits" in str(e.get("log_format")) for e in warnings)


@pytest_twisted.ensureDeferred
async def test_a_reply_just_over_the_limits_of_a_client_that_said_none_is_dropped_there(
        clocknet: Any, monkeypatch: Any) -> None:
    """A payload a few bytes over the limits of a client that said none gets
    through the inner transport (whose limits leave room for the session's
    own frames): the client's session drops it, logged, and acknowledges
    it, so what follows comes through (it was left unacknowledged, and held
    back all after it for good)."""
    saying_no_limits(monkeypatch)
    server, client, got = await small_client(clocknet, "band", b"x" * 1020, b"after")
    client.send(b"hi")
    clocknet.advance(10)
    assert got == [[b"after"]]
    assert client.dealer.dropped == 1
    (session,) = server.router.machine.sessions.values()
    assert not session.seq.unacked and server.router.skipped == 0


@pytest_twisted.ensureDeferred
async def test_a_request_over_the_servers_limits_is_refused_or_skipped() -> None:
    """The same towards the server, over TCP. Once attached, the client knows
    the server's limits: ``send`` refuses a request over them at once, with
    RequestTooLarge. One sent before (while attaching), far over them, is
    skipped when it goes: what follows is delivered, and the client holds
    nothing."""
    from mdp.errors import RequestTooLarge
    from mdp.policy import Limits
    from mdp.session import SessionClient, SessionServer

    received: list[list[bytes]] = []
    server = SessionServer(lambda routingId, frames: received.append(frames), reactor(),
                           limits=Limits(maxMessageBytes=1000))
    endpoint = await defer.ensureDeferred(server.listen("session+tcp:host=127.0.0.1:port=0"))
    client = SessionClient(endpoint, reactor())
    try:
        client.send(b"x" * 50_000)  # before the WELCOME: the limits are not known yet
        client.send(b"first")
        await client.attached().addTimeout(10, reactor())
        with pytest.raises(RequestTooLarge, match="the server takes no message of 1020 bytes"):
            client.send(b"x" * 1020)
        client.send(b"after")
        await wait_until(lambda: received == [[b"first"], [b"after"]], 10)
        assert server.router.dropped == 1 and client.dealer.skipped == 1
        await wait_until(lambda: not client.dealer.machine.seq.unacked, 10)
    finally:
        await client.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_a_full_session_says_so_and_drained_fires_once_acknowledged(clocknet: Any) -> None:
    """Backpressure for streaming senders: not writable at half the bound,
    drained() once the server has acknowledged enough."""
    server, bound, client, pipe = await loopback_pair(clocknet, "backpressure", maxQueued=10)
    deaf = bound.messageReceived
    bound.messageReceived = lambda peer, frames: None
    for n in range(5):
        pipe.sendMessage([b"%d" % n])
    assert pipe.writable is False
    waiting = pipe.drained()
    assert not waiting.called
    bound.messageReceived = deaf
    await clocknet.wait(waiting, timeout=10)
    assert pipe.writable is True


@pytest_twisted.ensureDeferred
async def test_a_raising_application_does_not_stop_the_session(clocknet: Any) -> None:
    from mdp.session.transport import SessionDealer

    @implementer(IRouterReceiver)
    class Broken(Server):
        def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
            super().messageReceived(peer, frames)
            raise RuntimeError("application bug")

        def peerDisconnected(self, peer: bytes) -> None:
            super().peerDisconnected(peer)
            raise RuntimeError("application bug")

    server = Broken()
    server.bound = await clocknet.wait(transport.listen("session+loopback:broken", server,
                                                        clocknet.reactor))
    clocknet.addCleanup(server.bound.close)
    client = Client()
    pipe = SessionDealer(server.bound.endpoint, client, clocknet.reactor)
    await clocknet.until(lambda: client.made == 1)
    for n in range(3):
        pipe.sendMessage([b"%d" % n])
    await clocknet.until(lambda: len(client.got) == 3)
    await clocknet.wait(pipe.close())
    clocknet.advance(31)
    assert len(server.gone) == 1 and server.bound.tick.running  # the tick survived


@pytest_twisted.ensureDeferred
async def test_a_session_that_cannot_take_more_ends_rather_than_lose_one(clocknet: Any) -> None:
    server, bound, client, pipe = await loopback_pair(clocknet, "overflow")
    pipe.sendMessage([b"x"])
    await clocknet.until(lambda: server.got)
    peer = list(server.got)[0]
    bound.machine.byRouting[1].seq.maxQueued = 2
    bound.inner.disconnectPeer(list(bound.machine.byPeer)[0])  # the client is away
    clocknet.reactor.advance(0)
    for n in range(5):
        bound.sendMessage(peer, [b"%d" % n])
    clocknet.reactor.advance(0)
    # ended, and its connection closed (a client that comes back opens another)
    assert server.gone == [peer] and 1 not in bound.machine.byRouting


@pytest_twisted.ensureDeferred
async def test_a_connection_sending_what_is_no_session_message_is_closed() -> None:
    """Over real TCP: a well-framed record that is not a session message
    closes its connection, so garbage holds no ``maxConnections`` slot."""
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
    from twisted.internet.protocol import Protocol

    from mdp.policy import Limits
    from mdp.transport.framing import encode_record

    @implementer(IRouterReceiver)
    class Quiet:
        def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
            pass

        def peerDisconnected(self, peer: bytes) -> None:
            pass

    class Raw(Protocol):
        def __init__(self) -> None:
            self.lost: defer.Deferred[None] = defer.Deferred()

        def connectionLost(self, reason: Any = None) -> None:
            self.lost.callback(None)

    bound = await transport.listen("session+tcp:host=127.0.0.1:port=0", Quiet(), reactor(),
                                   limits=Limits(maxConnections=2))
    try:
        port = int(bound.endpoint.rsplit("=", 1)[1])
        for _ in range(3):  # more than the slots: each is closed in turn
            raw = await connectProtocol(TCP4ClientEndpoint(reactor(), "127.0.0.1", port), Raw())
            raw.transport.write(encode_record([b"not a session message"]))
            await raw.lost.addTimeout(10, reactor())
    finally:
        await bound.close()


@pytest_twisted.ensureDeferred
async def test_a_close_right_after_a_send_waits_for_its_acknowledgement(
        clocknet: Any) -> None:
    """A worker's last DISCONNECT: the server has it, and acknowledges it
    within half a second; the close waits that long (at most CLOSE_GRACE)
    rather than warn of a loss there was not, and takes nothing more."""
    from twisted.logger import formatEvent, globalLogPublisher

    from mdp.errors import TransportError

    server, bound, client, pipe = await loopback_pair(clocknet, "bye")
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        pipe.sendMessage([b"bye"])
        closing = pipe.close()
        with pytest.raises(TransportError):
            pipe.send([b"more"])
        await clocknet.wait(closing)
        assert list(server.got.values()) == [[b"bye"]]
        assert not pipe.machine.seq.unacked
        assert not [line for line in lines if "not acknowledged" in line]
    finally:
        globalLogPublisher.removeObserver(observer)


def test_a_refused_connection_is_tried_again_within_the_dead_server_time() -> None:
    """Over ``session+tcp``, while the server's port refuses connections, the
    inner connection is tried again at least every ``pingInterval *
    liveness`` (3 s), not on a backoff doubling up to 32 s: a cut of 20 s
    was found again only after 31.5 s, past the server's 30 s expiry, and
    the session was lost though the cut was shorter."""
    from twisted.internet.error import ConnectionRefusedError
    from twisted.internet.testing import MemoryReactorClock
    from twisted.python.failure import Failure

    from mdp.session.transport import SessionDealer

    memory = MemoryReactorClock()
    pipe = SessionDealer("session+tcp:host=127.0.0.1:port=5555", Client(), memory,
                         pingInterval=1.0, liveness=3)
    attempts: list[float] = []
    try:
        while memory.seconds() < 40:
            for attempt in range(len(attempts), len(memory.tcpClients)):
                attempts.append(memory.seconds())
                if memory.seconds() < 20:  # the cut: refused
                    factory = memory.tcpClients[attempt][2]
                    factory.clientConnectionFailed(memory.connectors[attempt],
                                                   Failure(ConnectionRefusedError()))
            memory.advance(0.1)
    finally:
        pipe.close()
    assert len(attempts) >= 7
    assert max(b - a for a, b in zip(attempts, attempts[1:])) <= 3.0 + 0.1
    assert 20 <= attempts[-1] <= 23.1  # the first one after the cut, and it held


@pytest_twisted.ensureDeferred
async def test_a_client_whose_server_does_not_answer_tries_again_within_twice_the_dead_server_time(
        clocknet: Any) -> None:
    """A server that takes connections but says nothing (a proxy whose
    server is cut off): the client makes a new connection at least every
    ``2 * pingInterval * liveness`` (silent for that long, then the
    backoff, held to the same bound), so it attaches again within that of
    the end of the cut, not up to 32 s later."""
    server, bound, client, pipe = await loopback_pair(clocknet, "deaf-long", pingInterval=1.0,
                                                      liveness=3)
    made: list[float] = []
    connected = pipe.machine.handleConnected

    def spy(now: float) -> Any:
        made.append(now)
        return connected(now)

    pipe.machine.handleConnected = spy  # type: ignore[method-assign]
    deaf = bound.messageReceived
    bound.messageReceived = lambda peer, frames: None
    start = clocknet.reactor.seconds()
    clocknet.advance(60)
    gaps = [b - a for a, b in zip([start, *made], made)]
    assert len(made) >= 9 and max(gaps) <= 6.0 + 0.5
    bound.messageReceived = deaf
    pipe.sendMessage([b"after"])
    clocknet.advance(6.5)
    assert client.got == [b"re:after"] and client.made == 1


@pytest_twisted.ensureDeferred
async def test_a_session_that_cannot_take_a_message_takes_none_after_it(clocknet: Any) -> None:
    """The router refuses a reply its session has no room for (here its
    bytes bound) and the session ends: a smaller reply sent right after, in
    the same turn, is not numbered in the refused one's place (the client
    got the first and third replies and never knew of the second).  The
    client attaches to a new session, and its requests are answered there,
    in order."""
    from mdp.policy import Limits
    from mdp.session.transport import SessionDealer

    server = Server()
    server.bound = await clocknet.wait(transport.listen(
        "session+loopback:no-hole", server, clocknet.reactor, limits=Limits(maxOutputBytes=1000)))
    clocknet.addCleanup(server.bound.close)
    client = Client()
    pipe = SessionDealer(server.bound.endpoint, client, clocknet.reactor)
    clocknet.addCleanup(pipe.close)
    await clocknet.until(lambda: client.made == 1)
    for n, size in ((1, 900), (2, 200), (3, 50)):  # answered with 903, 203 and 53 bytes
        pipe.sendMessage([b"%d" % n * size])
    clocknet.advance(5)
    assert [(got[3:4], len(got)) for got in client.got] == [(b"1", 903), (b"2", 203), (b"3", 53)]
    assert server.gone == [(1).to_bytes(4, "big")] and len(server.got) == 2
    assert client.made == 1


@pytest_twisted.ensureDeferred
async def test_a_session_bound_to_one_message_drains(clocknet: Any) -> None:
    """``maxQueued=1``: writable while the session holds nothing, not while
    it holds its one message, and drained() fires once that is
    acknowledged (it never did: half of 1 was taken as 0)."""
    server, bound, client, pipe = await loopback_pair(clocknet, "one", maxQueued=1)
    assert pipe.writable is True
    assert pipe.drained().called
    deaf = bound.messageReceived
    bound.messageReceived = lambda peer, frames: None
    pipe.sendMessage([b"only"])
    assert pipe.writable is False
    waiting = pipe.drained()
    assert not waiting.called
    bound.messageReceived = deaf
    await clocknet.wait(waiting, timeout=10)
    assert pipe.writable is True and client.got == [b"re:only"]


def test_a_session_bound_below_one_message_is_refused_at_once() -> None:
    """A ``maxQueued`` below 1 is a ValueError when the client or server is
    made, not a session that can never send."""
    from mdp.session import SessionClient, SessionServer

    for maxQueued in (0, -5):
        with pytest.raises(ValueError, match="maxQueued must be at least 1"):
            SessionClient("loopback:nobody-here", task.Clock(), maxQueued=maxQueued)
        with pytest.raises(ValueError, match="maxQueued must be at least 1"):
            SessionServer(lambda routingId, frames: None, task.Clock(), maxQueued=maxQueued)


def test_each_connection_attempt_gives_up_within_the_dead_server_time() -> None:
    """A connection attempt made while a cut drops packets would run on
    for Twisted's 30 s, past the session expiry: over tcp each gives up
    after ``pingInterval * liveness`` (whole seconds, at least 1), unless
    the endpoint names its own timeout."""
    from mdp.session.transport import bounded_attempts

    assert bounded_attempts("tcp:host=h:port=1", 3.0) == "tcp:host=h:port=1:timeout=3"
    assert bounded_attempts("tcp:host=h:port=1", 0.4) == "tcp:host=h:port=1:timeout=1"
    assert bounded_attempts("tcp:host=h:port=1:timeout=9", 3.0) == "tcp:host=h:port=1:timeout=9"
    assert bounded_attempts("loopback:x", 3.0) == "loopback:x"
    assert bounded_attempts("zmq:tcp://h:1", 3.0) == "zmq:tcp://h:1"
    from twisted.internet.testing import MemoryReactorClock

    from mdp.session.transport import SessionDealer

    memory = MemoryReactorClock()
    pipe = SessionDealer("session+tcp:host=127.0.0.1:port=5555", Client(), memory,
                         pingInterval=1.0, liveness=3)
    try:
        memory.advance(0)
        (_, _, _, timeout, _), = memory.tcpClients
        assert timeout == 3
    finally:
        pipe.close()


def unreachable(router: Any) -> Any:
    """Make the loopback server behind *router* unreachable (its process
    alive: connections cut, new ones wait); returns what makes it reachable
    again."""
    from mdp.transport import loopback

    inner = router.inner
    loopback.network.unbind(inner.name, inner)
    for peer in list(inner.peers):
        inner.disconnectPeer(peer)
    return lambda: loopback.network.bind(inner.name, inner)


@pytest_twisted.ensureDeferred
async def test_a_client_whose_server_session_ended_is_told_and_its_message_goes_again(
        clocknet: Any) -> None:
    """The server is out of reach past its expiry: the session ends there,
    with a reply it held for the client. When the client is back it attaches
    to a new session and hears so (a warning, and ``onRenewed``): that reply
    is lost (it was told only in an info line). Its own message the server
    had not acknowledged yet goes again to the new session, which gets it a
    second time: at least once across a session's end."""
    from twisted.logger import formatEvent

    from mdp.session import SessionClient, SessionServer
    from tests.conftest import warnings_logged

    atServer: list[tuple[int, list[bytes]]] = []
    expired: list[int] = []
    server = SessionServer(lambda routingId, frames: atServer.append((routingId, frames)),
                           clocknet.reactor, onExpired=expired.append)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:renewed")))
    clocknet.addCleanup(server.close)
    renewed: list[float] = []
    client = SessionClient(endpoint, clocknet.reactor,
                           onRenewed=lambda: renewed.append(clocknet.reactor.seconds()))
    clocknet.addCleanup(client.close)
    got: list[list[bytes]] = []
    client.subscribe(got.append)
    await clocknet.wait(client.attached())
    client.send(b"c0")
    await clocknet.until(lambda: atServer)  # delivered; its ACK waits for the server's tick
    back = unreachable(server.router)
    server.reply(1, b"held")
    with warnings_logged() as warnings:
        clocknet.advance(40)
        assert expired == [1] and not renewed
        back()
        await clocknet.until(lambda: renewed)
        clocknet.advance(5)
    lines = [formatEvent(e) for e in warnings if "session for this client ended" in formatEvent(e)]
    assert len(lines) == 1 and "held for this client and had not delivered are lost" in lines[0]
    assert "may get one twice" in lines[0]
    assert len(renewed) == 1 and got == []
    assert atServer == [(1, [b"c0"]), (2, [b"c0"])]
    assert not client.dealer.machine.seq.unacked


@pytest_twisted.ensureDeferred
async def test_closing_a_server_that_holds_unacknowledged_replies_warns(clocknet: Any) -> None:
    """Closing a server ends its sessions and what their clients have not
    acknowledged: it says how many messages to how many sessions (it did
    so silently, while a dealer's close warned); a server holding nothing
    closes quietly, and a second close says nothing more."""
    from twisted.logger import formatEvent

    from mdp.session import SessionClient, SessionServer
    from tests.conftest import warnings_logged

    server = SessionServer(lambda routingId, frames: None, clocknet.reactor)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:close-held")))
    clients = [SessionClient(endpoint, clocknet.reactor) for _ in range(3)]
    for client in clients:
        clocknet.addCleanup(client.close)
        await clocknet.wait(client.attached())
    router = server.router
    unreachable(router)
    server.reply(1, b"a")
    server.reply(1, b"b")
    server.reply(2, b"c")
    with warnings_logged() as warnings:
        await clocknet.wait(server.close())
        await clocknet.wait(router.close())
    assert [formatEvent(e) for e in warnings] == [
        "session router at session+loopback:close-held closed with 3 message(s) to 2 "
        "session(s) not acknowledged by their clients: they are lost"]
    quiet = SessionServer(lambda routingId, frames: None, clocknet.reactor)
    await clocknet.wait(defer.ensureDeferred(quiet.listen("loopback:close-quiet")))
    with warnings_logged() as warnings:
        await clocknet.wait(quiet.close())
    assert warnings == []


@pytest_twisted.ensureDeferred
async def test_a_raising_subscriber_does_not_keep_the_message_from_the_others(
        clocknet: Any) -> None:
    """Each ``subscribe`` callback is called on its own: one that raises is
    logged, and those after it still get every message, once, in order."""
    from mdp.session import SessionClient, SessionServer
    from tests.conftest import failures_logged

    server = SessionServer(lambda routingId, frames: None, clocknet.reactor)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:subscribers")))
    clocknet.addCleanup(server.close)
    client = SessionClient(endpoint, clocknet.reactor)
    clocknet.addCleanup(client.close)
    first: list[list[bytes]] = []
    after: list[list[bytes]] = []

    def broken(frames: list[bytes]) -> None:
        first.append(frames)
        raise RuntimeError("subscriber bug")

    client.subscribe(broken)
    client.subscribe(after.append)
    await clocknet.wait(client.attached())
    with failures_logged() as failures:
        server.reply(1, b"x")
        server.reply(1, b"y")
        clocknet.advance(2)
    assert first == after == [[b"x"], [b"y"]]
    assert len(failures) == 2
    assert all("subscriber" in e["log_format"] for e in failures)
    assert not server.router.machine.byRouting[1].seq.unacked


@pytest_twisted.ensureDeferred
async def test_a_lost_welcome_delays_the_replies_after_it_and_repeats_none(
        clocknet: Any, monkeypatch: Any) -> None:
    """The first WELCOME is lost on its way, the replies after it are not
    (as ZeroMQ may lose one message): the client does not take them before
    it knows the server's epoch, says HELLO again a ping interval later, and
    gets each once (the first came twice)."""
    from mdp.transport import loopback

    deliver = loopback.LoopbackDealer._deliver
    lost: list[list[bytes]] = []

    def losing(self: Any, peer: bytes, frames: list[bytes]) -> None:
        if frames[1:2] == [codec.WELCOME] and not lost:
            lost.append(frames)
            self.inbound -= 1
            return
        deliver(self, peer, frames)

    monkeypatch.setattr(loopback.LoopbackDealer, "_deliver", losing)
    server = Server()
    server.bound = await clocknet.wait(transport.listen("session+loopback:lost-welcome", server,
                                                        clocknet.reactor))
    clocknet.addCleanup(server.bound.close)
    client = Client()
    from mdp.session.transport import SessionDealer

    pipe = SessionDealer(server.bound.endpoint, client, clocknet.reactor, pingInterval=1.0)
    clocknet.addCleanup(pipe.close)
    clocknet.advance(0.1)
    assert lost and pipe.machine.state == "attaching"
    for n in range(40):  # more than ACK_EVERY
        server.bound.sendMessage((1).to_bytes(4, "big"), [b"s%d" % n])
    clocknet.advance(0.5)
    assert client.got == [] and client.made == 0
    await clocknet.until(lambda: client.made == 1)
    clocknet.advance(5)
    assert client.got == [b"s%d" % n for n in range(40)]
    assert not server.bound.machine.byRouting[1].seq.unacked


@pytest_twisted.ensureDeferred
async def test_a_message_sent_from_on_renewed_goes_after_the_resends(clocknet: Any) -> None:
    """The application told of a new session sends at once (who it is):
    that message goes after what the client sends again, not ahead of it
    (the server would see a gap, and the client attach again later)."""
    from twisted.logger import formatEvent

    from mdp.session import SessionClient, SessionServer
    from tests.conftest import logged_at

    atServer: list[tuple[float, int, list[bytes]]] = []
    server = SessionServer(lambda rid, frames: atServer.append(
        (clocknet.reactor.seconds(), rid, frames)), clocknet.reactor)
    endpoint = await clocknet.wait(defer.ensureDeferred(server.listen("loopback:renew-then-send")))
    clocknet.addCleanup(server.close)
    renewed: list[float] = []

    def onRenewed() -> None:
        renewed.append(clocknet.reactor.seconds())
        client.send(b"hello-again")      # tell the new session who we are

    client = SessionClient(endpoint, clocknet.reactor, onRenewed=onRenewed)
    clocknet.addCleanup(client.close)
    await clocknet.wait(client.attached())
    client.send(b"c0")
    await clocknet.until(lambda: atServer)
    back = unreachable(server.router)
    with logged_at(("info", "warn")) as logs:
        clocknet.advance(40)              # the server's session expires
        back()
        await clocknet.until(lambda: renewed)
        t = renewed[0]
        clocknet.advance(5)
    after = [(round(s - t, 2), f) for s, rid, f in atServer if rid == 2]
    assert not [e for e in logs if "attaching again" in formatEvent(e)]
    # the application sent hello-again after c0 (c0 unacknowledged, resent on attach)
    assert [f for _, f in after] == [[b"c0"], [b"hello-again"]]
    assert all(dt < 0.1 for dt, _ in after), f"delayed: {after}"
