"""SP REQ/REP over TCP, wire-compatible with nng: :class:`SPClient` (REQ),
:class:`SPServer` (REP) and :class:`SPDevice`.  Endpoints are nng URLs
(``tcp://127.0.0.1:5555``; port 0: the OS picks) or Twisted endpoint strings.
"""

from __future__ import annotations

import functools
import secrets
from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp import transport
from mdp.errors import ClientClosed
from mdp.interfaces import IDealerReceiver, IRouterReceiver
from mdp.messages import as_frame
from mdp.policy import Backoff, Limits, LogThrottle, call_at, cancel_call, default_reactor
from mdp.sp import machines
from mdp.sp.codec import DEFAULT_MAX_HOPS, endpoint_of
from mdp.transport.spframing import REP, REQ, SPFraming
from mdp.transport.stream import StreamDealer, StreamRouter

log = Logger()


random_id = functools.partial(secrets.randbits, 31)  # a random 31-bit id


@implementer(IDealerReceiver)
class _Pipe:
    """One connection a REQ side dials, of an :class:`SPClient` or an :class:`SPDevice`."""

    def __init__(self, owner: Union[SPClient, SPDevice], url: str) -> None:
        self.owner, self.url = owner, url
        self.transport: Any = None

    def connectionMade(self) -> None:
        self.owner._channel(self, True)

    def connectionLost(self, reason: object) -> None:
        self.owner._channel(self, False)

    def messageReceived(self, frames: list[bytes]) -> None:
        self.owner._reply(self, frames[0])


@implementer(IRouterReceiver)
class _Listener:
    """One listening endpoint of an :class:`SPServer` or an :class:`SPDevice`."""

    def __init__(self, owner: _Side) -> None:
        self.owner = owner
        self.transport: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        owner = self.owner
        owner._perform(owner.machine.handleRequest((self, peer), frames[0], owner._now()))

    def peerDisconnected(self, peer: bytes) -> None:
        self.owner.machine.handleChannelDown((self, peer), self.owner._now())


class _Side:
    """What the SP peers share: a machine, its clock, listeners and dialed pipes."""

    machine: Any

    def __init__(self, reactor: Any, limits: Limits) -> None:
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.throttle = LogThrottle(self.reactor)
        self.routers: list[StreamRouter] = []
        self.pipes: list[_Pipe] = []

    def _now(self) -> float:
        return self.reactor.seconds()

    def _dial(self, endpoints: Union[str, Sequence[str]], none: str, backoff: Backoff) -> None:
        """A :class:`_Pipe` dialing each of *endpoints* as a REQ; ``ValueError(none)`` for none."""
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not urls:
            raise ValueError(none)
        for url, dial in [(url, endpoint_of(url, listen=False)) for url in urls]:
            pipe = _Pipe(self, url)  # type: ignore[arg-type]
            pipe.transport = StreamDealer(dial, pipe, self.reactor, limits=self.limits,
                                          framing=SPFraming(REQ), retryPolicy=backoff.retryPolicy())
            self.pipes.append(pipe)

    def _listen(self, endpoint: str, what: str, then: str = "") -> defer.Deferred[StreamRouter]:
        """Listen on *endpoint*; fires with the router."""
        listener = _Listener(self)

        def bound(router: StreamRouter) -> StreamRouter:
            listener.transport = router
            self.routers.append(router)
            log.info("{what} listening on {endpoint}{then}", what=what, endpoint=router.endpoint, then=then)
            return router

        return StreamRouter.listen(endpoint_of(endpoint, listen=True), listener, self.reactor,
                                   limits=self.limits, framing=SPFraming(REP)).addCallback(bound)

    def _sendBack(self, action: machines.SendOn) -> bool:
        """Send a reply on the listener's channel *action* names, if it is still there."""
        listener, peer = action.channel
        if listener.transport is not None:
            listener.transport.sendMessage(peer, [action.body])
        return listener.transport is not None

    def close(self) -> defer.Deferred[None]:
        routers, self.routers = self.routers, []
        return transport.close_all([*routers, *(pipe.transport for pipe in self.pipes)],
                                   f"an {type(self).__name__} connection")


