"""What the listening and the connecting side of a stream connection share
(:class:`FramedProtocol`), over a pluggable :class:`~mdp.interfaces.IFraming`."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from twisted.internet.protocol import Protocol
from twisted.logger import Logger

from mdp.errors import ProtocolError
from mdp.interfaces import IFraming
from mdp.policy import Limits, LogThrottle
from mdp.transport.framing import RECORDS
from mdp.transport.twisted_private import direct_capable, write_direct

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

#: A batch is handed to the transport at this many bytes, so that a long burst meets its flow control.
FLUSH_BYTES = 65536


class FramedProtocol(Protocol):
    """One stream connection carrying framed multi-frame messages.  Input the
    framing refuses ends the connection.  What is sent in one batch (while its
    cause is handled, or within one reactor turn) is written together."""

    limits: Limits = Limits()
    framing: IFraming = RECORDS
    identity: Optional[bytes] = None  #: the identity a connecting side announces in its greeting
    onMessage: Callable[[list[bytes]], None]
    throttle: Optional[LogThrottle] = None
    dropped = False  # deliver nothing more
    closedHere = False
    refusal: Optional[ProtocolError] = None
    paused = False
    needsLogContext = False  #: mdp.uvreactor may read without Twisted's legacy log context

    _out: list[bytes]
    _outBytes = 0
    _direct = False
    _flushCall: Any = None

    def connectionMade(self) -> None:
        self.decoder = self.framing.decoder(self.limits)
        self.decoder.onEvicted = self.refuse  # (the budget of unfinished records dropped it)
        self.encode = self.framing.encode
        self._out = []
        self._direct = direct_capable(self.transport)
        # as ZeroMQ does: Nagle would hold a reply until the peer's delayed ACK
        with contextlib.suppress(OSError, AttributeError, NotImplementedError):
            self.transport.setTcpNoDelay(True)
        greeting = self.framing.greeting(self.identity)
        if greeting:
            self.transport.write(greeting)

    def sendFrames(self, frames: list[bytes]) -> None:
        self._queue(self.encode(frames))

    def _queue(self, record: bytes, channel: Optional[bytes] = None) -> None:
        """Send *record* (on *channel*) with the rest of this batch."""
        out = self._out
        first = not out
        if channel is not None:
            out.append(channel)
            self._outBytes += 4
        out.append(record)
        self._outBytes += len(record)
        if self._outBytes >= FLUSH_BYTES:
            self.flushWrites()
        elif first:
            self._batchBegun()

    def _batchBegun(self) -> None:
        """The first record of a batch is queued: see that it is flushed."""
        raise NotImplementedError

    def _flushTurn(self) -> None:
        """At the end of the reactor turn (``call_soon``) that scheduled it as ``_flushCall``."""
        self._flushCall = None
        self.flushWrites()

    def _cancelFlush(self) -> None:
        call, self._flushCall = self._flushCall, None
        if call is not None:
            call.cancel()

    def flushWrites(self) -> None:
        out = self._out
        if not out:
            return
        self._out = []
        self._outBytes = 0
        if self.dropped:
            return
        if self._direct and write_direct(self.transport, out):
            return
        self.transport.writeSequence(out)

    def dataReceived(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as e:
            before = getattr(e, "decoded", None)
            if before:  # whole messages that came before it
                self._deliverAll(before)
            self.refuse(e)
            return
        if messages:
            self._deliverAll(messages)

    def refuse(self, e: ProtocolError) -> None:  # (input that cannot be taken)
        self.refusal = e
        self.drop("{reason}", reason=e)

    def _deliverAll(self, messages: list[Any]) -> None:
        """Hand the messages of one read on until the connection closes."""
        batch = self._batch = iter(messages)
        try:
            for frames in batch:
                self.onMessage(frames)
                if self.closing:
                    return
        finally:
            self._batch = None

    _batch: Any = None

    def discardBatch(self) -> int:
        """Drop the messages of this read not delivered yet; how many."""
        batch, self._batch = self._batch, None
        return 0 if batch is None else sum(1 for _ in batch)

    @property
    def closing(self) -> bool:
        return self.dropped or self.transport.disconnecting

    def drop(self, why: str, **fields: Any) -> None:
        """End the connection at once, logging *why* with the peer."""
        if self.dropped:
            return
        self.dropped = True
        self._warn("drop", "dropping stream peer {peer}: " + why, **fields)
        self.transport.abortConnection()

    def _warn(self, kind: str, why: str, **fields: Any) -> None:
        """Warn of *why* about the peer (throttled if the owner throttles)."""
        fields["peer"] = self.peerName()
        if self.throttle is not None:
            self.throttle.warn(log, kind, why, **fields)
        else:
            log.warn(why, **fields)

    def closeGracefully(self) -> None:
        """Close once what is written is sent (unregistering the producer that keeps it open)."""
        self.closedHere = True
        self.flushWrites()
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    def pauseProducing(self) -> None:
        self.paused = True

    def connectionLost(self, reason: object = None) -> None:
        """Warn if the peer closed in the middle of a message; let go of what is held."""
        decoder = getattr(self, "decoder", None)
        if decoder is not None and not (self.dropped or self.closedHere) and decoder.inRecord:
            self._warn("unfinished", "stream peer {peer} closed its connection in the middle of a "
                       "message ({held} bytes of it received): that message is lost",
                       held=decoder.buffered)
        getattr(decoder, "release", int)()  # what an unfinished record held, at once
        self._cancelFlush()
        self._out = []
        self._outBytes = 0

    def peerName(self) -> str:
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"
