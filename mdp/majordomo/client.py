"""The MDP/0.2 client: Deferred-returning requests, many in flight at once.

MDP/0.2 replies carry no request id, so the client keeps a pool of connections (DEALER sockets, or
channels of one stream connection), each carrying **one request at a time**.  :class:`Client` drives
:class:`~mdp.majordomo.client_machine.ClientMachine` (the state tables) over real transports; the
caller's view is in docs/mdp.md."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import classImplements

from mdp import tracing, transport
from mdp.errors import ClientClosed, StreamRestarted
from mdp.handlers import current_deadline, serving_trace
from mdp.interfaces import IClient, IDealerReceiver
from mdp.machine import machine_view
from mdp.majordomo import client_machine, codec
from mdp.majordomo.client_machine import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    Action,
    CancelOn,
    ClientMachine,
    CloseChannel,
    Complete,
    Dropped,
    Fail,
    OpenChannel,
    Partial,
    Retrying,
    SendOn,
    WakeAt,
    _Call,
    _Channel,
)
from mdp.messages import Frame
from mdp.messages import text as label
from mdp.policy import Limits, LogThrottle, call_at, default_reactor

__all__ = ["Client", "ReplyStream", "ClientMachine", "DEFAULT_TIMEOUT", "DEFAULT_RETRIES",
           "DEFAULT_MAX_CONNECTIONS"]

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)


def __getattr__(name: str) -> Any:
    """The machine's classes (compiled, a class the .pxd cimports is no attribute)."""
    if name in ("ClientMachine", "_Call", "_Channel"):
        return getattr(client_machine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _ChannelPipe:
    """The receiver of one channel's transport: feeds the client's machine."""

    __slots__ = ("client", "channel")

    def __init__(self, client: Client, channel: _Channel) -> None:
        self.client = client
        self.channel = channel

    def connectionMade(self) -> None:
        client = self.client
        client._perform(client.machine.handlePipeUp(self.channel, client.reactor.seconds()))

    def connectionLost(self, reason: object) -> None:
        client = self.client
        client._perform(client.machine.handlePipeLost(
            self.channel, getattr(reason, "value", None), client.reactor.seconds()))

    def connectionFailed(self, reason: BaseException) -> None:
        client = self.client
        client._perform(client.machine.handleConnectFailed(self.channel, reason,
                                                           client.reactor.seconds()))

    def messageReceived(self, frames: list[bytes]) -> None:
        client = self.client
        client._perform(client.machine.handleMessage(self.channel, frames,
                                                     client.reactor.seconds()))


classImplements(_ChannelPipe, IDealerReceiver)


class ClientDriver:
    """What :class:`Client` and :class:`mdp.blocking.Client` share: the :class:`ClientMachine` (``machine``),
    its options and the actions both perform alike; *clock* has ``seconds()``."""

    def __init__(self, endpoint: Union[str, Sequence[str]], clock: Any, *, limits: Limits,
                 curveServerPublic: Optional[str], curveSecret: Optional[str], **options: Any) -> None:
        endpoints = transport.endpoint_list(endpoint)
        self.curve = transport.curve_client_for(endpoints, curveServerPublic, curveSecret)
        self.machine = ClientMachine(endpoints, limits=limits, now=clock.seconds(), **options)
        self.limits = limits
        self.throttle = LogThrottle(clock)
        self._wakeTime: Optional[float] = None

    endpoints = machine_view("endpoints", "The broker endpoints, in failover order.")
    endpoint = machine_view("endpoint", "The broker endpoint new connections go to.")

    def _act(self, action: Action) -> None:
        kind = type(action)
        if kind is WakeAt:
            self._wakeBy(action.when)
        elif kind is OpenChannel:
            # (an earlier action's callback may have closed the client)
            if not self.machine.closed and self.machine.holds(action.channel):
                self._open(action.channel)
        elif kind is CloseChannel:
            pipe, action.channel.pipe = action.channel.pipe, None
            if pipe is not None:
                pipe.close()
        elif kind is CancelOn:
            self._sendCancel(action.channel, action.frames)
        elif kind is Dropped:
            self.throttle.warn(log, "dropped", "client dropped a message from {endpoint}: {reason}",
                               endpoint=action.endpoint, reason=action.reason)
        elif kind is Retrying:
            call = action.call
            self.throttle.info(log, "retry", "no reply from {service} in {timeout:g}s; retrying "
                               "({attempt}/{retries})", service=label(call.service),
                               timeout=call.timeout, attempt=action.attempt, retries=call.retries)
        else:  # Partial, Restarted: the caller's callback, unless the request is done
            call = action.call
            partial = kind is Partial
            callback = call.onPartial if partial else call.onRestart
            if callback is None or call.done:
                return
            try:
                if partial:
                    callback(action.body)
                else:
                    callback()
            except Exception:
                log.failure("{name} callback for {service} failed", service=label(call.service),
                            name="onPartial" if partial else "onRestart")

    def _stale(self, channel: _Channel) -> None:
        """What came on *channel* before its request was dropped."""
        self.throttle.warn(log, "stale", "client dropped what came from {endpoint} before its "
                           "request: no request was in flight there to answer",
                           endpoint=channel.endpoint)


class Client(ClientDriver):
    """An MDP/0.2 client of a broker (or a failover list of them) over real
    transports; *endpoint* is checked at once (:class:`~mdp.errors.TransportError`).
    At most *maxConnections* requests are in flight, more wait in a FIFO."""

    def __init__(self, endpoint: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 timeout: float = DEFAULT_TIMEOUT, retries: int = DEFAULT_RETRIES,
                 maxConnections: int = DEFAULT_MAX_CONNECTIONS, dialect: str = codec.RFC,
                 stamp: bool = False, limits: Limits = Limits(), extensions: bool = True,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None) -> None:
        reactor = default_reactor(reactor)
        super().__init__(endpoint, reactor, timeout=timeout, retries=retries,
                         maxConnections=maxConnections, dialect=dialect, stamp=stamp,
                         limits=limits, extensions=extensions, curveServerPublic=curveServerPublic,
                         curveSecret=curveSecret)
        self.reactor = reactor
        self._timer: Any = None
        #: the connections its pipes share, by endpoint
        self._links: dict[str, Any] = {}

    def request(self, service: Union[str, bytes], *frames: Frame, timeout: Optional[float] = None,
                retries: Optional[int] = None,
                onPartial: Optional[Callable[[list[bytes]], Any]] = None,
                onRestart: Optional[Callable[[], Any]] = None) -> defer.Deferred[list[bytes]]:
        """Send a request; the Deferred fires with the FINAL body frames (docs/mdp.md).
        *timeout* is the seconds of **one attempt**, *retries* the attempts in all."""
        now = self.reactor.seconds()
        machine = self.machine
        try:
            call = machine.newCall(service, frames, timeout, retries, onPartial, onRestart, now,
                                   current_deadline())
        except ClientClosed as e:
            return defer.fail(e)
        deferred = call.deferred = defer.Deferred(lambda _: self._cancel(call))
        if tracing.tracer() is None:
            call.trace = serving_trace()
        else:  # a span for the call, ended with it
            span, call.trace = tracing.start_client_span(call.service)
            deferred.addBoth(tracing.ended, span)
        self._perform(machine.handleRequest(call, now))
        return deferred

    def stream(self, service: Union[str, bytes], *frames: Frame,
               timeout: Optional[float] = None) -> ReplyStream:
        """Send a request; ``async for`` over the :class:`ReplyStream` yields
        each PARTIAL body, then the FINAL one.  Arguments as :meth:`request`."""
        replies = ReplyStream(self.reactor)
        d = self.request(service, *frames, timeout=timeout, onPartial=replies._put,
                         onRestart=replies._restart)
        d.addBoth(replies._end)
        return replies

    def close(self) -> defer.Deferred[None]:
        """Fail every pending request with :class:`ClientClosed` and close; the
        Deferred fires once every connection is closed."""
        self._perform(self.machine.handleClose(self.reactor.seconds()))
        links, self._links = self._links, {}
        return transport.close_all(links.values(), "a client connection")

    def _cancel(self, call: _Call) -> None:
        self._perform(self.machine.handleCancel(call, self.reactor.seconds()))

    def _wake(self) -> None:
        self._timer = None
        self._perform(self.machine.handleWake(self.reactor.seconds()))

    def _wakeBy(self, when: Optional[float]) -> None:
        """Arm the timer for a :class:`WakeAt` (the machine asks only for an
        earlier one); once closed, none is armed."""
        self._timer = call_at(self._timer, self.reactor, None if self.machine.closed else when, self._wake)

    def _perform(self, actions: list[Action]) -> None:
        """Do what the machine asked, in order."""
        for action in actions:
            kind = type(action)
            if kind is SendOn:
                self._send(action.channel, action.frames)
            elif kind is Complete or kind is Fail:
                deferred = action.call.deferred
                if deferred.called:  # (cancelled by an earlier action's callback)
                    pass
                elif kind is Complete:
                    deferred.callback(action.body)
                else:
                    deferred.errback(action.error)
            else:
                self._act(action)

    def _send(self, channel: _Channel, frames: list[bytes]) -> None:
        pipe = channel.pipe
        call = channel.call
        if pipe is not None and pipe.connected and call is not None and not call.done:
            if pipe.discardReceived():
                self._stale(channel)
            pipe.sendMessage(frames)

    def _sendCancel(self, channel: _Channel, frames: list[bytes]) -> None:
        pipe = channel.pipe
        if pipe is not None and pipe.connected:
            pipe.sendMessage(frames)

    def _open(self, channel: _Channel) -> None:
        try:
            link = self._links.get(channel.endpoint)
            if link is None:
                link = self._links[channel.endpoint] = transport.connect_channels(
                    channel.endpoint, self.reactor, limits=self.limits,
                    security=transport.curve_for(channel.endpoint, self.curve),
                    relayProbe=codec.RELAY_PROBE)
            channel.pipe = link.open(_ChannelPipe(self, channel))
        except Exception as e:
            self._perform(self.machine.handleOpenFailed(channel, e, self.reactor.seconds()))


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Client, IClient)


