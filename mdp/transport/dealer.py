"""The connecting side of the stream transport (:class:`StreamDealer`)."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from twisted.application.internet import ClientService
from twisted.internet import defer
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IHandshakeListener, INegotiated, IPushProducer
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import ProtocolError
from mdp.interfaces import IDealerReceiver, IDealerTransport, IFraming
from mdp.policy import RECONNECT, Limits, LogThrottle, cancel_call, held_bytes
from mdp.transport.flow import DrainWaiters, after
from mdp.transport.framed import FramedProtocol
from mdp.transport.framing import RECORDS
from mdp.transport.twisted_private import call_soon, shortcut_reads

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

#: seconds a silent connection must stay up to count as made (one lost sooner is
#: a failed attempt, so the backoff grows)
PROVEN_AFTER = 1.0


@implementer(IPushProducer, IHandshakeListener)
class _DealerConnection(FramedProtocol):
    """The connecting side's protocol, producer of its transport."""

    dealer: StreamDealer
    madeAt: Optional[float] = None  # (over TLS, once the handshake is done)
    proven = False  # something came, or it stayed up PROVEN_AFTER

    #: (a framing with a greeting) its timer, and what came meanwhile
    _awaiting: Any = None
    _early: Optional[list[Any]] = None

    def connectionMade(self) -> None:
        self.dealer = self.factory.dealer
        self.limits = self.dealer.limits
        self.framing = self.dealer.framing
        self.identity = self.dealer.identity
        super().connectionMade()
        awaits = getattr(self.decoder, "handshaken", None) is False
        if not awaits and not INegotiated.providedBy(self.transport):
            self.handshakeCompleted()
        shortcut_reads(self)
        self.transport.registerProducer(self, True)
        if awaits:  # not the dealer's until the peer's greeting comes
            self._early = []
            self.onMessage = self._early.append
            self._awaiting = self.dealer.reactor.callLater(self.limits.handshakeTimeout, self._noGreeting)
            return
        self.dealer._made(self)

    def _noGreeting(self) -> None:
        self._awaiting = None
        self.refusal = ProtocolError(f"no {self.framing.name} greeting within "
                                     f"{self.limits.handshakeTimeout:g}s of connecting")
        self.drop("it sent no {framing} greeting within {seconds:g}s of connecting",
                  framing=self.framing.name, seconds=self.limits.handshakeTimeout)

    reading = False

    def _batchBegun(self) -> None:
        if not self.reading and self._flushCall is None:
            self._flushCall = call_soon(self.dealer.reactor, self._flushTurn)

    def dataReceived(self, data: bytes) -> None:
        self.reading = True
        try:
            super().dataReceived(data)
            if self._awaiting is not None and not self.closing and self.decoder.handshaken:
                self._awaiting = cancel_call(self._awaiting)  # greeted
                early, self._early = self._early or [], None
                if not INegotiated.providedBy(self.transport):
                    self.handshakeCompleted()
                self.dealer._made(self)
                for frames in early:
                    if self.closing or self.dealer.protocol is not self:
                        break
                    self.onMessage(frames)
            if not self.proven and self.madeAt is not None and not self.closing:
                self.proven, self.dealer._unproven = True, 0
        finally:
            self.reading = False
            if self._out:
                self.flushWrites()

    def connectionLost(self, reason: object = None) -> None:
        self._awaiting = cancel_call(self._awaiting)
        self.paused = False
        super().connectionLost(reason)
        if (not self.proven and self.madeAt is not None
                and self.dealer.reactor.seconds() - self.madeAt >= PROVEN_AFTER):
            self.proven, self.dealer._unproven = True, 0
        if not self.proven and not self.closedHere:
            self.dealer._unproven += 1
        self.dealer._lost(self, Failure(self.refusal) if self.refusal is not None else reason)

    def handshakeCompleted(self) -> None:
        self.madeAt = self.dealer.reactor.seconds()

    def resumeProducing(self) -> None:
        self.paused = False
        self.dealer._resumed(self)

    def stopProducing(self) -> None:
        self.paused = False


