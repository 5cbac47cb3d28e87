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

import errno
import os
import select
import socket
import sys
from collections import deque
from collections.abc import Generator
from time import monotonic
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from twisted.logger import Logger

from mdp.errors import ClientClosed, OversizedMessage, TransportError
from mdp.handlers import reply_frames
from mdp.majordomo import codec
from mdp.majordomo.client import report_stale, tell
from mdp.majordomo.client_machine import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    Action,
    ClientMachine,
    CloseChannel,
    Complete,
    Fail,
    OpenChannel,
    SendOn,
    WakeAt,
    _Call,
    _Channel,
    _check_attempts,
)
from mdp.majordomo.codec import WorkerFinal, WorkerPartial
from mdp.majordomo.worker import (
    ClosePipe,
    Final,
    OpenPipe,
    ReopenAfter,
    SendToBroker,
    Serve,
    StoreReply,
    WorkerDriver,
)
from mdp.messages import Frame
from mdp.messages import text as label
from mdp.policy import PIRATE, RECONNECT, Backoff, HeartbeatPolicy, Limits, LogThrottle
from mdp.transport import curve_client_for, curve_for, endpoint_list
from mdp.transport.framing import CHANNELS_GREETING, RecordDecoder, encode_record
from mdp.transport.registry import split_description
from mdp.transport.zeromq import ZERO_COPY_BYTES, random_identity, zmq_frames

__all__ = ["Client", "Worker", "STREAM_SCHEMES"]

#: the longest wait one poll takes (its timeout is a C int of milliseconds)
_MAX_WAIT_MS = 2**31 - 1

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)
#: how long closing a worker's socket may take to send its DISCONNECT (ms)
LINGER_MS = 200

#: stream schemes the blocking client speaks (plain sockets, no TLS; as for
#: the Twisted client, ``tcp:`` connects to IPv6 hosts too: ``tcp6:`` listens)
STREAM_SCHEMES = ("tcp", "unix")
_READ_SIZE = 262144

_PENDING: Any = object()  # the end of map()'s items

#: what a handler returns that is certainly not a generator
_PLAIN_REPLIES = frozenset((bytes, list, tuple, str, type(None)))

_forks = 0  # how many times this process is a fork's child (clients do not cross a fork)


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def _log_to_stdlib() -> None:
    """Where nothing has begun Twisted's logging (a plain script), send the
    library's log events to the standard :mod:`logging` module, so that a
    blocking node's warnings (a retry, a failed handler) are not held in
    Twisted's start-up buffer unseen."""
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    if getattr(globalLogBeginner, "_temporaryObserver", None) is not None:
        globalLogBeginner.beginLoggingTo([STDLibLogObserver()], redirectStandardIO=False)


def _zmq() -> Any:
    import zmq

    return zmq


def _stream_address(endpoint: str) -> tuple[int, Any]:
    scheme, _, rest = endpoint.partition(":")
    args, kwargs = split_description(rest)
    if scheme == "unix":
        path = kwargs.get("path") or (args[0] if args else None)
        if not path:
            raise TransportError(f"bad endpoint {endpoint!r}: no path")
        return socket.AF_UNIX, path
    host = kwargs.get("host") or (args[0] if args else None)
    port = kwargs.get("port") or (args[1] if len(args) > 1 else None)
    if not host or not port:
        raise TransportError(f"bad endpoint {endpoint!r}: give host and port")
    return socket.AF_UNSPEC, (host, int(port))


def _check_schemes(endpoints: list[str]) -> None:
    """Refuse (at once) an endpoint whose scheme has no blocking transport."""
    for each in endpoints:
        scheme = each.partition(":")[0]
        if scheme == "zmq":
            continue
        if scheme not in STREAM_SCHEMES:
            raise TransportError(
                f"blocking nodes speak zmq:, {', '.join(s + ':' for s in STREAM_SCHEMES)} "
                f"endpoints, not {each!r}")
        _stream_address(each)


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
        """Watch *fd* for *flags* (``POLLIN``/``POLLOUT``), replacing what it
        was watched for."""
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
        """Ready descriptors and their flags, waiting at most *timeout* ms
        (-1: no limit)."""
        if self._seconds:
            return self._poller.poll(timeout / 1000 if timeout >= 0 else -1)
        return self._poller.poll(timeout if timeout >= 0 else None)

    def close(self) -> None:
        self.closed = True
        if self._seconds:
            self._poller.close()
        self._flags.clear()


class _Loop:
    """One poller (``epoll`` where there is one) over the descriptors of the
    pipes, and the pipes' reconnection times: what a blocking node waits on.
    A pipe reports to its *owner* (the client or the worker) through
    ``_pipeUp``, ``_pipeLost``, ``_pipeFailed`` and ``_pipeMessage``, each
    with the *tag* it was opened with.

    A ZeroMQ socket is watched through its ``ZMQ_FD``, as the Twisted
    transport watches it: that descriptor only says "ask ``EVENTS``", and a
    send or receive on the socket may consume its signal, so a pipe that used
    its socket is asked ``EVENTS`` before the loop waits again (``unchecked``).
    A wake-up costs what is ready, not a ``zmq_poll`` over every socket (a
    pipelined client holds one per request in flight).

    A caller's callback may wait on the loop (a request made from inside
    ``onPartial``) while the message it is called for was one of several
    read at once: the rest, read already and not handed on yet (a stream
    pipe's ``received``, or a ZeroMQ socket whose signal that read spent),
    are handed on by that wait before it blocks (``unchecked`` again), in
    order: the reply it may be waiting for can be among them."""

    def __init__(self, limits: Limits, context: Any) -> None:
        self.limits = limits
        self._zmqContext = context
        self.poller = _Poller()
        self.pipes: dict[int, Any] = {}  # descriptor -> pipe
        #: pipes that may have a connection attempt due (``retryAt``): the
        #: stream pipes, and a ZeroMQ pipe waiting to get a socket again
        self.timed: set[Any] = set()
        #: pipes to ask (``check``) before waiting: ZeroMQ pipes whose socket
        #: was used since it was last asked EVENTS, and stream pipes holding
        #: messages read and not handed on yet
        self.unchecked: set[Any] = set()
        #: the stream connections that carry a client's pipes, by endpoint
        self.links: dict[str, _StreamLink] = {}
        #: stream pipes with records to send before the loop waits (what a
        #: turn's requests send goes out in one write)
        self.unflushed: set[Any] = set()
        #: links whose last pipe closed: closed once the actions that closed
        #: it are done, unless a pipe opened meanwhile (a connection replaced)
        #: keeps them (closeIdle)
        self.idle: set[Any] = set()

    def context(self) -> Any:
        if self._zmqContext is None:
            self._zmqContext = _zmq().Context.instance()
        return self._zmqContext

    def open(self, endpoint: str, owner: Any, tag: Any, linger: int = 0, curve: Any = None,
             shared: bool = False) -> Any:
        """A pipe to *endpoint*, to be started (``start()``) once its owner
        holds it: a ZeroMQ one (with *curve*, a CURVE client) is up at once
        (the caller tells its owner), a stream one once its connection is
        made (or it reports a failure, at once or later).  *shared*: a stream
        pipe is a channel of the one connection this loop keeps to
        *endpoint* (:class:`_StreamLink`), up whenever it is."""
        if self.poller.closed:  # (its owner is closed: no socket is made for it any more)
            raise TransportError(f"cannot open a connection to {endpoint}: closed")
        if endpoint.startswith("zmq:"):
            return _ZmqPipe(self, owner, tag, endpoint[len("zmq:"):], linger,
                            curve_for(endpoint, curve))
        family, address = _stream_address(endpoint)
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
        """Wait for a socket or until *when* (or a pipe's next connection
        attempt, if sooner), and handle what came."""
        if self.idle:
            self.closeIdle()
        if self.unflushed:
            unflushed, self.unflushed = self.unflushed, set()
            try:
                for stream in unflushed:
                    stream._flush()
            except BaseException:  # (Ctrl-C) flushed again next time; twice is harmless
                self.unflushed |= unflushed
                raise
        now = monotonic()
        timed = self.timed
        for pipe in timed:
            retry = pipe.retryAt
            if retry is not None and (when is None or retry < when):
                when = retry
        # (poll takes at most 2**31-1 ms: a longer wait is several turns)
        if when is None:
            timeout = -1
        else:
            ms = (when - now) * 1000.0
            # whole milliseconds, rounded up (a wait that ends a little late is
            # harmless, one that ends early is a wasted wake-up)
            timeout = 0 if ms <= 0 else _MAX_WAIT_MS if ms >= _MAX_WAIT_MS else int(ms) + 1
        pipes = self.pipes
        if len(pipes) == 1 and not timed:
            for only in pipes.values():
                if not only.backlog:
                    only.wait(timeout)
                    break
            else:
                self._poll(timeout, now)
        else:
            self._poll(timeout, now)
        if timed:
            now = monotonic()
            for pipe in list(timed):
                if pipe.retryAt is not None and now >= pipe.retryAt:
                    pipe.wake(now)

    def closeIdle(self) -> None:
        """Close the links whose last pipe closed, unless one opened since."""
        idle, self.idle = self.idle, set()
        for link in idle:
            if not link.pipes:
                link.close()

    def _poll(self, timeout: int, now: float) -> None:
        if self.unchecked:
            # what a send or a receive left unsaid: a message that came
            # meanwhile does not signal the descriptor again
            unchecked, self.unchecked = self.unchecked, set()
            try:
                for pipe in unchecked:
                    if pipe.check(now):
                        timeout = 0  # something was handled: look, but do not wait
            except BaseException:
                # (Ctrl-C in a caller's callback) the rest are asked next
                # time; asking one twice is harmless
                self.unchecked |= unchecked
                raise
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
        """Release the poller's descriptor (the pipes are closed already),
        after closing the links their last pipes left."""
        for link in list(self.links.values()):
            link.close()
        self.idle.clear()
        self.poller.close()


