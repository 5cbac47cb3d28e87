"""The blocking nodes' pipes (:mod:`mdp.blocking`): pyzmq DEALER and stream
sockets under the blocking loop's poller, reporting to their *owner*
(``_pipeUp``, ``_pipeLost``, ``_pipeFailed``, ``_pipeMessage``) with a *tag*."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import sys
from collections import deque
from time import monotonic
from typing import Any, Optional

from twisted.logger import Logger

from mdp.errors import TransportError
from mdp.policy import RECONNECT
from mdp.transport.channellink import CHANNELS, DELIVER, ENDED, STALE, Channel, ChannelLink
from mdp.transport.dealercore import DealerCore
from mdp.transport.framing import RECORDS, encode_record
from mdp.transport.registry import split_description
from mdp.transport.zmqio import ZERO_COPY_BYTES, _zmq, random_identity, socket_calls

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

_READ_SIZE = 262144

STREAM_SCHEMES = ("tcp", "unix")  #: stream schemes the blocking nodes speak (no TLS)

#: the longest wait one poll takes (its timeout is a C int of milliseconds)
_MAX_WAIT_MS = 2**31 - 1


def timeout_ms(when: Optional[float], now: float) -> int:
    """A poll's timeout until *when* (None: -1), in milliseconds rounded up."""
    if when is None:
        return -1
    ms = (when - now) * 1000.0
    return 0 if ms <= 0 else _MAX_WAIT_MS if ms >= _MAX_WAIT_MS else int(ms) + 1


def _check_schemes(endpoints: list[str]) -> None:
    """Refuse (at once) an endpoint whose scheme has no blocking transport."""
    for each in endpoints:
        if not each.startswith("zmq:"):
            stream_address(each)


def stream_address(endpoint: str) -> tuple[int, Any]:
    """The socket family and address of stream *endpoint* (``tcp:``, ``unix:``)."""
    scheme, _, rest = endpoint.partition(":")
    if scheme not in STREAM_SCHEMES:
        raise TransportError(f"blocking nodes speak zmq:, "
                             f"{', '.join(s + ':' for s in STREAM_SCHEMES)} endpoints, not {endpoint!r}")
    args, kwargs = split_description(rest)
    unix = scheme == "unix"
    given = [kwargs.get(name) or (args[i] if i < len(args) else None)
             for i, name in enumerate(("path",) if unix else ("host", "port"))]
    if not all(given):
        raise TransportError(f"bad endpoint {endpoint!r}: {'no path' if unix else 'give host and port'}")
    return (socket.AF_UNIX, given[0]) if unix else (socket.AF_UNSPEC, (given[0], int(given[1])))


_HIGH_WATER_MARK = 1000  #: messages a DEALER queues each way (its HWMs)


