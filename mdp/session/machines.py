"""CLIENT/SERVER sessions as pure state machines (see :mod:`mdp.machine`): the client
says HELLO with its session id on each connection, and each side resends what is not
acknowledged after a re-attach.  docs/sessions.md tells the rules."""

from __future__ import annotations

import functools
import os
from collections import OrderedDict, deque
from typing import Any, Hashable, Optional

import attrs

from mdp.errors import MDPError
from mdp.machine import Machine, action_type
from mdp.session import codec
from mdp.session.codec import MalformedSession

DEFAULT_PING_INTERVAL = 1.0
DEFAULT_LIVENESS = 3
DEFAULT_EXPIRY = 30.0
DEFAULT_MAX_QUEUED = 10_000  # messages a side keeps for resending (sent, not yet acknowledged)
ACK_EVERY = 32  # an ACK goes after this many DATA received with nothing to carry the ack
DEFAULT_MAX_SESSIONS = 10_000
#: Bytes a side keeps for resending (the transports use ``Limits.maxOutputBytes``).
DEFAULT_MAX_QUEUED_BYTES = 64 * 1024 * 1024
ROUTING_ID_BYTES = 4  # routing ids run from 1 and wrap, skipping those in use
MAX_ROUTING_ID = 2 ** (8 * ROUTING_ID_BYTES) - 1
MAX_UNATTACHED = 4096  # connections without a session a server tracks (beyond, the oldest close)


class SessionQueueFull(MDPError):
    """The session holds its limit of unacknowledged messages; nothing was queued."""


class UnknownSession(MDPError, KeyError):
    """No session has this routing id (it expired, or never was)."""


class SessionRefused(MDPError):
    """The server holds all the sessions it may; the client goes on asking."""


_action = functools.partial(action_type, __name__)
Send = _action("Send", "frames")
SendTo = _action("SendTo", "peer", "frames")
Deliver = _action("Deliver", "payload", routingId=0)  # to the application (from *routingId*, on a server)
Dropped = _action("Dropped", "seq", "reason", routingId=0)  # from the other side: over our limits
Skipped = _action("Skipped", "seq", "reason", routingId=0)  # ours went as a SKIP: over the other's limits
Notice = _action("Notice", "topic", "text", level="warn")  # for the driver's log, throttled by *topic*
Refusal = _action("Refusal", "reason")  # client: the server refused to open our session
#: client: the server's session for us ended, a new one began (what it held is lost; ours goes again)
Renewed = _action("Renewed", "reason")
Reconnect = _action("Reconnect", "reason")  # client: replace the connection; the session goes on
Opened = _action("Opened", "routingId")
Attached = _action("Attached", "routingId")
Full = _action("Full", "peer", "sessions")  # server: a HELLO opened none: *sessions*, the most, are open
Expired = _action("Expired", "routingId")  # server: the session ended (silent for the expiry)
DropPeer = _action("DropPeer", "peer", "reason")  # server: close the connection (it must not hold a slot)


def over_limits(payload: tuple[bytes, ...], limits: Optional[tuple[int, int]]) -> Optional[str]:
    """Why *payload* is over *limits* (bytes, frames; 0: not said), or None."""
    maxBytes, maxFrames = limits or (0, 0)
    if maxBytes and (size := sum(len(f) for f in payload)) > maxBytes:
        return f"{size} bytes, and it takes at most {maxBytes}"
    if maxFrames and len(payload) > maxFrames:
        return f"{len(payload)} frames, and it takes at most {maxFrames}"
    return None


