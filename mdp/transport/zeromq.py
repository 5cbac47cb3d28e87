"""ZeroMQ ROUTER/DEALER transports over txzmq (``zmq:tcp://…``, ``zmq:ipc://…``),
with bounded high-water marks and message sizes.  ZeroMQ hides connection state:
only a peer a ROUTER cuts off for not reading is reported gone."""

from __future__ import annotations

import errno
import os
from collections import OrderedDict, deque
from typing import Any, Callable, Optional

import zmq
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zmq.utils.monitor import recv_monitor_message
from zope.interface import implementer

from mdp.errors import TransportError
from mdp.interfaces import (
    IAuthenticatedRouter,
    IDealerReceiver,
    IDealerTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.messages import envelope, is_relayed, relayed_peer, routing_id
from mdp.policy import RECONNECT, Limits, LogThrottle, cancel_call, default_reactor, held_bytes
from mdp.transport.curve import CurveClient, CurveServer, forget_domain, zap_domain
from mdp.transport.dealercore import DealerCore
from mdp.transport.flow import DrainWaiters
from mdp.transport.zmqio import (
    MAX_CUT_OFF,
    ROUTER_SEND_WATER_MARK,
    ZERO_COPY_BYTES,
    FlushPacer,
    _connection_classes,
    kept_frame_type,
    random_identity,
    zmq_factory,
    zmq_frames,
)

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

__all__ = ["ROUTER_SEND_WATER_MARK", "ZERO_COPY_BYTES", "ZmqDealer", "ZmqPeerRouter", "ZmqRouter",
           "kept_frame_type", "zmq_frames"]
MAX_RELAYED = 4096  # relayed peers one connection may have


def _address(endpoint: str) -> str:
    if not endpoint.startswith("zmq:"):
        raise TransportError(f"not a zmq endpoint: {endpoint!r}")
    return endpoint[len("zmq:"):]


def _open_connection(owner: Any, kind: int, limits: Limits, identity: Optional[bytes],
                     bound: bool = False) -> Any:
    """A limited txzmq ROUTER (*kind* 0) or DEALER (1) for *owner*.  Only a *bound*
    socket sets MAXMSGSIZE: libzmq never reconnects a connecting one's pipe after it."""
    connection = _connection_classes()[kind](zmq_factory(), identity=identity)
    connection.owner = owner
    connection.maxBytes = limits.maxMessageBytes
    connection.maxFrames = limits.maxFrames
    if bound:
        connection.socket.set(zmq.MAXMSGSIZE, limits.maxMessageBytes)
    return connection


class _Backlog(deque):  # type: ignore[type-arg]
    """A full pipe's messages, in order: each as sent, with its counted size."""

    bytes = 0


class _RoutedSocket:
    """A bound or connecting ROUTER: a full pipe's messages wait in a backlog; past
    ``maxOutputBytes`` its connection is cut off (dropped until it sends again; a bound
    ROUTER reports it and its relayed peers disconnected)."""

    connects = False
    dropped = overflows = oversizedCount = 0
    _flushCall: Any = None

    def _setup(self, endpoint: str, receiver: Any, reactor: Any, limits: Limits,
               identity: Optional[bytes] = None) -> None:
        self.connection = _open_connection(self, 0, limits, identity, bound=not self.connects)
        self.endpoint = endpoint
        self.receiver = receiver
        self.reactor = reactor
        self.limits = limits
        self.throttle = LogThrottle(reactor)
        self.backlogs: dict[bytes, _Backlog] = {}
        self.cut: dict[bytes, None] = {}  # connections cut off, oldest first
        self.relayedOf: dict[bytes, OrderedDict[bytes, None]] = {}  # by connection
        self._pacer = FlushPacer()
        self.connection.socket.set(zmq.ROUTER_MANDATORY, 1)

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        if self.connection.socket is None:
            return
        message = envelope(peer, frames)
        backlog = None
        if self.backlogs or self.cut:
            if message[0] in self.cut:
                self.dropped += 1
                return
            backlog = self.backlogs.get(message[0])
        if backlog is None:
            try:
                self.connection.send(message)
                return
            except zmq.ZMQError as e:
                if e.errno != errno.EAGAIN:
                    self._refused(peer, e)
                    return
            backlog = self.backlogs[message[0]] = _Backlog()
        size = held_bytes(frames)
        backlog.append((message, size))
        backlog.bytes += size
        if backlog.bytes <= self.limits.maxOutputBytes:
            if self._flushCall is None:
                self._flushCall = self.reactor.callLater(self._pacer.next(True), self._flush)
            return
        connection = message[0]  # cut off
        del self.backlogs[connection]
        self.cut[connection] = None
        if len(self.cut) > MAX_CUT_OFF:
            del self.cut[next(iter(self.cut))]
        self.overflows += 1
        self.dropped += len(backlog)
        self.throttle.warn(log, "overflow", "zmq router {endpoint} cut off peer {peer}: it reads "
                           "slower than it is sent to ({held} bytes unsent, over the limit of "
                           "{limit}); {count} peers cut off so far", endpoint=self.endpoint,
                           peer=connection.hex(), held=backlog.bytes,
                           limit=self.limits.maxOutputBytes, count=self.overflows)
        if not self.connects:
            self.reactor.callLater(0, self._reportCut, connection)

    def _flush(self) -> None:
        """Send what waits (on the timer, and when libzmq signals)."""
        self._flushCall = cancel_call(self._flushCall)
        if self.connection.socket is None:
            return
        send = self.connection.send
        progressed = False
        for connection, backlog in list(self.backlogs.items()):
            try:
                while backlog:
                    send(backlog[0][0])
                    backlog.bytes -= backlog.popleft()[1]
                    progressed = True
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                backlog.popleft()
                self._refused(connection, e)
                self.dropped += len(backlog)
            del self.backlogs[connection]
        if self.backlogs:
            self._flushCall = self.reactor.callLater(self._pacer.next(progressed), self._flush)

    def _reportCut(self, peer: bytes) -> None:
        if peer in self.cut:
            self._gone(peer)

    def _gone(self, connection: bytes) -> None:
        self.receiver.peerDisconnected(connection)
        for relayed in self.relayedOf.pop(connection, ()):
            self.receiver.peerDisconnected(relayed)

    def oversized(self, peer: Optional[bytes], count: int, size: int) -> None:
        self.oversizedCount += 1
        self.throttle.warn(log, "oversized", "zmq {endpoint} dropped a message from {peer}: "
                           "{size}+ bytes in {count} frames, over the limit of {limit} bytes in "
                           "{frames} frames", endpoint=self.endpoint,
                           peer=peer.hex() if peer is not None else "?", size=size, count=count,
                           limit=self.limits.maxMessageBytes, frames=self.limits.maxFrames)

    def _refused(self, peer: bytes, error: Any) -> None:
        self.dropped += 1
        if error.errno == errno.EHOSTUNREACH:
            log.debug("zmq router {endpoint}: peer {peer} is gone; message dropped",
                      endpoint=self.endpoint, peer=peer.hex())
            return
        self.throttle.warn(log, "refused", "zmq router {endpoint} dropped a message to {peer}: "
                           "{error}", endpoint=self.endpoint, peer=peer.hex(), error=error)

    def close(self) -> defer.Deferred[None]:
        self._flushCall = cancel_call(self._flushCall)
        self.backlogs.clear()
        self.cut.clear()
        if self.connection.socket is not None:
            self.connection.shutdown()
        return defer.succeed(None)


def _check_ipc_free(address: str, endpoint: str) -> None:
    """Refuse an ``ipc://`` path that is no socket or is listened on (libzmq would unlink it)."""
    path = address[len("ipc://"):]
    if not address.startswith("ipc://") or path.startswith("@"):
        return
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise TransportError(f"cannot bind {endpoint}: {path} exists and is not a socket; "
                                 "left as it is")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(path)
    except OSError:
        return
    raise TransportError(f"cannot bind {endpoint}: address in use (a process listens on {path})")


@implementer(IRouterTransport, IAuthenticatedRouter)
class ZmqRouter(_RoutedSocket):
    """A bound ZeroMQ ROUTER.  A receiver whose ``keepFramesFrom`` is an index gets
    frames from there on of :data:`KEEP_FRAME_BYTES` or more uncopied."""

    acceptsBuffers = True
    hostileIds = 0
    _zapDomain: Optional[str] = None
    _closing = False

    def __init__(self, endpoint: str, receiver: IRouterReceiver, reactor: Any = None, *,
                 limits: Limits = Limits(), curve: Optional[CurveServer] = None) -> None:
        self._keys: OrderedDict[bytes, Optional[str]] = OrderedDict()
        address = _address(endpoint)
        _check_ipc_free(address, endpoint)
        # with a fixed port, the endpoint is the identity (the Guide's Freelance model 3)
        identity = address.encode() if "*" not in address else None
        self._setup(endpoint, receiver, default_reactor(reactor), limits, identity)
        keepFrom = getattr(receiver, "keepFramesFrom", None)
        self.deliversBuffers = type(keepFrom) is int  # (not a catch-all stand-in's attribute)
        relays = getattr(receiver, "relayHeaders", None)  # other first frames are relay hops
        self.relays = relays if isinstance(relays, frozenset) else None
        if self.deliversBuffers:
            self.connection.keepAfter = keepFrom + self.connection.envelope
        # handover, but not under CURVE: one key would take over another's peer id
        self.connection.socket.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve is not None else 1)
        if not address.startswith("inproc://"):  # (before the bind: ROUTER_SEND_WATER_MARK)
            self.connection.socket.set(zmq.SNDHWM, ROUTER_SEND_WATER_MARK)
        if curve is not None:
            factory = zmq_factory()
            self.handshakesRefused = 0
            self._zapDomain = zap_domain(factory.context, curve, endpoint, self.reactor,
                                          factory.beforeTerm, self._handshakeRefused)
            curve.apply(self.connection.socket, self._zapDomain)
            self.connection.identify = curve.allow is not None  # (else any key is nobody)
        try:
            self.connection.socket.bind(address)
        except zmq.ZMQError as e:
            self.connection.shutdown()
            self._forgetDomain()
            raise TransportError(f"cannot bind {endpoint}: {e}") from e
        self.connection.attached()
        self._bound = self.connection.socket.get(zmq.LAST_ENDPOINT).decode()
        self.endpoint = "zmq:" + self._bound.replace("0.0.0.0", "127.0.0.1")

    def identified(self, peer: bytes, userId: Optional[str]) -> None:
        """The next message from *peer* had key *userId*: with a new key, the id's holder is gone."""
        keys = self._keys
        known = keys.pop(peer, userId)
        keys[peer] = userId
        if known != userId and not self._closing:
            self.throttle.warn(log, "claimed", "peer id {peer} of {endpoint} now speaks with "
                               "another CURVE key: the peer that had it is gone",
                               peer=peer.hex(), endpoint=self.endpoint)
            self._gone(peer)
        elif len(keys) > MAX_CUT_OFF * 10:
            keys.popitem(last=False)

    def _handshakeRefused(self) -> None:
        self.handshakesRefused += 1

    def peerIdentity(self, peer: bytes) -> Optional[str]:
        """The CURVE public key (Z85) of *peer*'s connection; None without an allow-list."""
        return self._keys.get(routing_id(peer))

    def _forgetDomain(self) -> None:
        if self._zapDomain is not None:
            forget_domain(zmq_factory().context, self._zapDomain)
            self._zapDomain = None

    def delivered(self, peer: bytes, frames: list[bytes]) -> None:
        if self.cut:
            self.cut.pop(peer, None)  # it speaks again
        relays = self.relays
        if relays is not None:
            if is_relayed(peer):  # a routing id posing as a relayed peer
                self.hostileIds += 1
                self.throttle.warn(log, "hostile-id", "zmq router {endpoint} dropped a message "
                                   "from a peer whose routing id {peer} begins as only relayed "
                                   "peers' keys do", endpoint=self.endpoint, peer=peer.hex())
                return
            if len(frames) > 1 and frames[0] not in relays and 0 < len(frames[0]) < 256:
                # a relay hop: past MAX_RELAYED, the least recently heard peer is gone
                connection, peer = peer, relayed_peer(peer, bytes(frames[0]))
                frames = frames[1:]
                known = self.relayedOf.get(connection)
                if known is None:
                    known = self.relayedOf[connection] = OrderedDict()
                    if len(self.relayedOf) > MAX_CUT_OFF * 10:  # (ZeroMQ never says they went)
                        del self.relayedOf[next(iter(self.relayedOf))]
                known[peer] = None
                known.move_to_end(peer)
                if len(known) > MAX_RELAYED:
                    self.receiver.peerDisconnected(known.popitem(last=False)[0])
        if not self._closing:
            self.receiver.messageReceived(peer, frames)

    def disconnectPeer(self, peer: bytes) -> None:
        """ZeroMQ has no per-peer connection to drop."""

    unbindTimeout = 2.0

    def close(self) -> defer.Deferred[None]:
        """Close the socket; fires once its address is free (``unbindTimeout`` at most)."""
        socket = self.connection.socket
        if socket is None or self._closing:
            return defer.succeed(None)
        self._closing = True
        self._forgetDomain()
        if not self._bound.startswith(("tcp://", "ipc://")):
            return _RoutedSocket.close(self)
        monitor = socket.get_monitor_socket(zmq.EVENT_CLOSED)
        closed: defer.Deferred[None] = defer.Deferred()
        deadline = self.reactor.seconds() + self.unbindTimeout

        def done() -> None:
            if closed.called:
                return
            zmq_factory().beforeTerm.discard(done)
            socket.disable_monitor()
            monitor.close(linger=0)
            _RoutedSocket.close(self)
            closed.callback(None)

        zmq_factory().beforeTerm.add(done)  # (the context may end first)

        def poll() -> None:
            try:
                while recv_monitor_message(monitor, zmq.NOBLOCK)["event"] != zmq.EVENT_CLOSED:
                    pass
            except zmq.Again:
                if self.reactor.seconds() < deadline and not closed.called:
                    self.reactor.callLater(0.001, poll)
                    return
            done()

        try:
            socket.unbind(self._bound)
        except zmq.ZMQError:
            done()
        else:
            poll()
        return closed