#: Messages a DEALER of a blocking node queues each way (its HWMs).
_HIGH_WATER_MARK = 1000


class _ZmqPipe:
    """One DEALER socket: up from the start (ZeroMQ connects in the
    background and reconnects by itself)."""

    __slots__ = ("loop", "owner", "tag", "socket", "handle", "fd", "backlog", "up", "waitMs",
                 "address", "linger", "curve", "failures", "retryAt")

    def __init__(self, loop: _Loop, owner: Any, tag: Any, address: str, linger: int,
                 curve: Any = None) -> None:
        self.loop = loop
        self.owner = owner
        self.tag = tag
        self.address = address
        self.linger = linger
        self.curve = curve
        self.backlog: deque[list[bytes]] = deque()
        #: when to try again for a socket that could not be had (see _oversized)
        self.failures = 0
        self.retryAt: Optional[float] = None
        self._connect()

    def _connect(self) -> None:
        """A fresh socket, connected (a fresh routing id for the broker)."""
        zmq = _zmq()
        self.socket = None
        self.up = False
        sock = self.loop.context().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, self.linger)
            sock.setsockopt(zmq.SNDHWM, _HIGH_WATER_MARK)
            sock.setsockopt(zmq.RCVHWM, _HIGH_WATER_MARK)
            if self.curve is not None:
                self.curve.apply(sock)
                sock.setsockopt(zmq.ROUTING_ID, random_identity())  # not guessable (ZmqRouter)
            sock.connect(self.address)
            fd = _get(sock, _FD)
            self.loop.poller.watch(fd, _POLLIN)  # (a closed poller refuses: the socket goes)
        except BaseException:
            sock.close(0)
            raise
        self.socket = sock
        self.handle = sock.underlying  # its address in libzmq, for _frames
        self.fd = fd
        self.up = True
        self.waitMs = -1  # the socket's RCVTIMEO
        self.loop.pipes[fd] = self

    @property
    def backlogged(self) -> bool:
        return bool(self.backlog)

    def start(self) -> None:
        pass  # connected already: ZeroMQ connects in the background

    def send(self, frames: list[bytes]) -> None:
        if self.socket is None:
            return
        if self.backlog or not self._trySend(frames):
            self.backlog.append(frames)
        self.loop.unchecked.add(self)

    def _trySend(self, frames: list[bytes]) -> bool:
        send = _send
        sock = self.socket
        last = len(frames) - 1
        try:
            if _frames is not None:
                _sendC(self.handle, frames, ZERO_COPY_BYTES, send, sock)
                return True
            for i, frame in enumerate(frames):
                send(sock, frame, _NOBLOCK if i == last else _NOBLOCK_SNDMORE,
                     len(frame) < ZERO_COPY_BYTES)  # (copy: positional is cheaper)
        except _zmq().Again:
            return False  # only the first frame can be refused (a full pipe)
        return True

    def ready(self, flags: int, now: float) -> None:
        """The socket's descriptor was signalled: see what is ready."""
        self.check(now)

    def check(self, now: float) -> bool:
        """Ask the socket's ``EVENTS``, and send what waits and read what came
        accordingly; whether anything was read."""
        sock = self.socket
        if sock is None:
            return False
        events = self._events()
        if events & _ZMQ_POLLOUT and self.backlog:
            while self.backlog and self._trySend(self.backlog[0]):
                self.backlog.popleft()
            self.loop.unchecked.add(self)
        if events & _ZMQ_POLLIN:
            self._read(now)
            return True
        return False

    def wait(self, timeout: int) -> None:
        """The only socket of the loop: block in ``recv`` for at most
        *timeout* ms (-1: no limit), as a plain pyzmq loop would, instead of
        polling; handle what came."""
        sock = self.socket
        if _frames is None:
            # pyzmq's recv waits its whole RCVTIMEO again after each signal
            # (EINTR); its poll waits for what is left
            if sock.poll(timeout, _ZMQ_POLLIN):
                self.check(monotonic())
            return
        current = self.waitMs
        # a wait that ends a little late is harmless; setting RCVTIMEO on
        # every request is not free; a signal ends it early (Again), and the
        # loop waits again for what is left
        if current != timeout and (timeout < 0 or current < 0 or current < timeout // 2
                                   or current > timeout + min(50, timeout // 20)):
            _set(sock, _RCVTIMEO, timeout)
            self.waitMs = current = timeout
        try:
            frames = self._message(0)
        except _zmq().Again:
            return
        # one message a wake-up: the next recv takes what else is queued at once
        self.loop.unchecked.add(self)
        self._take(frames, monotonic())

    def _events(self) -> int:
        """The (open) socket's ``EVENTS`` bits, in C where that is built
        (pyzmq's ``get`` makes an enum of the option first)."""
        if _frames is not None:
            return _eventsC(self.handle)  # type: ignore[no-any-return]
        return _get(self.socket, _EVENTS)  # type: ignore[no-any-return]

    def discardReceived(self) -> int:
        """Read off and drop the messages waiting on the socket; how many."""
        sock = self.socket
        dropped = 0
        if sock is None:
            return 0
        for _ in range(_HIGH_WATER_MARK):  # what the socket holds at most
            if not self._events() & _ZMQ_POLLIN:
                break
            self._message(_NOBLOCK, False)
            dropped += 1
        return dropped

    def _read(self, now: float) -> None:
        """Read the messages that are there (EVENTS said one is), at most a
        few a wake-up: the loop comes back for the rest (asked again)."""
        sock = self.socket
        loop = self.loop
        for _ in range(64):
            # the socket's signal is spent: a callback of this message that
            # waits on the loop (a request from inside onPartial) has the
            # socket asked again, and what else it holds read, before it waits
            # (the set itself, not one kept: a wait swaps it for a new one)
            loop.unchecked.add(self)
            self._take(self._message(_NOBLOCK), now)
            if self.socket is not sock:
                return
            if not self._events() & _ZMQ_POLLIN:
                # asked just now (after whatever the callbacks sent on it):
                # its signal is armed again, no need to ask before waiting
                # (unless it holds messages to send)
                if not self.backlog:
                    loop.unchecked.discard(self)
                return

    def _message(self, flags: int, limited: bool = True) -> Any:
        """Receive a whole message (ZeroMQ delivers one whole, or nothing:
        ``Again``), in C where that is built (``_frames``): its frames; or,
        *limited* and over the limits, ``(bytes, frames)`` read so far, and
        nothing past the limit copied (the rest goes with the socket, which
        the caller replaces)."""
        if limited:
            limits = self.loop.limits
            maxFrames, maxBytes = limits.maxFrames, limits.maxMessageBytes
        else:
            maxFrames = maxBytes = _NEVER
        if _frames is not None:
            got = _readC(self.handle, flags, _NEVER, 0, maxFrames, maxBytes, False)
            if got.__class__ is list:
                return got
            _, count, size, _ = got[1]
            return size, count
        sock = self.socket
        frame = _recv(sock, flags, copy=False)
        count = 1
        size = len(frame)
        if size > maxBytes:
            return size, count
        frames = [frame.bytes]
        while frame.more:
            frame = _recv(sock, _NOBLOCK, copy=False)
            count += 1
            size += len(frame)
            if count > maxFrames or size > maxBytes:
                return size, count
            frames.append(frame.bytes)
        return frames

    def _take(self, frames: Any, now: float) -> None:
        """Hand the message *frames* to the owner; or, over the limits
        (``(bytes, frames)``), drop it with its socket."""
        if frames.__class__ is not list:
            size, count = frames
            self._oversized(now, size, count)
            return
        self.owner._pipeMessage(self.tag, frames, now)

    def _oversized(self, now: float, size: int, count: int) -> None:
        """As the Twisted dealer: drop the message and the socket that carried
        it (a fresh one replaces it), and tell the owner its pipe was lost to
        an oversized message, then that it is up again."""
        self.close()
        why = OversizedMessage(f"a message of {size}+ bytes in {count} frames is over the limits")
        self.failures = 0
        self._reopen(now)
        self.owner._pipeLost(self.tag, why, now)
        if self.socket is not None:
            self.owner._pipeUp(self.tag, now)

    def _reopen(self, now: float) -> bool:
        """A fresh socket; if none can be had (out of descriptors), say so
        and try again after :data:`RECONNECT`'s delay (the loop wakes the
        pipe), down meanwhile as a stream pipe that reconnects."""
        try:
            self._connect()
        except Exception as e:
            delay = RECONNECT.delay(self.failures)
            self.failures += 1
            self.retryAt = now + delay
            self.loop.timed.add(self)
            log.warn("zmq dealer to {address} cannot open a socket: {error}; tries again in "
                     "{delay:g}s", address=self.address, error=e, delay=delay)
            return False
        self.retryAt = None
        self.loop.timed.discard(self)
        return True

    def wake(self, now: float) -> None:
        """Time to try again for a socket."""
        if self.retryAt is not None and now >= self.retryAt and self.socket is None:
            if self._reopen(now):
                self.owner._pipeUp(self.tag, now)

    def close(self) -> None:
        sock, self.socket = self.socket, None
        self.handle = 0
        self.up = False
        self.retryAt = None
        self.backlog.clear()
        self.loop.unchecked.discard(self)
        self.loop.timed.discard(self)
        if sock is not None:
            self.loop.forget(self.fd)  # before the socket (and its descriptor) goes
            sock.close()  # after LINGER ms at most


class _StreamPipe:
    """One plain stream socket with the stream transport's records; it
    reconnects with :data:`RECONNECT`'s backoff after a failure or a loss, as
    the Twisted transport does.  With *channels*, the connection of a
    :class:`_StreamLink`: it greets with the channels greeting, every record
    names its channel (its messages are ``(channel, frames)`` pairs), and
    what is sent goes out when the loop next waits, in one write."""

    __slots__ = ("loop", "owner", "tag", "family", "address", "socket", "key", "out", "decoder",
                 "up", "connecting", "failures", "retryAt", "received", "candidates", "skip",
                 "broken", "channels", "queuedBytes", "sentBytes")

    backlog = ()  # never waits in recv alone (see _Loop.turn)

    def __init__(self, loop: _Loop, owner: Any, tag: Any, family: int, address: Any,
                 channels: bool = False) -> None:
        self.loop = loop
        self.owner = owner
        self.tag = tag
        self.family = family
        self.address = address
        self.channels = channels
        self.socket: Optional[socket.socket] = None
        self.key: Any = None
        self.out = bytearray()
        #: bytes put in ``out`` and bytes written, on this connection (a
        #: channel's request has left once ``sentBytes`` passed its end)
        self.queuedBytes = 0
        self.sentBytes = 0
        self.decoder = self._decoder()
        self.up = False
        self.connecting = False
        self.failures = 0
        self.retryAt: Optional[float] = None
        #: messages read and not yet handed on, in order: a caller's callback
        #: that waits on this loop reads more meanwhile (see ready)
        self.received: deque[list[bytes]] = deque()
        #: the addresses of this attempt's host not yet tried
        self.candidates: list[tuple[int, Any]] = []
        #: records to drop as they complete: one begun before a discard (on
        #: channels: the channels discarded meanwhile, whose record it may be)
        self.skip: Any = 0
        #: what was wrong with the stream read by a discard (reported as the loss)
        self.broken: Optional[BaseException] = None

    @property
    def backlogged(self) -> bool:
        return bool(self.out)

    def _decoder(self) -> RecordDecoder:
        decoder = RecordDecoder(self.loop.limits)
        decoder.channels = self.channels
        return decoder

    def start(self) -> None:
        self.open(monotonic())

    def open(self, now: float) -> None:
        """Start a connection attempt (the poller says when it is made): to
        each address the host resolves to in turn, as Twisted's endpoints
        do, until one takes."""
        self.retryAt = None
        if self.family == socket.AF_UNIX:
            self.candidates = [(socket.AF_UNIX, self.address)]
        else:
            host, port = self.address
            try:
                found = socket.getaddrinfo(host, port, self.family, socket.SOCK_STREAM)
            except OSError as e:
                self._failed(e, now)
                return
            self.candidates = [(info[0], info[4]) for info in found]
        self._next(now, None)

    def _next(self, now: float, error: Optional[BaseException]) -> None:
        """Connect to the next address not tried; if none is left, the
        attempt failed with the last *error*."""
        while self.candidates:
            family, target = self.candidates.pop(0)
            sock = None
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
                if family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                code = sock.connect_ex(target)
            except OSError as e:  # no descriptor, a path too long, ...
                if sock is not None:
                    sock.close()
                error = e
                continue
            # (EAGAIN is not "in progress": a local socket's listener has a
            # full backlog, which a later attempt may find free)
            if code not in (0, errno.EINPROGRESS):
                sock.close()
                error = OSError(code, os.strerror(code))
                continue
            self.socket = sock
            self.key = sock.fileno()
            self.connecting = True
            self.loop.poller.watch(self.key, _POLLOUT)
            self.loop.pipes[self.key] = self
            return
        self._failed(error or OSError(errno.EADDRNOTAVAIL, f"{self.address!r} has no address"),
                     now)

    def _failed(self, error: BaseException, now: float) -> None:
        if isinstance(error, socket.gaierror):
            from twisted.internet.error import DNSLookupError

            error = DNSLookupError(str(error))
        self.connecting = False
        self.failures += 1
        self.retryAt = now + RECONNECT.delay(self.failures - 1)
        self.owner._pipeFailed(self.tag, error, now)

    def send(self, frames: list[bytes]) -> None:
        if not self.up:
            return
        self.out += encode_record(frames)
        self._flush()

    def sendRecord(self, record: bytes) -> int:
        """Send *record*, whole as the wire has it (a channel's), when the
        loop next waits (``unflushed``); where it ends in what this
        connection sends (``queuedBytes``; 0: not up, not sent)."""
        if not self.up:
            return 0
        return self._queue(record)

    def _queue(self, record: bytes) -> int:
        self.out += record
        self.queuedBytes += len(record)
        self.loop.unflushed.add(self)
        return self.queuedBytes

    def _flush(self) -> None:
        sock = self.socket
        if sock is None or not self.up:
            return
        if self.channels and self.owner.unsent:
            self.owner.settle()  # (what came before the requests about to go)
        try:
            sent = sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the poller reports the loss
        del self.out[:sent]
        self.sentBytes += sent
        self.loop.poller.watch(self.key, _POLLIN | (_POLLOUT if self.out else 0))

    def ready(self, events: int, now: float) -> None:
        sock = self.socket
        if sock is None:
            return
        if self.connecting:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if not code:
                try:
                    sock.getpeername()
                except OSError as e:  # writable, yet not connected
                    code = e.errno or errno.ENOTCONN
            if code:
                self._drop()
                self._next(now, OSError(code, os.strerror(code)))
                return
            if self.channels:  # (first, before what the pipes send; and before it is up)
                self._queue(CHANNELS_GREETING)
            self.connecting = False
            self.up = True
            self.failures = 0
            self.loop.poller.watch(self.key, _POLLIN)
            self.owner._pipeUp(self.tag, now)
            return
        if events & _POLLOUT:
            self._flush()
        if events & (_POLLIN | _POLLERR | _POLLHUP):
            if self.broken is not None:  # (a discard, or a read below, found it unusable)
                self._lost(self.broken, now)
                return
            try:
                data = sock.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e, now)
                return
            if not data:
                self._lost(self.broken or ConnectionError("connection closed by the broker"),
                           now)
                return
            try:
                messages = self.decoder.feed(data)
            except Exception as e:  # ProtocolError (RecordTooLarge): the stream is unusable
                # what came whole before it is handed on first, as the Twisted
                # transport does (on channels, the other pipes' replies); a
                # callback's wait meanwhile must not read on past it
                self._break(e)
                self._take(getattr(e, "decoded", None) or [], now)
                if self.socket is sock:
                    self._lost(e, now)
                return
            self._take(messages, now)

    def _break(self, error: BaseException) -> None:
        """The stream cannot be decoded past this point: nothing more is
        read from it, and the next read reports *error* as the loss."""
        self.broken = error
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        except OSError:
            pass

    def _take(self, messages: list[Any], now: float) -> None:
        if self.skip and messages:
            self._skipBegun(messages)
        self.received.extend(messages)
        self._handOn(now)

    def _skipBegun(self, messages: list[Any]) -> None:
        """Drop the first of *messages*, the record a discard saw begun (it
        came before the request then sent, so it cannot answer it), now
        that it is whole; on channels, if it came on a channel discarded."""
        if not self.channels or messages[0][0] in self.skip:
            del messages[0]
        self.skip = 0

    def _handOn(self, now: float) -> None:
        """Hand on the messages read and not handed on yet, in order.  A
        callback of one of them may wait on the loop (a request from inside
        onPartial): that wait hands on the rest before it blocks (``check``,
        the pipe being ``unchecked``) or reads here again (``ready``, which
        hands on what is left first, then its own), so that a reply among
        them (the FINAL that frees this connection) is not held back."""
        received = self.received
        owner, tag, loop = self.owner, self.tag, self.loop
        while received:  # (a loss meanwhile clears it)
            frames = received.popleft()
            if received:
                loop.unchecked.add(self)  # (a wait swaps the set: not one kept)
            owner._pipeMessage(tag, frames, now)

    def check(self, now: float) -> bool:
        """Hand on the messages read and not handed on yet (see _handOn);
        whether there were any."""
        if not self.received:
            return False
        self._handOn(now)
        return True

    def discardReceived(self) -> int:
        """Drop the messages read and not handed on yet, and those waiting
        in the socket; how many.  A record begun and not complete is dropped
        when it is (it came before what is about to be sent, so it cannot
        answer it)."""
        dropped = len(self.received) + len(self._drain())
        self.received.clear()
        if self.broken is not None:
            return dropped
        # (what an earlier discard saw begun has come whole meanwhile)
        self.skip = 1 if self.decoder.inRecord else 0
        return dropped + self.skip

    def _drain(self) -> list[Any]:
        """Read what waits in the socket now and decode it: the messages it
        completes (a record an earlier discard saw begun, dropped).  A
        stream that cannot be read any more is left for the poller to
        report; one that cannot be decoded, for the next read
        (``broken``)."""
        sock = self.socket
        messages: list[Any] = []
        if sock is None or not self.up or self.broken is not None:
            return messages
        for _ in range(64):  # bounded: a peer sending without pause cannot hold us here
            try:
                data = sock.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # the poller reports the loss
            if not data:
                break  # the same: the next read sees the end again
            try:
                messages += self.decoder.feed(data)
            except Exception as e:  # the stream is unusable: the next read reports it
                messages += getattr(e, "decoded", None) or []
                self._break(e)
                break
        if self.skip and messages:
            self._skipBegun(messages)
        return messages

    def _lost(self, why: BaseException, now: float) -> None:
        self._drop()
        self.retryAt = now + RECONNECT.delay(0)
        self.owner._pipeLost(self.tag, why, now)

    def _drop(self) -> None:
        sock, self.socket = self.socket, None
        self.up = self.connecting = False
        self.out.clear()
        self.received.clear()
        self.loop.unchecked.discard(self)
        self.skip = 0
        self.broken = None
        self.queuedBytes = self.sentBytes = 0
        self.decoder = self._decoder()
        self.loop.unflushed.discard(self)
        if sock is not None:
            self.loop.forget(self.key)
            sock.close()

    def wake(self, now: float) -> None:
        """Time for the next connection attempt."""
        if self.retryAt is not None and now >= self.retryAt and self.socket is None:
            self.open(now)

    def close(self) -> None:
        """Close, after handing the OS what waits to be sent (for at most a
        moment: DISCONNECT on a worker's way out)."""
        sock = self.socket
        if sock is not None and self.up and self.out:
            try:
                sock.settimeout(0.2)
                sock.sendall(self.out)
            except OSError:
                pass
        self.retryAt = None
        self._drop()


#: what ends a channel: a record of no frames
_END = encode_record([])


class _StreamLink:
    """The one stream connection a client keeps to an endpoint, carrying
    its pipes as *channels* (``docs/transports.md``; what the Twisted
    client's ``StreamChannels`` is): each pipe is up while the connection
    is, and the broker knows it as a peer of its own.  The requests of a
    turn go out in one write, and their replies come in one read.

    The broker ending a channel ends that pipe alone: it is lost, and up
    again after the reconnection delay under a new channel.  Losing the
    connection loses every pipe; they are up again together once it is
    back (a record over the limits loses the whole connection, and that
    pipe's loss says so).  No channel is used twice on a connection: what
    comes on one this side ended is dropped.  The connection is opened with
    the first pipe and closed with the last (``forget``).

    What comes on a channel before its request has left, whole, is not a
    reply to it: it is dropped (the stale-reply look of ``discard`` and
    ``settle``), as a pipe of its own drops what came before its send."""

    __slots__ = ("loop", "endpoint", "stream", "pipes", "unsent", "untold", "_next")

    def __init__(self, loop: _Loop, endpoint: str, family: int, address: Any) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.stream = _StreamPipe(loop, self, None, family, address, channels=True)
        loop.timed.add(self.stream)
        #: the open pipes, by channel
        self.pipes: dict[bytes, _LinkPipe] = {}
        #: channels whose request has not left whole yet: where it ends in
        #: what the connection sends (``_StreamPipe.queuedBytes``)
        self.unsent: dict[bytes, int] = {}
        #: pipes the connection's loss is still to be told to, and why (a
        #: callback told before them may wait on the loop, which may bring
        #: the connection up again: they hear of the loss first)
        self.untold: deque[tuple[_LinkPipe, BaseException]] = deque()
        self._next = 0

    def open(self, owner: Any, tag: Any) -> _LinkPipe:
        pipe = _LinkPipe(self, owner, tag)
        self._name(pipe)
        pipe.up = self.stream.up
        return pipe

    def start(self) -> None:
        """Connect, unless connected, connecting or waiting to try again."""
        stream = self.stream
        if stream.socket is None and stream.retryAt is None:
            stream.open(monotonic())

    def _name(self, pipe: _LinkPipe) -> None:
        """Give *pipe* a channel not used on this connection yet (as the
        Twisted side: 2³² of them before one comes round again)."""
        pipes = self.pipes
        while True:
            self._next = self._next % 0xFFFFFFFF + 1
            name = self._next.to_bytes(4, "big")
            if name not in pipes:
                break
        pipe.id = name
        pipes[name] = pipe

    def send(self, pipe: _LinkPipe, frames: list[bytes]) -> None:
        at = self.stream.sendRecord(pipe.id + encode_record(frames))
        if at:
            self.unsent[pipe.id] = at

    def _unsent(self, name: bytes) -> bool:
        """Whether channel *name*'s request is still to leave (what comes
        on it cannot answer it)."""
        at = self.unsent.get(name)
        if at is None:
            return False
        if self.stream.sentBytes >= at:
            del self.unsent[name]
            return False
        return True

    def discard(self, name: bytes) -> int:
        """A request is about to go on channel *name*: drop what came on it
        and is read, not handed on yet (how many); what waits in the socket
        is read off just before the request goes (``settle``).  An end the
        broker sent is kept: it is no reply."""
        received = self.stream.received
        if not received:
            return 0
        items = list(received)
        received.clear()
        return len(self._sift(items, {name}))

    def _sift(self, items: list[Any], names: set[bytes]) -> list[bytes]:
        """Keep *items* (``(channel, frames)``), in order, in what the
        connection has read and not handed on, but the messages on *names*
        (not an end: that is no reply); their channels, one a message."""
        received = self.stream.received
        dropped = []
        for item in items:
            if item[0] in names and item[1]:
                dropped.append(item[0])
            else:
                received.append(item)
        return dropped

    def settle(self) -> None:
        """Just before what the pipes sent goes out: read what waits in the
        socket, and drop what came on the channels whose request is about to
        go (a record begun there, once whole: it came before the request, so
        it cannot answer it); keep the rest, in order.  One read for all
        the requests of a turn."""
        stream = self.stream
        waiting = {name for name in list(self.unsent) if self._unsent(name)}
        if not waiting:
            return
        items = stream._drain()
        if stream.decoder.inRecord:
            stream.skip = waiting | (stream.skip or set())
        stale = set(self._sift(items, waiting))
        if stream.received:
            self.loop.unchecked.add(stream)  # handed on before the loop waits
        for name in stale:
            self._dropped(name)

    def _dropped(self, name: bytes) -> None:
        pipe = self.pipes.get(name)
        if pipe is not None and pipe.up:
            pipe.owner._stale(pipe.tag)

    def forget(self, pipe: _LinkPipe) -> None:
        """*pipe* was closed: end its channel (the broker drops what it
        had for it); the connection closes with the last pipe (once the
        client's actions are done: a pipe opened meanwhile, as when the
        client replaces one, keeps it)."""
        pipe.closed = True
        pipe.up = False
        if pipe.retryAt is not None:
            pipe.retryAt = None
            self.loop.timed.discard(pipe)
        if self.pipes.get(pipe.id) is pipe:
            self._end(pipe.id)
        if not self.pipes:
            self.loop.idle.add(self)  # closed after the actions, if still unused

    def _end(self, name: bytes) -> None:
        """Channel *name* is no longer open: send the end that says so (it
        ends it, or says this side knows the broker did)."""
        del self.pipes[name]
        self.unsent.pop(name, None)
        self.stream.sendRecord(name + _END)

    def close(self) -> None:
        if self.loop.links.get(self.endpoint) is self:
            del self.loop.links[self.endpoint]
        for pipe in list(self.pipes.values()):
            pipe.closed = True
            pipe.up = False
            self.loop.timed.discard(pipe)
        self.pipes.clear()
        self.untold.clear()
        self.loop.close(self.stream)

    def mend(self) -> None:
        """After an interrupt (Ctrl-C) cut the telling of the connection's
        events short: the pipes it left down while the connection is up
        are up (the client tells its machine, handleReset), and the losses
        not told yet are the machine's to find (its channels whose pipe is
        down)."""
        self.untold.clear()
        if self.stream.up:
            for pipe in self.pipes.values():
                if not pipe.up and not pipe.closed and pipe.retryAt is None:
                    pipe.up = True

    # --- what the connection reports ---------------------------------------------

    def _pipeUp(self, tag: Any, now: float) -> None:
        self._tellLost(now)
        for pipe in list(self.pipes.values()):
            # (a callback below may have closed it, or the connection)
            if (self.pipes.get(pipe.id) is pipe and not pipe.up and pipe.retryAt is None
                    and self.stream.up):
                pipe.up = True
                pipe.owner._pipeUp(pipe.tag, now)

    def _pipeLost(self, tag: Any, why: BaseException, now: float) -> None:
        self.unsent.clear()
        # a record refused for its size was one pipe's: the others only lost
        # the connection (what they had in flight goes again)
        refused = getattr(why, "channel", None)
        others = why
        if refused is not None:
            others = ConnectionError(f"the connection was dropped for another channel's "
                                     f"record: {why}")
        # every pipe is down before any is told (one may send on another)
        for pipe in self.pipes.values():
            if pipe.up:
                pipe.up = False
                self.untold.append((pipe, why if refused in (None, pipe.id) else others))
        self._tellLost(now)

    def _tellLost(self, now: float) -> None:
        untold = self.untold
        while untold:
            pipe, why = untold.popleft()
            if not pipe.closed:
                pipe.owner._pipeLost(pipe.tag, why, now)

    def _pipeFailed(self, tag: Any, error: BaseException, now: float) -> None:
        for pipe in list(self.pipes.values()):
            if not pipe.closed:
                pipe.owner._pipeFailed(pipe.tag, error, now)

    def _pipeMessage(self, tag: Any, item: Any, now: float) -> None:
        name, frames = item
        pipe = self.pipes.get(name)
        if pipe is None:
            return  # ended here: what came before the broker knew, or its acknowledgment
        if frames:
            if not pipe.up:
                return
            if self._unsent(name):  # (before its request left: no reply to it)
                self._dropped(name)
                return
            pipe.ends = 0
            pipe.owner._pipeMessage(pipe.tag, frames, now)
            return
        # the broker ended this channel: say it is known, and bring the pipe
        # up again under a new channel after the reconnection delay
        self._end(name)
        self._name(pipe)
        pipe.ends += 1
        pipe.retryAt = now + RECONNECT.delay(pipe.ends - 1)
        self.loop.timed.add(pipe)
        if pipe.up:
            pipe.up = False
            pipe.owner._pipeLost(pipe.tag, ConnectionError("the broker ended this channel"), now)


class _LinkPipe:
    """One pipe of a :class:`_StreamLink`: what a connection of its own
    would be, under its channel."""

    __slots__ = ("link", "owner", "tag", "id", "up", "closed", "ends", "retryAt")

    backlog = ()

    def __init__(self, link: _StreamLink, owner: Any, tag: Any) -> None:
        self.link = link
        self.owner = owner
        self.tag = tag
        self.id = b""
        self.up = False
        self.closed = False
        #: times in a row the broker ended it (paces bringing it up again)
        self.ends = 0
        #: when it comes up again, after the broker ended it
        self.retryAt: Optional[float] = None

    @property
    def backlogged(self) -> bool:
        return self.link.stream.backlogged

    def start(self) -> None:
        self.link.start()

    def send(self, frames: list[bytes]) -> None:
        if self.up:
            self.link.send(self, frames)

    def discardReceived(self) -> int:
        return self.link.discard(self.id)

    def check(self, now: float) -> bool:
        return False  # (its link's connection is what the loop asks)

    def wake(self, now: float) -> None:
        """Time to come up again, after the broker ended its channel."""
        if self.retryAt is not None and now >= self.retryAt:
            self.retryAt = None
            self.link.loop.timed.discard(self)
            if not self.closed and not self.up and self.link.stream.up:
                self.up = True
                self.owner._pipeUp(self.tag, now)

    def close(self) -> None:
        self.link.forget(self)


class _Refused:
    """An item of :meth:`Client.map` that could not be sent: its error."""

    __slots__ = ("result",)

    def __init__(self, error: Exception) -> None:
        self.result = error


class Client:
    """A blocking MDP/0.2 client of one broker (or the first live one of a
    failover list): :meth:`request` returns the reply's frames and raises the
    errors the Twisted :class:`mdp.Client`'s Deferred fails with
    (:class:`~mdp.errors.RequestTimeout`, :class:`~mdp.errors.ServiceUnavailable`,
    :class:`~mdp.errors.WorkerError`, :class:`~mdp.errors.BrokerUnreachable`, ...);
    :meth:`map` pipelines.  It drives the Twisted client's
    :class:`~mdp.majordomo.client_machine.ClientMachine` (``machine``).

    *endpoint*: ``zmq:...``, ``tcp:...`` or ``unix:...`` (one,
    or a list); *timeout* is the seconds of **one attempt** and *retries* the
    number of attempts in all.  At most *maxConnections* requests are in flight
    at once (one per connection).  *context* is the ZeroMQ context to use (by
    default one per process).

    An exception that interrupts a call (Ctrl-C, wherever it lands) drops
    every connection and fails every request in flight; the next call
    starts clean, on fresh connections (docs/blocking.md)."""

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
        endpoints = endpoint_list(endpoint)
        #: the broker's public key and this client's key pair, for zmq: endpoints
        self.curve = curve_client_for(endpoints, curveServerPublic, curveSecret)
        self.machine = ClientMachine(endpoints, timeout=timeout, retries=retries,
                                     maxConnections=maxConnections, dialect=dialect,
                                     stamp=stamp, limits=limits, now=monotonic())
        _check_schemes(endpoints)
        _log_to_stdlib()
        self.limits = limits
        self.throttle = LogThrottle(_CLOCK)
        self._loop = _Loop(limits, context)
        #: every pipe open, and its channel: to drop them all at once
        self._pipes: dict[Any, _Channel] = {}
        self._wakeTime: Optional[float] = None
        self._closed = False
        #: the result of a request of the current machine not answered yet
        self._unanswered = _Unanswered()
        self._forks = _forks

    @property
    def endpoints(self) -> list[str]:
        """The broker endpoints, in failover order."""
        return self.machine.endpoints

    @property
    def endpoint(self) -> str:
        """The broker endpoint new connections go to."""
        return self.machine.endpoint

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
        inside this call."""
        call = self._submit(service, frames, timeout, retries, onPartial, onRestart)
        self._waitFor(call)
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
        if window > self.machine.maxConnections:
            raise ValueError(f"window {window} is over maxConnections {self.machine.maxConnections}: "
                             "requests past it would wait, their attempts running")
        # mistakes of the whole call raise here, not once per item
        codec.api_service_name(service)
        if timeout is not None or retries is not None:
            _check_attempts(self.machine.timeout if timeout is None else timeout,
                            self.machine.retries if retries is None else retries)
        return self._map(service, iter(requests), window, timeout, retries, returnExceptions)

    def _map(self, service: Union[str, bytes], items: Iterator[Any], window: int,
             timeout: Optional[float], retries: Optional[int],
             returnExceptions: bool) -> Iterator[Any]:
        pending: deque[Any] = deque()
        #: what reading *items* raised: raised in its place, after the
        #: replies to the items before it
        broken: Optional[Exception] = None
        try:
            while True:
                while len(pending) < window and broken is None:
                    try:
                        item = next(items, _PENDING)
                    except Exception as e:
                        broken = e
                        break
                    if item is _PENDING:  # (no more items)
                        break
                    pending.append(self._submitItem(service, item, timeout, retries))
                if not pending:
                    if broken is not None:
                        raise broken
                    return
                call = pending[0]
                if call.__class__ is not _Refused:
                    self._waitFor(call)
                pending.popleft()
                result = call.result
                if isinstance(result, BaseException) and not returnExceptions:
                    raise result
                yield result
        finally:
            for call in pending:
                if call.__class__ is not _Refused:
                    self._cancel(call)

    def _submitItem(self, service: Union[str, bytes], item: Any, timeout: Optional[float],
                    retries: Optional[int]) -> Any:
        """The request of one item of :meth:`map` (``bytes``/``str``: one
        frame; a sequence: its frames), or, if it cannot be sent, its error."""
        single = isinstance(item, (bytes, str, bytearray, memoryview))
        try:
            return self._submit(service, (item,) if single else tuple(item), timeout, retries,
                                None, None)
        except ClientClosed:
            raise
        except Exception as e:
            return _Refused(e)

    def close(self) -> None:
        """Fail every pending request with :class:`ClientClosed` and close
        every socket."""
        if self._forks != _forks:  # forked: the sockets are the parent's, left alone
            self.machine = self.machine.fresh(monotonic())
            self._pipes = {}
            self._loop = _Loop(self.limits, None)
        self._closed = True
        self._perform(self.machine.handleClose(monotonic()))
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
        machine = self.machine
        call = machine.newCall(service, frames, timeout, retries, onPartial, onRestart, now)
        call.result = self._unanswered
        try:
            self._perform(machine.handleRequest(call, now))
        except BaseException:
            self._drop()
            raise
        return call

    def _waitFor(self, call: _Call) -> None:
        """Run the sockets and the timers until *call* is done: wait for a
        socket or the machine's wake-up, and handle what came."""
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
        if call.result.__class__ is _Unanswered:  # of a machine dropped since
            call.result = ClientClosed("request abandoned: an interrupt dropped the "
                                       "client's connections")

    def _cancel(self, call: _Call) -> None:
        if call.result is self._unanswered:
            call.result = ClientClosed("request abandoned")
            call.onPartial = call.onRestart = None
            try:
                self._perform(self.machine.handleCancel(call, monotonic()))
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        """What a call was doing was interrupted (Ctrl-C, or any exception,
        wherever it landed): every connection is closed and the requests in
        flight are answered no more (a request waited for later raises
        :class:`ClientClosed`); the client goes on with a fresh machine, so
        no reply to them can reach a later request."""
        self.machine = self.machine.fresh(monotonic())
        self._unanswered = _Unanswered()
        self._wakeTime = None
        pipes = self._pipes
        while pipes:
            pipe, channel = pipes.popitem()
            channel.pipe = None  # (an action of the machine dropped finds no pipe)
            self._loop.close(pipe)
        self._loop.closeIdle()

    # --- what the pipes report -------------------------------------------------

    def _pipeUp(self, channel: _Channel, now: float) -> None:
        self._perform(self.machine.handlePipeUp(channel, now))

    def _pipeLost(self, channel: _Channel, why: BaseException, now: float) -> None:
        self._perform(self.machine.handlePipeLost(channel, why, now))

    def _pipeFailed(self, channel: _Channel, error: BaseException, now: float) -> None:
        self._perform(self.machine.handleConnectFailed(channel, error, now))

    def _pipeMessage(self, channel: _Channel, frames: list[bytes], now: float) -> None:
        self._perform(self.machine.handleMessage(channel, frames, now))

    def _stale(self, channel: _Channel) -> None:
        report_stale(self.throttle, channel)

    def _perform(self, actions: list[Action]) -> None:
        """Do what the machine asked, in order (as the Twisted driver); a
        caller's callback that raises an ``Exception`` is logged."""
        closed = False
        for action in actions:
            kind = type(action)
            if kind is SendOn:
                self._send(action.channel, action.frames)
            elif kind is Complete or kind is Fail:
                call = action.call
                if call.result is self._unanswered:
                    call.result = action.body if kind is Complete else action.error
                call.onPartial = call.onRestart = None
            elif kind is CloseChannel:
                closed = self._close(action.channel) or closed
            else:
                self._act(action)
        if closed:  # a stream connection whose last pipe these actions closed
            self._loop.closeIdle()

    def _act(self, action: Action) -> None:
        """An action other than a request's send and end, or a close."""
        kind = type(action)
        if kind is WakeAt:
            # an earlier wake-up stays (asked for by a nested event)
            when = action.when
            if when is None or self._wakeTime is None or when < self._wakeTime:
                self._wakeTime = when
        elif kind is OpenChannel:
            # (not if a callback run by an earlier action closed the client,
            # or had the machine give the channel up)
            if not self._closed and self.machine.holds(action.channel):
                self._open(action.channel)
        else:
            tell(self.throttle, action)

    def _send(self, channel: _Channel, frames: list[bytes]) -> None:
        pipe = channel.pipe
        call = channel.call
        # (not if a callback run by an earlier action cancelled its request)
        if pipe is not None and pipe.up and call is not None and not call.done:
            if pipe.discardReceived():
                report_stale(self.throttle, channel)
            pipe.send(frames)

    def _close(self, channel: _Channel) -> bool:
        """Close the pipe of *channel*; whether there was one."""
        pipe, channel.pipe = channel.pipe, None
        if pipe is None:
            return False
        self._pipes.pop(pipe, None)
        self._loop.close(pipe)
        return True

    def _open(self, channel: _Channel) -> None:
        pipe = None
        try:
            pipe = channel.pipe = self._loop.open(channel.endpoint, self, channel,
                                                  curve=self.curve, shared=True)
            self._pipes[pipe] = channel
            # (a stream pipe may say at once that it is up, or failed)
            pipe.start()
        except Exception as e:  # no socket to be had (out of descriptors)
            if pipe is not None:
                channel.pipe = None
                self._pipes.pop(pipe, None)
                self._loop.close(pipe)
            error = TransportError(f"cannot open a connection to {channel.endpoint}: {e}")
            error.__cause__ = e
            self._perform(self.machine.handleOpenFailed(channel, error, monotonic()))
            return
        if pipe.up and not channel.up and channel.pipe is pipe:  # ZeroMQ: up at once
            self._perform(self.machine.handlePipeUp(channel, monotonic()))


class _Unanswered:
    """The result of a request not answered yet (one per machine: see
    :meth:`Client._drop`)."""

    __slots__ = ()


_CLOCK = SimpleNamespace(seconds=monotonic)  # what a log throttle reads


class Worker(WorkerDriver):
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
        super().__init__(endpoints, service, handler, _CLOCK, heartbeat=heartbeat,
                         backoff=backoff, dialect=dialect, limits=limits,
                         curveServerPublic=curveServerPublic, curveSecret=curveSecret)
        _log_to_stdlib()
        self._context = context
        #: the sockets and the poller, made by :meth:`run` and released when
        #: it returns
        self._loop: Any = None
        self._pipe: Any = None
        self._reopenAt: Optional[float] = None
        self._nextTick = 0.0
        self._stopping = False

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
        self._loop = _Loop(self.machine.limits, self._context)
        now = monotonic()
        self._nextTick = now + self.machine.wakeEvery
        self._perform(self.machine.handleStart(now))
        try:
            while not self._stopping and (until is None or not until()):
                when = self._nextTick
                if self._reopenAt is not None and self._reopenAt < when:
                    when = self._reopenAt
                self._loop.turn(when)
                now = monotonic()
                if self._reopenAt is not None and now >= self._reopenAt:
                    self._reopenAt = None
                    self._perform(self.machine.handleReopen(now))
                if now >= self._nextTick:
                    self._tickDue(now)
        finally:
            self._reopenAt = None
            try:
                self._perform(self.machine.handleStop(monotonic()))
            finally:
                loop, self._loop = self._loop, None
                loop.shutdown()

    # --- what the pipe reports -------------------------------------------------

    def _pipeUp(self, tag: Any, now: float) -> None:
        self._perform(self.machine.handlePipeUp(now))
        self._ready()

    def _pipeLost(self, tag: Any, why: BaseException, now: float) -> None:
        self._perform(self.machine.handlePipeLost(now, why))

    def _pipeFailed(self, tag: Any, error: BaseException, now: float) -> None:
        # logged; the stream retries, and the broker's silence decides (the machine's tick)
        self._perform(self.machine.handleConnectFailed(error, now))

    def _pipeMessage(self, tag: Any, frames: list[bytes], now: float) -> None:
        self._perform(self.machine.handleMessage(frames, now))

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
                self._open(action.endpoint)
            elif kind is ClosePipe:
                pipe, self._pipe = self._pipe, None
                if pipe is not None:
                    self._loop.close(pipe)
            elif kind is ReopenAfter:
                self._report(action)
                self._reopenAt = monotonic() + action.delay
            elif kind is not StoreReply:  # (a blocking worker keeps no reply store)
                self._report(action)

    def _open(self, endpoint: str) -> None:
        try:
            pipe = self._loop.open(endpoint, self, None, LINGER_MS, curve=self.curve)
        except Exception as e:  # no socket to be had (out of descriptors)
            error = TransportError(f"cannot connect to {endpoint!r}: {e}")
            error.__cause__ = e
            self._openFailed(error)
            return
        self._pipe = pipe
        pipe.start()  # (a stream pipe may say at once that it is up)
        if pipe.up and not self.machine.connected and self._pipe is pipe:  # ZeroMQ: up at once
            self._pipeUp(None, monotonic())

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
            log.failure("handler for {service} failed", service=label(self.machine.service))
            self._reply(job, WorkerFinal, codec.error_body(
                codec.STATUS_WORKER_ERROR, f"{type(e).__name__}: {e}"))
        if monotonic() - started > self.machine.heartbeat.interval:
            self._perform(self.machine.handleBlocked(monotonic()))

    def _stream(self, parts: Any, job: Any) -> None:
        for item in parts:
            if isinstance(item, Final):
                parts.close()
                self._reply(job, WorkerFinal, reply_frames(item.frames))
                self.requestsServed += 1
                return
            if not self._reply(job, WorkerPartial, reply_frames(item)):
                parts.close()  # the request is void, or was answered (413)
                return
            self._betweenParts(job)
            if not self.machine.isCurrent(job):
                # its broker was lost or given up meanwhile: so is the request
                parts.close()
                log.info("worker for {service} stopped a stream: its request went with "
                         "its broker", service=label(self.machine.service))
                return
        self._reply(job, WorkerFinal, [b""])
        self.requestsServed += 1

    def _betweenParts(self, job: Any) -> None:
        """Between parts as between requests: what the broker sent is read,
        a HEARTBEAT goes out when due, a broker silent for its expiry is
        given up; while the broker takes PARTIALs slower than the handler
        makes them, wait rather than pile them up."""
        loop = self._loop
        pipe = self._pipe
        if pipe is not None and pipe.backlogged:
            while pipe.backlogged and self.machine.isCurrent(job) and not loop.poller.closed:
                loop.turn(self._nextTick)
                now = monotonic()
                if now >= self._nextTick:
                    self._tickDue(now)
        elif monotonic() >= self._nextTick:
            loop.turn(monotonic())  # (a look, no wait)
            self._tickDue(monotonic())

    def _tickDue(self, now: float) -> None:
        """The machine's tick, due by *now* (heartbeats, the broker's
        silence); a tick late by more than an interval was held up by a
        handler (or a stopped process): the broker's silence is ours."""
        if now - self._nextTick > self.machine.heartbeat.interval:
            self._perform(self.machine.handleBlocked(now))
        self._nextTick = now + self.machine.wakeEvery
        self._perform(self.machine.handleTick(now))

    def _reply(self, job: Any, kind: type, frames: list[bytes]) -> bool:
        sent, actions = self.machine.handleReply(job, kind, frames, monotonic())
        self._perform(actions)
        return sent


def _bind_zmq() -> None:
    """pyzmq's compiled socket methods, below its Python wrappers (whose
    IntEnum flag arithmetic costs more than the I/O on this path), and
    messages in and out in C where that is built (``_frames``)."""
    global _send, _recv, _get, _set, _frames, _readC, _sendC, _eventsC
    global _RCVTIMEO, _NOBLOCK, _NOBLOCK_SNDMORE, _EVENTS, _FD, _ZMQ_POLLIN, _ZMQ_POLLOUT
    zmq = _zmq()
    backend = zmq.backend.Socket
    _send, _recv, _get, _set = backend.send, backend.recv, backend.get, backend.set
    _RCVTIMEO = int(zmq.RCVTIMEO)
    _NOBLOCK = int(zmq.NOBLOCK)
    _NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
    _EVENTS, _FD = int(zmq.EVENTS), int(zmq.FD)
    _ZMQ_POLLIN, _ZMQ_POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # EVENTS bits
    _frames = zmq_frames()
    if _frames is not None:  # its functions themselves: a module's attribute costs a look-up
        _readC, _sendC, _eventsC = _frames.read, _frames.send, _frames.events


_send: Callable[..., Any]
_recv: Callable[..., Any]
_get: Callable[..., Any]
_set: Callable[..., Any]
_RCVTIMEO = 0
#: mdp.transport._zmqframes, bound (see zmq_frames), or None; and its read,
#: send and events
_frames: Any = None
_readC: Callable[..., Any]
_sendC: Callable[..., Any]
_eventsC: Callable[..., Any]
#: no frame kept, no limit (the blocking pipe checks a message's limits itself)
_NEVER = sys.maxsize
_NOBLOCK = _NOBLOCK_SNDMORE = _EVENTS = _FD = _ZMQ_POLLIN = _ZMQ_POLLOUT = 0
# a descriptor's (poll(2)'s and epoll's bits, not ZeroMQ's EVENTS bits)
_POLLIN, _POLLOUT = int(select.POLLIN), int(select.POLLOUT)
_POLLERR, _POLLHUP = int(select.POLLERR), int(select.POLLHUP)
_bind_zmq()
