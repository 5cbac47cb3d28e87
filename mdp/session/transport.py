"""Sessions as a transport: ``session+`` and an inner endpoint (``tcp:``, ``zmq:``, ``loopback:``).

:class:`SessionDealer` reports ``connectionMade`` once, at the first attach, and re-attaches by itself
(its receiver may have ``sessionRenewed()`` and ``sessionRefused(reason)``); :class:`SessionRouter`
names each session by a 4-byte routing id and reports ``peerDisconnected`` when it expires.
:class:`SessionClient` and :class:`SessionServer` serve programs that speak their own messages."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

import attrs
from twisted.internet import defer, task
from twisted.logger import Logger
from zope.interface import implementer

from mdp import interfaces
from mdp.errors import ClientClosed, OversizedMessage, ReplyTooLarge, RequestTooLarge, TransportError
from mdp.messages import bytes_frames
from mdp.policy import PIRATE, RECONNECT, Backoff, Limits, LogThrottle, cancel_call, default_reactor
from mdp.session import machines
from mdp.session.codec import DATA as DATA_COMMAND
from mdp.session.codec import PROTOCOL
from mdp.transport.flow import DrainWaiters, after

log = Logger()

PREFIX = "session+"
OVERHEAD_FRAMES = 4  # what the session protocol adds to a message: frames, and bytes at most
OVERHEAD_BYTES = 64


def inner_endpoint(endpoint: str) -> str:
    """``session+tcp:host=h:port=1`` → ``tcp:host=h:port=1``."""
    if not endpoint.startswith(PREFIX):
        raise TransportError(f"bad endpoint {endpoint!r}: a session endpoint starts with "
                             f"{PREFIX!r}, e.g. session+tcp:host=127.0.0.1:port=5555")
    return endpoint[len(PREFIX):]


def bounded_attempts(endpoint: str, seconds: float) -> str:
    """*endpoint* with attempts bounded by *seconds* unless it says a ``timeout`` (30 s outlasts expiry)."""
    kind, _, rest = endpoint.partition(":")
    if kind != "tcp" or any(part.startswith("timeout=") for part in rest.split(":")):
        return endpoint
    return f"{endpoint}:timeout={max(1, math.ceil(seconds))}"


def inner_limits(limits: Limits) -> Limits:
    """Room for the session's frames, and twice the output room: a full resend always fits."""
    return attrs.evolve(limits, maxMessageBytes=limits.maxMessageBytes + OVERHEAD_BYTES,
                        maxFrames=limits.maxFrames + OVERHEAD_FRAMES,
                        maxOutputBytes=2 * limits.maxOutputBytes + OVERHEAD_BYTES)


def payload_limits(limits: Limits) -> tuple[int, int]:
    return limits.maxMessageBytes, limits.maxFrames


def routing_bytes(routingId: int) -> bytes:
    return routingId.to_bytes(machines.ROUTING_ID_BYTES, "big")


def routing_id(peer: bytes) -> int:
    return int.from_bytes(peer, "big")


