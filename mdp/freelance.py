"""Brokerless reliable request-reply: the Guide's Freelance pattern, models 1-3.

Wire protocol (as the Guide's model 3):

* a client sends ``[b"PING"]``, a server answers ``[b"PONG"]``;
* a client sends ``[sequence, body...]``, a server answers
  ``[sequence, reply...]``; a handler error is answered with
  ``[sequence, b"\x00MDP-ERROR", b"500", message]`` and raised as
  :class:`~mdp.errors.WorkerError` (the error body of MDP replies, so that
  both patterns raise the same errors for the same codes; this module has its
  own copy, as patterns do not import each other).

A server bounds what clients may cost it: its transport enforces the message
and per-peer output limits (:class:`~mdp.policy.Limits`; a client that does
not read its replies is disconnected), at most ``maxPending`` requests and
``maxPendingBytes`` of request bodies are being handled at once (beyond, a
request is answered at once with a 429 error, raised as
:class:`~mdp.errors.ServiceOverloaded`), and a reply over the message limits
is replaced by a 413 error (:class:`~mdp.errors.MessageTooLarge`).

Clients, all with ``request(*frames, timeout=None, deadline=None) ->
Deferred[list[bytes]]`` and ``close()``.  As in the MDP client, ``timeout``
is the seconds **one attempt** may take and ``deadline`` the seconds the
**whole request** may take (``None``: no bound beyond the attempts); both
are constructor arguments, and ``request()`` overrides either for one call.

:class:`SequentialClient` (model 1)
    tries each server in turn, each on a fresh connection with its own
    ``timeout`` (1 s); ``deadline`` (30 s) bounds the request in all.
:class:`ShotgunClient` (model 2)
    sends every request to all servers; the first reply wins, the rest are
    dropped; ``timeout`` (3 s) bounds the one round, which is the whole
    request (``deadline``: ``None``).
:class:`AgentClient` (model 3)
    one ROUTER-like connection to all servers; PING/PONG heartbeats
    (:class:`~mdp.policy.HeartbeatPolicy`, 1 s × 3) tell which are alive; each
    request goes to the first live server and, after ``timeout`` (1 s), to
    the next; ``deadline`` (3 s) bounds it in all.  A server that let an
    attempt time out gets no new requests until it answers again.  When every
    known server is known dead, requests fail at once with
    :class:`~mdp.errors.NoServerAvailable`.

Theory of operation
-------------------
Every node here is a state machine.  The clients' decisions live in
:class:`SequentialMachine`, :class:`ShotgunMachine` and :class:`AgentMachine`
(on :class:`FreelanceMachine`), which know no reactor, no transport and no
Deferred: ``handle*`` events with their time in (a server added, a request, a
reply, a timer, a tick, a cancel, close), actions out (:class:`Later`,
:class:`Cancel`, :class:`OpenPipe`, :class:`ClosePipe`, :class:`SendPipe`,
:class:`ConnectPeer`, :class:`SendPeer`, :class:`Resolve`, :class:`Reject`).
Each client class is its machine's driver: it owns the timers of each
request, the connections and the Deferreds.  :mod:`mdp.testing` drives the
drivers by a list of events, with no transport.  The states are :class:`RequestState` (every
client) and :class:`ServerState` (the agent's view of each server); the
tables below are what the code does.

A request, in every client::

    state         event                          action                          next
    (new)         request(), client closed       ClientClosed                    -
    (new)         request(), no server known     NoServerAvailable               -
    (new)         request() over the limits      RequestTooLarge (raised)        -
    WAITING/SENT  [sequence, reply...]           fire (an error reply: raise)    DONE
    WAITING/SENT  deadline timer                 RequestTimeout                  DONE
    WAITING/SENT  cancel() / close()             CancelledError / ClientClosed   DONE
    DONE          [sequence, reply...]           dropped                         DONE

Model 1 (:class:`SequentialClient`; leaving SENT closes the attempt's pipe)::

    (new)  request()                             pipe to the first server,       SENT
                                                 send, attempt timer
    SENT   attempt timer, a server left          close; pipe to the next, send   SENT
    SENT   attempt timer, every server tried     RequestTimeout                  DONE
    SENT   429, a server left                    close; pipe to the next, send   SENT
    SENT   429, every server tried               ServiceOverloaded               DONE

Model 2 (:class:`ShotgunClient`)::

    (new)  request()                             send on every server's pipe,    SENT
                                                 attempt timer (the round)
    SENT   attempt timer                         RequestTimeout                  DONE
    SENT   429 from each server                  ServiceOverloaded               DONE
                                                 (a 429 while another may answer:
                                                 dropped)

Model 3 (:class:`AgentClient`), each server::

    state                  event                        action                         next
    (new)                  connect(endpoint)            PING                           UNKNOWN
    any                    any message from it but 429  WAITING requests go out        ALIVE
    ALIVE                  a 429 (it is busy)           -                              SUSPECT
    ALIVE                  an attempt to it timed out   -                              SUSPECT
    UNKNOWN/ALIVE/SUSPECT  tick: silent > expiry        its SENT requests go elsewhere DEAD
    any                    tick (every interval)        PING                           same

and each request (only ALIVE servers get requests)::

    (new)    request(), every server DEAD   NoServerAvailable                      -
    (new)    request(), a server ALIVE      send to the first ALIVE, attempt timer SENT
    (new)    request(), none ALIVE          queue                                  WAITING
    WAITING  a server becomes ALIVE         send to it, attempt timer              SENT
    SENT     attempt timer, or its server   send to the next ALIVE server not      SENT
             becomes DEAD                   tried this round (all tried: the
                                            first ALIVE); none ALIVE: queue        WAITING
    SENT     429 from its server            send to the next ALIVE server not      SENT
                                            tried this round; none: raise          DONE
                                            ServiceOverloaded
    any      tick: every server DEAD        NoServerAvailable                      DONE

The server (:class:`FreelanceServer`) keeps no state per client, only what
it has in hand::

    [PING]                                  [PONG]
    [sequence, body...], room in hand       handler(body); its reply as
                                            [sequence, reply...] (a failure:
                                            500; a reply over the limits: 413)
    [sequence, body...], maxPending or      [sequence, 429 error] at once
    maxPendingBytes reached
    anything else                           dropped, the peer disconnected

No state machine here imports a transport implementation: they use
:func:`mdp.transport.listen`, :func:`~mdp.transport.connect` and
:func:`~mdp.transport.connect_peers`.  The one exception is
:meth:`FreelanceServer.streamFactory`, which hands the stream transport's
protocol factory to a caller who listens with a Twisted endpoint of their own.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import attrs
from twisted.internet import defer, task
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger
from zope.interface import implementer

from mdp import messages, transport
from mdp.errors import (
    ClientClosed,
    NoServerAvailable,
    RemoteError,
    RequestTimeout,
    RequestTooLarge,
    ServiceOverloaded,
    TransportError,
)
from mdp.handlers import call_handler
from mdp.interfaces import IDealerReceiver, IPeerRouterReceiver, IRouterReceiver
from mdp.machine import Machine, action_class
from mdp.messages import STATUS_OVERLOADED, STATUS_TOO_LARGE, STATUS_WORKER_ERROR, error_body
from mdp.policy import (
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PENDING_BYTES,
    EndpointRotation,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    cancel_call,
    default_reactor,
    held_bytes,
    positive_seconds,
)
from mdp.transport.curve import curve_client, curve_server

log = Logger()

PING = b"PING"
PONG = b"PONG"
SERVICE = b"freelance"  # what RequestTimeout names
Handler = Callable[[list[bytes]], Any]


class RequestState(enum.Enum):
    """Where a client's request is (see "Theory of operation")."""

    #: accepted, not sent: no server to send it to yet (model 3 only)
    WAITING = "waiting"
    #: an attempt is out (to ``call.server``, or to every server in model 2)
    #: and its timer runs
    SENT = "sent"
    #: answered, failed, timed out, cancelled or closed: forgotten; a late
    #: reply with its sequence number is dropped
    DONE = "done"


