"""The MDP/0.2 worker: serves one service through a broker.  What a handler may return is in
docs/mdp.md ("Worker").  Stamped requests (:mod:`mdp.majordomo.idempotence`) are unstamped first;
with a reply store (``replies=``) one already answered is answered from it.  A handler exception is
answered with a 500, a reply part over the limits with a 413.  :class:`WorkerMachine` decides (its
states and transitions: docs/machines.md); :class:`Worker` drives it over one pipe to the current
endpoint of a failover list."""

from __future__ import annotations

import enum
import functools
from collections.abc import AsyncGenerator, Coroutine, Generator
from typing import Any, Callable, Optional, Sequence, Union

import attrs
from twisted.internet import defer, task
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from zope.interface import classImplements

from mdp import handlers, tracing, transport
from mdp.errors import ProtocolError, TransportError
from mdp.handlers import reply_frames
from mdp.interfaces import IDealerChannels, IDealerReceiver, IWorker
from mdp.machine import Machine, action_type, machine_view
from mdp.majordomo import codec, extension, idempotence
from mdp.majordomo.client_machine import unreachable
from mdp.majordomo.codec import (
    RFC,
    W_FINAL,
    W_PARTIAL,
    W_REQUEST,
    WORKER_HEADER,
    Disconnect,
    Heartbeat,
    WorkerCancel,
    WorkerFinal,
    WorkerPartial,
    WorkerRequest,
    encode_worker,
)
from mdp.majordomo.idempotence import STAMP_MARKER
from mdp.messages import text as label
from mdp.policy import (
    JITTER,
    PIRATE,
    Backoff,
    EndpointRotation,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    cancel_call,
    default_reactor,
    whole_number,
)

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

Handler = Callable[[list[bytes]], Any]

#: how the broker's answer to a worker's ``mmi.extensions`` begins
_EXTENSIONS_ANSWER = [codec.CLIENT_HEADER, codec.C_FINAL, extension.MMI_EXTENSIONS]
#: bytes a reply's envelope adds, besides the client address
_REPLY_OVERHEAD = len(WORKER_HEADER) + 1


class WorkerState(enum.Enum):
    """Where a worker's connection to the broker stands (the module's table)."""

    STOPPED = "stopped"
    CONNECTING = "connecting"
    READY = "ready"
    BACKING_OFF = "backing off"


STOPPED, CONNECTING, READY, BACKING_OFF = WorkerState


@attrs.frozen
class Final:
    """Wraps the last item of a streaming handler: sent as the FINAL reply."""

    frames: Any


_action = functools.partial(action_type, __name__)
#: one request being served: its client, the generation of the pipe it came on, its
#: stamp's key, when it came, and its context (mdp.majordomo.extension) and deadline if it
#: had one; *givenUp* is set to why (``"cancelled"``, ``"deadline"``) once it is, and
#: *answered* once its FINAL went (what its handler started may outlive it)
_Job = _action("_Job", "client", "generation", "key", "startedAt", context=None, deadline=None,
               givenUp=None, answered=False)
SendToBroker = _action("SendToBroker", "frames")
OpenPipe = _action("OpenPipe", "endpoint")
ClosePipe = _action("ClosePipe")  # (what was sent on it goes first)
#: call :meth:`WorkerMachine.handleReopen` after *delay*, having left *endpoint*,
#: *silent* that long (``None``: DISCONNECT)
ReopenAfter = _action("ReopenAfter", "delay", "endpoint", "silent")
#: the session left *endpoint* (DISCONNECT sent) to try its first broker, *home*, again: call
#: :meth:`WorkerMachine.handleReopen` now
ReturnHome = _action("ReturnHome", "home", "endpoint")
#: answer *job*, reporting each part to :meth:`WorkerMachine.handleReply`
Serve = _action("Serve", "job", "body")
#: the broker cancelled the request in hand for *client*: give it up (its handler's Deferred)
GiveUp = _action("GiveUp", "client")
StoreReply = _action("StoreReply", "key", "frames")
Dropped = _action("Dropped", "reason")
Refused = _action("Refused", "status", "reason")  # a request answered with an error instead
Lost = _action("Lost", "endpoint", "why")
ConnectFailed = _action("ConnectFailed", "endpoint", "why")

Action = Any  # one of the above


def lapsed(job: _Job, now: float) -> bool:
    """*job*'s deadline passed by *now*, before its handler started: given up (504)."""
    if job.deadline is not None and now >= job.deadline:
        job.givenUp = "deadline"
        return True
    return False


