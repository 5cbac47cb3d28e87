"""The MDP/0.2 client and worker without a reactor (docs/blocking.md): the Twisted drivers' machines
over pyzmq (``zmq:``) or stream sockets (``tcp:``, ``unix:``) and one poller, only inside their
calls, in the calling thread.  A client belongs to one thread at a time (as a ZeroMQ socket does)."""

from __future__ import annotations

import os
import select
from collections import deque
from time import monotonic
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from twisted.logger import Logger

from mdp import tracing
from mdp.errors import ClientClosed, TransportError
from mdp.handlers import current_deadline, serving_trace
from mdp.handlerthreads import PACED_POLL, HandlerThreads, run_handler
from mdp.majordomo import codec
from mdp.majordomo.client import ClientDriver
from mdp.majordomo.client_machine import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    Action,
    CancelOn,
    Complete,
    Fail,
    SendOn,
    _Call,
    _Channel,
)
from mdp.majordomo.codec import WorkerFinal, WorkerPartial
from mdp.majordomo.worker import STOPPED, SendToBroker, Serve, WorkerDriver, given_up_body, lapsed
from mdp.messages import Frame
from mdp.messages import text as label
from mdp.policy import PIRATE, Backoff, HeartbeatPolicy, Limits, whole_number
from mdp.transport import curve_for, endpoint_list
from mdp.transport.pipes import (
    STREAM_SCHEMES,
    _check_schemes,
    _StreamLink,
    _StreamPipe,
    _zmq,
    _ZmqPipe,
    stream_address,
    timeout_ms,
)
from mdp.transport.zmqio import FlushPacer

__all__ = ["Client", "Worker", "STREAM_SCHEMES"]

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

#: how long closing a worker's socket may take to send its DISCONNECT (ms)
LINGER_MS = 200

_PENDING: Any = object()  # the end of map()'s items
_NEVER = float("inf")

_forks = 0  # how many times this process is a fork's child


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def _log_to_stdlib() -> None:
    """Where nothing has begun Twisted's logging, send it to :mod:`logging`."""
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    from mdp.transport.twisted_private import logging_begun

    if not logging_begun():
        globalLogBeginner.beginLoggingTo([STDLibLogObserver()], redirectStandardIO=False)


