"""Brokerless reliable request-reply: the Guide's Freelance pattern, models 1-3
(:class:`SequentialClient`, :class:`ShotgunClient`, :class:`AgentClient`, each
driving its machine in :mod:`mdp.freelance.machines`) and :class:`FreelanceServer`.

``[b"PING"]`` is answered ``[b"PONG"]``, ``[sequence, body...]`` with ``[sequence,
reply...]``; errors use MDP's error body (500, 429, 413), so both patterns raise
the same errors.  ``timeout`` bounds one attempt, ``deadline`` the whole request.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer, task
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp import messages, policy, transport
from mdp.errors import ClientClosed, RequestTooLarge, TransportError
from mdp.freelance import machines
from mdp.freelance.machines import (
    ATTEMPT,
    DEADLINE,
    PING,
    PONG,
    SERVICE,
    AgentMachine,
    FreelanceMachine,
    KnownServer,
    RequestState,
    SequentialMachine,
    ServerState,
    ShotgunMachine,
    remote_error,
)
from mdp.handlers import call_handler
from mdp.interfaces import DealerReceiver, IPeerRouterReceiver, IRouterReceiver
from mdp.machine import machine_view
from mdp.messages import STATUS_OVERLOADED, STATUS_TOO_LARGE, STATUS_WORKER_ERROR, error_body
from mdp.policy import HeartbeatPolicy, Limits, LogThrottle, cancel_call, default_reactor, positive_seconds
from mdp.transport.curve import curve_client, curve_server

__all__ = ["ATTEMPT", "DEADLINE", "PING", "PONG", "SERVICE", "AgentClient", "AgentMachine",
           "FreelanceMachine", "FreelanceServer", "KnownServer", "RequestState", "SequentialClient",
           "SequentialMachine", "ServerState", "ShotgunClient", "ShotgunMachine", "freelance_client",
           "remote_error"]

log = Logger()

Handler = Callable[[list[bytes]], Any]


class FreelanceServer:
    """Answers PING with PONG and ``[sequence, body...]`` with ``[sequence, handler(body)...]``
    (a worker's handler)."""

    def __init__(self, handler: Handler, reactor: Optional[Any] = None, *, limits: Limits = Limits(),
                 maxPending: int = policy.DEFAULT_MAX_PENDING,
                 maxPendingBytes: int = policy.DEFAULT_MAX_PENDING_BYTES, metrics: Optional[Any] = None,
                 curveSecret: Optional[str] = None, curveAllow: Optional[str] = None) -> None:
        self.handler = handler
        #: CURVE key pair and allow-list for zmq: endpoints (docs/security.md)
        self.curve = curve_server(curveSecret, curveAllow)
        self.reactor = default_reactor(reactor)
        self.limits, self.maxPending, self.maxPendingBytes = limits, maxPending, maxPendingBytes
        self.throttle = LogThrottle(self.reactor)
        self.transports: list[Any] = []
        #: replies sent, requests answered 429, and those being handled and their bytes
        self.served = self.refused = self.pending = self.pendingBytes = 0
        #: a :class:`mdp.metrics.FreelanceMetrics` (or None)
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)

    def listen(self, endpoint: str) -> defer.Deferred:
        """Bind *endpoint*; fires with the transport."""
        binding = _Binding(self)

        def bound(routerTransport: Any) -> Any:
            log.info("Freelance server listening on {endpoint}", endpoint=routerTransport.endpoint)
            return binding.bind(routerTransport)

        security = transport.curve_listen_for(endpoint, self.curve)
        transport.warn_if_open(endpoint, security, "Freelance server")
        return transport.listen(endpoint, binding, self.reactor, limits=self.limits,
                                security=security).addCallback(bound)

    def streamFactory(self) -> IProtocolFactory:
        """This server as a Twisted :class:`IProtocolFactory` in the stream framing, to
        listen with on an endpoint of one's own (stopping that port is the caller's)."""
        from mdp.transport.stream import StreamRouter

        binding = _Binding(self)
        return binding.bind(StreamRouter(binding, self.reactor, limits=self.limits)).factory()

    def close(self) -> defer.Deferred:
        """Close every transport: stop listening, drop every client."""
        transports, self.transports = self.transports, []
        return transport.close_all(transports, "a Freelance server listener")

    def received(self, routerTransport: Any, peer: bytes, frames: list[bytes]) -> None:
        """A message from *peer* (the server's table is in docs/freelance.md)."""
        if frames == [PING]:
            routerTransport.sendMessage(peer, [PONG])
            self._count("pings")
            return
        if len(frames) < 2:
            self._count("rejected")
            self.throttle.warn(log, "invalid", "Freelance server dropped a {count}-frame message "
                               "from {peer}, and its connection: neither PING nor "
                               "[sequence, body...]", count=len(frames), peer=peer.hex())
            routerTransport.disconnectPeer(peer)
            return
        sequence, body = frames[0], frames[1:]
        size = policy.held_bytes(body)
        self._count("requests")
        if self.pending >= self.maxPending or self.pendingBytes + size > self.maxPendingBytes:
            self.refused += 1
            self._count("refused")
            self.throttle.warn(log, "overloaded", "Freelance server refused a request from {peer}: "
                               "{pending} requests ({bytes} bytes) already in hand",
                               peer=peer.hex(), pending=self.pending, bytes=self.pendingBytes)
            routerTransport.sendMessage(peer, [sequence, *error_body(
                STATUS_OVERLOADED, f"server busy: {self.pending} requests in hand")])
            return
        self.pending += 1
        self.pendingBytes += size
        started = self.reactor.seconds()

        def reply(result: Any) -> None:
            self.pending -= 1
            self.pendingBytes -= size
            outcome = None  # why the client gets an error, if it does
            if isinstance(result, Failure):
                log.failure("Freelance handler failed", result)
                outcome, result = "error", error_body(
                    STATUS_WORKER_ERROR, f"{result.type.__name__}: {result.getErrorMessage()}")
            message = [sequence, *result]
            tooLarge = self.limits.refuse(message)
            if tooLarge is not None:
                self.throttle.warn(log, "too-large", "Freelance server answers 413: its reply is "
                                   "too large ({reason})", reason=tooLarge)
                message = [sequence, *error_body(STATUS_TOO_LARGE, f"reply too large to send: {tooLarge}")]
                outcome = "too-large"
            self.served += 1
            if self.metrics is not None:
                self.metrics.handlerSeconds.observe(self.reactor.seconds() - started)
                if outcome is not None:
                    self.metrics.failures.labels(outcome).inc()
            routerTransport.sendMessage(peer, message)

        call_handler(self.handler, body).addBoth(reply)

    def _count(self, counter: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, counter).inc()


