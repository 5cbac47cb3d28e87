"""Many pipes over one ZeroMQ DEALER, each a *relay hop*: a four-byte frame before
its messages, as a ROUTER-DEALER proxy adds (docs/mdp.md, "Relayed peers").  Once
a second pipe opens, a *probe* goes on a relay hop; a pipe waits up to
:data:`PROBE_WAIT` seconds for its answer, then goes alone (a DEALER of its own)."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Optional

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import OversizedMessage
from mdp.interfaces import IDealerChannels, IDealerReceiver, IDealerTransport
from mdp.policy import Limits, LogThrottle, cancel_call
from mdp.transport.channellink import Channel, ChannelLink
from mdp.transport.zeromq import ZmqDealer

log = Logger(namespace=__name__)

PROBE_HOP = b"\x00\x00\x00\x00"  # the probe's hop; pipes' hops count up from 1
PROBE_WAIT = 0.5  # seconds a pipe opened while the probe is out waits for its answer
MAX_HELD = 1000  # messages a waiting pipe holds until it is up or goes alone

#: a link's states: one pipe so far; probe out; probe unanswered; answered
ALONE, PROBING, UNANSWERED, RELAYING = "alone", "probing", "unanswered", "relaying"


@implementer(IDealerTransport)
class ZmqChannel(Channel):
    """A pipe: a relay hop (``id``) on the link's DEALER or (``alone``) its own DEALER; held until known."""

    alone: Optional[ZmqDealer] = None

    def __init__(self, link: ZmqChannels, receiver: IDealerReceiver) -> None:
        super().__init__()
        self.link = link
        self.endpoint = link.endpoint
        self.receiver = receiver
        self.pending: list[list[bytes]] = []

    @property
    def connected(self) -> bool:  # (a DEALER of its own is, from the start)
        return self.alone is not None or bool(self.id) and self.link.up and not self.closed

    @property
    def writable(self) -> bool:
        return bool((self.alone or self.link.dealer).writable)

    def drained(self) -> defer.Deferred[None]:
        return (self.alone or self.link.dealer).drained()

    def discardReceived(self) -> int:
        return self.alone.discardReceived() if self.alone is not None else 0

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.alone is not None:
            self.alone.sendMessage(frames)
        elif self.closed:
            return
        elif self.id:
            self.link.dealer.sendMessage([self.id, *frames])
        elif len(self.pending) < MAX_HELD:
            self.pending.append(list(frames))
        else:
            self.link.throttle.warn(log, "held", "zmq pipe to {endpoint} refused a message: "
                                    "{count} wait for the broker's answer to the probe",
                                    endpoint=self.endpoint, count=len(self.pending))

    def release(self) -> None:  # what was held, now that the pipe knows its way
        held, self.pending = self.pending, []
        for frames in held:
            self.sendMessage(frames)

    def close(self) -> defer.Deferred[None]:
        self.pending = []
        self.link.forget(self)
        return self.alone.close() if self.alone is not None else defer.succeed(None)