class _ZmqPipe:
    """One DEALER socket, up from the start (ZeroMQ reconnects by itself);
    ``backlogged`` while messages wait for room or libzmq holds over
    ``limits.maxOutputBytes`` (:class:`DealerCore`), ``draining`` until half."""

    __slots__ = ("loop", "owner", "tag", "socket", "handle", "fd", "backlog", "up", "waitMs",
                 "address", "linger", "curve", "core", "retryAt")

    def __init__(self, loop: Any, owner: Any, tag: Any, address: str, linger: int, curve: Any = None) -> None:
        self.loop = loop
        self.owner = owner
        self.tag = tag
        self.address = address
        self.linger = linger
        self.curve = curve
        self.core = DealerCore(loop.limits, RECONNECT.delay, bounded=False)
        self.backlog = self.core.backlog
        self.retryAt: Optional[float] = None
        self._connect()

    def _connect(self) -> None:
        zmq = _zmq()
        sock = self.loop.context().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, self.linger)
            sock.setsockopt(zmq.SNDHWM, _HIGH_WATER_MARK)
            sock.setsockopt(zmq.RCVHWM, _HIGH_WATER_MARK)
            if self.curve is not None:
                self.curve.apply(sock)
                sock.setsockopt(zmq.ROUTING_ID, random_identity())  # not guessable (ZmqRouter)
            sock.connect(self.address)
            fd = sock.get(zmq.FD)
            handle = sock.underlying if _native else sock
            self.loop.watch(fd, _POLLIN)  # (a closed poller refuses: the socket goes)
        except BaseException:
            sock.close(0)
            raise
        # (no call from here on: an interrupt cannot leave it half set)
        self.socket = sock
        self.handle = handle
        self.fd = fd
        self.up = True
        self.waitMs = -1  # the socket's RCVTIMEO
        self.core.clear()
        self.loop.pipes[fd] = self

    @property
    def backlogged(self) -> bool:
        return bool(self.backlog) or self.core.held() > self.core.limits.maxOutputBytes

    @property
    def draining(self) -> bool:
        return bool(self.backlog) or self.core.held() > self.core.limits.maxOutputBytes // 2

    def send(self, frames: list[bytes]) -> None:
        if self.socket is None:
            return
        if self.backlog or not self._trySend(frames):
            self.core.hold(frames)
        self.loop.unchecked.add(self)

    def _trySend(self, frames: list[bytes]) -> bool:
        frames, size, tracker = self.core.track(frames)
        try:
            _send(self.handle, frames, ZERO_COPY_BYTES, _pysend, self.socket)
        except _Again:
            return False  # only the first frame can be refused (a full pipe)
        self.core.went(size, tracker)
        return True

    def ready(self, flags: int, now: float) -> None:
        self.check(now)

    def check(self, now: float) -> bool:
        """Send what waits, read what came; whether anything was read."""
        if self.socket is None:
            return False
        events = _events(self.handle)
        if events & _ZMQ_POLLOUT and self.backlog:
            while self.backlog and self._trySend(self.backlog[0]):
                self.core.sent()
            self.loop.unchecked.add(self)
        if events & _ZMQ_POLLIN:
            self._read(now)
            return True
        return False

    def wait(self, timeout: int) -> None:
        """The loop's only socket: wait in ``recv`` at most *timeout* ms (-1: no limit)."""
        sock = self.socket
        if not _native:
            # pyzmq's recv waits its whole RCVTIMEO again after an EINTR; its poll, what is left
            if sock.poll(timeout, _ZMQ_POLLIN):
                self.check(monotonic())
            return
        current = self.waitMs
        # setting RCVTIMEO is not free: keep one close enough
        if current != timeout and (timeout < 0 or current < 0 or current < timeout // 2
                                   or current > timeout + min(50, timeout // 20)):
            _set(sock, _RCVTIMEO, timeout)
            self.waitMs = current = timeout
        try:
            frames = self._message(0)
        except _Again:
            return
        self.loop.unchecked.add(self)  # (the next recv takes what else is queued at once)
        self._take(frames, monotonic())

    def discardReceived(self) -> int:
        """Read off and drop the messages waiting on the socket; how many."""
        if self.socket is None:
            return 0
        for dropped in range(_HIGH_WATER_MARK):  # what the socket holds at most
            if not _events(self.handle) & _ZMQ_POLLIN:
                return dropped
            _read(self.handle, _NOBLOCK, _NEVER, 0, _NEVER, _NEVER, False)
        return _HIGH_WATER_MARK

    def _read(self, now: float) -> None:
        """Read a few messages at most: the loop comes back for the rest."""
        sock = self.socket
        loop = self.loop
        for _ in range(64):
            # the signal is spent: a callback that waits on the loop must ask again
            loop.unchecked.add(self)
            self._take(self._message(_NOBLOCK), now)
            if self.socket is not sock:
                return
            if not _events(self.handle) & _ZMQ_POLLIN:
                # its signal is armed again: no need to ask before waiting
                if not self.backlog:
                    loop.unchecked.discard(self)
                return

    def _message(self, flags: int) -> Any:
        """A whole message (or raise ``Again``), as :func:`socket_calls` read it."""
        limits = self.loop.limits
        return _read(self.handle, flags, _NEVER, 0, limits.maxFrames, limits.maxMessageBytes, False)

    def _take(self, frames: Any, now: float) -> None:
        """Hand *frames* on; over the limits, a new socket (lost, then up)."""
        if frames.__class__ is list:
            self.owner._pipeMessage(self.tag, frames, now)
            return
        _, count, size, _ = frames[1]
        why = self.core.oversized(size, count)
        self.close()
        self._reopen(now)
        self.owner._pipeLost(self.tag, why, now)
        if self.socket is not None:
            self.owner._pipeUp(self.tag, now)

    def _reopen(self, now: float) -> bool:
        """A new socket; if none can be had, down until the core's delay is over."""
        try:
            self._connect()
        except Exception as e:
            delay = self.core.openFailed()
            self.retryAt = now + delay
            self.loop.timed.add(self)
            log.warn("zmq dealer to {address} cannot open a socket: {error}; tries again in "
                     "{delay:g}s", address=self.address, error=e, delay=delay)
            return False
        self.retryAt = None
        self.loop.timed.discard(self)
        return True

    def wake(self, now: float) -> None:
        if self.retryAt is not None and self.socket is None and self._reopen(now):
            self.owner._pipeUp(self.tag, now)

    def close(self) -> None:
        sock, self.socket = self.socket, None
        self.handle = 0
        self.up = False
        self.retryAt = None
        self.core.clear()
        self.loop.unchecked.discard(self)
        self.loop.timed.discard(self)
        if sock is not None:
            self.loop.forget(self.fd)  # before the socket (and its descriptor) goes
            sock.close()  # after LINGER ms at most


class _StreamPipe:
    """One stream socket with the stream transport's records, reconnecting
    with :data:`RECONNECT`'s backoff."""

    __slots__ = ("loop", "owner", "tag", "family", "address", "socket", "key", "out", "decoder",
                 "up", "connecting", "failures", "retryAt", "received", "candidates", "skip",
                 "broken", "queuedBytes", "sentBytes")

    framing: Any = RECORDS

    def __init__(self, loop: Any, owner: Any, tag: Any, family: int, address: Any) -> None:
        self.loop = loop
        self.owner = owner
        self.tag = tag
        self.family = family
        self.address = address
        self.socket: Optional[socket.socket] = None
        self.out = bytearray()
        self.failures = 0
        self.retryAt: Optional[float] = 0.0  # (the first attempt: at the loop's next turn)
        #: messages read and not yet handed on, in order
        self.received: deque[list[bytes]] = deque()
        self._closeSocket()
        loop.timed.add(self)

    @property
    def backlogged(self) -> bool:
        return bool(self.out)

    draining = backlogged

    def connect(self, now: float) -> None:
        """Start a connection attempt, to each address of the host in turn."""
        self.retryAt = None
        if self.family == socket.AF_UNIX:
            self.candidates = [(socket.AF_UNIX, self.address)]
        else:
            try:
                found = socket.getaddrinfo(*self.address, self.family, socket.SOCK_STREAM)
            except OSError as e:
                self._failed(e, now)
                return
            self.candidates = [(info[0], info[4]) for info in found]
        self._next(now, None)

    def _next(self, now: float, error: Optional[BaseException]) -> None:
        """Connect to the next address; none left: failed with the last *error*."""
        while self.candidates:
            family, target = self.candidates.pop(0)
            sock = None
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
                if family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                code = sock.connect_ex(target)
                # (EAGAIN: a full listen backlog, which a later attempt may find free)
                if code not in (0, errno.EINPROGRESS):
                    raise OSError(code, os.strerror(code))
            except OSError as e:  # no descriptor, a path too long, refused, ...
                if sock is not None:
                    sock.close()
                error = e
                continue
            self.socket = sock
            self.key = sock.fileno()
            self.connecting = True
            self.loop.watch(self.key, _POLLOUT)
            self.loop.pipes[self.key] = self
            return
        self._failed(error or OSError(errno.EADDRNOTAVAIL, f"{self.address!r} has no address"), now)

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

    def _flush(self) -> None:
        sock = self.socket
        if sock is None or not self.up:
            return
        try:
            sent = sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the poller reports the loss
        del self.out[:sent]
        self.sentBytes += sent
        self.loop.watch(self.key, _POLLIN | (_POLLOUT if self.out else 0))

    def ready(self, events: int, now: float) -> None:
        sock = self.socket
        if sock is None:
            return
        if self.connecting:
            self._connected(sock, now)
            return
        if events & _POLLOUT:
            self._flush()
        if events & (_POLLIN | _POLLERR | _POLLHUP):
            # what came whole before a loss is handed on first, as in Twisted
            self.received.extend(self._drain(1))
            self._deliverReceived(now)
            why = self.broken
            if why is not None and self.socket is sock:
                self._closeSocket()
                self.retryAt = now + RECONNECT.delay(0)
                self.owner._pipeLost(self.tag, why, now)

    def _connected(self, sock: socket.socket, now: float) -> None:
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not code:
            try:
                sock.getpeername()
            except OSError as e:  # writable, yet not connected
                code = e.errno or errno.ENOTCONN
        if code:
            self._closeSocket()
            self._next(now, OSError(code, os.strerror(code)))
            return
        self.connecting = False
        self.up = True
        self.failures = 0
        self.loop.watch(self.key, _POLLIN)
        self.owner._pipeUp(self.tag, now)

    def _break(self, error: BaseException) -> None:
        """Stop reading; the next read reports *error* as the loss."""
        self.broken = error
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]

    def _deliverReceived(self, now: float) -> None:
        """Hand on the messages read, in order (the rest first if a callback waits)."""
        received = self.received
        owner, tag, loop = self.owner, self.tag, self.loop
        while received:  # (a loss meanwhile clears it)
            frames = received.popleft()
            if received:
                loop.unchecked.add(self)  # (a wait swaps the set: not one kept)
            owner._pipeMessage(tag, frames, now)

    def check(self, now: float) -> bool:
        """Send what was queued; hand on what was read, whether there was any."""
        if self.out:
            self._flush()
        if not self.received:
            return False
        self._deliverReceived(now)
        return True

    def _drain(self, reads: int = 64) -> list[Any]:
        """The messages read whole in at most *reads* reads; a loss found is
        kept (``broken``) for the next read to report."""
        sock = self.socket
        messages: list[Any] = []
        if self.broken is not None:
            return messages
        for _ in range(reads):  # (a peer sending without pause cannot hold us here)
            try:
                data = sock.recv(_READ_SIZE)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._break(e)
                break
            if not data:
                self._break(ConnectionError("connection closed by the broker"))
                break
            try:
                messages += self.decoder.feed(data)
            except Exception as e:  # ProtocolError (RecordTooLarge): the stream is unusable
                messages += getattr(e, "decoded", None) or []
                self._break(e)
                break
        if self.skip and messages:
            # the record a stale discard saw begun, now whole: dropped if on a channel it discarded
            if messages[0][0] in self.skip:
                del messages[0]
            self.skip = 0
        return messages

    def _closeSocket(self) -> None:
        sock, self.socket = self.socket, None
        self.up = self.connecting = False
        self.out.clear()
        self.received.clear()
        self.loop.unchecked.discard(self)
        self.skip: Any = 0  #: the channels of a stale discard that saw a record begun
        self.broken: Optional[BaseException] = None
        #: a channel's request has left once ``sentBytes`` passed its end
        self.queuedBytes = self.sentBytes = 0
        self.decoder = self.framing.decoder(self.loop.limits)
        if sock is not None:
            self.loop.forget(self.key)
            sock.close()

    def wake(self, now: float) -> None:
        if self.retryAt is not None and self.socket is None:
            self.connect(now)

    def close(self) -> None:
        """Close, after a moment's try to send what waits (a worker's DISCONNECT)."""
        sock = self.socket
        if sock is not None and self.up and self.out:
            with contextlib.suppress(OSError):
                sock.settimeout(0.2)
                sock.sendall(self.out)
        self.retryAt = None
        self.loop.timed.discard(self)
        self._closeSocket()


class _StreamLink(_StreamPipe):
    """A client's one stream connection to an endpoint, its pipes on channels
    (the blocking shell of a :class:`~mdp.transport.channellink.ChannelLink`)."""

    __slots__ = ("endpoint", "core", "lossesToTell")

    framing = CHANNELS

    def __init__(self, loop: Any, endpoint: str, family: int, address: Any) -> None:
        # whole before the base joins the loop's timed pipes (an interrupt there: closable)
        self.endpoint = endpoint
        self.core = ChannelLink(ended=ConnectionError, dropped=ConnectionError)
        #: pipes to tell of the loss before any reconnection
        self.lossesToTell: deque[tuple[_LinkPipe, BaseException]] = deque()
        super().__init__(loop, self, None, family, address)

    def open(self, owner: Any, tag: Any) -> _LinkPipe:
        pipe = _LinkPipe(self, owner, tag)
        self.core.open(pipe)
        if self.up:
            self.core.comeUp(pipe)  # up at once: its owner tells itself
        return pipe

    def sendRecord(self, record: bytes) -> int:
        """Send *record* before the loop waits; where it ends in the bytes sent (0: not)."""
        if not self.up:
            return 0
        self.out += record
        self.queuedBytes += len(record)
        self.loop.unchecked.add(self)
        return self.queuedBytes

    def _flush(self) -> None:
        if self.up and self.core.unsent:
            self.dropStale()  # (what came before the requests about to go)
        _StreamPipe._flush(self)

    def _keepBut(self, items: list[Any], names: set[bytes]) -> list[bytes]:
        """Put back *items* but the messages on *names*; the channels dropped."""
        self.received.extend(item for item in items if item[0] not in names or not item[1])
        return [item[0] for item in items if item[0] in names and item[1]]

    def dropStale(self) -> None:
        """Before the pipes' requests go out: read, and drop what came on their channels."""
        core = self.core
        waiting = {name for name in list(core.unsent) if core.stale(name, self.sentBytes)}
        if not waiting:
            return
        items = self._drain()
        if self.decoder.inRecord:
            self.skip = waiting | (self.skip or set())
        stale = set(self._keepBut(items, waiting))
        if self.received:
            self.loop.unchecked.add(self)  # handed on before the loop waits
        for name in stale:
            pipe: Any = core.channels.get(name)
            if pipe is not None and pipe.up:
                pipe.owner._stale(pipe.tag)

    def close(self) -> None:
        if self.loop.links.get(self.endpoint) is self:
            del self.loop.links[self.endpoint]
        for pipe in self.core.closeAll():
            self.loop.timed.discard(pipe)
        self.lossesToTell.clear()
        _StreamPipe.close(self)

    def _pipeUp(self, tag: Any, now: float) -> None:
        self.sendRecord(CHANNELS.greeting(None))  # (first, before what the pipes send)
        self._tellLost(now)
        for pipe in self.core.made():
            pipe.owner._pipeUp(pipe.tag, now)  # type: ignore[attr-defined]

    def _pipeLost(self, tag: Any, why: BaseException, now: float) -> None:
        # every pipe is down before any is told (one may send on another)
        self.lossesToTell.extend(self.core.lost(why))  # type: ignore[arg-type]
        self._tellLost(now)

    def _tellLost(self, now: float) -> None:
        lossesToTell = self.lossesToTell
        while lossesToTell:
            pipe, why = lossesToTell.popleft()
            if not pipe.closed:
                pipe.owner._pipeLost(pipe.tag, why, now)

    def _pipeFailed(self, tag: Any, error: BaseException, now: float) -> None:
        for pipe in self.core.failed():
            pipe.owner._pipeFailed(pipe.tag, error, now)  # type: ignore[attr-defined]

    def _pipeMessage(self, tag: Any, item: Any, now: float) -> None:
        name, frames = item
        pipe: Any = self.core.channels.get(name)
        if pipe is None:
            return  # ended here
        what = self.core.received(pipe, frames, self.sentBytes)
        if what == DELIVER:
            pipe.owner._pipeMessage(pipe.tag, frames, now)
        elif what == STALE:
            pipe.owner._stale(pipe.tag)
        elif what == ENDED:
            record, why, delay = self.core.endedThere(pipe)
            self.sendRecord(record)
            pipe.retryAt = now + delay
            self.loop.timed.add(pipe)
            if why is not None:
                pipe.owner._pipeLost(pipe.tag, why, now)


class _LinkPipe(Channel):
    """One pipe of a :class:`_StreamLink`, on its channel."""

    __slots__ = ("link", "owner", "tag", "retryAt", "dropsStale")

    def __init__(self, link: _StreamLink, owner: Any, tag: Any) -> None:
        super().__init__()
        self.link = link
        self.owner = owner
        self.tag = tag
        self.retryAt: Optional[float] = None
        #: what comes before its last message left answers an earlier one (a client's, not a worker's)
        self.dropsStale: bool = getattr(owner, "dropsStale", True)

    @property
    def backlogged(self) -> bool:
        """Its connection's (shared by the link's channels)."""
        return self.link.backlogged

    draining = backlogged

    def send(self, frames: list[bytes]) -> None:
        if self.up:
            link = self.link
            at = link.sendRecord(self.id + encode_record(frames))
            if at and self.dropsStale:
                link.core.unsent[self.id] = at

    def discardReceived(self) -> int:
        """Drop what was read on its channel but an end; how many."""
        received = self.link.received
        if not received:
            return 0
        items = list(received)
        received.clear()
        return len(self.link._keepBut(items, {self.id}))

    def wake(self, now: float) -> None:
        self.retryAt = None
        self.link.loop.timed.discard(self)
        if self.link.core.comeUp(self):  # (else up with the connection)
            self.owner._pipeUp(self.tag, now)

    def close(self) -> None:
        """End its channel (the last closes the connection, after the client's actions)."""
        link = self.link
        self.retryAt = None
        link.loop.timed.discard(self)
        record = link.core.close(self)
        if record is not None:
            link.sendRecord(record)
        if not link.core.channels:
            link.loop.idle.add(link)


_read, _send, _events, _native = socket_calls(True)
_pysend, _set, _Again = _zmq().backend.Socket.send, _zmq().backend.Socket.set, _zmq().Again
_RCVTIMEO, _NOBLOCK = int(_zmq().RCVTIMEO), int(_zmq().NOBLOCK)
_ZMQ_POLLIN, _ZMQ_POLLOUT = int(_zmq().POLLIN), int(_zmq().POLLOUT)  # EVENTS bits
_NEVER = sys.maxsize
_POLLIN, _POLLOUT = int(select.POLLIN), int(select.POLLOUT)  # poll(2)'s and epoll's bits
_POLLERR, _POLLHUP = int(select.POLLERR), int(select.POLLHUP)