class ServerState(enum.Enum):
    """What the agent (model 3) believes of one server."""

    #: added, not heard from yet: PINGed, gets no requests
    UNKNOWN = "unknown"
    #: heard from within ``heartbeat.expiry``: gets requests
    ALIVE = "alive"
    #: let an attempt time out: no new requests until it speaks again
    SUSPECT = "suspect"
    #: silent for longer than ``heartbeat.expiry``: still PINGed, no requests
    DEAD = "dead"


# --- error replies: [sequence, *messages.error_body(code, message)] ------------------


def remote_error(body: Sequence[bytes]) -> Optional[RemoteError]:
    """The error a reply body stands for (a :class:`~mdp.errors.RemoteError`
    subclass by its code), or ``None`` for an ordinary reply."""
    return messages.remote_error(SERVICE, body)


# --- server --------------------------------------------------------------------

class FreelanceServer:
    """Answers PING with PONG and ``[sequence, body...]`` with ``[sequence,
    handler(body)...]``.  The handler is as a worker's (frames in; frames, a
    Deferred or a coroutine out).

    One server may listen on several endpoints; each bound transport gets its
    own :class:`~mdp.interfaces.IRouterReceiver` (a ``_Binding``) that hands
    its messages to :meth:`received` with the transport to answer on."""

    def __init__(self, handler: Handler, reactor: Optional[Any] = None, *, limits: Limits = Limits(),
                 maxPending: int = DEFAULT_MAX_PENDING,
                 maxPendingBytes: int = DEFAULT_MAX_PENDING_BYTES,
                 metrics: Optional[Any] = None, curveSecret: Optional[str] = None,
                 curveAllow: Optional[str] = None) -> None:
        self.handler = handler
        #: the key pair and allow-list of its zmq: endpoints (docs/security.md)
        self.curve = curve_server(curveSecret, curveAllow)
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.maxPending = maxPending
        self.maxPendingBytes = maxPendingBytes
        self.throttle = LogThrottle(self.reactor)
        self.transports: list[Any] = []
        self.served = 0
        self.refused = 0  # requests answered 429
        self.pending = 0  # requests being handled
        self.pendingBytes = 0
        #: a :class:`mdp.metrics.FreelanceMetrics` (or None)
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)

    def listen(self, endpoint: str) -> defer.Deferred:
        """Bind *endpoint*; fires with the transport (its ``endpoint`` is the
        string clients connect to).  A malformed endpoint raises
        :class:`~mdp.errors.TransportError` at once; a failure to bind fails
        the Deferred."""

        binding = _Binding(self)

        def bound(routerTransport: Any) -> Any:
            binding.transport = routerTransport
            self.transports.append(routerTransport)
            log.info("Freelance server listening on {endpoint}", endpoint=routerTransport.endpoint)
            return routerTransport

        security = transport.curve_listen_for(endpoint, self.curve)
        transport.warn_if_open(endpoint, security, "Freelance server")
        return transport.listen(endpoint, binding, self.reactor, limits=self.limits,
                                security=security).addCallback(bound)

    def streamFactory(self) -> IProtocolFactory:
        """This server as a plain Twisted :class:`IProtocolFactory` speaking
        the stream transports' framing, for listening with an endpoint, a TLS
        wrapper or an ``Application`` of one's own (``listen`` binds an
        endpoint string instead).  Clients reach it as ``tcp:host=H:port=P``
        (or ``unix:``, ``tls:``, ...).  The same limits apply; :meth:`close`
        drops its connections, stopping the listening port is the caller's.
        """
        from mdp.transport.stream import StreamRouter

        binding = _Binding(self)
        router = StreamRouter(binding, self.reactor, limits=self.limits)
        binding.transport = router
        self.transports.append(router)
        return router.factory()

    def close(self) -> defer.Deferred:
        """Close every transport: stop listening, drop every client."""
        transports, self.transports = self.transports, []
        return transport.close_all(transports, "a Freelance server listener")

    def received(self, routerTransport: Any, peer: bytes, frames: list[bytes]) -> None:
        """A message from *peer* on *routerTransport* (see the server's table
        in the module docstring)."""
        metrics = self.metrics
        if frames == [PING]:
            routerTransport.sendMessage(peer, [PONG])
            if metrics is not None:
                metrics.pings.inc()
            return
        if len(frames) < 2:
            if metrics is not None:
                metrics.rejected.inc()
            self.throttle.warn(log, "invalid", "Freelance server dropped a {count}-frame message "
                               "from {peer}, and its connection: neither PING nor "
                               "[sequence, body...]", count=len(frames), peer=peer.hex())
            routerTransport.disconnectPeer(peer)
            return
        sequence, body = frames[0], frames[1:]
        size = held_bytes(body)
        if metrics is not None:
            metrics.requests.inc()
        if self.pending >= self.maxPending or self.pendingBytes + size > self.maxPendingBytes:
            self.refused += 1
            if metrics is not None:
                metrics.refused.inc()
            self.throttle.warn(log, "overloaded", "Freelance server refused a request from {peer}: "
                               "{pending} requests ({bytes} bytes) already in hand",
                               peer=peer.hex(), pending=self.pending, bytes=self.pendingBytes)
            routerTransport.sendMessage(peer, [sequence, *error_body(
                STATUS_OVERLOADED, f"server busy: {self.pending} requests in hand")])
            return
        self.pending += 1
        self.pendingBytes += size
        started = self.reactor.seconds()
        outcome: list[str] = []

        def failed(failure: Any) -> list[bytes]:
            log.failure("Freelance handler failed", failure)
            outcome.append("error")
            return error_body(STATUS_WORKER_ERROR,
                                    f"{failure.type.__name__}: {failure.getErrorMessage()}")

        def reply(replyFrames: list[bytes]) -> None:
            self.pending -= 1
            self.pendingBytes -= size
            message = [sequence, *replyFrames]
            tooLarge = self.limits.refuse(message)
            if tooLarge is not None:
                self.throttle.warn(log, "too-large", "Freelance server answers 413: its reply is "
                                   "too large ({reason})", reason=tooLarge)
                message = [sequence, *error_body(STATUS_TOO_LARGE,
                                                 f"reply too large to send: {tooLarge}")]
                outcome.append("too-large")
            self.served += 1
            if metrics is not None:
                metrics.handlerSeconds.observe(self.reactor.seconds() - started)
                if outcome:  # one reason per request: what the client got
                    metrics.failures.labels(outcome[-1]).inc()
            routerTransport.sendMessage(peer, message)

        call_handler(self.handler, body).addErrback(failed).addCallback(reply)


