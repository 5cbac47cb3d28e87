"""The MDP/0.2 worker: serves one service through a broker.

The handler receives the request body (``list[bytes]``) and may return:

* ``bytes``/``str`` or a list of them — sent as one FINAL;
* a :class:`~twisted.internet.defer.Deferred` or a coroutine — its result is
  sent as above when it fires;
* a generator or async generator — every item it yields is sent at once as a
  PARTIAL, except an item wrapped in :class:`Final`, which ends the reply; a
  generator that ends without yielding :class:`Final` is closed with a FINAL
  holding one empty frame.

Requests stamped by the client (see :mod:`mdp.majordomo.idempotence`) are unstamped
before the handler sees them; given a reply store (``replies=``), the worker
answers a stamped request it has already answered from the store.

A handler exception is logged and answered with an error FINAL
(``codec.error_body(b"500", ...)``) that our client raises as
:class:`~mdp.errors.WorkerError`.  A reply (or a PARTIAL) too large for the
message limits is not sent: the request is answered with a 413 error FINAL
(:class:`~mdp.errors.MessageTooLarge`) and a streaming handler is closed, so
an oversized reply never costs the worker its connection.

Theory of operation
-------------------
The decisions live in :class:`WorkerMachine`, which knows no reactor, no
transport, no Deferred and no handler: it is fed events with their time and
returns actions (:class:`SendToBroker`, :class:`OpenPipe`, :class:`ClosePipe`,
:class:`ReopenAfter`, :class:`Serve`, :class:`StoreReply`, and
:class:`Dropped`, :class:`Refused`, :class:`Lost`, :class:`ConnectFailed` for
the log).  :class:`Worker` is its driver: it holds the machine
(``worker.machine``), owns the pipe, the timers and the log, runs the handler
and the reply store, and reports each reply part back (``handleReply``).

A worker is in one :class:`WorkerState` at a time; its connection to the
broker is one pipe (one DEALER socket on ZeroMQ), opened to the current
endpoint of its failover list (:class:`~mdp.policy.EndpointRotation`).
Silence is judged by a :class:`~mdp.policy.Liveness`: every message from the
broker counts, and so does opening a pipe (a pipe that never comes up counts
as silence, so the worker fails over even from a broker it cannot reach).

=============  ==================================  =============  ==============================
state          event                               next state     actions
=============  ==================================  =============  ==============================
STOPPED        ``start()``                         CONNECTING     open a pipe; start the tick
CONNECTING     pipe up (``connectionMade``)        READY          send READY
READY          pipe broke (``connectionLost``)     CONNECTING     drop the request in hand (the
                                                                  transport reconnects by itself)
READY          HEARTBEAT                           READY          reset failures and refusals
READY          REQUEST while idle                  READY          run the handler; PARTIAL*,
                                                                  FINAL
READY          DISCONNECT                          BACKING_OFF    close the pipe, next endpoint,
                                                                  wait 0 s the first time, then
                                                                  ``backoff.delay(refusals-1)``
CONNECTING,    tick, broker silent for more than   BACKING_OFF    close the pipe, next endpoint,
READY          ``interval × liveness``                            wait ``backoff.delay(failures)``
                                                                  (with several endpoints: 0 s the
                                                                  first time, then
                                                                  ``backoff.delay(failures-1)``)
READY          tick (every half interval), nothing  READY          send HEARTBEAT
               sent for ¾ of an interval
BACKING_OFF    the delay is over                   CONNECTING     open a fresh pipe
any            ``stop()``                          STOPPED        DISCONNECT if READY; close
=============  ==================================  =============  ==============================

Every message from the broker resets ``failures`` (the backoff of silence);
HEARTBEAT and REQUEST also reset ``refusals`` (the backoff of DISCONNECTs: a
broker that refuses READY, e.g. at its worker limit, sends DISCONNECT again
before anything else).  Messages arriving while STOPPED or BACKING_OFF come
from a pipe already closed and are ignored.  Every new or lost pipe bumps the
*generation*: a reply computed for an older one is dropped, since the broker
has re-queued that request elsewhere.

This is the Guide's Paranoid Pirate: heartbeats both ways; a broker silent for
``interval × liveness`` is dead, and the worker reconnects on a fresh socket
after a backoff delay (1 s doubling to 32 s), rotating through its list of
broker endpoints.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Coroutine, Generator
from typing import Any, Callable, Optional, Sequence, Union

import attrs
from twisted.internet import defer, task
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from zope.interface import classImplements

from mdp import transport
from mdp.errors import ProtocolError, TransportError
from mdp.handlers import checked_handler, reply_frames
from mdp.interfaces import IDealerReceiver, IDealerTransport, IWorker
from mdp.machine import Machine, action_class
from mdp.majordomo import codec, idempotence
from mdp.majordomo.codec import (
    RFC,
    W_REQUEST,
    WORKER_HEADER,
    Disconnect,
    Heartbeat,
    WorkerFinal,
    WorkerPartial,
    WorkerRequest,
    encode_worker_reply,
)
from mdp.majordomo.idempotence import STAMP_MARKER
from mdp.messages import text as label
from mdp.policy import (
    PIRATE,
    Backoff,
    EndpointRotation,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    cancel_call,
    default_reactor,
)

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

Handler = Callable[[list[bytes]], Any]

#: bytes a reply's envelope adds to its frames, besides the client address
_REPLY_OVERHEAD = len(WORKER_HEADER) + 1




class WorkerState(enum.Enum):
    """Where a worker's connection to the broker stands (see the table in the
    module docstring)."""

    #: not started, or stopped: no pipe, no timer
    STOPPED = "stopped"
    #: a pipe is open and not up yet (or broke and its transport reconnects)
    CONNECTING = "connecting"
    #: the pipe is up and READY went out on it
    READY = "ready"
    #: the pipe was closed; a fresh one opens once the backoff delay is over
    BACKING_OFF = "backing off"


STOPPED, CONNECTING, READY, BACKING_OFF = (
    WorkerState.STOPPED, WorkerState.CONNECTING, WorkerState.READY, WorkerState.BACKING_OFF)


@attrs.frozen
class Final:
    """Wraps the last item of a streaming handler: sent as the FINAL reply."""

    frames: Any


@action_class
class _Job:
    """One request being served: where its reply goes and whether it still may.
    Not changed once made (not frozen: a frozen class sets every field
    through ``object.__setattr__``, on every request)."""

    client: bytes  # the client address frame to reply to
    generation: int  # the connection it arrived on
    key: Optional[idempotence.StampKey]  # its stamp, if the client stamped it
    startedAt: float = 0.0  # when it arrived


@action_class
class SendToBroker:
    """The machine's wish: send *frames* on the pipe."""

    frames: list[bytes]