class _End:
    """What both ends share: a tick, an inner transport, limits and logging."""

    machine: Any
    title = ""
    dropped = 0  # messages lost as over our limits
    skipped = 0  # ours sent as SKIPs

    def __init__(self, receiver: Any, reactor: Any, limits: Limits, endpoint: str) -> None:
        self.receiver, self.reactor, self.limits, self.endpoint = receiver, reactor, limits, endpoint
        self.inner: Any = None
        self.throttle = LogThrottle(reactor)
        self.tick = task.LoopingCall(self._tick)
        self.tick.clock = reactor

    def _now(self) -> float:
        return self.reactor.seconds()

    def _tick(self) -> None:
        self._perform(self.machine.handleTick(self._now()))

    def _perform(self, actions: list[Any]) -> None:
        for action in actions:
            self._performers[type(action)](self, action)

    def _overLimits(self, frames: list[bytes]) -> Optional[str]:
        """Why the DATA *frames* is over our limits (None if not, or not DATA)."""
        if len(frames) >= 4 and frames[1] == DATA_COMMAND and frames[0] == PROTOCOL:
            return self.limits.refuse(frames[4:])
        return None

    def _sendable(self, frames: Any, peerLimits: Optional[tuple[int, int]], other: str,
                  error: type[Exception], where: str) -> tuple[bytes, ...]:
        """*frames* copied, to keep and send to *where*; *error* if over our limits or *peerLimits*."""
        reason = self.limits.refuse(frames)
        if reason is None:
            why = machines.over_limits(frames, peerLimits)
            reason = None if why is None else f"{other} takes no message of {why}"
        if reason is not None:
            raise error(f"not sent to {where}: {reason}")
        for index, frame in enumerate(frames):
            if not isinstance(frame, (bytes, bytearray, memoryview)):
                raise TypeError(f"frame {index} is {type(frame).__name__}, not bytes")
        return tuple(frame if frame.__class__ is bytes else bytes(frame) for frame in frames)

    def _tell(self, method: str, *args: Any) -> None:
        """Call the receiver's *method*, if it has one, logging what it raises."""
        try:
            getattr(self.receiver, method, lambda *args: None)(*args)
        except Exception:
            log.failure("{end}: {what} raised", end=self._name(), what=method)

    def _say(self, topic: str, format: str, level: str = "warn", **fields: Any) -> None:
        """Log *format* with *fields* (and ``end``), throttled by *topic*."""
        self.throttle.log(level, log, topic, "{end}: " + format, end=self._name(), **fields)

    def _dropped(self, action: machines.Dropped) -> None:
        self.dropped += 1
        self._say("dropped", "message {seq}{of} from the other side is lost: {reason}", seq=action.seq,
                  reason=action.reason, of=f" of session {action.routingId}" if action.routingId else "")

    def _skipped(self, action: machines.Skipped) -> None:
        self.skipped += 1
        self._say("skipped", "message {seq}{to} is over the limits the other side said ({reason}); a SKIP "
                  "goes in its place: it is lost, and what follows it goes through", seq=action.seq,
                  reason=action.reason, to=f" to session {action.routingId}" if action.routingId else "")

    def _notice(self, action: machines.Notice) -> None:
        self._say(action.topic, "{text}", action.level, text=action.text)

    _performers = {machines.Dropped: _dropped, machines.Skipped: _skipped, machines.Notice: _notice}

    def _name(self) -> str:
        return f"{self.title} {self.endpoint}"

    def _shutdown(self) -> defer.Deferred[None]:
        if self.tick.running:
            self.tick.stop()
        return self._closeInner()

    def _closeInner(self) -> defer.Deferred[None]:
        inner, self.inner = self.inner, None
        return inner.close() if inner is not None else defer.succeed(None)


