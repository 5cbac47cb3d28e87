"""The MDP/0.2 client's decisions: :class:`ClientMachine`, driven by
:class:`mdp.majordomo.client.Client` and :class:`mdp.blocking.Client`.  Each request is in a
:class:`CallState`, each connection of the pool in a :class:`ChannelState` (the transitions:
docs/machines.md).  With ``stamp=True`` each request carries the client's id and a sequence
number, the same on each retry (:mod:`mdp.majordomo.idempotence`)."""

from __future__ import annotations

import enum
import errno
import functools
import itertools
import uuid
from collections import deque
from heapq import heapify, heappop, heappush
from typing import Any, Callable, Optional, Sequence, Union

from mdp.errors import (
    BrokerUnreachable,
    ClientClosed,
    OversizedMessage,
    ProtocolError,
    ReplyTooLarge,
    RequestTimeout,
    RequestTooLarge,
    StreamRestarted,
)
from mdp.machine import Machine, action_type
from mdp.majordomo import codec, idempotence
from mdp.majordomo.codec import ClientFinal, ClientPartial
from mdp.messages import Frame, remote_error, request_frames
from mdp.policy import MAX_SECONDS, EndpointRotation, Limits, whole_number

_HEADER, _FINAL, _PARTIAL = codec.CLIENT_HEADER, codec.C_FINAL, codec.C_PARTIAL
_ERROR_MARKER, _RESTART_MARKER = codec.ERROR_MARKER, codec.RESTART_MARKER
_RFC = codec.RFC
_NAMES_KEPT = 64

DEFAULT_TIMEOUT = 2.5
DEFAULT_RETRIES = 3
DEFAULT_MAX_CONNECTIONS = 64


def _check_attempts(timeout: float, retries: int) -> None:
    if not timeout > 0:  # NaN too
        raise ValueError(f"timeout must be positive, got {timeout}")
    if not timeout <= MAX_SECONDS:  # inf too: no timer takes it
        raise ValueError(f"timeout must be at most {MAX_SECONDS:g} seconds, got {timeout}")
    if retries < 1:
        raise ValueError(f"retries counts attempts and must be at least 1, got {retries}")


class CallState(enum.Enum):
    """Where one request stands (the module's table)."""

    QUEUED = "queued"
    IN_FLIGHT = "in flight"
    STREAMING = "streaming"  # PARTIALs of the current attempt were delivered
    DONE = "done"  # answered, failed or cancelled (maybe still carried, abandoned)


QUEUED, IN_FLIGHT, STREAMING, DONE = CallState


class ChannelState(enum.Enum):
    """Where one connection of the pool stands (the module's table)."""

    DOWN = "down"
    UP = "up"
    SENT = "sent"


DOWN, UP, SENT = ChannelState


_UNREACHABLE = {errno.ENOENT: "no such socket", errno.ECONNREFUSED: "connection refused"}


def unreachable(error: BaseException) -> Optional[str]:
    """Why a failed connection attempt means nobody is there at all, or None if it may be passing."""
    from twisted.internet import error as net

    if isinstance(error, net.ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, net.DNSLookupError):
        return "host not found"
    # (a ConnectError's code, or that of the blocking driver's plain sockets)
    return _UNREACHABLE.get(getattr(error, "osError" if isinstance(error, net.ConnectError)
                                    else "errno", None))


class _Call:
    """One request: its attempts and where it is; the driver hangs its
    Deferred or ``result`` and callbacks on it."""

    __slots__ = ("service", "message", "deferred", "result", "onPartial", "onRestart", "timeout",
                 "retries", "attempts", "startedAt", "deadline", "channel", "state", "tried")

    def __init__(self, service: bytes, message: list[bytes], timeout: float, retries: int,
                 onPartial: Optional[Callable[[list[bytes]], Any]],
                 onRestart: Optional[Callable[[], Any]], startedAt: float) -> None:
        self.service = service
        self.message = message
        self.timeout = timeout
        self.retries = retries
        self.onPartial = onPartial
        self.onRestart = onRestart
        self.startedAt = startedAt
        self.attempts = 1
        self.deadline = startedAt + timeout  # of the current attempt
        self.channel: Optional[_Channel] = None
        self.state = QUEUED  # (a DONE one may linger in the FIFO)
        self.tried: list[str] = []
        self.deferred: Any = None
        self.result: Any = None  # the blocking driver's reply frames or error

    @property
    def done(self) -> bool:
        return self.state is DONE


