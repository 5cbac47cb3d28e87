"""SP REQ, REP and device as pure state machines (see :mod:`mdp.machine`); a *channel*
is one connection to a peer."""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from typing import Any, Hashable, Optional

import attrs

from mdp.errors import ProtocolError
from mdp.machine import Machine, action_type
from mdp.policy import DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_BYTES
from mdp.sp.codec import BOTTOM, DEFAULT_MAX_HOPS, ID_MASK, id_sequence, pop_word, split_backtrace, word

DEFAULT_RESEND = 60.0  # seconds before a request without a reply is sent again (nng's default)

Channel = Hashable


_action = functools.partial(action_type, __name__)
SendOn = _action("SendOn", "channel", "body")
Forward = _action("Forward", "body")  # a device: send *body* upstream
Complete = _action("Complete", "requestId", "payload")  # request *requestId* has its reply
Serve = _action("Serve", "token", "payload")  # run the handler on *payload*; answer with *token*
Dropped = _action("Dropped", "channel", "reason")  # something was dropped (the driver logs it)
Overloaded = _action("Overloaded", "channel", "reason")  # a request dropped: as many as allowed are in hand
WakeAt = _action("WakeAt", "when")  # call ``handleWake`` at *when* (None: no timer needed)


@attrs.define(eq=False)
class _Request:
    requestId: int
    body: bytes
    serial: int  # resends due together go in this order
    channel: Optional[Channel] = None
    resendAt: float = 0.0


class ReqMachine(Machine):
    """The requesting side; *firstId* seeds the request ids.

    Every request waits the same resend interval, so those sent fall due in
    the order they went: ``_sent`` keeps that order (sorted again if the
    clock goes back), its first the next due."""

    def __init__(self, firstId: int, *, resend: float = DEFAULT_RESEND, now: float = 0.0) -> None:
        super().__init__(now)
        if not resend > 0:
            raise ValueError(f"resend must be positive seconds, got {resend!r}")
        self.resend = resend
        self.ids = id_sequence(firstId)
        self.channels: list[Channel] = []
        self._turn = 0
        #: every request out, oldest first (those waiting for a channel have none)
        self.requests: dict[int, _Request] = {}
        self._sent: OrderedDict[int, _Request] = OrderedDict()  # those on a channel, by deadline
        self.wakeAt: Optional[float] = None
        self._serials = itertools.count()

    def handleRequest(self, payload: bytes, now: float) -> tuple[int, list[Any]]:
        self.now = now
        requestId = next(self.ids) | BOTTOM
        request = _Request(requestId, word(requestId) + payload, next(self._serials))
        self.requests[requestId] = request
        self._send(request)
        return requestId, self._drain()

    def handleChannelUp(self, channel: Channel, now: float) -> list[Any]:
        self.now = now
        if channel not in self.channels:
            self.channels.append(channel)
        for request in [r for r in self.requests.values() if r.channel is None]:
            self._send(request)
        return self._drain()

    def handleChannelDown(self, channel: Channel, now: float) -> list[Any]:
        """Its requests go out again on the others, oldest first."""
        self.now = now
        if channel in self.channels:
            index = self.channels.index(channel)
            del self.channels[index]  # (the turn stays with the channel that was next)
            self._turn = (self._turn - (index < self._turn)) % max(len(self.channels), 1)
        for request in list(self.requests.values()):
            if request.channel == channel:
                self._send(request)
        return self._drain()

    def handleReply(self, channel: Channel, body: bytes, now: float) -> list[Any]:
        self.now = now
        try:
            requestId, payload = pop_word(body)
        except ProtocolError as e:
            return [Dropped(channel, str(e))]
        if not self._forget(requestId):
            return [Dropped(channel, f"reply to request 0x{requestId:08x}, which is not "
                                     "in flight (late, duplicate or stray)")]
        self._emit(Complete(requestId, payload))
        return self._drain()

    def handleCancel(self, requestId: int, now: float) -> list[Any]:
        self.now = now
        self._forget(requestId)
        return self._drain()

    def _forget(self, requestId: int) -> bool:
        if self.requests.pop(requestId, None) is None:
            return False
        self._sent.pop(requestId, None)
        return True

    def handleWake(self, now: float) -> list[Any]:
        """Resend the requests whose resend interval is over, oldest first."""
        self.now = now
        self.wakeAt = None
        due = itertools.takewhile(lambda request: request.resendAt <= now, self._sent.values())
        for request in sorted(due, key=lambda request: request.serial):
            self._send(request)
        return self._drain()

    def _send(self, request: _Request) -> None:
        self._sent.pop(request.requestId, None)
        if not self.channels:
            request.channel = None
            return
        channel = self.channels[self._turn % len(self.channels)]
        self._turn = (self._turn + 1) % len(self.channels)
        request.channel = channel
        request.resendAt = self.now + self.resend
        sent = self._sent
        late = sent and next(reversed(sent.values())).resendAt > request.resendAt
        sent[request.requestId] = request
        if late:  # the clock went back: keep the deadlines in order
            self._sent = OrderedDict(sorted(sent.items(), key=lambda item: item[1].resendAt))
        self._emit(SendOn(channel, request.body))

    def _drain(self) -> list[Any]:
        """The actions, and a wake-up at the first resend deadline if it changed."""
        when = next(iter(self._sent.values())).resendAt if self._sent else None
        if when != self.wakeAt:
            self.wakeAt = when
            self._emit(WakeAt(when))
        return super()._drain()