class _Loop:
    """One poller over a blocking node's pipes, and their reconnection times.  A ZeroMQ ``ZMQ_FD`` only says
    "ask ``EVENTS``", and a send or receive may consume it: a pipe that used its socket, or holds unread
    messages or unsent records, is asked before the next wait (``unchecked``)."""

    def __init__(self, limits: Limits, context: Any) -> None:
        self.limits = limits
        self._zmqContext = context
        epoll = getattr(select, "epoll", None)
        self.poller: Any = epoll() if epoll is not None else select.poll()
        #: ms to a poll's timeout: epoll's is in seconds, poll's in ms (negative: no limit)
        self.pollUnit = 0.001 if epoll is not None else 1
        self.closed = False
        self.pipes: dict[int, Any] = {}  # descriptor -> pipe
        self.watched: dict[int, int] = {}  # descriptor -> its poll flags
        self.timed: set[Any] = set()  # pipes that may have a connection attempt due
        self.unchecked: set[Any] = set()
        self.links: dict[str, _StreamLink] = {}  # by endpoint
        self.idle: set[Any] = set()  # links whose last pipe closed

    def context(self) -> Any:
        if self._zmqContext is None:
            self._zmqContext = _zmq().Context.instance()
        return self._zmqContext

    def open(self, endpoint: str, owner: Any, tag: Any, linger: int = 0, curve: Any = None,
             shared: bool = False) -> Any:
        """A pipe to *endpoint* (a stream connects at the next turn); *shared*,
        a channel of this loop's one stream connection there."""
        if self.closed:
            raise TransportError(f"cannot open a connection to {endpoint}: closed")
        if endpoint.startswith("zmq:"):
            return _ZmqPipe(self, owner, tag, endpoint[len("zmq:"):], linger,
                            curve_for(endpoint, curve))
        family, address = stream_address(endpoint)
        if shared:
            link = self.links.get(endpoint)
            if link is None:
                link = self.links[endpoint] = _StreamLink(self, endpoint, family, address)
            self.idle.discard(link)
            return link.open(owner, tag)
        return _StreamPipe(self, owner, tag, family, address)

    def turn(self, when: Optional[float]) -> None:
        """Wait for a socket or until *when* (or a pipe's retry); handle what came."""
        if self.idle:
            self.closeIdle()
        now = monotonic()
        timed = self.timed
        timeout = timeout_ms(self._soonest(when) if timed else when, now)
        pipes = self.pipes
        # the only socket, with nothing to send: wait in its recv, not a poll
        only = next(iter(pipes.values())) if len(pipes) == 1 and not timed else None
        if only is not None and not only.backlog:
            only.wait(timeout)
        else:
            self._poll(timeout, now)
        if timed:
            self._wakeDue(monotonic())

    def _wakeDue(self, now: float) -> None:
        for pipe in list(self.timed):
            if pipe.retryAt is not None and now >= pipe.retryAt:
                pipe.wake(now)

    def _soonest(self, when: Optional[float]) -> Optional[float]:
        for pipe in self.timed:
            retry = pipe.retryAt
            if retry is not None and (when is None or retry < when):
                when = retry
        return when

    def closeIdle(self) -> None:
        idle, self.idle = self.idle, set()
        for link in idle:
            if not link.core.channels:
                link.close()

    def _poll(self, timeout: int, now: float) -> None:
        if self.unchecked:
            unchecked, self.unchecked = self.unchecked, set()
            for pipe in unchecked:
                if pipe.check(now):
                    timeout = 0
            if self.unchecked:
                timeout = 0
        if self.closed:  # a callback above closed the client
            return
        events = self.poller.poll(timeout * self.pollUnit)
        now = monotonic()
        pipes = self.pipes
        for fd, flags in events:
            pipe = pipes.get(fd)
            if pipe is not None:
                pipe.ready(flags, now)

    def watch(self, fd: int, flags: int) -> None:
        current = self.watched.get(fd)
        if current == flags:
            return
        if current is None:
            self.poller.register(fd, flags)
        else:
            self.poller.modify(fd, flags)
        self.watched[fd] = flags

    def forget(self, fd: int) -> None:
        self.pipes.pop(fd, None)
        if self.watched.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def shutdown(self) -> None:
        """Close every connection, then the poller."""
        for link in list(self.links.values()):
            link.close()
        for pipe in [*self.pipes.values(), *self.timed]:
            pipe.close()
        self.idle.clear()
        self.closed = True
        if self.pollUnit != 1:  # (an epoll object holds a descriptor)
            self.poller.close()
        self.watched.clear()


