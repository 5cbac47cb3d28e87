"""The ZeroMQ sockets of the ``zmq:`` transports: the txzmq factory, options, :func:`socket_calls`."""

from __future__ import annotations

import errno
import os
import sys
from functools import cache, partial
from typing import Any, Callable, Optional

import zmq
from twisted.logger import Logger
from twisted.python.failure import Failure

from mdp import _compiled
from mdp.policy import Limits, cancel_call

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

HIGH_WATER_MARK = 100_000  # messages per pipe on a DEALER: a burst of PARTIALs rarely waits
#: per pipe on a ROUTER, received (and sent on inproc:// and by a connecting ROUTER);
#: small, as libzmq counts messages, not bytes
ROUTER_HIGH_WATER_MARK = 64
ROUTER_SEND_WATER_MARK = 128  # sent, per pipe of a bound ROUTER: set before the bind (libzmq #4524)
LINGER_MS = 200


@cache
def zmq_factory() -> Any:
    """The process-wide txzmq factory, shut down with the reactor."""
    import txzmq

    class Factory(txzmq.ZmqFactory):
        """Runs ``beforeTerm`` callables before terminating the context."""

        def __init__(self) -> None:
            super().__init__()
            self.beforeTerm: set[Callable[[], None]] = set()

        def shutdown(self) -> None:
            for callback in list(self.beforeTerm):
                callback()
            super().shutdown()

    factory = Factory()
    factory.lingerPeriod = LINGER_MS
    factory.registerForShutdown()
    return factory


READ_BATCH = 64  # messages per doRead before yielding to the reactor
BUSY_BATCH = 8  # after a doRead of this many messages, the next asks EVENTS only once
MAX_CUT_OFF = 10_000  # peers a ROUTER remembers as cut off
FRAMES_PER_TURN = 10_000  # frames of a message over the limits read off per doRead
ZERO_COPY_BYTES = 1 << 20  # frames at least this long are sent without copying
KEEP_FRAME_BYTES = 16 * 1024  # frames at least this long may be kept uncopied


@cache
def zmq_frames() -> Any:
    """:mod:`mdp.transport._zmqframes` bound to pyzmq's libzmq, or None."""
    module: Any = _compiled.accelerator("mdp.transport._zmqframes")
    if module is not None:
        try:
            backend = sys.modules[zmq.backend.Socket.__module__]
            module.bind(backend.__file__, zmq.Again, zmq.ZMQError)
        except (ImportError, AttributeError, KeyError, TypeError) as e:
            log.info("ZeroMQ messages go through pyzmq's calls: {why}", why=e)
            return None
    return module


def kept_frame_type() -> type:
    """The type of a frame a ROUTER passes on uncopied: ``Held`` or ``zmq.Frame``."""
    frames = zmq_frames()
    return frames.Held if frames is not None else zmq.Frame


# pyzmq's compiled socket methods (below its IntEnum wrappers) and int flags
_recv, _pysend, _get = zmq.backend.Socket.recv, zmq.backend.Socket.send, zmq.backend.Socket.get
NOBLOCK, NOBLOCK_SNDMORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
EVENTS, POLLIN, POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
OVER = 1  # read_pyzmq's answer for a message over the limits, as _zmqframes.read's


def socket_calls(native: bool = True) -> tuple[Any, Any, Any, bool]:
    """``(read, send, events, native)``: the calls that read a whole message,
    send one and ask ``EVENTS``; in C where built and *native* (taking the libzmq
    socket's address, ``socket.underlying``), else pyzmq's (taking the socket)."""
    frames = zmq_frames() if native else None
    if frames is None:
        return read_pyzmq, send_pyzmq, events_pyzmq, False
    return frames.read, frames.send, frames.events, True


