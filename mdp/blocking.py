"""The MDP/0.2 client without a reactor, for scripts, notebooks and Spark
executors.

:class:`Client` is :class:`mdp.majordomo.client.ClientMachine` — the same
decisions as the Twisted :class:`mdp.Client`: one request per connection,
Lazy Pirate attempts and failover, the typed errors — driven by plain pyzmq
DEALER sockets (``zmq:`` endpoints) or plain stream sockets (``tcp:``, to
IPv4 and IPv6 hosts, and ``unix:``, with the stream transport's
length-prefixed records) and one poller.  Nothing runs between calls: the client does its work
inside :meth:`Client.request` and :meth:`Client.map`, in the calling thread,
and never imports or starts a Twisted reactor.

::

    from mdp.blocking import Client

    with Client("zmq:tcp://127.0.0.1:5555", timeout=2.5, retries=3) as client:
        reply = client.request("echo", b"hello")          # [b"hello"]
        for reply in client.map("echo", rows, window=16):  # in order, 16 in flight
            ...

A client belongs to one thread at a time (as a ZeroMQ socket does).
"""

from __future__ import annotations

import os
import select
from collections import deque
from collections.abc import Generator
from time import monotonic
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from twisted.logger import Logger

from mdp.errors import ClientClosed, TransportError
from mdp.handlers import checked_handler, reply_frames
from mdp.majordomo import codec
from mdp.majordomo.client import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    DONE,
    DOWN,
    Action,
    ClientCore,
    CloseChannel,
    Complete,
    Fail,
    OpenChannel,
    Partial,
    Restarted,
    SendOn,
    WakeAt,
    _Call,
    _Channel,
    _check_attempts,
    call_back,
)
from mdp.majordomo.codec import WorkerFinal, WorkerPartial
from mdp.majordomo.worker import (
    ClosePipe,
    Final,
    OpenPipe,
    ReopenAfter,
    SendToBroker,
    Serve,
    WorkerMachine,
)
from mdp.messages import Frame
from mdp.messages import text as label
from mdp.policy import PIRATE, Backoff, HeartbeatPolicy, Limits
from mdp.transport import curve_client_for, curve_for, endpoint_list
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

__all__ = ["Client", "Worker", "STREAM_SCHEMES"]

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)
#: how long closing a worker's socket may take to send its DISCONNECT (ms)
LINGER_MS = 200

_PENDING: Any = object()  # a call's result while it is not done

#: what a handler returns that is certainly not a generator
_PLAIN_REPLIES = frozenset((bytes, list, tuple, str, type(None)))

_forks = 0  # how many times this process is a fork's child (clients do not cross a fork)


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def _log_to_stdlib() -> None:
    """Where nothing has begun Twisted's logging (a plain script), send the
    library's log events to :mod:`logging` instead of Twisted's unseen buffer."""
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    from mdp.transport.twisted_private import logging_begun

    if not logging_begun():
        globalLogBeginner.beginLoggingTo([STDLibLogObserver()], redirectStandardIO=False)


class _Poller:
    """``select.epoll`` (``select.poll`` where there is none) over plain
    descriptors, remembering what each is watched for so that watching it
    for the same again costs no system call."""

    __slots__ = ("_poller", "_flags", "_seconds", "closed")

    def __init__(self) -> None:
        epoll = getattr(select, "epoll", None)
        self._poller: Any = epoll() if epoll is not None else select.poll()
        self._seconds = epoll is not None  # epoll's timeout is in seconds, poll's in ms
        self._flags: dict[int, int] = {}
        #: closed (its owner is): nothing is watched or waited for any more
        self.closed = False

    def watch(self, fd: int, flags: int) -> None:
        """Watch *fd* for *flags* (``POLLIN``/``POLLOUT``) instead of what it was."""
        current = self._flags.get(fd)
        if current == flags:
            return
        if current is None:
            self._poller.register(fd, flags)
        else:
            self._poller.modify(fd, flags)
        self._flags[fd] = flags

    def forget(self, fd: int) -> None:
        if self._flags.pop(fd, None) is not None:
            self._poller.unregister(fd)

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        """Ready descriptors and their flags, waiting at most *timeout* ms (-1: no limit)."""
        if self._seconds:
            return self._poller.poll(timeout / 1000 if timeout >= 0 else -1)
        return self._poller.poll(timeout if timeout >= 0 else None)

    def close(self) -> None:
        self.closed = True
        if self._seconds:
            self._poller.close()
        self._flags.clear()