def check_bounds(maxQueued: int, maxQueuedBytes: int) -> None:
    """``ValueError`` unless a side may keep at least one message and one byte."""
    for name, value in (("maxQueued", maxQueued), ("maxQueuedBytes", maxQueuedBytes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def said_limits(message: Any) -> Optional[tuple[int, int]]:
    """The limits a HELLO or WELCOME says (None: it says none)."""
    return (message.maxBytes, message.maxFrames) if message.maxBytes or message.maxFrames else None


def delivery(message: Any, refused: Optional[str], routingId: int = 0) -> Any:
    """The next DATA or SKIP: :class:`Deliver`, or :class:`Dropped` (a SKIP, or *refused*)."""
    if isinstance(message, codec.Skip):
        return Dropped(message.seq, "over this side's limits, the other side did not send it", routingId)
    if refused is None:
        return Deliver(message.payload, routingId)
    return Dropped(message.seq, f"over this side's limits ({refused}); dropped, and "
                                "acknowledged so that what follows it comes through", routingId)


class _Sequenced:
    """One side's numbering: what it sent and keeps, and what it received."""

    def __init__(self, maxQueued: int, maxQueuedBytes: int) -> None:
        check_bounds(maxQueued, maxQueuedBytes)
        self.maxQueued, self.maxQueuedBytes = maxQueued, maxQueuedBytes
        self.queuedBytes = self.sent = self.received = 0
        self.unacked: deque[tuple[int, tuple[bytes, ...]]] = deque()
        self.ackPending = 0  # DATA delivered since our last message to the other side
        self.peerLimits: Optional[tuple[int, int]] = None  # what the other side takes in one DATA
        #: our DATA sent as SKIP, not yet reported: (seq, why); and those reported, until acked
        self.skips: list[tuple[int, str]] = []
        self._skipped: set[int] = set()

    def number(self, payload: tuple[bytes, ...]) -> codec.Message:
        """Number *payload*, kept until acknowledged; :class:`SessionQueueFull` past the bounds."""
        size = sum(len(f) for f in payload)
        if len(self.unacked) >= self.maxQueued or (
                self.unacked and self.queuedBytes + size > self.maxQueuedBytes):
            raise SessionQueueFull(f"{len(self.unacked)} messages ({self.queuedBytes} bytes) already wait "
                                   "for an acknowledgement (the other side is away or slow)")
        self.sent += 1
        self.unacked.append((self.sent, payload))
        self.queuedBytes += size
        return self.data(self.sent, payload)

    @property
    def hasRoom(self) -> bool:
        """Below half the bounds (at least 1, so an empty session has room): send on."""
        return (len(self.unacked) < max(1, self.maxQueued // 2)
                and self.queuedBytes < max(1, self.maxQueuedBytes // 2))

    def data(self, seq: int, payload: tuple[bytes, ...]) -> codec.Message:
        """DATA *seq*, or a SKIP in its place if the other side would refuse it."""
        self.ackPending = 0
        why = over_limits(payload, self.peerLimits)
        if why is None:
            return codec.Data(seq, self.received, payload)
        if seq not in self._skipped:
            self._skipped.add(seq)
            self.skips.append((seq, why))
        return codec.Skip(seq, self.received)

    def acked(self, ack: int) -> None:
        while self.unacked and self.unacked[0][0] <= ack:
            seq, payload = self.unacked.popleft()
            self.queuedBytes -= sum(len(f) for f in payload)
            self._skipped.discard(seq)

    @property
    def since(self) -> int:
        """The last of our DATA the other side acknowledged (we hold the rest)."""
        return self.unacked[0][0] - 1 if self.unacked else self.sent

    def resend(self) -> list[codec.Message]:
        return [self.data(seq, payload) for seq, payload in self.unacked]

    def reportSkips(self, routingId: int = 0) -> list[Skipped]:
        skips, self.skips = self.skips, []
        return [Skipped(seq, why, routingId) for seq, why in skips]

    def accept(self, message: Any) -> str:
        """``"next"`` (deliver it), ``"old"`` (a resend: drop it) or ``"gap"``
        (some were lost with a connection that broke unseen: attach again)."""
        if message.seq <= self.received:
            return "old"
        if message.seq != self.received + 1:
            return "gap"
        self.received = message.seq
        self.ackPending += 1
        return "next"

    def ackDue(self, force: bool) -> tuple[codec.Ack, ...]:
        """The ACK to send now, if one is due (*force*: any DATA is unacknowledged)."""
        if self.ackPending >= ACK_EVERY or (force and self.ackPending):
            self.ackPending = 0
            return (codec.Ack(self.received),)
        return ()


class ClientSessionMachine(Machine):
    """The client end of one session, across any number of connections: the server is dead after
    ``pingInterval * liveness`` of silence; *limits*: what this side takes in one DATA (bytes, frames)."""

    def __init__(self, session: bytes, *, pingInterval: float = DEFAULT_PING_INTERVAL,
                 liveness: int = DEFAULT_LIVENESS, maxQueued: int = DEFAULT_MAX_QUEUED,
                 maxQueuedBytes: int = DEFAULT_MAX_QUEUED_BYTES, limits: Optional[tuple[int, int]] = None,
                 now: float = 0.0) -> None:
        super().__init__(now)
        if len(session) != codec.SESSION_ID_BYTES:
            raise ValueError(f"a session id is {codec.SESSION_ID_BYTES} bytes")
        if pingInterval <= 0 or liveness < 1:
            raise ValueError("pingInterval must be positive and liveness at least 1")
        self.session, self.pingInterval, self.liveness = session, pingInterval, liveness
        self.limits = limits or (0, 0)
        self.seq = _Sequenced(maxQueued, maxQueuedBytes)
        self.epoch = 0  # the server incarnation our received count is of (0: none yet)
        self.state = "detached"  # or "attaching", "attached"
        self.lastPing = self.lastHeard = self.helloAt = now
        self.pings = 0
        self.sentAtPing: deque[int] = deque()  # for each PING in flight, what we had sent before it

    @property
    def deadAfter(self) -> float:
        return self.pingInterval * self.liveness

    def _send(self, message: codec.Message) -> None:
        self._emit(Send(codec.encode(message)))
        if self.seq.skips:
            self._outbox.extend(self.seq.reportSkips())

    def handleConnected(self, now: float) -> list[Any]:
        self.now = self.lastHeard = now
        self.pings = 0
        self._hello()
        return self._drain()

    def handleDisconnected(self, now: float) -> list[Any]:
        self.now = now
        self.state = "detached"
        return self._drain()

    def send(self, payload: tuple[bytes, ...], now: float) -> list[Any]:
        """Queue *payload*; :class:`SessionQueueFull` beyond the limit."""
        self.now = now
        message = self.seq.number(tuple(payload))
        if self.state == "attached":
            self._send(message)
        return self._drain()

    def handleMessage(self, frames: list[bytes], now: float, refused: Optional[str] = None) -> list[Any]:
        """A message from the server; *refused*: why a DATA is over our limits."""
        self.now = now
        try:
            message = codec.decode(frames)
        except MalformedSession as e:
            self._emit(Notice("malformed", f"dropped a message from the server: {e}"))
            return self._drain()
        self.lastHeard = now
        self.pings = 0
        handler = self._handlers.get(type(message))
        if handler is not None:  # (a server never says HELLO: its ack is not read)
            if hasattr(message, "ack"):
                self.seq.acked(message.ack)  # counts our own DATA: the same in every epoch
            handler(self, message, refused)
        return self._drain()

    def _onPingOk(self, message: codec.PingOk, refused: Optional[str]) -> None:
        if not self.sentAtPing:
            return
        before = self.sentAtPing.popleft()
        if self.state == "attached" and (message.ack < before or message.sent > self.seq.received):
            # what went before the PING (or its answer) should be there by now
            self._lost(max(message.sent, self.seq.received))

    def _onUnknown(self, message: codec.Unknown, refused: Optional[str]) -> None:
        self._reattach("the server does not know this connection (it restarted, or the connection "
                       "was replaced)")

    def _onRefused(self, message: codec.Refused, refused: Optional[str]) -> None:
        if self.state == "attaching":
            self._emit(Refusal(message.reason))

    def _onWelcome(self, message: codec.Welcome, refused: Optional[str]) -> None:
        renewed = False
        if message.epoch != self.epoch:
            renewed = bool(self.epoch)
            self.epoch = message.epoch
            self.seq.received = 0
            self.seq.ackPending = 0
        self.state = "attached"
        self.seq.peerLimits = said_limits(message)
        for data in self.seq.resend():
            self._send(data)
        if renewed:  # (told after the resends: what it sends then goes after them)
            self._emit(Renewed("the server's session for this client ended; a new one began"))

    def _onData(self, message: Any, refused: Optional[str]) -> None:
        if self.state != "attached":
            return  # numbered in an epoch we do not know yet: resent after the WELCOME
        verdict = self.seq.accept(message)
        if verdict == "next":
            self._emit(delivery(message, refused))
            for ack in self.seq.ackDue(force=False):
                self._send(ack)
        elif verdict == "gap":
            self._lost(message.seq)

    _handlers = {codec.PingOk: _onPingOk, codec.Unknown: _onUnknown, codec.Refused: _onRefused,
                 codec.Welcome: _onWelcome, codec.Data: _onData, codec.Skip: _onData,
                 codec.Ack: lambda *event: None}

    def _lost(self, seq: int) -> None:
        self._reattach(f"messages were lost on the way (up to {seq}, we have {self.seq.received})")

    def _reattach(self, why: str) -> None:
        # (each HELLO makes the server resend all; else ours, or what is lost, is on its way)
        if self.now - self.helloAt >= min(self.pingInterval, 1.0):
            self._emit(Notice("reattach", f"{why}; attaching again", "info"))
            self._hello()

    def _hello(self) -> None:
        self.state = "attaching"
        self.sentAtPing.clear()
        self.helloAt = self.now
        self._send(codec.Hello(self.session, self.seq.received, self.seq.since, self.epoch, *self.limits))

    def handleTick(self, now: float) -> list[Any]:
        self.now = now
        if self.state == "detached":
            return self._drain()
        if now - self.lastHeard >= self.deadAfter:
            self.state = "detached"
            self._emit(Reconnect(f"nothing from the server in {now - self.lastHeard:.1f} s"))
        elif self.state == "attaching":
            if now - self.helloAt >= self.pingInterval:
                self._hello()
        # a PING every interval, busy or idle: its answer finds losses no later message shows
        elif now - self.lastPing >= self.pingInterval and self.pings < self.liveness:
            self.pings += 1
            self.lastPing = now
            self.sentAtPing.append(self.seq.sent)
            self.seq.ackPending = 0
            self._send(codec.Ping(self.seq.received))
        else:
            for ack in self.seq.ackDue(force=True):
                self._send(ack)
        return self._drain()


@attrs.define(eq=False)
class _Session:
    session: bytes
    routingId: int
    epoch: int
    seq: _Sequenced
    lastHeard: float
    openedBy: Optional[Hashable]  # the connection that opened it
    peer: Optional[Hashable] = None


class ServerSessionMachine(Machine):
    """The server's sessions, by session id, by connection and by routing id."""

    def __init__(self, *, expiry: float = DEFAULT_EXPIRY, maxQueued: int = DEFAULT_MAX_QUEUED,
                 maxQueuedBytes: int = DEFAULT_MAX_QUEUED_BYTES, maxSessions: int = DEFAULT_MAX_SESSIONS,
                 limits: Optional[tuple[int, int]] = None, now: float = 0.0) -> None:
        super().__init__(now)
        if expiry <= 0:
            raise ValueError("expiry must be positive")
        check_bounds(maxQueued, maxQueuedBytes)
        self.expiry, self.maxSessions = expiry, maxSessions
        self.limits = limits or (0, 0)
        self.maxQueued, self.maxQueuedBytes = maxQueued, maxQueuedBytes
        self.sessions: dict[bytes, _Session] = {}
        self.byPeer: dict[Hashable, _Session] = {}
        self.byRouting: dict[int, _Session] = {}
        self._routingIds = 0
        self._told: OrderedDict[Hashable, float] = OrderedDict()  # when each was last told UNKNOWN
        self._opened: dict[Hashable, _Session] = {}  # the session each connection opened
        self._unattached: OrderedDict[Hashable, float] = OrderedDict()  # since when, without one

    def _sendTo(self, session: _Session, message: codec.Message) -> None:
        if session.peer is not None:
            self._emit(SendTo(session.peer, codec.encode(message)))
        if session.seq.skips:
            self._outbox.extend(session.seq.reportSkips(session.routingId))

    def handleMessage(self, peer: Hashable, frames: list[bytes], now: float,
                      refused: Optional[str] = None) -> list[Any]:
        """A message from *peer*; *refused*: why a DATA is over our limits."""
        self.now = now
        try:
            message = codec.decode(frames)
        except MalformedSession as e:
            self._drop(peer, f"not a session message: {e}")
            return self._drain()
        session = self.byPeer.get(peer)
        if isinstance(message, codec.Hello):
            self._attach(peer, message)
        elif session is None:
            self._withoutSession(peer, codec.Unknown())
        else:
            session.lastHeard = now
            handler = self._handlers.get(type(message))
            if handler is not None:  # (a client never says WELCOME: its ack is not read)
                session.seq.acked(message.ack)  # (every message a server handles has one)
                handler(self, session, message, refused)
        return self._drain()

    def _onPing(self, session: _Session, message: codec.Ping, refused: Optional[str]) -> None:
        self._sendTo(session, codec.PingOk(session.seq.received, session.seq.sent))
        session.seq.ackPending = 0

    def _onData(self, session: _Session, message: Any, refused: Optional[str]) -> None:
        verdict = session.seq.accept(message)
        if verdict == "next":
            self._emit(delivery(message, refused, session.routingId))
            for ack in session.seq.ackDue(force=False):
                self._sendTo(session, ack)
        elif verdict == "gap" and self._mayTell(session.peer):
            self._sendTo(session, codec.Unknown())

    _handlers = {codec.Ping: _onPing, codec.Data: _onData, codec.Skip: _onData,
                 codec.Ack: lambda *event: None}

    def _withoutSession(self, peer: Hashable, answer: codec.Message) -> None:
        """Track *peer*, which has no session (the tick closes it after the expiry); *answer* it."""
        unattached = self._unattached
        if peer not in unattached:
            unattached[peer] = self.now
            if len(unattached) > MAX_UNATTACHED:
                oldest = next(iter(unattached))
                self._drop(oldest, f"more than {MAX_UNATTACHED} connections without a session")
        if self._mayTell(peer):
            self._emit(SendTo(peer, codec.encode(answer)))

    def _newRoutingId(self) -> int:
        while True:
            self._routingIds = self._routingIds % MAX_ROUTING_ID + 1
            if self._routingIds not in self.byRouting:
                return self._routingIds

    def _mayTell(self, peer: Hashable) -> bool:
        """At most one UNKNOWN or REFUSED a second to a connection (each draws a HELLO)."""
        if self.now - self._told.get(peer, float("-inf")) < 1.0:
            return False
        self._told[peer] = self.now
        self._told.move_to_end(peer)
        while len(self._told) > 1024:
            self._told.popitem(last=False)
        return True

    def end(self, routingId: int, now: float) -> list[Any]:
        """End the session *routingId* (it cannot hold what it is given): :class:`Expired`."""
        self.now = now
        session = self.byRouting.get(routingId)
        if session is not None:
            self._end(session, "it could not hold what it was given")
        return self._drain()

    def _end(self, session: _Session, why: str, drop: bool = True) -> None:
        """Forget *session*, report it :class:`Expired`; with *drop*, close its connection."""
        del self.sessions[session.session]
        del self.byRouting[session.routingId]
        if session.peer is not None and self.byPeer.get(session.peer) is session:
            del self.byPeer[session.peer]
            if drop:
                self._drop(session.peer, f"its session {session.routingId} ended: {why}")
        if self._opened.get(session.openedBy) is session:
            del self._opened[session.openedBy]
        self._emit(Expired(session.routingId))

    def _drop(self, peer: Hashable, reason: str) -> None:
        self._unattached.pop(peer, None)
        self._told.pop(peer, None)
        self._emit(DropPeer(peer, reason))

    def _attach(self, peer: Hashable, hello: codec.Hello) -> None:
        session = self.sessions.get(hello.session)
        held = self.byPeer.get(peer)
        if held is not None and held is not session:
            # else one client, with a second connection's help, would hold any number
            self._emit(Notice("second", f"{peer!r} attached another session; the one it held "
                                        f"({held.routingId}) ends (one session per connection)"))
            self._end(held, "another was attached on its connection", drop=False)
        if session is None:
            session = self._open(peer, hello)
            if session is None:
                return
        if session.peer is not None and session.peer != peer:
            self.byPeer.pop(session.peer, None)
            self._drop(session.peer, f"its session {session.routingId} moved to another connection")
        self._unattached.pop(peer, None)
        session.peer = peer
        session.lastHeard = self.now
        self.byPeer[peer] = session
        session.seq.peerLimits = said_limits(hello)
        if hello.epoch == session.epoch:
            session.seq.acked(hello.ack)  # an ack of another incarnation means nothing here
        if hello.since > session.seq.received:
            self._emit(Notice("since", f"session {session.routingId} from {peer!r} holds nothing before "
                                       f"{hello.since + 1}, but we have only {session.seq.received + 1}: "
                                       "those are lost"))
            session.seq.received = hello.since
        self._emit(Attached(session.routingId))
        self._sendTo(session, codec.Welcome(session.seq.received, session.epoch, *self.limits))
        for data in session.seq.resend():
            self._sendTo(session, data)

    def _open(self, peer: Hashable, hello: codec.Hello) -> Optional[_Session]:
        """A new session for *hello*, or None (REFUSED) at *maxSessions*."""
        earlier = self._opened.get(peer)
        if earlier is not None and earlier.peer is None:
            self._emit(Notice("second", f"{peer!r} opened another session; the one it opened before "
                                        f"({earlier.routingId}) ends (one session per connection)"))
            self._end(earlier, "its connection opened another", drop=False)
        if len(self.sessions) >= self.maxSessions:
            self._emit(Full(peer, len(self.sessions)))
            self._withoutSession(peer, codec.Refused(
                f"the server holds {len(self.sessions)} sessions, all it may (maxSessions)"))
            return None
        session = _Session(hello.session, self._newRoutingId(), int.from_bytes(os.urandom(8), "big") or 1,
                           _Sequenced(self.maxQueued, self.maxQueuedBytes), self.now, peer)
        self._opened[peer] = session
        # the client numbers on from its earlier session (with a server that is gone)
        session.seq.received = hello.since
        self.sessions[hello.session] = session
        self.byRouting[session.routingId] = session
        self._emit(Opened(session.routingId))
        return session

    def reply(self, routingId: int, payload: tuple[bytes, ...], now: float) -> list[Any]:
        """Send *payload* to *routingId*; :class:`UnknownSession`, :class:`SessionQueueFull`."""
        self.now = now
        session = self.byRouting.get(routingId)
        if session is None:
            raise UnknownSession(routingId)
        self._sendTo(session, session.seq.number(tuple(payload)))
        return self._drain()

    def handlePeerGone(self, peer: Hashable, now: float) -> list[Any]:
        self.now = now
        session = self.byPeer.pop(peer, None)
        if session is not None:
            session.peer = None
        self._opened.pop(peer, None)
        self._unattached.pop(peer, None)
        return self._drain()

    def handleTick(self, now: float) -> list[Any]:
        self.now = now
        unattached = self._unattached
        while unattached:
            peer, since = next(iter(unattached.items()))
            if now - since < self.expiry:
                break
            self._drop(peer, f"no session attached within {self.expiry:g}s")
        for session in list(self.sessions.values()):
            if now - session.lastHeard >= self.expiry:
                self._end(session, f"silent for {self.expiry:g}s")
                continue
            for ack in session.seq.ackDue(force=True):
                self._sendTo(session, ack)
        return self._drain()
