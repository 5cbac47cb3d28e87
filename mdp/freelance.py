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
Every node here is a state machine.  It changes state only on an event (a
message from a transport, a timer of the reactor it was given, a call of its
API) and acts only through a transport (send, open or close a pipe, drop a
peer) or by firing a Deferred.  :mod:`mdp.testing` drives each one by a list
of events, with no transport.  The states are :class:`RequestState` (every
client) and :class:`ServerState` (the agent's view of each server); the
tables below are what the code does.

A request, in every client::

    state         event                          action                          next
    (new)         request(), client closed       ClientClosed                    -
    (new)         request(), no server known     NoServerAvailable               -
    WAITING/SENT  [sequence, reply...]           fire (an error reply: raise)    DONE
    WAITING/SENT  deadline timer                 RequestTimeout                  DONE
    WAITING/SENT  cancel() / close()             CancelledError / ClientClosed   DONE
    DONE          [sequence, reply...]           dropped                         DONE

Model 1 (:class:`SequentialClient`; leaving SENT closes the attempt's pipe)::

    (new)  request()                             pipe to the first server,       SENT
                                                 send, attempt timer
    SENT   attempt timer, a server left          close; pipe to the next, send   SENT
    SENT   attempt timer, every server tried     RequestTimeout                  DONE

Model 2 (:class:`ShotgunClient`)::

    (new)  request()                             send on every server's pipe,    SENT
                                                 attempt timer (the round)
    SENT   attempt timer                         RequestTimeout                  DONE

Model 3 (:class:`AgentClient`), each server::

    state                  event                        action                         next
    (new)                  connect(endpoint)            PING                           UNKNOWN
    any                    any message from it          WAITING requests go out        ALIVE
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
)
from mdp.handlers import call_handler
from mdp.interfaces import IDealerReceiver, IPeerRouterReceiver, IRouterReceiver
from mdp.messages import STATUS_OVERLOADED, STATUS_TOO_LARGE, STATUS_WORKER_ERROR, error_body
from mdp.policy import (
    EndpointRotation,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    MiB,
    cancel_call,
    default_reactor,
    held_bytes,
)

log = Logger()

PING = b"PING"
PONG = b"PONG"
SERVICE = b"freelance"  # what RequestTimeout names
DEFAULT_MAX_PENDING = 10_000
DEFAULT_MAX_PENDING_BYTES = 256 * MiB

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


def _result(deferred: defer.Deferred, reply: list[bytes]) -> None:
    """Fire a request's Deferred with a reply body, or its error."""
    error = remote_error(reply)
    if error is not None:
        deferred.errback(error)
    else:
        deferred.callback(reply)


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
                 maxPendingBytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.handler = handler
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

        return transport.listen(endpoint, binding, self.reactor, limits=self.limits).addCallback(bound)

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
        return defer.DeferredList([t.close() for t in transports]).addCallback(lambda _: None)

    def received(self, routerTransport: Any, peer: bytes, frames: list[bytes]) -> None:
        """A message from *peer* on *routerTransport* (see the server's table
        in the module docstring)."""
        if frames == [PING]:
            routerTransport.sendMessage(peer, [PONG])
            return
        if len(frames) < 2:
            self.throttle.warn(log, "invalid", "Freelance server dropped a {count}-frame message "
                               "from {peer}, and its connection: neither PING nor "
                               "[sequence, body...]", count=len(frames), peer=peer.hex())
            routerTransport.disconnectPeer(peer)
            return
        sequence, body = frames[0], frames[1:]
        size = held_bytes(body)
        if self.pending >= self.maxPending or self.pendingBytes + size > self.maxPendingBytes:
            self.refused += 1
            self.throttle.warn(log, "overloaded", "Freelance server refused a request from {peer}: "
                               "{pending} requests ({bytes} bytes) already in hand",
                               peer=peer.hex(), pending=self.pending, bytes=self.pendingBytes)
            routerTransport.sendMessage(peer, [sequence, *error_body(
                STATUS_OVERLOADED, f"server busy: {self.pending} requests in hand")])
            return
        self.pending += 1
        self.pendingBytes += size

        def failed(failure: Any) -> list[bytes]:
            log.failure("Freelance handler failed", failure)
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
            self.served += 1
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


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is a number of seconds, not {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)




class _Call:
    __slots__ = ("sequence", "body", "deferred", "state", "startedAt", "timeout", "deadline",
                 "attempts", "deadlineTimer", "attemptTimer", "tried", "server", "rotation")

    def __init__(self, sequence: bytes, body: list[bytes], startedAt: float, timeout: float,
                 deadline: Optional[float]) -> None:
        self.sequence = sequence
        self.body = body
        self.startedAt = startedAt
        self.timeout = timeout  # seconds per attempt
        self.deadline = deadline  # seconds for the whole request, or None
        self.deferred: defer.Deferred = defer.Deferred()
        self.state = RequestState.WAITING  # until the model sends it
        self.attempts = 0
        self.deadlineTimer: Any = None
        self.attemptTimer: Any = None
        self.tried: list[str] = []  # model 3: servers tried in this round
        self.server: Optional[str] = None  # where the current attempt went
        self.rotation: Optional[EndpointRotation] = None  # model 1: the servers it walks


class _FreelanceClient:
    """What the three models share: sequence numbers, pending requests, the
    deadline, and close()."""

    def __init__(self, endpoints: Union[str, Sequence[str]], reactor: Optional[Any],
                 timeout: float, deadline: Optional[float]) -> None:
        self.reactor = default_reactor(reactor)
        self.timeout = _positive("timeout", timeout)
        self.deadline = None if deadline is None else _positive("deadline", deadline)
        self.endpoints: list[str] = []
        self.pending: dict[bytes, _Call] = {}
        self._sequence = itertools.count(1)
        self._closed = False
        for endpoint in transport.endpoint_list(endpoints, empty=True):  # all checked before any is used
            self.connect(endpoint)

    def connect(self, endpoint: str) -> None:
        """Add a server (:class:`~mdp.errors.TransportError` at once for a
        malformed endpoint)."""
        transport.check(endpoint, transport.CONNECT)
        if endpoint not in self.endpoints:
            self.endpoints.append(endpoint)

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
        timeout = self.timeout if timeout is None else _positive("timeout", timeout)
        deadline = self.deadline if deadline is None else _positive("deadline", deadline)
        if self._closed:
            return defer.fail(ClientClosed("client is closed"))
        refusal = self._refusal()
        if refusal is not None:
            return defer.fail(refusal)
        call = _Call(str(next(self._sequence)).encode(), body, self.reactor.seconds(), timeout,
                     deadline)
        call.deferred = defer.Deferred(lambda d: self._finish(call))
        self.pending[call.sequence] = call
        if deadline is not None:
            call.deadlineTimer = self.reactor.callLater(deadline, self._expired, call)
        self._start(call)
        return call.deferred

    def _refusal(self) -> Optional[Exception]:
        """Why a new request fails at once, if it does."""
        if not self.endpoints:
            return NoServerAvailable("no Freelance server configured")
        return None

    def _finish(self, call: _Call) -> bool:
        """*call* is DONE: forget it; False if it already was."""
        if call.state is RequestState.DONE:
            return False
        call.state = RequestState.DONE
        del self.pending[call.sequence]
        cancel_call(call.deadlineTimer)
        cancel_call(call.attemptTimer)
        return True

    def _expired(self, call: _Call) -> None:
        """The deadline, or the last attempt, ran out."""
        self._fail(call, RequestTimeout(SERVICE, call.attempts,
                                        self.reactor.seconds() - call.startedAt))

    def _fail(self, call: _Call, error: Exception) -> None:
        if self._finish(call):
            call.deferred.errback(error)

    def _reply(self, frames: list[bytes]) -> None:
        """A ``[sequence, reply...]`` arrived; stale or unknown ones are dropped."""
        if len(frames) < 2:
            return
        call = self.pending.get(frames[0])  # DONE requests are not pending
        if call is not None and self._finish(call):
            _result(call.deferred, frames[1:])

    def close(self) -> defer.Deferred:
        """Fail every pending request with :class:`~mdp.errors.ClientClosed`
        and close the connections."""
        self._closed = True
        for call in list(self.pending.values()):
            self._fail(call, ClientClosed("client closed"))
        return defer.succeed(None)

    def _start(self, call: _Call) -> None:
        raise NotImplementedError


# --- model 1 -----------------------------------------------------------------------

@implementer(IDealerReceiver)
class _Pipe:
    """A connection to one server whose replies go to the client's matcher
    (model 1: one per attempt; model 2: one per server)."""

    def __init__(self, client: _FreelanceClient, endpoint: str) -> None:
        self.client = client
        self.transport = transport.connect(endpoint, self, client.reactor)

    def connectionMade(self) -> None:
        pass

    def connectionLost(self, reason: object) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        self.client._reply(frames)


class SequentialClient(_FreelanceClient):
    """Model 1: try each server in turn, in list order, each attempt on a
    fresh connection with *timeout* seconds; :class:`RequestTimeout` after
    every server was tried once, or after *deadline* seconds in all
    (``None``: no bound beyond the round), whichever comes first."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = SEQUENTIAL_TIMEOUT,
                 deadline: Optional[float] = SEQUENTIAL_DEADLINE) -> None:
        self.attempts: dict[bytes, _Pipe] = {}
        super().__init__(endpoints, reactor, timeout, deadline)

    def _start(self, call: _Call) -> None:
        call.rotation = EndpointRotation(self.endpoints)
        self._next(call)

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
        attempt = self.attempts[call.sequence] = _Pipe(self, endpoint)
        attempt.transport.sendMessage([call.sequence, *call.body])
        call.attemptTimer = self.reactor.callLater(call.timeout, self._next, call)

    def _drop(self, call: _Call) -> None:
        attempt = self.attempts.pop(call.sequence, None)
        if attempt is not None:
            attempt.transport.close()

    def _finish(self, call: _Call) -> bool:
        finished = super()._finish(call)
        self._drop(call)
        return finished


# --- model 2 -----------------------------------------------------------------------

class ShotgunClient(_FreelanceClient):
    """Model 2: send every request to all servers; the first reply wins.  The
    one round is the only attempt: :class:`RequestTimeout` after *timeout*
    seconds (or *deadline*, if given and shorter)."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = SHOTGUN_TIMEOUT, deadline: Optional[float] = None) -> None:
        self.links: dict[str, _Pipe] = {}
        super().__init__(endpoints, reactor, timeout, deadline)

    def connect(self, endpoint: str) -> None:
        super().connect(endpoint)
        if endpoint not in self.links:
            self.links[endpoint] = _Pipe(self, endpoint)

    def _start(self, call: _Call) -> None:
        call.attempts = len(self.links)
        call.state = RequestState.SENT
        for link in self.links.values():
            link.transport.sendMessage([call.sequence, *call.body])
        call.attemptTimer = self.reactor.callLater(call.timeout, self._expired, call)

    def close(self) -> defer.Deferred:
        super().close()
        links, self.links = self.links, {}
        return defer.DeferredList([link.transport.close() for link in links.values()]).addCallback(
            lambda _: None)


# --- model 3 -----------------------------------------------------------------------

class KnownServer:
    """What the agent knows of one server: its :class:`ServerState` and when
    it was last heard from (since it was added, if never)."""

    __slots__ = ("endpoint", "state", "liveness")

    def __init__(self, endpoint: str, liveness: Liveness) -> None:
        self.endpoint = endpoint
        self.state = ServerState.UNKNOWN
        self.liveness = liveness


@implementer(IPeerRouterReceiver)
class AgentClient(_FreelanceClient):
    """Model 3, the full agent (see the module docstring): PINGs every server
    each ``heartbeat.interval`` and counts one silent for ``heartbeat.expiry``
    as dead; each attempt goes to one live server and has *timeout* seconds;
    *deadline* bounds the request in all (``None``: until answered or every
    server is dead)."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, heartbeat: HeartbeatPolicy = HeartbeatPolicy(1.0, 3),
                 timeout: float = AGENT_TIMEOUT,
                 deadline: Optional[float] = AGENT_DEADLINE) -> None:
        reactor = default_reactor(reactor)
        if not isinstance(heartbeat, HeartbeatPolicy):
            raise TypeError(f"heartbeat is a HeartbeatPolicy, not {type(heartbeat).__name__}")
        self.heartbeat = heartbeat
        self.servers: OrderedDict[str, KnownServer] = OrderedDict()
        self.waiting: list[_Call] = []  # WAITING requests, oldest first
        self.router = transport.connect_peers(self, reactor)
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = reactor
        super().__init__(endpoints, reactor, timeout, deadline)
        self._ticker.start(heartbeat.interval, now=False)

    def connect(self, endpoint: str) -> None:
        """Add a server at runtime; it is used once it answers a PING."""
        super().connect(endpoint)
        if endpoint not in self.servers:
            now = self.reactor.seconds()
            server = self.servers[endpoint] = KnownServer(endpoint, Liveness(self.heartbeat, now))
            self.router.connect(endpoint)
            self._ping(server, now)

    def live(self) -> list[str]:
        """The endpoints of the ALIVE servers, in the order they were added."""
        return [s.endpoint for s in self.servers.values() if s.state is ServerState.ALIVE]

    def _allDead(self) -> bool:
        return bool(self.servers) and all(s.state is ServerState.DEAD
                                          for s in self.servers.values())

    def _ping(self, server: KnownServer, now: float) -> None:
        self.router.sendMessage(server.endpoint, [PING])
        server.liveness.sent(now)

    # --- server transitions
    def _becomes(self, server: KnownServer, state: ServerState) -> None:
        """Move *server* to *state* and do what that entails."""
        if server.state is state:
            return
        server.state = state
        if state is ServerState.ALIVE:
            log.info("Freelance server {endpoint} is alive", endpoint=server.endpoint)
            waiting, self.waiting = self.waiting, []
            for call in waiting:
                self._send(call)
        elif state is ServerState.DEAD:
            log.warn("Freelance server {endpoint} is dead", endpoint=server.endpoint)
            for call in list(self.pending.values()):
                if call.state is RequestState.SENT and call.server == server.endpoint:
                    self._send(call)  # do not wait for its attempt to time out

    # --- request transitions
    def _refusal(self) -> Optional[Exception]:
        if self._allDead():
            return NoServerAvailable(
                f"all {len(self.servers)} Freelance servers are dead: {', '.join(self.servers)}")
        return super()._refusal()

    def _start(self, call: _Call) -> None:
        self._send(call)

    def _send(self, call: _Call) -> None:
        """Send *call* to the first live server it has not tried this round
        (all tried: a new round, from the first live one); none: WAITING."""
        cancel_call(call.attemptTimer)
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
        self.router.sendMessage(endpoint, [call.sequence, *call.body])
        call.attemptTimer = self.reactor.callLater(call.timeout, self._retry, call)

    def _retry(self, call: _Call) -> None:
        """An attempt went unanswered: its server, if ALIVE, becomes SUSPECT
        (no new requests until it speaks again); try another."""
        call.attemptTimer = None
        server = self.servers.get(call.server or "")
        if server is not None and server.state is ServerState.ALIVE:
            self._becomes(server, ServerState.SUSPECT)
        self._send(call)

    def _finish(self, call: _Call) -> bool:
        if call.state is RequestState.WAITING:
            self.waiting.remove(call)
        return super()._finish(call)

    # --- events: IPeerRouterReceiver
    def messageReceived(self, endpoint: str, frames: list[bytes]) -> None:  # type: ignore[override]
        """A PONG or a reply from the server at *endpoint*: it is ALIVE."""
        server = self.servers.get(endpoint)
        if server is None:
            return
        server.liveness.heard(self.reactor.seconds())
        self._becomes(server, ServerState.ALIVE)
        if frames != [PONG]:
            self._reply(frames)

    # --- events: time
    def tick(self) -> None:
        """Every ``heartbeat.interval``: servers silent for longer than
        ``heartbeat.expiry`` become DEAD; PING every server; if every one is
        DEAD, fail what is pending with NoServerAvailable."""
        now = self.reactor.seconds()
        for server in list(self.servers.values()):
            if server.state is not ServerState.DEAD and server.liveness.dead(now):
                self._becomes(server, ServerState.DEAD)
            self._ping(server, now)
        if self._allDead():
            for call in list(self.pending.values()):
                self._fail(call, NoServerAvailable("every Freelance server is dead"))

    def close(self) -> defer.Deferred:
        super().close()
        if self._ticker.running:
            self._ticker.stop()
        return self.router.close()


def freelance_client(endpoints: Union[str, Sequence[str]], model: int = 3,
                     reactor: Optional[Any] = None, **options: Any) -> _FreelanceClient:
    """A Freelance client of the Guide's *model* (1, 2 or 3); *options* are
    the constructor's (``timeout``, ``deadline``; ``heartbeat`` for model 3)."""
    kinds = {1: SequentialClient, 2: ShotgunClient, 3: AgentClient}
    if model not in kinds:
        raise ValueError(f"Freelance model must be 1, 2 or 3, not {model!r}")
    return kinds[model](endpoints, reactor, **options)
