"""The listening side of the stream transport (:class:`StreamRouter`).

Each accepted connection (or channel of one) is a peer: an opaque id, or the
identity its greeting announces.  A full listener closes the connection that
has done least to admit a newcomer (:func:`_leastUseful`; docs/transports.md)."""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict, deque
from functools import cached_property
from typing import Any, Callable, Optional

from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import TransportError
from mdp.interfaces import IAuthenticatedRouter, IFraming, IRouterReceiver, IRouterTransport
from mdp.policy import Limits, LogThrottle, cancel_call, default_reactor
from mdp.transport.endpoints import (
    DESCRIPTOR_RESERVE,
    connect_description,
    descriptor_budget,
    server_description,
    server_endpoint,
    subject,
)
from mdp.transport.framed import FramedProtocol
from mdp.transport.framing import RECORDS
from mdp.transport.twisted_private import call_soon

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

_ids = itertools.count(1)
_routers: weakref.WeakSet[StreamRouter] = weakref.WeakSet()

#: connections making room, past which newcomers are refused at the descriptor budget
MAX_MAKING_ROOM = DESCRIPTOR_RESERVE // 2
MAX_UNACKNOWLEDGED = 64  # channels ended here and not acknowledged, before it is dropped
NEWCOMER_GRACE = 1.0  # seconds before a silent new connection makes room before one that spoke


