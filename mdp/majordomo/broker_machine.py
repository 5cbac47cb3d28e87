"""The MDP/0.2 broker's decisions: :class:`BrokerMachine` takes events with their
time and returns actions (states and transitions: :mod:`mdp.majordomo.broker_records`).
An ``admission`` (e.g. Binary Star) votes on each request and READY: a passive
broker answers only ``mmi.binarystar``."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import OrderedDict, deque
from typing import Any, Callable, Optional, Sequence

from mdp.errors import ProtocolError
from mdp.interfaces import IAccess, IAdmission
from mdp.machine import Machine, action_type
from mdp.majordomo import codec, extension, mmi
from mdp.majordomo.broker_records import (
    ANSWERED,
    ASSIGNED,
    BUSY,
    DONE,
    GONE,
    IDLE,
    QUEUED,
    BrokerSnapshot,
    PeerKey,
    PendingRequest,
    QueueLedger,
    RequestState,
    ServiceQueue,
    ServiceSnapshot,
    WorkerRef,
    WorkerSnapshot,
    as_bytes,
)
from mdp.majordomo.codec import (
    RFC,
    W_REQUEST,
    ClientCancel,
    ClientFinal,
    ClientPartial,
    ClientRequest,
    Disconnect,
    Heartbeat,
    Ready,
    WorkerCancel,
    WorkerFinal,
    WorkerPartial,
    encode_client_reply,
    encode_worker,
    parse,
    split,
)
from mdp.messages import relay_hop
from mdp.messages import text as label
from mdp.policy import FRAME_OVERHEAD, HeartbeatPolicy, Limits, Liveness, MiB, whole_number

DEFAULT_REQUEST_EXPIRY = 30.0
DEFAULT_SERVICE_LINGER = 10.0
DEFAULT_MAX_QUEUE = 100_000
DEFAULT_MAX_SERVICE_QUEUE = 50_000
DEFAULT_MAX_QUEUE_BYTES = 1024 * MiB
DEFAULT_MAX_SERVICE_QUEUE_BYTES = 512 * MiB
DEFAULT_MAX_WORKERS = 10_000
DEFAULT_MAX_SERVICE_WORKERS = 1_000
DEFAULT_MAX_DELIVERIES = 20
#: seconds a request for an unregistered service waits: under a client's default
#: budget (3 attempts of 2.5 s), so that it hears 503 rather than a timeout
DEFAULT_UNKNOWN_SERVICE_EXPIRY = 5.0

#: bytes and frames a worker REQUEST adds to the body besides the client's peer id
_REQUEST_OVERHEAD = len(codec.WORKER_HEADER) + 1 + 8
_REQUEST_FRAMES = 5
_MMI_PREFIX = mmi.PREFIX
#: asked of a broker whatever its Binary Star state, and no client's vote for it
_NO_VOTE = frozenset({mmi.BINARYSTAR, extension.MMI_EXTENSIONS})
_CLIENT_COMMANDS = frozenset({ClientRequest, ClientPartial, ClientFinal, ClientCancel})

#: workers remembered as told DISCONNECT
MAX_GONE = 10_000
#: assignments taken back from lost workers remembered for a late FINAL
MAX_TAKEN_BACK = 1024
#: empty unregistered services kept so that retries share one expiry window
MAX_UNKNOWN_KEPT = 10_000
#: clients remembered as useful (more: the idle are forgotten early)
MAX_USEFUL_CLIENTS = 100_000
#: seconds a client stays useful after its last request left the broker (at
#: most twice that and a tick): an idle connection may make room again
USEFUL_GRACE = 10.0


def _remember(table: dict[Any, Any], key: Any, value: Any) -> None:
    """*table*[*key*] = *value*, newest last; past ``MAX_USEFUL_CLIENTS`` keys the oldest goes."""
    table.pop(key, None)
    table[key] = value
    if len(table) > MAX_USEFUL_CLIENTS:
        del table[next(iter(table))]


def _who(identity: Optional[str]) -> str:
    return "an unauthenticated peer" if identity is None else f"peer {identity!r}"


_action = functools.partial(action_type, __name__)
Send = _action("Send", "key", "frames")
#: close peer *key*'s connection once its output is sent (if it has one)
DropPeer = _action("DropPeer", "key")
#: peer *key* is *useful* (its connection is kept when its listener is full), or no
#: more: a worker of a service a request went to, a client of one with workers
MarkUseful = _action("MarkUseful", "key", "useful")
#: call :meth:`BrokerMachine.handleWake` at *time*
WakeAt = _action("WakeAt", "time")
#: a message from *peer* was not acted on: *kind* (a metric label) and *reason* say why
Dropped = _action("Dropped", "peer", "kind", "reason")
#: a request (or READY) of *peer* for *service* was refused with error reply *code*
#: (None: no reply); *kind* says why in a word
Refused = _action("Refused", "peer", "service", "code", "kind", "reason")
#: a worker is "ready", "disconnected", "silent" (after *silence* seconds),
#: "released" (passive broker) or "answered-late"
WorkerChanged = _action("WorkerChanged", "peer", "service", "change", "silence")
#: while ``observed``: a request for *service* came; it went to a worker after *waited* s
Requested = _action("Requested", "service")
Assigned = _action("Assigned", "service", "waited")
#: while ``observed``: a FINAL went to *client*, *code* its error status or None;
#: *served* seconds by *worker* after *queued* seconds (None, None: the broker's own)
Replied = _action("Replied", "service", "code", "client", "worker", "served", "queued")
#: while ``traced``: a request with a W3C *trace* context waited from *arrivedAt* to *assignedAt*
Traced = _action("Traced", "service", "trace", "arrivedAt", "assignedAt")
Action = Any  # one of the classes above


class BrokerMachine(Machine):
    """The broker's decisions: each ``handle*`` event returns the actions wanted, in order."""

    def __init__(self, *, heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
                 requestExpiry: float = DEFAULT_REQUEST_EXPIRY,
                 serviceLinger: float = DEFAULT_SERVICE_LINGER, maxQueue: int = DEFAULT_MAX_QUEUE,
                 maxServiceQueue: int = DEFAULT_MAX_SERVICE_QUEUE,
                 maxWorkers: int = DEFAULT_MAX_WORKERS, maxQueueBytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 maxServiceQueueBytes: int = DEFAULT_MAX_SERVICE_QUEUE_BYTES,
                 maxServiceWorkers: int = DEFAULT_MAX_SERVICE_WORKERS,
                 maxDeliveries: int = DEFAULT_MAX_DELIVERIES,
                 unknownServiceExpiry: float = DEFAULT_UNKNOWN_SERVICE_EXPIRY,
                 limits: Limits = Limits(), admission: Optional[IAdmission] = None,
                 access: Optional[IAccess] = None, observed: bool = False, traced: bool = False,
                 now: float = 0.0) -> None:
        if not unknownServiceExpiry > 0:
            raise ValueError(f"unknownServiceExpiry must be positive, got {unknownServiceExpiry}")
        super().__init__(now)
        self.heartbeat = heartbeat
        self.requestExpiry = requestExpiry
        self.unknownServiceExpiry = unknownServiceExpiry
        self.serviceLinger = serviceLinger
        self.maxQueue = maxQueue
        self.maxServiceQueue = maxServiceQueue
        self.maxQueueBytes = maxQueueBytes
        self.maxServiceQueueBytes = maxServiceQueueBytes
        self.maxWorkers = maxWorkers
        self.maxServiceWorkers = maxServiceWorkers
        self.maxDeliveries = whole_number("maxDeliveries", maxDeliveries)
        self.limits = limits
        self.admission = admission
        #: who may call and serve what (None: anyone, anything)
        self.access = access
        self.observed = observed
        self.traced = traced  # report each traced request's queue wait (Traced)
        self._assignments = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget every worker, service and queued request."""
        self._ledger = QueueLedger()
        #: services whose last worker left, by when (checked for linger's end)
        self._abandoned: deque[tuple[float, ServiceQueue]] = deque()
        self.services: dict[bytes, ServiceQueue] = {}
        self.workers: dict[PeerKey, WorkerRef] = {}
        #: services no worker has registered for, by when they are given up
        self._unknown: deque[tuple[float, ServiceQueue]] = deque()
        #: when the admission last began to admit clients (None: it refuses)
        self._activeSince: Optional[float] = None
        #: a Binary Star peer is active: no dispatch, workers are let go
        self._passive = False
        #: envelopes of assignments taken back from lost workers (see _late)
        self._takenBack: OrderedDict[bytes, tuple[PeerKey, PendingRequest]] = OrderedDict()
        #: workers told DISCONNECT or that said it, by when: all but READY dropped for an expiry
        self._gone: OrderedDict[PeerKey, float] = OrderedDict()
        #: the clients marked useful: heard (or holding a request) this round, and
        #: in the round before; when the next round begins (:meth:`_sweepClients`)
        self._usefulClients: dict[PeerKey, None] = {}
        self._usefulBefore: dict[PeerKey, None] = {}
        self._sweepAt = self.now + USEFUL_GRACE
        #: (deadline, id, request) of queued requests with a deadline; stale entries are skipped
        self._deadlines: list[tuple[float, int, PendingRequest]] = []
        #: each client's latest request that came with a context: what its CANCEL is for
        self._latest: dict[PeerKey, PendingRequest] = {}
        #: peers that asked ``mmi.extensions``: a worker among them takes CANCEL and contexts
        self._declared: dict[PeerKey, bool] = {}
        self._outbox = []

    @property
    def wakeEvery(self) -> float:
        """How often :meth:`handleTick` wants to run: one heartbeat interval."""
        return self.heartbeat.interval

    def handleMessage(self, key: PeerKey, frames: list[bytes], now: float, clients: bool = True,
                      workers: bool = True, identity: Optional[str] = None) -> list[Action]:
        """A message from peer *key*, on a route accepting *clients* and/or *workers*;
        *identity* is the peer as its transport authenticated it, for the ``access``."""
        self.now = now
        dialect, body = split(frames)
        if dialect is not RFC:
            body = as_bytes(body)  # the codec reads non-RFC frames only as bytes
        try:
            kind, address, body = parse(body, dialect)
        except ProtocolError as e:
            self._invalid(key, "malformed", str(e))
            return self._drain()
        if kind in _CLIENT_COMMANDS:
            if not clients and address != extension.MMI_EXTENSIONS:  # (a worker asks it too)
                self._invalid(key, "wrong-endpoint", "client command on a worker-only endpoint")
            elif kind is ClientRequest:
                self._request(key, address, body, dialect, identity)
            elif kind is ClientCancel:
                self._cancel(key, address)
            else:
                self._invalid(key, "unexpected", f"client sent {kind.__name__}: only REQUEST is valid")
        elif not workers:
            self._invalid(key, "wrong-endpoint", "worker command on a client-only endpoint")
        else:
            worker = self.workers.get(key)
            if worker is None:
                self._fromUnregistered(key, kind, address, body, dialect, identity)
            else:
                self._fromWorker(worker, kind, address, body)
        return self._drain()

    def handlePeerGone(self, key: PeerKey, now: float) -> list[Action]:
        """A transport lost the peer *key* (or cut it off)."""
        self.now = now
        worker = self.workers.get(key)
        if worker is not None:
            self._removeWorker(worker, "disconnected")
        for service in list(self._ledger.byClient.get(key, ())):
            service.dropClient(key)
            self._forgetIfEmpty(service)
        self._declared.pop(key, None)
        request = self._latest.pop(key, None)
        if request is not None and request.state is ASSIGNED:
            holder = self.workers.get(request.holder)
            if holder is not None and holder.extended:
                self._tellCancelled(holder, request, "its client is gone")
        self._usefulClients.pop(key, None)
        self._usefulBefore.pop(key, None)
        return self._drain()

    def handleAdmissionChange(self, now: float) -> list[Action]:
        """The admission (a Binary Star pair) changed state: act on it now."""
        self.now = now
        if self.admission is not None:
            self._checkAdmission(now)
        return self._drain()

    def handleWake(self, now: float) -> list[Action]:
        """The wake-up asked for with :class:`WakeAt`."""
        self.now = now
        self._giveUpUnknown(now)
        self._lapseDeadlines(now)
        return self._drain()

    # --- the read-only view (what MMI and operators read) --------------------

    @property
    def queued(self) -> int:
        """Requests waiting in all service queues."""
        return self._ledger.count

    @property
    def queuedBytes(self) -> int:
        """Bytes of request bodies waiting in all service queues."""
        return self._ledger.bytes

    def clientCount(self) -> int:
        """Clients with a request in the broker (queued or with a worker)."""
        return len(self._clientsWithRequests())

    def _clientsWithRequests(self) -> set[PeerKey]:
        clients = set(self._ledger.byClient)
        clients.update(w.current.client for w in self.workers.values() if w.current is not None)
        return clients

    def isServiceAvailable(self, name: bytes, now: Optional[float] = None) -> bool:
        """True if *name* has a live worker, or lost its last within ``serviceLinger`` of *now*."""
        service = self.services.get(name)
        if service is None or service.workers:
            return service is not None
        return (service.abandonedAt is not None
                and (self.now if now is None else now) - service.abandonedAt < self.serviceLinger)

    def admissionStatus(self, now: Optional[float] = None) -> Optional[dict[str, Any]]:
        """What the ``admission`` says of itself (``mmi.binarystar``), or None."""
        if self.admission is None:
            return None
        return self.admission.status(self.now if now is None else now)

    def snapshot(self, serviceLimit: Optional[int] = None, workerLimit: Optional[int] = None,
                 service: Optional[bytes] = None, *,
                 visible: Optional[Callable[[bytes], bool]] = None,
                 now: Optional[float] = None) -> BrokerSnapshot:
        """The broker at *now* (default: the current event's time): its services
        by name and workers in registration order, with totals.  *serviceLimit*,
        *workerLimit* and *service* narrow the lists; *visible* filters services
        and their workers (but with *serviceLimit* 0 the total is of all)."""
        at = self.now if now is None else now
        if visible is None or serviceLimit == 0:
            shown: Any = self.services  # (no services wanted: their total unfiltered)
        else:
            shown = [name for name in self.services if visible(name)]
        names = sorted(shown) if serviceLimit is None else heapq.nsmallest(serviceLimit, shown)
        queues = [self.services[name] for name in names]
        chosen = [w for w in self.workers.values()
                  if (service is None or w.service.name == service)
                  and (visible is None or visible(w.service.name))]
        return BrokerSnapshot(
            at, tuple(ServiceSnapshot(q.name, len(q.idle), q.workers - len(q.idle), q.size, q.bytes)
                      for q in queues),
            tuple(WorkerSnapshot(w.key[1].hex(), w.service.name, w.dialect, w.state is BUSY,
                                 w.liveness.silence(at)) for w in chosen[:workerLimit]),
            len(shown), len(chosen), self._ledger.count, self._ledger.bytes)

    # --- clients ------------------------------------------------------------

    def _request(self, key: PeerKey, name: bytes, body: Sequence[bytes], dialect: str,
                 identity: Optional[str]) -> None:
        content = sum(map(len, body))
        request = PendingRequest(key, name, body, dialect, self.now, content + FRAME_OVERHEAD * len(body))
        if self.observed:
            self._emit(Requested(name))
        if not self._admitted(request, identity):
            return
        extra = 0  # what its context adds to the worker's REQUEST, at most
        if extension.has_context(body):
            extra = len(body[0]) + 16
            content -= len(body[0])
            try:
                self._withContext(request, content)
            except ProtocolError as e:
                self._refuse(request, codec.STATUS_BAD_REQUEST, "bad-context", f"request context: {e}")
                return
            body = request.body
        if name == extension.MMI_EXTENSIONS:  # (a worker asks before its READY: it takes them)
            _remember(self._declared, key, True)
        if name.startswith(_MMI_PREFIX):  # (about the services *identity* may call)
            visible = None if self.access is None else functools.partial(self.access.mayCall, identity)
            request.state = DONE
            self._reply(request, mmi.answer(self, name, body, visible), True)
            if self.observed:
                self._emit(Replied(name, None, key[1], None, None, 0.0))
            return
        tooLarge = self.limits.oversize(content + extra + len(key[1]) + _REQUEST_OVERHEAD,
                                        len(body) + _REQUEST_FRAMES + (extra > 0))
        if tooLarge is not None:
            self._refuse(request, codec.STATUS_TOO_LARGE, "too-large",
                         f"request too large for a worker: {tooLarge}")
            return
        service = self.services.get(name)
        if service is not None and service.idle and not service.size:
            self._assign(service.idle.popitem(last=False)[1], request)
        elif self._queueHasRoom(service, request):
            self._enqueue(service, request)
        if request.context is not None and request.state is not DONE:  # (what a CANCEL is for)
            _remember(self._latest, key, request)

    def _withContext(self, request: PendingRequest, content: int) -> None:
        """*request*'s body begins with a context: taken out (*content* bytes are left), its
        deadline set."""
        context, body = extension.split_context(request.body)
        request.body = body
        request.size = content + FRAME_OVERHEAD * len(body)
        request.context = context
        if context.deadline is not None:
            request.deadline = self.now + context.deadline / 1000

    def _forgetLatest(self, request: PendingRequest) -> None:
        """*request* is over: no CANCEL is for it (nor its body held for one)."""
        if self._latest.get(request.client) is request:
            del self._latest[request.client]

    def _cancel(self, key: PeerKey, name: bytes) -> None:
        """Client *key* cancels its latest request to *name*: dropped if queued; its worker told,
        if it takes CANCEL (else the client is answered now and the worker's reply dropped)."""
        request = self._latest.get(key)
        if request is None or request.service != name or (request.state is not QUEUED
                                                          and request.state is not ASSIGNED):
            self._emit(Dropped(key[1], "cancel-unknown",
                               f"CANCEL for {label(name)!r}: no request of this client in hand"))
            return
        del self._latest[key]
        if request.state is QUEUED:
            service = self.services[request.service]
            service.remove(request)
            self._refuse(request, extension.STATUS_CANCELLED, "cancelled",
                         "cancelled by its client while queued")
            self._forgetIfEmpty(service)
        elif self.workers[request.holder].extended:
            self._tellCancelled(self.workers[request.holder], request, "cancelled by its client")
        else:  # the worker cannot be told: the client hears now, the worker's reply is void
            self._refuse(request, extension.STATUS_CANCELLED, "cancelled",
                         "cancelled by its client while served", ANSWERED)

    def _tellCancelled(self, worker: WorkerRef, request: PendingRequest, why: str) -> None:
        """Send CANCEL to the (extended) *worker* serving *request*; it still answers it (if
        the worker is lost first, the request is not run again)."""
        request.givenUp = True
        self._emit(Send(worker.key, codec.encode(WorkerCancel(request.envelope), worker.dialect)))
        self._emit(Refused(request.client[1], request.service, None, "cancelled", why))

    def _lapse(self, request: PendingRequest) -> None:
        """*request*, out of its queue, is past its deadline: 504."""
        waited = self.now - request.arrivedAt
        self._refuse(request, extension.STATUS_DEADLINE, "deadline",
                     f"its deadline passed after {waited:.3f}s in the broker, before a worker took it")

    def _lapseDeadlines(self, now: float) -> None:
        """504 to each queued request past its deadline; a wake-up for the next."""
        heap = self._deadlines
        while heap and heap[0][0] <= now + 1e-9:
            request = heapq.heappop(heap)[2]
            if request.state is QUEUED:
                service = self.services[request.service]
                service.remove(request)
                self._lapse(request)
                self._forgetIfEmpty(service)
        if heap:
            self._emit(WakeAt(heap[0][0]))

    def _watchDeadline(self, request: PendingRequest) -> None:
        """A queued *request* with a deadline: a wake-up by then."""
        heap = self._deadlines
        if len(heap) > 2 * self._ledger.count + 1024:  # stale entries are many: drop them
            heap[:] = [e for e in heap if e[2].state is QUEUED]
            heapq.heapify(heap)
        if not heap or request.deadline < heap[0][0]:
            self._emit(WakeAt(request.deadline))
        heapq.heappush(heap, (request.deadline, id(request), request))

    def _admitted(self, request: PendingRequest, identity: Optional[str]) -> bool:
        """The admission's vote (not serving, the client times out and tries another
        broker; ``mmi.binarystar`` and ``mmi.extensions`` always pass), then the access
        policy's (every peer may ask ``mmi.*``)."""
        name, now = request.service, self.now
        if self.admission is not None and name not in _NO_VOTE:
            if not self.admission.admitClient(now):
                self._activeSince = None
                self._refuse(request, None, "passive", "this broker is passive")
                return False
            if self._activeSince is None:
                self._activeSince = now
            self._passive = False  # admitted: active now, even before a tick says so
        if self.access is None or name.startswith(_MMI_PREFIX) or self.access.mayCall(identity, name):
            return True
        self._refuse(request, codec.STATUS_FORBIDDEN, "forbidden",
                     f"{_who(identity)} may not call {name.decode('ascii')!r}")
        return False

    def _queueHasRoom(self, service: Optional[ServiceQueue], request: PendingRequest) -> bool:
        """Within the queue bounds with *request*; else it gets a 429."""
        queued = service.size if service is not None else 0
        queuedBytes = service.bytes if service is not None else 0
        ledger = self._ledger
        if (ledger.count < self.maxQueue and queued < self.maxServiceQueue
                and ledger.bytes + request.size <= self.maxQueueBytes
                and queuedBytes + request.size <= self.maxServiceQueueBytes):
            return True
        self._refuse(request, codec.STATUS_OVERLOADED, "overloaded",
                     f"broker queue full for service {request.service.decode('ascii')!r} "
                     f"({queued} requests, {queuedBytes} bytes queued for it; "
                     f"{ledger.count} requests, {ledger.bytes} bytes in all)")
        return False

    def _enqueue(self, service: Optional[ServiceQueue], request: PendingRequest) -> None:
        if service is None:
            service = self.services[request.service] = ServiceQueue(request.service, self._ledger)
            # in ``unknownServiceExpiry``, but not before the workers of a broker just
            # become active (Binary Star failover) can find it: interval × (liveness + 1)
            deadline = self.now + min(self.unknownServiceExpiry, self.requestExpiry)
            if self._activeSince is not None:
                beat = self.heartbeat
                learning = self._activeSince + beat.interval * (beat.liveness + 1)
                deadline = max(deadline, min(learning, self.now + self.requestExpiry))
            service.unknownUntil = deadline
            service.askedAt = self.now
            if not self._unknown:
                self._emit(WakeAt(deadline))
            self._unknown.append((deadline, service))
        service.enqueue(request)
        if request.deadline is not None:
            self._watchDeadline(request)
        if service.registered and request.client not in self._usefulClients:
            self._usefulClient(request.client)
        self._dispatch(service)

    def _usefulClient(self, key: PeerKey) -> None:
        """Client *key* asked for a service with workers: marked useful unless it still is."""
        useful = self._usefulClients
        useful[key] = None
        if key not in self._usefulBefore:
            self._emit(MarkUseful(key, True))
        if len(useful) > MAX_USEFUL_CLIENTS:
            self._sweepAt = self.now  # (at the next tick: the idle are forgotten sooner)

    def _sweepClients(self) -> None:
        """Once a round (``USEFUL_GRACE``): clients neither heard nor holding a
        request in this round and the one before are useful no more; those holding
        one stay another round."""
        if self.now < self._sweepAt:
            return
        self._sweepAt = self.now + USEFUL_GRACE
        old, recent, busy = self._usefulBefore, self._usefulClients, self._clientsWithRequests()
        for key in old:
            if key not in busy and key not in recent and key not in self.workers:
                self._emit(MarkUseful(key, False))
        self._usefulBefore = recent
        self._usefulClients = dict.fromkeys(key for key in (*old, *recent) if key in busy)

    def _usefulWorkers(self, service: ServiceQueue, worker: WorkerRef) -> None:
        """*service* is wanted: *worker* and its idle ones marked useful, once each."""
        service.wanted = True
        for each in (worker, *service.idle.values()):
            if not each.useful:
                each.useful = True
                self._emit(MarkUseful(each.key, True))

    def _refuse(self, request: PendingRequest, code: Optional[bytes], kind: str, message: str,
                state: RequestState = DONE) -> None:
        """Answer *request* at once with error reply *code* (None: none), leaving it in *state*."""
        request.state = state
        if request.context is not None:
            self._forgetLatest(request)
        if code is not None:
            self._reply(request, codec.error_body(code, message), final=True)
        self._emit(Refused(request.client[1], request.service, code, kind, message))

    def _forgetIfEmpty(self, service: ServiceQueue) -> None:
        """Drop a service with no worker and no request, once its linger is over."""
        if service.workers or service.size or self.services.get(service.name) is not service:
            return
        if (not service.registered and service.unknownUntil > self.now
                and len(self._unknown) <= MAX_UNKNOWN_KEPT):
            return  # a retry of its requests waits in the same window
        if service.abandonedAt is None or self.now - service.abandonedAt >= self.serviceLinger:
            del self.services[service.name]  # (else it lingers)

    def _reply(self, request: PendingRequest, body: Sequence[bytes], final: bool) -> None:
        frames = encode_client_reply(request.service, body, final, request.dialect)
        self._outbox.append(Send(request.client, frames))

    # --- workers ------------------------------------------------------------

    def _fromWorker(self, worker: WorkerRef, kind: type, address: bytes, body: Sequence[bytes]) -> None:
        worker.liveness.heard(self.now)
        if kind is WorkerFinal or kind is WorkerPartial:
            request = worker.current
            if (request is not None and address == request.envelope
                    and (kind is WorkerFinal or len(body) != 1
                         or body[0] != codec.RESTART_MARKER)):
                self._replyPart(worker, request, body, kind is WorkerFinal)
            else:
                self._misdirected(worker, kind, address)
        elif kind is Disconnect:
            self._removeWorker(worker, "disconnected")
            self._markGone(worker.key)
        elif kind is not Heartbeat:  # READY again, or REQUEST: valid but unexpected
            self._invalid(worker.key, "unexpected",
                          f"unexpected {kind.__name__} from a registered worker: sending DISCONNECT")

    def _misdirected(self, worker: WorkerRef, kind: type, envelope: bytes) -> None:
        """A worker's PARTIAL or FINAL not for its request (or with the restart marker)."""
        what, request = kind.__name__, worker.current
        if request is not None and envelope == request.envelope:
            # only the broker may say a reply starts over
            self._invalid(worker.key, "restart-marker", "PARTIAL holding the restart marker")
        elif envelope == worker.lastEnvelope:
            self._emit(Dropped(worker.key[1], "stale", f"a second {what} for a request it already answered"))
        elif request is None:
            self._invalid(worker.key, "unexpected", f"unexpected {what} while idle: sending DISCONNECT")
        else:
            self._invalid(worker.key, "not-serving", f"{what} for a request it does not serve")

    def _fromUnregistered(self, key: PeerKey, kind: type, address: bytes, body: Sequence[bytes],
                          dialect: str, identity: Optional[str]) -> None:
        if kind is Ready:
            self._gone.pop(key, None)
            self._onReady(key, address, dialect, identity, self._declared.pop(key, False))
            return
        if kind is Disconnect:
            return
        late = (kind is WorkerFinal or kind is WorkerPartial) and self._late(key, kind, address, body)
        if key in self._gone:
            # MDP/0.2: no commands after DISCONNECT (messages that crossed ours end here)
            if not late:
                self._emit(Dropped(key[1], "gone", f"{kind.__name__} after its DISCONNECT"))
            return
        if not late:
            self._emit(Dropped(key[1], "unregistered",
                               f"{kind.__name__} from an unregistered worker: sending DISCONNECT"))
        self._sendDisconnect(key, dialect)

    def _replyPart(self, worker: WorkerRef, request: PendingRequest, body: Sequence[bytes],
                   final: bool) -> None:
        """A *worker*'s PARTIAL or FINAL for its *request*: on to the client,
        unless already answered (413) or too large for the link back (413)."""
        tooLarge = None
        hop = len(relay_hop(request.client[1]))  # (a relayed client's hop goes with its reply)
        if len(request.service) + hop > len(request.envelope):
            # the client's frames outgrow the worker's only by a service name (and a
            # hop) longer than the envelope
            size = sum(map(len, body)) + len(codec.CLIENT_HEADER) + 1 + len(request.service) + hop
            tooLarge = self.limits.oversize(size, len(body) + 4 + (hop > 0))
        if request.state is ANSWERED:  # the worker's rest is void
            self._emit(Dropped(worker.key[1], "void", "the rest of a reply already answered"))
            if final:
                request.state = DONE
        elif tooLarge is not None:
            self._refuse(request, codec.STATUS_TOO_LARGE, "too-large",
                         f"reply too large for the client: {tooLarge}",
                         DONE if final else ANSWERED)
        elif final:
            request.state = DONE
            self._reply(request, body, True)
            if self.observed:
                self._emitReplied(request, body, worker.key)
        else:
            request.partials += 1
            self._reply(request, body, False)
        if final:
            self._finished(worker, request)

    def _finished(self, worker: WorkerRef, request: PendingRequest) -> None:
        """*worker* answered *request*: free for the next (or released, if passive)."""
        if request.context is not None:
            self._forgetLatest(request)
        worker.current = None
        worker.lastEnvelope = request.envelope
        if self._passive:
            self._release(worker)
        else:
            worker.state = IDLE
            service = worker.service
            service.idle[worker.key] = worker
            if service.size:
                self._dispatch(service)

    def _emitReplied(self, request: PendingRequest, body: Sequence[bytes], worker: PeerKey) -> None:
        error = codec.parse_error_body(body)
        self._emit(Replied(request.service, error[0] if error is not None else None,
                           request.client[1], worker[1], self.now - request.assignedAt,
                           request.assignedAt - request.arrivedAt))

    def _late(self, key: PeerKey, kind: type, envelope: bytes, body: Sequence[bytes]) -> bool:
        """A reply from a worker given up on, for an assignment taken back from it: a FINAL
        with no PARTIAL before it answers the request if still queued; after a PARTIAL
        the request runs again.  False if no such assignment was taken back from it."""
        entry = self._takenBack.get(envelope)
        if entry is None or entry[0] != key:
            return False
        del self._takenBack[envelope]
        request = entry[1]
        if kind is WorkerPartial or request.state is not QUEUED or request.envelope != envelope:
            self._emit(Dropped(key[1], "orphaned", f"the late {kind.__name__} of a worker given "
                               "up, for a request that is elsewhere now or runs again"))
            return True
        service = self.services[request.service]
        service.remove(request)
        if request.context is not None:
            self._forgetLatest(request)
        self._emit(WorkerChanged(key[1], request.service, "answered-late", 0.0))
        self._reply(request, body, final=True)
        if self.observed:
            self._emitReplied(request, body, key)
        self._forgetIfEmpty(service)
        return True

    def _onReady(self, key: PeerKey, name: bytes, dialect: str, identity: Optional[str],
                 extended: bool = False) -> None:
        service = self.services.get(name)
        kind = "ready"
        if self.access is not None and not self.access.mayServe(identity, name):
            kind, why = "serve-forbidden", f"{_who(identity)} may not serve it"
        elif self.admission is not None and not self.admission.admitWorker(self.now):
            why = "this broker is not the active one of its Binary Star pair"
        elif len(self.workers) >= self.maxWorkers:
            why = f"{len(self.workers)} workers already registered"
        elif service is not None and service.workers >= self.maxServiceWorkers:
            why = f"{service.workers} workers already serve {name.decode('ascii')!r}"
        else:
            if service is None:
                service = self.services[name] = ServiceQueue(name, self._ledger)
            worker = WorkerRef(key, service, dialect, Liveness(self.heartbeat, self.now))
            worker.extended = extended
            self.workers[key] = worker
            self._passive = False  # admitted: active now, even before a tick says so
            service.workers += 1
            service.abandonedAt = None
            service.registered = True
            self._emit(WorkerChanged(key[1], name, "ready", 0.0))
            if service.wanted:
                self._usefulWorkers(service, worker)
            service.idle[key] = worker
            self._dispatch(service)
            return
        self._emit(Refused(key[1], name, None, kind, f"READY refused: {why}"))
        self._sendDisconnect(key, dialect)

    def _dispatch(self, service: ServiceQueue) -> None:
        """Hand queued requests to idle workers, least recently used first (none if passive)."""
        if self._passive:
            return
        while service.size and service.idle:
            request = service.nextRequest()
            if request.deadline is not None and request.deadline <= self.now:
                self._lapse(request)
                continue
            self._assign(service.idle.popitem(last=False)[1], request)

    def _assign(self, worker: WorkerRef, request: PendingRequest) -> None:
        if not worker.useful:
            self._usefulWorkers(worker.service, worker)
        if request.client not in self._usefulClients:
            self._usefulClient(request.client)
        worker.state = BUSY
        worker.current = request
        request.state = ASSIGNED
        request.deliveries += 1
        request.assignedAt = now = self.now
        if self.observed:
            self._emit(Assigned(request.service, now - request.queuedAt))
        request.envelope = envelope = request.client[1] + next(self._assignments).to_bytes(8, "big")
        request.holder = worker.key
        body = request.body
        context = request.context
        if context is not None and worker.extended:
            body = [self._contextFrame(request), *body]
        frames = encode_worker(W_REQUEST, envelope, body, worker.dialect)
        self._outbox.append(Send(worker.key, frames))
        worker.liveness.lastSent = now
        if context is not None and self.traced and context.traceparent is not None:
            self._emit(Traced(request.service, (context.traceparent, context.tracestate),
                              request.arrivedAt, now))

    def _contextFrame(self, request: PendingRequest) -> bytes:
        """*request*'s context as its worker gets it: the time left now."""
        context = request.context
        if request.deadline is not None:
            context = context._replace(deadline=max(1, math.ceil((request.deadline - self.now) * 1000)))
        return extension.encode_context(context)

    def _removeWorker(self, worker: WorkerRef, change: Optional[str] = None, silence: float = 0.0) -> None:
        """Forget *worker* (a :class:`WorkerChanged` if *change*); re-queue its request
        unless handed out ``maxDeliveries`` times."""
        if self.workers.pop(worker.key, None) is None:
            return
        if change is not None:
            self._emit(WorkerChanged(worker.key[1], worker.service.name, change, silence))
        if worker.useful:
            self._emit(MarkUseful(worker.key, False))
        worker.state = GONE
        service = worker.service
        service.idle.pop(worker.key, None)
        service.workers -= 1
        if not service.workers:
            service.abandonedAt = now = self.now
            self._abandoned.append((now, service))
        request, worker.current = worker.current, None
        if request is not None:
            self._takeBack(request, service, worker.key)
        self._forgetIfEmpty(service)

    def _takeBack(self, request: PendingRequest, service: ServiceQueue, worker: PeerKey) -> None:
        if request.state is not ASSIGNED:  # ANSWERED (413): nothing is owed
            request.state = DONE
            return
        if request.givenUp:  # cancelled while its worker had it: not run again
            self._refuse(request, extension.STATUS_CANCELLED, "cancelled",
                         "cancelled by its client; its worker was lost meanwhile")
            return
        if request.deliveries >= self.maxDeliveries:
            self._refuse(request, codec.STATUS_WORKER_ERROR, "poison",
                         f"request abandoned: the {request.deliveries} workers given it were "
                         "each lost while serving it")
            return
        if request.partials:
            # the next worker starts the reply over: tell the client first
            request.partials = 0
            self._reply(request, [codec.RESTART_MARKER], final=False)
        else:
            # its worker may yet answer, late (see _late)
            takenBack = self._takenBack
            takenBack[request.envelope] = (worker, request)
            if len(takenBack) > MAX_TAKEN_BACK:
                takenBack.popitem(last=False)
        # accepted work is never dropped, even past the queue bounds
        request.queuedAt = self.now
        service.enqueue(request, first=True)
        if request.deadline is not None:
            self._watchDeadline(request)
        self._dispatch(service)

    def _invalid(self, key: PeerKey, kind: str, reason: str) -> None:
        """Drop an invalid message, and the peer's connection if it has its own; a
        registered worker that sent it is no longer trusted: DISCONNECT."""
        self._emit(Dropped(key[1], kind, reason))
        worker = self.workers.get(key)
        if worker is not None:
            self._release(worker)
        else:
            self._emit(DropPeer(key))

    def _release(self, worker: WorkerRef, change: Optional[str] = None) -> None:
        self._removeWorker(worker, change)
        self._sendDisconnect(worker.key, worker.dialect)

    def _sendDisconnect(self, key: PeerKey, dialect: str) -> None:
        """DISCONNECT, then close the connection: the worker must reconnect (MDP), and
        a peer that only gets DISCONNECTs holds no connection slot."""
        self._emit(Send(key, codec.encode(codec.DISCONNECT, dialect)))
        self._emit(DropPeer(key))
        self._markGone(key)

    def _markGone(self, key: PeerKey) -> None:
        """Nothing more goes to *key* (bounded: the oldest go first)."""
        gone = self._gone
        gone[key] = self.now
        gone.move_to_end(key)
        if len(gone) > MAX_GONE:
            gone.popitem(last=False)

    # --- time ----------------------------------------------------------------

    def handleTick(self, now: float) -> list[Action]:
        """Heartbeats, dead workers, expired requests, services past their linger."""
        self.now = now
        self._checkWorkers(now)
        gone, since = self._gone, now - self.heartbeat.expiry
        while gone and next(iter(gone.values())) < since:
            gone.popitem(last=False)
        self._expire(now - self.requestExpiry)
        self._giveUpUnknown(now)
        self._sweepClients()
        if self._takenBack:
            # no late reply can answer requests that left the queue: drop their bodies
            self._takenBack = OrderedDict(
                (envelope, entry) for envelope, entry in self._takenBack.items()
                if entry[1].state is QUEUED and entry[1].envelope == envelope)
        if self.admission is not None:
            self._checkAdmission(now)
        abandoned = self._abandoned
        while abandoned and abandoned[0][0] + self.serviceLinger <= now:
            self._forgetIfEmpty(abandoned.popleft()[1])
        return self._drain()

    def _checkWorkers(self, now: float) -> None:
        for worker in list(self.workers.values()):
            liveness = worker.liveness
            if liveness.dead(now):
                self._removeWorker(worker, "silent", liveness.silence(now))
            elif liveness.due(now, 0.5):
                self._emit(Send(worker.key, codec.encode(codec.HEARTBEAT, worker.dialect)))
                liveness.sent(now)

    def _checkAdmission(self, now: float) -> None:
        """Track when the admission began to serve; a passive broker lets go (:meth:`_letGo`)."""
        status = self.admission.status(now)
        if not status.get("serving", True):
            self._activeSince = None
        elif self._activeSince is None:
            self._activeSince = now
        wasPassive = self._passive
        self._passive = status.get("state") == "passive"
        if wasPassive and not self._passive:
            for service in list(self.services.values()):
                self._dispatch(service)
        if self._passive:
            self._letGo()

    def _letGo(self) -> None:
        """A passive broker drops its queue unanswered (clients time out and retry
        on the active broker) and sends idle workers DISCONNECT so they move there."""
        for service in list(self.services.values()):
            while service.size:
                self._refuse(service.nextRequest(), None, "passive",
                             "dropped from the queue of a passive broker")
            self._forgetIfEmpty(service)
        for worker in [w for w in self.workers.values() if w.current is None]:
            self._release(worker, "released")

    def _expire(self, deadline: float) -> None:
        """Answer 503 to every request queued at or before *deadline*."""
        byAge = self._ledger.byAge
        while byAge and byAge[0][0] <= deadline:
            queuedAt, request = byAge.popleft()
            if request.state is not QUEUED or request.queuedAt != queuedAt:
                continue  # it left the queue (or was queued again) since
            service = self.services[request.service]
            service.remove(request)
            why = "no worker for service" if not service.workers else "no worker free for service"
            self._refuse(request, codec.STATUS_UNAVAILABLE, "expired",
                         f"{why} {label(service.name)!r} within {self.requestExpiry:g}s")
            self._forgetIfEmpty(service)

    def _giveUpUnknown(self, now: float) -> None:
        """503 to the requests of services unregistered within ``unknownServiceExpiry``; forget them."""
        unknown = self._unknown
        while unknown and unknown[0][0] <= now + 1e-9:
            deadline, service = unknown.popleft()
            if service.registered or self.services.get(service.name) is not service:
                continue
            service.unknownUntil = 0.0
            message = (f"no worker for service {label(service.name)!r}: none registered "
                       f"within {deadline - service.askedAt:g}s")
            while service.size:
                self._refuse(service.nextRequest(), codec.STATUS_UNAVAILABLE, "unknown", message)
            self._forgetIfEmpty(service)
        if unknown:
            self._emit(WakeAt(unknown[0][0]))
