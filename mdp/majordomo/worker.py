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
READY          tick, nothing sent for half an      READY          send HEARTBEAT
               interval
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
import inspect
from typing import Any, Callable, Optional, Sequence, Union

import attrs
from twisted.internet import defer, task
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp import transport
from mdp.errors import ProtocolError
from mdp.handlers import reply_frames
from mdp.interfaces import IDealerReceiver, IDealerTransport, IWorker
from mdp.majordomo import codec, idempotence
from mdp.majordomo.codec import Disconnect, Heartbeat, WorkerFinal, WorkerPartial, WorkerRequest
from mdp.policy import (
    Backoff,
    EndpointRotation,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    cancel_call,
    default_reactor,
)

log = Logger()

Handler = Callable[[list[bytes]], Any]




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


@attrs.frozen
class _Job:
    """One request being served: where its reply goes and whether it still may."""

    client: bytes  # the client address frame to reply to
    generation: int  # the connection it arrived on
    key: Optional[idempotence.StampKey]  # its stamp, if the client stamped it


@implementer(IWorker, IDealerReceiver)
class Worker:
    """An MDP/0.2 worker for one *service*, connected to one broker at a time.

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
        backoff: Backoff = Backoff(),
        dialect: str = codec.RFC,
        replies: Optional[idempotence.IReplyStore] = None,
        limits: Limits = Limits(),
    ) -> None:
        reactor = default_reactor(reactor)
        endpoints = transport.endpoint_list(endpoint)
        if not callable(handler):
            raise TypeError(f"a handler is a callable taking the request body, "
                            f"not {type(handler).__name__}: {handler!r}")
        self._rotation = EndpointRotation(endpoints)
        self.service = codec.api_service_name(service)
        self.handler = handler
        self.reactor = reactor
        self.heartbeat = heartbeat
        self.backoff = backoff
        self.dialect = codec.check_dialect(dialect)
        self.replies = replies
        self.limits = limits
        self.throttle = LogThrottle(reactor)
        self.state = STOPPED
        self.transport: Optional[IDealerTransport] = None
        #: when the broker was last heard from and last sent to
        self.liveness = Liveness(heartbeat, reactor.seconds())
        self.failures = 0  # reconnections since the broker last spoke
        self.refusals = 0  # DISCONNECTs since the broker last sent HEARTBEAT or REQUEST
        self.current: Optional[bytes] = None  # client address being served
        self.generation = 0  # bumped on every new or lost pipe; stale replies are dropped
        self.requestsServed = 0
        self.streamPauses = 0  # times a streaming handler waited for a full queue to drain
        self._reconnectCall: Any = None
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = reactor

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

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Connect to the broker; READY is sent once the pipe is up."""
        if self.state is not STOPPED:
            return
        self._open()
        self._ticker.start(self.heartbeat.interval, now=False)

    def stop(self) -> defer.Deferred[None]:
        """Say DISCONNECT to the broker (if registered) and close."""
        wasReady = self.state is READY
        self.state = STOPPED
        if self._ticker.running:
            self._ticker.stop()
        cancel_call(self._reconnectCall)
        self._reconnectCall = None
        transport_, self.transport = self.transport, None
        if transport_ is None:
            return defer.succeed(None)
        if wasReady:
            transport_.sendMessage(codec.encode(codec.DISCONNECT, self.dialect))
        self.generation += 1
        return transport_.close()

    def _open(self) -> None:
        """Open a pipe to the current endpoint: CONNECTING."""
        self.state = CONNECTING
        # a pipe that never comes up counts as silence, so the worker fails
        # over even when the broker cannot be reached at all
        self.liveness.heard(self.reactor.seconds())
        self.transport = transport.connect(
            self.endpoint, self, self.reactor, retryPolicy=self.backoff.retryPolicy(),
            limits=self.limits,
        )

    def _reconnect(self, delay: float) -> None:
        """Close the socket, wait *delay*, open a fresh one to the next
        endpoint (Paranoid Pirate): BACKING_OFF."""
        self.state = BACKING_OFF
        self.current = None
        self.generation += 1
        transport_, self.transport = self.transport, None
        if transport_ is not None:
            transport_.close()
        self._rotation.advance()
        cancel_call(self._reconnectCall)
        self._reconnectCall = self.reactor.callLater(delay, self._reopen)

    def _reopen(self) -> None:
        self._reconnectCall = None
        if self.state is BACKING_OFF:
            self._open()

    # --- IDealerReceiver ---------------------------------------------------

    def connectionMade(self) -> None:
        self.generation += 1
        self.state = READY
        self.current = None
        self.liveness.heard(self.reactor.seconds())
        self._send(codec.Ready(self.service))
        log.info("worker for {service} sent READY to {endpoint}",
                 service=self.service, endpoint=self.endpoint)

    def connectionLost(self, reason: object) -> None:
        if self.state is READY:
            log.info("worker for {service} lost {endpoint}; reconnecting",
                     service=self.service, endpoint=self.endpoint)
            self.state = CONNECTING
        self.current = None
        self.generation += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        if self.state is STOPPED or self.state is BACKING_OFF:
            return  # from a pipe already closed
        try:
            command = codec.decode_worker(codec.expect(frames, self.dialect))
        except ProtocolError as e:
            self.throttle.warn(log, "invalid", "worker for {service} dropped invalid message from "
                               "broker: {reason}", service=self.service, reason=e)
            return
        self.liveness.heard(self.reactor.seconds())
        self.failures = 0
        kind = type(command)
        if kind is Heartbeat:
            self.refusals = 0
            return
        if kind is WorkerRequest:
            self.refusals = 0
            if self.current is not None:
                self.throttle.warn(log, "busy", "worker for {service} got a REQUEST while busy; "
                                   "dropped", service=self.service)
                return
            self._serve(command)  # type: ignore[arg-type]
        elif kind is Disconnect:
            delay = self.backoff.delay(self.refusals - 1) if self.refusals else 0.0
            self.refusals += 1
            log.info("worker for {service} got DISCONNECT; registering again in {delay:g}s",
                     service=self.service, delay=delay)
            self._reconnect(delay)
        else:
            self.throttle.warn(log, "unexpected", "worker for {service} dropped unexpected "
                               "{command} from broker", service=self.service, command=kind.__name__)

    # --- serving -------------------------------------------------------------

    def _serve(self, request: WorkerRequest) -> None:
        key, body = idempotence.unstamp(request.body)
        job = _Job(request.client, self.generation, key)
        self.current = request.client
        if key is None or self.replies is None:
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

        defer.maybeDeferred(self.replies.get, key).addCallbacks(lookedUp, storeFailed)

    def _run(self, job: _Job, body: list[bytes]) -> None:
        try:
            result = self.handler(body)
        except Exception:
            self._failed(Failure(), job)
            return
        kind = type(result)
        if kind is list or kind is bytes:  # the common, synchronous answer
            self._finish(result, job)
            return
        if inspect.iscoroutine(result):
            result = defer.ensureDeferred(result)
        if isinstance(result, defer.Deferred):
            result.addCallbacks(self._finish, self._failed, (job,), None, (job,))
        elif inspect.isasyncgen(result) or inspect.isgenerator(result):
            defer.ensureDeferred(self._stream(result, job)).addErrback(self._failed, job)
        else:
            self._finish(result, job)

    async def _stream(self, parts: Any, job: _Job) -> None:
        if inspect.isgenerator(parts):
            source = parts

            async def iterate() -> Any:
                for item in source:
                    yield item

            parts = iterate()
        async for item in parts:
            if job.generation != self.generation or self.current != job.client:
                await parts.aclose()  # the request is void, or was answered (413)
                return
            if isinstance(item, Final):
                await parts.aclose()
                self._finish(item.frames, job)
                return
            if not self._reply(job, WorkerPartial, reply_frames(item)):
                await parts.aclose()  # the request is void, or was answered (413)
                return
            transport = self.transport
            if transport is not None and not transport.writable:
                # the broker takes PARTIALs slower than the handler makes them:
                # pause the handler rather than pile them up
                self.streamPauses += 1
                await transport.drained()
        self._finish(None, job)

    def _finish(self, value: Any, job: _Job) -> None:
        try:
            frames = reply_frames(value)
        except TypeError:
            self._failed(Failure(), job)
            return
        if self._reply(job, WorkerFinal, frames):
            self.requestsServed += 1

    def _failed(self, failure: Failure, job: _Job) -> None:
        log.failure("handler for {service} failed", failure, service=self.service)
        message = f"{failure.type.__name__}: {failure.getErrorMessage()}"
        self._reply(job, WorkerFinal, codec.error_body(codec.STATUS_WORKER_ERROR, message))

    def _reply(self, job: _Job, kind: type, frames: list[bytes], store: bool = True) -> bool:
        """Send a PARTIAL or FINAL unless the connection it belongs to is gone;
        remember a stamped request's FINAL in the reply store.  A part over
        the message limits is replaced by a 413 error FINAL."""
        if job.generation != self.generation or self.state is not READY or self.current != job.client:
            self._store(job, kind, frames, store)
            return False
        size = sum(map(len, frames)) + len(codec.WORKER_HEADER) + 1 + len(job.client)
        tooLarge = self.limits.oversize(size, len(frames) + 5)
        if tooLarge is not None:
            self.throttle.warn(log, "too-large", "worker for {service} answers 413: its {command} "
                               "is too large ({reason})", service=self.service,
                               command=kind.__name__, reason=tooLarge)
            kind, store = WorkerFinal, False
            frames = codec.error_body(codec.STATUS_TOO_LARGE, f"reply too large to send: {tooLarge}")
        self._store(job, kind, frames, store)
        self._send(kind(job.client, frames))
        if kind is WorkerFinal:
            self.current = None
        return tooLarge is None

    def _store(self, job: _Job, kind: type, frames: list[bytes], store: bool) -> None:
        if kind is WorkerFinal and store and job.key is not None and self.replies is not None:
            defer.maybeDeferred(self.replies.put, job.key, frames).addErrback(
                lambda f: log.failure("reply store could not keep a reply", f)
            )

    # --- time ----------------------------------------------------------------

    def tick(self) -> None:
        """Once per heartbeat interval: detect a dead (or unreachable) broker,
        send HEARTBEAT."""
        state = self.state
        if state is not CONNECTING and state is not READY:
            return  # waiting out a reconnect delay
        now = self.reactor.seconds()
        liveness = self.liveness
        if liveness.dead(now):
            delay = self.backoff.delay(self.failures)
            self.failures += 1
            log.warn("broker {endpoint} silent for {silence:.1f}s; worker for {service} "
                     "reconnects in {delay:g}s", endpoint=self.endpoint,
                     silence=liveness.silence(now), service=self.service, delay=delay)
            self._reconnect(delay)
        elif state is READY and liveness.due(now, 0.5):
            self._send(codec.HEARTBEAT)

    def _send(self, command: Any) -> None:
        if self.transport is not None:
            self.transport.sendMessage(codec.encode(command, self.dialect))
            self.liveness.sent(self.reactor.seconds())
