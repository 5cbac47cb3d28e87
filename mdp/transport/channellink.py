"""The channels of one stream connection, without I/O (``docs/transports.md``):
what the Twisted :class:`~mdp.transport.channels.StreamChannels` and the
blocking client's link (:mod:`mdp.transport.pipes`) both are, around their
own connection and timers.

Each pipe is a :class:`Channel` named by four bytes no other open channel of
the connection has.  A channel is up while the connection is, unless the far
side ended it: it then comes up again (``comeUp``) under a new name after
the reconnection delay, which its shell times.  What a pipe sends while it
is not up is held, bounded with the other pipes' together, and sent once it
is up.  A record of no frames ends a channel, from either side.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from mdp.policy import Limits, held_bytes
from mdp.transport.framing import encode_record

#: what ends a channel: a record of no frames
END = encode_record([])


class Channel:
    """One pipe's state on the connection (its shell's pipe is one)."""

    __slots__ = ("id", "up", "closed", "ends", "waiting", "held", "heldBytes")

    def __init__(self) -> None:
        #: the four bytes that name it on the connection
        self.id = b""
        self.up = False
        self.closed = False
        #: times in a row the far side ended it (paces bringing it up again)
        self.ends = 0
        #: ended by the far side: up again only once its delay is over (comeUp)
        self.waiting = False
        #: what it sent while not up, in order (None: nothing), and its cost
        self.held: Optional[deque[list[bytes]]] = None
        self.heldBytes = 0


class ChannelLink:
    """The channels of one connection and what the connection's events do
    to them; each method returns what its shell must do (write, tell)."""

    def __init__(self, limits: Limits, maxQueued: int = 1000) -> None:
        self.limits = limits
        self.maxQueued = maxQueued
        #: the open channels, by name
        self.channels: dict[bytes, Channel] = {}
        self.connected = False
        #: messages the channels hold, and their cost, bounded together
        self.queued = 0
        self.queuedBytes = 0
        #: channels whose message has not left whole yet: where it ends in
        #: what the connection sent (what comes on them meanwhile is stale)
        self.unsent: dict[bytes, int] = {}
        self._next = 0

    def open(self, channel: Channel) -> None:
        """Name the new *channel*, down until ``comeUp`` (or ``made``)."""
        self._name(channel)

    def _name(self, channel: Channel) -> None:
        """Give *channel* a name no open channel has (2³² of them before
        one comes round again: none is used twice while the far side may
        still send on it)."""
        channels = self.channels
        while True:
            self._next = self._next % 0xFFFFFFFF + 1
            name = self._next.to_bytes(4, "big")
            if name not in channels:
                break
        channel.id = name
        channels[name] = channel

    def made(self) -> list[Channel]:
        """The connection is made: the channels to bring up with it, each
        with ``comeUp`` as it is told (a callback may close another)."""
        self.connected = True
        return [channel for channel in self.channels.values()
                if not channel.up and not channel.closed and not channel.waiting]

    def comeUp(self, channel: Channel) -> bool:
        """*channel*'s delay after the far side ended it is over (or it is
        new on a connection already made): whether it is up now."""
        channel.waiting = False
        if channel.closed or channel.up or not self.connected or (
                self.channels.get(channel.id) is not channel):
            return False
        channel.up = True
        return True

    def lost(self, refused: Optional[bytes]) -> list[tuple[Channel, bool]]:
        """The connection is lost (for a record on channel *refused* over the
        limits, if it was): every channel that was up is down, with whether
        the loss is its own (else it lost it for another's record)."""
        self.connected = False
        self.unsent.clear()
        down = [(channel, refused is None or refused == channel.id)
                for channel in self.channels.values() if channel.up]
        for channel, _ in down:
            channel.up = False
        return down

    def endedThere(self, channel: Channel) -> tuple[bytes, bool]:
        """The far side ended *channel*: the record that says this side knows
        (to write), and whether it was up (to tell).  It is down under a new
        name until ``comeUp``."""
        record = channel.id + END
        del self.channels[channel.id]
        self.unsent.pop(channel.id, None)
        self._name(channel)
        channel.ends += 1
        channel.waiting = True
        was, channel.up = channel.up, False
        return record, was

    def hold(self, channel: Channel, frames: list[bytes]) -> bool:
        """Keep what *channel* sent while not up, for when it is; False if
        that is over the bounds (``maxQueued`` messages, ``maxOutputBytes``)."""
        size = held_bytes(frames)
        if self.queued >= self.maxQueued or self.queuedBytes + size > self.limits.maxOutputBytes:
            return False
        if channel.held is None:
            channel.held = deque()
        channel.held.append(list(frames))
        channel.heldBytes += size
        self.queued += 1
        self.queuedBytes += size
        return True

    def release(self, channel: Channel) -> deque[list[bytes]]:
        """What *channel* held, to send now (no longer counted here)."""
        held, channel.held = channel.held, None
        if held is None:
            return deque()
        self.queued -= len(held)
        self.queuedBytes -= channel.heldBytes
        channel.heldBytes = 0
        return held

    def close(self, channel: Channel) -> Optional[bytes]:
        """*channel* is closed here: the record that ends it (to write), or
        None if it was not open any more."""
        channel.closed = True
        channel.up = False
        channel.waiting = False
        self.release(channel)
        if self.channels.get(channel.id) is not channel:
            return None
        del self.channels[channel.id]
        self.unsent.pop(channel.id, None)
        return channel.id + END

    def closeAll(self) -> list[Channel]:
        """Every channel is closed with the connection: those that were open."""
        closed = list(self.channels.values())
        for channel in closed:
            self.close(channel)
        return closed

    def sending(self, name: bytes, until: int) -> None:
        """Channel *name*'s message ends at byte *until* of what the
        connection sends: what comes on it before that is stale."""
        self.unsent[name] = until

    def stale(self, name: bytes, sent: int) -> bool:
        """Whether what comes on channel *name* now, *sent* bytes having
        left, came before its message left whole (so cannot answer it)."""
        until = self.unsent.get(name)
        if until is None:
            return False
        if sent >= until:
            del self.unsent[name]
            return False
        return True