@action_class
class OpenPipe:
    """The machine's wish: open a pipe to *endpoint*."""

    endpoint: str


@action_class
class ClosePipe:
    """The machine's wish: close the pipe (what was sent on it goes first)."""


@action_class
class ReopenAfter:
    """The machine's wish: call :meth:`WorkerMachine.handleReopen` after
    *delay* seconds (replacing any such call still pending), having left
    *endpoint*: its broker was *silent* for that many seconds, or (``None``)
    said DISCONNECT."""

    delay: float
    endpoint: str
    silent: Optional[float]


@action_class
class Serve:
    """The machine's wish: answer request *job* with body *body* (from the
    reply store, or by running the handler), then report each part through
    :meth:`WorkerMachine.handleReply`."""

    job: _Job
    body: list[bytes]


@action_class
class StoreReply:
    """The machine's wish: keep *frames* as the reply to stamp *key*."""

    key: idempotence.StampKey
    frames: list[bytes]


@action_class
class Dropped:
    """For the log: a message from the broker was dropped, for *reason*."""

    reason: str


@action_class
class Refused:
    """For the log: a request is answered with the error *status* (400,
    413) instead, for *reason*."""

    status: bytes
    reason: str


@action_class
class Lost:
    """For the log: the registered pipe to *endpoint* was lost (*why*)."""

    endpoint: str
    why: str


@action_class
class ConnectFailed:
    """For the log: the pipe cannot connect to *endpoint* (*why*); the
    transport tries again."""

    endpoint: str
    why: str


Action = Any  # SendToBroker | OpenPipe | ClosePipe | ReopenAfter | Serve | StoreReply
#               | Dropped | Refused | Lost | ConnectFailed


def _why(reason: object) -> str:
    """A connection's loss or failure, in words: the exception a Failure
    holds, or the exception itself."""
    value = getattr(reason, "value", reason)
    if value is None:
        return "no reason given"
    return str(value) or type(value).__name__


