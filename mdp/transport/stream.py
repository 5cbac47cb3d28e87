"""Multi-frame messages over any Twisted stream endpoint (tcp, tls, unix).

Each message is one length-prefixed record (:mod:`mdp.transport.framing`,
documented in ``docs/transports.md``).  A record over the message limits, or a
payload whose frame lengths do not add up, ends the connection, logged with
the peer.

The bound side (:class:`StreamRouter`) gives each accepted connection an
opaque peer id and reports its loss at once.  It defends itself
(:class:`~mdp.policy.Limits`): a connection must send its first message within
``handshakeTimeout`` and complete every record it starts within
``recordTimeout``; at most ``maxConnections`` are open (at the cap, the oldest
connection that has not yet sent a message makes room, or the newcomer is
refused); and what a peer does not read is kept, beyond Twisted's own write
buffer, only up to ``maxOutputBytes``, after which that peer alone is
disconnected.

The connecting side uses :class:`ClientService`, so it reconnects with
exponential backoff by itself.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Any, Callable, Optional

from twisted.application.internet import ClientService
from twisted.internet import defer
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.interfaces import IListeningPort, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import ProtocolError
from mdp.interfaces import (
    IDealerReceiver,
    IDealerTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.policy import Limits, LogThrottle, held_bytes
from mdp.transport.flow import DrainWaiters
from mdp.transport.framing import RecordDecoder, encode_record

log = Logger()

_ids = itertools.count(1)


class FramedProtocol(Protocol):
    """One stream connection carrying framed multi-frame messages."""

    limits: Limits = Limits()
    onMessage: Callable[[list[bytes]], None]
    throttle: Optional[LogThrottle] = None
    dropped = False  # drop() was called: deliver nothing more
    #: why the stream was refused (reported with connectionLost), if it was
    refusal: Optional[ProtocolError] = None

    def connectionMade(self) -> None:
        self.decoder = RecordDecoder(self.limits)

    def sendFrames(self, frames: list[bytes]) -> None:
        self.transport.write(encode_record(frames))

    def dataReceived(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as e:
            self.refusal = e
            self.drop("{reason}", reason=e)
            return
        for frames in messages:
            self.onMessage(frames)
            if self.closing:
                return

    @property
    def closing(self) -> bool:
        return self.dropped or self.transport.disconnecting

    def drop(self, why: str, **fields: Any) -> None:
        """End the connection at once, logging *why* with the peer."""
        if self.dropped:
            return
        self.dropped = True
        fields["peer"] = self.peerName()
        if self.throttle is not None:
            self.throttle.warn(log, "drop", "dropping stream peer {peer}: " + why, **fields)
        else:
            log.warn("dropping stream peer {peer}: " + why, **fields)
        self.transport.abortConnection()

    def closeGracefully(self) -> None:
        """Close once what is written is sent.  A registered producer is
        unregistered first: Twisted keeps a connection whose paused producer
        is still registered open for good, waiting for more."""
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    def peerName(self) -> str:
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"


def server_description(endpoint: str) -> str:
    """Accept the client form ``tcp:host=H:port=P`` for listening too."""
    kind, _, rest = endpoint.partition(":")
    if kind in ("tcp", "tcp6", "ssl") and "host=" in rest:
        rest = ":".join(
            "interface=" + p[len("host="):] if p.startswith("host=") else p
            for p in rest.split(":")
        )
        return f"{kind}:{rest}"
    return endpoint


def connect_description(kind: str, port: IListeningPort) -> str:
    """The client endpoint string that reaches *port*."""
    address = port.getHost()
    if kind == "unix":
        return f"unix:path={address.name.decode() if isinstance(address.name, bytes) else address.name}"
    host = address.host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = host.replace(":", r"\:")
        kind = "tcp6" if kind == "tcp" else kind
    return f"{kind}:host={host}:port={address.port}"


@implementer(IPushProducer)
class _RouterConnection(FramedProtocol):
    """An accepted connection.  It is the push producer of its transport:
    while Twisted's write buffer is full it keeps what is sent in a backlog of
    its own, counted in bytes."""

    router: StreamRouter
    peer: bytes
    greeted = False  # a first complete message arrived
    paused = False

    def connectionMade(self) -> None:
        router = self.router
        self.limits = router.limits
        self.throttle = router.throttle
        super().connectionMade()
        self.peer = b"\x00" + next(_ids).to_bytes(4, "big")
        self.onMessage = self._deliver
        self.backlog: deque[bytes] = deque()
        self.backlogBytes = 0
        self._recordsAtArm = -1
        router.connections[self.peer] = self
        router.ungreeted[self.peer] = self
        self.transport.registerProducer(self, True)
        self._timer: Any = router.reactor.callLater(
            self.limits.handshakeTimeout, self._timedOut,
            "sent no message within {seconds:g}s of connecting", self.limits.handshakeTimeout)

    def _deliver(self, frames: list[bytes]) -> None:
        if not self.greeted:
            self.greeted = True
            self.router.ungreeted.pop(self.peer, None)
            self._cancelTimer()
        self.router.receiver.messageReceived(self.peer, frames)

    def dataReceived(self, data: bytes) -> None:
        super().dataReceived(data)
        if not self.greeted or self.closing:
            return  # the handshake deadline covers a first record
        decoder = self.decoder
        if decoder.inRecord:
            if self._timer is None or self._recordsAtArm != decoder.records:
                # a record has begun since the timer was armed (or none is armed)
                self._cancelTimer()
                self._recordsAtArm = decoder.records
                self._timer = self.router.reactor.callLater(
                    self.limits.recordTimeout, self._timedOut,
                    "a record of theirs stayed incomplete for {seconds:g}s ({held} bytes held)",
                    self.limits.recordTimeout)
        elif self._timer is not None:
            self._cancelTimer()

    def _timedOut(self, why: str, seconds: float) -> None:
        self._timer = None
        self.drop(why, seconds=seconds, held=self.decoder.buffered)

    def _cancelTimer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def send(self, frames: list[bytes]) -> None:
        if self.closing:
            return
        record = encode_record(frames)
        if not self.paused and not self.backlog:
            self.transport.write(record)
            return
        self.backlog.append(record)
        self.backlogBytes += len(record)
        if self.backlogBytes > self.limits.maxOutputBytes:
            self.router.overflows += 1
            self.drop("it reads slower than it is sent to ({held} bytes unsent, over the limit "
                      "of {limit})", held=self.backlogBytes, limit=self.limits.maxOutputBytes)
            self.backlog.clear()
            self.backlogBytes = 0

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        backlog = self.backlog
        while backlog and not self.paused:
            record = backlog.popleft()
            self.backlogBytes -= len(record)
            self.transport.write(record)

    def stopProducing(self) -> None:
        self.backlog.clear()
        self.backlogBytes = 0

    def closeGracefully(self) -> None:
        self.transport.writeSequence(list(self.backlog))
        self.stopProducing()
        super().closeGracefully()

    def connectionLost(self, reason: object = None) -> None:
        self._cancelTimer()
        self.backlog.clear()
        self.router.ungreeted.pop(self.peer, None)
        if self.router.connections.pop(self.peer, None) is not None:
            self.router.receiver.peerDisconnected(self.peer)


@implementer(IRouterTransport)
class StreamRouter:
    """The bound side over a Twisted server endpoint."""

    reportsDisconnects = True

    def __init__(self, receiver: IRouterReceiver, reactor: Any, limits: Limits = Limits()) -> None:
        self.receiver = receiver
        self.reactor = reactor
        self.limits = limits
        self.throttle = LogThrottle(reactor)
        self.connections: dict[bytes, _RouterConnection] = {}
        #: connections that have not yet sent a message, oldest first
        self.ungreeted: OrderedDict[bytes, _RouterConnection] = OrderedDict()
        self.port: Optional[IListeningPort] = None
        self.endpoint = ""
        #: peers disconnected for not reading their messages
        self.overflows = 0
        #: connections refused at maxConnections
        self.refused = 0

    def buildProtocol(self, addr: object) -> Optional[_RouterConnection]:
        if len(self.connections) >= self.limits.maxConnections:
            if self.ungreeted:  # make room: the oldest one that has said nothing
                _, idle = self.ungreeted.popitem(last=False)
                idle.drop("making room for a new connection ({limit} open) before it sent a message",
                          limit=self.limits.maxConnections)
                self._forget(idle)
            else:
                self.refused += 1
                self.throttle.warn(log, "refused", "stream listener {endpoint} refused a connection "
                                   "from {address}: {limit} connections open",
                                   endpoint=self.endpoint, address=str(addr),
                                   limit=self.limits.maxConnections)
                return None
        proto = _RouterConnection()
        proto.router = self
        return proto

    def _forget(self, connection: _RouterConnection) -> None:
        """Stop counting an aborted connection at once (its connectionLost
        comes a reactor turn later)."""
        if self.connections.pop(connection.peer, None) is not None:
            self.receiver.peerDisconnected(connection.peer)

    @classmethod
    def listen(
        cls, reactor: Any, endpoint: str, receiver: IRouterReceiver, limits: Limits = Limits(),
    ) -> defer.Deferred[StreamRouter]:
        router = cls(receiver, reactor, limits)
        description = server_description(endpoint)
        server = serverFromString(reactor, description)
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = router.buildProtocol  # type: ignore[method-assign]
        factory.noisy = False

        def listening(port: IListeningPort) -> StreamRouter:
            router.port = port
            router.endpoint = connect_description(description.partition(":")[0], port)
            return router

        return server.listen(factory).addCallback(listening)

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.send(frames)

    def disconnectPeer(self, peer: bytes) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.closeGracefully()

    def close(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        for connection in list(self.connections.values()):
            connection.transport.abortConnection()
        self.connections.clear()
        self.ungreeted.clear()
        if port is None:
            return defer.succeed(None)
        return defer.maybeDeferred(port.stopListening)


@implementer(IPushProducer)
class _DealerConnection(FramedProtocol):
    """The connecting side's protocol; it registers itself as the producer of
    its transport, which pauses it while its write buffer is full."""

    dealer: StreamDealer
    paused = False

    def connectionMade(self) -> None:
        self.limits = self.dealer.limits
        super().connectionMade()
        self.onMessage = self.dealer.receiver.messageReceived
        self.transport.registerProducer(self, True)
        self.dealer._made(self)

    def connectionLost(self, reason: object = None) -> None:
        self.paused = False
        self.dealer._lost(self, Failure(self.refusal) if self.refusal is not None else reason)

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self.dealer._resumed(self)

    def stopProducing(self) -> None:
        self.paused = False


def default_retry_policy(initial: float = 0.5, maximum: float = 32.0) -> Callable[[int], float]:
    """Exponential backoff doubling from *initial*, capped at *maximum*, no jitter."""

    def policy(attempt: int) -> float:
        return min(initial * (2.0 ** min(attempt - 1, 64)), maximum)

    return policy


@implementer(IDealerTransport)
class StreamDealer:
    """The connecting side: one :class:`ClientService`-managed connection.

    Messages sent while no connection is up wait (at most ``maxQueued`` of
    them and ``limits.maxOutputBytes`` in all; beyond, they are refused with a
    warning) and go out after the next ``connectionMade``."""

    maxQueued = 1000

    def __init__(
        self,
        reactor: Any,
        endpoint: str,
        receiver: IDealerReceiver,
        retryPolicy: Optional[Callable[[int], float]] = None,
        limits: Limits = Limits(),
    ) -> None:
        self.endpoint = endpoint
        self.receiver = receiver
        self.limits = limits
        self.protocol: Optional[_DealerConnection] = None
        self.queue: deque[list[bytes]] = deque()
        self.queuedBytes = 0
        self._throttle = LogThrottle(reactor)
        self._dropping: Optional[_DealerConnection] = None
        self._waiters = DrainWaiters()
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = self._buildProtocol  # type: ignore[method-assign]
        factory.noisy = False
        self.service = ClientService(
            clientFromString(reactor, endpoint),
            factory,
            retryPolicy=retryPolicy or default_retry_policy(),
            clock=reactor,
        )
        self.service.startService()

    def _buildProtocol(self, addr: object) -> _DealerConnection:
        proto = _DealerConnection()
        proto.dealer = self
        return proto

    @property
    def connected(self) -> bool:
        return self.protocol is not None

    @property
    def writable(self) -> bool:
        return self.protocol is None or not self.protocol.paused

    def drained(self) -> defer.Deferred[None]:
        if self.writable:
            return defer.succeed(None)
        return self._waiters.wait()

    def _resumed(self, proto: _DealerConnection) -> None:
        if proto is self.protocol:
            self._waiters.fire()

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto
        self.receiver.connectionMade()
        while self.queue and self.protocol is proto:
            proto.sendFrames(self.queue.popleft())
        if not self.queue:
            self.queuedBytes = 0

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is proto:
            self.protocol = None
            self._waiters.fire()
        if self._dropping is proto:
            self._dropping = None
            return
        if self.service.running:
            self.receiver.connectionLost(reason)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.protocol is not None:
            self.protocol.sendFrames(frames)
            return
        if not self.service.running:
            return
        size = held_bytes(frames)
        if len(self.queue) >= self.maxQueued or self.queuedBytes + size > self.limits.maxOutputBytes:
            self._throttle.warn(log, "full", "stream dealer to {endpoint} refused a message: "
                                "{count} messages ({bytes} bytes) already wait for the connection",
                                endpoint=self.endpoint, count=len(self.queue), bytes=self.queuedBytes)
            return
        self.queue.append(list(frames))
        self.queuedBytes += size

    def reconnect(self) -> None:
        self.queue.clear()
        self.queuedBytes = 0
        proto, self.protocol = self.protocol, None
        if proto is not None:
            self._dropping = proto
            proto.transport.abortConnection()
        self._waiters.fire()

    def close(self) -> defer.Deferred[None]:
        self.queue.clear()
        self.queuedBytes = 0
        self._waiters.fire()
        if self.protocol is not None:
            # the ClientService closes with loseConnection(): see closeGracefully
            self.protocol.transport.unregisterProducer()
        return self.service.stopService()
