"""The ZeroMQ sockets under the ``zmq:`` transports (:mod:`mdp.transport.zeromq`):
the process's txzmq factory, the socket options' values, and txzmq's
connections with their read and send paths replaced (``FastIO``): pyzmq's
compiled methods with plain int flags, or whole messages in C
(:mod:`mdp.transport._zmqframes`) where that is built.

``import txzmq`` installs the default reactor; this module imports it only
when a ``zmq:`` endpoint is actually used.
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

#: Messages libzmq queues per pipe on a DEALER: a worker's burst of PARTIALs
#: rarely has to wait in the backlog (a small mark costs streams most of their
#: throughput: each message then crosses libzmq's threads on its own).
HIGH_WATER_MARK = 100_000
#: Per pipe on a ROUTER, for what it receives (and sends, on inproc:// and
#: on a connecting ROUTER).  libzmq counts messages, not bytes, so this is
#: kept small (1,000, libzmq's default, would let 1 MiB messages pin a
#: gigabyte).
ROUTER_HIGH_WATER_MARK = 64
#: Per pipe on a bound ROUTER, for what it sends: a peer that does not read
#: costs at most its backlog (bounded in bytes) plus this many messages in
#: libzmq.  Set before the bind and never changed: libzmq (4.3.5 and
#: earlier) passes a new SNDHWM on to the far end of every pipe the socket
#: holds, a pipe whose peer disconnected and whose far end is freed already
#: among them, and its IO thread then crashes on the freed pipe (libzmq
#: issue #4524, fixed after 4.3.5 by PR #4647).  The mark used to start at
#: twice this while every message was small and come down at the first
#: large one: with a peer gone at that moment (``mdp status`` closes the
#: connection of a query it gave up on), the process died of SIGSEGV.
ROUTER_SEND_WATER_MARK = 128
LINGER_MS = 200

_factory: Any = None
_classes: Optional[tuple[type, type]] = None


def zmq_factory() -> Any:
    """The process-wide txzmq factory (one ZeroMQ context), shut down with the
    reactor."""
    global _factory
    if _factory is None:
        import txzmq

        class Factory(txzmq.ZmqFactory):
            """Runs ``beforeTerm`` callables (closing monitor sockets) before
            terminating the context, which would wait for ever on an open
            socket."""

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
#: A doRead that delivered at least this many messages (a burst: a stream,
#: pipelined requests) makes the next one
#: read until a recv fails instead of asking EVENTS before every message.
BUSY_BATCH = 8
#: Peers a ROUTER remembers as cut off (messages for them are discarded).
MAX_CUT_OFF = 10_000
#: Frames of a message over the limits read off per doRead: a message of
#: millions of frames is dropped over many reactor turns, not in one stall.
FRAMES_PER_TURN = 10_000
#: Frames at least this long are sent without copying.  Below it a copy is
#: cheaper: a zero-copy frame is released through pyzmq's garbage-collector
#: thread (a message and a thread wake-up per frame), which costs more CPU
#: than copying a frame of up to about 1 MiB.
ZERO_COPY_BYTES = 1 << 20
#: A receiver that only passes body frames on (the broker) may take frames
#: at least this long as the message libzmq received (a ``Held`` of
#: ``_zmqframes``, or without it the ``zmq.Frame`` they arrived in; see
#: ``IRouterReceiver.keepFramesFrom``): sending one on shares libzmq's buffer
#: instead of copying it out into ``bytes`` and back in.  Shorter frames may sit in
#: a buffer libzmq shares between the messages of one read (8 KiB); they are
#: copied.
KEEP_FRAME_BYTES = 16 * 1024


_frames: Any = None


def zmq_frames() -> Any:
    """:mod:`mdp.transport._zmqframes` (messages read and sent in C), bound
    to the libzmq pyzmq loaded, where it is built and current
    (``mdp._compiled``); else None, and messages go through pyzmq's own
    calls, as before."""
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
    """The type of a long frame a ROUTER passes on uncopied
    (``keepFramesFrom``): :class:`mdp.transport._zmqframes.Held`, or
    ``zmq.Frame`` where messages go through pyzmq."""
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
        # pyzmq's compiled socket methods, below its Python-level wrappers
        backend = zmq.backend.Socket
        recv, send, get = backend.recv, backend.send, backend.get
        Again = zmq.Again
        # whole messages in and out in C, where that is built
        inC = zmq_frames()
        readFrames = sendFrames = eventsOf = None
        if inC is not None:
            readFrames, sendFrames, eventsOf = inC.read, inC.send, inC.events

        class FastIO:
            """Replaces txzmq's read and send paths:
            pyzmq's compiled methods with plain int flags (its Python wrappers'
            IntEnum arithmetic costs more than the I/O), frames' own ``more``
            flag instead of a RCVMORE lookup, an EVENTS check instead of the
            exception a failed recv raises, at most READ_BATCH messages per
            reactor turn, and an extra read after a send only when ZeroMQ says
            input is pending (its FD is edge-triggered).  Frames beyond the
            message limits are received and dropped, never copied."""

            read_scheduled: Any
            socket: Any
            factory: Any
            reading = False
            #: logs through twisted.logger only: mdp.uvreactor may call
            #: doRead without Twisted's legacy log context
            needsLogContext = False
            #: frames of routing envelope before the message (1 on a ROUTER)
            envelope = 0
            #: tell the owner who sent each message (CURVE's User-Id) before
            #: it is delivered: ``owner.identified(peer, userId)``
            identify = False
            maxBytes = Limits().maxMessageBytes
            maxFrames = Limits().maxFrames

            #: a message over the limits being read off, over as many reactor
            #: turns as it takes: [first frame, frames, bytes, more to come]
            skipping: Any = None

            #: messages the last doRead delivered: after a busy one (at least
            #: BUSY_BATCH), the next one, once EVENTS said input is there,
            #: reads on until a recv finds nothing (one exception a turn)
            #: instead of asking EVENTS before every message
            lastBatch = 0
            owner: Any = None
            #: frames after the first this many (counting the routing id) of
            #: at least KEEP_FRAME_BYTES are delivered uncopied (kept_frame_type;
            #: the receiver asked: ZmqRouter); by default none is
            keepAfter = 1 << 62

            def doRead(self) -> None:
                """Read what the socket has (at most READ_BATCH messages a
                turn).  Raises nothing but KeyboardInterrupt: a failed read
                (or a handler's SystemExit) is logged and ends this socket's
                reading (``connectionLost``), as Twisted's epoll reactor does
                with a ``doRead`` that raises.  It is also ``readNow``, which
                :mod:`mdp.uvreactor`'s loop calls itself, with no reactor code
                between."""
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
                    # EVENTS asked in C, without a method call a message
                    handle = 0
                    if eventsOf is not None:
                        handle = self.handle or self._handle(socket)
                    budget = FRAMES_PER_TURN
                    busy = self.lastBatch >= BUSY_BATCH
                    delivered = 0
                    # sends made while reading need no EVENTS check of their own:
                    # the loop asks EVENTS again before it returns
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
                                    # asking EVENTS is cheaper than the Again a failed recv raises
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
                                break  # out of this turn's budget: the rest next turn
                    finally:
                        self.reading = False
                        self.lastBatch = delivered
                    # more may be waiting: let the reactor run other work first
                    self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)
                except KeyboardInterrupt:
                    raise  # (as the reactor's own dispatch lets it through)
                except BaseException:  # a handler's SystemExit too: logged, as the reactor did
                    log.failure("reading from a ZeroMQ socket failed")
                    self.connectionLost(Failure())

            readNow = doRead

            #: the libzmq socket's address (readFrames, sendFrames)
            handle = 0

            def _readMessage(self, socket: Any) -> Optional[list[bytes]]:
                """Read one message; None if it is over the limits (then it
                is being read off: ``skipping``).  Nothing over the limits
                is copied."""
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
                        frames.append(frame)  # passed on, never read: not copied
                    else:
                        frames.append(frame.bytes)
                    more = frame.more
                if self.identify and count > 1:
                    # every frame of a message carries its connection's
                    # metadata but the routing id a ROUTER adds
                    self.owner.identified(frames[0], frame.get("User-Id"))
                return frames

            def discardQueued(self) -> int:
                """Read off and drop the messages waiting on the socket (at
                most READ_BATCH of them); how many.  Not while a message over
                the limits is being read off: that one ends the pipe."""
                socket = self.socket
                dropped = 0
                if socket is None or self.skipping is not None:
                    return 0
                handle = 0  # (as in doRead)
                if eventsOf is not None:
                    handle = self.handle or self._handle(socket)
                for _ in range(READ_BATCH):
                    events = eventsOf(handle) if handle else get(socket, EVENTS)
                    if not events & POLLIN:
                        break
                    if self._readMessage(socket) is None:
                        # over the limits: doRead reads the rest off and reports it
                        if not self.reading and self.read_scheduled is None:
                            self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)
                        break
                    dropped += 1
                return dropped

            def _skip(self, socket: Any, budget: int) -> int:
                """Read off up to *budget* frames of the message over the
                limits; returns the budget left."""
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
                # on a ROUTER the first frame is the sender's id
                self.owner.oversized(head if self.envelope else None, count - self.envelope, size)
                return budget

            def attached(self) -> None:
                """After a bind or connect, look for input a turn later.
                libzmq attaches an inproc pipe within the call itself, without
                signalling the FD: a ROUTER that binds an address DEALERs
                connected to first finds their messages queued already, and
                their later ones signal nothing until it has read those."""
                if self.read_scheduled is None and self.socket is not None:
                    self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

            def _events(self, socket: Any) -> int:
                """The socket's ``EVENTS`` bits, in C where that is built
                (pyzmq's ``get`` makes an enum of the option first)."""
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
                        # large frames go zero-copy (ZeroMQ keeps a reference), as
                        # pyzmq's own send_multipart does past its copy threshold
                        send(socket, frame, NOBLOCK if i == last else NOBLOCK_SNDMORE,
                             len(frame) < ZERO_COPY_BYTES)
                finally:
                    # a send, refused or not, may have taken the FD's (edge-
                    # triggered) signal of pending input: look for it ourselves
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
    """When to try a full pipe again.  libzmq says a full pipe has drained by
    signalling its socket, but any send or EVENTS check may consume that
    (edge-triggered) signal, so the backlogs are also retried on a timer: at
    once while they drain, backing off (doubling up to ``longest`` seconds)
    while they do not, so a peer that stops reading costs little CPU."""

    shortest = 0.0005
    longest = 0.05

    def __init__(self) -> None:
        self.delay = 0.0

    def next(self, progressed: bool) -> float:
        """The delay before the next try, after a try that *progressed* or not."""
        self.delay = 0.0 if progressed else min(self.longest, max(self.shortest, self.delay * 2))
        return self.delay


def random_identity() -> bytes:
    """16 random bytes a peer id can be (not starting with a zero byte,
    which ZeroMQ keeps for the ids it makes up)."""
    return bytes([os.urandom(1)[0] | 1]) + os.urandom(15)


def _zmq() -> Any:
    """The zmq module (imported late: see the module docstring)."""
    import zmq

    return zmq