@implementer(IRouterReceiver)
class _Binding:
    """The receiver of one bound transport of a :class:`FreelanceServer`."""

    def __init__(self, server: FreelanceServer) -> None:
        self.server = server
        self.transport: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        if self.transport is not None:
            self.server.received(self.transport, peer, frames)

    def peerDisconnected(self, peer: bytes) -> None:
        pass


# --- shared client plumbing ------------------------------------------------------

#: Defaults: seconds per attempt (``timeout``) and for the whole request
#: (``deadline``; ``None``: no bound beyond the attempts) of each model.
SEQUENTIAL_TIMEOUT, SEQUENTIAL_DEADLINE = 1.0, 30.0
SHOTGUN_TIMEOUT = 3.0
AGENT_TIMEOUT, AGENT_DEADLINE = 1.0, 3.0




class _Call:
    """One request: its attempts and where it is."""

    __slots__ = ("sequence", "body", "state", "startedAt", "timeout", "deadline",
                 "attempts", "tried", "server", "rotation", "refusals")

    def __init__(self, sequence: bytes, body: list[bytes], startedAt: float, timeout: float,
                 deadline: Optional[float]) -> None:
        self.sequence = sequence
        self.body = body
        self.startedAt = startedAt
        self.timeout = timeout  # seconds per attempt
        self.deadline = deadline  # seconds for the whole request, or None
        self.state = RequestState.WAITING  # until the model sends it
        self.attempts = 0
        self.tried: list[str] = []  # model 3: servers tried in this round
        self.server: Optional[str] = None  # where the current attempt went
        self.rotation: Optional[EndpointRotation] = None  # model 1: the servers it walks
        self.refusals: set[Any] = set()  # model 2: servers that answered 429 this round


# --- what a client machine asks its driver to do ----------------------------------------

DEADLINE, ATTEMPT = "deadline", "attempt"  # the two timers of a request


@action_class
class Later:
    """Call ``handleTimer(call, kind)`` after *delay* seconds (replacing that
    timer of *call* if it is pending)."""

    call: _Call
    kind: str
    delay: float


@action_class
class Cancel:
    """Forget that timer of *call*, if pending."""

    call: _Call
    kind: str


def _for_call() -> Any:
    """The field of a send (or of a pipe) made for one request: the driver
    skips it if that request is DONE by then (a caller's callback run by an
    earlier action of the same event cancelled it).  Not compared: actions
    are equal whoever they were made for."""
    return attrs.field(default=None, eq=False, repr=False)


@action_class
class OpenPipe:
    """Open a connection to *endpoint*, known as *key*; its messages come back
    through ``handleReply``."""

    key: Any
    endpoint: str
    #: the request it is opened for (model 1), or None
    call: Optional[_Call] = _for_call()