def read_pyzmq(socket: Any, flags: int, keepAfter: int, keepBytes: int, maxFrames: int,
               maxBytes: int, envelope: bool,
               identified: Optional[Callable[[bytes, Optional[str]], None]] = None) -> Any:
    """``_zmqframes.read`` through pyzmq: the frames (past *keepAfter*, those of
    *keepBytes* or more as ``zmq.Frame``), or ``(OVER, [first frame or b"", frames,
    bytes, more follow])``; with *identified*, ``identified(first frame, User-Id)``."""
    frame = _recv(socket, flags, False)
    size = 0 if envelope else len(frame)
    if size > maxBytes:  # a lone first frame (connecting sockets set no MAXMSGSIZE)
        return OVER, [b"", 1, size, frame.more]
    frames = [frame.bytes]
    count = 1
    while frame.more:
        frame = _recv(socket, NOBLOCK, False)
        count += 1
        length = len(frame)
        size += length
        if count > maxFrames or size > maxBytes:
            return OVER, [frames[0], count, size, frame.more]
        frames.append(frame if length >= keepBytes and count > keepAfter else frame.bytes)
    if identified is not None and count > 1:  # (the routing id carries no metadata)
        identified(frames[0], frame.get("User-Id"))
    return frames


def send_pyzmq(socket: Any, frames: list[bytes], copyBelow: int, send: Any, _: Any) -> None:
    """``_zmqframes.send`` through pyzmq's *send*."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(socket, frame, NOBLOCK if i == last else NOBLOCK_SNDMORE, len(frame) < copyBelow)


def events_pyzmq(socket: Any) -> int:
    return _get(socket, EVENTS)  # type: ignore[no-any-return]


def skip_pyzmq(socket: Any, budget: int) -> tuple[int, int, bool]:
    """``_zmqframes.skip`` through pyzmq: ``(frames, bytes, more follow)``."""
    count = size = 0
    more = True
    while more and count < budget:
        frame = _recv(socket, NOBLOCK, False)
        count += 1
        size += len(frame)
        more = frame.more
    return count, size, more


@cache
def _connection_classes() -> tuple[type, type]:
    import txzmq

    read, send, events, native = socket_calls()
    Again = zmq.Again
    skip = zmq_frames().skip if native else skip_pyzmq

    class FastIO:
        """txzmq's read and send through :func:`socket_calls`, READ_BATCH messages a turn."""

        read_scheduled: Any
        socket: Any
        factory: Any
        reading = False
        needsLogContext = False
        envelope = 0  # frames of routing id (1 on a ROUTER)
        identify = False
        maxBytes = Limits().maxMessageBytes
        maxFrames = Limits().maxFrames
        #: a message over the limits being read off: [first frame, frames, bytes, more]
        skipping: Any = None
        lastBatch = 0  # messages the last doRead delivered
        owner: Any = None
        keepAfter = 1 << 62  # frames past this many may be kept uncopied
        handle: Any = 0  # what socket_calls take; 0 once closed

        def doRead(self) -> None:
            """Read at most READ_BATCH messages; a failure ends the reading."""
            try:
                if self.read_scheduled is not None:
                    self.read_scheduled = cancel_call(self.read_scheduled)
                socket = self.socket
                if socket is None:
                    return
                owner = self.owner
                if owner is not None and owner.backlogs:  # (a drained pipe signals too)
                    owner._flush()
                    if self.socket is None:
                        return
                deliver = self.deliver
                handle = self.handle or self._handle(socket)
                reader, source = self._reader(socket, handle)
                keepAfter, envelope = self.keepAfter, self.envelope
                maxFrames, maxBytes = self.maxFrames + envelope, self.maxBytes
                budget = FRAMES_PER_TURN
                busy = self.lastBatch >= BUSY_BATCH
                delivered = 0
                self.reading = True
                try:
                    for _ in range(READ_BATCH):
                        if self.skipping is None:
                            if not (busy and delivered) and not events(handle) & POLLIN:
                                return
                            try:
                                frames = reader(source, NOBLOCK, keepAfter, KEEP_FRAME_BYTES,
                                                maxFrames, maxBytes, envelope)
                            except Again:
                                return
                            if frames.__class__ is list:
                                delivered += 1
                                try:
                                    deliver(frames)
                                except Exception:
                                    log.failure("zmq message handler failed")
                                if self.socket is None:
                                    return
                                continue
                            self.skipping = frames[1]
                        budget = self._skip(socket, budget)
                        if self.skipping is not None:
                            break  # the rest next turn
                finally:
                    self.reading = False
                    self.lastBatch = delivered
                self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)
            except KeyboardInterrupt:
                raise
            except BaseException:  # a handler's SystemExit too
                log.failure("reading from a ZeroMQ socket failed")
                self.connectionLost(Failure())

        readNow = doRead

        def _reader(self, socket: Any, handle: Any) -> tuple[Any, Any]:
            """The read call and what it takes (only pyzmq's sees User-Id)."""
            if self.identify:
                return partial(read_pyzmq, identified=self.owner.identified), socket
            return read, handle

        def discardQueued(self) -> int:
            """Drop up to READ_BATCH waiting messages; how many."""
            socket = self.socket
            dropped = 0
            if socket is None or self.skipping is not None:
                return 0
            handle = self.handle or self._handle(socket)
            reader, source = self._reader(socket, handle)
            for _ in range(READ_BATCH):
                if not events(handle) & POLLIN:
                    break
                frames = reader(source, NOBLOCK, self.keepAfter, KEEP_FRAME_BYTES,
                                self.maxFrames + self.envelope, self.maxBytes, self.envelope)
                if frames.__class__ is not list:
                    self.skipping = frames[1]
                    if not self.reading:
                        self.attached()
                    break
                dropped += 1
            return dropped

        def _skip(self, socket: Any, budget: int) -> int:
            """Read off the message over the limits; the budget left."""
            head, count, size, more = self.skipping
            if more:
                frames, length, more = skip(self.handle or self._handle(socket), budget)
                count, size, budget = count + frames, size + length, budget - frames
            if more:
                self.skipping = [head, count, size, more]
                return 0
            self.skipping = None  # (head: a ROUTER's peer, a DEALER's relay hop)
            self.owner.oversized(head, count - self.envelope, size)
            return budget

        def attached(self) -> None:
            """Look for input a turn after a bind or connect."""
            if self.read_scheduled is None and self.socket is not None:
                self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        def _handle(self, socket: Any) -> Any:
            if socket is None:
                raise zmq.ZMQError(errno.ENOTSOCK)
            self.handle = handle = socket.underlying if native else socket
            return handle

        def send(self, frames: list[bytes]) -> None:
            socket = self.socket
            try:
                send(self.handle or self._handle(socket), frames, ZERO_COPY_BYTES, _pysend, socket)
            finally:  # (a send may have taken the signal of pending input)
                if (not self.reading and self.read_scheduled is None
                        and self.socket is not None and events(self.handle) & POLLIN):
                    self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        def shutdown(self) -> None:
            self.handle = 0
            super().shutdown()  # type: ignore[misc]

    class Router(FastIO, txzmq.ZmqRouterConnection):
        highWaterMark = ROUTER_HIGH_WATER_MARK
        envelope = 1

        def deliver(self, frames: list[bytes]) -> None:
            self.owner.delivered(frames[0], frames[1:])

    class Dealer(FastIO, txzmq.ZmqDealerConnection):
        highWaterMark = HIGH_WATER_MARK

        def deliver(self, frames: list[bytes]) -> None:
            self.owner.receiver.messageReceived(frames)

    return Router, Dealer


class FlushPacer:
    """When to try a full pipe again: backing off up to ``longest`` seconds."""

    shortest = 0.0005
    longest = 0.05

    def __init__(self) -> None:
        self.delay = 0.0

    def next(self, progressed: bool) -> float:
        self.delay = 0.0 if progressed else min(self.longest, max(self.shortest, self.delay * 2))
        return self.delay


def random_identity() -> bytes:
    """16 random bytes, not ZeroMQ's own ids' leading zero."""
    return bytes([os.urandom(1)[0] | 1]) + os.urandom(15)


def _zmq() -> Any:
    return zmq
