"""The ZeroMQ sockets under the ``zmq:`` transports: the process's txzmq
factory, the socket options, and txzmq's connections with faster read and send
paths (``FastIO``).  txzmq is imported only when a ``zmq:`` endpoint is used.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from twisted.logger import Logger
from twisted.python.failure import Failure

from mdp.policy import Limits, cancel_call

if TYPE_CHECKING:
    from mdp.transport.zeromq import ZmqDealer

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

#: Messages libzmq queues per pipe on a DEALER: a burst of PARTIALs rarely waits.
HIGH_WATER_MARK = 100_000
#: Per pipe on a ROUTER, for what it receives (and sends, on inproc:// and on
#: a connecting ROUTER); small, as libzmq counts messages, not bytes.
ROUTER_HIGH_WATER_MARK = 64
#: Per pipe on a bound ROUTER, for what it sends.  Set before the bind and
#: never changed: libzmq <= 4.3.5 crashes on a freed pipe when SNDHWM changes
#: (libzmq issue #4524).
ROUTER_SEND_WATER_MARK = 128
LINGER_MS = 200

_factory: Any = None
_classes: Optional[tuple[type, type]] = None


def zmq_factory() -> Any:
    """The process-wide txzmq factory, shut down with the reactor."""
    global _factory
    if _factory is None:
        import txzmq

        class Factory(txzmq.ZmqFactory):
            """Runs ``beforeTerm`` callables (closing monitor sockets) before
            terminating the context, which would wait on an open socket."""

            def __init__(self) -> None:
                super().__init__()
                self.beforeTerm: set[Callable[[], None]] = set()

            def shutdown(self) -> None:
                for callback in list(self.beforeTerm):
                    callback()
                super().shutdown()

        _factory = Factory()
        _factory.lingerPeriod = LINGER_MS
        _factory.registerForShutdown()
    return _factory


#: Messages handled per doRead before yielding to the reactor.
READ_BATCH = 64
#: After a doRead of this many messages, the next reads until a recv fails
#: instead of asking EVENTS before every message.
BUSY_BATCH = 8
#: Peers a ROUTER remembers as cut off (messages for them are discarded).
MAX_CUT_OFF = 10_000
#: Frames of a message over the limits read off per doRead (no long stall).
FRAMES_PER_TURN = 10_000
#: Frames at least this long are sent without copying (below, a copy is
#: cheaper than pyzmq's release of a zero-copy frame).
ZERO_COPY_BYTES = 1 << 20
#: Frames at least this long may be kept uncopied (``keepFramesFrom``);
#: shorter ones may share a libzmq read buffer, and are copied.
KEEP_FRAME_BYTES = 16 * 1024


_frames: Any = None


def zmq_frames() -> Any:
    """:mod:`mdp.transport._zmqframes`, bound to pyzmq's libzmq, where it is
    built and current; else None (messages go through pyzmq's calls)."""
    global _frames
    if _frames is None:
        _frames = False
        from mdp import _compiled

        module: Any = _compiled.accelerator("mdp.transport._zmqframes")
        if module is not None:
            import sys

            import zmq

            try:
                backend = sys.modules[zmq.backend.Socket.__module__]
                module.bind(backend.__file__, zmq.Again, zmq.ZMQError)
            except (ImportError, AttributeError, KeyError, TypeError) as e:
                log.info("ZeroMQ messages go through pyzmq's calls: {why}", why=e)
            else:
                _frames = module
    return _frames or None


def kept_frame_type() -> type:
    """The type of a frame a ROUTER passes on uncopied: ``Held`` or ``zmq.Frame``."""
    frames = zmq_frames()
    return frames.Held if frames is not None else _zmq().Frame


def _connection_classes() -> tuple[type, type]:
    global _classes
    if _classes is None:
        import txzmq
        import zmq

        NOBLOCK = int(zmq.NOBLOCK)
        NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
        EVENTS = int(zmq.EVENTS)
        POLLIN = int(zmq.POLLIN)
        backend = zmq.backend.Socket
        recv, send, get = backend.recv, backend.send, backend.get
        Again = zmq.Again
        inC = zmq_frames()
        readFrames = sendFrames = eventsOf = None
        if inC is not None:
            readFrames, sendFrames, eventsOf = inC.read, inC.send, inC.events

        class FastIO:
            """Replaces txzmq's read and send paths: pyzmq's compiled methods
            with int flags, at most READ_BATCH messages a turn, and a read
            after a send only when EVENTS says input is pending (the FD is
            edge-triggered).  Frames over the limits are dropped uncopied."""

            read_scheduled: Any
            socket: Any
            factory: Any
            reading = False
            #: mdp.uvreactor may call doRead without Twisted's legacy log context
            needsLogContext = False
            #: frames of routing envelope before the message (1 on a ROUTER)
            envelope = 0
            #: call ``owner.identified(peer, userId)`` before each delivery
            identify = False
            maxBytes = Limits().maxMessageBytes
            maxFrames = Limits().maxFrames

            #: a message over the limits being read off: [first frame, frames, bytes, more]
            skipping: Any = None

            #: messages the last doRead delivered (see BUSY_BATCH)
            lastBatch = 0
            owner: Any = None
            #: frames after this many (routing id included) of KEEP_FRAME_BYTES
            #: or more are delivered uncopied
            keepAfter = 1 << 62

            def doRead(self) -> None:
                """Read at most READ_BATCH messages.  Raises nothing but
                KeyboardInterrupt: a failed read is logged and ends the reading
                (``connectionLost``), as Twisted's reactor does.  Also
                ``readNow``, which :mod:`mdp.uvreactor` calls directly."""
                try:
                    if self.read_scheduled is not None:
                        self.read_scheduled = cancel_call(self.read_scheduled)
                    socket = self.socket
                    if socket is None:
                        return
                    # ZeroMQ signals its FD when a full pipe drains, too
                    owner = self.owner
                    if owner is not None and owner.backlogged:
                        owner._flush()
                        if self.socket is None:
                            return
                    deliver = self.deliver
                    handle = 0
                    if eventsOf is not None:
                        handle = self.handle or self._handle(socket)
                    budget = FRAMES_PER_TURN
                    busy = self.lastBatch >= BUSY_BATCH
                    delivered = 0
                    # sends while reading need no EVENTS check: the loop asks again
                    self.reading = True
                    try:
                        for _ in range(READ_BATCH):
                            if self.skipping is None:
                                if busy and delivered:
                                    try:
                                        frames = self._readMessage(socket)
                                    except Again:
                                        return
                                else:
                                    events = eventsOf(handle) if handle else get(socket, EVENTS)
                                    if not events & POLLIN:
                                        return
                                    frames = self._readMessage(socket)
                                if frames is not None:
                                    delivered += 1
                                    try:
                                        deliver(frames)
                                    except Exception:
                                        log.failure("zmq message handler failed")
                                    if self.socket is None:
                                        return
                                    continue
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

            #: the libzmq socket's address
            handle = 0

            def _readMessage(self, socket: Any) -> Optional[list[bytes]]:
                """Read one message; None if over the limits (then ``skipping``)."""
                maxBytes = self.maxBytes
                maxFrames = self.maxFrames + self.envelope
                keepAfter = self.keepAfter
                if readFrames is not None and not self.identify:
                    handle = self.handle
                    if not handle or socket is None:
                        handle = self._handle(socket)
                    got = readFrames(handle, NOBLOCK, keepAfter, KEEP_FRAME_BYTES, maxFrames,
                                     maxBytes, self.envelope)
                    if got.__class__ is list:
                        return got
                    self.skipping = got[1]
                    return None
                frame = recv(socket, NOBLOCK, False)
                frames = [frame.bytes]
                size = 0 if self.envelope else len(frames[0])
                more = frame.more
                if size > maxBytes:  # a lone first frame (connecting sockets set no MAXMSGSIZE)
                    self.skipping = [b"", 1, size, more]
                    return None
                count = len(frames)
                while more:
                    frame = recv(socket, NOBLOCK, False)
                    count += 1
                    length = len(frame)
                    size += length
                    if count > maxFrames or size > maxBytes:
                        self.skipping = [frames[0], count, size, frame.more]
                        return None
                    if length >= KEEP_FRAME_BYTES and count > keepAfter:
                        frames.append(frame)
                    else:
                        frames.append(frame.bytes)
                    more = frame.more
                if self.identify and count > 1:
                    # the routing id a ROUTER adds carries no metadata
                    self.owner.identified(frames[0], frame.get("User-Id"))
                return frames

            def discardQueued(self) -> int:
                """Drop up to READ_BATCH waiting messages; how many.  Not while
                a message over the limits is read off: that one ends the pipe."""
                socket = self.socket
                dropped = 0
                if socket is None or self.skipping is not None:
                    return 0
                handle = 0
                if eventsOf is not None:
                    handle = self.handle or self._handle(socket)
                for _ in range(READ_BATCH):
                    events = eventsOf(handle) if handle else get(socket, EVENTS)
                    if not events & POLLIN:
                        break
                    if self._readMessage(socket) is None:
                        if not self.reading and self.read_scheduled is None:
                            self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)
                        break
                    dropped += 1
                return dropped

            def _skip(self, socket: Any, budget: int) -> int:
                """Read off up to *budget* frames of the message over the limits;
                the budget left."""
                head, count, size, more = self.skipping
                while more and budget > 0:
                    frame = recv(socket, NOBLOCK, False)
                    count += 1
                    size += len(frame)
                    more = frame.more
                    budget -= 1
                if more:
                    self.skipping = [head, count, size, more]
                    return 0
                self.skipping = None
                self.owner.oversized(head if self.envelope else None, count - self.envelope, size)
                return budget

            def attached(self) -> None:
                """After a bind or connect, look for input a turn later: an
                inproc pipe attached within the call signals nothing."""
                if self.read_scheduled is None and self.socket is not None:
                    self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

            def _events(self, socket: Any) -> int:
                """The socket's ``EVENTS`` bits."""
                if eventsOf is not None:
                    handle = self.handle
                    if not handle:
                        handle = self._handle(socket)
                    return eventsOf(handle)  # type: ignore[no-any-return]
                return get(socket, EVENTS)  # type: ignore[no-any-return]

            def _handle(self, socket: Any) -> int:
                """The address of *socket* in libzmq (a closed one has none)."""
                if socket is None:
                    raise zmq.ZMQError(errno.ENOTSOCK)
                self.handle = handle = socket.underlying
                return handle

            def send(self, frames: list[bytes]) -> None:
                socket = self.socket
                last = len(frames) - 1
                try:
                    if sendFrames is not None:
                        handle = self.handle
                        if not handle or socket is None:
                            handle = self._handle(socket)
                        sendFrames(handle, frames, ZERO_COPY_BYTES, send, socket)
                        return
                    for i, frame in enumerate(frames):
                        send(socket, frame, NOBLOCK if i == last else NOBLOCK_SNDMORE,
                             len(frame) < ZERO_COPY_BYTES)
                finally:
                    # a send may have taken the edge-triggered signal of pending input
                    if (not self.reading and self.read_scheduled is None
                            and self.socket is not None and self._events(socket) & POLLIN):
                        self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        class Router(FastIO, txzmq.ZmqRouterConnection):
            highWaterMark = ROUTER_HIGH_WATER_MARK
            envelope = 1
            owner: Any

            def deliver(self, frames: list[bytes]) -> None:
                self.owner.delivered(frames[0], frames[1:])

        class Dealer(FastIO, txzmq.ZmqDealerConnection):
            highWaterMark = HIGH_WATER_MARK
            owner: ZmqDealer

            def deliver(self, frames: list[bytes]) -> None:
                self.owner._received(self, frames)

        _classes = (Router, Dealer)
    return _classes


class FlushPacer:
    """When to try a full pipe again: libzmq's edge-triggered drain signal may
    be consumed elsewhere, so backlogs are retried on a timer, backing off
    (doubling up to ``longest`` seconds) while they do not drain."""

    shortest = 0.0005
    longest = 0.05

    def __init__(self) -> None:
        self.delay = 0.0

    def next(self, progressed: bool) -> float:
        """The delay before the next try."""
        self.delay = 0.0 if progressed else min(self.longest, max(self.shortest, self.delay * 2))
        return self.delay


def random_identity() -> bytes:
    """16 random bytes for a peer id (no leading zero byte: ZeroMQ's own ids)."""
    return bytes([os.urandom(1)[0] | 1]) + os.urandom(15)


def _zmq() -> Any:
    """The zmq module, imported late."""
    import zmq

    return zmq