@implementer(IDealerChannels, IDealerReceiver)
class ZmqChannels:
    """The pipes to one ZeroMQ endpoint: relay hops where the server answers the *probe*."""

    state = ALONE
    up = closed = False
    _waitCall: Any = None
    dealer: Any = None  # of the relay hops, once a second pipe is open

    def __init__(self, endpoint: str, reactor: Any, probe: list[bytes], limits: Limits = Limits(),
                 retryPolicy: Optional[Callable[[int], float]] = None, security: Any = None) -> None:
        self.endpoint = endpoint
        self.probe = probe
        self.reactor = reactor
        #: a new DEALER to the endpoint, for a receiver
        self._dealer = partial(ZmqDealer, endpoint, reactor=reactor, limits=limits, curve=security,
                               retryPolicy=retryPolicy)
        self.throttle = LogThrottle(reactor)
        self.hops = ChannelLink()  # (names the hops)
        self.relayed: dict[bytes, Any] = self.hops.channels
        self.waiting: list[ZmqChannel] = []
        self.alone: weakref.WeakSet[ZmqDealer] = weakref.WeakSet()

    def open(self, receiver: IDealerReceiver) -> IDealerTransport:
        """A relayed pipe, a DEALER of its own (alone or the probe unanswered), or one awaiting the answer."""
        if self.closed:
            raise RuntimeError(f"the pipes to {self.endpoint} are closed")
        if self.state is not RELAYING and (self.state is UNANSWERED or not (
                self.relayed or self.waiting or any(d.connection for d in self.alone))):
            dealer = self._dealer(receiver)
            self.alone.add(dealer)
            return dealer
        pipe = ZmqChannel(self, receiver)
        if self.state is RELAYING:
            self._relay(pipe)
            return pipe
        if self.state is ALONE:  # a second pipe: ask whether the server relays
            self.state = PROBING
            self.dealer = self._dealer(self)
            self.dealer.sendMessage([PROBE_HOP, *self.probe])
            self._waitCall = self.reactor.callLater(PROBE_WAIT, self._unanswered)
        self.waiting.append(pipe)
        return pipe

    def _relay(self, pipe: ZmqChannel) -> None:
        self.hops.open(pipe)
        pipe.release()
        if self.up:
            self.reactor.callLater(0, self._made, pipe)

    def _made(self, pipe: ZmqChannel) -> None:
        if self.relayed.get(pipe.id) is pipe and self.up:
            pipe.receiver.connectionMade()

    def _unanswered(self) -> None:
        """The waiting pipes go alone (a later answer relays those opened after)."""
        self._waitCall = None
        if self.state is PROBING:
            self.state = UNANSWERED
            log.info("zmq: the broker at {endpoint} did not answer a relayed probe within "
                     "{wait}s: a DEALER per pipe", endpoint=self.endpoint, wait=PROBE_WAIT)
        waiting, self.waiting = self.waiting, []
        for pipe in waiting:
            if not pipe.closed:
                pipe.alone = self._dealer(pipe.receiver)
                self.alone.add(pipe.alone)
                pipe.release()

    def forget(self, pipe: ZmqChannel) -> None:
        self.hops.close(pipe)
        if pipe in self.waiting:
            self.waiting.remove(pipe)

    def connectionMade(self) -> None:
        self.up = True
        for pipe in list(self.relayed.values()):
            self._made(pipe)

    def connectionLost(self, reason: object) -> None:
        self.up = False
        for pipe in list(self.relayed.values()):
            pipe.receiver.connectionLost(reason)

    def messageReceived(self, frames: list[bytes]) -> None:
        hop = frames[0] if len(frames) > 1 else None
        pipe = self.relayed.get(hop)
        if pipe is not None:
            pipe.receiver.messageReceived(frames[1:])
        elif hop == PROBE_HOP and self.state is not RELAYING:  # the probe's answer
            self.state = RELAYING
            self._waitCall = cancel_call(self._waitCall)
            waiting, self.waiting = self.waiting, []
            for pipe in waiting:
                if not pipe.closed:
                    self._relay(pipe)

    def hopOversized(self, hop: bytes, count: int, size: int) -> bool:
        """A message over the limits came on *hop*: only its pipe moves to a new hop."""
        pipe = self.relayed.get(hop)
        if pipe is not None:
            why = OversizedMessage(f"a message of {size}+ bytes in {count} frames is over the limits")
            self.reactor.callLater(0, self._hopReplaced, pipe, hop, why)
        return True

    def _hopReplaced(self, pipe: ZmqChannel, hop: bytes, why: Exception) -> None:
        if self.relayed.get(hop) is pipe:
            del self.relayed[hop]
            self._relay(pipe)
            pipe.receiver.connectionLost(Failure(why))

    def close(self) -> defer.Deferred[None]:
        """Close every pipe and the DEALER; fires once all are."""
        from mdp.transport import close_all

        self.closed = True
        self._waitCall = cancel_call(self._waitCall)
        pipes: list[Any] = list(self.alone)
        self.relayed.clear()
        self.alone = weakref.WeakSet()
        self.waiting = []
        if self.dealer is not None:
            pipes.append(self.dealer)
        return close_all(pipes, "a pipe to " + self.endpoint)