class _ChannelMachine(Machine):
    """What a REP side and a device share: the hop limit, and a 31-bit id for
    each channel, never one in use."""

    def __init__(self, firstChannelId: int, *, maxHops: int = DEFAULT_MAX_HOPS, now: float = 0.0) -> None:
        super().__init__(now)
        self.maxHops = maxHops
        self.channelIds = id_sequence(firstChannelId)
        self.byChannel: dict[Channel, int] = {}
        self.byId: dict[int, Channel] = {}

    def handleChannelDown(self, channel: Channel, now: float) -> list[Any]:
        self.now = now
        self.byId.pop(self.byChannel.pop(channel, None), None)  # (None: a channel without an id)
        return []

    def _idOf(self, channel: Channel) -> int:
        if channel not in self.byChannel:
            number = next(n for n in self.channelIds if n not in self.byId)
            self.byChannel[channel], self.byId[number] = number, channel
        return self.byChannel[channel]


class RepMachine(_ChannelMachine):
    """The replying end: runs each request once per backtrace and channel at a time."""

    def __init__(self, firstChannelId: int, *, maxHops: int = DEFAULT_MAX_HOPS,
                 maxPending: int = DEFAULT_MAX_PENDING,
                 maxPendingBytes: int = DEFAULT_MAX_PENDING_BYTES, now: float = 0.0) -> None:
        super().__init__(firstChannelId, maxHops=maxHops, now=now)
        if maxPending < 1 or maxPendingBytes < 1:
            raise ValueError(f"maxPending and maxPendingBytes must be at least 1, got "
                             f"{maxPending} and {maxPendingBytes}")
        self.maxPending, self.maxPendingBytes = maxPending, maxPendingBytes
        #: (channel, backtrace) of requests being handled: their payload's size
        self.inHand: dict[tuple[Channel, bytes], int] = {}
        self.pendingBytes = 0

    def handleRequest(self, channel: Channel, body: bytes, now: float) -> list[Any]:
        self.now = now
        self._idOf(channel)
        try:
            backtrace, payload = split_backtrace(body, self.maxHops)
        except ProtocolError as e:
            return [Dropped(channel, str(e))]
        token = (channel, backtrace)
        if token in self.inHand:
            return [Dropped(channel, "a resent copy of a request in hand")]
        size = len(payload)
        # one request always gets in, however large: it would never get in otherwise
        if len(self.inHand) >= self.maxPending or (
                self.inHand and self.pendingBytes + size > self.maxPendingBytes):
            return [Overloaded(channel, (
                f"{len(self.inHand)} requests ({self.pendingBytes} bytes) in hand already, as many as "
                f"allowed (maxPending {self.maxPending}, maxPendingBytes {self.maxPendingBytes}); its "
                "requester sends it again later"))]
        self.inHand[token] = size
        self.pendingBytes += size
        return [Serve(token, payload)]

    def handleReply(self, token: tuple[Channel, bytes], payload: Optional[bytes], now: float) -> list[Any]:
        """The handler's reply for *token* (None: it cancelled, no reply)."""
        self.now = now
        size = self.inHand.pop(token, None)
        if size is None:
            return []
        self.pendingBytes -= size
        channel, backtrace = token
        if payload is None:
            return []
        if channel not in self.byChannel:
            return [Dropped(channel, "reply for a channel that is gone")]
        return [SendOn(channel, backtrace + payload)]


class DeviceMachine(_ChannelMachine):
    """A device's REP side: requests go upstream with their channel's id pushed;
    replies go to the channel their first word names."""

    def handleRequest(self, channel: Channel, body: bytes, now: float) -> list[Any]:
        """:class:`Forward`, or :class:`Dropped` over the hop limit (counting ours)."""
        self.now = now
        upstream = word(self._idOf(channel)) + body
        try:
            split_backtrace(upstream, self.maxHops)
        except ProtocolError as e:
            return [Dropped(channel, str(e))]
        return [Forward(upstream)]

    def handleReply(self, body: bytes, now: float) -> list[Any]:
        self.now = now
        try:
            number, rest = pop_word(body)
        except ProtocolError as e:
            return [Dropped(None, str(e))]
        channel = self.byId.get(number & ID_MASK) if not number & BOTTOM else None
        if channel is None:
            return [Dropped(None, f"reply for channel 0x{number:08x}, which is not one of ours")]
        return [SendOn(channel, rest)]