class _Loop:
    """One poller over the descriptors of the pipes (:mod:`mdp.transport.pipes`),
    and the pipes' reconnection times: what a blocking node waits on.

    A ZeroMQ socket is watched through its ``ZMQ_FD``, which only says "ask
    ``EVENTS``"; a send or receive may consume its signal, so a pipe that
    used its socket is asked before the loop waits again (``unchecked``), as
    is a stream pipe holding messages read and not handed on yet (a
    caller's callback may wait on the loop while the reply it waits for is
    among them)."""

    def __init__(self, limits: Limits, context: Any) -> None:
        self.limits = limits
        self._zmqContext = context
        self.poller = _Poller()
        self.pipes: dict[int, Any] = {}  # descriptor -> pipe
        #: pipes that may have a connection attempt due (``retryAt``)
        self.timed: set[Any] = set()
        #: pipes to ask (``check``) before waiting
        self.unchecked: set[Any] = set()
        #: the stream connections that carry a client's pipes, by endpoint
        self.links: dict[str, _StreamLink] = {}
        #: stream pipes with records to send before the loop waits (in one write)
        self.unflushed: set[Any] = set()
        #: links whose last pipe closed: closed once the actions that closed it
        #: are done, unless a pipe opened meanwhile keeps them (closeIdle)
        self.idle: set[Any] = set()

    def context(self) -> Any:
        if self._zmqContext is None:
            self._zmqContext = _zmq().Context.instance()
        return self._zmqContext

    def open(self, endpoint: str, owner: Any, tag: Any, linger: int = 0, curve: Any = None,
             shared: bool = False) -> Any:
        """A pipe to *endpoint*, to be started (``start()``) once its owner
        holds it: a ZeroMQ one (with *curve*, a CURVE client) is up at once,
        a stream one once its connection is made.  *shared*: a stream pipe is
        a channel of the one connection this loop keeps to *endpoint*."""
        if self.poller.closed:  # (its owner is closed: no socket is made for it any more)
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
        stream = _StreamPipe(self, owner, tag, family, address)
        self.timed.add(stream)
        return stream

    def close(self, pipe: Any) -> None:
        self.timed.discard(pipe)
        pipe.close()

    def turn(self, when: Optional[float]) -> None:
        """Wait for a socket or until *when* (or sooner, see _soonest); handle what came."""
        if self.idle:
            self.closeIdle()
        if self.unflushed:
            unflushed, self.unflushed = self.unflushed, set()
            for stream in unflushed:
                stream._flush()
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
        """*when*, or a pipe's next connection attempt if sooner."""
        for pipe in self.timed:
            retry = pipe.retryAt
            if retry is not None and (when is None or retry < when):
                when = retry
        return when

    def closeIdle(self) -> None:
        """Close the links whose last pipe closed, unless one opened since."""
        idle, self.idle = self.idle, set()
        for link in idle:
            if not link.pipes:
                link.close()

    def _poll(self, timeout: int, now: float) -> None:
        if self.unchecked:
            unchecked, self.unchecked = self.unchecked, set()
            for pipe in unchecked:
                if pipe.check(now):
                    timeout = 0  # something was handled: look, but do not wait
            if self.unchecked:
                timeout = 0  # used again meanwhile: asked at the next turn, soon
        poller = self.poller
        if poller.closed:  # a caller's callback above closed the client: nothing to wait for
            return
        events = poller.poll(timeout)
        now = monotonic()
        pipes = self.pipes
        for fd, flags in events:
            pipe = pipes.get(fd)
            if pipe is not None:
                pipe.ready(flags, now)

    def forget(self, fd: int) -> None:
        self.pipes.pop(fd, None)
        self.poller.forget(fd)

    def shutdown(self) -> None:
        """Close the links the last pipes left, and the poller's descriptor."""
        for link in list(self.links.values()):
            link.close()
        self.idle.clear()
        self.poller.close()


class _Refused:
    """An item of :meth:`Client.map` that could not be sent: its error."""

    __slots__ = ("result",)

    def __init__(self, error: Exception) -> None:
        self.result = error