class WorkerMachine(Machine):
    """The worker's decisions (the table in the module docstring), and
    nothing else: no reactor, no transport, no Deferred, no handler, no log.
    Feed it events with their time; each ``handle*`` returns the actions it
    wants done, in order.  :class:`Worker` drives it."""

    def __init__(
        self,
        endpoints: list[str],
        service: bytes,
        *,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        backoff: Backoff = PIRATE,
        dialect: str = codec.RFC,
        limits: Limits = Limits(),
        now: float = 0.0,
    ) -> None:
        super().__init__(now)
        self._rotation = EndpointRotation(endpoints)
        self.service = service
        self.heartbeat = heartbeat
        self.backoff = backoff
        self.dialect = codec.check_dialect(dialect)
        self.limits = limits
        #: the last reason a connection attempt failed, and when it was told
        self.connectWhy: Optional[str] = None
        self.connectSaidAt = 0.0
        self.state = STOPPED
        #: when the broker was last heard from and last sent to
        self.liveness = Liveness(heartbeat, now)
        self.failures = 0  # reconnections since the broker last spoke
        self.refusals = 0  # DISCONNECTs since the broker last sent HEARTBEAT or REQUEST
        self.current: Optional[bytes] = None  # client address being served
        self.answered = False  # the broker sent something since READY
        self.generation = 0  # bumped on every new or lost pipe; stale replies are dropped

    @property
    def endpoints(self) -> list[str]:
        """The broker endpoints, in failover order."""
        return self._rotation.endpoints

    @property
    def endpoint(self) -> str:
        """The broker endpoint in use (or next to be tried)."""
        return self._rotation.current

    @property
    def connected(self) -> bool:
        """The pipe is up and READY went out on it (state READY)."""
        return self.state is READY

    @property
    def started(self) -> bool:
        """Started and not stopped since (any state but STOPPED)."""
        return self.state is not STOPPED

    @property
    def registered(self) -> bool:
        """READY went out and the broker has answered since (a HEARTBEAT or
        a request): on ZeroMQ a pipe is "up" whether or not anyone listens."""
        return self.state is READY and self.answered

    @property
    def wakeEvery(self) -> float:
        """How often :meth:`handleTick` wants to run: half a heartbeat
        interval, so a silent broker is noticed within half an interval of
        its expiry (a HEARTBEAT still goes out once an interval)."""
        return self.heartbeat.interval / 2

    def isCurrent(self, job: _Job) -> bool:
        """*job* may still be answered: its pipe lives and it is the request
        in hand."""
        return job.generation == self.generation and self.current == job.client

    # --- events ----------------------------------------------------------------

    def handleStart(self, now: float) -> list[Action]:
        """Connect: READY goes out once the pipe is up."""
        self.now = now
        if self.state is STOPPED:
            self._open()
        return self._drain()

    def handleStop(self, now: float) -> list[Action]:
        """Say DISCONNECT (if registered) and close."""
        self.now = now
        state, self.state = self.state, STOPPED
        if state is READY:
            self._send(codec.DISCONNECT)
        if state is READY or state is CONNECTING:
            self._outbox.append(ClosePipe())
            self.generation += 1
        return self._drain()

    def handleReopen(self, now: float) -> list[Action]:
        """The backoff delay is over."""
        self.now = now
        if self.state is BACKING_OFF:
            self._open()
        return self._drain()

    def handlePipeUp(self, now: float) -> list[Action]:
        self.now = now
        self.connectWhy = None  # a later failure is news again
        self.generation += 1
        self.state = READY
        self.current = None
        self.answered = False
        self.liveness.heard(now)
        self._send(codec.Ready(self.service))
        return self._drain()

    def handleConnectFailed(self, error: object, now: float) -> list[Action]:
        """A connection attempt failed (refused, no such host, ...), and the
        transport tries again on its own: logged when the reason changes,
        and at most once per ``interval * liveness`` while it stays (a
        worker started before its broker would say so at every retry)."""
        from mdp.majordomo.client_machine import unreachable

        self.now = now
        value = getattr(error, "value", error)
        why = (unreachable(value) if isinstance(value, BaseException) else None) or _why(value)
        if why != self.connectWhy or now - self.connectSaidAt >= self.heartbeat.expiry:
            self.connectWhy = why
            self.connectSaidAt = now
            self._outbox.append(ConnectFailed(self.endpoint, why))
        return self._drain()

    def handlePipeLost(self, now: float, why: object = None) -> list[Action]:
        """The connection was lost; *why*, the reason (a Failure or an
        exception), is logged with it (a TLS handshake refused, say)."""
        self.now = now
        if self.state is READY:
            self._outbox.append(Lost(self.endpoint, _why(why)))
            self.state = CONNECTING
        self.current = None
        self.generation += 1
        return self._drain()

    def handleMessage(self, frames: list[bytes], now: float) -> list[Action]:
        """A message from the broker."""
        self.now = now
        self._received(frames)
        return self._drain()

    def handleReply(self, job: _Job, kind: type, frames: list[bytes], now: float,
                    store: bool = True) -> tuple[bool, list[Action]]:
        """A PARTIAL or FINAL for *job*: sent unless its pipe is gone (a
        stamped request's FINAL is stored either way); a part over the
        message limits is replaced by a 413 error FINAL.  Returns whether the
        part went out as itself, and the actions."""
        self.now = now
        sent = self._replyPart(job, kind, frames, store)
        outbox = self._outbox
        self._outbox = []
        return sent, outbox

    def handleTick(self, now: float) -> list[Action]:
        """Once per heartbeat interval: detect a dead (or unreachable) broker,
        send HEARTBEAT."""
        self.now = now
        self._tick(now)
        return self._drain()

    def handleBlocked(self, now: float) -> list[Action]:
        """The reactor could not run until *now* (a handler blocked it): what
        the broker sent meanwhile waits unread, so its silence is ours and
        is not held against it (the silence clock starts again)."""
        self.now = now
        if self.state is READY or self.state is CONNECTING:
            self.liveness.heard(now)
        return self._drain()

    # --- decisions -------------------------------------------------------------

    def _open(self) -> None:
        """Open a pipe to the current endpoint: CONNECTING."""
        self.state = CONNECTING
        # a pipe that never comes up counts as silence, so the worker fails
        # over even when the broker cannot be reached at all
        self.liveness.heard(self.now)
        self._outbox.append(OpenPipe(self.endpoint))

    def _reconnect(self, delay: float, silent: Optional[float] = None) -> None:
        """Close the socket, wait *delay*, open a fresh one to the next
        endpoint (Paranoid Pirate): BACKING_OFF."""
        self.state = BACKING_OFF
        self.current = None
        self.generation += 1
        self._outbox.append(ClosePipe())
        left = self.endpoint
        self._rotation.advance()
        self._outbox.append(ReopenAfter(delay, left, silent))

    def _received(self, frames: list[bytes]) -> None:
        if self.state is STOPPED or self.state is BACKING_OFF:
            return  # from a pipe already closed
        if (len(frames) >= 5 and frames[0] == WORKER_HEADER and frames[1] == W_REQUEST
                and frames[3] == b"" and self.dialect == RFC):
            # a REQUEST, checked as decode_worker checks it
            self._command(WorkerRequest, frames[2], frames[4:])
            return
        try:
            command = codec.decode_worker(codec.expect(frames, self.dialect))
        except ProtocolError as e:
            self._outbox.append(Dropped(f"invalid message: {e}"))
            return
        if type(command) is WorkerRequest:
            self._command(WorkerRequest, command.client, list(command.body))
        else:
            self._command(type(command), b"", [])

    def _command(self, kind: type, client: bytes, body: list[bytes]) -> None:
        """A command from the broker (a REQUEST from *client* with *body*)."""
        self.liveness.heard(self.now)
        self.failures = 0
        self.answered = True
        if kind is WorkerRequest or kind is Heartbeat:
            self.refusals = 0
            if kind is WorkerRequest:
                self._request(client, body)
        elif kind is Disconnect:
            delay = self.backoff.delay(self.refusals - 1) if self.refusals else 0.0
            self.refusals += 1
            self._reconnect(delay)
        else:
            self._outbox.append(Dropped(f"unexpected {kind.__name__}"))

    def _request(self, client: bytes, body: list[bytes]) -> None:
        """A REQUEST from *client* (its body a list of our own)."""
        if self.current is not None:
            self._outbox.append(Dropped("a REQUEST while busy"))
            return
        key = None
        if body and body[0] == STAMP_MARKER:
            try:
                key, body = idempotence.unstamp(body)
            except ValueError as e:
                self._outbox.append(Refused(codec.STATUS_BAD_REQUEST, f"malformed stamp: {e}"))
                self.current = client
                self._replyPart(_Job(client, self.generation, None, self.now), WorkerFinal,
                                codec.error_body(codec.STATUS_BAD_REQUEST,
                                                 f"malformed request stamp: {e}"), False)
                return
        self.current = client
        self._outbox.append(Serve(_Job(client, self.generation, key, self.now), body))

    def _replyPart(self, job: _Job, kind: type, frames: list[bytes], store: bool) -> bool:
        if job.generation != self.generation or self.state is not READY or self.current != job.client:
            self._store(job, kind, frames, store)
            return False
        size = sum(map(len, frames)) + _REPLY_OVERHEAD + len(job.client)
        limits = self.limits
        tooLarge = None
        if size > limits.maxMessageBytes or len(frames) + 5 > limits.maxFrames:
            tooLarge = limits.oversize(size, len(frames) + 5)
            self._outbox.append(Refused(codec.STATUS_TOO_LARGE,
                                        f"its {kind.__name__} is too large ({tooLarge})"))
            kind, store = WorkerFinal, False
            frames = codec.error_body(codec.STATUS_TOO_LARGE, f"reply too large to send: {tooLarge}")
        final = kind is WorkerFinal
        if final and store and job.key is not None:
            self._outbox.append(StoreReply(job.key, frames))
        self._outbox.append(SendToBroker(encode_worker_reply(job.client, frames, final,
                                                                   self.dialect)))
        self.liveness.sent(self.now)
        if final:
            self.current = None
        return tooLarge is None

    def _store(self, job: _Job, kind: type, frames: list[bytes], store: bool) -> None:
        if kind is WorkerFinal and store and job.key is not None:
            self._outbox.append(StoreReply(job.key, frames))

    def _tick(self, now: float) -> None:
        state = self.state
        if state is not CONNECTING and state is not READY:
            return  # waiting out a reconnect delay
        liveness = self.liveness
        if liveness.dead(now):
            if self.failures or len(self._rotation.endpoints) == 1:
                delay = self.backoff.delay(self.failures - (len(self._rotation.endpoints) > 1))
            else:
                delay = 0.0  # another broker to try (a Binary Star pair): at once
            self.failures += 1
            self._reconnect(delay, liveness.silence(now))
        elif state is READY and liveness.due(now, 0.75):
            self._send(codec.HEARTBEAT)

    def _send(self, command: Any) -> None:
        self._outbox.append(SendToBroker(codec.encode(command, self.dialect)))
        self.liveness.sent(self.now)