@implementer(IPushProducer)
class _RouterConnection(FramedProtocol):
    """An accepted connection, its transport's push producer; with channels, each channel is a peer."""

    router: StreamRouter
    peer: bytes
    greeted = False  # its handshake is done
    useful = False  # never closed to make room
    host: Optional[str] = None
    makingRoom = False
    _timer: Any = None
    backlogBytes = 0
    _recordsAtArm = -1

    def connectionMade(self) -> None:
        StreamRouter.accepted += 1
        router = self.router
        self.limits = router.limits
        self.framing = router.framing
        self.throttle = router.throttle
        super().connectionMade()
        self.peer = b"\x00" + next(_ids).to_bytes(4, "big")
        self.onMessage = self._deliver
        self.backlog: deque[bytes] = deque()
        self.channels: dict[bytes, bytes] = {}
        self.unacknowledged: set[bytes] = set()
        router.connections[self.peer] = self
        self.hostRanks = ranks = router.hostRanks.setdefault(self.host, ({}, {}))
        router.ungreeted[self] = ranks[0][self] = None
        router._countHost(self.host, 1)
        self.since = router.reactor.seconds()
        self.transport.registerProducer(self, True)
        self._arm(self.limits.handshakeTimeout, "sent no message within {seconds:g}s of connecting")

    @cached_property
    def tlsSubject(self) -> Optional[str]:
        certificate = getattr(self.transport, "getPeerCertificate", lambda: None)()
        return None if certificate is None else subject(certificate)

    def _deliver(self, frames: list[bytes]) -> None:
        router = self.router
        if type(frames) is tuple:  # a (channel, frames) pair: it carries channels
            channel, frames = frames
            peer = self.channels.get(channel)
            if not frames:  # ended, or the end acknowledged
                if peer is not None:
                    self._forgetChannel(channel)
                    router.receiver.peerDisconnected(peer)
                else:
                    self.unacknowledged.discard(channel)
                return
            if peer is None:
                if channel in self.unacknowledged:
                    return  # sent before the peer knew the channel was ended
                full = router._fullOfChannels() if self.channels else None
                if full is not None:
                    router.refused += 1
                    self._warn("channel", "stream peer {peer} opened a channel over the cap "
                               "({full}): ended it", full=full)
                    self._end(channel)
                    return
                if not self.channels:
                    router.carriers += 1
                peer = self.channels[channel] = self.peer + channel
                router.channels[peer] = (self, channel)
        else:
            peer = self.decoder.identity
            if peer is None:
                peer = self.peer
            elif peer != self.peer:  # announced: an older holder is dropped
                old = router.connections.get(peer)
                if old is not None and old is not self:
                    if old.tlsSubject != self.tlsSubject:
                        self.drop("it announced identity {identity}, held by a connection with "
                                  "another TLS certificate", identity=peer.hex())
                        return
                    old.drop("a newer connection took over its identity {identity}", identity=peer.hex())
                    if old.useful:
                        self.greeted = True
                        self.markUseful()
                router.connections.pop(self.peer, None)
                router.connections[peer] = self
                self.peer = peer
        if not self.useful:  # (dataReceived ends the handshake timer)
            self.greeted = True
            self.markUseful(not router.judged)  # judged: the last to make room
        router.receiver.messageReceived(peer, frames)

    def markUseful(self, useful: bool = True) -> None:
        self.useful = useful
        self._unrank()
        if not useful and not self.dropped:
            self.router.spoken[self] = self.hostRanks[1][self] = None

    def _unrank(self) -> None:
        for ranked in (*self.router.ranks, *self.hostRanks):
            ranked.pop(self, None)

    def drop(self, why: str, **fields: Any) -> None:
        self._unrank()
        super().drop(why, **fields)

    def _forgetChannel(self, channel: bytes) -> Optional[bytes]:
        peer = self.channels.pop(channel, None)
        if peer is not None:
            self.router.channels.pop(peer, None)
            if not self.channels:
                self.router.carriers -= 1
        return peer

    def _end(self, channel: bytes) -> None:
        self.send([], channel)
        self.unacknowledged.add(channel)
        if len(self.unacknowledged) > MAX_UNACKNOWLEDGED:
            self.drop("it did not acknowledge the end of {count} channels", count=len(self.unacknowledged))

    def endChannel(self, channel: bytes) -> None:
        peer = self._forgetChannel(channel)
        if peer is None:
            return
        if not self.closing:
            self._end(channel)
        self.router.reactor.callLater(0, self.router._channelEnded, peer)

    def _batchBegun(self) -> None:
        router = self.router
        if getattr(self.decoder, "channels", False):  # (sent together at the turn's end)
            if self._flushCall is None:
                self._flushCall = call_soon(router.reactor, self._flushTurn)
            return
        router.dirty.append(self)
        if not router.reading and router.flushCall is None:
            router.flushCall = router.reactor.callLater(0, router.flushWrites)

    def dataReceived(self, data: bytes) -> None:
        router = self.router
        router.reading += 1
        try:
            super().dataReceived(data)
            decoder = self.decoder
            if not self.greeted and not self.closing and getattr(decoder, "handshaken", False):
                self.greeted = True  # its framing's handshake (SP's header)
            if not self.greeted or self.closing:
                return
            if decoder.inRecord:
                if self._timer is None or self._recordsAtArm != decoder.records:
                    self._recordsAtArm = decoder.records
                    self._arm(self.limits.recordTimeout, "a record of theirs stayed incomplete "
                              "for {seconds:g}s ({held} bytes held)")
            elif self._timer is not None:
                self._timer = cancel_call(self._timer)
        finally:
            router.reading -= 1
            if not router.reading and router.dirty:
                router.flushWrites()

    def _arm(self, seconds: float, why: str) -> None:
        self._timer = cancel_call(self._timer)
        self._timer = self.router.reactor.callLater(seconds, self._timedOut, why, seconds)

    def _timedOut(self, why: str, seconds: float) -> None:
        self._timer = None
        self.drop(why, seconds=seconds, held=self.decoder.buffered)

    def send(self, frames: list[bytes], channel: Optional[bytes] = None) -> None:
        """Send *frames* (on *channel*; empty ends it), held within ``maxOutputBytes``."""
        if self.closing:
            return
        record = self.encode(frames)
        if self.paused or self.backlog:
            self._hold(record if channel is None else channel + record)
        else:
            self._queue(record, channel)

    def _hold(self, record: bytes) -> None:
        self.backlog.append(record)
        self.backlogBytes += len(record)
        if self.backlogBytes > self.limits.maxOutputBytes:
            self.router.overflows += 1
            self.drop("it reads slower than it is sent to ({held} bytes unsent, over the limit "
                      "of {limit})", held=self.backlogBytes, limit=self.limits.maxOutputBytes)
            self.stopProducing()

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
        """Close once what is written is sent, or after ``recordTimeout``."""
        if self.dropped or self.closedHere:
            return
        self.flushWrites()
        self.transport.writeSequence(list(self.backlog))
        self.stopProducing()
        super().closeGracefully()
        if not self.dropped:
            self._arm(self.limits.recordTimeout, "it did not take what was sent to it within "
                      "{seconds:g}s of being disconnected")

    def connectionLost(self, reason: object = None) -> None:
        StreamRouter.accepted -= 1
        if self.makingRoom:
            StreamRouter.makingRoom -= 1
        super().connectionLost(reason)
        self._timer = cancel_call(self._timer)
        self.backlog.clear()
        router = self.router
        self._unrank()
        router._countHost(self.host, -1)
        channels, self.channels = self.channels, {}
        if channels and not router.closed:
            router.carriers -= 1
        for peer in channels.values():
            if router.channels.pop(peer, None) is not None:
                router.receiver.peerDisconnected(peer)
        if router.connections.get(self.peer) is self:
            del router.connections[self.peer]
            if not getattr(self.decoder, "channels", False):
                router.receiver.peerDisconnected(self.peer)


