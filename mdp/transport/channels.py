"""Many pipes over one stream connection: the connecting side of the
channels of ``docs/transports.md`` (:class:`StreamChannels`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from twisted.application.internet import ClientService
from twisted.internet import defer
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.interfaces import IDealerChannels, IDealerReceiver, IDealerTransport, IFraming
from mdp.policy import RECONNECT, Limits, LogThrottle, cancel_call
from mdp.transport.dealer import _connection, _DealerConnection, _OneConnection
from mdp.transport.flow import DrainWaiters, after
from mdp.transport.framing import CHANNELS_GREETING, RecordDecoder, encode_record

log = Logger(namespace="mdp.transport.stream")


@implementer(IFraming)
class _ChannelsFraming:
    """The record framing of a connection that carries channels, as its
    connecting side speaks it: the channels greeting, and a decoder that
    expects a channel in every record."""

    name = "records32-channels"
    acceptsBuffers = True

    def greeting(self, identity: Optional[bytes]) -> bytes:
        return CHANNELS_GREETING

    def encode(self, frames: list[bytes]) -> bytes:
        return encode_record(frames)

    def decoder(self, limits: Limits) -> RecordDecoder:
        decoder = RecordDecoder(limits)
        decoder.channels = True
        return decoder


_CHANNELS = _ChannelsFraming()

#: what ends a channel: a record of no frames
_END = encode_record([])


class _ChannelsConnection(_DealerConnection):
    """The connection of a :class:`StreamChannels`: each read's messages go
    to it, which hands each to its channel."""

    dealer: StreamChannels  # type: ignore[assignment]

    def _deliverAll(self, messages: list[Any]) -> None:
        self.dealer._dispatch(self, messages)


@implementer(IDealerTransport)
class _StreamChannel:
    """One pipe of a :class:`StreamChannels`: what a connection of its own
    would be, with its own peer id at the far end."""

    #: the four bytes that name it on the connection
    id = b""
    up = False
    closed = False
    #: times the far side ended it in a row (paces opening it again)
    ends = 0
    _call: Any = None
    #: what it sent while not up, in order (None: nothing), and its cost
    #: (:func:`held_bytes`): sent once it is up
    held: Optional[deque[list[bytes]]] = None
    heldBytes = 0

    def __init__(self, link: StreamChannels, receiver: IDealerReceiver) -> None:
        self.link = link
        self.receiver = receiver
        self.endpoint = link.endpoint

    @property
    def connected(self) -> bool:
        return self.up

    @property
    def writable(self) -> bool:
        return self.link.writable

    def drained(self) -> defer.Deferred[None]:
        return self.link.drained()

    def discardReceived(self) -> int:
        """The messages for it in the read being delivered that are not
        delivered yet (the other channels' stay)."""
        return self.link._discard(self.id)

    def sendMessage(self, frames: list[bytes]) -> None:
        proto = self.link.protocol
        if self.up and proto is not None:
            proto._queueOn(self.id, proto.encode(frames))
        elif not self.closed:
            self.link._hold(self, frames)

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed = True
            self.up = False
            self._call = cancel_call(self._call)
            self.link._forget(self)
        return defer.succeed(None)

    def _up(self) -> None:
        self._call = cancel_call(self._call)
        proto = self.link.protocol
        # (not on a connection closing: what it held would go with it; the
        # next connection brings it up)
        if (not self.closed and not self.up and proto is not None and not proto.closing
                and not proto.closedHere):
            self.up = True
            try:
                self.receiver.connectionMade()
            except Exception:  # logged: the connection and its other channels stand
                log.failure("stream channel to {endpoint}: its receiver's connectionMade failed",
                            endpoint=self.link.endpoint)
            # then what it sent before (as a StreamDealer's queue goes after
            # its receiver's connectionMade); held again if it went down
            for frames in self.link._release(self):
                self.sendMessage(frames)

    def _down(self, reason: object) -> None:
        self._call = cancel_call(self._call)
        if self.up:
            self.up = False
            self.receiver.connectionLost(reason)


@implementer(IDealerChannels)
class StreamChannels(_OneConnection):
    """The connecting side of one connection (:class:`ClientService`-managed,
    so it reconnects with backoff) that carries many pipes, its *channels*
    (``framing``'s docstring has the wire form).  Each pipe
    (:meth:`open`) behaves as a connection of its own: it is up while the
    connection is, the far side's router knows it as a peer of its own, and
    the far side may end it alone (it is then lost, and made again after the
    reconnection delay, under a new channel).  What the pipes send in one
    reactor turn goes out in one write, and their replies come in one read.

    The connection is opened with the first pipe and closed with the last."""

    kind = "stream channels"

    def __init__(self, endpoint: str, reactor: Any, *,
                 retryPolicy: Optional[Callable[[int], float]] = None,
                 limits: Limits = Limits()) -> None:
        self.endpoint = endpoint
        self.reactor = reactor
        self.limits = limits
        self.framing = _CHANNELS
        self.identity = None
        self.retryPolicy = retryPolicy or RECONNECT.retryPolicy()
        #: the open pipes, by channel
        self.channels: dict[bytes, _StreamChannel] = {}
        self.protocol: Optional[_ChannelsConnection] = None
        self.service: Optional[ClientService] = None
        #: messages its pipes hold (sent while not up: each pipe keeps its
        #: own until it is up, none is sent twice), and their bytes: bounded
        #: together by ``maxQueued`` and ``limits.maxOutputBytes``
        self.queued = 0
        self.queuedBytes = 0
        self._next = 0
        #: fires once the connection being closed is (None: none is)
        self._closing: Optional[defer.Deferred[None]] = None
        self._throttle = LogThrottle(reactor)
        self._waiters = DrainWaiters()
        #: the messages of the read being delivered, and the next one's index
        self._pending: Optional[list[Any]] = None
        self._at = 0
        self._waiting: dict[bytes, int] = {}

    def open(self, receiver: IDealerReceiver) -> _StreamChannel:
        """A new pipe: ``receiver.connectionMade`` is called once it is up."""
        channel = _StreamChannel(self, receiver)
        self._name(channel)
        if self.service is None:
            self.service = _connection(self, self.endpoint, self.retryPolicy)
        elif self.protocol is not None:  # up already: it is too, at the next turn
            channel._call = self.reactor.callLater(0, channel._up)
        return channel

    def _name(self, channel: _StreamChannel) -> None:
        """Give *channel* a channel not in use (none is used twice while the
        far side may still send on it)."""
        while True:
            self._next = self._next % 0xFFFFFFFF + 1
            name = self._next.to_bytes(4, "big")
            if name not in self.channels:
                break
        channel.id = name
        self.channels[name] = channel

    def _buildProtocol(self, addr: object) -> _ChannelsConnection:
        proto = _ChannelsConnection()
        proto.dealer = self  # type: ignore[assignment]
        return proto

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto  # type: ignore[assignment]
        for channel in list(self.channels.values()):
            if self.protocol is not proto:
                return
            channel._up()  # (and sends what it held)

    def _failed(self, reason: Any) -> None:
        """A connection attempt failed: the pipes' receivers that have a
        ``connectionFailed`` hear why."""
        if self.service is None or not self.service.running or isinstance(
                reason, defer.CancelledError):  # (a stopped service's attempt)
            return
        for channel in list(self.channels.values()):
            report = getattr(channel.receiver, "connectionFailed", None)
            if report is not None and not channel.closed:
                report(reason)

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is not proto:
            return
        self.protocol = None
        self._waiters.fire()
        # a record refused for its size was one pipe's: the others only lost
        # the connection (what they had in flight goes again)
        too_large = getattr(proto.refusal, "channel", None)
        others = reason
        if too_large is not None:
            others = Failure(ConnectionLost(f"the connection was dropped for another channel's "
                                            f"record: {proto.refusal}"))
        # every pipe is down before any receiver hears it (one may send on another)
        lost = [channel for channel in self.channels.values() if channel.up]
        for channel in lost:
            channel.up = False
        for channel in lost:
            if not channel.closed:
                channel._call = cancel_call(channel._call)
                channel.receiver.connectionLost(
                    reason if channel.id == too_large or too_large is None else others)

    def _dispatch(self, proto: _ChannelsConnection, messages: list[Any]) -> None:
        """Hand each message of a read to its channel, in order."""
        self._pending = messages
        channels = self.channels
        #: the messages still to come in this read, by channel (so that a
        #: pipe with none there is answered without a scan)
        waiting = self._waiting = {}
        for item in messages:
            waiting[item[0]] = waiting.get(item[0], 0) + 1
        try:
            for i in range(len(messages)):
                item = messages[i]
                if item is None:  # discarded
                    continue
                self._at = i + 1
                waiting[item[0]] -= 1
                channel = channels.get(item[0])
                if channel is None:
                    continue  # ended here: what came before the far side knew
                frames = item[1]
                if not frames:
                    self._endedThere(channel)
                elif channel.up:
                    if channel.ends:
                        channel.ends = 0
                    channel.receiver.messageReceived(frames)
                if proto.closing or self.protocol is not proto:
                    return
        finally:
            self._pending = None

    def _discard(self, name: bytes) -> int:
        pending = self._pending
        if pending is None or not self._waiting.get(name):
            return 0
        self._waiting[name] = 0
        count = 0
        for i in range(self._at, len(pending)):
            item = pending[i]
            if item is not None and item[0] == name:
                pending[i] = None
                count += 1
        return count

    def _endedThere(self, channel: _StreamChannel) -> None:
        """The far side ended *channel*: say it is known, and make the pipe
        again under a new channel after the reconnection delay."""
        if self.protocol is not None:
            self.protocol._queueOn(channel.id, _END)
        del self.channels[channel.id]
        self._name(channel)
        channel._down(Failure(ConnectionDone("the far side ended this channel")))
        channel.ends += 1
        if not channel.closed:  # (its receiver may have closed it)
            channel._call = self.reactor.callLater(self.retryPolicy(channel.ends), channel._up)

    def _hold(self, channel: _StreamChannel, frames: list[bytes]) -> None:
        """*channel* sent *frames* while not up (the connection is down, or
        the pipe is not up on it yet): it keeps them until it is up (its
        pipes within ``maxQueued`` and ``maxOutputBytes`` together)."""
        size = self._admit(frames, self.queued)
        if size is None:
            return
        if channel.held is None:
            channel.held = deque()
        channel.held.append(list(frames))
        channel.heldBytes += size
        self.queued += 1
        self.queuedBytes += size

    def _release(self, channel: _StreamChannel) -> deque[list[bytes]]:
        """What *channel* held, no longer counted here."""
        held, channel.held = channel.held, None
        if held is None:
            return deque()
        self.queued -= len(held)
        self.queuedBytes -= channel.heldBytes
        channel.heldBytes = 0
        return held

    @property
    def queue(self) -> deque[tuple[_StreamChannel, list[bytes]]]:
        """What its pipes hold, as (pipe, frames), each pipe's in the order
        it sent them (a copy)."""
        return deque((channel, frames) for channel in self.channels.values()
                     for frames in channel.held or ())

    def _forget(self, channel: _StreamChannel) -> None:
        """*channel* was closed: drop what it held, tell the far side; close
        the connection with the last one."""
        self._release(channel)
        if self.channels.get(channel.id) is channel:
            del self.channels[channel.id]
            if self.protocol is not None:
                self.protocol._queueOn(channel.id, _END)
        if not self.channels:
            self._stop()

    def _stop(self) -> defer.Deferred[None]:
        service, self.service = self.service, None
        proto, self.protocol = self.protocol, None
        self.queued = 0
        self.queuedBytes = 0
        self._waiters.fire()
        if service is None:
            # (the connection of the last pipe closed may still be closing)
            return after(self._closing)
        if proto is not None:
            proto.beforeStop()
        stopped: defer.Deferred[None] = defer.Deferred()
        self._closing = stopped

        def done(result: object) -> None:
            if self._closing is stopped:
                self._closing = None
            stopped.callback(None)

        service.stopService().addBoth(done)
        return after(stopped)

    def close(self) -> defer.Deferred[None]:
        """Close every pipe and the connection."""
        for channel in list(self.channels.values()):
            channel.closed = True
            channel.up = False
            channel._call = cancel_call(channel._call)
            self._release(channel)
        self.channels.clear()
        return self._stop()