class WorkerDriver:
    """What both drivers of a :class:`WorkerMachine` share (:class:`Worker`
    and :class:`mdp.blocking.Worker`): the machine (``machine``), its state
    for the caller, the handler, and the log of what the machine reports.
    *clock* (what has ``seconds()``) is the driver's time."""

    #: the level of the line saying READY went out: a process of many
    #: workers of its own (Titanic's) says once what it serves instead
    readyLogLevel = LogLevel.info

    def __init__(self, endpoints: list[str], service: Union[str, bytes], handler: Handler,
                 clock: Any, *, heartbeat: HeartbeatPolicy, backoff: Backoff, dialect: str,
                 limits: Limits, curveServerPublic: Optional[str],
                 curveSecret: Optional[str]) -> None:
        self.handler = checked_handler(handler)
        #: the broker's public key and this worker's key pair, for zmq: endpoints
        self.curve = transport.curve_client_for(endpoints, curveServerPublic, curveSecret)
        self.machine = WorkerMachine(endpoints, codec.api_service_name(service),
                                     heartbeat=heartbeat, backoff=backoff, dialect=dialect,
                                     limits=limits, now=clock.seconds())
        self.throttle = LogThrottle(clock)
        self.requestsServed = 0

    @property
    def service(self) -> bytes:
        """The service name, bytes."""
        return self.machine.service

    @property
    def endpoints(self) -> list[str]:
        """The broker endpoints, in failover order."""
        return self.machine.endpoints

    @property
    def endpoint(self) -> str:
        """The broker endpoint in use (or next to be tried)."""
        return self.machine.endpoint

    @property
    def state(self) -> WorkerState:
        """Where the connection to the broker stands."""
        return self.machine.state

    @property
    def connected(self) -> bool:
        """The pipe is up and READY went out on it."""
        return self.machine.state is READY

    @property
    def started(self) -> bool:
        """Started and not stopped since."""
        return self.machine.state is not STOPPED

    @property
    def registered(self) -> bool:
        """READY went out and the broker has answered since."""
        return self.machine.registered

    @property
    def current(self) -> Optional[bytes]:
        """The address of the client being served, if one is."""
        return self.machine.current

    @property
    def generation(self) -> int:
        """Bumped on every new or lost pipe (a reply for an older one is dropped)."""
        return self.machine.generation

    def _ready(self) -> None:
        log.emit(self.readyLogLevel, "worker for {service} sent READY to {endpoint}",
                 service=label(self.machine.service), endpoint=self.machine.endpoint)

    def _openFailed(self, error: BaseException) -> None:
        """The transport could not open the pipe (no socket to be had: out
        of descriptors): as a pipe that never comes up, the broker's silence
        decides, and the worker reconnects with its backoff."""
        machine = self.machine
        log.error("worker for {service} cannot open a connection to {endpoint}: {error}; "
                  "it reconnects, with its backoff, once {expiry:g}s pass without a broker",
                  service=label(machine.service), endpoint=machine.endpoint, error=error,
                  expiry=machine.heartbeat.expiry)

    def _report(self, action: Action) -> None:
        """Log what the machine reports (throttled where the broker could
        make a flood of it)."""
        kind = type(action)
        service = label(self.machine.service)
        if kind is ReopenAfter:
            if action.silent is None:
                log.info("worker for {service} got DISCONNECT; registering again in {delay:g}s",
                         service=service, delay=action.delay)
            else:
                log.warn("broker {endpoint} silent for {silence:.1f}s; worker for {service} "
                         "reconnects in {delay:g}s", endpoint=action.endpoint,
                         silence=action.silent, service=service, delay=action.delay)
        elif kind is Dropped:
            self.throttle.warn(log, "dropped", "worker for {service} dropped a message from the "
                               "broker: {reason}", service=service, reason=action.reason)
        elif kind is Refused:
            self.throttle.warn(log, "refused", "worker for {service} answers {status}: {reason}",
                               service=service, status=action.status.decode(),
                               reason=action.reason)
        elif kind is Lost:
            log.info("worker for {service} lost {endpoint} ({why}); reconnecting",
                     service=service, endpoint=action.endpoint, why=action.why)
        elif kind is ConnectFailed:
            log.warn("worker for {service} cannot connect to {endpoint}: {error}; trying again",
                     service=service, endpoint=action.endpoint, error=action.why)