@implementer(interfaces.IRouterReceiver, interfaces.IRouterTransport)
class SessionRouter(_End):
    """A bound session server: connections come and go, sessions stay until they expire."""

    title = "session router at"

    def __init__(self, receiver: interfaces.IRouterReceiver, reactor: Any, *, limits: Limits = Limits(),
                 expiry: float = machines.DEFAULT_EXPIRY, maxQueued: int = machines.DEFAULT_MAX_QUEUED,
                 maxSessions: int = machines.DEFAULT_MAX_SESSIONS) -> None:
        super().__init__(receiver, reactor, limits, "")
        self.machine = machines.ServerSessionMachine(
            expiry=expiry, maxQueued=maxQueued, maxSessions=maxSessions,
            maxQueuedBytes=limits.maxOutputBytes, limits=payload_limits(limits), now=reactor.seconds())
        self.attaches = self.refused = 0  # HELLOs that attached, and those refused at maxSessions

    @classmethod
    @defer.inlineCallbacks
    def listen(cls, endpoint: str, receiver: interfaces.IRouterReceiver, reactor: Any,
               limits: Limits = Limits(), **options: Any) -> Any:
        from mdp import transport

        self = cls(receiver, reactor, limits=limits, **options)
        self.inner = yield transport.listen(inner_endpoint(endpoint), self, reactor,
                                            limits=inner_limits(limits))
        self.endpoint = PREFIX + self.inner.endpoint
        self.tick.start(min(0.5, self.machine.expiry / 4), now=False)
        return self

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self._perform(self.machine.handleMessage(peer, frames, self._now(), refused=self._overLimits(frames)))

    def peerDisconnected(self, peer: bytes) -> None:
        self._perform(self.machine.handlePeerGone(peer, self._now()))

    def _sendTo(self, action: machines.SendTo) -> None:
        if self.inner is not None:
            self.inner.sendMessage(action.peer, action.frames)

    def _deliver(self, action: machines.Deliver) -> None:
        self._tell("messageReceived", routing_bytes(action.routingId), list(action.payload))

    def _expired(self, action: machines.Expired) -> None:
        self._tell("peerDisconnected", routing_bytes(action.routingId))

    def _dropPeer(self, action: machines.DropPeer) -> None:
        if self.inner is not None:
            self._say("drop", "closed a connection: {reason}", "info", reason=action.reason)
            self.inner.disconnectPeer(action.peer)

    def _attached(self, action: machines.Attached) -> None:
        self.attaches += 1

    def _full(self, action: machines.Full) -> None:
        self.refused += 1
        self._say("full", "refused a new session from {peer!r}: {count} already (maxSessions)",
                  peer=action.peer, count=action.sessions)

    _performers = {**_End._performers, machines.SendTo: _sendTo, machines.Deliver: _deliver,
                   machines.Expired: _expired, machines.DropPeer: _dropPeer, machines.Full: _full,
                   machines.Opened: lambda self, action: None, machines.Attached: _attached}

    def reply(self, routingId: int, frames: Any) -> None:
        """Send *frames* to *routingId*; ReplyTooLarge, UnknownSession, SessionQueueFull."""
        session = self.machine.byRouting.get(routingId)
        kept = self._sendable(frames, None if session is None else session.seq.peerLimits,
                              "the session's client", ReplyTooLarge, f"session {routingId}")
        self._perform(self.machine.reply(routingId, kept, self._now()))

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        try:
            self.reply(routing_id(peer), frames)
        except ReplyTooLarge as e:
            self._say("too large", "{error}", error=e)
        except machines.UnknownSession:
            pass  # as a ROUTER drops what it cannot route
        except machines.SessionQueueFull as e:
            # a hole would be worse: the session ends, its Expired (the last action) reported a turn
            # later (we are in the app's call)
            self._say("full", "session {session} ends: {error}", session=routing_id(peer), error=e)
            actions = self.machine.end(routing_id(peer), self._now())
            self._perform(actions[:-1])
            self.reactor.callLater(0, self._perform, actions[-1:])

    def disconnectPeer(self, peer: bytes) -> None:
        """A session has no connection to drop: it ends when it expires."""

    def close(self) -> defer.Deferred[None]:
        """Stop listening; the sessions end, and what they hold is lost (warned about)."""
        held = [len(s.seq.unacked) for s in self.machine.sessions.values() if s.seq.unacked]
        if self.inner is not None and held:
            log.warn("{end} closed with {count} message(s) to {sessions} session(s) not acknowledged "
                     "by their clients: they are lost", end=self._name(), count=sum(held), sessions=len(held))
        return self._shutdown()