class Client(ClientDriver):
    """A blocking MDP/0.2 client of a broker (or a failover list of them): :meth:`request` returns the reply's
    frames or raises what :class:`mdp.Client`'s Deferred fails with; :meth:`map` pipelines.  An interrupt
    (Ctrl-C) drops every connection and request in flight; the next call starts clean."""

    def __init__(self, endpoint: Union[str, Sequence[str]], timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES, *,
                 maxConnections: int = DEFAULT_MAX_CONNECTIONS, dialect: str = codec.RFC,
                 stamp: bool = False, limits: Limits = Limits(), context: Any = None,
                 extensions: bool = True, curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None) -> None:
        super().__init__(endpoint, _CLOCK, timeout=timeout, retries=retries,
                         maxConnections=maxConnections, dialect=dialect, stamp=stamp,
                         limits=limits, extensions=extensions, curveServerPublic=curveServerPublic,
                         curveSecret=curveSecret)
        _check_schemes(self.machine.endpoints)
        _log_to_stdlib()
        self._loop = _Loop(limits, context)
        #: the result of a request not answered yet (a plain object, one per machine)
        self._unanswered = object()
        self._forks = _forks

    @property
    def forked(self) -> bool:
        """This process is a fork's child of the one that made the client."""
        return self._forks != _forks

    def request(self, service: Union[str, bytes], *frames: Frame, timeout: Optional[float] = None,
                retries: Optional[int] = None,
                onPartial: Optional[Callable[[list[bytes]], Any]] = None,
                onRestart: Optional[Callable[[], Any]] = None) -> list[bytes]:
        """Send a request and return its FINAL body frames; arguments and
        errors as :meth:`mdp.Client.request`, the errors raised."""
        span = trace = None
        if tracing.tracer() is not None:  # a span for the call, ended with it
            span, trace = tracing.start_client_span(codec.api_service_name(service))
        try:
            call = self._submit(service, frames, timeout, retries, onPartial, onRestart, trace)
            self._waitFor(call)
            result = call.result
            if isinstance(result, BaseException):
                raise result
        except BaseException as e:
            if span is not None:
                tracing.end_span(span, e)
            raise
        if span is not None:
            tracing.end_span(span)
        return result  # type: ignore[no-any-return]

    def map(self, service: Union[str, bytes], requests: Iterable[Union[Frame, Sequence[Frame]]],
            window: int = 16, *, timeout: Optional[float] = None, retries: Optional[int] = None,
            returnExceptions: bool = False) -> Iterator[Any]:
        """One request per item (``bytes``/``str``: one frame; a sequence: its frames), up to *window* in
        flight; yield the replies **in order**.  The first failure raises, or with *returnExceptions* is
        yielded in its place; stopping early abandons what is in flight."""
        whole_number("window", window)
        if window > self.machine.maxConnections:
            raise ValueError(f"window {window} is over maxConnections {self.machine.maxConnections}: "
                             "requests past it would wait, their attempts running")
        codec.api_service_name(service)
        if timeout is not None or retries is not None:
            self.machine.attempts(timeout, retries)
        return self._map(service, iter(requests), window, timeout, retries, returnExceptions)

    def _map(self, service: Union[str, bytes], items: Iterator[Any], window: int,
             timeout: Optional[float], retries: Optional[int], returnExceptions: bool) -> Iterator[Any]:
        pending: deque[Any] = deque()
        try:
            # what reading the items raised, raised after the replies before it
            broken = self._fill(pending, window, service, items, timeout, retries)
            while pending:
                call = pending[0]
                self._waitFor(call)
                pending.popleft()
                result = call.result
                if isinstance(result, BaseException) and not returnExceptions:
                    raise result
                yield result
                if broken is None:
                    broken = self._fill(pending, window, service, items, timeout, retries)
            if broken is not None:
                raise broken
        except BaseException as e:
            if not isinstance(e, (Exception, GeneratorExit)):
                self._drop()  # an interrupt anywhere in a map, as in a call
            raise
        finally:
            for call in pending:
                self._cancel(call)

    def _fill(self, pending: deque[Any], window: int, service: Union[str, bytes],
              items: Iterator[Any], timeout: Optional[float], retries: Optional[int]) -> Optional[Exception]:
        """Send items until *window* are pending; what reading them raised, if anything."""
        while len(pending) < window:
            try:
                item = next(items, _PENDING)
            except Exception as e:
                return e
            if item is _PENDING:
                break
            frames = (item,) if isinstance(item, (bytes, str, bytearray, memoryview)) else item
            try:
                pending.append(self._submit(service, tuple(frames), timeout, retries, None, None))
            except ClientClosed:
                raise
            except Exception as e:  # this item's own error, in its place: a call answered
                refused = _Call(b"", [], 0.0, 0, None, None, 0.0)
                refused.result = e
                pending.append(refused)
        return None

    def close(self) -> None:
        """Fail every pending request with :class:`ClientClosed`; close the sockets."""
        if self._forks != _forks:  # the sockets are the parent's: left alone
            self.machine = self.machine.fresh(monotonic())
            self._loop = _Loop(self.limits, None)
        self._perform(self.machine.handleClose(monotonic()))
        self._loop.shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, service: Union[str, bytes], frames: Sequence[Frame], timeout: Optional[float],
                retries: Optional[int], onPartial: Optional[Callable[[list[bytes]], Any]],
                onRestart: Optional[Callable[[], Any]], trace: tracing.Trace = None) -> _Call:
        if self._forks != _forks:
            raise ClientClosed("this client belongs to the process it was made in; "
                               "make a new one after fork()")
        now = monotonic()
        machine = self.machine
        call = machine.newCall(service, frames, timeout, retries, onPartial, onRestart, now,
                               current_deadline())
        call.trace = serving_trace() if trace is None else trace
        call.result = self._unanswered
        try:
            self._perform(machine.handleRequest(call, now))
        except BaseException:
            self._drop()
            raise
        return call

    def _waitFor(self, call: _Call) -> None:
        loop = self._loop
        try:
            while call.result is self._unanswered:
                loop.turn(self._wakeTime)
                when = self._wakeTime
                if when is not None:
                    now = monotonic()
                    if now >= when:
                        self._wakeTime = None
                        self._perform(self.machine.handleWake(now))
        except BaseException:
            self._drop()
            raise
        if type(call.result) is object:  # unanswered by a machine dropped since
            call.result = ClientClosed("request abandoned: an interrupt dropped the "
                                       "client's connections")

    def _cancel(self, call: _Call) -> None:
        if call.result is self._unanswered:
            call.result = ClientClosed("request abandoned")
            try:
                self._perform(self.machine.handleCancel(call, monotonic()))
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        """A call was interrupted: close every connection, and a fresh machine
        (no reply to an abandoned request reaches a later one)."""
        old, self.machine = self.machine, self.machine.fresh(monotonic())
        for action in old.handleClose(monotonic()):  # (a broker that takes CANCEL is told)
            if type(action) is CancelOn:
                self._sendCancel(action.channel, action.frames)
        self._unanswered = object()
        self._wakeTime = None
        loop = self._loop
        if not self.machine.closed:  # first: a second interrupt below still leaves a usable loop
            self._loop = _Loop(self.limits, loop._zmqContext)
        loop.shutdown()

    def _pipeUp(self, channel: _Channel, now: float) -> None:
        self._perform(self.machine.handlePipeUp(channel, now))

    def _pipeLost(self, channel: _Channel, why: BaseException, now: float) -> None:
        self._perform(self.machine.handlePipeLost(channel, why, now))

    def _pipeFailed(self, channel: _Channel, error: BaseException, now: float) -> None:
        self._perform(self.machine.handleConnectFailed(channel, error, now))

    def _pipeMessage(self, channel: _Channel, frames: list[bytes], now: float) -> None:
        self._perform(self.machine.handleMessage(channel, frames, now))

    def _perform(self, actions: list[Action]) -> None:
        """Do what the machine asked, in order; close the links left unused."""
        for action in actions:
            kind = type(action)
            if kind is SendOn:
                self._send(action.channel, action.frames)
            elif kind is Complete or kind is Fail:
                call = action.call
                if call.result is self._unanswered:
                    call.result = action.body if kind is Complete else action.error
            else:
                self._act(action)
        if self._loop.idle:
            self._loop.closeIdle()

    def _wakeBy(self, when: Optional[float]) -> None:
        if when is None or self._wakeTime is None or when < self._wakeTime:
            self._wakeTime = when

    def _send(self, channel: _Channel, frames: list[bytes]) -> None:
        pipe = channel.pipe
        call = channel.call
        if pipe is not None and pipe.up and call is not None and not call.done:
            if pipe.discardReceived():
                self._stale(channel)
            pipe.send(frames)

    def _sendCancel(self, channel: _Channel, frames: list[bytes]) -> None:
        pipe = channel.pipe
        if pipe is not None and pipe.up:
            pipe.send(frames)

    def _open(self, channel: _Channel) -> None:
        try:
            pipe = channel.pipe = self._loop.open(channel.endpoint, self, channel,
                                                  curve=self.curve, shared=True)
        except Exception as e:  # no socket to be had (out of descriptors)
            error = TransportError(f"cannot open a connection to {channel.endpoint}: {e}")
            error.__cause__ = e
            self._perform(self.machine.handleOpenFailed(channel, error, monotonic()))
            return
        if pipe.up:  # ZeroMQ, or a channel of a connection that is up
            self._perform(self.machine.handlePipeUp(channel, monotonic()))


