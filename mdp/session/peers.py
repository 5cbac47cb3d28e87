"""Sessions for programs that speak their own messages (MDP uses ``session+`` endpoints)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp.errors import ClientClosed
from mdp.interfaces import DealerReceiver, IRouterReceiver
from mdp.messages import bytes_frames
from mdp.policy import Limits, default_reactor
from mdp.session import machines
from mdp.session.transport import PREFIX, SessionDealer, SessionRouter, routing_id
from mdp.transport.flow import DrainWaiters

log = Logger()


def session_endpoint(endpoint: str) -> str:
    """*endpoint* with ``session+`` in front, if it has not."""
    return endpoint if endpoint.startswith(PREFIX) else PREFIX + endpoint


class SessionClient(DealerReceiver):
    """One session to a server at *endpoint* (``tcp:host=H:port=P``, ``zmq:tcp://H:P``).
    ``send(*frames)`` never waits: while the connection is down the message waits in the
    session (beyond *maxQueued*: :class:`~mdp.session.SessionQueueFull`).  *onRenewed()*
    hears when the server's session for us was renewed (what it held for us is lost); the
    other *options* (*pingInterval*, *liveness*, *maxQueued*, *limits*) are the dealer's."""

    def __init__(self, endpoint: str, reactor: Optional[Any] = None, *,
                 onRenewed: Optional[Callable[[], Any]] = None, **options: Any) -> None:
        self.reactor = default_reactor(reactor)
        self.onRenewed = onRenewed
        self._callbacks: list[Callable[[list[bytes]], Any]] = []
        self._waiting = DrainWaiters()
        self.dealer = SessionDealer(session_endpoint(endpoint), self, self.reactor, **options)

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

    def sessionRenewed(self) -> None:
        if self.onRenewed is not None:
            self.onRenewed()

    def messageReceived(self, frames: list[bytes]) -> None:
        for callback in list(self._callbacks):
            try:
                callback(frames)
            except Exception:
                log.failure("session client to {endpoint}: the subscriber {callback!r} raised",
                            endpoint=self.dealer.endpoint, callback=callback)


@implementer(IRouterReceiver)
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
        self.options = {"expiry": expiry, "maxQueued": maxQueued, "maxSessions": maxSessions}
        self.limits = limits
        self.router: Optional[SessionRouter] = None

    async def listen(self, endpoint: str) -> str:
        """Bind *endpoint*; returns the endpoint clients connect to."""
        from mdp import transport

        full = session_endpoint(endpoint)
        transport.check(full, transport.LISTEN)
        self.router = await SessionRouter.listen(full, self, self.reactor, self.limits, **self.options)
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