def given_up_body(job: _Job) -> list[bytes]:
    """The error reply of a request given up: 499 (cancelled) or 504 (its deadline passed)."""
    if job.givenUp == "cancelled":
        return codec.error_body(extension.STATUS_CANCELLED, "cancelled by its caller")
    return codec.error_body(extension.STATUS_DEADLINE, "its deadline passed at the worker")


def _why(reason: object) -> str:
    value = getattr(reason, "value", reason)
    if value is None:
        return "no reason given"
    return str(value) or type(value).__name__


class WorkerMachine(Machine):
    """The worker's decisions (the module's table)."""

    def __init__(self, endpoints: list[str], service: bytes, *,
                 heartbeat: HeartbeatPolicy = HeartbeatPolicy(), backoff: Backoff = PIRATE,
                 dialect: str = codec.RFC, limits: Limits = Limits(), extensions: bool = True,
                 homeward: Optional[Backoff] = None, now: float = 0.0) -> None:
        super().__init__(now)
        self._rotation = EndpointRotation(endpoints)
        #: with a schedule, a session idle on another broker than its first goes back to the
        #: first after its delay (brokers side by side: spread again once a broker is back);
        #: each try that does not reach it makes the next wait longer
        self.homeward = homeward
        self.homeAt: Optional[float] = None  # when to go back (READY away from the first)
        self.homeTries = 0  # tries since the first broker last answered
        #: declare the request-context extension to each broker (RFC dialect only)
        self.extensions = extensions and dialect == RFC
        self.asked = False  # on this connection
        #: endpoints whose broker dropped us after we asked, how many times in a row
        self._unasked: dict[str, int] = {}
        self.service = service
        self.heartbeat = heartbeat
        self.backoff = backoff
        self.dialect = codec.check_dialect(dialect)
        self.limits = limits
        self.connectWhy: Optional[str] = None
        self.connectSaidAt = 0.0
        self.state = STOPPED
        self.liveness = Liveness(heartbeat, now)
        self.failures = 0
        self.refusals = 0
        self.current: Optional[bytes] = None  # client address being served
        self.answered = False  # the broker sent something since READY
        self.generation = 0

    @property
    def endpoints(self) -> list[str]:
        return self._rotation.endpoints

    @property
    def endpoint(self) -> str:
        return self._rotation.current

    @property
    def wakeEvery(self) -> float:
        return self.heartbeat.interval / 2

    def isCurrent(self, job: _Job) -> bool:
        """*job* may still be answered: its pipe lives and it is in hand."""
        return job.generation == self.generation and self.current == job.client

    def handleStart(self, now: float) -> list[Action]:
        self.now = now
        if self.state is STOPPED:
            self._open()
        return self._drain()

    def handleStop(self, now: float) -> list[Action]:
        self.now = now
        state, self.state = self.state, STOPPED
        if state is READY:
            self._send(codec.DISCONNECT)
        if state is READY or state is CONNECTING:
            self._outbox.append(ClosePipe())
            self.generation += 1
        return self._drain()

    def handleReopen(self, now: float) -> list[Action]:
        self.now = now
        if self.state is BACKING_OFF:
            self._open()
        return self._drain()

    def handlePipeUp(self, now: float) -> list[Action]:
        self.now = now
        self.connectWhy = None
        self.generation += 1
        self.state = READY
        self.current = None
        self.answered = False
        self.liveness.heard(now)
        self.homeAt = (None if self.homeward is None or self._rotation.index == 0
                       else now + self.homeward.delay(self.homeTries))
        # declares the extension to a broker that takes it (not again where asking cost
        # the connection: a broker that takes no client command from a worker)
        self.asked = self.extensions and self._unasked.get(self.endpoint, 0) < 2
        if self.asked:
            self._outbox.append(SendToBroker(list(extension.ASK_EXTENSIONS)))
        self._send(codec.Ready(self.service))
        return self._drain()

    def handleConnectFailed(self, error: object, now: float) -> list[Action]:
        self.now = now
        value = getattr(error, "value", error)
        why = (unreachable(value) if isinstance(value, BaseException) else None) or _why(value)
        if why != self.connectWhy or now - self.connectSaidAt >= self.heartbeat.expiry:
            self.connectWhy = why
            self.connectSaidAt = now
            self._outbox.append(ConnectFailed(self.endpoint, why))
        return self._drain()

    def handlePipeLost(self, now: float, why: object = None) -> list[Action]:
        self.now = now
        self._askedInVain()
        if self.state is READY:
            self._outbox.append(Lost(self.endpoint, _why(why)))
            self.state = CONNECTING
        self.current = None
        self.generation += 1
        return self._drain()

    def handleMessage(self, frames: list[bytes], now: float) -> list[Action]:
        self.now = now
        if self.state is STOPPED or self.state is BACKING_OFF:
            pass
        elif (len(frames) >= 5 and frames[0] == WORKER_HEADER and frames[1] == W_REQUEST
                and frames[3] == b"" and self.dialect == RFC):
            self._command(WorkerRequest, frames[2], frames[4:])
        elif frames[:3] == _EXTENSIONS_ANSWER:  # the broker heard the question (whatever it takes)
            self.liveness.heard(now)
            self.asked = False
            self._unasked.pop(self.endpoint, None)
        else:
            try:
                kind, client, body = codec.parse(codec.expect(frames, self.dialect, WORKER_HEADER))
            except ProtocolError as e:
                self._outbox.append(Dropped(f"invalid message: {e}"))
                return self._drain()
            self._command(kind, client, list(body))
        return self._drain()

    def handleReply(self, job: _Job, kind: type, frames: list[bytes], now: float,
                    store: bool = True) -> tuple[bool, list[Action]]:
        """A PARTIAL or FINAL for *job*: whether it went out as itself (not
        replaced by a 413), and the actions."""
        self.now = now
        sent = self._replyPart(job, kind, frames, store)
        outbox, self._outbox = self._outbox, []
        return sent, outbox

    def handleTick(self, now: float) -> list[Action]:
        """Detect a dead broker; send HEARTBEAT when due."""
        self.now = now
        state = self.state
        liveness = self.liveness
        if state is not CONNECTING and state is not READY:
            pass
        elif liveness.dead(now):
            if self.failures or len(self._rotation.endpoints) == 1:
                delay = self.backoff.delay(self.failures - (len(self._rotation.endpoints) > 1))
            else:
                delay = 0.0  # another broker to try: at once
            self.failures += 1
            self._reconnect(delay, liveness.silence(now))
        elif state is READY:
            if liveness.due(now, 0.75):
                self._send(codec.HEARTBEAT)
            if self._homeDue(now):
                self._returnHome()
        return self._drain()

    def _homeDue(self, now: float) -> bool:
        """Idle away from the first broker for as long as the homeward schedule says."""
        return self.homeAt is not None and now >= self.homeAt and self.current is None

    def _returnHome(self) -> None:
        self.homeTries, self.homeAt = self.homeTries + 1, None
        self._send(codec.DISCONNECT)
        left = self._leave()
        self._rotation.index = 0
        self._outbox.append(ReturnHome(self.endpoint, left))

    def handleBlocked(self, now: float) -> list[Action]:
        """A handler blocked us until *now*: the broker's silence is not held against it."""
        self.now = now
        if self.state is READY or self.state is CONNECTING:
            self.liveness.heard(now)
        return self._drain()

    def _askedInVain(self) -> None:
        """The connection ended before the broker said anything after we asked
        ``mmi.extensions``: after twice in a row, that broker is not asked again."""
        if self.asked and not self.answered and self.state is READY:
            self._unasked[self.endpoint] = self._unasked.get(self.endpoint, 0) + 1
        self.asked = False

    def _open(self) -> None:
        self.state = CONNECTING
        self.liveness.heard(self.now)
        self._outbox.append(OpenPipe(self.endpoint))

    def _reconnect(self, delay: float, silent: Optional[float] = None) -> None:
        left = self._leave()
        self._rotation.advance()
        self._outbox.append(ReopenAfter(delay, left, silent))

    def _leave(self) -> str:
        """Close the pipe, backing off until it is opened again; the endpoint left."""
        self.state = BACKING_OFF
        self.current = None
        self.generation += 1
        self._outbox.append(ClosePipe())
        return self.endpoint

    def _command(self, kind: type, client: bytes, body: list[bytes]) -> None:
        self.liveness.heard(self.now)
        self.failures = 0
        self.answered = True
        if kind is WorkerRequest or kind is Heartbeat:
            self.refusals = 0
            if self._rotation.index == 0:  # (home took it: a DISCONNECT is a failed try)
                self.homeTries = 0
            if kind is WorkerRequest:
                self._request(client, body)
        elif kind is WorkerCancel:
            if self.current == client:  # (else it crossed the reply: nothing to give up)
                self._outbox.append(GiveUp(client))
        elif kind is Disconnect:
            self._askedInVain()
            delay = self.backoff.delay(self.refusals - 1) if self.refusals else 0.0
            self.refusals += 1
            self._reconnect(delay)
        else:
            self._outbox.append(Dropped(f"unexpected {kind.__name__}"))

    def _request(self, client: bytes, body: list[bytes]) -> None:
        if self.current is not None:
            self._outbox.append(Dropped("a REQUEST while busy"))
            return
        key = context = deadline = None
        try:
            if extension.has_context(body):
                context, body = extension.split_context(body)
                if context.deadline is not None:
                    deadline = self.now + context.deadline / 1000
            if body and body[0] == STAMP_MARKER:
                key, body = idempotence.unstamp(body)
        except (ValueError, ProtocolError) as e:
            what = "stamp" if isinstance(e, ValueError) else "context"
            self._outbox.append(Refused(codec.STATUS_BAD_REQUEST, f"malformed {what}: {e}"))
            self.current = client
            self._replyPart(_Job(client, self.generation, None, self.now), WorkerFinal,
                            codec.error_body(codec.STATUS_BAD_REQUEST,
                                             f"malformed request {what}: {e}"), False)
            return
        self.current = client
        self._outbox.append(Serve(_Job(client, self.generation, key, self.now, context, deadline),
                                  body))

    def _replyPart(self, job: _Job, kind: type, frames: list[bytes], store: bool) -> bool:
        """Send a reply part if *job* is in hand (a 413 instead if too large); a FINAL
        is stored either way."""
        current = (job.generation == self.generation and self.state is READY
                   and self.current == job.client)
        tooLarge = None
        if current:
            size = sum(map(len, frames)) + _REPLY_OVERHEAD + len(job.client)
            limits = self.limits
            if size > limits.maxMessageBytes or len(frames) + 5 > limits.maxFrames:
                tooLarge = limits.oversize(size, len(frames) + 5)
                self._outbox.append(Refused(codec.STATUS_TOO_LARGE,
                                            f"its {kind.__name__} is too large ({tooLarge})"))
                kind, store = WorkerFinal, False
                frames = codec.error_body(codec.STATUS_TOO_LARGE,
                                          f"reply too large to send: {tooLarge}")
        final = kind is WorkerFinal
        if final:
            job.answered = True
            if store and job.key is not None:
                self._outbox.append(StoreReply(job.key, frames))
        if not current:
            return False
        self._outbox.append(SendToBroker(encode_worker(
            W_FINAL if final else W_PARTIAL, job.client, frames, self.dialect)))
        self.liveness.sent(self.now)
        if final:
            self.current = None
            if self._homeDue(self.now):  # (busy at the ticks)
                self._returnHome()
        return tooLarge is None

    def _send(self, command: Any) -> None:
        self._outbox.append(SendToBroker(codec.encode(command, self.dialect)))
        self.liveness.sent(self.now)


