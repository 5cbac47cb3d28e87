"""Many pipes over one stream connection (:class:`StreamChannels`)."""

from __future__ import annotations

from collections import Counter, deque
from functools import partial
from typing import Any, Callable, Optional

from twisted.internet import defer
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.interfaces import IDealerChannels, IDealerReceiver, IDealerTransport
from mdp.policy import Limits, cancel_call
from mdp.transport.channellink import CHANNELS, DELIVER, ENDED, Channel, ChannelLink
from mdp.transport.dealer import _DealerConnection, _OneConnection


@implementer(IDealerTransport)
class _StreamChannel(Channel):
    """One pipe of a :class:`StreamChannels`, a peer of its own at the far end."""

    _call: Any = None

    def __init__(self, link: StreamChannels, receiver: IDealerReceiver) -> None:
        super().__init__()
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
        """Drop its messages of this read not delivered yet; how many."""
        link, name, count = self.link, self.id, 0
        pending = link._pending
        if pending is None or not link._waiting.get(name):  # (the client asks before every send)
            return 0
        link._waiting[name] = 0
        for i in range(link._at, len(pending)):
            if pending[i] is not None and pending[i][0] == name:
                pending[i] = None
                count += 1
        return count

    def sendMessage(self, frames: list[bytes]) -> None:
        link = self.link
        proto = link.protocol
        if self.up and proto is not None:
            proto._queue(proto.encode(frames), self.id)
        elif not self.closed:
            size = link._admit(frames, link.core.queued)
            if size is not None:
                link.core.hold(self, frames, size)  # (sent once it is up)

    def close(self) -> defer.Deferred[None]:
        """End its channel; the last closes the connection."""
        link = self.link
        if not self.closed:
            self._call = cancel_call(self._call)
            record = link.core.close(self)
            if record is not None and link.protocol is not None:
                link.protocol._queue(record[4:], record[:4])
            if not link.core.channels:
                link._stop()
        return defer.succeed(None)

    def _up(self) -> None:
        """Its delay is over, or it is new: up, if the connection is."""
        self._call = cancel_call(self._call)
        proto = self.link.protocol
        # not on a closing connection: what it held would go with it
        if proto is None or proto.closing or proto.closedHere:
            self.waiting = False
            return
        if self.link.core.comeUp(self):
            self._made()

    def _made(self) -> None:
        """It is up: tell its receiver, then send what it held."""
        self.link._tellMade(self.receiver, "stream channel")
        for frames in self.link.core.release(self):
            self.sendMessage(frames)


@implementer(IDealerChannels)
class StreamChannels(_OneConnection):
    """One :class:`ClientService`-managed connection carrying many pipes (:meth:`open`), each as a
    connection of its own: the Twisted shell of a :class:`~mdp.transport.channellink.ChannelLink`."""

    kind = "stream channels"

    def __init__(self, endpoint: str, reactor: Any, limits: Limits = Limits(),
                 retryPolicy: Optional[Callable[[int], float]] = None) -> None:
        super().__init__(endpoint, reactor, limits, CHANNELS, None)
        self.core = ChannelLink(retryPolicy)
        self._pending: Optional[list[Any]] = None
        self._at = 0
        self._waiting: Counter[bytes] = Counter()

    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def queuedBytes(self) -> int:  # type: ignore[override]
        return self.core.queuedBytes

    @property
    def queue(self) -> deque[tuple[Channel, list[bytes]]]:
        """A copy of what its pipes hold, as (pipe, frames)."""
        return deque((channel, frames) for channel in self.core.channels.values()
                     for frames in channel.held or ())

    def open(self, receiver: IDealerReceiver) -> _StreamChannel:
        """A new pipe: ``receiver.connectionMade`` is called once it is up."""
        channel = _StreamChannel(self, receiver)
        self.core.open(channel)
        if self.service is None:
            self._start(self.core.retryPolicy)
        elif self.protocol is not None:
            channel._call = self.reactor.callLater(0, channel._up)
        return channel

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto
        proto._deliverAll = partial(self._dispatch, proto)  # type: ignore[method-assign]
        for channel in self.core.made():
            channel._call = cancel_call(channel._call)  # type: ignore[attr-defined]
            channel._made()  # type: ignore[attr-defined]

    def _failed(self, reason: Any) -> None:
        if self.service is None or isinstance(reason, defer.CancelledError):  # (a stopped service's)
            return
        for channel in self.core.failed():
            report = getattr(channel.receiver, "connectionFailed", None)  # type: ignore[attr-defined]
            if report is not None:
                report(reason)

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is not proto:
            return
        self.protocol = None
        self._waiters.fire()
        # all down before any receiver hears it (one may send on another)
        for channel, why in self.core.lost(reason if proto.refusal is None else proto.refusal):
            if not channel.closed:
                channel._call = cancel_call(channel._call)  # type: ignore[attr-defined]
                channel.receiver.connectionLost(  # type: ignore[attr-defined]
                    why if why is reason else Failure(why))

    def _dispatch(self, proto: _DealerConnection, messages: list[Any]) -> None:
        self._pending = messages
        core = self.core
        channels = core.channels
        waiting = self._waiting = Counter(item[0] for item in messages)  # by channel, still to come
        try:
            for i, item in enumerate(messages):
                if item is None:
                    continue
                self._at = i + 1
                waiting[item[0]] -= 1
                channel = channels.get(item[0])
                if channel is None:
                    continue
                what = core.received(channel, item[1])
                if what == DELIVER:
                    channel.receiver.messageReceived(item[1])  # type: ignore[attr-defined]
                elif what == ENDED:
                    self._endedThere(channel)  # type: ignore[arg-type]
                if proto.closing or self.protocol is not proto:
                    return
        finally:
            self._pending = None

    def _endedThere(self, channel: _StreamChannel) -> None:
        """The far side ended *channel*: acknowledge; up again after the delay."""
        record, why, delay = self.core.endedThere(channel)
        if self.protocol is not None:
            self.protocol._queue(record[4:], record[:4])
        channel._call = cancel_call(channel._call)
        if why is not None:
            channel.receiver.connectionLost(Failure(why))
        if not channel.closed:
            channel._call = self.reactor.callLater(delay, channel._up)

    def _stop(self) -> defer.Deferred[None]:
        self.core.connected = False
        return super()._stop()

    def close(self) -> defer.Deferred[None]:
        """Close every pipe and the connection."""
        for channel in self.core.closeAll():
            channel._call = cancel_call(channel._call)  # type: ignore[attr-defined]
        return self._stop()