@implementer(IRouterReceiver)
class _Binding:
    """The receiver of one bound transport of a :class:`FreelanceServer`."""

    def __init__(self, server: FreelanceServer) -> None:
        self.server = server
        self.transport: Any = None

    def bind(self, routerTransport: Any) -> Any:
        self.transport = routerTransport
        self.server.transports.append(routerTransport)
        return routerTransport

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        if self.transport is not None:
            self.server.received(self.transport, peer, frames)

    def peerDisconnected(self, peer: bytes) -> None:
        pass


class _Pipe(DealerReceiver):
    """A connection to one server (model 1: one per attempt; model 2: one per
    server); failing to open, it logs and tries again at the next send."""

    def __init__(self, client: _FreelanceClient, endpoint: str) -> None:
        self.client, self.endpoint = client, endpoint
        self.security = transport.curve_for(endpoint, client.curve)
        self.transport: Any = None
        self._open()

    def _open(self) -> Any:
        client, endpoint = self.client, self.endpoint
        try:
            self.transport = transport.connect(endpoint, self, client.reactor,
                                               security=self.security, limits=client.limits)
        except TransportError as e:
            client.throttle.warn(log, f"open {endpoint}", "Freelance client: {error}; what it sends "
                                 "there goes unanswered until a connection opens", error=e)
        return self.transport

    def send(self, frames: list[bytes]) -> None:
        if self.transport is not None or self._open() is not None:
            self.transport.sendMessage(frames)

    def close(self) -> defer.Deferred[None]:
        closing, self.transport = self.transport, None
        return defer.succeed(None) if closing is None else closing.close()

    def messageReceived(self, frames: list[bytes]) -> None:
        client = self.client
        client._perform(client.machine.handleReply(frames, client.reactor.seconds(), self.endpoint))