@action_class
class ClosePipe:
    key: Any


@action_class
class SendPipe:
    key: Any
    frames: list[bytes]
    #: the request sent
    call: Optional[_Call] = _for_call()


@action_class
class ConnectPeer:
    """Add *endpoint* to the connecting router (model 3)."""

    endpoint: str


@action_class
class SendPeer:
    """Send *frames* to the server at *endpoint* through the router (model 3)."""

    endpoint: str
    frames: list[bytes]
    #: the request sent, or None (a PING)
    call: Optional[_Call] = _for_call()


@action_class
class Resolve:
    """Fire the Deferred of *call* with *frames*."""

    call: _Call
    frames: list[bytes]


@action_class
class Reject:
    """Fail the Deferred of *call* with *error*."""

    call: _Call
    error: BaseException


@action_class
class ServerChanged:
    """The agent's view of the server at *endpoint* is now *state* (model 3)."""

    endpoint: str
    state: ServerState


Action = Any  # Later | Cancel | OpenPipe | ClosePipe | SendPipe | ConnectPeer | SendPeer | ...


class FreelanceMachine(Machine):
    """What the three models decide alike (sequence numbers, pending
    requests, the deadline, replies, close), with no reactor, no transport and
    no Deferred: ``handle*`` events with their time in, actions out.  The
    models add their own rules; each client class drives its machine."""

    def __init__(self, timeout: float, deadline: Optional[float], now: float = 0.0) -> None:
        super().__init__(now)
        self.timeout = positive_seconds("timeout", timeout)
        self.deadline = None if deadline is None else positive_seconds("deadline", deadline)
        self.endpoints: list[str] = []
        self.pending: dict[bytes, _Call] = {}
        self._sequence = itertools.count(1)
        #: new requests and servers are refused
        self.closed = False

    def refusal(self) -> Optional[Exception]:
        """Why a new request fails at once, if it does."""
        if self.closed:
            return ClientClosed("client is closed")
        if not self.endpoints:
            return NoServerAvailable("no Freelance server configured")
        return None

    def newCall(self, body: list[bytes], timeout: float, deadline: Optional[float]) -> _Call:
        """A request with the next sequence number, starting now."""
        return _Call(str(next(self._sequence)).encode(), body, self.now, timeout, deadline)

    # --- events ------------------------------------------------------------------

    def handleConnect(self, endpoint: str, now: float) -> list[Action]:
        """A server to use (already checked)."""
        self.now = now
        if endpoint not in self.endpoints:
            self.endpoints.append(endpoint)
        self._connected(endpoint)
        return self._drain()

    def handleRequest(self, call: _Call, now: float) -> list[Action]:
        """Start *call* (made by :meth:`newCall`; :meth:`refusal` said yes)."""
        self.now = call.startedAt = now
        self.pending[call.sequence] = call
        if call.deadline is not None:
            self._outbox.append(Later(call, DEADLINE, call.deadline))
        self._start(call)
        return self._drain()

    def handleReply(self, frames: list[bytes], now: float,
                    endpoint: Optional[str] = None) -> list[Action]:
        """A ``[sequence, reply...]`` arrived (from the server at *endpoint*,
        where the driver knows it); stale or unknown ones are dropped."""
        self.now = now
        self._reply(frames, endpoint)
        return self._drain()

    def handleTimer(self, call: _Call, kind: str, now: float) -> list[Action]:
        self.now = now
        if call.state is not RequestState.DONE:
            if kind == DEADLINE:
                self._expired(call)
            else:
                self._attemptOver(call)
        return self._drain()

    def handleCancel(self, call: _Call, now: float) -> list[Action]:
        """The caller cancelled *call*: forget it (a late reply is dropped)."""
        self.now = now
        self._finish(call)
        return self._drain()

    def handleClose(self, now: float) -> list[Action]:
        """Fail every pending request with ClientClosed."""
        self.now = now
        self.closed = True
        for call in list(self.pending.values()):
            self._fail(call, ClientClosed("client closed"))
        return self._drain()

    # --- decisions -----------------------------------------------------------------

    def _connected(self, endpoint: str) -> None:
        """A model's own work for a new server."""

    def _start(self, call: _Call) -> None:
        raise NotImplementedError

    def _attemptOver(self, call: _Call) -> None:
        raise NotImplementedError

    def _finish(self, call: _Call) -> bool:
        """*call* is DONE: forget it; False if it already was."""
        if call.state is RequestState.DONE:
            return False
        call.state = RequestState.DONE
        del self.pending[call.sequence]
        self._outbox.append(Cancel(call, DEADLINE))
        self._outbox.append(Cancel(call, ATTEMPT))
        return True

    def _expired(self, call: _Call) -> None:
        """The deadline, or the last attempt, ran out."""
        self._fail(call, RequestTimeout(SERVICE, call.attempts, self.now - call.startedAt))

    def _fail(self, call: _Call, error: Exception) -> None:
        if self._finish(call):
            self._outbox.append(Reject(call, error))

    def _reply(self, frames: list[bytes], endpoint: Optional[str] = None) -> bool:
        """A reply; True if it was a 429 for a pending request (the server
        is busy: nothing ran there, and another may serve it)."""
        if len(frames) < 2:
            return False
        call = self.pending.get(frames[0])  # DONE requests are not pending
        if call is None or call.state is RequestState.DONE:
            return False
        body = frames[1:]
        error = remote_error(body)
        if isinstance(error, ServiceOverloaded):
            self._overloaded(call, error, endpoint)
            return True
        if self._finish(call):
            self._outbox.append(Resolve(call, body) if error is None else Reject(call, error))
        return False

    def _overloaded(self, call: _Call, error: ServiceOverloaded,
                    endpoint: Optional[str]) -> None:
        """A server answered *call* 429 (nothing ran): a model tries another
        server where it has one; this is the answer where not."""
        self._fail(call, error)