class _OneConnection:
    """A connecting side's one connection (``protocol``, None while down) and its
    flow control; what is sent meanwhile waits, within ``maxQueued`` and bytes."""

    maxQueued = 1000
    kind = "stream dealer"
    _unproven = 0  # connections in a row lost before they were proven
    service: Optional[ClientService] = None
    _closing: Optional[defer.Deferred[None]] = None
    queuedBytes: int

    def __init__(self, endpoint: str, reactor: Any, limits: Limits, framing: Any,
                 identity: Optional[bytes]) -> None:
        self.endpoint = endpoint
        self.reactor = reactor
        self.limits = limits
        self.framing = framing
        self.identity = identity
        self.protocol: Optional[_DealerConnection] = None
        self._throttle = LogThrottle(reactor)
        self._waiters = DrainWaiters()

    def _start(self, retryPolicy: Optional[Callable[[int], float]]) -> None:
        """Start the :class:`ClientService` keeping the connection."""
        factory = Factory.forProtocol(_DealerConnection)
        factory.dealer = self  # type: ignore[attr-defined]
        factory.noisy = False
        policy = retryPolicy or RECONNECT.retryPolicy()
        self._connector = clientFromString(self.reactor, self.endpoint)
        service = ClientService(  # (its endpoint: this, to report each failed attempt)
            self, factory, retryPolicy=lambda attempt: policy(attempt + max(0, self._unproven - 1)),
            clock=self.reactor)
        service.startService()
        self.service = service  # (an attempt failing meanwhile is not reported)

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        return self._connector.connect(factory).addErrback(self._attemptFailed)

    def _attemptFailed(self, failure: Failure) -> Failure:
        self._failed(failure.value)
        return failure

    def __str__(self) -> str:  # (as the service logs its endpoint)
        return self.endpoint

    def _admit(self, frames: list[bytes], count: int) -> Optional[int]:
        """What *frames* cost held, or None (warned) past the bounds."""
        size = held_bytes(frames)
        if count >= self.maxQueued or self.queuedBytes + size > self.limits.maxOutputBytes:
            self._throttle.warn(log, "full", "{kind} to {endpoint} refused a message: "
                                "{count} messages ({bytes} bytes) already wait for the connection",
                                kind=self.kind, endpoint=self.endpoint, count=count, bytes=self.queuedBytes)
            return None
        self.framing.encode(frames)
        return size

    @property
    def writable(self) -> bool:
        return self.protocol is None or not self.protocol.paused

    def drained(self) -> defer.Deferred[None]:
        return defer.succeed(None) if self.writable else self._waiters.wait()

    def _resumed(self, proto: _DealerConnection) -> None:
        if proto is self.protocol:
            self._waiters.fire()

    def _tellMade(self, receiver: IDealerReceiver, kind: Optional[str] = None) -> None:
        try:
            receiver.connectionMade()
        except Exception:
            log.failure("{kind} to {endpoint}: its receiver's connectionMade failed",
                        kind=kind or self.kind, endpoint=self.endpoint)

    def _stop(self) -> defer.Deferred[None]:
        service, self.service = self.service, None
        proto, self.protocol = self.protocol, None
        self._waiters.fire()
        if proto is not None:
            proto.closeGracefully()
        if service is not None:
            self._closing = service.stopService().addBoth(lambda result: None)
        return after(self._closing)


@implementer(IDealerTransport)
class StreamDealer(_OneConnection):
    """The connecting side: one :class:`ClientService`-managed connection."""

    def __init__(self, endpoint: str, receiver: IDealerReceiver, reactor: Any, *,
                 retryPolicy: Optional[Callable[[int], float]] = None, limits: Limits = Limits(),
                 framing: IFraming = RECORDS, identity: Optional[bytes] = None) -> None:
        super().__init__(endpoint, reactor, limits, framing, identity)
        self.receiver = receiver
        self.queue: deque[list[bytes]] = deque()
        self.queuedBytes = 0
        self._start(retryPolicy)

    @property
    def connected(self) -> bool:
        return self.protocol is not None

    def discardReceived(self) -> int:
        return 0 if self.protocol is None else self.protocol.discardBatch()

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto
        proto.onMessage = self.receiver.messageReceived
        self._tellMade(self.receiver)
        while self.queue and self.protocol is proto:
            proto.sendFrames(self.queue.popleft())
        if not self.queue:
            self.queuedBytes = 0

    def _failed(self, reason: Any) -> None:
        report = getattr(self.receiver, "connectionFailed", None)
        if report is not None and self.service is not None:
            report(reason)

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is proto:
            self.protocol = None
            self._waiters.fire()
        if self.service is None:
            return
        if proto._early is not None:  # its greeting never came: a failed attempt
            self._failed(reason.value if isinstance(reason, Failure) else reason)
        else:
            self.receiver.connectionLost(reason)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.protocol is not None:
            self.protocol.sendFrames(frames)
        elif self.service is not None:
            size = self._admit(frames, len(self.queue))
            if size is not None:
                self.queue.append(list(frames))
                self.queuedBytes += size

    def close(self) -> defer.Deferred[None]:
        self.queue.clear()
        self.queuedBytes = 0
        return self._stop()
