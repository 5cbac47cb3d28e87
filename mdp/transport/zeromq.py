"""ZeroMQ ROUTER/DEALER transports over txzmq: ``zmq:tcp://…``, ``zmq:ipc://…``.

Thin adapters around :class:`txzmq.ZmqRouterConnection` and
:class:`txzmq.ZmqDealerConnection`.  Socket options are set explicitly instead
of txzmq's defaults: a high-water mark of 100,000 messages per pipe (txzmq's 0
means unbounded queues) and a short linger.  ZeroMQ hides connection state, so these
transports never report disconnects; MDP heartbeats cover that.

``import txzmq`` installs the default reactor; this module imports it only when
a ``zmq:`` endpoint is actually used.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any, Optional

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp.errors import TransportError
from mdp.interfaces import (
    IDealerReceiver,
    IDealerTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.transport.flow import DrainWaiters

log = Logger()

#: Per-pipe queue bound.  High enough that a handler streaming thousands of
#: PARTIALs in one burst is not cut short (a DEALER refuses and a ROUTER drops
#: messages beyond it), low enough to bound memory; txzmq's default of 0 would
#: mean unbounded.
HIGH_WATER_MARK = 100_000
LINGER_MS = 200

_factory: Any = None
_classes: Optional[tuple[type, type]] = None


def zmq_factory() -> Any:
    """The process-wide txzmq factory (one ZeroMQ context), shut down with the
    reactor."""
    global _factory
    if _factory is None:
        import txzmq

        _factory = txzmq.ZmqFactory()
        _factory.lingerPeriod = LINGER_MS
        _factory.registerForShutdown()
    return _factory


#: Messages handled per doRead before yielding to the reactor.
READ_BATCH = 64
#: Frames at least this long are sent without copying.
ZERO_COPY_BYTES = 65536


def _connection_classes() -> tuple[type, type]:
    global _classes
    if _classes is None:
        import txzmq
        import zmq

        NOBLOCK = int(zmq.NOBLOCK)
        NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
        EVENTS = int(zmq.EVENTS)
        POLLIN = int(zmq.POLLIN)
        # pyzmq's compiled socket methods, below its Python-level wrappers
        backend = zmq.backend.Socket
        recv, send, get = backend.recv, backend.send, backend.get

        class FastIO:
            """Replaces txzmq's read and send paths (see docs/performance.md):
            pyzmq's compiled methods with plain int flags (its Python wrappers'
            IntEnum arithmetic costs more than the I/O), frames' own ``more``
            flag instead of a RCVMORE lookup, an EVENTS check instead of the
            exception a failed recv raises, at most READ_BATCH messages per
            reactor turn, and an extra read after a send only when ZeroMQ says
            input is pending (its FD is edge-triggered)."""

            read_scheduled: Any
            socket: Any
            factory: Any
            reading = False

            def doRead(self) -> None:
                self.read_scheduled = _cancel(self.read_scheduled)
                socket = self.socket
                if socket is None:
                    return
                deliver = self.deliver
                # sends made while reading need no EVENTS check of their own:
                # the loop asks EVENTS again before it returns
                self.reading = True
                try:
                    for _ in range(READ_BATCH):
                        # asking EVENTS is cheaper than the Again a failed recv raises
                        if not get(socket, EVENTS) & POLLIN:
                            return
                        frame = recv(socket, NOBLOCK, False)
                        frames = [frame.bytes]
                        while frame.more:
                            frame = recv(socket, NOBLOCK, False)
                            frames.append(frame.bytes)
                        try:
                            deliver(frames)
                        except Exception:
                            log.failure("zmq message handler failed")
                        if self.socket is None:
                            return
                finally:
                    self.reading = False
                # more may be waiting: let the reactor run other work first
                self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

            def send(self, frames: list[bytes]) -> None:
                socket = self.socket
                last = len(frames) - 1
                for i, frame in enumerate(frames):
                    # large frames go zero-copy (ZeroMQ keeps a reference), as
                    # pyzmq's own send_multipart does past its copy threshold
                    send(socket, frame, NOBLOCK if i == last else NOBLOCK_SNDMORE,
                         len(frame) < ZERO_COPY_BYTES)
                if not self.reading and self.read_scheduled is None and get(socket, EVENTS) & POLLIN:
                    self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        class Router(FastIO, txzmq.ZmqRouterConnection):
            highWaterMark = HIGH_WATER_MARK
            owner: ZmqRouter

            def deliver(self, frames: list[bytes]) -> None:
                self.owner.receiver.messageReceived(frames[0], frames[1:])

        class Dealer(FastIO, txzmq.ZmqDealerConnection):
            highWaterMark = HIGH_WATER_MARK
            owner: ZmqDealer

            def doRead(self) -> None:
                # ZeroMQ signals its FD when a full pipe drains, too
                owner = getattr(self, "owner", None)
                if owner is not None and owner._backlog:
                    owner._flush()
                FastIO.doRead(self)

            def deliver(self, frames: list[bytes]) -> None:
                self.owner._received(self, frames)

        _classes = (Router, Dealer)
    return _classes


def _cancel(call: Any) -> None:
    """Cancel a pending delayed call (if any); returns None to store back."""
    if call is not None and call.active():
        call.cancel()


def _zmq() -> Any:
    """The zmq module (imported late: see the module docstring)."""
    import zmq

    return zmq


def _address(endpoint: str) -> str:
    if not endpoint.startswith("zmq:"):
        raise TransportError(f"not a zmq endpoint: {endpoint!r}")
    return endpoint[len("zmq:"):]


@implementer(IRouterTransport)
class ZmqRouter:
    """A bound ZeroMQ ROUTER socket."""

    reportsDisconnects = False

    def __init__(self, endpoint: str, receiver: IRouterReceiver) -> None:
        import txzmq
        import zmq

        router_class, _ = _connection_classes()
        self.receiver = receiver
        address = _address(endpoint)
        # bind after construction: a bind error inside txzmq's constructor would
        # leave an unclosed socket that blocks the context's term() at shutdown
        # with a fixed port, announce the endpoint as identity (the Guide's
        # Freelance model 3 clients address servers that way)
        identity = address.encode() if "*" not in address else None
        self.connection = router_class(zmq_factory(), identity=identity)
        self.connection.owner = self
        # refuse (and so report) a message to a full or unknown peer instead
        # of ZeroMQ's silent drop
        self.connection.socket.set(zmq.ROUTER_MANDATORY, 1)
        self.dropped = 0
        self._warnedAt = float("-inf")
        try:
            self.connection.addEndpoints([txzmq.ZmqEndpoint(txzmq.ZmqEndpointType.bind, address)])
        except zmq.ZMQError as e:
            self.connection.shutdown()
            raise TransportError(f"cannot bind {endpoint}: {e}") from e
        bound = self.connection.socket.get(zmq.LAST_ENDPOINT).decode()
        self.endpoint = "zmq:" + bound.replace("0.0.0.0", "127.0.0.1")

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        try:
            self.connection.send([peer, *frames])
        except _zmq().ZMQError as e:
            self._refused(peer, e)

    def _refused(self, peer: bytes, error: Any) -> None:
        self.dropped += 1
        if error.errno == errno.EHOSTUNREACH:  # the peer closed its socket
            log.debug("zmq router {endpoint}: peer {peer!r} is gone; message dropped",
                      endpoint=self.endpoint, peer=peer)
            return
        now = time.monotonic()
        if now - self._warnedAt < 1.0:  # at most one line a second for a flood
            return
        self._warnedAt = now
        reason = ("its queue is full (it reads slower than it is sent to)"
                  if error.errno == errno.EAGAIN else str(error))
        log.warn("zmq router {endpoint} dropped a message to {peer!r}: {reason}; "
                 "{dropped} dropped so far", endpoint=self.endpoint, peer=peer,
                 reason=reason, dropped=self.dropped)

    def disconnectPeer(self, peer: bytes) -> None:
        """ZeroMQ has no per-peer connection to drop."""

    def close(self) -> defer.Deferred[None]:
        if self.connection.socket is not None:
            self.connection.shutdown()
        return defer.succeed(None)


@implementer(IDealerTransport)
class ZmqDealer:
    """A connecting ZeroMQ DEALER socket; :meth:`reconnect` opens a new one.

    At the high-water mark a DEALER refuses messages; they are kept, in order,
    in a backlog that is flushed as the pipe drains (``writable`` is false
    meanwhile), so nothing given to :meth:`sendMessage` is dropped while the
    socket lives."""

    connected = True
    #: Seconds between flush attempts while backlogged, besides the ones
    #: ZeroMQ's own "writable again" signal triggers.
    flushInterval = 0.005

    def __init__(self, reactor: Any, endpoint: str, receiver: IDealerReceiver) -> None:
        self.reactor = reactor
        self.endpoint = endpoint
        self.address = _address(endpoint)
        self.receiver = receiver
        self.connection: Any = None
        self._backlog: deque[list[bytes]] = deque()
        self._waiters = DrainWaiters()
        self._retry: Any = None
        self._open()

    @property
    def writable(self) -> bool:
        return not self._backlog

    def drained(self) -> defer.Deferred[None]:
        if not self._backlog:
            return defer.succeed(None)
        return self._waiters.wait()

    def _flush(self) -> None:
        """Send what waits in the backlog, until ZeroMQ refuses again."""
        self._retry = _cancel(self._retry)
        if self.connection is None:
            return
        backlog = self._backlog
        while backlog:
            if not self._trySend(backlog[0]):
                self._retry = self.reactor.callLater(self.flushInterval, self._flush)
                return
            backlog.popleft()
        self._waiters.fire()

    def _trySend(self, frames: list[bytes]) -> bool:
        """Send *frames* now; False if ZeroMQ refused them for a full queue.
        Any other error is logged and the message dropped."""
        try:
            self.connection.send(frames)
        except _zmq().ZMQError as e:
            if isinstance(e, _zmq().Again):  # a full queue
                return False
            log.warn("zmq dealer to {endpoint} could not send: {error}", endpoint=self.endpoint, error=e)
        return True

    def _open(self) -> None:
        import txzmq

        _, dealer_class = _connection_classes()
        connection = dealer_class(
            zmq_factory(), txzmq.ZmqEndpoint(txzmq.ZmqEndpointType.connect, self.address)
        )
        connection.owner = self
        self.connection = connection
        self.reactor.callLater(0, self._made, connection)

    def _made(self, connection: Any) -> None:
        if connection is self.connection:
            self.receiver.connectionMade()

    def _received(self, connection: Any, frames: list[bytes]) -> None:
        if connection is self.connection:
            self.receiver.messageReceived(frames)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.connection is None:
            return
        # behind what waits already, to keep the order
        if not self._backlog and self._trySend(frames):
            return
        self._backlog.append(frames)
        if self._retry is None:
            self._retry = self.reactor.callLater(self.flushInterval, self._flush)

    def _shutdown(self) -> None:
        connection, self.connection = self.connection, None
        self._backlog.clear()
        self._retry = _cancel(self._retry)
        self._waiters.fire()
        if connection is not None and connection.socket is not None:
            connection.shutdown()

    def reconnect(self) -> None:
        if self.connection is None:
            return
        self._shutdown()
        self._open()

    def close(self) -> defer.Deferred[None]:
        self._shutdown()
        return defer.succeed(None)


class ZmqPeerRouter:
    """A ROUTER socket that *connects* to servers and names each one by its
    endpoint string (ZMQ_CONNECT_ROUTING_ID), so the server's own identity
    does not matter and ports picked by the OS work."""

    def __init__(self, receiver: Any) -> None:
        router_class, _ = _connection_classes()
        self.target = receiver
        self.receiver = self  # the connection delivers to owner.receiver
        self.endpoints: set[str] = set()
        self.connection = router_class(zmq_factory())
        self.connection.owner = self

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.target.messageReceived(peer.decode("utf-8", "replace"), frames)

    def connect(self, endpoint: str) -> None:
        import zmq

        socket = self.connection.socket
        socket.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.encode())
        socket.connect(_address(endpoint))
        self.endpoints.add(endpoint)

    def sendMessage(self, endpoint: str, frames: list[bytes]) -> None:
        if self.connection.socket is None:
            return
        try:
            self.connection.send([endpoint.encode(), *frames])
        except _zmq().ZMQError as e:
            log.warn("zmq peer router could not send to {endpoint}: {error}",
                     endpoint=endpoint, error=e)

    def close(self) -> defer.Deferred[None]:
        if self.connection.socket is not None:
            self.connection.shutdown()
        return defer.succeed(None)