class SequentialMachine(FreelanceMachine):
    """Model 1's rules: each server in turn, each attempt on a fresh pipe."""

    def __init__(self, timeout: float, deadline: Optional[float], now: float = 0.0) -> None:
        super().__init__(timeout, deadline, now)
        self.attempts: dict[bytes, str] = {}  # the open pipe of each request, by sequence

    def _start(self, call: _Call) -> None:
        call.rotation = EndpointRotation(self.endpoints)
        self._next(call)

    def _attemptOver(self, call: _Call) -> None:
        self._next(call)

    def _overloaded(self, call: _Call, error: ServiceOverloaded,
                    endpoint: Optional[str]) -> None:
        rotation = call.rotation
        if rotation is not None and call.attempts < len(rotation):
            self._next(call)  # the next server, at once
        else:
            self._fail(call, error)

    def _next(self, call: _Call) -> None:
        self._drop(call)
        rotation = call.rotation
        assert rotation is not None
        if call.attempts >= len(rotation):
            self._expired(call)
            return
        endpoint = rotation.current if call.attempts == 0 else rotation.advance()
        call.attempts += 1
        call.server = endpoint
        call.state = RequestState.SENT
        self.attempts[call.sequence] = endpoint
        self._outbox.append(OpenPipe(call.sequence, endpoint, call))
        self._outbox.append(SendPipe(call.sequence, [call.sequence, *call.body], call))
        self._outbox.append(Later(call, ATTEMPT, call.timeout))

    def _drop(self, call: _Call) -> None:
        if self.attempts.pop(call.sequence, None) is not None:
            self._outbox.append(ClosePipe(call.sequence))

    def _finish(self, call: _Call) -> bool:
        finished = super()._finish(call)
        self._drop(call)
        return finished


class ShotgunMachine(FreelanceMachine):
    """Model 2's rules: one pipe per server, every request to all."""

    def __init__(self, timeout: float, deadline: Optional[float], now: float = 0.0) -> None:
        super().__init__(timeout, deadline, now)
        self.linked: list[str] = []  # servers with a pipe open

    def _connected(self, endpoint: str) -> None:
        if endpoint not in self.linked:
            self.linked.append(endpoint)
            self._outbox.append(OpenPipe(endpoint, endpoint))

    def _start(self, call: _Call) -> None:
        call.attempts = len(self.linked)
        call.refusals = set()
        call.state = RequestState.SENT
        for endpoint in self.linked:
            self._outbox.append(SendPipe(endpoint, [call.sequence, *call.body], call))
        self._outbox.append(Later(call, ATTEMPT, call.timeout))

    def _attemptOver(self, call: _Call) -> None:
        self._expired(call)

    def _overloaded(self, call: _Call, error: ServiceOverloaded,
                    endpoint: Optional[str]) -> None:
        # the answer only once every server said so: counted by server, so
        # that one server's 429 sent twice does not speak for another (a
        # reply of unknown origin counts on its own)
        call.refusals.add(object() if endpoint is None else endpoint)
        if len(call.refusals) >= call.attempts:
            self._fail(call, error)

    def handleClose(self, now: float) -> list[Action]:
        actions = super().handleClose(now)
        linked, self.linked = self.linked, []
        return actions + [ClosePipe(endpoint) for endpoint in linked]


class KnownServer:
    """What the agent knows of one server: its :class:`ServerState` and when
    it was last heard from (since it was added, if never)."""

    __slots__ = ("endpoint", "state", "liveness")

    def __init__(self, endpoint: str, liveness: Liveness) -> None:
        self.endpoint = endpoint
        self.state = ServerState.UNKNOWN
        self.liveness = liveness