class WorkerDriver:
    """What :class:`Worker` and :class:`mdp.blocking.Worker` share; *clock* has ``seconds()``."""

    #: the level of the READY line (a process of many workers lowers it)
    readyLogLevel = LogLevel.info

    def __init__(self, endpoint: Union[str, Sequence[str]], service: Union[str, bytes],
                 handler: Handler, clock: Any, *, curveServerPublic: Optional[str],
                 curveSecret: Optional[str], **options: Any) -> None:
        endpoints = transport.endpoint_list(endpoint)
        if not callable(handler):
            raise TypeError(f"a handler is a callable taking the request body, "
                            f"not {type(handler).__name__}: {handler!r}")
        self.handler = handler
        self.curve = transport.curve_client_for(endpoints, curveServerPublic, curveSecret)
        self.machine = WorkerMachine(endpoints, codec.api_service_name(service),
                                     now=clock.seconds(), **options)
        self.throttle = LogThrottle(clock)
        self.requestsServed = 0
        self.replies: Optional[idempotence.IReplyStore] = None
        self.transport: Any = None  # the pipe to the broker

    concurrency = property(lambda self: len(self.sessions),
                           doc="How many requests this worker serves at once (its sessions).")
    busy = property(lambda self: sum(session.machine.current is not None for session in self.sessions),
                    doc="How many of its sessions are serving a request.")
    service = machine_view("service", "The service name, as sent.")
    endpoints = machine_view("endpoints", "The broker endpoints, in failover order.")
    endpoint = machine_view("endpoint", "The broker endpoint in use (or next to be tried).")
    state = machine_view("state", "Where the connection stands (:class:`WorkerState`).")
    connected = property(lambda self: self.machine.state is READY,
                         doc="The pipe is up and READY went out on it.")
    started = property(lambda self: self.machine.state is not STOPPED,
                       doc="Started and not stopped since.")
    registered = property(lambda self: self.machine.state is READY and self.machine.answered,
                          doc="READY went out and the broker has answered since (a ZeroMQ "
                          "pipe is up whether or not anyone listens).")
    current = machine_view("current", "The address of the client being served, if one is.")
    generation = machine_view("generation", "Bumped on every new or lost pipe.")

    def _act(self, action: Action) -> Any:
        """What both drivers do alike; a pipe's closing, if any."""
        kind = type(action)
        if kind is StoreReply:
            if self.replies is not None:
                defer.maybeDeferred(self.replies.put, action.key, action.frames).addErrback(
                    _storeFailed)
            return None
        if kind is GiveUp:
            self._giveUpHeld(action.client)
            return None
        service = label(self.machine.service)
        if kind is OpenPipe:
            try:
                self._open(action.endpoint)
            except TransportError as error:  # no socket to be had (out of descriptors): as a pipe never up
                log.error("worker for {service} cannot open a connection to {endpoint}: {error}; "
                          "it reconnects, with its backoff, once {expiry:g}s pass without a broker",
                          service=service, endpoint=action.endpoint, error=error,
                          expiry=self.machine.heartbeat.expiry)
        elif kind is ClosePipe:
            pipe, self.transport = self.transport, None
            if pipe is not None:
                return pipe.close()
        elif kind is ReopenAfter or kind is ReturnHome:
            self._reopening(action, service)
        else:
            self._report(kind, action, service)
        return None

    def _reopening(self, action: Action, service: str) -> None:
        """Say why the pipe is opened again (ReopenAfter, ReturnHome), and open it when due."""
        if type(action) is ReturnHome:
            log.emit(self.readyLogLevel, "worker for {service} leaves {endpoint} to go back to "
                     "{home}, its first broker", service=service, endpoint=action.endpoint,
                     home=action.home)
            self._reopenAfter(0.0)
            return
        if action.silent is None:
            log.info("worker for {service} got DISCONNECT; registering again in {delay:g}s",
                     service=service, delay=action.delay)
        else:
            log.warn("broker {endpoint} silent for {silence:.1f}s; worker for {service} "
                     "reconnects in {delay:g}s", endpoint=action.endpoint,
                     silence=action.silent, service=service, delay=action.delay)
        self._reopenAfter(action.delay)

    def _report(self, kind: type, action: Action, service: str) -> None:
        """Log what the machine reports (throttled where the broker could flood it)."""
        if kind is Dropped:
            self.throttle.warn(log, "dropped", "worker for {service} dropped a message from the "
                               "broker: {reason}", service=service, reason=action.reason)
        elif kind is Refused:
            self.throttle.warn(log, "refused", "worker for {service} answers {status}: {reason}",
                               service=service, status=action.status.decode(),
                               reason=action.reason)
        elif kind is Lost:
            log.info("worker for {service} lost {endpoint} ({why}); reconnecting",
                     service=service, endpoint=action.endpoint, why=action.why)
        else:
            log.warn("worker for {service} cannot connect to {endpoint}: {error}; trying again",
                     service=service, endpoint=action.endpoint, error=action.why)

    # the pipe's events, as the blocking pipes report them (*tag*: unused)
    def _pipeUp(self, tag: Any, now: float) -> None:
        self._perform(self.machine.handlePipeUp(now))
        log.emit(self.readyLogLevel, "worker for {service} sent READY to {endpoint}",
                 service=label(self.machine.service), endpoint=self.machine.endpoint)

    def _pipeLost(self, tag: Any, why: object, now: float) -> None:
        self._perform(self.machine.handlePipeLost(now, why))

    def _pipeFailed(self, tag: Any, error: object, now: float) -> None:
        self._perform(self.machine.handleConnectFailed(error, now))


