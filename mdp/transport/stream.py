"""Multi-frame messages over any Twisted stream endpoint (tcp, tls, unix).

Framing (documented in ``docs/transports.md``): each message is one record::

    record  = length:uint32be  payload          ; length = len(payload)
    payload = *( frame-length:uint32be  frame-bytes )

so a message of frames ``[b"MDPC02", b"\\x01"]`` is
``00 00 00 0f | 00 00 00 06 "MDPC02" | 00 00 00 01 01``.  A record longer than
``maxLength`` (16 MiB by default) or a payload whose frame lengths do not add up
ends the connection, logged with the peer.

The bound side gives each accepted connection an opaque peer id and reports its
loss at once.  The connecting side uses :class:`ClientService`, so it
reconnects with exponential backoff by itself.
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from typing import Callable, Optional

from twisted.application.internet import ClientService
from twisted.internet import defer
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.interfaces import IListeningPort, IPushProducer
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.protocols.basic import Int32StringReceiver
from zope.interface import implementer

from mdp.errors import ProtocolError
from mdp.interfaces import (
    IDealerReceiver,
    IDealerTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.transport.flow import DrainWaiters

log = Logger()

DEFAULT_MAX_LENGTH = 16 * 1024 * 1024

_pack = struct.Struct(">I").pack
_unpack_from = struct.Struct(">I").unpack_from
_ids = itertools.count(1)


def encode_record(frames: list[bytes]) -> bytes:
    """Payload of one record (without the outer length, which the
    Int32StringReceiver adds)."""
    parts = []
    for frame in frames:
        parts.append(_pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def decode_record(payload: bytes) -> list[bytes]:
    """Split one record's payload back into frames."""
    frames = []
    offset = 0
    end = len(payload)
    view = memoryview(payload)
    while offset < end:
        if end - offset < 4:
            raise ProtocolError("truncated frame length in stream record")
        (size,) = _unpack_from(payload, offset)
        offset += 4
        if size > end - offset:
            raise ProtocolError(
                f"frame of {size} bytes overruns its record ({end - offset} left)"
            )
        frames.append(bytes(view[offset : offset + size]))
        offset += size
    return frames


class FramedProtocol(Int32StringReceiver):
    """One stream connection carrying framed multi-frame messages."""

    MAX_LENGTH = DEFAULT_MAX_LENGTH

    onMessage: Callable[[list[bytes]], None]

    def sendFrames(self, frames: list[bytes]) -> None:
        self.sendString(encode_record(frames))

    def stringReceived(self, payload: bytes) -> None:
        try:
            frames = decode_record(payload)
        except ProtocolError as e:
            log.warn("dropping stream peer {peer}: {reason}", peer=self._peerName(), reason=e)
            self.transport.loseConnection()
            return
        self.onMessage(frames)

    def lengthLimitExceeded(self, length: int) -> None:
        log.warn(
            "dropping stream peer {peer}: record of {length} bytes exceeds {limit}",
            peer=self._peerName(),
            length=length,
            limit=self.MAX_LENGTH,
        )
        self.transport.loseConnection()

    def _peerName(self) -> str:
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


class _RouterConnection(FramedProtocol):
    router: StreamRouter
    peer: bytes

    def connectionMade(self) -> None:
        self.peer = b"\x00" + next(_ids).to_bytes(4, "big")
        self.MAX_LENGTH = self.router.maxLength
        self.router.connections[self.peer] = self
        self.onMessage = self._deliver

    def _deliver(self, frames: list[bytes]) -> None:
        self.router.receiver.messageReceived(self.peer, frames)

    def connectionLost(self, reason: object = None) -> None:
        if self.router.connections.pop(self.peer, None) is not None:
            self.router.receiver.peerDisconnected(self.peer)


@implementer(IRouterTransport)
class StreamRouter:
    """The bound side over a Twisted server endpoint."""

    reportsDisconnects = True

    def __init__(self, receiver: IRouterReceiver, maxLength: int = DEFAULT_MAX_LENGTH) -> None:
        self.receiver = receiver
        self.maxLength = maxLength
        self.connections: dict[bytes, _RouterConnection] = {}
        self.port: Optional[IListeningPort] = None
        self.endpoint = ""

    def buildProtocol(self, addr: object) -> _RouterConnection:
        proto = _RouterConnection()
        proto.router = self
        return proto

    @classmethod
    def listen(
        cls, reactor: object, endpoint: str, receiver: IRouterReceiver,
        maxLength: int = DEFAULT_MAX_LENGTH,
    ) -> defer.Deferred[StreamRouter]:
        router = cls(receiver, maxLength)
        description = server_description(endpoint)
        server = serverFromString(reactor, description)
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = router.buildProtocol  # type: ignore[method-assign]

        def listening(port: IListeningPort) -> StreamRouter:
            router.port = port
            router.endpoint = connect_description(description.partition(":")[0], port)
            return router

        return server.listen(factory).addCallback(listening)

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.sendFrames(frames)

    def disconnectPeer(self, peer: bytes) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.transport.loseConnection()

    def close(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        for connection in list(self.connections.values()):
            connection.transport.abortConnection()
        self.connections.clear()
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
        self.MAX_LENGTH = self.dealer.maxLength
        self.onMessage = self.dealer.receiver.messageReceived
        self.transport.registerProducer(self, True)
        self.dealer._made(self)

    def connectionLost(self, reason: object = None) -> None:
        self.paused = False
        self.dealer._lost(self, reason)

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
    """The connecting side: one :class:`ClientService`-managed connection."""

    maxQueued = 1000

    def __init__(
        self,
        reactor: object,
        endpoint: str,
        receiver: IDealerReceiver,
        retryPolicy: Optional[Callable[[int], float]] = None,
        maxLength: int = DEFAULT_MAX_LENGTH,
    ) -> None:
        self.endpoint = endpoint
        self.receiver = receiver
        self.maxLength = maxLength
        self.protocol: Optional[_DealerConnection] = None
        self.queue: deque[list[bytes]] = deque(maxlen=self.maxQueued)
        self._dropping: Optional[_DealerConnection] = None
        self._waiters = DrainWaiters()
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = self._buildProtocol  # type: ignore[method-assign]
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
        elif self.service.running:
            self.queue.append(list(frames))

    def reconnect(self) -> None:
        self.queue.clear()
        proto, self.protocol = self.protocol, None
        if proto is not None:
            self._dropping = proto
            proto.transport.abortConnection()
        self._waiters.fire()

    def close(self) -> defer.Deferred[None]:
        self.queue.clear()
        self._waiters.fire()
        return self.service.stopService()