class AgentMachine(FreelanceMachine):
    """Model 3's rules (the server table of the module docstring): PING every
    ``heartbeat.interval`` (:meth:`handleTick`, every ``wakeEvery`` seconds),
    requests only to ALIVE servers."""

    def __init__(self, heartbeat: HeartbeatPolicy, timeout: float, deadline: Optional[float],
                 now: float = 0.0) -> None:
        if not isinstance(heartbeat, HeartbeatPolicy):
            raise TypeError(f"heartbeat is a HeartbeatPolicy, not {type(heartbeat).__name__}")
        super().__init__(timeout, deadline, now)
        self.heartbeat = heartbeat
        self.servers: OrderedDict[str, KnownServer] = OrderedDict()
        self.waiting: list[_Call] = []  # WAITING requests, oldest first

    @property
    def wakeEvery(self) -> float:
        return self.heartbeat.interval

    def live(self) -> list[str]:
        """The endpoints of the ALIVE servers, in the order they were added."""
        return [s.endpoint for s in self.servers.values() if s.state is ServerState.ALIVE]

    def _allDead(self) -> bool:
        return bool(self.servers) and all(s.state is ServerState.DEAD
                                          for s in self.servers.values())

    def refusal(self) -> Optional[Exception]:
        if not self.closed and self._allDead():
            return NoServerAvailable(
                f"all {len(self.servers)} Freelance servers are dead: {', '.join(self.servers)}")
        return super().refusal()

    # --- events
    def handleMessage(self, endpoint: str, frames: list[bytes], now: float) -> list[Action]:
        """A PONG or a reply from the server at *endpoint*: it is ALIVE."""
        self.now = now
        server = self.servers.get(endpoint)
        if server is not None:
            server.liveness.heard(now)
            # the reply first: the request it answers is no longer waiting
            # when the server's coming back sends what waits
            if frames == [PONG] or not self._reply(frames, endpoint):
                self._becomes(server, ServerState.ALIVE)
        return self._drain()

    def handleTick(self, now: float) -> list[Action]:
        """Every ``heartbeat.interval``: servers silent for longer than
        ``heartbeat.expiry`` become DEAD; PING every server; if every one is
        DEAD, fail what is pending with NoServerAvailable."""
        self.now = now
        for server in list(self.servers.values()):
            if server.state is not ServerState.DEAD and server.liveness.dead(now):
                self._becomes(server, ServerState.DEAD)
            self._ping(server)
        if self._allDead():
            for call in list(self.pending.values()):
                self._fail(call, NoServerAvailable("every Freelance server is dead"))
        return self._drain()

    # --- decisions
    def _connected(self, endpoint: str) -> None:
        if endpoint not in self.servers:
            server = self.servers[endpoint] = KnownServer(endpoint,
                                                          Liveness(self.heartbeat, self.now))
            self._outbox.append(ConnectPeer(endpoint))
            self._ping(server)

    def _ping(self, server: KnownServer) -> None:
        self._outbox.append(SendPeer(server.endpoint, [PING]))
        server.liveness.sent(self.now)

    def _becomes(self, server: KnownServer, state: ServerState) -> None:
        """Move *server* to *state* and do what that entails."""
        if server.state is state:
            return
        server.state = state
        self._emit(ServerChanged(server.endpoint, state))
        if state is ServerState.ALIVE:
            waiting, self.waiting = self.waiting, []
            for call in waiting:
                self._send(call)
        elif state is ServerState.DEAD:
            for call in list(self.pending.values()):
                if call.state is RequestState.SENT and call.server == server.endpoint:
                    self._send(call)  # do not wait for its attempt to time out

    def _start(self, call: _Call) -> None:
        self._send(call)

    def _send(self, call: _Call) -> None:
        """Send *call* to the first live server it has not tried this round
        (all tried: a new round, from the first live one); none: WAITING."""
        self._outbox.append(Cancel(call, ATTEMPT))
        live = self.live()
        if not live:
            call.state = RequestState.WAITING
            self.waiting.append(call)
            return
        fresh = [e for e in live if e not in call.tried]
        if not fresh:
            call.tried = []
        endpoint = (fresh or live)[0]
        call.tried.append(endpoint)
        call.server = endpoint
        call.attempts += 1
        call.state = RequestState.SENT
        self._outbox.append(SendPeer(endpoint, [call.sequence, *call.body], call))
        self._outbox.append(Later(call, ATTEMPT, call.timeout))

    def _overloaded(self, call: _Call, error: ServiceOverloaded,
                    endpoint: Optional[str]) -> None:
        """A 429: its server, if ALIVE, becomes SUSPECT (no new requests
        until it answers a PING), and the request goes to a live server not
        tried this round; none: the 429 is the answer."""
        self._suspect(endpoint)
        if call.state is not RequestState.SENT or call.server != endpoint:
            return  # from an attempt before the current one: that one goes on
        if any(e not in call.tried for e in self.live()):
            self._send(call)
        else:
            self._fail(call, error)

    def _attemptOver(self, call: _Call) -> None:
        """An attempt went unanswered: its server, if ALIVE, becomes SUSPECT
        (no new requests until it speaks again); try another."""
        self._suspect(call.server)
        self._send(call)

    def _suspect(self, endpoint: Optional[str]) -> None:
        """The server at *endpoint*, if ALIVE, becomes SUSPECT."""
        server = self.servers.get(endpoint or "")
        if server is not None and server.state is ServerState.ALIVE:
            self._becomes(server, ServerState.SUSPECT)

    def _finish(self, call: _Call) -> bool:
        if call.state is RequestState.WAITING:
            self.waiting.remove(call)
        return super()._finish(call)


# --- the drivers ---------------------------------------------------------------------

