"""A connecting ROUTER: one transport to many servers, addressed by endpoint."""

from __future__ import annotations

from typing import Any, Optional

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp import transport
from mdp.interfaces import IDealerTransport, IPeerRouterReceiver, IPeerRouterTransport
from mdp.policy import JITTER, Backoff, Limits, LogThrottle, default_reactor

log = Logger(namespace=__name__)


class _Pipe:
    """Receives for one endpoint's DEALER and forwards with the endpoint name."""

    def __init__(self, owner: PeerRouter, endpoint: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.connected = False

    def connectionMade(self) -> None:
        self.connected = True

    def connectionLost(self, reason: object) -> None:
        self.connected = False

    def messageReceived(self, frames: list[bytes]) -> None:
        self.owner.receiver.messageReceived(self.endpoint, frames)


#: Reconnection to a server that went away: quick, as the agent PINGs every second.
RECONNECT = Backoff(initial=0.25, maximum=2.0, jitter=JITTER)


@implementer(IPeerRouterTransport)
class PeerRouter:
    """Routes by endpoint: ZeroMQ through one native ROUTER, the rest through one pipe each."""

    def __init__(self, receiver: IPeerRouterReceiver, reactor: Any = None, *,
                 limits: Limits = Limits(), curve: Any = None) -> None:
        self.receiver = receiver
        self.curve = curve
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.pipes: dict[str, tuple[_Pipe, IDealerTransport]] = {}
        self.zmq: Optional[Any] = None
        #: servers whose connection could not be opened, tried at their next message
        self.unconnected: set[str] = set()
        self.throttle = LogThrottle(self.reactor)

    def connect(self, endpoint: str) -> None:
        """Connect to the server at *endpoint*; if no socket can be had, try
        again at the next message for it."""
        if endpoint in self.pipes or (self.zmq is not None and endpoint in self.zmq.endpoints):
            return
        zmq = transport.lookup(endpoint, transport.CONNECT).name == "zmq"  # (bad ones raise)
        try:
            if zmq:
                if self.zmq is None:
                    from mdp.transport.zeromq import ZmqPeerRouter

                    self.zmq = ZmqPeerRouter(self.receiver, self.reactor, limits=self.limits,
                                             curve=self.curve)
                self.zmq.connect(endpoint)
            else:
                pipe = _Pipe(self, endpoint)
                self.pipes[endpoint] = (pipe, transport.connect(
                    endpoint, pipe, self.reactor, retryPolicy=RECONNECT.retryPolicy(),
                    limits=self.limits))
        except Exception as e:
            self.unconnected.add(endpoint)
            self.throttle.warn(log, f"connect {endpoint}", "connecting router: cannot connect "
                               "to {endpoint}: {error}; tries again at its next message",
                               endpoint=endpoint, error=e)
        else:
            self.unconnected.discard(endpoint)

    def sendMessage(self, endpoint: str, frames: list[bytes]) -> None:
        if endpoint in self.unconnected:
            self.connect(endpoint)
            if endpoint in self.unconnected:
                return
        entry = self.pipes.get(endpoint)
        if entry is not None:
            pipe, dealer = entry
            if pipe.connected:  # like a ROUTER: nothing is queued for an absent peer
                dealer.sendMessage(frames)
        elif self.zmq is not None:
            self.zmq.sendMessage(endpoint, frames)

    def close(self) -> defer.Deferred[None]:
        closing = [dealer for _, dealer in self.pipes.values()]
        self.pipes.clear()
        self.unconnected.clear()
        if self.zmq is not None:
            closing.append(self.zmq)
            self.zmq = None
        return transport.close_all(closing, "a Freelance connection")