class Client(ClientCore):
    """A blocking MDP/0.2 client of one broker (or the first live one of a
    failover list): :meth:`request` returns the reply's frames and raises the
    errors the Twisted :class:`mdp.Client`'s Deferred fails with
    (:class:`~mdp.errors.RequestTimeout`, :class:`~mdp.errors.ServiceUnavailable`,
    :class:`~mdp.errors.WorkerError`, :class:`~mdp.errors.BrokerUnreachable`, ...);
    :meth:`map` pipelines.

    *endpoint*: ``zmq:...``, ``tcp:...`` or ``unix:...`` (one,
    or a list); *timeout* is the seconds of **one attempt** and *retries* the
    number of attempts in all.  At most *maxConnections* requests are in flight
    at once (one per connection).  *context* is the ZeroMQ context to use (by
    default one per process)."""

    def __init__(
        self,
        endpoint: Union[str, Sequence[str]],
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        *,
        maxConnections: int = DEFAULT_MAX_CONNECTIONS,
        dialect: str = codec.RFC,
        stamp: bool = False,
        limits: Limits = Limits(),
        context: Any = None,
        curveServerPublic: Optional[str] = None,
        curveSecret: Optional[str] = None,
    ) -> None:
        super().__init__(endpoint, monotonic(), timeout=timeout, retries=retries,
                         maxConnections=maxConnections, dialect=dialect, stamp=stamp,
                         limits=limits, curveServerPublic=curveServerPublic,
                         curveSecret=curveSecret)
        _check_schemes(self.endpoints)
        _log_to_stdlib()
        self._loop = _Loop(limits, context)
        self._wakeTime: Optional[float] = None
        self._madeUp: deque[_Channel] = deque()  # zmq channels whose pipe is up, to tell
        self._forks = _forks

    @property
    def forked(self) -> bool:
        """This process is a fork's child of the one that made the client
        (whose sockets it must not use)."""
        return self._forks != _forks

    # --- public API ----------------------------------------------------------

    def request(
        self,
        service: Union[str, bytes],
        *frames: Frame,
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
        onPartial: Optional[Callable[[list[bytes]], Any]] = None,
        onRestart: Optional[Callable[[], Any]] = None,
    ) -> list[bytes]:
        """Send a request and wait for its FINAL body frames.  Arguments and
        errors as :meth:`mdp.Client.request`; an error is raised instead of
        failing a Deferred.  *onPartial* and *onRestart* are called from
        inside this call.  An exception that interrupts the wait (Ctrl-C)
        abandons the request."""
        call: Optional[_Call] = None
        try:
            call = self._submit(service, frames, timeout, retries, onPartial, onRestart)
            self._waitFor(call)
        except BaseException as e:
            if call is not None:  # (as _waitFor does; also before its own try)
                self._drop(call)
            self._interrupted(e)
            raise
        result = call.result
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def map(
        self,
        service: Union[str, bytes],
        requests: Iterable[Union[Frame, Sequence[Frame]]],
        window: int = 16,
        *,
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
        returnExceptions: bool = False,
    ) -> Iterator[Any]:
        """Send one request per item of *requests* (``bytes``/``str``: one
        frame; a sequence: its frames), with up to *window* in flight, and
        yield the replies' frames **in the order of the requests**.

        The first failed request raises its error (the ones still in flight
        are abandoned), unless *returnExceptions*: then the error is yielded
        in its place.  An item that cannot be sent (over the limits:
        ``RequestTooLarge``; not frames: ``TypeError``) is such a failure, in
        its place; an error reading *requests* is raised after the replies to
        the items before it.  Items are read from *requests* only as the
        window allows.  Stopping the iteration early abandons what is in
        flight."""
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window is a number of requests, not {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if window > self.maxConnections:
            raise ValueError(f"window {window} is over maxConnections {self.maxConnections}: "
                             "requests past it would wait, their attempts running")
        # mistakes of the whole call raise here, not once per item
        codec.api_service_name(service)
        if timeout is not None or retries is not None:
            _check_attempts(self.timeout if timeout is None else timeout,
                            self.retries if retries is None else retries)
        return self._map(service, iter(requests), window, timeout, retries, returnExceptions)

    def _map(self, service: Union[str, bytes], items: Iterator[Any], window: int,
             timeout: Optional[float], retries: Optional[int],
             returnExceptions: bool) -> Iterator[Any]:
        pending: deque[Any] = deque()
        #: what reading *items* raised: raised in its place, after the
        #: replies to the items before it
        broken: Optional[Exception] = None
        interrupted: Optional[BaseException] = None
        try:
            while True:
                while len(pending) < window and broken is None:
                    try:
                        item = next(items, _PENDING)
                    except Exception as e:
                        broken = e
                        break
                    if item is _PENDING:
                        break
                    try:
                        single = isinstance(item, (bytes, str, bytearray, memoryview))
                        pending.append(self._submit(service, (item,) if single else tuple(item),
                                                    timeout, retries, None, None))
                    except ClientClosed:
                        raise
                    except Exception as e:  # an item that cannot be sent: its result
                        pending.append(_Refused(e))
                if not pending:
                    if broken is not None:
                        raise broken
                    return
                call = pending[0]
                if call.__class__ is not _Refused:
                    self._waitFor(call)
                pending.popleft()
                result = call.result
                if isinstance(result, BaseException):
                    if not returnExceptions:
                        raise result
                    yield result
                else:
                    yield result
        except BaseException as e:
            interrupted = e
            raise
        finally:
            for call in pending:
                self._cancel(call)
            self._interrupted(interrupted)

    def close(self) -> None:
        """Fail every pending request with :class:`ClientClosed` and close
        every socket."""
        if self._forks != _forks:  # forked: the sockets are the parent's, left alone
            for channel in self._channels:
                channel.pipe = None
            self._loop = _Loop(self.limits, None)
        self._perform(self.handleClose(monotonic()))
        self._loop.shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the driver ------------------------------------------------------------

    def _submit(self, service: Union[str, bytes], frames: Sequence[Frame],
                timeout: Optional[float], retries: Optional[int],
                onPartial: Optional[Callable[[list[bytes]], Any]],
                onRestart: Optional[Callable[[], Any]]) -> _Call:
        if self._forks != _forks:
            raise ClientClosed("this client belongs to the process it was made in; "
                               "make a new one after fork()")
        now = monotonic()
        call = self._newCall(service, frames, timeout, retries, onPartial, onRestart, now)
        call.result = _PENDING
        try:
            self._perform(self.handleRequest(call, now))
        except BaseException:  # (Ctrl-C while it was being sent) abandoned
            self._drop(call)
            raise
        return call

    def _drop(self, call: _Call) -> None:
        """*call* is abandoned by what interrupted it (its caller gets that
        instead): cancelled, and the driver's wake-up made the machine's
        again, whatever the interrupt cut short."""
        try:
            self._cancel(call)
        finally:
            self._wakeTime = self._wakeAt

    def _interrupted(self, error: Optional[BaseException]) -> None:
        """A request or a ``map`` ends with *error*: if it is an interrupt
        (Ctrl-C; not an ``Exception``, and not a generator's close), which
        may have landed anywhere in the machine or its actions, the pool of
        connections is made whole again
        (:meth:`~mdp.majordomo.client.ClientMachine.handleReset`), once
        the interrupted requests are cancelled."""
        if (error is None or isinstance(error, (Exception, GeneratorExit))
                or self._closed):
            return
        try:
            # a stream connection's pipes whose coming up (or loss) the
            # interrupt kept from being told
            for link in list(self._loop.links.values()):
                link.mend()
            # (the channels whose socket is still there and whose pipe is up,
            # or known to be down: the others are closed)
            sound = [channel for channel in self._channels if channel.pipe is not None
                     and (channel.pipe.up or channel.state is DOWN)]
            # a connection up whose coming up the interrupt kept from the
            # machine is told after the reset, as _open's are (_perform)
            self._madeUp.clear()
            self._madeUp.extend(channel for channel in sound
                                if channel.pipe.up and channel.state is DOWN)
            self._perform(self.handleReset(monotonic(), sound))
        finally:
            self._wakeTime = self._wakeAt

    def _cancel(self, call: _Call) -> None:
        if call.result is _PENDING:
            call.result = ClientClosed("request abandoned")
            self._perform(self.handleCancel(call, monotonic()))
            call.onPartial = call.onRestart = None

    def _waitFor(self, call: _Call) -> None:
        """Run the sockets and the timers until *call* is done: wait for a
        socket or the machine's wake-up, and handle what came."""
        loop = self._loop
        try:
            while call.result is _PENDING:
                loop.turn(self._wakeTime)
                when = self._wakeTime
                if when is not None:
                    now = monotonic()
                    if now >= when:
                        self._wakeTime = None
                        self._perform(self.handleWake(now))
        except BaseException:
            self._drop(call)
            raise

    # --- what the pipes report -------------------------------------------------

    def _pipeUp(self, channel: _Channel, now: float) -> None:
        self._perform(self.handlePipeUp(channel, now))

    def _pipeLost(self, channel: _Channel, why: BaseException, now: float) -> None:
        self._perform(self.handlePipeLost(channel, why, now))

    def _pipeFailed(self, channel: _Channel, error: BaseException, now: float) -> None:
        self._perform(self.handleConnectFailed(channel, error, now))

    def _pipeMessage(self, channel: _Channel, frames: list[bytes], now: float) -> None:
        self._perform(self.handleMessage(channel, frames, now))

    def _perform(self, actions: list[Action]) -> None:
        """Do what the machine asked, in order (as the Twisted driver).  A
        caller's callback that raises is logged.  Whatever interrupts an
        action (Ctrl-C, in a callback or anywhere else) has the rest of the
        actions done first, then is raised: the machine's decisions are
        never half done (a channel it opened left without a socket, a
        wake-up it asked for never armed)."""
        interrupted: Optional[BaseException] = None
        for action in actions:
            try:
                kind = type(action)
                if kind is SendOn:
                    channel = action.channel
                    pipe = channel.pipe
                    call = channel.call
                    if (pipe is not None and pipe.up and call is not None
                            and call.state is not DONE):
                        if pipe.discardReceived():
                            self._stale(channel)
                        pipe.send(action.frames)
                elif kind is Complete or kind is Fail:
                    call = action.call
                    if call.result is _PENDING:
                        call.result = action.body if kind is Complete else action.error
                    call.onPartial = call.onRestart = None
                elif kind is WakeAt:
                    # the machine's wake-up as it is now (a callback above may have
                    # asked for an earlier one, which this older action must not undo)
                    self._wakeTime = self._wakeAt
                elif kind is OpenChannel:
                    channel = action.channel
                    # a callback run by an earlier action may have closed the
                    # client, or waited on it (a request of its own) while the
                    # machine gave up this channel: it is not opened, as nothing
                    # would ever close it
                    if not self._closed and channel in self._channels:
                        self._open(channel)
                elif kind is CloseChannel:
                    pipe, action.channel.pipe = action.channel.pipe, None
                    if pipe is not None:
                        self._loop.close(pipe)
                elif kind is Partial:
                    onPartial = action.call.onPartial
                    if onPartial is not None and not action.call.done:
                        call_back("onPartial", action.call, onPartial, action.body)
                elif kind is Restarted:
                    onRestart = action.call.onRestart
                    if onRestart is not None and not action.call.done:
                        call_back("onRestart", action.call, onRestart)
            except BaseException as e:  # raised once the rest is done
                if interrupted is None:
                    interrupted = e
        while self._madeUp:
            channel = self._madeUp.popleft()
            if channel.pipe is not None:
                self._perform(self.handlePipeUp(channel, monotonic()))
        if self._loop.idle:  # (a stream connection whose last pipe these actions closed)
            self._loop.closeIdle()
        if interrupted is not None:
            raise interrupted

    def _open(self, channel: _Channel) -> None:
        try:
            pipe = channel.pipe = self._loop.open(channel.endpoint, self, channel,
                                                  curve=self.curve, shared=True)
            # a failure reported at once (no such socket file) may close the channel
            pipe.start()
        except BaseException as e:
            # no socket to be had (out of descriptors), or the opening was
            # interrupted (Ctrl-C): nothing can be sent on it, and the machine
            # is told so (a channel it believes opening, with no socket,
            # would hold its request for good)
            pipe, channel.pipe = channel.pipe, None
            if pipe is not None:
                self._loop.close(pipe)
            why = str(e) if isinstance(e, Exception) else f"interrupted ({type(e).__name__})"
            error = TransportError(f"cannot open a connection to {channel.endpoint}: {why}")
            error.__cause__ = e
            self._perform(self.handleOpenFailed(channel, error, monotonic()))
            if not isinstance(e, Exception):
                raise
            return
        if pipe.up and channel.pipe is pipe:  # ZeroMQ: up at once, told after these actions
            self._madeUp.append(channel)


class Worker(WorkerMachine):
    """A blocking MDP/0.2 worker for one *service*: the
    :class:`~mdp.majordomo.worker.WorkerMachine` of :class:`mdp.Worker` (READY,
    heartbeats both ways, Paranoid Pirate reconnection with backoff and
    failover, DISCONNECT, the 413 for a reply over the limits) driven by the
    same sockets as :class:`Client`, in the thread that calls :meth:`run`.

    *handler* takes the request's body frames and returns the reply
    (``bytes``, ``str`` or a list of them), or is a generator that yields
    PARTIAL bodies and then, optionally, a :class:`~mdp.Final`.  It runs in
    the loop's thread: while it runs nothing else does, so a handler that
    takes longer than the broker's heartbeat expiry (interval × liveness)
    has its worker given up (use the Twisted :class:`mdp.Worker` and
    ``deferToThread`` for such work).  A handler that raises is answered with
    a 500 error reply (:class:`~mdp.errors.WorkerError` for the client)."""

    def __init__(
        self,
        endpoint: Union[str, Sequence[str]],
        service: Union[str, bytes],
        handler: Callable[[list[bytes]], Any],
        *,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        backoff: Backoff = PIRATE,
        dialect: str = codec.RFC,
        limits: Limits = Limits(),
        context: Any = None,
        curveServerPublic: Optional[str] = None,
        curveSecret: Optional[str] = None,
    ) -> None:
        endpoints = endpoint_list(endpoint)
        _check_schemes(endpoints)
        self.handler = checked_handler(handler)
        #: the broker's public key and this worker's key pair, for zmq: endpoints
        self.curve = curve_client_for(endpoints, curveServerPublic, curveSecret)
        super().__init__(endpoints, codec.api_service_name(service), heartbeat=heartbeat,
                         backoff=backoff, dialect=dialect, limits=limits, now=monotonic())
        self.requestsServed = 0
        _log_to_stdlib()
        self._context = context
        #: the sockets and the poller, made by :meth:`run` and released when
        #: it returns
        self._loop: Any = None
        self._pipe: Any = None
        self._reopenAt: Optional[float] = None
        self._nextTick = 0.0
        self._stopping = False
        self._madeUp = False

    def stop(self) -> None:
        """Make :meth:`run` return (after saying DISCONNECT) once the current
        request, if any, is answered.  From a handler or a signal handler;
        from another thread it takes effect within half a heartbeat interval."""
        self._stopping = True

    def run(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Serve until :meth:`stop` is called, *until()* is true (checked
        after every wake-up), or an exception (Ctrl-C) ends the loop; then say
        DISCONNECT and close."""
        self._stopping = False
        self._loop = _Loop(self.limits, self._context)
        now = monotonic()
        self._nextTick = now + self.wakeEvery
        self._perform(self.handleStart(now))
        try:
            while not self._stopping and (until is None or not until()):
                when = self._nextTick
                if self._reopenAt is not None and self._reopenAt < when:
                    when = self._reopenAt
                self._loop.turn(when)
                now = monotonic()
                if self._reopenAt is not None and now >= self._reopenAt:
                    self._reopenAt = None
                    self._perform(self.handleReopen(now))
                if now >= self._nextTick:
                    self._tock(now)
        finally:
            self._reopenAt = None
            try:
                self._perform(self.handleStop(monotonic()))
            finally:
                loop, self._loop = self._loop, None
                loop.shutdown()

    # --- what the pipe reports -------------------------------------------------

    def _pipeUp(self, tag: Any, now: float) -> None:
        self._perform(self.handlePipeUp(now))

    def _pipeLost(self, tag: Any, why: BaseException, now: float) -> None:
        self._perform(self.handlePipeLost(now, why))

    def _pipeFailed(self, tag: Any, error: BaseException, now: float) -> None:
        # logged; the stream retries, and the broker's silence decides (the machine's tick)
        self._perform(self.handleConnectFailed(error, now))

    def _pipeMessage(self, tag: Any, frames: list[bytes], now: float) -> None:
        self._perform(self.handleMessage(frames, now))

    # --- the driver ------------------------------------------------------------

    def _perform(self, actions: list[Any]) -> None:
        for action in actions:
            kind = type(action)
            if kind is SendToBroker:
                if self._pipe is not None:
                    self._pipe.send(action.frames)
            elif kind is Serve:
                self._serve(action.job, action.body)
            elif kind is OpenPipe:
                try:
                    pipe = self._loop.open(action.endpoint, self, None, LINGER_MS,
                                           curve=self.curve)
                except Exception as e:  # no socket to be had (out of descriptors)
                    error = TransportError(f"cannot connect to {action.endpoint!r}: {e}")
                    error.__cause__ = e
                    self._perform(self.handleOpenFailed(error, monotonic()))
                    continue
                self._pipe = pipe
                pipe.start()
                if pipe.up:
                    self._madeUp = True
            elif kind is ClosePipe:
                pipe, self._pipe = self._pipe, None
                if pipe is not None:
                    self._loop.close(pipe)
            elif kind is ReopenAfter:
                self._reopenAt = monotonic() + action.delay
            # StoreReply: a blocking worker keeps no reply store
        if self._madeUp:
            self._madeUp = False
            if self._pipe is not None:
                self._perform(self.handlePipeUp(monotonic()))

    def _serve(self, job: Any, body: list[bytes]) -> None:
        started = monotonic()
        try:
            result = self.handler(body)
            # (the ABC check only for what is not a plain reply: it costs)
            if type(result) not in _PLAIN_REPLIES and isinstance(result, Generator):
                self._stream(result, job)
            else:
                self._reply(job, WorkerFinal, reply_frames(result))
                self.requestsServed += 1
        except Exception as e:
            log.failure("handler for {service} failed", service=label(self.service))
            self._reply(job, WorkerFinal, codec.error_body(
                codec.STATUS_WORKER_ERROR, f"{type(e).__name__}: {e}"))
        if monotonic() - started > self.heartbeat.interval:
            self._perform(self.handleBlocked(monotonic()))

    def _stream(self, parts: Any, job: Any) -> None:
        loop = self._loop
        for item in parts:
            if isinstance(item, Final):
                parts.close()
                self._reply(job, WorkerFinal, reply_frames(item.frames))
                self.requestsServed += 1
                return
            if not self._reply(job, WorkerPartial, reply_frames(item)):
                parts.close()  # the request is void, or was answered (413)
                return
            # between parts as between requests: what the broker sent is
            # read, a HEARTBEAT goes out when due, a broker silent for its
            # expiry is given up
            pipe = self._pipe
            if pipe is not None and pipe.backlogged:
                # the broker takes PARTIALs slower than the handler makes
                # them: wait rather than pile them up
                while pipe.backlogged and self.isCurrent(job) and not loop.poller.closed:
                    loop.turn(self._nextTick)
                    now = monotonic()
                    if now >= self._nextTick:
                        self._tock(now)
            else:
                now = monotonic()
                if now >= self._nextTick:
                    loop.turn(now)  # (a look, no wait)
                    self._tock(monotonic())
            if not self.isCurrent(job):
                # its broker was lost or given up meanwhile: so is the request
                parts.close()
                log.info("worker for {service} stopped a stream: its request went with "
                         "its broker", service=label(self.service))
                return
        self._reply(job, WorkerFinal, [b""])
        self.requestsServed += 1

    def _tock(self, now: float) -> None:
        """The machine's tick, due by *now* (heartbeats, the broker's
        silence); a tick late by more than an interval was held up by a
        handler (or a stopped process): the broker's silence is ours."""
        if now - self._nextTick > self.heartbeat.interval:
            self._perform(self.handleBlocked(now))
        self._nextTick = now + self.wakeEvery
        self._perform(self.handleTick(now))

    def _reply(self, job: Any, kind: type, frames: list[bytes]) -> bool:
        sent, actions = self.handleReply(job, kind, frames, monotonic())
        self._perform(actions)
        return sent