class SPClient(_Side):
    """An SP REQ socket dialing *endpoints*; a request is sent again every *resend*
    seconds until a reply comes or its Deferred is cancelled."""

    def __init__(self, endpoints: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 resend: float = machines.DEFAULT_RESEND, limits: Limits = Limits(),
                 backoff: Backoff = Backoff(initial=0.1, maximum=2.0)) -> None:
        super().__init__(reactor, limits)
        self.machine = machines.ReqMachine(random_id(), resend=resend, now=self._now())
        self._waiting: dict[int, defer.Deferred[bytes]] = {}
        self._timer: Any = None
        self._closed = False
        self._dial(endpoints, "an SPClient needs at least one endpoint", backoff)

    def request(self, payload: bytes) -> defer.Deferred[bytes]:
        """Send *payload*; the Deferred fires with the reply's payload."""
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"an SP request is bytes, not {type(payload).__name__}")
        if self._closed:
            return defer.fail(ClientClosed("this SPClient is closed"))
        requestId, actions = self.machine.handleRequest(bytes(payload), self._now())

        def cancel(d: defer.Deferred) -> None:
            self._waiting.pop(requestId, None)
            self._perform(self.machine.handleCancel(requestId, self._now()))

        d = self._waiting[requestId] = defer.Deferred(cancel)
        self._perform(actions)
        return d

    def _channel(self, pipe: _Pipe, up: bool) -> None:
        handle = self.machine.handleChannelUp if up else self.machine.handleChannelDown
        self._perform(handle(pipe, self._now()))

    def _reply(self, pipe: _Pipe, body: bytes) -> None:
        self._perform(self.machine.handleReply(pipe, body, self._now()))

    def _perform(self, actions: list[Any]) -> None:
        """Sends and the timer first, then the replies, whose callbacks may call us."""
        replies = []
        for action in actions:
            kind = type(action)
            if kind is machines.Complete:
                replies.append(action)
            elif kind is machines.SendOn:
                if not self._closed:
                    action.channel.transport.sendMessage([action.body])
            elif kind is machines.WakeAt:
                when = None if self._closed else action.when
                self._timer = call_at(self._timer, self.reactor, when, self._wake)
            else:
                self.throttle.info(log, "dropped", "SP client dropped a reply from {url}: {reason}",
                                   url=getattr(action.channel, "url", "?"), reason=action.reason)
        for action in replies:
            d = self._waiting.pop(action.requestId, None)
            if d is not None:
                d.callback(action.payload)

    def _wake(self) -> None:
        self._timer = None
        self._perform(self.machine.handleWake(self._now()))

    def close(self) -> defer.Deferred[None]:
        """Close every connection; requests still waiting fail with ClientClosed."""
        self._closed = True
        self._timer = cancel_call(self._timer)
        waiting, self._waiting = self._waiting, {}
        for d in waiting.values():
            d.errback(ClientClosed("SPClient closed"))
        return super().close()


