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
import math
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
from mdp.majordomo import codec, extension, idempotence
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
#: seconds a broker has to answer ``mmi.extensions`` (ours answers at once; an RFC 18 one
#: may never), on one of the client's connections
PROBE_TIMEOUT = 1.0
#: seconds until a broker that did not answer it is asked again, doubling up to the most
ASK_AGAIN_FIRST, ASK_AGAIN_MAX = 60.0, 3600.0


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
                 "retries", "attempts", "startedAt", "deadline", "channel", "state", "tried", "trace")

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
        #: the W3C trace context it carries where the broker takes it: (traceparent, tracestate)
        self.trace: Optional[tuple[bytes, Optional[bytes]]] = None

    @property
    def done(self) -> bool:
        return self.state is DONE


class _Channel:
    """One connection of the pool, with at most one request in flight; the
    driver hangs the transport on ``pipe``."""

    __slots__ = ("endpoint", "call", "state", "pipe", "context")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.call: Optional[_Call] = None  # a done one is abandoned, its reply due
        self.state = DOWN
        self.pipe: Any = None
        self.context = False  # its request went with a context frame: CANCEL may follow

    @property
    def up(self) -> bool:
        return self.state is not DOWN


# --- what the machine asks its driver to do -------------------------------------------

_action = functools.partial(action_type, __name__)
OpenChannel = _action("OpenChannel", "channel")
CloseChannel = _action("CloseChannel", "channel")
SendOn = _action("SendOn", "channel", "frames")
#: send CANCEL on *channel*, whose request is done (the broker's answer frees it)
CancelOn = _action("CancelOn", "channel", "frames")
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
                 stamp: bool = False, limits: Limits = Limits(), extensions: bool = True,
                 now: float = 0.0) -> None:
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
        #: whether requests carry their deadline and may be cancelled at the broker: asked
        #: of each broker, with *extensions* and the RFC dialect (docs/mdp.md)
        self.extensions = extensions and self.dialect == _RFC and maxConnections > 1
        #: the current broker takes the request-context extension (None: not known yet)
        self.extended: Optional[bool] = None if self.extensions else False
        self._probe: Optional[_Call] = None  # the mmi.extensions request asking it
        #: when to ask again a broker that did not answer, and the wait after that
        self._askAgainAt: Optional[float] = None
        self._askAgainIn = ASK_AGAIN_FIRST

    @property
    def endpoints(self) -> list[str]:
        return self._rotation.endpoints

    @property
    def endpoint(self) -> str:
        return self._rotation.current

    def newCall(self, service: Union[str, bytes], frames: Sequence[Frame], timeout: Optional[float],
                retries: Optional[int], onPartial: Optional[Callable[[list[bytes]], Any]],
                onRestart: Optional[Callable[[], Any]], now: float,
                within: Optional[float] = None) -> _Call:
        """A request for :meth:`handleRequest`; raises for caller mistakes and once closed.
        *within*: seconds left of a deadline it serves (a handler's), which its attempts keep to."""
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
        if within is not None and timeout * retries > within:
            timeout = min(timeout, max(within, 0.001))
            retries = max(1, min(retries, int(within / timeout)))
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
                                stamp=self.stamp, limits=self.limits, extensions=self.extensions,
                                now=now)
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
        if self._probe is None and not self.closed and (
                self.extended is None or (self._askAgainAt is not None and now >= self._askAgainAt)):
            self._askAgainAt = None
            self._askExtensions()
        outbox, self._outbox = self._outbox, []  # (_drain, inlined)
        return outbox

    def _askExtensions(self) -> None:
        """Ask the broker (``mmi.extensions``) whether it takes request contexts, on the
        first connection its request frees (so the broker holds no connection more); until it
        answers, requests go without (a broker that never answers: none, at the timeout)."""
        name = extension.MMI_EXTENSIONS
        self._probe = _Call(name, [_HEADER, codec.C_REQUEST, name, b""],
                            min(self.timeout, PROBE_TIMEOUT), 1, None, None, self.now)

    def _sendProbe(self, channel: _Channel) -> bool:
        """Send the probe on *channel*, just freed, if it waits and nothing else does."""
        probe = self._probe
        if (probe is None or probe.state is not QUEUED or self._waiting or self.closed
                or channel.endpoint != self._rotation.current):
            return False
        probe.startedAt, probe.deadline = self.now, self.now + probe.timeout
        self._live += 1
        self._schedule(probe)
        self._assign(channel, probe)
        return True

    def _probed(self, call: _Call, reply: Optional[list[bytes]]) -> None:
        """The probe's *reply* (None: it failed): what the broker it went to takes.  An
        answer is final for that broker; no answer, and it is asked again later (a minute,
        doubling to an hour: an RFC 18 broker may never answer)."""
        self._probe = None
        if not call.tried or call.tried[0] != self._rotation.current:
            return
        self.extended = reply is not None and extension.takes_extensions(reply)
        if reply is None:
            self._askAgainAt = self.now + self._askAgainIn
            self._askAgainIn = min(self._askAgainIn * 2, ASK_AGAIN_MAX)

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
            if self.extensions and channel.endpoint == self._rotation.current:
                self.extended, self._askAgainIn = None, ASK_AGAIN_FIRST  # (maybe restarted)
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
            call = channel.call
            if channel.state is SENT and call is not None and not call.done:
                self._cancelOn(channel, call)  # (a broker that takes CANCEL lets it go)
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
            message = call.message
            # (what is known of the current broker alone: a channel may outlive a failover)
            channel.context = (self.extended is True and channel.endpoint == self._rotation.current
                               and call is not self._probe and not call.service.startswith(b"mmi."))
            if channel.context:
                message = [*message[:3], self._contextFrame(call), *message[3:]]
            self._outbox.append(SendOn(channel, message))  # type: ignore[arg-type]

    def _contextFrame(self, call: _Call) -> bytes:
        """The attempt's time left (rounded up: no hop gives up before this client), and the
        call's trace context (a ``tracestate`` the broker would refuse is left out)."""
        left = min(max(1, math.ceil((call.deadline - self.now) * 1000)), extension.MAX_DEADLINE_MS)
        parent, state = call.trace if call.trace is not None else (None, None)
        if state is not None and not 0 < len(state) <= extension.MAX_TRACESTATE:
            state = None
        return extension.encode_context(extension.RequestContext(left, parent, state))

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
        if channel.endpoint != self._rotation.current:
            self._discard(channel)
        elif not self._sendProbe(channel):
            self._idle.append(channel)
        if self._waiting:
            self._pump()

    def _moveOn(self) -> None:
        """Fail over to the next broker; close the idle connections to the one left."""
        left = self._rotation.current
        self._rotation.advance()
        if self.extensions and self._rotation.current != left:
            self.extended, self._askAgainIn = None, ASK_AGAIN_FIRST  # (another broker: asked anew)
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
            if call is self._probe:
                if self._done(call):
                    self._probed(call, body)
            elif len(body) == 3 and body[0] == _ERROR_MARKER:
                self._failed(call, body)
            elif self._done(call):
                self._outbox.append(Complete(call, body))
        elif call.state is not DONE:
            if len(body) == 1 and body[0] == _RESTART_MARKER:
                self._restart(call)
            else:
                call.state = STREAMING
                self._outbox.append(Partial(call, body))

    def _failed(self, call: _Call, body: list[bytes]) -> None:
        """An error reply to *call*; a 504 (its attempt's deadline passed at the broker or
        the worker) ends that attempt alone, as its timeout would."""
        streamed = call.state is STREAMING
        if (body[1] == extension.STATUS_DEADLINE and call.state is not DONE
                and call.attempts < call.retries and not (streamed and call.onRestart is None)):
            self._retry(call, streamed)
        else:
            self._fail(call, remote_error(call.service, body))  # type: ignore[arg-type]

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
            if channel.endpoint == self._rotation.current and call is not self._probe:
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
            if call is self._probe:
                self._probed(call, None)
            else:
                self._outbox.append(Fail(call, error))
            if self._abandon(call):
                self._pump()

    def _abandon(self, call: _Call) -> bool:
        """*call* just became DONE: whether its connection is kept for the reply (a broker
        that takes CANCEL is told, and answers at once)."""
        channel = call.channel
        if channel is not None and channel.call is call and channel.state is SENT:
            self._abandoned += 1
            self._cancelOn(channel, call)
            return True
        return False

    def _cancelOn(self, channel: _Channel, call: _Call) -> None:
        """CANCEL for *call*, in flight on *channel*, if it went with a context."""
        if channel.context:
            self._outbox.append(CancelOn(channel, [_HEADER, codec.C_CANCEL, call.service]))
