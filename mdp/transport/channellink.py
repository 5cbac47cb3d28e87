"""The channels of one stream connection, without I/O: the core of
:class:`~mdp.transport.channels.StreamChannels` and of the blocking client's link; ZmqChannels' hop names."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Callable, Optional

from twisted.internet.error import ConnectionDone, ConnectionLost

from mdp.policy import RECONNECT
from mdp.transport.framing import LengthPrefixedFraming, encode_record

END = encode_record([])  #: what ends a channel: a record of no frames

#: what a record on a channel means (:meth:`ChannelLink.received`)
DELIVER, IGNORE, STALE, ENDED = range(4)


#: the record framing of a connection that carries channels
CHANNELS = LengthPrefixedFraming(channels=True)


class Channel:
    """One pipe's state on the connection."""

    __slots__ = ("id", "up", "closed", "ends", "waiting", "held", "heldBytes")

    def __init__(self) -> None:
        self.id = b""
        self.up = False
        self.closed = False
        self.ends = 0  #: times in a row the far side ended it (paces bringing it up again)
        self.waiting = False  #: ended by the far side, its delay not over
        #: what it sent while not up, in order (None: nothing)
        self.held: Optional[deque[list[bytes]]] = None
        self.heldBytes = 0


class ChannelLink:
    """The channels of one connection: up while it is, unless the far side ended one (then up again under a
    new name after a delay).  Methods return what the shell must do; *ended* and *dropped* (for another
    channel's record) are the shell's exception classes for a loss."""

    def __init__(self, retryPolicy: Optional[Callable[[int], float]] = None,
                 ended: type[BaseException] = ConnectionDone,
                 dropped: type[BaseException] = ConnectionLost) -> None:
        self.ended = ended
        self.dropped = dropped
        #: times in a row a channel was ended -> seconds before it comes up again
        self.retryPolicy = retryPolicy or RECONNECT.retryPolicy()
        self.channels: dict[bytes, Channel] = {}
        self.connected = False
        #: what the channels hold (the shell bounds it)
        self.queued = 0
        self.queuedBytes = 0
        #: channel -> where its message ends in the bytes sent (before: stale)
        self.unsent: dict[bytes, int] = {}
        self._next = 0

    def open(self, channel: Channel) -> None:
        """Give the new *channel* a name no open channel has; down until ``comeUp``."""
        channels = self.channels
        while True:
            self._next = self._next % 0xFFFFFFFF + 1
            name = self._next.to_bytes(4, "big")
            if name not in channels:
                break
        channel.id = name
        channels[name] = channel

    def made(self) -> Iterator[Channel]:
        """The connection is made: each channel up now (lazily: one told may lose it)."""
        self.connected = True
        for channel in [channel for channel in self.channels.values() if not channel.waiting]:
            if self.comeUp(channel):
                yield channel

    def failed(self) -> Iterator[Channel]:
        """A connection attempt failed: each channel to tell, while open."""
        for channel in list(self.channels.values()):
            if not channel.closed:
                yield channel

    def comeUp(self, channel: Channel) -> bool:
        """*channel*'s delay is over, or it is new: whether it is up now."""
        channel.waiting = False
        if channel.closed or channel.up or not self.connected or (
                self.channels.get(channel.id) is not channel):
            return False
        channel.up = True
        return True

    def lost(self, why: object) -> list[tuple[Channel, object]]:
        """The connection is lost for *why*: the channels that were up, each
        with its reason (a record refused for its size was one ``channel``'s)."""
        self.connected = False
        self.unsent.clear()
        refused = getattr(why, "channel", None)
        others = why if refused is None else self.dropped(
            f"the connection was dropped for another channel's record: {why}")
        down = [(channel, why if refused is None or refused == channel.id else others)
                for channel in self.channels.values() if channel.up]
        for channel, _ in down:
            channel.up = False
        return down

    def received(self, channel: Channel, frames: list[bytes], sent: int = 0) -> int:
        """What *frames* on open *channel* mean, *sent* bytes having left: :data:`DELIVER`, :data:`IGNORE`
        (down), :data:`STALE` (before its message left) or :data:`ENDED` (see ``endedThere``)."""
        if not frames:
            return ENDED
        if not channel.up:
            return IGNORE
        if channel.id in self.unsent and self.stale(channel.id, sent):
            return STALE
        channel.ends = 0
        return DELIVER

    def endedThere(self, channel: Channel) -> tuple[bytes, Optional[BaseException], float]:
        """The far side ended *channel*: the record acknowledging it, the loss
        to tell (None: was down), and the seconds before ``comeUp`` (renamed)."""
        record = channel.id + END
        del self.channels[channel.id]
        self.unsent.pop(channel.id, None)
        self.open(channel)
        channel.ends += 1
        channel.waiting = True
        was, channel.up = channel.up, False
        why = self.ended("the far side ended this channel") if was else None
        return record, why, self.retryPolicy(channel.ends)

    def hold(self, channel: Channel, frames: list[bytes], size: int) -> None:
        """Keep what *channel* sent while not up, of *size* bytes (``held_bytes``)."""
        if channel.held is None:
            channel.held = deque()
        channel.held.append(list(frames))
        channel.heldBytes += size
        self.queued += 1
        self.queuedBytes += size

    def release(self, channel: Channel) -> deque[list[bytes]]:
        """What *channel* held, to send now."""
        held, channel.held = channel.held or deque(), None
        self.queued -= len(held)
        self.queuedBytes -= channel.heldBytes
        channel.heldBytes = 0
        return held

    def close(self, channel: Channel) -> Optional[bytes]:
        """*channel* is closed here: the record that ends it, or None."""
        channel.closed = True
        channel.up = channel.waiting = False
        self.release(channel)
        if self.channels.get(channel.id) is not channel:
            return None
        del self.channels[channel.id]
        self.unsent.pop(channel.id, None)
        return channel.id + END

    def closeAll(self) -> list[Channel]:
        """Close every channel; those that were open."""
        closed = list(self.channels.values())
        for channel in closed:
            self.close(channel)
        return closed

    def stale(self, name: bytes, sent: int) -> bool:
        """Whether what comes on *name* now, *sent* bytes having left, is stale."""
        until = self.unsent.get(name)
        if until is not None and sent >= until:
            del self.unsent[name]
            return False
        return until is not None