@implementer(interfaces.IDealerTransport)
class SessionDealer(_End):
    """The client end of a session; it re-attaches after every break."""

    title = "session dealer to"

    def __init__(self, endpoint: str, receiver: interfaces.IDealerReceiver, reactor: Any, *,
                 retryPolicy: Any = None, pingInterval: float = machines.DEFAULT_PING_INTERVAL,
                 liveness: int = machines.DEFAULT_LIVENESS, maxQueued: int = machines.DEFAULT_MAX_QUEUED,
                 backoff: Backoff = PIRATE, limits: Limits = Limits()) -> None:
        super().__init__(receiver, reactor, limits, endpoint)
        self.retryPolicy = retryPolicy
        self.machine = machines.ClientSessionMachine(
            os.urandom(16), pingInterval=pingInterval, liveness=liveness, maxQueued=maxQueued,
            maxQueuedBytes=limits.maxOutputBytes, limits=payload_limits(limits), now=reactor.seconds())
        self.innerEndpoint = bounded_attempts(inner_endpoint(endpoint), self.machine.deadAfter)
        self.backoff, self.attempts = backoff, 0
        self.oversizedLosses = 0  # attaches that ended on a message over our limits since one came through
        self.reopening: Any = None
        self._waiters = DrainWaiters()
        self.madeOnce = self.closed = False
        self._open()
        self.tick.start(pingInterval / 4, now=False)

    def discardReceived(self) -> int:
        """Nothing: a session delivers all it numbers."""
        return 0

    def _open(self) -> None:
        from mdp import transport

        self.reopening = None
        if self.closed:
            return
        receiver = _Inner(self)
        try:
            self.inner = receiver.transport = transport.connect(self.innerEndpoint, receiver, self.reactor,
                retryPolicy=self._innerRetry, limits=inner_limits(self.limits))
        except Exception as e:  # out of sockets, ...: try again later, never stop
            self._say("open", "cannot connect: {error}", error=e)
            self._reopen()

    def _innerRetry(self, attempt: int) -> float:
        """The delay before *attempt*, at most ``pingInterval * liveness`` (within the expiry)."""
        if self.retryPolicy is None:
            return RECONNECT.delay(max(attempt - 1, 0), self.machine.deadAfter)
        return min(self.retryPolicy(attempt), self.machine.deadAfter)

    def _oversized(self, why: OversizedMessage) -> None:
        """The connection closed on a message over our limits, resent at each attach: back off."""
        delay = self.backoff.delay(self.oversizedLosses, self.machine.deadAfter)
        self.oversizedLosses += 1
        self._say("oversized", "a message from the server is over this side's limits ({reason}); it is "
                  "resent at each attach, so nothing after it can be received until the limits "
                  "agree; attaching again in {delay:g}s", reason=why, delay=delay)
        self._closeInner()
        self._perform(self.machine.handleDisconnected(self._now()))
        cancel_call(self.reopening)
        self._reopen(delay)

    def _reopen(self, delay: Optional[float] = None) -> None:
        """A new connection after *delay*, or a backoff of at most ``pingInterval * liveness``."""
        if delay is None:
            delay = self.backoff.delay(self.attempts, self.machine.deadAfter)
            self.attempts += 1
        self.reopening = None if self.closed else self.reactor.callLater(delay, self._open)

    @property
    def writable(self) -> bool:
        """False while half the session's bounds are unacknowledged: wait on :meth:`drained`."""
        return self.machine.seq.hasRoom and getattr(self.inner, "writable", True)  # (None: True)

    @property
    def connected(self) -> bool:
        """True from the first attach until closed."""
        return self.madeOnce and not self.closed

    def drained(self) -> defer.Deferred[None]:
        return defer.succeed(None) if self.writable or self.closed else self._waiters.wait()

    def _perform(self, actions: list[Any]) -> None:
        super()._perform(actions)
        if self.machine.state == "attached":
            self.attempts = 0
            if not self.madeOnce and not self.closed:
                self.madeOnce = True
                self._tell("connectionMade")
        if self.writable:
            self._waiters.fire()

    def _send(self, action: machines.Send) -> None:
        if self.inner is not None:
            self.inner.sendMessage(action.frames)

    def _deliver(self, action: machines.Deliver) -> None:
        self.oversizedLosses = 0
        self._tell("messageReceived", list(action.payload))

    def _refused(self, action: machines.Refusal) -> None:
        self._say("refused", "the server refused the session: {reason}; asking again", reason=action.reason)
        self._tell("sessionRefused", action.reason)

    def _renewed(self, action: machines.Renewed) -> None:
        log.warn("{end}: the server's session for this client ended (it expired, was ended as full, or "
                 "the server restarted) and a new one began: messages the server held for this client "
                 "and had not delivered are lost; those this client sent that the server had not "
                 "acknowledged are sent again, so the server may get one twice", end=self._name())
        self.oversizedLosses = 0  # what stalled the old session is gone with it
        self._tell("sessionRenewed")

    def _reconnect(self, action: machines.Reconnect) -> None:
        log.info("{end}: {reason}; connecting again", end=self._name(), reason=action.reason)
        self._closeInner()
        if self.reopening is None:
            self._reopen()

    _performers = {**_End._performers, machines.Send: _send, machines.Deliver: _deliver,
                   machines.Refusal: _refused, machines.Renewed: _renewed, machines.Reconnect: _reconnect}

    def send(self, frames: list[bytes]) -> None:
        """Send *frames*; SessionQueueFull, RequestTooLarge or ``TypeError``: nothing queued."""
        if self.closed:
            raise TransportError(f"the session to {self.endpoint} is closed")
        kept = self._sendable(frames, self.machine.seq.peerLimits, "the server", RequestTooLarge,
                              self.endpoint)
        self._perform(self.machine.send(kept, self._now()))

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.closed:
            return
        try:
            self.send(frames)
        except (machines.SessionQueueFull, RequestTooLarge) as e:
            self._say("full", "refused a message: {error}", error=e)

    CLOSE_GRACE = 1.0  # seconds a close waits for the server's acknowledgement (of a worker's DISCONNECT)

    _closing: Optional[defer.Deferred[None]] = None

    def close(self) -> defer.Deferred[None]:
        """Close, after up to :attr:`CLOSE_GRACE` for the server's acknowledgement."""
        if self._closing is None:
            self.closed = True  # (sends refused; what comes in is still read)
            deadline = self._now() + self.CLOSE_GRACE

            def check() -> Any:
                if self.machine.seq.unacked and self.machine.state == "attached" and self._now() < deadline:
                    return task.deferLater(self.reactor, 0.05, check)
                if self.machine.seq.unacked:
                    log.warn("{end} closed with {count} messages not acknowledged by the server",
                             end=self._name(), count=len(self.machine.seq.unacked))
                self.reopening = cancel_call(self.reopening)
                self._waiters.fire()
                return self._shutdown()

            self._closing = defer.maybeDeferred(check)
        return after(self._closing)