@implementer(IDealerReceiver)
class _Pipe:
    """A connection to one server whose replies go to the client's machine
    (model 1: one per attempt; model 2: one per server).  If no socket can be
    had (the process out of descriptors), that is logged and the next send
    tries again: meanwhile what is sent there goes unanswered, as to a
    server that is down, and the request moves on at its attempt's end."""

    def __init__(self, client: _FreelanceClient, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.security = transport.curve_for(endpoint, client.curve)
        self.transport: Any = None
        self.closed = False
        self._open()

    def _open(self) -> bool:
        client, endpoint = self.client, self.endpoint
        try:
            self.transport = transport.connect(endpoint, self, client.reactor,
                                               security=self.security, limits=client.limits)
        except TransportError as e:  # no socket to be had (out of descriptors)
            client.throttle.warn(log, f"open {endpoint}", "Freelance client: {error}; what "
                                 "it sends there goes unanswered until a connection opens",
                                 error=e)
            return False
        return True

    def send(self, frames: list[bytes]) -> None:
        if self.transport is not None or (not self.closed and self._open()):
            self.transport.sendMessage(frames)

    def close(self) -> defer.Deferred[None]:
        closing, self.transport = self.transport, None
        self.closed = True
        return defer.succeed(None) if closing is None else closing.close()

    def connectionMade(self) -> None:
        pass

    def connectionLost(self, reason: object) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        client = self.client
        client._perform(client.machine.handleReply(frames, client.reactor.seconds(),
                                                   self.endpoint))


class _FreelanceClient:
    """The driver the three models share: it holds the model's machine, owns
    the Deferreds, the timers of each request and the connections, and does
    what the machine asks.  *limits* are the message limits of its
    connections (a request over them raises RequestTooLarge at once); the
    CURVE keys are for its ``zmq:`` servers (every one shares the key pair)."""

    def __init__(self, machine: FreelanceMachine, endpoints: Union[str, Sequence[str]],
                 reactor: Optional[Any], curveServerPublic: Optional[str],
                 curveSecret: Optional[str], limits: Limits) -> None:
        self.machine = machine
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.curve = curve_client(curveServerPublic, curveSecret)
        self.throttle = LogThrottle(self.reactor)
        self.router = self._connectRouter()
        self.pipes: dict[Any, _Pipe] = {}
        self._timers: dict[tuple[bytes, str], Any] = {}
        self._deferreds: dict[bytes, defer.Deferred[list[bytes]]] = {}
        #: how each action is done (a closing pipe's returns the Deferred of its close)
        self._performers: dict[type, Callable[[Any], Optional[defer.Deferred[None]]]] = {
            Later: self._arm, Cancel: self._disarm, SendPeer: self._sendPeer,
            SendPipe: self._sendPipe, Resolve: self._resolve, Reject: self._reject,
            OpenPipe: self._openPipe, ClosePipe: self._closePipe,
            ConnectPeer: self._connectPeer, ServerChanged: self._logServer}
        listed = transport.endpoint_list(endpoints, empty=True)  # all checked before any is used
        #: the endpoints of the servers added, in order
        self.added: list[str] = []
        if listed:  # the list as a whole: one zmq: server among them uses the keys
            transport.check_curve_client(listed, self.curve)
        for endpoint in listed:
            self._add(endpoint)

    def _connectRouter(self) -> Any:
        """The connecting router of model 3 (the others have none)."""
        return None

    @property
    def timeout(self) -> float:
        """Seconds one attempt may take (the default of each request)."""
        return self.machine.timeout

    @property
    def deadline(self) -> Optional[float]:
        """Seconds a whole request may take (``None``: no bound beyond its attempts)."""
        return self.machine.deadline

    def connect(self, endpoint: str) -> None:
        """Add a server (:class:`~mdp.errors.TransportError` at once for a
        malformed endpoint; ``ValueError`` for CURVE keys and no ``zmq:``
        server to use them)."""
        if self.machine.closed:
            raise ClientClosed("client is closed")
        transport.check(endpoint, transport.CONNECT)
        # keys no server would use (it would talk in the clear), or a
        # session+zmq: one, which cannot have them: ValueError, TransportError
        transport.check_curve_client([*self.added, endpoint], self.curve)
        self._add(endpoint)

    def _add(self, endpoint: str) -> None:
        if endpoint not in self.added:
            self.added.append(endpoint)
        self._perform(self.machine.handleConnect(endpoint, self.reactor.seconds()))

    def request(self, *frames: Union[bytes, str], timeout: Optional[float] = None,
                deadline: Optional[float] = None) -> defer.Deferred:
        """Send a request; the Deferred fires with the reply body frames.

        *timeout* (seconds one attempt may take) and *deadline* (seconds the
        whole request may take) override the client's own for this request.
        Errors: :class:`~mdp.errors.RequestTimeout`,
        :class:`~mdp.errors.NoServerAvailable`, the remote errors of a server
        (:class:`~mdp.errors.WorkerError`, ...),
        :class:`~mdp.errors.ClientClosed`; cancelling the Deferred abandons the
        request (a late reply is dropped).  Frames are bytes or str (UTF-8);
        anything else raises TypeError at once, no frame ValueError."""
        body = messages.request_frames(frames)
        # the sequence frame counted at its longest: a server's transport
        # would drop the connection, and every request on it, for one over
        tooLarge = self.limits.refuse([b"0" * 20, *body])
        if tooLarge is not None:
            raise RequestTooLarge(f"Freelance request not sent: {tooLarge}")
        machine = self.machine
        timeout = machine.timeout if timeout is None else positive_seconds("timeout", timeout)
        deadline = machine.deadline if deadline is None else positive_seconds("deadline", deadline)
        refusal = machine.refusal()
        if refusal is not None:
            return defer.fail(refusal)
        call = machine.newCall(body, timeout, deadline)

        def cancel(d: defer.Deferred[list[bytes]]) -> None:
            self._deferreds.pop(call.sequence, None)
            self._perform(machine.handleCancel(call, self.reactor.seconds()))

        d = self._deferreds[call.sequence] = defer.Deferred(cancel)
        self._perform(machine.handleRequest(call, self.reactor.seconds()))
        return d

    def close(self) -> defer.Deferred:
        """Fail every pending request with :class:`~mdp.errors.ClientClosed`
        and close the connections."""
        closing = self._perform(self.machine.handleClose(self.reactor.seconds()))
        # every request is DONE and its timers cancelled; none is armed again
        # once closed, but none is left behind whatever happened before
        timers, self._timers = self._timers, {}
        for timer in timers.values():
            cancel_call(timer)
        return defer.DeferredList(closing).addCallback(lambda _: None)

    def _fire(self, call: _Call, kind: str) -> None:
        self._timers.pop((call.sequence, kind), None)
        self._perform(self.machine.handleTimer(call, kind, self.reactor.seconds()))

    def _stale(self, call: Optional[_Call]) -> bool:
        """Is an action for *call* (None: for no request) no longer to be
        done?  A caller's callback run by an earlier action of the same
        event may have cancelled that request, or closed the client."""
        return self.machine.closed or (call is not None and call.state is RequestState.DONE)

    def _perform(self, actions: list[Action]) -> list[defer.Deferred[None]]:
        """Do what the machine asked, in order; returns the closings of the
        pipes it closed.  What a caller's callback does meanwhile (a cancel,
        close, a new request) is a new event, handled at once: the actions
        left over that would send, open or arm a timer for a request it
        ended, or for a client it closed, are skipped (see :meth:`_stale`)."""
        closing = []
        for action in actions:
            closed = self._performers[type(action)](action)
            if closed is not None:
                closing.append(closed)
        return closing

    def _arm(self, action: Later) -> None:
        call = action.call
        if not self._stale(call):
            key = (call.sequence, action.kind)
            cancel_call(self._timers.get(key))
            self._timers[key] = self.reactor.callLater(action.delay, self._fire, call,
                                                       action.kind)

    def _disarm(self, action: Cancel) -> None:
        cancel_call(self._timers.pop((action.call.sequence, action.kind), None))

    def _sendPeer(self, action: SendPeer) -> None:
        if not self._stale(action.call):
            self.router.sendMessage(action.endpoint, action.frames)

    def _sendPipe(self, action: SendPipe) -> None:
        pipe = self.pipes.get(action.key)
        if pipe is not None and not self._stale(action.call):
            pipe.send(action.frames)

    def _resolve(self, action: Resolve) -> None:
        d = self._deferreds.pop(action.call.sequence, None)
        if d is not None and not d.called:  # (cancelled by a callback of another)
            d.callback(action.frames)

    def _reject(self, action: Reject) -> None:
        d = self._deferreds.pop(action.call.sequence, None)
        if d is not None and not d.called:
            d.errback(action.error)

    def _openPipe(self, action: OpenPipe) -> None:
        if not self._stale(action.call):
            self.pipes[action.key] = _Pipe(self, action.endpoint)

    def _closePipe(self, action: ClosePipe) -> Optional[defer.Deferred[None]]:
        pipe = self.pipes.pop(action.key, None)
        if pipe is None:
            return None
        return transport.close_all([pipe], "a Freelance client connection")

    def _connectPeer(self, action: ConnectPeer) -> None:
        if not self.machine.closed:
            self.router.connect(action.endpoint)

    def _logServer(self, action: ServerChanged) -> None:
        if action.state is ServerState.ALIVE:
            log.info("Freelance server {endpoint} is alive", endpoint=action.endpoint)
        elif action.state is ServerState.DEAD:
            log.warn("Freelance server {endpoint} is dead", endpoint=action.endpoint)


class SequentialClient(_FreelanceClient):
    """Model 1: try each server in turn, in list order, each attempt on a
    fresh connection with *timeout* seconds; :class:`RequestTimeout` after
    every server was tried once, or after *deadline* seconds in all
    (``None``: no bound beyond the round), whichever comes first."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = SEQUENTIAL_TIMEOUT,
                 deadline: Optional[float] = SEQUENTIAL_DEADLINE,
                 curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None, limits: Limits = Limits()) -> None:
        super().__init__(SequentialMachine(timeout, deadline), endpoints, reactor,
                         curveServerPublic, curveSecret, limits)


class ShotgunClient(_FreelanceClient):
    """Model 2: send every request to all servers; the first reply wins.  The
    one round is the only attempt: :class:`RequestTimeout` after *timeout*
    seconds (or *deadline*, if given and shorter)."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = SHOTGUN_TIMEOUT, deadline: Optional[float] = None,
                 curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None, limits: Limits = Limits()) -> None:
        super().__init__(ShotgunMachine(timeout, deadline), endpoints, reactor,
                         curveServerPublic, curveSecret, limits)

    @property
    def links(self) -> dict[str, _Pipe]:
        """The connection to each server."""
        return dict(self.pipes)