@implementer(IDealerTransport)
class ZmqDealer:
    """A connecting DEALER: not ``writable`` while refused messages wait or libzmq holds too much."""

    connected = True
    connection: Any = None
    _retry: Any = None
    _reopening: Any = None

    def __init__(self, endpoint: str, receiver: IDealerReceiver, reactor: Any, *,
                 limits: Limits = Limits(), identity: Optional[bytes] = None,
                 curve: Optional[CurveClient] = None,
                 retryPolicy: Optional[Callable[[int], float]] = None) -> None:
        self.reactor = reactor
        policy = retryPolicy or RECONNECT.retryPolicy()
        self.core = DealerCore(limits, lambda failures: policy(failures + 1))
        self.backlogs = self.core.backlog  # (what the connection's read looks at, as a ROUTER's)
        self.curve = curve
        self.endpoint = endpoint
        # under CURVE, unguessable (see ZmqRouter.identified)
        self.identity = random_identity() if curve is not None and identity is None else identity
        self.address = _address(endpoint)
        self.receiver = receiver
        self.limits = limits
        self.throttle = LogThrottle(reactor)
        self._waiters = DrainWaiters()
        self._pacer = FlushPacer()
        self._open()

    @property
    def writable(self) -> bool:
        core = self.core
        return not core.backlog and core.held() <= self.limits.maxOutputBytes

    def drained(self) -> defer.Deferred[None]:
        if self.writable:
            return defer.succeed(None)
        if self._retry is None:
            self._retry = self.reactor.callLater(self._pacer.next(True), self._flush)
        return self._waiters.wait()

    def _flush(self) -> None:
        """Send what waits; wake the waiters once libzmq holds at most half the bound (polled)."""
        self._retry = cancel_call(self._retry)
        if self.connection is None:
            self._waiters.fire()
            return
        core = self.core
        progressed = False
        while core.backlog:
            if not self._trySend(core.backlog[0]):
                break
            core.sent()
            progressed = True
        else:
            released = core.released
            if core.held() <= self.limits.maxOutputBytes // 2:
                self._waiters.fire()
                return
            progressed = core.released != released
        self._retry = self.reactor.callLater(self._pacer.next(progressed), self._flush)

    def _trySend(self, frames: list[bytes]) -> bool:
        """Send *frames* now; False on a full queue."""
        frames, size, tracker = self.core.track(frames)
        try:
            self.connection.send(frames)
            self.core.went(size, tracker)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            log.warn("zmq dealer to {endpoint} could not send: {error}", endpoint=self.endpoint, error=e)
        return True

    def _open(self) -> None:
        connection = _open_connection(self, 1, self.limits, self.identity)
        try:
            if self.curve is not None:
                self.curve.apply(connection.socket)
            connection.socket.connect(self.address)
        except BaseException:
            connection.shutdown()
            raise
        self.connection = connection
        self.core.clear()
        self.reactor.callLater(0, self._made, connection)

    def _made(self, connection: Any) -> None:
        if connection is self.connection:
            self.receiver.connectionMade()
            connection.attached()  # (unless a callback closed it)

    def discardReceived(self) -> int:
        return 0 if self.connection is None else self.connection.discardQueued()

    def oversized(self, head: Any, count: int, size: int) -> None:
        """Replace the socket after a message over the limits, or only a relay hop's pipe."""
        onHop = getattr(self.receiver, "hopOversized", None)
        if onHop is not None and head and onHop(bytes(head), count, size):
            return
        self.throttle.warn(log, "oversized", "zmq dealer to {endpoint} dropped a message of "
                           "{size}+ bytes in {count} frames, over the limit of {limit} bytes in "
                           "{frames} frames, and opens a new connection", endpoint=self.endpoint,
                           size=size, count=count, limit=self.limits.maxMessageBytes,
                           frames=self.limits.maxFrames)
        self.reactor.callLater(0, self._replace, self.connection, size, count)

    def _replace(self, connection: Any, size: int, count: int) -> None:
        if connection is not self.connection:  # (closed or replaced meanwhile)
            return
        why = self.core.oversized(size, count)
        self.close()
        self._reopen()
        self.receiver.connectionLost(Failure(why))

    def _reopen(self) -> None:
        self._reopening = None
        try:
            self._open()
        except Exception as e:
            delay = self.core.openFailed()
            self.throttle.warn(log, "reopen", "zmq dealer to {endpoint} cannot open a socket: "
                               "{error}; tries again in {delay:g}s", endpoint=self.endpoint,
                               error=e, delay=delay)
            self._reopening = self.reactor.callLater(delay, self._reopen)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.connection is None or not self.core.backlog and self._trySend(frames):
            return
        if not self.core.hold(frames):
            self.throttle.warn(log, "full", "zmq dealer to {endpoint} refused a message: {bytes} "
                               "bytes already wait for its pipe to drain", endpoint=self.endpoint,
                               bytes=self.core.backlogBytes)
        elif self._retry is None:
            self._retry = self.reactor.callLater(self._pacer.next(True), self._flush)

    def close(self) -> defer.Deferred[None]:
        connection, self.connection = self.connection, None
        self.core.clear()
        self._retry = cancel_call(self._retry)
        self._reopening = cancel_call(self._reopening)
        self._waiters.fire()
        if connection is not None and connection.socket is not None:
            connection.shutdown()
        return defer.succeed(None)


class ZmqPeerRouter(_RoutedSocket):
    """A ROUTER that connects to servers, each named by its endpoint."""

    connects = True

    def __init__(self, receiver: Any, reactor: Any = None, *, limits: Limits = Limits(),
                 curve: Optional[CurveClient] = None) -> None:
        self.endpoints: set[str] = set()
        self._setup("(connecting router)", receiver, default_reactor(reactor), limits)
        if curve is not None:
            curve.apply(self.connection.socket)
            self.connection.socket.setsockopt(zmq.ROUTING_ID, random_identity())

    def delivered(self, peer: bytes, frames: list[bytes]) -> None:
        if self.cut:
            self.cut.pop(peer, None)
        self.receiver.messageReceived(peer.decode("utf-8", "replace"), frames)

    def connect(self, endpoint: str) -> None:
        socket = self.connection.socket
        socket.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.encode())
        socket.connect(_address(endpoint))
        self.connection.attached()
        self.endpoints.add(endpoint)

    def sendMessage(self, endpoint: str, frames: list[bytes]) -> None:
        _RoutedSocket.sendMessage(self, endpoint.encode(), frames)