class Worker(WorkerDriver):
    """An MDP/0.2 worker for one *service*, connected to one broker at a time:
    the :class:`WorkerMachine` driven over a real transport.  The driver owns
    the pipe, the tick and the backoff timer, runs the handler (Deferreds,
    coroutines, generators, pacing a stream by ``drained()``) and the reply
    store; every decision is the machine's.

    *endpoint* is one broker endpoint or a failover list; each is checked at
    once (a malformed one raises :class:`~mdp.errors.TransportError`); a
    *handler* that is not callable raises ``TypeError``."""

    def __init__(
        self,
        endpoint: Union[str, Sequence[str]],
        service: Union[str, bytes],
        handler: Handler,
        reactor: Optional[Any] = None,
        *,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        backoff: Backoff = PIRATE,
        dialect: str = codec.RFC,
        replies: Optional[idempotence.IReplyStore] = None,
        limits: Limits = Limits(),
        metrics: Optional[Any] = None,
        curveServerPublic: Optional[str] = None,
        curveSecret: Optional[str] = None,
    ) -> None:
        reactor = default_reactor(reactor)
        super().__init__(transport.endpoint_list(endpoint), service, handler, reactor,
                         heartbeat=heartbeat, backoff=backoff, dialect=dialect, limits=limits,
                         curveServerPublic=curveServerPublic, curveSecret=curveSecret)
        self.reactor = reactor
        self.replies = replies
        self.transport: Optional[IDealerTransport] = None
        self.streamPauses = 0  # times a streaming handler waited for a full queue to drain
        self._reconnectCall: Any = None
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = reactor
        self._lastTick: Optional[float] = None
        #: when the last block of the reactor by a handler ended (it is logged once)
        self._handlerBlockEnded = -1.0
        #: a :class:`mdp.metrics.WorkerMetrics` (or None)
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Connect to the broker; READY is sent once the pipe is up."""
        if self.machine.state is not STOPPED:
            return
        self._perform(self.machine.handleStart(self.reactor.seconds()))
        self._ticker.start(self.machine.wakeEvery, now=False)

    def stop(self) -> defer.Deferred[None]:
        """Say DISCONNECT to the broker (if registered) and close."""
        if self._ticker.running:
            self._ticker.stop()
        self._lastTick = None
        self._reconnectCall = cancel_call(self._reconnectCall)
        closing = self._perform(self.machine.handleStop(self.reactor.seconds()))
        return closing if closing is not None else defer.succeed(None)

    def _reopen(self) -> None:
        self._reconnectCall = None
        self._perform(self.machine.handleReopen(self.reactor.seconds()))

    def tick(self) -> None:
        now = self.reactor.seconds()
        last, self._lastTick = self._lastTick, now
        if last is not None and now - last > self.machine.wakeEvery + self.machine.heartbeat.interval:
            # the reactor did not run this timer on time: something blocked it
            blocked = now - last - self.machine.wakeEvery
            if self._handlerBlockEnded < last:  # not the handler's block, already told
                self.throttle.warn(log, "blocked", "the reactor was blocked for {blocked:.1f} s "
                                   "(worker for {service}): the broker's silence meanwhile is not "
                                   "held against it", blocked=blocked, service=label(self.service))
                if self.metrics is not None:
                    self.metrics.blockedReactor(self.service)
            self._perform(self.machine.handleBlocked(now))
        self._perform(self.machine.handleTick(now))

    def _perform(self, actions: list[Action]) -> Optional[defer.Deferred[None]]:
        """Do what the machine asked, in order; returns the closing of a pipe
        it closed, if it did."""
        closing = None
        for action in actions:
            kind = type(action)
            if kind is SendToBroker:
                if self.transport is not None:
                    self.transport.sendMessage(action.frames)
            elif kind is Serve:
                job = action.job
                if job.key is None and self.metrics is None:
                    self._run(job, action.body)
                else:
                    self._serve(job, action.body)
            else:
                closing = self._act(action) or closing
        return closing

    def _act(self, action: Action) -> Optional[defer.Deferred[None]]:
        """An action other than a send or a request to serve; returns the
        closing of a pipe it closed, if it did."""
        kind = type(action)
        if kind is StoreReply:
            if self.replies is not None:
                defer.maybeDeferred(self.replies.put, action.key, action.frames).addErrback(
                    _storeFailed)
        elif kind is OpenPipe:
            self._open(action.endpoint)
        elif kind is ClosePipe:
            pipe, self.transport = self.transport, None
            if pipe is not None:
                return pipe.close()
        else:
            self._report(action)
            if kind is ReopenAfter:
                cancel_call(self._reconnectCall)
                self._reconnectCall = self.reactor.callLater(action.delay, self._reopen)
                if self.metrics is not None:
                    self.metrics.reconnected(self.service)
        return None

    def _open(self, endpoint: str) -> None:
        try:
            self.transport = transport.connect(
                endpoint, self, self.reactor, retryPolicy=self.machine.backoff.retryPolicy(),
                limits=self.machine.limits, security=transport.curve_for(endpoint, self.curve))
        except TransportError as e:  # no socket to be had (out of descriptors)
            self._openFailed(e)

    # --- IDealerReceiver ---------------------------------------------------

    def connectionMade(self) -> None:
        self._perform(self.machine.handlePipeUp(self.reactor.seconds()))
        self._ready()

    def connectionLost(self, reason: object) -> None:
        self._perform(self.machine.handlePipeLost(self.reactor.seconds(), reason))

    def connectionFailed(self, reason: object) -> None:
        self._perform(self.machine.handleConnectFailed(reason, self.reactor.seconds()))

    def messageReceived(self, frames: list[bytes]) -> None:
        self._perform(self.machine.handleMessage(frames, self.reactor.seconds()))

    # --- serving -------------------------------------------------------------

    def _serve(self, job: _Job, body: list[bytes]) -> None:
        if self.metrics is not None:
            self.metrics.request(self.service)
        if job.key is None or self.replies is None:
            self._run(job, body)
            return

        def lookedUp(stored: Optional[list[bytes]]) -> None:
            if stored is None:
                self._run(job, body)
            else:
                self._reply(job, WorkerFinal, list(stored), store=False)

        def storeFailed(failure: Failure) -> None:
            log.failure("reply store lookup failed; running the request", failure)
            self._run(job, body)

        defer.maybeDeferred(self.replies.get, job.key).addCallbacks(lookedUp, storeFailed)

    def _run(self, job: _Job, body: list[bytes]) -> None:
        clock = self.reactor.seconds
        started = clock()
        try:
            result = self.handler(body)
        except Exception:
            self._checkBlocked(clock() - started)
            self._failed(Failure(), job)
            return
        blocked = clock() - started
        if blocked >= self.machine.heartbeat.interval:
            self._checkBlocked(blocked)
        kind = type(result)
        if kind is list or kind is bytes:  # the common, synchronous answer
            self._finish(result, job)
            return
        if isinstance(result, Coroutine):
            result = defer.ensureDeferred(result)
        if isinstance(result, defer.Deferred):
            result.addCallbacks(self._finish, self._failed, (job,), None, (job,))
        elif isinstance(result, (AsyncGenerator, Generator)):
            defer.ensureDeferred(self._stream(result, job)).addErrback(self._failed, job)
        else:
            self._finish(result, job)

    def _checkBlocked(self, blocked: float) -> None:
        """A handler that kept the reactor for longer than a heartbeat
        interval is told so, and the broker's silence meanwhile is not held
        against it (the broker may still have given this worker up: its
        late reply is then taken if the request is still queued)."""
        if blocked < self.machine.heartbeat.interval:
            return
        now = self.reactor.seconds()
        self._handlerBlockEnded = now
        self.throttle.warn(log, "blocked", "handler for {service} blocked the reactor for "
                           "{blocked:.1f} s; run blocking work with deferToThread",
                           service=label(self.service), blocked=blocked)
        if self.metrics is not None:
            self.metrics.blockedReactor(self.service)
        self._perform(self.machine.handleBlocked(now))

    async def _stream(self, parts: Any, job: _Job) -> None:
        """Send what a streaming handler yields (a plain or an asynchronous
        generator) as PARTIALs, until a :class:`Final` ends the reply or the
        request is void (or answered with a 413); the handler is paused
        while the broker takes PARTIALs slower than it makes them."""
        sync = isinstance(parts, Generator)
        while True:
            try:
                item = next(parts) if sync else await parts.__anext__()
            except (StopIteration, StopAsyncIteration):
                self._finish(None, job)
                return
            current = self.machine.isCurrent(job)
            final = current and isinstance(item, Final)
            if not current or final or not self._reply(job, WorkerPartial, reply_frames(item)):
                await _close(parts)
                if final:
                    self._finish(item.frames, job)
                return
            transport = self.transport
            if transport is not None and not transport.writable:
                self.streamPauses += 1
                await transport.drained()

    def _finish(self, value: Any, job: _Job) -> None:
        try:
            frames = reply_frames(value)
        except Exception:  # whatever it is, the request gets its answer (500)
            self._failed(Failure(), job)
            return
        if self._reply(job, WorkerFinal, frames):
            self.requestsServed += 1

    def _failed(self, failure: Failure, job: _Job) -> None:
        log.failure("handler for {service} failed", failure, service=label(self.service))
        message = f"{failure.type.__name__}: {failure.getErrorMessage()}"
        self._reply(job, WorkerFinal, codec.error_body(codec.STATUS_WORKER_ERROR, message),
                    failure="error")

    def _reply(self, job: _Job, kind: type, frames: list[bytes], store: bool = True,
               failure: Optional[str] = None) -> bool:
        """Hand a reply part to the machine and do what it says; True if the
        part went out as itself."""
        metrics = self.metrics
        current = metrics is not None and self.machine.isCurrent(job)
        now = self.reactor.seconds()
        sent, actions = self.machine.handleReply(job, kind, frames, now, store)
        self._perform(actions)
        if current and (kind is WorkerFinal or not sent):
            # a FINAL went out (a part over the limits became a 413 FINAL)
            metrics.replied(self.service, now - job.startedAt,
                            failure if sent else "too-large")
        return sent


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Worker, IWorker, IDealerReceiver)


async def _close(parts: Any) -> None:
    """Close a streaming handler's generator, plain or asynchronous."""
    if isinstance(parts, Generator):
        parts.close()
    else:
        await parts.aclose()


def _storeFailed(failure: Failure) -> None:
    """The reply store failed to keep a reply: logged (the reply went out)."""
    log.failure("reply store could not keep a reply", failure)