class SPServer(_Side):
    """An SP REP socket: *handler* takes a request's payload and returns bytes, a Deferred or a
    coroutine (None or a cancelled Deferred: no reply); *options* (*maxHops*, *maxPending*,
    *maxPendingBytes*) are :class:`~mdp.sp.machines.RepMachine`'s."""

    def __init__(self, handler: Callable[[bytes], Any], reactor: Optional[Any] = None, *,
                 limits: Limits = Limits(), **options: Any) -> None:
        super().__init__(reactor, limits)
        self.handler = handler
        self.machine = machines.RepMachine(random_id(), now=self._now(), **options)
        self.served = 0
        self.overloaded = 0  # requests dropped at maxPending or maxPendingBytes

    def listen(self, endpoint: str) -> defer.Deferred[StreamRouter]:
        """Listen on *endpoint*; fires with the router (its ``endpoint`` reaches it)."""
        return self._listen(endpoint, "SP REP")

    def _perform(self, actions: list[Any]) -> None:
        for action in actions:
            kind = type(action)
            if kind is machines.Serve:
                self._serve(action.token, action.payload)
            elif kind is machines.SendOn:
                if self._sendBack(action):
                    self.served += 1
            else:
                overloaded = kind is machines.Overloaded
                self.overloaded += overloaded
                level, topic = ("warn", "overloaded") if overloaded else ("info", "dropped")
                self.throttle.log(level, log, topic, "SP server dropped a request from {peer}: {reason}",
                                  peer=peer_label(*action.channel), reason=action.reason)

    def _serve(self, token: Any, payload: bytes) -> None:
        def done(reply: Any) -> None:
            try:
                reply = None if reply is None else as_frame(reply, "the SP handler's reply")
            except TypeError as e:
                log.error("SP handler's reply is not bytes, or is a str UTF-8 cannot encode "
                          "({error}); no reply", error=e)
                reply = None
            self._perform(self.machine.handleReply(token, reply, self._now()))

        def failed(failure: Any) -> None:
            if not failure.check(defer.CancelledError):
                log.failure("SP handler failed; no reply", failure)
            self._perform(self.machine.handleReply(token, None, self._now()))

        defer.maybeDeferred(self.handler, payload).addCallbacks(done, failed)  # (a coroutine too)


def peer_label(owner: Any, peer: bytes) -> str:
    """*peer* of the listener *owner* for a log line: its address and id."""
    router = getattr(owner, "transport", None)
    address = router.peerAddress(peer) if router is not None else None
    return f"{address or 'a peer gone'} (id {peer.hex()})"


class SPDevice(_Side):
    """A device: a REP side listening on *front*, a REQ side dialing *back*.  It keeps
    no state of its own: the requesters resend."""

    def __init__(self, back: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 maxHops: int = DEFAULT_MAX_HOPS, limits: Limits = Limits(),
                 backoff: Backoff = Backoff(initial=0.1, maximum=2.0)) -> None:
        super().__init__(reactor, limits)
        self.machine = machines.DeviceMachine(random_id(), maxHops=maxHops, now=self._now())
        self._turn = 0
        self._dial(back, "an SPDevice needs at least one endpoint to forward to", backoff)
        self.backs = self.pipes  # the upstream connections

    def listen(self, front: str) -> defer.Deferred[StreamRouter]:
        return self._listen(front, "SP device", f", forwarding to {', '.join(b.url for b in self.backs)}")

    def _perform(self, actions: list[Any], what: str = "request from a peer") -> None:
        for action in actions:
            kind = type(action)
            if kind is machines.Forward:
                self._forward(action.body)
            elif kind is machines.SendOn:
                self._sendBack(action)
            else:  # dropped
                if action.channel is not None:
                    what = f"request from {peer_label(*action.channel)}"
                self.throttle.info(log, "dropped", "SP device dropped a {what}: {reason}",
                                   what=what, reason=action.reason)

    def _forward(self, body: bytes) -> None:
        """Send *body* upstream, on the next connection that is up."""
        live = [b for b in self.backs if b.transport.connected] or self.backs
        if live is self.backs:
            # none up: held by a connection until it is, as nng's send queue holds it
            self.throttle.info(log, "no-upstream", "SP device holds a request until an "
                               "upstream connection is up")
        end = live[self._turn % len(live)]
        self._turn += 1
        end.transport.sendMessage([body])

    def _channel(self, pipe: _Pipe, up: bool) -> None:
        """An upstream connection came or went: :meth:`_forward` reads its ``connected``."""

    def _reply(self, pipe: _Pipe, body: bytes) -> None:
        self._perform(self.machine.handleReply(body, self._now()), f"reply from upstream {pipe.url}")