class _Channel:
    """One connection of the pool, with at most one request in flight; the
    driver hangs the transport on ``pipe``."""

    __slots__ = ("endpoint", "call", "state", "pipe")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.call: Optional[_Call] = None  # a done one is abandoned, its reply due
        self.state = DOWN
        self.pipe: Any = None

    @property
    def up(self) -> bool:
        return self.state is not DOWN


# --- what the machine asks its driver to do -------------------------------------------

_action = functools.partial(action_type, __name__)
OpenChannel = _action("OpenChannel", "channel")
CloseChannel = _action("CloseChannel", "channel")
SendOn = _action("SendOn", "channel", "frames")
Partial = _action("Partial", "call", "body")
Restarted = _action("Restarted", "call")
Complete = _action("Complete", "call", "body")
Fail = _action("Fail", "call", "error")
#: call :meth:`ClientMachine.handleWake` by *when* (``None``: no need)
WakeAt = _action("WakeAt", "when")
Dropped = _action("Dropped", "endpoint", "reason")
Retrying = _action("Retrying", "call", "attempt")

Action = Any  # one of the above


class ClientMachine(Machine):
    """The client's decisions (the module's tables); bad options raise
    ``TypeError``/``ValueError`` at once."""

    def __init__(self, endpoints: list[str], *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES,
                 maxConnections: int = DEFAULT_MAX_CONNECTIONS, dialect: str = codec.RFC,
                 stamp: bool = False, limits: Limits = Limits(), now: float = 0.0) -> None:
        super().__init__(now)
        _check_attempts(timeout, retries)
        whole_number("maxConnections", maxConnections)
        self._rotation = EndpointRotation(endpoints)
        self.timeout = timeout
        self.retries = retries
        self.maxConnections = maxConnections
        self.dialect = codec.check_dialect(dialect)
        self.stamp = stamp
        self.limits = limits
        self.clientId = uuid.uuid4().bytes
        self._sequence = itertools.count(1)
        self._names: dict[Union[str, bytes], bytes] = {}  # caller's name -> wire bytes
        self._idle: list[_Channel] = []
        self._channels: set[_Channel] = set()
        self._waiting: deque[_Call] = deque()
        self._waitingDone = 0  # done calls still in _waiting
        self._live = 0
        self.closed = False
        self._abandoned = 0  # at least the connections kept for a done request's reply
        #: (deadline, order, call) for every attempt; stale entries are skipped
        self._deadlines: list[tuple[float, int, _Call]] = []
        self._order = itertools.count()
        self._wakeAt: Optional[float] = None
        self._everUp = False
        self._failures: dict[str, str] = {}
        self._unreachable: dict[str, str] = {}

    @property
    def endpoints(self) -> list[str]:
        return self._rotation.endpoints

    @property
    def endpoint(self) -> str:
        return self._rotation.current

    def newCall(self, service: Union[str, bytes], frames: Sequence[Frame], timeout: Optional[float],
                retries: Optional[int], onPartial: Optional[Callable[[list[bytes]], Any]],
                onRestart: Optional[Callable[[], Any]], now: float) -> _Call:
        """A request for :meth:`handleRequest`; raises for caller mistakes and once closed."""
        name = self._names.get(service) if type(service) in (str, bytes) else None
        if name is None:
            name = self._serviceName(service)
        mmi = name.startswith(b"mmi.")
        # MDP/0.2 wants a body: an MMI query without frames sends one empty frame
        body = request_frames(frames, empty=mmi) or [b""]
        if timeout is None and retries is None:
            timeout, retries = self.timeout, self.retries
        else:
            timeout, retries = self.attempts(timeout, retries)
        if self.closed:
            raise ClientClosed("client is closed")
        return _Call(name, self._encode(name, body, mmi), timeout, retries, onPartial,
                     onRestart, now)

    def _encode(self, name: bytes, body: list[bytes], mmi: bool) -> list[bytes]:
        """The REQUEST, stamped unless an MMI query; :class:`RequestTooLarge` if too large."""
        if self.stamp and not mmi:
            body = idempotence.stamp(self.clientId, next(self._sequence), body)
        if self.dialect == _RFC:
            message = [_HEADER, codec.C_REQUEST, name, *body]
        else:
            message = codec.encode(codec.ClientRequest(name, body), self.dialect)
        limits = self.limits
        size = sum(map(len, message))
        if size > limits.maxMessageBytes or len(message) > limits.maxFrames:
            raise RequestTooLarge(f"request to {name.decode()!r} not sent: "
                                  f"{limits.oversize(size, len(message))}")
        return message

    def _serviceName(self, service: Union[str, bytes]) -> bytes:
        """*service* on the wire, checked, and kept for the next requests."""
        name = codec.api_service_name(service)
        if len(self._names) >= _NAMES_KEPT:
            self._names.clear()
        self._names[service] = name
        return name

    def attempts(self, timeout: Optional[float], retries: Optional[int]) -> tuple[float, int]:
        """A request's *timeout* and *retries* (None: the client's), checked."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        _check_attempts(timeout, retries)
        return timeout, retries

    def fresh(self, now: float) -> ClientMachine:
        """A machine with this one's options and stamps and nothing in flight (closed if this one is)."""
        machine = ClientMachine(self.endpoints, timeout=self.timeout, retries=self.retries,
                                maxConnections=self.maxConnections, dialect=self.dialect,
                                stamp=self.stamp, limits=self.limits, now=now)
        machine.clientId, machine._sequence = self.clientId, self._sequence
        machine.closed = self.closed
        return machine

    def holds(self, channel: _Channel) -> bool:
        """*channel* is one of the pool (not given up)."""
        return channel in self._channels

    def handleRequest(self, call: _Call, now: float) -> list[Action]:
        self.now = now
        self._live += 1
        self._schedule(call)
        idle = self._idle
        if idle and not self._waiting and not self.closed:
            self._assign(idle.pop(), call)
        else:
            self._enqueue(call)
            self._pump()
        outbox, self._outbox = self._outbox, []  # (_drain, inlined)
        return outbox

    def handlePipeUp(self, channel: _Channel, now: float) -> list[Action]:
        self.now = now
        if channel.state is DOWN:
            channel.state = UP
        self._everUp = True
        if self._failures:
            self._failures.pop(channel.endpoint, None)
            self._unreachable.clear()
        self._sendOn(channel)
        return self._drain()

    def handleConnectFailed(self, channel: _Channel, error: BaseException, now: float) -> list[Action]:
        """A connection attempt failed.  Until some broker was reached, an endpoint nobody is at is left at
        once, and when all are so, pending requests fail with :class:`BrokerUnreachable`."""
        self.now = now
        if channel not in self._channels:
            return self._drain()
        why = unreachable(error)
        self._failures[channel.endpoint] = why or str(error)
        if self._everUp or why is None:
            return self._drain()
        self._unreachable[channel.endpoint] = why
        if all(e in self._unreachable for e in self._rotation.endpoints):
            failures = {e: self._unreachable[e] for e in self._rotation.endpoints}
            self._failPending(lambda: BrokerUnreachable(failures))
            self._failures.clear()
            self._unreachable.clear()
            return self._drain()
        call = channel.call
        self._discard(channel)
        while self._rotation.current in self._unreachable:
            self._moveOn()
        if call is not None and not call.done:
            self._enqueue(call, first=True)
        self._pump()
        return self._drain()

    def handlePipeLost(self, channel: _Channel, why: object, now: float) -> list[Action]:
        """A connection was lost; its request goes out again when it is back,
        unless the reply was over this client's limits."""
        self.now = now
        if why is not None and channel in self._channels:
            self._failures[channel.endpoint] = f"connection lost: {why}"
        channel.state = DOWN
        call = channel.call
        if call is not None:
            if not call.done and isinstance(why, OversizedMessage):
                self._fail(call, ReplyTooLarge(
                    f"reply from service {call.service.decode('ascii', 'replace')!r} too "
                    f"large for this client, dropped: {why}"))
            if not call.done:
                self._restart(call)
            if call.done:  # an abandoned reply can no longer come
                self._release(channel)
        return self._drain()

    def handleOpenFailed(self, channel: _Channel, error: BaseException, now: float) -> list[Action]:
        self.now = now
        call = channel.call
        self._channels.discard(channel)
        if call is not None:
            call.channel = None
            self._fail(call, error)
        return self._drain()

    def handleMessage(self, channel: _Channel, frames: list[bytes], now: float) -> list[Action]:
        """A message on *channel*: its request's reply or part; else dropped."""
        self.now = now
        call = channel.call
        command = frames[1] if len(frames) > 3 else None
        final = command == _FINAL
        if (call is not None and (final or command == _PARTIAL) and frames[0] == _HEADER
                and frames[2] == call.service and self.dialect == _RFC):
            self._reply(channel, call, final, frames[3:])
        else:
            self._decoded(channel, call, frames)
        outbox, self._outbox = self._outbox, []
        return outbox

    def handleCancel(self, call: _Call, now: float) -> list[Action]:
        self.now = now
        if self._done(call):
            channel = call.channel
            if channel is not None and channel.call is call and channel.state is not SENT:
                self._release(channel)
            elif self._abandon(call) and len(self._waiting) > self._waitingDone:
                # (at the next wake-up: a batch cancel would hand it round in turn)
                self._wakeBy(now)
        return self._drain()

    def handleWake(self, now: float) -> list[Action]:
        self.now = now
        self._wakeAt = None
        self._sweep()
        self._pump()  # (after a cancel, see handleCancel)
        return self._drain()

    def handleClose(self, now: float) -> list[Action]:
        """Fail every pending request with :class:`ClientClosed`; close all."""
        self.now = now
        self.closed = True
        if self._wakeAt is not None:
            self._wakeAt = None
            self._outbox.append(WakeAt(None))
        self._failPending(lambda: ClientClosed("client closed"))
        self._deadlines.clear()
        return self._drain()

    def _failPending(self, error: Callable[[], BaseException]) -> None:
        """Fail every request not done with its own *error()*; close every connection."""
        calls = {id(e[2]): e[2] for e in sorted(self._deadlines) if not e[2].done}.values()
        self._waiting.clear()
        for channel in list(self._channels):
            self._discard(channel)
        for call in calls:
            call.channel = None
            self._fail(call, error())
        self._waitingDone = 0

    def _assign(self, channel: _Channel, call: _Call) -> None:
        channel.call = call
        call.channel = channel
        call.state = IN_FLIGHT
        tried = call.tried
        if channel.endpoint not in tried:
            tried.append(channel.endpoint)
        if channel.state is not DOWN:
            channel.state = UP
            self._sendOn(channel)

    def _sendOn(self, channel: _Channel) -> None:
        call = channel.call
        if channel.state is UP and call is not None and call.state is not DONE:
            channel.state = SENT
            self._outbox.append(SendOn(channel, call.message))  # type: ignore[arg-type]

    def _enqueue(self, call: _Call, first: bool = False) -> None:
        call.state = QUEUED
        if first:
            self._waiting.appendleft(call)
        else:
            self._waiting.append(call)

    def _pump(self) -> None:
        if self.closed:
            return
        waiting = self._waiting
        while waiting:
            call = waiting[0]
            if call.state is DONE:
                waiting.popleft()
                self._waitingDone -= 1
                continue
            if self._idle:
                channel = self._idle.pop()
            elif len(self._channels) < self.maxConnections:
                channel = _Channel(self.endpoint)
                self._channels.add(channel)
                self._outbox.append(OpenChannel(channel))
            elif self._abandoned and self._reclaim():
                continue
            else:
                return
            waiting.popleft()
            self._assign(channel, call)

    def _reclaim(self) -> bool:
        """Close a connection kept only for a done request's reply; False if none."""
        for channel in self._channels:
            call = channel.call
            if call is not None and call.state is DONE:
                self._abandoned -= 1
                self._discard(channel)
                return True
        self._abandoned = 0
        return False

    def _discard(self, channel: _Channel) -> None:
        self._channels.discard(channel)
        if channel in self._idle:
            self._idle.remove(channel)
        call = channel.call
        if call is not None and call.channel is channel:
            call.channel = None
        channel.call = None
        self._outbox.append(CloseChannel(channel))

    def _release(self, channel: _Channel) -> None:
        """*channel* is free: it serves the next request, unless its broker was left."""
        call = channel.call
        channel.call = None
        if channel.state is SENT:
            channel.state = UP
        if call is not None and call.channel is channel:
            call.channel = None
        if channel.endpoint == self._rotation.current:
            self._idle.append(channel)
        else:
            self._discard(channel)
        if self._waiting:
            self._pump()

    def _moveOn(self) -> None:
        """Fail over to the next broker; close the idle connections to the one left."""
        self._rotation.advance()
        current = self._rotation.current
        for channel in [c for c in self._idle if c.endpoint != current]:
            self._discard(channel)

    def _schedule(self, call: _Call) -> None:
        deadline = call.deadline
        heap = self._deadlines
        if len(heap) > 2 * (self._live + len(self._channels)) + 1024:
            # (in place: _sweep may hold this list)
            heap[:] = [e for e in heap if self._watched(e)]
            heapify(heap)
        heappush(heap, (deadline, next(self._order), call))
        self._wakeBy(deadline)

    @staticmethod
    def _watched(entry: tuple[float, int, _Call]) -> bool:
        """The entry is of a current attempt, or of an abandoned call still carried."""
        deadline, _, call = entry
        if call.deadline != deadline:
            return False
        return not call.done or call.channel is not None

    def _wakeBy(self, deadline: float) -> None:
        if self._wakeAt is not None and self._wakeAt <= deadline:
            return
        self._wakeAt = deadline
        self._outbox.append(WakeAt(deadline))

    def _sweep(self) -> None:
        now = self.now + 1e-9  # a deadline met to the float is met
        heap = self._deadlines
        due = []
        while heap and heap[0][0] <= now:
            entry = heappop(heap)
            if self._watched(entry):
                due.append(entry[2])
        # the wake-up for what is left comes before any callback of what is due:
        # the blocking driver waits inside a callback that makes a request
        self._wakeByHead()
        # queued ones first, so that a freed connection goes to no expired request
        for call in sorted(due, key=lambda call: call.state is not QUEUED):
            self._expired(call)
        self._wakeByHead()

    def _wakeByHead(self) -> None:
        """Ask for a wake-up by the earliest deadline still watched."""
        heap = self._deadlines
        while heap and not self._watched(heap[0]):
            heappop(heap)
        if heap:
            self._wakeBy(heap[0][0])

    def _decoded(self, channel: _Channel, call: Optional[_Call], frames: list[bytes]) -> None:
        """A message not plainly a reply to the request in flight: decoded in full, or dropped."""
        try:
            command = codec.decode(codec.expect(frames, self.dialect, codec.CLIENT_HEADER), self.dialect)
            kind = type(command)
            if kind is not ClientPartial and kind is not ClientFinal:
                raise ProtocolError(f"broker sent a client {kind.__name__}")
            if call is not None and command.service != call.service and self.dialect == _RFC:
                raise ProtocolError(
                    f"reply for service {command.service!r} to a request for {call.service!r}")
        except ProtocolError as e:
            self._outbox.append(Dropped(channel.endpoint, str(e)))
            return
        if call is None:
            self._outbox.append(Dropped(channel.endpoint, f"a {kind.__name__} on a connection "
                                        "with no request in flight (connection replaced)"))
            self._discard(channel)
            return
        self._reply(channel, call, kind is ClientFinal, command.body)

    def _reply(self, channel: _Channel, call: _Call, final: bool, body: list[bytes]) -> None:
        """The FINAL or a PARTIAL of *call* (discarded if it is done)."""
        if final:
            self._release(channel)
            if len(body) == 3 and body[0] == _ERROR_MARKER:
                self._fail(call, remote_error(call.service, body))  # type: ignore[arg-type]
            elif self._done(call):
                self._outbox.append(Complete(call, body))
        elif call.state is not DONE:
            if len(body) == 1 and body[0] == _RESTART_MARKER:
                self._restart(call)
            else:
                call.state = STREAMING
                self._outbox.append(Partial(call, body))

    def _restart(self, call: _Call) -> None:
        """The reply of *call* starts over: a STREAMING call is IN_FLIGHT again."""
        if call.state is STREAMING:
            call.state = IN_FLIGHT
            self._restarted(call)

    def _restarted(self, call: _Call) -> None:
        """Tell the caller, or fail *call* if it gave no ``onRestart``."""
        if call.onRestart is None:
            self._fail(call, StreamRestarted(
                f"the reply stream of the request to {call.service.decode('ascii', 'replace')!r} "
                "started over; pass onRestart to accept restarts"))
            return
        self._outbox.append(Restarted(call))

    def _expired(self, call: _Call) -> None:
        """The current attempt of *call* ran out (or, abandoned, its reply never came)."""
        channel = call.channel
        if call.state is DONE:  # abandoned and unanswered
            if channel is not None:
                self._discard(channel)
                self._pump()
            return
        streamed = call.state is STREAMING
        if channel is not None:
            self._discard(channel)
            if channel.endpoint == self._rotation.current:
                self._moveOn()
        if call.attempts >= call.retries or (streamed and call.onRestart is None):
            self._fail(call, RequestTimeout(call.service, call.attempts,
                                            self.now - call.startedAt,
                                            call.tried or [self._rotation.current],
                                            failures=self._failures))
            self._pump()
        else:
            self._retry(call, streamed)

    def _retry(self, call: _Call, streamed: bool) -> None:
        """The next attempt of *call*, at the head of the FIFO."""
        call.attempts += 1
        self._outbox.append(Retrying(call, call.attempts))
        call.deadline = self.now + call.timeout
        self._schedule(call)
        if call.state is not QUEUED:
            self._enqueue(call, first=True)
        # in place before onRestart runs: it may cancel or close
        if streamed:
            self._restarted(call)
        self._pump()

    def _done(self, call: _Call) -> bool:
        """Mark *call* DONE; False if it already was."""
        state = call.state
        if state is DONE:
            return False
        call.state = DONE
        self._live -= 1
        call.message = call.onPartial = call.onRestart = None  # (the caller's callbacks go too)
        if state is QUEUED:
            self._waitingDone += 1
            waiting = self._waiting
            if self._waitingDone > 64 and 2 * self._waitingDone > len(waiting):
                # in place: _pump may be iterating this very deque
                kept = [c for c in waiting if c.state is not DONE]
                waiting.clear()
                waiting.extend(kept)
                self._waitingDone = 0
        # stale entries left for the sweep would make full GC passes frequent
        heap = self._deadlines
        while heap and not self._watched(heap[0]):
            heappop(heap)
        return True

    def _fail(self, call: _Call, error: BaseException) -> None:
        if self._done(call):
            self._outbox.append(Fail(call, error))
            if self._abandon(call):
                self._pump()

    def _abandon(self, call: _Call) -> bool:
        """*call* just became DONE: whether its connection is kept for the reply."""
        channel = call.channel
        if channel is not None and channel.call is call and channel.state is SENT:
            self._abandoned += 1
            return True
        return False