#: actions void once the client is closed or their call is DONE
_VOIDABLE = (machines.Later, machines.SendPeer, machines.SendPipe, machines.OpenPipe, machines.ConnectPeer)


class _FreelanceClient:
    """The driver the three models share: it owns the Deferreds, timers and connections,
    and does what the machine asks.  Each model's *options*: *curveServerPublic*,
    *curveSecret* (docs/security.md) and *limits*."""

    def __init__(self, machine: FreelanceMachine, endpoints: Union[str, Sequence[str]],
                 reactor: Optional[Any], *, curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None, limits: Limits = Limits()) -> None:
        self.machine = machine
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.curve = curve_client(curveServerPublic, curveSecret)
        self.throttle = LogThrottle(self.reactor)
        #: model 3's connecting router
        self.router = (transport.connect_peers(self, self.reactor, security=self.curve, limits=limits)
                       if isinstance(machine, AgentMachine) else None)
        self.pipes: dict[Any, _Pipe] = {}
        self._timers: dict[tuple[bytes, str], Any] = {}
        self._deferreds: dict[bytes, defer.Deferred[list[bytes]]] = {}
        #: a closing pipe's performer returns the Deferred of its close
        self._performers: dict[type, Callable[[Any], Optional[defer.Deferred[None]]]] = {
            machines.Later: self._arm, machines.SendPipe: self._sendPipe,
            machines.Cancel: lambda a: cancel_call(self._timers.pop((a.call.sequence, a.kind), None)),
            machines.SendPeer: lambda a: self.router.sendMessage(a.endpoint, a.frames),
            machines.Resolve: self._answer, machines.Reject: self._answer,
            machines.ClosePipe: self._closePipe,
            machines.OpenPipe: lambda a: self.pipes.__setitem__(a.key, _Pipe(self, a.endpoint)),
            machines.ConnectPeer: lambda a: self.router.connect(a.endpoint),
            machines.ServerChanged: self._logServer}
        listed = transport.endpoint_list(endpoints, empty=True)  # all checked before any is used
        if listed:  # as a whole: one zmq: server among them uses the keys
            transport.check_curve_client(listed, self.curve)
        for endpoint in listed:
            self._perform(machine.handleConnect(endpoint, self.reactor.seconds()))

    added = machine_view("endpoints", "The servers' endpoints, in the order they were added.")
    timeout = machine_view("timeout", "Seconds one attempt may take (each request's default).")
    deadline = machine_view("deadline", "Seconds a whole request may take (None: no bound "
                            "beyond its attempts).")

    def connect(self, endpoint: str) -> None:
        """Add a server (:class:`~mdp.errors.TransportError` for a malformed endpoint)."""
        if self.machine.closed:
            raise ClientClosed("client is closed")
        transport.check(endpoint, transport.CONNECT)
        transport.check_curve_client([*self.added, endpoint], self.curve)
        self._perform(self.machine.handleConnect(endpoint, self.reactor.seconds()))

    def request(self, *frames: Union[bytes, str], timeout: Optional[float] = None,
                deadline: Optional[float] = None) -> defer.Deferred:
        """Send a request (frames: bytes or str); the Deferred fires with the reply
        body frames.  *timeout* and *deadline* override the client's; cancelling
        abandons the request."""
        body = messages.request_frames(frames)
        # the sequence frame at its longest: one over would cost the connection
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
        """Fail every pending request with :class:`~mdp.errors.ClientClosed` and close."""
        closing = self._perform(self.machine.handleClose(self.reactor.seconds()))
        return defer.DeferredList(closing).addCallback(lambda _: None)

    def _fire(self, call: machines._Call, kind: str) -> None:
        self._timers.pop((call.sequence, kind), None)
        self._perform(self.machine.handleTimer(call, kind, self.reactor.seconds()))

    def _perform(self, actions: list[machines.Action]) -> list[defer.Deferred[None]]:
        """Do what the machine asked, in order; returns the pipes' closings.  An action
        made void by a callback (its call DONE, or the client closed) is skipped."""
        closing = []
        for action in actions:
            if type(action) in _VOIDABLE:
                call = getattr(action, "call", None)
                if self.machine.closed or (call is not None and call.state is RequestState.DONE):
                    continue
            closed = self._performers[type(action)](action)
            if closed is not None:
                closing.append(closed)
        return closing

    def _arm(self, action: machines.Later) -> None:
        key = (action.call.sequence, action.kind)
        cancel_call(self._timers.get(key))
        self._timers[key] = self.reactor.callLater(action.delay, self._fire, action.call, action.kind)

    def _sendPipe(self, action: machines.SendPipe) -> None:
        pipe = self.pipes.get(action.key)
        if pipe is not None:
            pipe.send(action.frames)

    def _answer(self, action: Union[machines.Resolve, machines.Reject]) -> None:
        d = self._deferreds.pop(action.call.sequence, None)
        if d is not None and not d.called:
            if type(action) is machines.Resolve:
                d.callback(action.frames)
            else:
                d.errback(action.error)

    def _closePipe(self, action: machines.ClosePipe) -> Optional[defer.Deferred[None]]:
        pipe = self.pipes.pop(action.key, None)
        return None if pipe is None else transport.close_all([pipe], "a Freelance client connection")

    def _logServer(self, action: machines.ServerChanged) -> None:
        if action.state is ServerState.ALIVE:
            log.info("Freelance server {endpoint} is alive", endpoint=action.endpoint)
        elif action.state is ServerState.DEAD:
            log.warn("Freelance server {endpoint} is dead", endpoint=action.endpoint)


