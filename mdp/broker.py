"""The MDP/0.2 broker state machine.

One :class:`ServiceQueue` per service holds the requests waiting for a worker
(served fairly: round-robin over clients) and the idle workers (least recently
used first).  A single timer tick per heartbeat interval sends heartbeats,
expires silent workers (re-queueing the request each held), expires queued
requests of services that have no worker and forgets services whose last worker
left more than ``serviceLinger`` seconds ago.

Memory is bounded: at most ``maxQueue`` queued requests in all and
``maxServiceQueue`` per service (beyond, a request is refused at once with a
429 error reply), and at most ``maxWorkers`` registered workers (beyond, READY
gets DISCONNECT).  Requests to ``mmi.*`` services are answered by the broker
itself (:mod:`mdp.mmi`).

The broker answers every peer in the dialect it used (see :mod:`mdp.codec`):
RFC 18, or majortomo's (an empty delimiter frame first, other client codes).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Optional, Sequence

import attrs
from twisted.internet import defer, task
from twisted.logger import Logger
from zope.interface import implementer

from mdp import codec, mmi, transport
from mdp.codec import (
    ClientFinal,
    ClientPartial,
    ClientRequest,
    Disconnect,
    Heartbeat,
    Ready,
    WorkerFinal,
    WorkerPartial,
)
from mdp.errors import ProtocolError
from mdp.interfaces import IBroker, IRouterReceiver, IRouterTransport
from mdp.policy import HeartbeatPolicy

log = Logger()

DEFAULT_REQUEST_EXPIRY = 30.0
DEFAULT_SERVICE_LINGER = 10.0
DEFAULT_MAX_QUEUE = 100_000
DEFAULT_MAX_SERVICE_QUEUE = 50_000
DEFAULT_MAX_WORKERS = 10_000


def peer_label(peer: bytes) -> str:
    """A printable form of an opaque peer id for logs."""
    return peer.hex()


@implementer(IRouterReceiver)
class Binding:
    """One bound transport of the broker and the roles it accepts."""

    def __init__(self, broker: Broker, clients: bool, workers: bool) -> None:
        self.broker = broker
        self.clients = clients
        self.workers = workers
        self.transport: Optional[IRouterTransport] = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.broker.messageReceived((self, peer), frames)

    def peerDisconnected(self, peer: bytes) -> None:
        self.broker.peerDisconnected((self, peer))

    def send(self, peer: bytes, frames: list[bytes]) -> None:
        if self.transport is not None:
            self.transport.sendMessage(peer, frames)


PeerKey = tuple[Binding, bytes]


@attrs.define(eq=False, slots=True)
class PendingRequest:
    """A client request the broker has accepted and not yet answered."""

    client: PeerKey
    service: bytes
    body: Sequence[bytes]
    dialect: str
    queuedAt: float


@attrs.define(eq=False, slots=True)
class WorkerRef:
    """The broker's view of one registered worker."""

    key: PeerKey
    service: ServiceQueue
    dialect: str
    lastSeen: float
    lastSent: float
    current: Optional[PendingRequest] = None