@implementer(interfaces.IDealerReceiver)
class _Inner:
    """Receives for one inner connection; ignored once it is replaced."""

    def __init__(self, owner: SessionDealer) -> None:
        self.owner = owner
        self.transport: Any = None

    def _current(self) -> bool:
        return self.transport is not None and self.owner.inner is self.transport

    def connectionMade(self) -> None:
        if self._current():
            self.owner._perform(self.owner.machine.handleConnected(self.owner._now()))

    def messageReceived(self, frames: list[bytes]) -> None:
        if self._current():
            owner = self.owner
            owner._perform(owner.machine.handleMessage(frames, owner._now(),
                                                       refused=owner._overLimits(frames)))

    def connectionLost(self, reason: object) -> None:
        if self._current():
            owner = self.owner
            why = getattr(reason, "value", None)
            if isinstance(why, OversizedMessage):
                owner._oversized(why)
            else:
                owner._perform(owner.machine.handleDisconnected(owner._now()))


def check(endpoint: str, role: str) -> None:
    """A session endpoint is ``session+`` and a non-session endpoint."""
    from mdp import transport

    inner = inner_endpoint(endpoint)
    if inner.startswith(PREFIX):
        raise TransportError(f"bad endpoint {endpoint!r}: one session layer is enough")
    transport.check(inner, role)


listen = SessionRouter.listen


def connect(endpoint: str, receiver: Any, reactor: Any, limits: Limits, retryPolicy: Any,
            identity: Optional[bytes]) -> Any:
    return SessionDealer(endpoint, receiver, reactor, limits=limits, retryPolicy=retryPolicy)


def session_endpoint(endpoint: str) -> str:
    """*endpoint* with ``session+`` in front, if it has not."""
    return endpoint if endpoint.startswith(PREFIX) else PREFIX + endpoint


