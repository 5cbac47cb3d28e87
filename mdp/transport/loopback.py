"""In-memory transport for deterministic tests: ``loopback:NAME``.  Every event is scheduled with
``callLater(0)``, so nothing is re-entrant; a dealer waits for its listener, as a ZeroMQ DEALER does."""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from typing import Any, Optional

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import OversizedMessage, TransportError
from mdp.interfaces import IDealerReceiver, IDealerTransport, IRouterReceiver, IRouterTransport
from mdp.policy import Limits, LogThrottle, held_bytes

log = Logger()

_ids = itertools.count(1)


class LoopbackNetwork:
    """Loopback listeners and datagram networks (``members``) by name; most code uses :data:`network`."""

    def __init__(self) -> None:
        self.listeners: dict[str, LoopbackRouter] = {}
        #: dealers waiting for a listener, by name, in the order they came
        self.waiting: defaultdict[str, dict[LoopbackDealer, None]] = defaultdict(dict)
        self.members: defaultdict[str, list[Any]] = defaultdict(list)

    def bind(self, name: str, router: LoopbackRouter) -> None:
        if name in self.listeners:
            raise TransportError(f"loopback:{name} is already bound")
        self.listeners[name] = router
        for dealer in self.waiting.pop(name, {}):
            dealer._attach()

    def unbind(self, name: str, router: LoopbackRouter) -> None:
        if self.listeners.get(name) is router:
            del self.listeners[name]


#: The process-wide loopback namespace used by ``loopback:NAME`` strings.
network = LoopbackNetwork()


class _End:
    """What either end of ``loopback:NAME`` knows."""

    def __init__(self, name: str, receiver: Any, reactor: IReactorTime, net: LoopbackNetwork,
                 limits: Limits) -> None:
        self.name = name
        self.endpoint = f"loopback:{name}"
        self.receiver = receiver
        self.reactor = reactor
        self.network = net
        self.limits = limits
        self.throttle = LogThrottle(reactor)
        self.closed = False


@implementer(IRouterTransport)
class LoopbackRouter(_End):
    """The bound side: many dealers, each known by an opaque peer id."""

    def __init__(self, name: str, receiver: IRouterReceiver, reactor: IReactorTime, *,
                 net: LoopbackNetwork = network, limits: Limits = Limits()) -> None:
        super().__init__(name, receiver, reactor, net, limits)
        self.peers: dict[bytes, LoopbackDealer] = {}
        #: peers whose pipe an oversized message ended: nothing more is delivered
        self.ending: set[bytes] = set()
        net.bind(name, self)

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        dealer = self.peers.get(peer)
        if dealer is not None:
            dealer.inbound += 1
            dealer.reactor.callLater(0, dealer._deliver, peer, list(frames))

    def disconnectPeer(self, peer: bytes) -> None:
        """Drop *peer* once what was sent to it is delivered."""
        dealer = self.peers.get(peer)
        if dealer is not None:
            dealer.reactor.callLater(0, dealer._dropped, peer)

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed = True
            self.network.unbind(self.name, self)
            for peer, dealer in list(self.peers.items()):
                dealer._dropped(peer)
        return defer.succeed(None)

    def _connect(self, peer: bytes, dealer: LoopbackDealer) -> None:
        """A dealer arrives, taking over its identity (ZMQ_ROUTER_HANDOVER)."""
        previous = self.peers.get(peer)
        if previous is not None and previous is not dealer:
            previous.supplanted = True
            previous.reactor.callLater(0, previous._dropped, peer)
        self.ending.discard(peer)
        self.peers[peer] = dealer

    def _deliver(self, peer: bytes, frames: list[bytes]) -> None:
        if self.closed or peer in self.ending or peer not in self.peers:
            return
        reason = self.limits.refuse(frames)
        if reason is not None:
            self.throttle.warn(log, "oversized", "loopback:{name} dropping peer {peer}: {reason}",
                               name=self.name, peer=peer.hex(), reason=reason)
            self.ending.add(peer)
            self.disconnectPeer(peer)
            return
        self.receiver.messageReceived(peer, frames)

    def _peerGone(self, peer: bytes, dealer: LoopbackDealer) -> None:
        if self.peers.get(peer) is not dealer:
            return
        del self.peers[peer]
        self.ending.discard(peer)
        if not self.closed:
            self.receiver.peerDisconnected(peer)