class _Refused(Protocol):
    """A connection refused at a cap, closed at once (not None: TLS would keep it)."""

    def connectionMade(self) -> None:
        StreamRouter.accepted += 1
        self.transport.abortConnection()

    def connectionLost(self, reason: object = None) -> None:
        StreamRouter.accepted -= 1


def _leastUseful(ranks: list[tuple[dict, dict]], now: float) -> Optional[_RouterConnection]:
    """The connection of *ranks* (not greeted, spoken but not useful) to close
    for a newcomer: silent for ``NEWCOMER_GRACE``, oldest first; else not useful
    yet, least recently heard first; else silent."""
    for rank in (0, 1, 2):
        for ungreeted, spoken in ranks:
            for connection in spoken if rank == 1 else ungreeted:
                if rank == 0 and connection.since > now - NEWCOMER_GRACE:
                    break  # (and all after it)
                return connection  # type: ignore[no-any-return]
    return None


@implementer(IRouterTransport, IAuthenticatedRouter)
class StreamRouter:
    """The bound side: :meth:`listen` binds an endpoint; :meth:`factory` serves a port."""

    accepted = makingRoom = 0  # (process-wide) connections open, and dropped to make room
    carriers = 0  # connections with an open channel
    overflows = refused = evicted = reading = 0
    closed = _listening = False
    wrapped = True  # its factory may be wrapped (TLS): refuse with _Refused
    port: Optional[IListeningPort] = None
    endpoint = ""
    flushCall: Any = None

    def __init__(self, receiver: IRouterReceiver, reactor: Any = None, *,
                 limits: Limits = Limits(), framing: IFraming = RECORDS) -> None:
        self.receiver = receiver
        self.judged = bool(getattr(receiver, "marksUseful", False))
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.framing = framing
        self.acceptsBuffers = getattr(framing, "acceptsBuffers", False)
        self.throttle = LogThrottle(self.reactor)
        self.connections: dict[bytes, _RouterConnection] = {}
        self.channels: dict[bytes, tuple[_RouterConnection, bytes]] = {}
        self.ungreeted: OrderedDict[_RouterConnection, None] = OrderedDict()  # oldest first
        self.spoken: OrderedDict[_RouterConnection, None] = OrderedDict()
        self.ranks = (self.ungreeted, self.spoken)
        self.hostRanks: dict[Optional[str], tuple[dict, dict]] = {}
        self.hosts: dict[Optional[str], int] = {}  # connections by IP address
        self.dirty: list[_RouterConnection] = []
        self.descriptorBudget: Callable[[], Optional[int]] = descriptor_budget
        _routers.add(self)

    def flushWrites(self) -> None:
        self.flushCall = cancel_call(self.flushCall)
        while self.dirty:
            dirty, self.dirty = self.dirty, []
            for connection in dirty:
                connection.flushWrites()

    def buildProtocol(self, addr: object) -> Optional[Protocol]:
        host = getattr(addr, "host", None)
        full, victim = self._crowded(host)
        if full is not None:
            budget = self.descriptorBudget()
            if victim is not None and (StreamRouter.makingRoom < MAX_MAKING_ROOM or budget is None
                                       or StreamRouter.accepted < budget):
                router, victim.makingRoom = victim.router, True  # (maybe another listener)
                did = "nothing useful yet" if victim in router.spoken else "no message"
                router.evicted += 1
                StreamRouter.makingRoom += 1
                victim.drop("making room for a new connection from {address} ({full}): it had "
                            "sent {did}", address=str(addr), full=full, did=did)
                if router.connections.get(victim.peer) is victim:  # counted no more at once
                    del router.connections[victim.peer]
                    router.receiver.peerDisconnected(victim.peer)
            else:
                self.refused += 1
                self.throttle.warn(log, "refused", "stream listener {endpoint} refused a connection "
                                   "from {address}: {full}",
                                   endpoint=self.endpoint, address=str(addr), full=full)
                return _Refused() if self.wrapped else None
        proto = _RouterConnection()
        proto.router = self
        proto.host = host
        return proto

    def _crowded(self, host: Optional[str]) -> tuple[Optional[str], Optional[_RouterConnection]]:
        """Why a connection from *host* may not be added (None: it may), and whom to close for it."""
        perAddress = self.limits.maxConnectionsPerAddress
        now = self.reactor.seconds()
        if host is not None and perAddress and self.hosts.get(host, 0) >= perAddress:
            return (f"{perAddress} connections from {host} open (maxConnectionsPerAddress)",
                    _leastUseful([self.hostRanks[host]], now))
        full = self._fullOfChannels()
        if full is not None:
            return full, _leastUseful([self.ranks], now)
        budget = self.descriptorBudget()
        if budget is None or StreamRouter.accepted < budget:
            return None, None
        return (f"{StreamRouter.accepted} connections open in the process, all that its "
                f"descriptor limit leaves room for (raise it: ulimit -n)",
                _leastUseful([router.ranks for router in (self, *_routers - {self})], now))

    def markUseful(self, peer: bytes, useful: bool = True) -> None:
        """*peer* does useful work (never closed to make room), or no longer does."""
        connection = self._connectionOf(peer) if useful else self.connections.get(peer)
        if connection is not None:
            connection.markUseful(useful)

    def _countHost(self, host: Optional[str], by: int) -> None:
        count = self.hosts[host] = self.hosts.get(host, 0) + by
        if count <= 0:
            del self.hosts[host]
            del self.hostRanks[host]

    def _fullOfChannels(self) -> Optional[str]:
        """Why no connection or channel may be added now, or None."""
        if len(self.connections) + len(self.channels) - self.carriers >= self.limits.maxConnections:
            return f"{self.limits.maxConnections} connections and channels open (maxConnections)"
        return None

    def _channelEnded(self, peer: bytes) -> None:
        if not self.closed:
            self.receiver.peerDisconnected(peer)

    def _checkBudget(self) -> None:
        budget = self.descriptorBudget()
        if budget is not None and budget < self.limits.maxConnections:
            log.warn("stream listener {endpoint}: the process's descriptor limit leaves room for "
                     "{budget} connections, fewer than maxConnections ({limit}); raise it "
                     "(ulimit -n) to let more in", endpoint=self.endpoint or "(embedded)",
                     budget=budget, limit=self.limits.maxConnections)

    def _factoryStarted(self) -> None:
        if self.port is None and not self._listening:
            self._checkBudget()

    def factory(self) -> Factory:
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = self.buildProtocol  # type: ignore[method-assign]
        factory.startFactory = self._factoryStarted  # type: ignore[method-assign]
        factory.noisy = False
        return factory

    @classmethod
    def listen(cls, endpoint: str, receiver: IRouterReceiver, reactor: Any, limits: Limits = Limits(), *,
               framing: IFraming = RECORDS) -> defer.Deferred[StreamRouter]:
        router = cls(receiver, reactor, limits=limits, framing=framing)
        description = server_description(endpoint)
        kind = description.partition(":")[0]
        router.wrapped = kind.lower() not in ("tcp", "tcp6", "unix")
        router._listening = True

        def listening(port: IListeningPort) -> StreamRouter:
            router.port = port
            router.endpoint = connect_description(kind, port)
            router._checkBudget()
            return router

        def failed(failure: Failure) -> Failure:
            if failure.check(TransportError):
                return failure
            return Failure(TransportError(f"cannot listen on {endpoint}: "
                                          f"{failure.getErrorMessage()}"))

        bound = defer.maybeDeferred(lambda: server_endpoint(reactor, description).listen(router.factory()))
        return bound.addCallbacks(listening, failed)

    def peerAddress(self, peer: bytes) -> Optional[str]:
        connection = self._connectionOf(peer)
        return None if connection is None else connection.peerName()

    def peerIdentity(self, peer: bytes) -> Optional[str]:
        connection = self._connectionOf(peer)
        return None if connection is None else connection.tlsSubject

    def _connectionOf(self, peer: bytes) -> Optional[_RouterConnection]:
        return self.connections.get(peer) or self.channels.get(peer, (None, b""))[0]

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.send(frames)
        elif peer in self.channels:
            connection, channel = self.channels[peer]
            connection.send(frames, channel)

    def disconnectPeer(self, peer: bytes) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.closeGracefully()
        elif peer in self.channels:
            connection, channel = self.channels[peer]
            connection.endChannel(channel)

    def close(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        self.closed = True
        self.channels.clear()
        self.carriers = 0
        self.flushCall = cancel_call(self.flushCall)
        self.dirty = []
        for connection in list(self.connections.values()):
            connection.closedHere = True
            connection.dropped = True
            connection._cancelFlush()
            connection.transport.abortConnection()
        self.connections.clear()
        self.ungreeted.clear()
        self.spoken.clear()
        return defer.succeed(None) if port is None else defer.maybeDeferred(port.stopListening)