_RESTARTED = object()  # in a ReplyStream's queue: the stream started over here


class ReplyStream:
    """Async iterator over the reply parts of one request (:meth:`Client.stream`); given
    a *reactor*, a waiting consumer is woken once a turn for the parts that came."""

    def __init__(self, reactor: Any = None) -> None:
        self._parts: deque[Any] = deque()
        self._taken = 0  # of the current attempt
        self._done = False
        self._error: Any = None
        self._waiter: Optional[defer.Deferred[None]] = None
        self._reactor = reactor
        self._wakeCall: Any = None

    def _wake(self) -> None:
        self._wakeCall = None
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.callback(None)

    def _put(self, frames: list[bytes]) -> None:
        self._parts.append(frames)
        if self._waiter is None or self._wakeCall is not None:
            return
        if self._reactor is None:
            self._wake()
        else:
            self._wakeCall = self._reactor.callLater(0, self._wake)

    def _restart(self) -> None:
        while self._parts and self._parts[-1] is not _RESTARTED:
            self._parts.pop()
        if not self._parts and self._taken:
            self._parts.append(_RESTARTED)
        self._wake()

    def _end(self, result: Any) -> None:
        """The FINAL body, or the request's Failure."""
        if isinstance(result, Failure):
            self._error = result
        else:
            self._parts.append(result)
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
        part = self._parts.popleft()
        if part is _RESTARTED:
            self._taken = 0
            raise StreamRestarted("the reply stream started over; the parts taken so far "
                                  "belong to an abandoned attempt")
        self._taken += 1
        return part