class SequentialClient(_FreelanceClient):
    """Model 1: each server in turn, each attempt on a fresh connection with
    *timeout* seconds; :class:`RequestTimeout` after one round or *deadline*."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = 1.0, deadline: Optional[float] = 30.0, **options: Any) -> None:
        super().__init__(SequentialMachine(timeout, deadline), endpoints, reactor, **options)


class ShotgunClient(_FreelanceClient):
    """Model 2: every request to all servers, the first reply wins; one attempt,
    :class:`RequestTimeout` after *timeout* (or a shorter *deadline*)."""

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, timeout: float = 3.0, deadline: Optional[float] = None, **options: Any) -> None:
        super().__init__(ShotgunMachine(timeout, deadline), endpoints, reactor, **options)


@implementer(IPeerRouterReceiver)
class AgentClient(_FreelanceClient):
    """Model 3: PINGs every server each ``heartbeat.interval``; one silent for
    ``heartbeat.expiry`` is dead.  Each attempt goes to one live server for *timeout*
    seconds; *deadline* bounds the request (``None``: until all servers are dead)."""

    machine: AgentMachine

    def __init__(self, endpoints: Union[str, Sequence[str]] = (), reactor: Optional[Any] = None,
                 *, heartbeat: HeartbeatPolicy = HeartbeatPolicy(1.0, 3),
                 timeout: float = 1.0, deadline: Optional[float] = 3.0, **options: Any) -> None:
        super().__init__(AgentMachine(heartbeat, timeout, deadline), endpoints, reactor, **options)
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = self.reactor
        self._ticker.start(self.machine.wakeEvery, now=False)

    heartbeat = machine_view("heartbeat", "The agent's HeartbeatPolicy.")
    servers = machine_view("servers", "What the agent knows of each server (a KnownServer), by endpoint.")
    live = machine_view("live", "``live()``: the endpoints of the ALIVE servers, in the order added.")

    def messageReceived(self, endpoint: str, frames: list[bytes]) -> None:
        self._perform(self.machine.handleMessage(endpoint, frames, self.reactor.seconds()))

    def tick(self) -> None:
        try:
            self._perform(self.machine.handleTick(self.reactor.seconds()))
        except Exception:  # the heartbeat must go on
            log.failure("Freelance agent: its tick failed")
            self._perform(self.machine.actionsSoFar())

    def close(self) -> defer.Deferred:
        super().close()
        if self._ticker.running:
            self._ticker.stop()
        return self.router.close()


def freelance_client(endpoints: Union[str, Sequence[str]], model: int = 3,
                     reactor: Optional[Any] = None, **options: Any) -> _FreelanceClient:
    """A Freelance client of the Guide's *model* (1, 2 or 3), with the constructor's *options*."""
    kinds = {1: SequentialClient, 2: ShotgunClient, 3: AgentClient}
    if model not in kinds:
        raise ValueError(f"Freelance model must be 1, 2 or 3, not {model!r}")
    return kinds[model](endpoints, reactor, **options)