class QueueTotal:
    """Requests waiting in all of a broker's service queues, kept by the queues."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class ServiceQueue:
    """Requests waiting for one service and the workers able to serve it.

    Every change to its size is also counted in the broker-wide *total*."""

    def __init__(self, name: bytes, total: Optional[QueueTotal] = None) -> None:
        self.name = name
        self.total = total if total is not None else QueueTotal()
        self.pending: OrderedDict[PeerKey, deque[PendingRequest]] = OrderedDict()
        self.idle: OrderedDict[PeerKey, WorkerRef] = OrderedDict()
        self.workers = 0
        self.size = 0
        #: when the last worker left (None while the service has workers or never had one)
        self.abandonedAt: Optional[float] = None

    def enqueue(self, request: PendingRequest) -> None:
        queue = self.pending.get(request.client)
        if queue is None:
            queue = self.pending[request.client] = deque()
        queue.append(request)
        self._grow(1)

    def requeue(self, request: PendingRequest) -> None:
        """Put a request back at the head: it has waited longest."""
        queue = self.pending.get(request.client)
        if queue is None:
            queue = self.pending[request.client] = deque()
        queue.appendleft(request)
        self.pending.move_to_end(request.client, last=False)
        self._grow(1)

    def next_request(self) -> PendingRequest:
        """Round-robin over clients: take the first client's oldest request and
        move that client to the back."""
        client, queue = next(iter(self.pending.items()))
        request = queue.popleft()
        if queue:
            self.pending.move_to_end(client)
        else:
            del self.pending[client]
        self._grow(-1)
        return request

    def drop_client(self, client: PeerKey) -> int:
        queue = self.pending.pop(client, None)
        if not queue:
            return 0
        self._grow(-len(queue))
        return len(queue)

    def expire(self, deadline: float) -> list[PendingRequest]:
        """Remove and return requests queued at or before *deadline*."""
        expired = []
        for client in list(self.pending):
            queue = self.pending[client]
            while queue and queue[0].queuedAt <= deadline:
                expired.append(queue.popleft())
            if not queue:
                del self.pending[client]
        self._grow(-len(expired))
        return expired

    def _grow(self, by: int) -> None:
        self.size += by
        self.total.count += by


@implementer(IBroker)
class Broker:
    """An MDP/0.2 broker.  Bind it with :meth:`listen` (several times for
    separate client and worker endpoints)."""

    def __init__(
        self,
        reactor: Optional[Any] = None,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        requestExpiry: float = DEFAULT_REQUEST_EXPIRY,
        serviceLinger: float = DEFAULT_SERVICE_LINGER,
        maxQueue: int = DEFAULT_MAX_QUEUE,
        maxServiceQueue: int = DEFAULT_MAX_SERVICE_QUEUE,
        maxWorkers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.heartbeat = heartbeat
        self.requestExpiry = requestExpiry
        self.serviceLinger = serviceLinger
        self.maxQueue = maxQueue
        self.maxServiceQueue = maxServiceQueue
        self.maxWorkers = maxWorkers
        self._total = QueueTotal()
        self.bindings: list[Binding] = []
        self.services: dict[bytes, ServiceQueue] = {}
        self.workers: dict[PeerKey, WorkerRef] = {}
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = reactor

    # --- lifecycle -----------------------------------------------------------

    def listen(
        self, endpoint: str, clients: bool = True, workers: bool = True
    ) -> defer.Deferred[IRouterTransport]:
        """Bind *endpoint*; it accepts clients, workers or both."""
        binding = Binding(self, clients, workers)

        def bound(routerTransport: IRouterTransport) -> IRouterTransport:
            binding.transport = routerTransport
            self.bindings.append(binding)
            roles = "+".join(r for r, on in (("clients", clients), ("workers", workers)) if on)
            log.info("MDP broker listening on {endpoint} for {roles}",
                     endpoint=routerTransport.endpoint, roles=roles)
            if not self._ticker.running:
                self._ticker.start(self.heartbeat.interval, now=False)
            return routerTransport

        return transport.listen(endpoint, binding, self.reactor).addCallback(bound)

    def close(self) -> defer.Deferred[None]:
        """Unbind every endpoint and stop the heartbeat tick."""
        if self._ticker.running:
            self._ticker.stop()
        bindings, self.bindings = self.bindings, []
        closing = [b.transport.close() for b in bindings if b.transport is not None]
        self.workers.clear()
        self.services.clear()
        self._total = QueueTotal()
        return defer.DeferredList(closing).addCallback(lambda _: None)

    # --- inbound -------------------------------------------------------------

    def messageReceived(self, key: PeerKey, frames: list[bytes]) -> None:  # type: ignore[override]
        """Entry point for every message from every binding."""
        try:
            dialect, body = codec.split(frames)
            command = codec.decode(body, dialect)
        except ProtocolError as e:
            self._invalid(key, str(e))
            return
        try:
            kind = type(command)
            if kind is ClientRequest or kind is ClientPartial or kind is ClientFinal:
                if not key[0].clients:
                    self._invalid(key, "client command on a worker-only endpoint")
                elif kind is ClientRequest:
                    self._onRequest(key, command, dialect)  # type: ignore[arg-type]
                else:
                    log.warn("dropping {command} from client {peer}: only REQUEST is valid",
                             command=kind.__name__, peer=peer_label(key[1]))
            elif not key[0].workers:
                self._invalid(key, "worker command on a client-only endpoint")
            else:
                self._onWorkerCommand(key, command, dialect)
        except Exception:
            log.failure("broker failed handling a message from {peer}", peer=peer_label(key[1]))

    def peerDisconnected(self, key: PeerKey) -> None:  # type: ignore[override]
        """A stream transport lost a peer: forget it at once."""
        worker = self.workers.get(key)
        if worker is not None:
            log.info("worker {peer} for {service} disconnected",
                     peer=peer_label(key[1]), service=worker.service.name)
            self._removeWorker(worker)
        for service in list(self.services.values()):
            service.drop_client(key)
            self._forgetIfEmpty(service)

    # --- clients ------------------------------------------------------------

    def _onRequest(self, key: PeerKey, command: ClientRequest, dialect: str) -> None:
        request = PendingRequest(key, command.service, command.body, dialect, self.reactor.seconds())
        if command.service.startswith(mmi.PREFIX):
            self._reply(request, mmi.answer(self, command.service, command.body), final=True)
            return
        service = self.services.get(command.service)
        if service is not None and service.idle and not service.size:
            # a worker is waiting and no request is ahead: hand it over
            self._assign(service.idle.popitem(last=False)[1], request)
            return
        queued = service.size if service is not None else 0
        if self.queued >= self.maxQueue or queued >= self.maxServiceQueue:
            log.warn("refused a request for {service} from {peer}: queue full "
                     "({queued} for the service, {total} in all)",
                     service=command.service, peer=peer_label(key[1]),
                     queued=queued, total=self.queued)
            self._reply(request, codec.error_body(
                codec.STATUS_OVERLOADED,
                f"broker queue full for service {command.service.decode('ascii')!r}",
            ), final=True)
            return
        if service is None:
            service = self._service(command.service)
        service.enqueue(request)
        self._dispatch(service)

    def _service(self, name: bytes) -> ServiceQueue:
        service = self.services.get(name)
        if service is None:
            service = self.services[name] = ServiceQueue(name, self._total)
        return service

    def _forgetIfEmpty(self, service: ServiceQueue) -> None:
        """Drop a service with no worker and no request, once its linger is over."""
        if service.workers or service.size or self.services.get(service.name) is not service:
            return
        if not self._lingering(service):
            del self.services[service.name]

    def isServiceAvailable(self, name: bytes) -> bool:
        """True if *name* has a live worker, or lost its last one less than
        ``serviceLinger`` seconds ago (workers restarting keep it known)."""
        service = self.services.get(name)
        if service is None:
            return False
        return bool(service.workers) or self._lingering(service)

    def _lingering(self, service: ServiceQueue) -> bool:
        """Its last worker left less than ``serviceLinger`` seconds ago."""
        return (service.abandonedAt is not None
                and self.reactor.seconds() - service.abandonedAt < self.serviceLinger)

    @property
    def queued(self) -> int:
        """Requests waiting in all service queues."""
        return self._total.count

    def _reply(self, request: PendingRequest, body: Sequence[bytes], final: bool) -> None:
        client = request.client
        client[0].send(client[1], codec.encode_client_reply(request.service, body, final,
                                                            request.dialect))

    # --- workers ------------------------------------------------------------

    def _onWorkerCommand(self, key: PeerKey, command: Any, dialect: str) -> None:
        worker = self.workers.get(key)
        kind = type(command)
        if worker is None:
            if kind is Ready and len(self.workers) >= self.maxWorkers:
                log.warn("refused READY from {peer}: {count} workers already registered",
                         peer=peer_label(key[1]), count=len(self.workers))
                self._send(key, dialect, codec.DISCONNECT)
            elif kind is Ready:
                self._register(key, command.service, dialect)
            elif kind is not Disconnect:
                log.warn("{command} from unregistered worker {peer}: sending DISCONNECT",
                         command=kind.__name__, peer=peer_label(key[1]))
                self._send(key, dialect, codec.DISCONNECT)
            return
        worker.lastSeen = self.reactor.seconds()
        if kind is Heartbeat:
            return
        if kind is WorkerFinal or kind is WorkerPartial:
            request = worker.current
            if request is None:
                self._unexpected(worker, f"{kind.__name__} while idle")
            elif command.client != request.client[1]:
                self._invalid(key, f"{kind.__name__} addressed to a client it does not serve")
            elif kind is WorkerPartial:
                self._reply(request, command.body, final=False)
            else:
                self._reply(request, command.body, final=True)
                worker.current = None
                self._makeIdle(worker)
                self._dispatch(worker.service)
        elif kind is Disconnect:
            log.info("worker {peer} for {service} disconnected",
                     peer=peer_label(key[1]), service=worker.service.name)
            self._removeWorker(worker)
        else:  # READY again, or REQUEST from a worker: valid but unexpected
            self._unexpected(worker, f"{kind.__name__} from a registered worker")

    def _register(self, key: PeerKey, name: bytes, dialect: str) -> None:
        now = self.reactor.seconds()
        service = self._service(name)
        worker = WorkerRef(key, service, dialect, now, now)
        self.workers[key] = worker
        service.workers += 1
        service.abandonedAt = None
        log.info("worker {peer} ready for {service}", peer=peer_label(key[1]), service=name)
        self._makeIdle(worker)
        self._dispatch(service)

    def _makeIdle(self, worker: WorkerRef) -> None:
        worker.service.idle[worker.key] = worker

    def _dispatch(self, service: ServiceQueue) -> None:
        """Hand queued requests to idle workers, least recently used first."""
        while service.size and service.idle:
            _, worker = service.idle.popitem(last=False)
            self._assign(worker, service.next_request())

    def _assign(self, worker: WorkerRef, request: PendingRequest) -> None:
        """Send *request* to the idle *worker*."""
        worker.current = request
        key = worker.key
        key[0].send(key[1], codec.encode_worker_request(request.client[1], request.body,
                                                         worker.dialect))
        worker.lastSent = self.reactor.seconds()

    def _removeWorker(self, worker: WorkerRef) -> None:
        """Forget *worker*; re-queue the request it held (workers are idempotent)."""
        if self.workers.pop(worker.key, None) is None:
            return
        service = worker.service
        service.idle.pop(worker.key, None)
        service.workers -= 1
        if not service.workers:
            service.abandonedAt = self.reactor.seconds()
        request, worker.current = worker.current, None
        if request is not None:
            # accepted work is never dropped, even past the queue bounds
            service.requeue(request)
            self._dispatch(service)
        self._forgetIfEmpty(service)

    def _unexpected(self, worker: WorkerRef, what: str) -> None:
        log.warn("unexpected {what} from worker {peer}: sending DISCONNECT",
                 what=what, peer=peer_label(worker.key[1]))
        self._send(worker.key, worker.dialect, codec.DISCONNECT)
        self._removeWorker(worker)

    def _invalid(self, key: PeerKey, reason: str) -> None:
        """Drop an invalid message; a registered worker that sent it is no
        longer trusted and is disconnected."""
        log.warn("dropped invalid message from {peer}: {reason}",
                 peer=peer_label(key[1]), reason=reason)
        worker = self.workers.get(key)
        if worker is not None:
            self._send(key, worker.dialect, codec.DISCONNECT)
            self._removeWorker(worker)

    def _send(self, key: PeerKey, dialect: str, command: Any) -> None:
        key[0].send(key[1], codec.encode(command, dialect))

    # --- time ----------------------------------------------------------------

    def tick(self) -> None:
        """Once per heartbeat interval: heartbeats, dead workers, expired requests."""
        now = self.reactor.seconds()
        interval = self.heartbeat.interval
        expiry = self.heartbeat.expiry
        for worker in list(self.workers.values()):
            if now - worker.lastSeen > expiry:
                log.warn("worker {peer} for {service} silent for {silence:.1f}s: removed",
                         peer=peer_label(worker.key[1]), service=worker.service.name,
                         silence=now - worker.lastSeen)
                self._removeWorker(worker)
            elif now - worker.lastSent >= interval / 2:
                self._send(worker.key, worker.dialect, codec.HEARTBEAT)
                worker.lastSent = now
        deadline = now - self.requestExpiry
        for service in list(self.services.values()):
            if not service.workers and service.size:
                for request in service.expire(deadline):
                    self._reply(request, codec.error_body(
                        codec.STATUS_UNAVAILABLE,
                        f"no worker for service {service.name.decode('ascii')!r} within "
                        f"{self.requestExpiry:g}s",
                    ), final=True)
            self._forgetIfEmpty(service)