#: How a worker given several brokers attaches: to one at a time, the others a failover list
#: (``"one"``), or to all of them side by side, its sessions spread over them (``"all"``).
ATTACH_MODES = ("one", "all")


#: When a session attached to all brokers, idle on another than its own, tries its own again
#: (its own back after a restart: the sessions spread evenly again); each try that does not
#: reach it doubles the wait, up to 5 minutes.
HOMEWARD = Backoff(initial=30.0, maximum=300.0, jitter=JITTER)


def check_attach(attach: str, concurrency: int, brokers: int) -> None:
    """``ValueError`` unless *attach* is a mode of :data:`ATTACH_MODES` that *concurrency*
    sessions can keep over *brokers* brokers (attached to all: a session each at least)."""
    if attach not in ATTACH_MODES:
        raise ValueError(f"attach must be one of {', '.join(ATTACH_MODES)}, not {attach!r}")
    if attach == "all" and concurrency < brokers:
        raise ValueError(f"attach='all' to {brokers} brokers needs a concurrency of at least "
                         f"{brokers} (a session for each), not {concurrency}")


def spread_over(endpoints: Sequence[str], session: int) -> list[str]:
    """The failover list of worker session *session* attached to all of *endpoints*: each
    session starts at its own broker, in turn; the sessions of one broker list the others in
    turn too, so when it goes they spread over the rest."""
    first = session % len(endpoints)
    others = [*endpoints[first + 1:], *endpoints[:first]]
    shift = (session // len(endpoints)) % max(len(others), 1)
    return [endpoints[first], *others[shift:], *others[:shift]]


class Worker(WorkerDriver):
    """An MDP/0.2 worker for one *service* over a real transport, one broker at a time
    (docs/mdp.md); with *concurrency* N, N worker sessions (this one first, in :attr:`sessions`).
    With ``attach="all"`` and several brokers, the sessions are spread over the brokers side by
    side (:func:`spread_over`): never more than N requests in hand over all of them; a session
    that moved to another broker goes back to its own, once idle, on the *homeward* schedule."""

    def __init__(self, endpoint: Union[str, Sequence[str]], service: Union[str, bytes],
                 handler: Handler, reactor: Optional[Any] = None, *,
                 heartbeat: HeartbeatPolicy = HeartbeatPolicy(), backoff: Backoff = PIRATE,
                 dialect: str = codec.RFC, replies: Optional[idempotence.IReplyStore] = None,
                 limits: Limits = Limits(), metrics: Optional[Any] = None,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None,
                 concurrency: int = 1, extensions: bool = True, attach: str = "one",
                 homeward: Backoff = HOMEWARD) -> None:
        whole_number("concurrency", concurrency)
        endpoints = transport.endpoint_list(endpoint)
        check_attach(attach, concurrency, len(endpoints))
        reactor = default_reactor(reactor)
        options = dict(heartbeat=heartbeat, backoff=backoff, dialect=dialect, limits=limits,
                       curveServerPublic=curveServerPublic, curveSecret=curveSecret,
                       extensions=extensions)
        home = homeward if attach == "all" and len(endpoints) > 1 else None
        super().__init__(endpoint, service, handler, reactor, homeward=home, **options)
        self.reactor = reactor
        self.replies = replies
        self.streamPauses = 0  # times a stream waited for the queue to drain
        #: the request in hand that may be given up, with the Deferred of its handler
        self.held: Optional[tuple[_Job, defer.Deferred[Any]]] = None
        self._lapseCall: Any = None  # gives it up at its deadline
        self._reconnectCall: Any = None
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = reactor
        self._lastTick: Optional[float] = None
        #: when the last handler's block of the reactor ended (logged once)
        self._handlerBlockEnded = -1.0
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)
        #: each broker endpoint's shared connection (None: one session, its own pipe)
        self.links: Optional[dict[str, IDealerChannels]] = None
        #: the worker sessions of this process, this one first
        self.sessions: list[Worker] = [self]
        #: the first session: it alone logs and counts a blocked reactor
        self.owner = self
        if concurrency > 1:
            self.links = {}
            for index in range(1, concurrency):
                failover = spread_over(endpoints, index) if attach == "all" else endpoint
                session = Worker(failover, service, handler, reactor, replies=replies,
                                 metrics=metrics, **options)
                session.links, session.owner = self.links, self
                session.machine.homeward = home
                session.readyLogLevel = LogLevel.debug
                self.sessions.append(session)

    def start(self) -> None:
        """Connect to the broker; READY is sent once the pipe is up (each session's)."""
        for session in self.sessions:
            if session.machine.state is STOPPED:
                session._perform(session.machine.handleStart(self.reactor.seconds()))
                session._ticker.start(session.machine.wakeEvery, now=False)

    def stop(self) -> defer.Deferred[None]:
        """Say DISCONNECT to the broker (if registered) and close (every
        session; one of another's sessions: that one alone)."""
        if self.links is None or self.owner is not self:
            return self._stop()
        links = self.links
        stopping = [session._stop() for session in self.sessions]

        def stopped(_: object) -> defer.Deferred[None]:
            shared = list(links.values())
            links.clear()
            return transport.close_all(shared, "a worker's broker connection")

        return defer.gatherResults(stopping, consumeErrors=True).addBoth(stopped)

    def _stop(self) -> defer.Deferred[None]:
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
        wakeEvery = self.machine.wakeEvery
        if last is not None and now - last > wakeEvery + self.machine.heartbeat.interval:
            # not a handler's (already logged), and once for all the sessions
            if self.owner is self and self._handlerBlockEnded < last:
                self._reactorBlocked("the reactor was blocked for {blocked:.1f} s (worker for "
                                     "{service}): the broker's silence meanwhile is not held "
                                     "against it", now - last - wakeEvery)
            self._perform(self.machine.handleBlocked(now))
        self._perform(self.machine.handleTick(now))

    def _reactorBlocked(self, message: str, blocked: float) -> None:
        self.throttle.warn(log, "blocked", message, blocked=blocked, service=label(self.service))
        if self.metrics is not None:
            self.metrics.blockedReactor(self.service)

    def _perform(self, actions: list[Action]) -> Optional[defer.Deferred[None]]:
        """Do what the machine asked, in order; returns a pipe's closing, if any."""
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

    def _reopenAfter(self, delay: float) -> None:
        cancel_call(self._reconnectCall)
        self._reconnectCall = self.reactor.callLater(delay, self._reopen)
        if self.metrics is not None:
            self.metrics.reconnected(self.service)

    def _open(self, endpoint: str) -> None:
        options = dict(retryPolicy=self.machine.backoff.retryPolicy(), limits=self.machine.limits,
                       security=transport.curve_for(endpoint, self.curve))
        if self.links is None:
            self.transport = transport.connect(endpoint, self, self.reactor, **options)
            return
        link = self.links.get(endpoint)
        if link is None:
            link = self.links[endpoint] = transport.connect_channels(
                endpoint, self.reactor, relayProbe=codec.RELAY_PROBE, **options)
        self.transport = link.open(self)

    def connectionMade(self) -> None:
        self._pipeUp(None, self.reactor.seconds())

    def connectionLost(self, reason: object) -> None:
        self._pipeLost(None, reason, self.reactor.seconds())

    def connectionFailed(self, reason: object) -> None:
        self._pipeFailed(None, reason, self.reactor.seconds())

    def messageReceived(self, frames: list[bytes]) -> None:
        self._perform(self.machine.handleMessage(frames, self.reactor.seconds()))

    def _serve(self, job: _Job, body: list[bytes]) -> None:
        if self.metrics is not None:
            self.metrics.request(self.service)
        if job.key is None or self.replies is None:
            self._run(job, body)
            return

        def lookedUp(stored: Union[None, list[bytes], Failure]) -> None:
            if isinstance(stored, Failure):
                log.failure("reply store lookup failed; running the request", stored)
                stored = None
            if stored is None:
                self._run(job, body)
            else:
                self._reply(job, WorkerFinal, list(stored), store=False)

        defer.maybeDeferred(self.replies.get, job.key).addBoth(lookedUp)

    def _run(self, job: _Job, body: list[bytes]) -> None:
        if job.context is None:
            self._handle(job, body)
            return
        clock = self.reactor.seconds
        if lapsed(job, clock()):  # (it waited on the reply store)
            self._givenUp(job)
            return
        token = handlers.serving(job, clock)  # (current_deadline(), cancelled())
        span, spanToken = tracing.start_handler_span(self.machine.service, handlers.serving_trace())
        try:
            self._handle(job, body)
        finally:
            if span is not None:
                tracing.detach(spanToken)
            handlers._serving.reset(token)
        if span is not None:  # ended with the request (in hand: when its handler is done)
            held = self.held
            if held is not None and held[0] is job:
                held[1].addBoth(tracing.ended, span)
            else:
                tracing.end_span(span)

    def _hold(self, job: _Job, running: defer.Deferred[Any]) -> None:
        """*running* serves *job*, which came with a context: given up on CANCEL, or at its deadline."""
        if running.called and not running.paused:  # (answered; paused: it waits on another)
            return
        self.held = (job, running)
        if job.deadline is not None:
            self._lapseCall = self.reactor.callLater(max(0.0, job.deadline - self.reactor.seconds()),
                                                     self._giveUp, job, "deadline")
        running.addBoth(self._released, job)

    def _released(self, result: Any, job: _Job) -> Any:
        if self.held is not None and self.held[0] is job:
            self.held = None
            self._lapseCall = cancel_call(self._lapseCall)
        return result

    def _giveUpHeld(self, client: bytes) -> None:
        """The broker cancelled the request in hand for *client*."""
        held = self.held
        if held is not None and held[0].client == client:
            self._giveUp(held[0], "cancelled")

    def _giveUp(self, job: _Job, why: str) -> None:
        """Give up *job* (``why``: cancelled, deadline): its handler's Deferred is cancelled."""
        if job.givenUp is None and self.held is not None and self.held[0] is job:
            job.givenUp = why
            self.held[1].cancel()

    def _givenUp(self, job: _Job) -> None:
        """Answer a request given up: 499 (cancelled) or 504 (its deadline passed)."""
        self._reply(job, WorkerFinal, given_up_body(job), store=False, failure=job.givenUp)

    def _handle(self, job: _Job, body: list[bytes]) -> None:
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
        if kind is list or kind is bytes:
            self._finish(result, job)
            return
        if isinstance(result, Coroutine):
            result = defer.ensureDeferred(result)
        if isinstance(result, defer.Deferred):
            result.addCallbacks(self._finish, self._failed, (job,), None, (job,))
        elif isinstance(result, (AsyncGenerator, Generator)):
            result = defer.ensureDeferred(self._stream(result, job)).addErrback(self._failed, job)
        else:
            self._finish(result, job)
            return
        if job.context is not None:
            self._hold(job, result)

    def _checkBlocked(self, blocked: float) -> None:
        """Log a handler that kept the reactor over a heartbeat interval; the
        broker's silence meanwhile is not held against it."""
        if blocked < self.machine.heartbeat.interval:
            return
        now = self.owner._handlerBlockEnded = self.reactor.seconds()
        self._reactorBlocked("handler for {service} blocked the reactor for {blocked:.1f} s; "
                             "run blocking work with deferToThread", blocked)
        self._perform(self.machine.handleBlocked(now))

    async def _stream(self, parts: Any, job: _Job) -> None:
        """Send what a streaming handler yields as PARTIALs, until a :class:`Final`
        or the request is void; paused while the transport is not writable.  Given up
        (cancelled), the generator is closed."""
        try:
            await self._streamParts(parts, job)
        except defer.CancelledError:
            if isinstance(parts, Generator):
                parts.close()
            else:
                await parts.aclose()
            raise

    async def _streamParts(self, parts: Any, job: _Job) -> None:
        sync = isinstance(parts, Generator)
        while True:
            try:
                item = next(parts) if sync else await parts.__anext__()
            except (StopIteration, StopAsyncIteration):
                self._finish(None, job)
                return
            final = isinstance(item, Final)
            if final or not self._reply(job, WorkerPartial, reply_frames(item)):
                if sync:
                    parts.close()
                else:
                    await parts.aclose()
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
        except Exception:  # the request gets its answer (500)
            self._failed(Failure(), job)
            return
        if self._reply(job, WorkerFinal, frames):
            self.requestsServed += 1

    def _failed(self, failure: Failure, job: _Job) -> None:
        if job.givenUp is not None and failure.check(defer.CancelledError):
            self._givenUp(job)
            return
        log.failure("handler for {service} failed", failure, service=label(self.service))
        message = f"{failure.type.__name__}: {failure.getErrorMessage()}"
        self._reply(job, WorkerFinal, codec.error_body(codec.STATUS_WORKER_ERROR, message),
                    failure="error")

    def _reply(self, job: _Job, kind: type, frames: list[bytes], store: bool = True,
               failure: Optional[str] = None) -> bool:
        """Hand a reply part to the machine; True if it went out as itself."""
        metrics = self.metrics
        current = metrics is not None and self.machine.isCurrent(job)
        now = self.reactor.seconds()
        sent, actions = self.machine.handleReply(job, kind, frames, now, store)
        self._perform(actions)
        if current and (kind is WorkerFinal or not sent):
            metrics.replied(self.service, now - job.startedAt, failure if sent else "too-large")
        return sent


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Worker, IWorker, IDealerReceiver)


def _storeFailed(failure: Failure) -> None:
    log.failure("reply store could not keep a reply", failure)
