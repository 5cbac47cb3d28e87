"""The MDP/0.2 client: Deferred-returning requests, many in flight at once.

Correlation
-----------
MDP/0.2 replies carry no request id, and the broker sends every reply to the
connection the request came from.  So the client keeps a pool of connections
(one DEALER socket each on ZeroMQ) and lets each carry **one request at a
time**: a reply on a connection belongs to the one request in flight on it.
``request()`` takes an idle connection, opens a new one while the pool is below
``maxConnections``, or waits in a local FIFO queue.

With ``stamp=True`` every request carries this client's id and a sequence
number, the same on each retry, so that workers with a reply store run it once
(:mod:`mdp.idempotence`).

Reliability (Lazy Pirate)
-------------------------
Each attempt has ``timeout`` seconds, watched by one timer for the whole client
(set for the earliest deadline; a timer per request would be created and
cancelled for nearly every request).  When it passes, the connection is closed
and thrown away — so a late reply can never reach the caller — and the request
is resent on a fresh connection, to the next broker endpoint if several are
given, up to ``retries`` attempts in all; then the Deferred fails with
:class:`~mdp.errors.RequestTimeout`.  On stream transports a broken connection
is noticed at once and the in-flight request is resent when it comes back.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp import codec, idempotence, transport
from mdp.codec import ClientFinal, ClientPartial
from mdp.errors import (
    ClientClosed,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    ServiceOverloaded,
    ServiceUnavailable,
    WorkerError,
)
from mdp.interfaces import IClient, IDealerReceiver

log = Logger()

DEFAULT_TIMEOUT = 2.5
DEFAULT_RETRIES = 3
DEFAULT_MAX_CONNECTIONS = 64

_ERRORS = {
    codec.STATUS_WORKER_ERROR: WorkerError,
    codec.STATUS_UNAVAILABLE: ServiceUnavailable,
    codec.STATUS_OVERLOADED: ServiceOverloaded,
}

Frame = Union[bytes, str]


def request_frames(frames: Sequence[Frame]) -> list[bytes]:
    """Normalise request body frames (``str`` is UTF-8 encoded)."""
    body = [f.encode("utf-8") if isinstance(f, str) else bytes(f) for f in frames]
    if not body:
        raise ValueError("an MDP request needs at least one body frame")
    return body


def remote_error(service: bytes, body: Sequence[bytes]) -> Optional[RemoteError]:
    """The typed exception an error reply stands for, or ``None``."""
    parsed = codec.parse_error_body(body)
    if parsed is None:
        return None
    code, message = parsed
    return _ERRORS.get(code, RemoteError)(service, code, message)


class _Call:
    """One request: its Deferred, attempts so far and current connection."""

    __slots__ = ("service", "body", "deferred", "onPartial", "timeout", "retries",
                 "attempts", "startedAt", "deadline", "channel")

    def __init__(self, service: bytes, body: list[bytes], timeout: float, retries: int,
                 onPartial: Optional[Callable[[list[bytes]], Any]], startedAt: float,
                 canceller: Callable[[_Call], None]) -> None:
        self.service = service
        self.body = body
        self.timeout = timeout
        self.retries = retries
        self.onPartial = onPartial
        self.startedAt = startedAt
        self.attempts = 0
        self.deadline = 0.0  # when the current attempt times out
        self.channel: Optional[_Channel] = None
        self.deferred: defer.Deferred[list[bytes]] = defer.Deferred(lambda _: canceller(self))


@implementer(IDealerReceiver)
class _Channel:
    """One connection of the pool, with at most one request in flight."""

    def __init__(self, client: Client, endpoint: str) -> None:
        self.client = client
        self.call: Optional[_Call] = None
        self.lost = False
        self.transport = transport.connect(endpoint, self, client.reactor)

    def connectionMade(self) -> None:
        if self.lost and self.call is not None:
            self.client._send(self, self.call)
        self.lost = False

    def connectionLost(self, reason: object) -> None:
        self.lost = True

    def messageReceived(self, frames: list[bytes]) -> None:
        self.client._received(self, frames)

    def close(self) -> None:
        self.call = None
        self.transport.close()


@implementer(IClient)
class Client:
    """An MDP/0.2 client of one broker (or of the first live one of several)."""

    def __init__(
        self,
        endpoint: Union[str, Sequence[str]],
        reactor: Optional[Any] = None,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        maxConnections: int = DEFAULT_MAX_CONNECTIONS,
        dialect: str = codec.RFC,
        stamp: bool = False,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints:
            raise ValueError("a client needs at least one broker endpoint")
        if retries < 1:
            raise ValueError("retries counts attempts and must be at least 1")
        self.reactor = reactor
        self.timeout = timeout
        self.retries = retries
        self.maxConnections = maxConnections
        self.dialect = codec.check_dialect(dialect)
        self.stamp = stamp
        self.clientId = uuid.uuid4().bytes
        self._sequence = itertools.count(1)
        self._endpointIndex = 0
        self._idle: list[_Channel] = []
        self._channels: set[_Channel] = set()
        self._waiting: deque[_Call] = deque()
        self._closed = False
        self._timer: Any = None  # the one DelayedCall, for the earliest deadline

    @property
    def endpoint(self) -> str:
        """The broker endpoint new connections go to."""
        return self.endpoints[self._endpointIndex]

    # --- public API ----------------------------------------------------------

    def request(
        self,
        service: Union[str, bytes],
        *frames: Frame,
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
        onPartial: Optional[Callable[[list[bytes]], Any]] = None,
    ) -> defer.Deferred[list[bytes]]:
        """Send a request; the Deferred fires with the FINAL body frames.

        *onPartial* is called with the body of every PARTIAL before that.
        Errors: :class:`RequestTimeout`, :class:`WorkerError`,
        :class:`ServiceUnavailable`, :class:`ClientClosed`; cancelling the
        Deferred abandons the request.
        """
        if self._closed:
            return defer.fail(ClientClosed("client is closed"))
        body = request_frames(frames)
        if self.stamp:
            body = idempotence.stamp(self.clientId, next(self._sequence), body)
        call = _Call(
            codec.service_name(service),
            body,
            self.timeout if timeout is None else timeout,
            self.retries if retries is None else retries,
            onPartial,
            self.reactor.seconds(),
            self._cancel,
        )
        self._waiting.append(call)
        self._pump()
        return call.deferred

    def stream(self, service: Union[str, bytes], *frames: Frame,
               timeout: Optional[float] = None) -> ReplyStream:
        """Send a request and iterate its reply parts: ``async for part in
        client.stream(...)`` yields every PARTIAL body, then the FINAL body."""
        replies = ReplyStream()
        d = self.request(service, *frames, timeout=timeout, onPartial=replies._put)
        d.addCallbacks(replies._final, replies._fail)
        return replies

    def close(self) -> defer.Deferred[None]:
        """Fail every pending request with :class:`ClientClosed` and close."""
        self._closed = True
        waiting, self._waiting = self._waiting, deque()
        for call in waiting:
            call.deferred.errback(ClientClosed("client closed"))
        for channel in list(self._channels):
            call = channel.call
            self._discard(channel)
            if call is not None:
                call.deferred.errback(ClientClosed("client closed"))
        self._stopTimer()
        return defer.succeed(None)

    # --- pool ----------------------------------------------------------------

    def _pump(self) -> None:
        while self._waiting:
            if self._idle:
                channel = self._idle.pop()
            elif len(self._channels) < self.maxConnections:
                channel = _Channel(self, self.endpoint)
                self._channels.add(channel)
            else:
                return
            call = self._waiting.popleft()
            channel.call = call
            call.channel = channel
            call.attempts += 1
            call.deadline = self.reactor.seconds() + call.timeout
            self._armTimer(call.deadline)
            self._send(channel, call)

    def _send(self, channel: _Channel, call: _Call) -> None:
        channel.transport.sendMessage(
            codec.encode(codec.ClientRequest(call.service, call.body), self.dialect)
        )

    def _discard(self, channel: _Channel) -> None:
        self._channels.discard(channel)
        if channel in self._idle:
            self._idle.remove(channel)
        channel.close()

    def _release(self, channel: _Channel) -> None:
        channel.call = None
        self._idle.append(channel)
        self._pump()

    def _armTimer(self, deadline: float) -> None:
        """Make sure the timer fires by *deadline*."""
        timer = self._timer
        if timer is not None and timer.active():
            if timer.getTime() <= deadline:
                return
            timer.cancel()
        self._timer = self.reactor.callLater(max(0.0, deadline - self.reactor.seconds()),
                                             self._sweep)

    def _stopTimer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _sweep(self) -> None:
        """The timer: time out the attempts whose deadline has come, then wait
        for the next deadline."""
        self._timer = None
        now = self.reactor.seconds() + 1e-9  # a deadline met to the float is met
        expired = [c.call for c in self._channels if c.call is not None and c.call.deadline <= now]
        for call in expired:
            self._timedOut(call)
        pending = [c.call.deadline for c in self._channels if c.call is not None]
        if pending:
            self._armTimer(min(pending))

    # --- events --------------------------------------------------------------

    def _received(self, channel: _Channel, frames: list[bytes]) -> None:
        call = channel.call
        try:
            command = codec.decode_client(codec.expect(frames, self.dialect), self.dialect)
            kind = type(command)
            if kind is not ClientPartial and kind is not ClientFinal:
                raise ProtocolError(f"broker sent a client {kind.__name__}")
            if call is None:
                raise ProtocolError("reply on a connection with no request in flight")
            if command.service != call.service and self.dialect == codec.RFC:
                raise ProtocolError(
                    f"reply for service {command.service!r} to a request for {call.service!r}"
                )
        except ProtocolError as e:
            log.warn("client dropped a message from {endpoint}: {reason}",
                     endpoint=channel.transport.endpoint, reason=e)
            return
        if kind is ClientPartial:
            if call.onPartial is not None:
                try:
                    call.onPartial(list(command.body))
                except Exception:
                    log.failure("onPartial callback for {service} failed", service=call.service)
            return
        self._release(channel)
        error = remote_error(call.service, command.body)
        if error is not None:
            call.deferred.errback(error)
        else:
            call.deferred.callback(list(command.body))

    def _timedOut(self, call: _Call) -> None:
        channel, call.channel = call.channel, None
        if channel is not None:
            self._discard(channel)
        if len(self.endpoints) > 1:
            self._endpointIndex = (self._endpointIndex + 1) % len(self.endpoints)
        if call.attempts < call.retries:
            log.info("no reply from {service} in {timeout:g}s; retrying ({attempt}/{retries})",
                     service=call.service, timeout=call.timeout,
                     attempt=call.attempts + 1, retries=call.retries)
            self._waiting.appendleft(call)
            self._pump()
            return
        self._pump()
        call.deferred.errback(
            RequestTimeout(call.service, call.attempts, self.reactor.seconds() - call.startedAt)
        )

    def _cancel(self, call: _Call) -> None:
        if call in self._waiting:
            self._waiting.remove(call)
        channel, call.channel = call.channel, None
        if channel is not None and channel.call is call:
            self._discard(channel)
            self._pump()


class ReplyStream:
    """Async iterator over the reply parts of one request (see
    :meth:`Client.stream`)."""

    def __init__(self) -> None:
        self._parts: deque[list[bytes]] = deque()
        self._done = False
        self._error: Any = None
        self._waiter: Optional[defer.Deferred[None]] = None

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.callback(None)

    def _put(self, frames: list[bytes]) -> None:
        self._parts.append(frames)
        self._wake()

    def _final(self, frames: list[bytes]) -> None:
        self._parts.append(frames)
        self._done = True
        self._wake()

    def _fail(self, failure: Any) -> None:
        self._error = failure
        self._done = True
        self._wake()

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> list[bytes]:
        while not self._parts:
            if self._done:
                if self._error is not None:
                    error, self._error = self._error, None
                    error.raiseException()
                raise StopAsyncIteration
            self._waiter = defer.Deferred()
            await self._waiter
        return self._parts.popleft()
