"""The MDP/0.2 broker over real transports: :class:`Broker` drives a
:class:`~mdp.majordomo.broker_machine.BrokerMachine`, which makes every decision;
the driver owns the bindings and timers, performs the actions, and logs and
counts what they report."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

from twisted.internet import defer, task
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger
from zope.interface import classImplements

from mdp import tracing, transport
from mdp.interfaces import IBroker, IRouterReceiver, IRouterTransport
from mdp.majordomo import codec
from mdp.majordomo.broker_machine import (  # noqa: F401  (the defaults: read by mdp.app.tap)
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_BYTES,
    DEFAULT_MAX_SERVICE_QUEUE,
    DEFAULT_MAX_SERVICE_QUEUE_BYTES,
    DEFAULT_MAX_SERVICE_WORKERS,
    DEFAULT_MAX_WORKERS,
    DEFAULT_REQUEST_EXPIRY,
    DEFAULT_SERVICE_LINGER,
    DEFAULT_UNKNOWN_SERVICE_EXPIRY,
    Action,
    Assigned,
    BrokerMachine,
    Dropped,
    DropPeer,
    MarkUseful,
    Refused,
    Replied,
    Requested,
    Send,
    Traced,
    WakeAt,
    WorkerChanged,
)
from mdp.majordomo.broker_records import (  # noqa: F401  (the records, named in docs/changes.md)
    BrokerSnapshot,
    PeerKey,
    PendingRequest,
    WorkerRef,
    as_bytes,
)
from mdp.messages import text as label
from mdp.policy import LogThrottle, call_at, cancel_call, default_reactor
from mdp.transport.curve import curve_server
from mdp.transport.stream import StreamRouter

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

#: Dropped kinds that are invalid input (counted in ``Broker.invalid``)
_INVALID = frozenset({"malformed", "wrong-endpoint", "unexpected", "not-serving", "restart-marker"})
#: Dropped kinds that are worker replies not passed on
_REPLIES_DROPPED = frozenset({"stale", "void", "orphaned"})
#: Refused kinds of a READY; and those not logged (the client hears, or times out)
_READY_REFUSED = frozenset({"serve-forbidden", "ready"})
_QUIET_REFUSALS = frozenset({"passive", "expired", "unknown", "cancelled", "deadline"})
#: Refused kinds the metrics count: (BrokerMetrics method, label)
_COUNTED_REFUSALS = {"forbidden": ("deny", "call"), "serve-forbidden": ("deny", "serve"),
                     "overloaded": ("refuse", "overloaded"), "passive": ("refuse", "passive"),
                     "cancelled": ("giveUp", "cancelled"), "deadline": ("giveUp", "deadline")}
_WORKER_CHANGES = {
    "ready": "worker {peer} ready for {service}",
    "disconnected": "worker {peer} for {service} disconnected",
    "silent": "worker {peer} for {service} silent for {silence:.1f}s: removed",
    "answered-late": "accepted the late reply of worker {peer} for {service}: the broker had "
                     "given that worker up (silent, or gone), and the request was still queued",
    "released": "this broker is passive: sent DISCONNECT to worker {peer} for {service}, so "
                "it goes to the active one",
}


class Binding:
    """One bound transport of the broker and the roles it accepts.  Body frames,
    passed on unread, may arrive uncopied from ``keepFramesFrom`` on; ``copyOut``:
    this transport takes only ``bytes`` while another delivers buffers."""

    keepFramesFrom = 3
    #: it tells its transport which peers are useful (kept when it is full)
    marksUseful = True
    #: what MDP messages begin with: a ZeroMQ ROUTER takes any other first frame
    #: for a relay hop, and the peer behind it for a peer of its own
    relayHeaders = frozenset({b"", codec.CLIENT_HEADER, codec.WORKER_HEADER})

    def __init__(self, broker: Broker, clients: bool, workers: bool) -> None:
        self.broker = broker
        self.clients = clients
        self.workers = workers
        self.transport: Optional[IRouterTransport] = None
        self.copyOut = False

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        broker = self.broker
        machine = broker.machine
        identity = None
        if machine.access is not None:  # the peer as its transport authenticated it (CURVE key, TLS subject)
            peerIdentity = getattr(self.transport, "peerIdentity", None)
            identity = None if peerIdentity is None else peerIdentity(peer)
        try:
            actions = machine.handleMessage((self, peer), frames, broker.reactor.seconds(),
                                            self.clients, self.workers, identity)
        except Exception:
            log.failure("broker failed handling a message from {peer}", peer=peer.hex())
            actions = machine.actionsSoFar()
        broker._perform(actions)

    def peerDisconnected(self, peer: bytes) -> None:
        self.broker.peerGone((self, peer))


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Binding, IRouterReceiver)


class Broker:
    """An MDP/0.2 broker: a :class:`BrokerMachine` (``machine``, whose settings and
    state read through it) bound with :meth:`listen` or :meth:`streamFactory`.
    *metrics* (a :class:`mdp.metrics.BrokerMetrics`) counts; *logRequests* logs
    each request served."""

    def __init__(self, reactor: Optional[Any] = None, *, curveSecret: Optional[str] = None,
                 curveAllow: Optional[str] = None, metrics: Optional[Any] = None,
                 logRequests: bool = False, **options: Any) -> None:
        self.reactor = default_reactor(reactor)
        #: CURVE key pair and allow-list for zmq: endpoints (docs/security.md)
        self.curve = curve_server(curveSecret, curveAllow)
        self.machine = BrokerMachine(now=self.reactor.seconds(),
                                     observed=metrics is not None or logRequests,
                                     traced=tracing.available(), **options)
        self.metrics = metrics
        self.logRequests = logRequests
        self.invalid = 0
        self.throttle = LogThrottle(self.reactor)
        self.bindings: list[Binding] = []
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = self.reactor
        self._wakeCall: Any = None
        self._reporters: dict[type, Callable[[Any], None]] = {
            Dropped: self._dropped, Refused: self._refused, WorkerChanged: self._workerChanged,
            Replied: self._replied, MarkUseful: self._markUseful,
            Requested: lambda requested: None, Assigned: lambda assigned: None,
            Traced: lambda traced: tracing.record_queue_span(
                traced.service, traced.trace, traced.arrivedAt, traced.assignedAt)}
        if metrics is not None:
            self._reporters[Requested] = lambda requested: metrics.request(requested.service)
            self._reporters[Assigned] = lambda assigned: metrics.assigned(assigned.service, assigned.waited)
            metrics.watch(self)

    def __getattr__(self, name: str) -> Any:
        """The machine's settings and state, read through the broker."""
        if name.startswith("__") or name == "machine":
            raise AttributeError(name)
        return getattr(self.machine, name)

    admission = property(lambda self: self.machine.admission,
                         lambda self, admission: setattr(self.machine, "admission", admission),
                         doc="The machine's ``admission`` (settable: a Binary Star started later).")

    def received(self, key: PeerKey, frames: list[bytes]) -> None:
        """A message from peer *key*, a (binding, peer id)."""
        key[0].messageReceived(key[1], frames)

    def peerGone(self, key: PeerKey) -> None:
        self._perform(self.machine.handlePeerGone(key, self.reactor.seconds()))

    def admissionChanged(self) -> None:
        """Its admission changed state: a broker gone passive lets go now, not at its next tick."""
        self._perform(self.machine.handleAdmissionChange(self.reactor.seconds()))

    def tick(self) -> None:
        self._handle(self.machine.handleTick, "broker tick failed")

    def _wake(self) -> None:
        self._wakeCall = None
        self._handle(self.machine.handleWake, "broker wake-up failed")

    def _handle(self, event: Callable[[float], list[Action]], failed: str) -> None:
        """Perform what *event* decided, also when it or a send raised part-way: the
        tick must go on (heartbeats and expiries depend on it)."""
        try:
            self._perform(event(self.reactor.seconds()))
        except Exception:
            log.failure(failed)
            self._perform(self.machine.actionsSoFar())

    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            kind = type(action)
            if kind is Send:
                binding, peer = action.key
                transport = binding.transport
                if transport is not None:
                    frames = action.frames
                    transport.sendMessage(peer, as_bytes(frames) if binding.copyOut else frames)
            elif kind is DropPeer:
                binding, peer = action.key
                if binding.transport is not None:
                    binding.transport.disconnectPeer(peer)
            elif kind is WakeAt:
                self._wakeAt(action.time)
            else:
                self._reporters[kind](action)

    def _markUseful(self, mark: MarkUseful) -> None:
        markUseful = getattr(mark.key[0].transport, "markUseful", None)
        if markUseful is not None:
            markUseful(mark.key[1], mark.useful)

    def _wakeAt(self, when: float) -> None:
        call = self._wakeCall
        if call is None or not call.active() or call.getTime() > when:
            self._wakeCall = call_at(call, self.reactor, when, self._wake)

    def _dropped(self, dropped: Dropped) -> None:
        kind, metrics = dropped.kind, self.metrics
        if kind in _INVALID:
            self.invalid += 1
            self.throttle.warn(log, kind, "dropped invalid message from {peer}: {reason}",
                               peer=dropped.peer.hex(), reason=dropped.reason)
        else:
            self.throttle.info(log, kind, "dropped a message from {peer}: {reason}",
                               peer=dropped.peer.hex(), reason=dropped.reason)
        if metrics is not None:
            if kind in _REPLIES_DROPPED:
                metrics.dropped(kind)
            elif kind != "gone":
                metrics.reject(kind)

    def _refused(self, refused: Refused) -> None:
        kind, service, metrics = refused.kind, refused.service, self.metrics
        if metrics is not None:
            counted = _COUNTED_REFUSALS.get(kind)
            if counted is not None:
                getattr(metrics, counted[0])(service, counted[1])
            if refused.code is not None:
                metrics.replied(service, None, refused.code)
        if kind not in _QUIET_REFUSALS:
            self.throttle.warn(log, kind, "refused {what} for {service} from {peer}: {reason}",
                               what="READY" if kind in _READY_REFUSED else "a request",
                               service=label(service), peer=refused.peer.hex(),
                               reason=refused.reason)

    def _workerChanged(self, changed: WorkerChanged) -> None:
        change = changed.change
        fields = {"peer": changed.peer.hex(), "service": label(changed.service),
                  "silence": changed.silence}
        if change == "released":
            self.throttle.info(log, change, _WORKER_CHANGES[change], **fields)
        elif change == "silent":
            log.warn(_WORKER_CHANGES[change], **fields)
            if self.metrics is not None:
                self.metrics.expired(changed.service)
        else:
            log.info(_WORKER_CHANGES[change], **fields)

    def _replied(self, replied: Replied) -> None:
        if self.metrics is not None:
            self.metrics.replied(replied.service, replied.served, replied.code)
        if self.logRequests and replied.worker is not None:
            log.debug("{service}: request from client {client} served by worker {worker} in "
                      "{served:.4f}s after {queued:.4f}s queued", service=label(replied.service),
                      client=replied.client.hex(), worker=replied.worker.hex(),
                      served=replied.served, queued=replied.queued)

    def snapshot(self, serviceLimit: Optional[int] = None, workerLimit: Optional[int] = None,
                 service: Optional[bytes] = None, *,
                 visible: Optional[Callable[[bytes], bool]] = None) -> BrokerSnapshot:
        """:meth:`BrokerMachine.snapshot` now."""
        return self.machine.snapshot(serviceLimit, workerLimit, service, visible=visible,
                                     now=self.reactor.seconds())

    def isServiceAvailable(self, name: bytes) -> bool:
        """:meth:`BrokerMachine.isServiceAvailable` now."""
        return self.machine.isServiceAvailable(name, self.reactor.seconds())

    def listen(self, endpoint: str, clients: bool = True,
               workers: bool = True) -> defer.Deferred[IRouterTransport]:
        """Bind *endpoint* for clients, workers or both.  A malformed endpoint raises
        :class:`~mdp.errors.TransportError` at once; a failure to bind fails the Deferred."""
        binding = Binding(self, clients, workers)
        security = transport.curve_listen_for(endpoint, self.curve)
        transport.warn_if_open(endpoint, security, "MDP broker")
        return transport.listen(endpoint, binding, self.reactor, limits=self.machine.limits,
                                security=security).addCallback(partial(self._bind, binding))

    def streamFactory(self, clients: bool = True, workers: bool = True) -> IProtocolFactory:
        """An :class:`IProtocolFactory` served by this broker in the stream framing, to listen
        on a Twisted endpoint or TLS wrapper of one's own (docs/cli.md); :meth:`close` drops
        its connections, stopping the port is the caller's."""
        binding = Binding(self, clients, workers)
        router = StreamRouter(binding, self.reactor, limits=self.machine.limits)
        self._bind(binding, router)
        return router.factory()

    def _bind(self, binding: Binding, routerTransport: IRouterTransport) -> IRouterTransport:
        binding.transport = routerTransport
        self.bindings.append(binding)
        # frames delivered uncopied go out as bytes where a transport takes nothing else
        buffers = any(getattr(b.transport, "deliversBuffers", False) for b in self.bindings)
        for each in self.bindings:
            each.copyOut = buffers and not getattr(each.transport, "acceptsBuffers", False)
        roles = "+".join(r for r, on in (("clients", binding.clients), ("workers", binding.workers)) if on)
        if routerTransport.endpoint:
            log.info("MDP broker listening on {endpoint} for {roles}",
                     endpoint=routerTransport.endpoint, roles=roles)
        else:  # streamFactory: the caller listens
            log.info("MDP broker serving {roles} through a protocol factory", roles=roles)
        if not self._ticker.running:
            self._ticker.start(self.machine.wakeEvery, now=False)
        return routerTransport

    def close(self) -> defer.Deferred[None]:
        """Unbind every endpoint and stop the heartbeat tick."""
        if self._ticker.running:
            self._ticker.stop()
        self._wakeCall = cancel_call(self._wakeCall)
        bindings, self.bindings = self.bindings, []
        closing = [b.transport for b in bindings if b.transport is not None]
        self.machine.reset()
        return transport.close_all(closing, "a broker listener")


classImplements(Broker, IBroker)