@implementer(IPeerRouterReceiver)
class AgentClient(_FreelanceClient):
    """Model 3, the full agent (see the module docstring): PINGs every server
    each ``heartbeat.interval`` and counts one silent for ``heartbeat.expiry``
    as dead; each attempt goes to one live server and has *timeout* seconds;
    *deadline* bounds the request in all (``None``: until answered or every
    server is dead)."""

    machine: AgentMachine

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, heartbeat: HeartbeatPolicy = HeartbeatPolicy(1.0, 3),
                 timeout: float = AGENT_TIMEOUT,
                 deadline: Optional[float] = AGENT_DEADLINE,
                 curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None, limits: Limits = Limits()) -> None:
        super().__init__(AgentMachine(heartbeat, timeout, deadline), endpoints, reactor,
                         curveServerPublic, curveSecret, limits)
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = self.reactor
        self._ticker.start(self.machine.wakeEvery, now=False)

    def _connectRouter(self) -> Any:
        return transport.connect_peers(self, self.reactor, security=self.curve,
                                       limits=self.limits)

    @property
    def heartbeat(self) -> HeartbeatPolicy:
        return self.machine.heartbeat

    @property
    def servers(self) -> OrderedDict[str, KnownServer]:
        """What the agent knows of each server, by endpoint."""
        return self.machine.servers

    def live(self) -> list[str]:
        """The endpoints of the ALIVE servers, in the order they were added."""
        return self.machine.live()

    def messageReceived(self, endpoint: str, frames: list[bytes]) -> None:
        """A PONG or a reply from the server at *endpoint*."""
        self._perform(self.machine.handleMessage(endpoint, frames, self.reactor.seconds()))

    def tick(self) -> None:
        try:
            self._perform(self.machine.handleTick(self.reactor.seconds()))
        except Exception:  # the heartbeat must go on (a caller's callback raised)
            log.failure("Freelance agent: its tick failed")

    def close(self) -> defer.Deferred:
        super().close()
        if self._ticker.running:
            self._ticker.stop()
        return self.router.close()


def freelance_client(endpoints: Union[str, Sequence[str]], model: int = 3,
                     reactor: Optional[Any] = None, **options: Any) -> _FreelanceClient:
    """A Freelance client of the Guide's *model* (1, 2 or 3); *options* are
    the constructor's (``timeout``, ``deadline``, ``curveServerPublic``,
    ``curveSecret``, ``limits``; ``heartbeat`` for model 3)."""
    kinds = {1: SequentialClient, 2: ShotgunClient, 3: AgentClient}
    if model not in kinds:
        raise ValueError(f"Freelance model must be 1, 2 or 3, not {model!r}")
    return kinds[model](endpoints, reactor, **options)