class SessionClient(interfaces.DealerReceiver):
    """One session to a server at *endpoint* (``tcp:host=H:port=P``, ``zmq:tcp://H:P``).
    ``send(*frames)`` never waits: while the connection is down the message waits in the
    session (beyond *maxQueued*: :class:`~mdp.session.SessionQueueFull`).  *onRenewed()*
    hears when the server's session for us was renewed (what it held for us is lost); the
    other *options* (*pingInterval*, *liveness*, *maxQueued*, *limits*) are the dealer's."""

    def __init__(self, endpoint: str, reactor: Optional[Any] = None, *,
                 onRenewed: Optional[Callable[[], Any]] = None, **options: Any) -> None:
        self.reactor = default_reactor(reactor)
        self._callbacks: list[Callable[[list[bytes]], Any]] = []
        self._waiting = DrainWaiters()
        self.dealer = SessionDealer(session_endpoint(endpoint), self, self.reactor, **options)
        if onRenewed is not None:  # (the dealer calls its receiver's sessionRenewed, if it has one)
            self.sessionRenewed = onRenewed

    def attached(self) -> defer.Deferred[None]:
        """Fires once the session is first attached; fails with
        :class:`~mdp.session.SessionRefused` or :class:`~mdp.errors.ClientClosed`."""
        if self.dealer.closed:
            return defer.fail(ClientClosed("the session client is closed"))
        return defer.succeed(None) if self.dealer.madeOnce else self._waiting.wait()

    def subscribe(self, callback: Callable[[list[bytes]], Any]) -> None:
        """Call *callback(frames)* for every message from the server, in order, once."""
        self._callbacks.append(callback)

    def send(self, *frames: bytes) -> None:
        self.dealer.send(bytes_frames(frames))

    def close(self) -> defer.Deferred[None]:
        if not self.dealer.closed:
            self._waiting.fail(ClientClosed("the session client was closed before it attached"))
        return self.dealer.close()

    def connectionMade(self) -> None:
        self._waiting.fire()

    def sessionRefused(self, reason: str) -> None:
        self._waiting.fail(machines.SessionRefused(reason))

    def messageReceived(self, frames: list[bytes]) -> None:
        for callback in list(self._callbacks):
            try:
                callback(frames)
            except Exception:
                log.failure("session client to {endpoint}: the subscriber {callback!r} raised",
                            endpoint=self.dealer.endpoint, callback=callback)


@implementer(interfaces.IRouterReceiver)
class SessionServer:
    """Sessions behind one bound endpoint, each known by an ``int`` routing id:
    *handler(routingId, frames)* hears every message, in order, once;
    *onExpired(routingId)* hears of sessions silent for *expiry* seconds."""

    def __init__(self, handler: Callable[[int, list[bytes]], Any], reactor: Optional[Any] = None,
                 *, expiry: float = machines.DEFAULT_EXPIRY, onExpired: Optional[Callable[[int], Any]] = None,
                 maxQueued: int = machines.DEFAULT_MAX_QUEUED,
                 maxSessions: int = machines.DEFAULT_MAX_SESSIONS, limits: Limits = Limits()) -> None:
        if expiry <= 0:
            raise ValueError(f"expiry must be positive, got {expiry}")
        machines.check_bounds(maxQueued, limits.maxOutputBytes)
        self.reactor = default_reactor(reactor)
        self.handler, self.onExpired = handler, onExpired
        self.options = dict(expiry=expiry, maxQueued=maxQueued, maxSessions=maxSessions, limits=limits)
        self.router: Optional[SessionRouter] = None

    async def listen(self, endpoint: str) -> str:
        """Bind *endpoint*; returns the endpoint clients connect to."""
        from mdp import transport

        full = session_endpoint(endpoint)
        transport.check(full, transport.LISTEN)
        self.router = await SessionRouter.listen(full, self, self.reactor, **self.options)
        return self.router.endpoint

    def reply(self, routingId: int, *frames: bytes) -> None:
        """Send *frames* to *routingId* (kept until the client has it); UnknownSession,
        SessionQueueFull, ReplyTooLarge."""
        if self.router is None:
            raise machines.UnknownSession(routingId)
        self.router.reply(routingId, bytes_frames(frames))

    def close(self) -> defer.Deferred[None]:
        """Stop listening; the sessions end with it."""
        router, self.router = self.router, None
        return router.close() if router is not None else defer.succeed(None)

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.handler(routing_id(peer), frames)

    def peerDisconnected(self, peer: bytes) -> None:
        if self.onExpired is not None:
            self.onExpired(routing_id(peer))