@implementer(IDealerTransport)
class LoopbackDealer(_End):
    """The connecting side: one pipe to the router bound under *name*."""

    maxQueued = 1000  #: Messages kept while no listener exists
    writable = True
    inbound = discarding = 0  #: messages on their way to this dealer; how many of those to drop
    supplanted = False  #: a newer dealer took over our identity: we stay detached
    #: seconds before a dropped pipe attaches again (not in the same turn, for ever)
    reconnectDelay = 0.1

    def __init__(self, name: str, receiver: IDealerReceiver, reactor: IReactorTime, *,
                 net: LoopbackNetwork = network, limits: Limits = Limits(),
                 identity: Optional[bytes] = None) -> None:
        super().__init__(name, receiver, reactor, net, limits)
        self.identity = identity
        self.router: Optional[LoopbackRouter] = None
        self.peer: Optional[bytes] = None
        self.queue: deque[list[bytes]] = deque()
        self.queuedBytes = 0
        self._attach()

    @property
    def connected(self) -> bool:
        return self.router is not None

    def drained(self) -> defer.Deferred[None]:
        return defer.succeed(None)

    def _attach(self) -> None:
        if self.router is not None or self.supplanted or self.closed:
            return
        router = self.network.listeners.get(self.name)
        if router is None:
            self.network.waiting[self.name][self] = None
            return
        self.router = router
        self.peer = self.identity or b"\x00" + next(_ids).to_bytes(4, "big")
        router._connect(self.peer, self)
        self.reactor.callLater(0, self._made, self.peer)

    def _made(self, peer: bytes) -> None:
        if peer != self.peer or self.closed:
            return
        self.receiver.connectionMade()
        while self.queue and self.peer == peer:
            frames = self.queue.popleft()
            self.queuedBytes -= held_bytes(frames)
            self.sendMessage(frames)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.closed:
            return
        router, peer = self.router, self.peer
        if router is None or peer is None:
            size = held_bytes(frames)
            if len(self.queue) >= self.maxQueued or self.queuedBytes + size > self.limits.maxOutputBytes:
                self.throttle.warn(log, "full", "loopback dealer to {name} refused a message: {count} "
                                   "wait for a listener", name=self.name, count=len(self.queue))
                return
            self.queue.append(list(frames))
            self.queuedBytes += size
            return
        router.reactor.callLater(0, router._deliver, peer, list(frames))

    def discardReceived(self) -> int:
        dropped = self.inbound - self.discarding
        self.discarding = self.inbound
        return dropped

    def _deliver(self, peer: bytes, frames: list[bytes]) -> None:
        self.inbound -= 1
        if self.discarding:
            self.discarding -= 1
            return
        if peer == self.peer and not self.closed:
            reason = self.limits.refuse(frames)
            if reason is not None:
                self.throttle.warn(log, "oversized", "loopback dealer to {name} dropping its pipe: "
                                   "{reason}", name=self.name, reason=reason)
                self._dropped(peer, OversizedMessage(reason))
                return
            self.receiver.messageReceived(frames)

    def _detach(self) -> None:
        router, peer, self.router, self.peer = self.router, self.peer, None, None
        if router is not None and peer is not None:
            router.reactor.callLater(0, router._peerGone, peer, self)

    def _dropped(self, peer: bytes, why: Optional[Exception] = None) -> None:
        """The pipe is gone: report, then wait for a listener."""
        if peer != self.peer:
            return
        self._detach()
        self.reactor.callLater(0, self._lost, why or ConnectionDone("loopback peer closed"))

    def _lost(self, why: Exception) -> None:
        if self.closed:
            return
        self.receiver.connectionLost(Failure(why))
        if self.router is None and not self.supplanted:
            self.reactor.callLater(self.reconnectDelay, self._attach)

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed = True
            self.network.waiting[self.name].pop(self, None)
            self._detach()
        return defer.succeed(None)