_CLOCK = SimpleNamespace(seconds=monotonic)  # what a log throttle reads


class Worker(WorkerDriver):
    """A blocking MDP/0.2 worker for one *service*, run in the thread that calls :meth:`run`; *handler* as
    :class:`mdp.Worker`'s, without Deferreds.  With *concurrency* N it registers N sessions and runs the
    handler in N threads, while the calling thread keeps the connections and heartbeats."""

    #: what the broker sends is a new request, never a stale reply
    dropsStale = False

    def __init__(self, endpoint: Union[str, Sequence[str]], service: Union[str, bytes],
                 handler: Callable[[list[bytes]], Any], *,
                 heartbeat: HeartbeatPolicy = HeartbeatPolicy(), backoff: Backoff = PIRATE,
                 dialect: str = codec.RFC, limits: Limits = Limits(), context: Any = None,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None,
                 concurrency: int = 1, extensions: bool = True) -> None:
        _check_schemes(endpoint_list(endpoint))  # before the handler and CURVE checks
        whole_number("concurrency", concurrency)
        options = dict(heartbeat=heartbeat, backoff=backoff, dialect=dialect, limits=limits,
                       curveServerPublic=curveServerPublic, curveSecret=curveSecret,
                       extensions=extensions)
        super().__init__(endpoint, service, handler, _CLOCK, **options)
        _log_to_stdlib()
        self._context = context
        self._loop: Any = None
        self._reopenAt = _NEVER
        self._nextTick = 0.0
        self._stopping = False
        self._threads: Optional[HandlerThreads] = None
        self.held: Any = None  # the request in hand that came with a context
        #: the worker sessions of this process, this one first
        self.sessions = [self] + [Worker(endpoint, service, handler, context=context, **options)
                                  for _ in range(concurrency - 1)]

    def stop(self) -> None:
        """Make :meth:`run` return once the requests in hand are answered."""
        self._stopping = True

    def run(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Serve until :meth:`stop`, *until()* is true (checked at each wake-up) or an exception; then answer
        what is in hand (unless an exception), say DISCONNECT and close."""
        self._stopping = False
        loop = _Loop(self.machine.limits, self._context)
        threads = HandlerThreads(loop, len(self.sessions)) if len(self.sessions) > 1 else None
        now = monotonic()
        for session in self.sessions:
            session._loop, session._threads = loop, threads
            session._nextTick = now + session.machine.wakeEvery
            session._perform(session.machine.handleStart(now))
        try:
            while not self._stopping and (until is None or not until()):
                self._turn()
            while not self._stopIdle():  # the requests in hand are answered first
                self._turn()
        finally:
            try:
                self._stopIdle(everyone=True)
            finally:
                for session in self.sessions:
                    session._loop = session._threads = None
                if threads is not None:
                    threads.close()
                loop.shutdown()

    def _stopIdle(self, everyone: bool = False) -> bool:
        """Stop the sessions serving nothing (or all); True once all are stopped."""
        for session in self.sessions:
            if (everyone or session.machine.current is None) and session.machine.state is not STOPPED:
                session._reopenAt = _NEVER
                session._perform(session.machine.handleStop(monotonic()))
        return all(session.machine.state is STOPPED for session in self.sessions)

    def _pipeMessage(self, tag: Any, frames: list[bytes], now: float) -> None:
        self._perform(self.machine.handleMessage(frames, now))

    def _perform(self, actions: list[Any]) -> None:
        for action in actions:
            kind = type(action)
            if kind is SendToBroker:
                if self.transport is not None:
                    self.transport.send(action.frames)
            elif kind is Serve:
                self._serve(action.job, action.body)
            else:
                self._act(action)

    def _giveUpHeld(self, client: bytes) -> None:
        """The broker cancelled the request in hand: answered 499 now (the handler, which
        may poll ``mdp.cancelled()``, finds its reply void)."""
        held = self.held
        if held is not None and held.client == client and self.machine.isCurrent(held):
            held.givenUp = "cancelled"
            self._reply(held, WorkerFinal, given_up_body(held))

    def _reopenAfter(self, delay: float) -> None:
        self._reopenAt = monotonic() + delay

    def _open(self, endpoint: str) -> None:
        try:
            pipe = self.transport = self._loop.open(endpoint, self, None, LINGER_MS, curve=self.curve,
                                                    shared=self._threads is not None)
        except Exception as e:  # no socket to be had (out of descriptors)
            raise TransportError(f"cannot connect to {endpoint!r}: {e}") from e
        if pipe.up:  # ZeroMQ: up at once
            self._pipeUp(None, monotonic())

    def _serve(self, job: Any, body: list[bytes]) -> None:
        if job.context is not None:
            if lapsed(job, monotonic()):
                self._reply(job, WorkerFinal, given_up_body(job))
                return
            self.held = job  # (a CANCEL sets its givenUp, for mdp.cancelled())
        if self._threads is not None:
            self._threads.serve(self, job, body)
            return
        started = monotonic()
        answer = run_handler(self, job, body, lambda frames: self._part(job, frames))
        if answer is not None:
            frames, served, raised = answer
            if raised is not None:
                raise raised
            if self._reply(job, WorkerFinal, frames) and served:
                self.requestsServed += 1
        if monotonic() - started > self.machine.heartbeat.interval:
            self._perform(self.machine.handleBlocked(monotonic()))

    def _part(self, job: Any, frames: list[bytes]) -> bool:
        """Send a PARTIAL, then serve the broker's traffic and heartbeats; while the broker takes PARTIALs
        slower than they come, wait until what waits has drained (polled: libzmq tells nobody when it lets go
        of a message).  Whether the stream goes on (False: the request is void or was answered)."""
        if not self._reply(job, WorkerPartial, frames):
            return False
        pipe = self.transport
        if pipe is not None and pipe.backlogged:
            pacer = FlushPacer()
            while pipe.draining and self.machine.isCurrent(job) and not self._loop.closed:
                self._turn(monotonic() + pacer.next(False))
        elif monotonic() >= self._nextTick:
            self._turn()
        if self.machine.isCurrent(job):
            return True
        log.info("worker for {service} stopped a stream: its request was cancelled, or went with "
                 "its broker",
                 service=label(self.machine.service))
        return False

    def _turn(self, until: float = _NEVER) -> None:
        """One turn of the loop, until a session's next tick or reopening, or
        *until*; then what is due."""
        threads = self._threads
        if threads is not None and threads.paced:
            self._loop.turn(monotonic())  # what waits goes out, without waiting
            threads.release()
            if threads.paced:
                until = min(until, monotonic() + PACED_POLL)
        sessions = self.sessions
        for session in sessions:
            until = min(until, session._nextTick, session._reopenAt)
        self._loop.turn(until)
        now = monotonic()
        for session in sessions:
            if now >= session._reopenAt:
                session._reopenAt = _NEVER
                session._perform(session.machine.handleReopen(now))
            if now >= session._nextTick:
                session._tickDue(now)
        if threads is not None and threads.paced:
            threads.release()

    def _tickDue(self, now: float) -> None:
        """The machine's tick; one late by over an interval was held up by a handler."""
        if now - self._nextTick > self.machine.heartbeat.interval:
            self._perform(self.machine.handleBlocked(now))
        self._nextTick = now + self.machine.wakeEvery
        self._perform(self.machine.handleTick(now))

    def _reply(self, job: Any, kind: type, frames: list[bytes]) -> bool:
        sent, actions = self.machine.handleReply(job, kind, frames, monotonic())
        self._perform(actions)
        return sent
