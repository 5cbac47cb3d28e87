"""The MDP/0.2 broker state machine.

Theory of operation
-------------------
One :class:`ServiceQueue` per service holds the requests waiting for a worker
(served fairly: round-robin over clients) and the idle workers (least recently
used first).  A request that meets an idle worker and an empty queue goes
straight to it.

Each time the broker hands a request to a worker it gives that *assignment* an
envelope of its own (the client address frame of the worker REQUEST), and it
forwards a worker's PARTIAL or FINAL only if it carries the envelope of the
worker's current assignment.  So exactly one FINAL reaches the client per
request: a second FINAL for the same assignment, or a reply to an assignment
that was taken back, can never complete another request of that client.

A single timer tick per heartbeat interval sends heartbeats, removes silent
workers (re-queueing the request each held), expires requests queued longer
than ``requestExpiry`` (503), and forgets services whose last worker left
more than ``serviceLinger`` seconds ago.  Each worker's silence is judged by
a :class:`~mdp.policy.Liveness`.

The decisions live in :class:`BrokerMachine`, which knows no reactor, no
transport and no Deferred: it is fed events with their time
(``handleMessage``, ``handlePeerGone``, ``handleTick``, ``handleWake``) and
returns what it wants done (:class:`Send`, :class:`DropPeer`, :class:`WakeAt`).
:class:`Broker` is its driver: it owns the bindings, the periodic timer and
the wake-up timer, passes every message from
every binding in (:meth:`Broker.received`, :meth:`Broker.peerGone`) and
performs the actions.

A registered worker (a :class:`WorkerRef`, in a :class:`WorkerState`):

=========  ===========================================  =========  ============================
state      event                                        next       actions
=========  ===========================================  =========  ============================
(none)     READY, within ``maxWorkers`` and             IDLE       joins the back of its
           ``maxServiceWorkers``                                   service's idle line
(none)     READY beyond them, or refused by the         (none)     DISCONNECT
           ``admission`` (a passive Binary Star); any
           other command
IDLE       a request for its service, none ahead        BUSY       REQUEST under a new envelope
BUSY       PARTIAL with the current envelope            BUSY       PARTIAL to the client
BUSY       FINAL with the current envelope              IDLE       FINAL to the client; the next
                                                                   queued request, if any: BUSY
BUSY       FINAL with the envelope it answered last     BUSY/IDLE  dropped (a second FINAL)
IDLE,      any message                                  same       heard: its silence restarts
BUSY
IDLE,      tick, nothing sent for half an interval      same       HEARTBEAT
BUSY
IDLE,      DISCONNECT; peer lost; silent for more       GONE       its request is taken back
BUSY       than ``interval × liveness``
IDLE,      invalid or unexpected command (PARTIAL or    GONE       DISCONNECT; its request is
BUSY       FINAL while IDLE or for another envelope,               taken back
           READY again, REQUEST)
=========  ===========================================  =========  ============================

A client request (a :class:`PendingRequest`, in a :class:`RequestState`):

=========  ===========================================  =========  ============================
state      event                                        next       actions
=========  ===========================================  =========  ============================
NEW        refused by the ``admission`` (a passive      DONE       none: the client times out
           Binary Star); not ``mmi.binarystar``                    and tries another broker
NEW        an idle worker and nothing queued            ASSIGNED   REQUEST to the worker
NEW        no idle worker, queues within bounds         QUEUED     waits in its service's queue
NEW        ``mmi.*``; too large (413); queues full      DONE       answered at once
           (429)
QUEUED     a worker of its service is idle              ASSIGNED   REQUEST to the worker
QUEUED     waited ``requestExpiry``                     DONE       503 error reply
QUEUED     no worker registered for its service         DONE       503 error reply
           ``unknownServiceExpiry`` after its first
           request
QUEUED     a late FINAL from the worker it was taken    DONE       FINAL to the client
           back from (none of its PARTIALs went out)
QUEUED     its client is lost                           DONE       forgotten
ASSIGNED   PARTIAL                                      ASSIGNED   PARTIAL to the client
ASSIGNED   FINAL                                        DONE       FINAL to the client
ASSIGNED   a reply part too large for the client        ANSWERED   413 error reply (a FINAL too
                                                        (DONE)     large: DONE)
ANSWERED   PARTIAL                                      ANSWERED   dropped
ANSWERED   FINAL, or its worker is GONE                 DONE       dropped
ASSIGNED   its worker is GONE                           QUEUED     at the head; the restart
                                                                   marker first if PARTIALs
                                                                   went out
ASSIGNED   its worker is GONE, ``maxDeliveries``        DONE       500 error reply
           reached
=========  ===========================================  =========  ============================

Limits (``docs/reliability.md`` has the table)
----------------------------------------------
* Queues: at most ``maxQueue`` requests and ``maxQueueBytes`` of request
  bodies in all, and ``maxServiceQueue`` / ``maxServiceQueueBytes`` per
  service; beyond, a request is refused at once with a 429 error reply.
  Requests taken back from a lost worker are re-queued even past the bounds:
  accepted work is never dropped for space.
* Workers: at most ``maxWorkers`` in all and ``maxServiceWorkers`` per
  service; beyond, READY gets DISCONNECT (the worker backs off).
* Messages: a request whose REQUEST to a worker, or a reply whose message to
  the client, would exceed ``limits`` fails that request at once with a 413
  error reply.  A request whose worker is lost ``maxDeliveries`` times fails
  with a 500 error reply instead of being handed to worker after worker.
* Logs of bad input are throttled (one line a second per kind).

Binary Star
-----------
Given an ``admission`` (an :class:`~mdp.interfaces.IAdmission`, e.g. a
:class:`mdp.binarystar.BinaryStar`), the broker asks it before it takes each
client request (the client's vote) and registers each worker.  A passive
broker answers nothing but ``mmi.binarystar`` and sends DISCONNECT to every
READY, so clients and workers given both brokers move to the active one.

Requests to ``mmi.*`` services are answered by the broker itself
(:mod:`mdp.majordomo.mmi`).  The broker answers every peer in the dialect it used (see
:mod:`mdp.majordomo.codec`): RFC 18, or majortomo's.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict, deque
from functools import partial
from typing import Any, Callable, Optional, Sequence

import attrs
from twisted.internet import defer, task
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger
from zope.interface import classImplements

from mdp import transport
from mdp.errors import ProtocolError
from mdp.interfaces import IAccess, IAdmission, IBroker, IRouterReceiver, IRouterTransport
from mdp.machine import Machine, action_class
from mdp.majordomo import codec, mmi
from mdp.majordomo.codec import (
    C_FINAL,
    C_PARTIAL,
    C_REQUEST,
    CLIENT_HEADER,
    RFC,
    W_FINAL,
    W_HEARTBEAT,
    W_PARTIAL,
    W_REQUEST,
    WORKER_HEADER,
    ClientFinal,
    ClientPartial,
    ClientRequest,
    Disconnect,
    Heartbeat,
    Ready,
    WorkerFinal,
    WorkerPartial,
    is_service_name,
)
from mdp.messages import text as label
from mdp.policy import (
    FRAME_OVERHEAD,
    HeartbeatPolicy,
    Limits,
    Liveness,
    LogThrottle,
    MiB,
    default_reactor,
)
from mdp.transport.curve import curve_server
from mdp.transport.stream import StreamRouter

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

DEFAULT_REQUEST_EXPIRY = 30.0
DEFAULT_SERVICE_LINGER = 10.0
DEFAULT_MAX_QUEUE = 100_000
DEFAULT_MAX_SERVICE_QUEUE = 50_000
DEFAULT_MAX_QUEUE_BYTES = 1024 * MiB
DEFAULT_MAX_SERVICE_QUEUE_BYTES = 512 * MiB
DEFAULT_MAX_WORKERS = 10_000
DEFAULT_MAX_SERVICE_WORKERS = 1_000
DEFAULT_MAX_DELIVERIES = 20
#: seconds a request for a service no worker has registered waits (counted
#: from the service's first request), within a client's default budget
#: (3 attempts of 2.5 s) so that it hears 503 rather than a timeout
DEFAULT_UNKNOWN_SERVICE_EXPIRY = 5.0

#: Bytes of frame content a worker REQUEST adds to the request body besides the
#: client's peer id: the header, the command and the 8-byte assignment number
#: of the envelope; and the frames it adds (with majortomo's leading empty frame).
_REQUEST_OVERHEAD = len(codec.WORKER_HEADER) + 1 + 8
_REQUEST_FRAMES = 5
#: (a name of this module's own: another module's attribute is a look-up each time)
_MMI_PREFIX = mmi.PREFIX


def as_bytes(frames: Sequence[Any]) -> list[bytes]:
    """*frames* with every frame that is not ``bytes`` (a ZeroMQ frame a
    transport did not copy) copied into ``bytes``; *frames* itself if all are."""
    for frame in frames:
        if type(frame) is not bytes:
            return [f if type(f) is bytes else bytes(f) for f in frames]
    return frames  # type: ignore[return-value]


def peer_label(peer: bytes) -> str:
    """A printable form of an opaque peer id for logs."""
    return peer.hex()


#: workers remembered as told DISCONNECT (see BrokerMachine._gone)
MAX_GONE = 10_000
#: how many assignments taken back from lost workers are remembered, so that
#: a late FINAL for one still queued can answer it (:meth:`BrokerMachine._late`)
MAX_TAKEN_BACK = 1024
#: how many services no worker registered are kept while empty, so that the
#: retries of their requests share one unknownServiceExpiry window
MAX_UNKNOWN_KEPT = 10_000


class Binding:
    """One bound transport of the broker and the roles it accepts.

    Body frames are passed on, never read: a transport may deliver long ones
    from ``keepFramesFrom`` on uncopied (libzmq's message; a client REQUEST's
    body starts there, a worker's command has its client address before it).
    The machine reads only the frames before it on its fast path and
    copies the rest into ``bytes`` before anything else reads them
    (:func:`as_bytes`); ``copyOut`` marks a binding whose transport takes
    only ``bytes`` while another delivers buffers (``deliversBuffers``)."""

    keepFramesFrom = 3

    def __init__(self, broker: Broker, clients: bool, workers: bool) -> None:
        self.broker = broker
        self.clients = clients
        self.workers = workers
        self.transport: Optional[IRouterTransport] = None
        self.copyOut = False

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        broker = self.broker
        broker._perform(broker.handleMessage((self, peer), frames, broker.reactor.seconds()))

    def peerDisconnected(self, peer: bytes) -> None:
        self.broker.peerGone((self, peer))

    def send(self, peer: bytes, frames: list[bytes]) -> None:
        if self.transport is not None:
            self.transport.sendMessage(peer, as_bytes(frames) if self.copyOut else frames)

    def identity(self, peer: bytes) -> Optional[str]:
        """Who *peer* is, as its transport authenticated it (a CURVE public
        key, a TLS subject), or None."""
        peerIdentity = getattr(self.transport, "peerIdentity", None)
        return None if peerIdentity is None else peerIdentity(peer)

    def disconnect(self, peer: bytes) -> None:
        """Close *peer*'s connection once what was sent to it is out (a no-op
        on ZeroMQ, which has no connection per peer)."""
        if self.transport is not None:
            self.transport.disconnectPeer(peer)


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Binding, IRouterReceiver)

PeerKey = tuple[Binding, bytes]


def _identity(key: PeerKey) -> Optional[str]:
    """Who the peer of *key* is, as its transport authenticated it."""
    return key[0].identity(key[1])


def _who(identity: Optional[str]) -> str:
    return "an unauthenticated peer" if identity is None else f"peer {identity!r}"

class RequestState(enum.Enum):
    """What a client request is doing (see the table in the module docstring)."""

    #: accepted, not yet queued or assigned
    NEW = "new"
    #: waiting in its service's queue
    QUEUED = "queued"
    #: handed to a worker, whose reply is forwarded to the client
    ASSIGNED = "assigned"
    #: handed to a worker, but already answered with an error (413): the
    #: rest of the worker's reply is dropped
    ANSWERED = "answered"
    #: finished: answered, expired, or its client is gone
    DONE = "done"


NEW, QUEUED, ASSIGNED, ANSWERED, DONE = (
    RequestState.NEW, RequestState.QUEUED, RequestState.ASSIGNED, RequestState.ANSWERED,
    RequestState.DONE)


class WorkerState(enum.Enum):
    """What a registered worker is doing (see the table in the module docstring)."""

    #: in its service's idle line
    IDLE = "idle"
    #: serving one request (``WorkerRef.current``)
    BUSY = "busy"
    #: forgotten: disconnected, lost, silent or misbehaving
    GONE = "gone"


IDLE, BUSY, GONE = WorkerState.IDLE, WorkerState.BUSY, WorkerState.GONE


def _fields_repr(record: Any) -> str:
    """``Name(field=value, ...)``, every field of *record* (its class's
    ``__slots__``) in order, as attrs would show it."""
    fields = ", ".join(f"{name}={getattr(record, name)!r}" for name in type(record).__slots__)
    return f"{type(record).__name__}({fields})"


class PendingRequest:
    """A client request the broker has accepted and not yet answered.  (A
    plain class, not attrs: compiled, it is an extension type, broker.pxd.)"""

    __slots__ = ("client", "service", "body", "dialect", "queuedAt", "size", "state", "envelope",
                 "deliveries", "partials", "arrivedAt", "assignedAt")

    def __init__(self, client: PeerKey, service: bytes, body: Sequence[bytes], dialect: str,
                 queuedAt: float, size: int, state: RequestState = NEW, envelope: bytes = b"",
                 deliveries: int = 0, partials: int = 0, arrivedAt: float = 0.0,
                 assignedAt: float = 0.0) -> None:
        self.client = client
        self.service = service
        self.body = body
        self.dialect = dialect
        self.queuedAt = queuedAt  # when it arrived, or was queued again
        self.size = size  # what holding its body costs (policy.held_bytes)
        self.state = state
        self.envelope = envelope  # of its current assignment
        self.deliveries = deliveries  # times handed to a worker
        self.partials = partials  # PARTIALs forwarded to the client by its current worker
        self.arrivedAt = arrivedAt
        self.assignedAt = assignedAt  # when its current assignment began

    def __repr__(self) -> str:
        return _fields_repr(self)


class WorkerRef:
    """The broker's view of one registered worker (a plain class, as
    :class:`PendingRequest`)."""

    __slots__ = ("key", "service", "dialect", "liveness", "state", "current", "lastEnvelope")

    def __init__(self, key: PeerKey, service: ServiceQueue, dialect: str, liveness: Liveness,
                 state: WorkerState = IDLE, current: Optional[PendingRequest] = None,
                 lastEnvelope: bytes = b"") -> None:
        self.key = key
        self.service = service
        self.dialect = dialect
        self.liveness = liveness
        self.state = state
        self.current = current  # the request it serves while BUSY
        #: envelope of the assignment it finished last (a second FINAL for it is dropped)
        self.lastEnvelope = lastEnvelope

    def __repr__(self) -> str:
        return _fields_repr(self)


@attrs.frozen
class ServiceSnapshot:
    """One service as :meth:`Broker.snapshot` saw it."""

    name: bytes
    idle: int  # workers waiting for a request
    busy: int  # workers serving one
    queued: int  # requests waiting
    queuedBytes: int  # what they hold (as the queue bounds count it)

    @property
    def workers(self) -> int:
        """Registered workers, idle or busy."""
        return self.idle + self.busy


@attrs.frozen
class WorkerSnapshot:
    """One registered worker as :meth:`Broker.snapshot` saw it."""

    peer: str  # its peer id, printable (hex)
    service: bytes
    dialect: str
    busy: bool
    silence: float  # seconds since it was last heard from


@attrs.frozen
class BrokerSnapshot:
    """A read-only view of a broker at one moment (:meth:`Broker.snapshot`)."""

    at: float  # the broker's clock
    services: tuple[ServiceSnapshot, ...]  # by name (the first ``serviceLimit``)
    workers: tuple[WorkerSnapshot, ...]  # by registration (the first ``workerLimit``)
    serviceCount: int  # services known, listed or not
    workerCount: int  # registered workers (of the service asked for), listed or not
    queued: int  # requests waiting, in all
    queuedBytes: int


class QueueLedger:
    """What all of a broker's service queues hold, kept up to date by the
    queues: requests and bytes in all, the services where each client has
    requests waiting, and every queued request in the order it was queued
    (for expiry; requests that left the queue are skipped lazily)."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.byClient: dict[PeerKey, set[ServiceQueue]] = {}
        self.byAge: deque[tuple[float, PendingRequest]] = deque()

    def compact(self) -> None:
        """Drop entries of requests no longer queued once they outnumber the
        queued ones: the age list stays within twice the queue."""
        if len(self.byAge) > 2 * self.count + 1024:
            self.byAge = deque(e for e in self.byAge
                               if e[1].state is QUEUED and e[1].queuedAt == e[0])


class ServiceQueue:
    """Requests waiting for one service and the workers able to serve it.

    Every change is also counted in the broker-wide *ledger*."""

    def __init__(self, name: bytes, ledger: Optional[QueueLedger] = None) -> None:
        self.name = name
        self.ledger = ledger if ledger is not None else QueueLedger()
        self.pending: OrderedDict[PeerKey, deque[PendingRequest]] = OrderedDict()
        self.idle: OrderedDict[PeerKey, WorkerRef] = OrderedDict()
        self.workers = 0
        self.size = 0
        self.bytes = 0
        #: when the last worker left (None while the service has workers or never had one)
        self.abandonedAt: Optional[float] = None
        #: a worker has registered for it (else requests wait ``unknownServiceExpiry``)
        self.registered = False
        #: until when it is kept, even empty, while no worker has registered: the
        #: window of its first request, which a client's retries share
        self.unknownUntil = 0.0
        #: when a request first asked for it while no worker had registered
        self.askedAt = 0.0

    def _clientQueue(self, client: PeerKey) -> deque[PendingRequest]:
        queue = self.pending.get(client)
        if queue is None:
            queue = self.pending[client] = deque()
            services = self.ledger.byClient.get(client)
            if services is None:
                services = self.ledger.byClient[client] = set()
            services.add(self)
        return queue

    def _dropClientQueue(self, client: PeerKey) -> None:
        del self.pending[client]
        services = self.ledger.byClient.get(client)
        if services is not None:
            services.discard(self)
            if not services:
                del self.ledger.byClient[client]

    def enqueue(self, request: PendingRequest) -> None:
        self._clientQueue(request.client).append(request)
        self._added(request)

    def requeue(self, request: PendingRequest) -> None:
        """Put a request back at the head: it has waited longest."""
        self._clientQueue(request.client).appendleft(request)
        self.pending.move_to_end(request.client, last=False)
        self._added(request)

    def _added(self, request: PendingRequest) -> None:
        request.state = QUEUED
        self._grow(1, request.size)
        ledger = self.ledger
        ledger.byAge.append((request.queuedAt, request))
        ledger.compact()

    def nextRequest(self) -> PendingRequest:
        """Round-robin over clients: take the first client's oldest request and
        move that client to the back."""
        client, queue = next(iter(self.pending.items()))
        request = queue.popleft()
        if queue:
            self.pending.move_to_end(client)
        else:
            self._dropClientQueue(client)
        self._grow(-1, -request.size)
        return request

    def remove(self, request: PendingRequest) -> None:
        """Take one queued request out of the queue."""
        queue = self.pending[request.client]
        queue.remove(request)
        if not queue:
            self._dropClientQueue(request.client)
        request.state = DONE
        self._grow(-1, -request.size)

    def dropClient(self, client: PeerKey) -> int:
        """Forget every request *client* has queued here; returns how many."""
        queue = self.pending.get(client)
        if not queue:
            return 0
        self._dropClientQueue(client)
        for request in queue:
            request.state = DONE
        self._grow(-len(queue), -sum(r.size for r in queue))
        return len(queue)

    def _grow(self, by: int, size: int) -> None:
        self.size += by
        self.bytes += size
        self.ledger.count += by
        self.ledger.bytes += size


@action_class
class Send:
    """The machine's wish: send *frames* to the peer *key* (binding, peer id)."""

    key: PeerKey
    frames: list[bytes]


@action_class
class DropPeer:
    """The machine's wish: close the connection of peer *key* once what was
    sent to it is out (a no-op on media without connections)."""

    key: PeerKey


@action_class
class WakeAt:
    """The machine's wish: :meth:`BrokerMachine.handleWake` at *time* (for a
    deadline between two ticks)."""

    time: float


Action = Any  # Send | DropPeer | WakeAt


class BrokerMachine(Machine):
    """The broker's decisions, and nothing else: no reactor, no transport, no
    Deferred.  Feed it events with the time they happen
    (:meth:`handleMessage`, :meth:`handlePeerGone`, :meth:`handleTick`, the
    latter every ``wakeEvery`` seconds); each returns the actions it wants
    done, in order (:class:`Send`, :class:`DropPeer`, :class:`WakeAt`).  A peer key is a
    ``(binding, peer id)`` pair whose binding says which roles it accepts
    (``.clients``, ``.workers``).  :class:`Broker` drives it over real
    transports."""

    def __init__(
        self,
        *,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        requestExpiry: float = DEFAULT_REQUEST_EXPIRY,
        serviceLinger: float = DEFAULT_SERVICE_LINGER,
        maxQueue: int = DEFAULT_MAX_QUEUE,
        maxServiceQueue: int = DEFAULT_MAX_SERVICE_QUEUE,
        maxWorkers: int = DEFAULT_MAX_WORKERS,
        maxQueueBytes: int = DEFAULT_MAX_QUEUE_BYTES,
        maxServiceQueueBytes: int = DEFAULT_MAX_SERVICE_QUEUE_BYTES,
        maxServiceWorkers: int = DEFAULT_MAX_SERVICE_WORKERS,
        maxDeliveries: int = DEFAULT_MAX_DELIVERIES,
        unknownServiceExpiry: float = DEFAULT_UNKNOWN_SERVICE_EXPIRY,
        limits: Limits = Limits(),
        admission: Optional[IAdmission] = None,
        access: Optional[IAccess] = None,
        metrics: Optional[Any] = None,
        logRequests: bool = False,
        now: float = 0.0,
    ) -> None:
        if maxDeliveries < 1:
            raise ValueError(f"maxDeliveries must be at least 1, got {maxDeliveries}")
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
        self.maxDeliveries = maxDeliveries
        self.limits = limits
        #: asked before a client request is taken or a worker registered
        #: (Binary Star: only the active broker of a pair serves)
        self.admission = admission
        #: who may call and serve what (None: anyone, anything)
        self.access = access
        self.throttle = LogThrottle(self)
        self._ledger = QueueLedger()
        self._assignments = itertools.count(1)
        #: services whose last worker left, by when (checked for linger's end)
        self._abandoned: deque[tuple[float, ServiceQueue]] = deque()
        self.services: dict[bytes, ServiceQueue] = {}
        self.workers: dict[PeerKey, WorkerRef] = {}
        #: services no worker has registered for, by when they are given up
        self._unknown: deque[tuple[float, ServiceQueue]] = deque()
        #: when the admission last began to admit clients (a Binary Star broker
        #: becoming active), None while it refuses or without one
        self._activeSince: Optional[float] = None
        #: the admission says passive (a Binary Star peer is active): no
        #: dispatch, and workers are let go (see _checkAdmission)
        self._passive = False
        #: envelopes of assignments taken back from lost workers (see _late)
        self._takenBack: OrderedDict[bytes, tuple[PeerKey, PendingRequest]] = OrderedDict()
        #: workers told DISCONNECT, or that said it, by when (MDP/0.2: no
        #: further commands to them): what they still send is dropped, for
        #: a heartbeat expiry, unless it is a READY (a new conversation)
        self._gone: OrderedDict[PeerKey, float] = OrderedDict()
        #: messages dropped as invalid or unexpected
        self.invalid = 0
        #: a :class:`mdp.metrics.BrokerMetrics` (or None): told of each event it counts
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(self)
        #: log one debug line per request served (``twist --log-level debug``
        #: turns it on; off, the line costs nothing)
        self.logRequests = logRequests

    @property
    def wakeEvery(self) -> float:
        """How often :meth:`handleTick` wants to run: one heartbeat interval."""
        return self.heartbeat.interval

    def handleMessage(self, key: PeerKey, frames: list[bytes], now: float) -> list[Action]:
        """A message from peer *key* at time *now*."""
        self.now = now
        self._received(key, frames)
        return self._drain()

    def handlePeerGone(self, key: PeerKey, now: float) -> list[Action]:
        """A transport lost the peer *key* (or cut it off)."""
        self.now = now
        self._peerGone(key)
        return self._drain()

    def handleTick(self, now: float) -> list[Action]:
        """The periodic tick (every ``wakeEvery`` seconds)."""
        self.now = now
        self._tick(now)
        return self._drain()

    def handleAdmissionChange(self, now: float) -> list[Action]:
        """The admission (a Binary Star pair) changed state: act on it now
        rather than at the next tick."""
        self.now = now
        if self.admission is not None:
            self._checkAdmission(now)
        return self._drain()

    def handleWake(self, now: float) -> list[Action]:
        """The wake-up asked for with :class:`WakeAt`."""
        self.now = now
        self._giveUpUnknown(now)
        return self._drain()

    def reset(self) -> None:
        """Forget every worker, service and queued request."""
        self.workers.clear()
        self.services.clear()
        self._ledger = QueueLedger()
        self._abandoned.clear()
        self._unknown.clear()
        self._takenBack.clear()
        self._gone.clear()
        self._activeSince = None
        self._passive = False
        self._outbox = []

    # --- inbound -------------------------------------------------------------

    def _received(self, key: PeerKey, frames: list[bytes]) -> None:
        """Every message from every binding: *key* is the (binding, peer id)
        it came from."""
        try:
            if self._fastPath(key, frames):
                return
        except Exception:
            log.failure("broker failed handling a message from {peer}", peer=peer_label(key[1]))
            return
        frames = as_bytes(frames)  # the codec and what follows read every frame
        try:
            dialect, body = codec.split(frames)
            command = codec.decode(body, dialect)
        except ProtocolError as e:
            self._invalid(key, str(e), "malformed")
            return
        try:
            kind = type(command)
            if kind is ClientRequest or kind is ClientPartial or kind is ClientFinal:
                if not key[0].clients:
                    self._invalid(key, "client command on a worker-only endpoint", "wrong-endpoint")
                elif kind is ClientRequest:
                    self._onRequest(key, command, dialect)  # type: ignore[arg-type]
                else:
                    self._invalid(key, f"client sent {kind.__name__}: only REQUEST is valid",
                                  "unexpected")
            elif not key[0].workers:
                self._invalid(key, "worker command on a client-only endpoint", "wrong-endpoint")
            else:
                self._onWorkerCommand(key, command, dialect)
        except Exception:
            log.failure("broker failed handling a message from {peer}", peer=peer_label(key[1]))

    def _fastPath(self, key: PeerKey, frames: list[bytes]) -> bool:
        """The commonest messages in the RFC dialect, recognised without
        building command objects: a client's REQUEST, and a registered
        worker's HEARTBEAT, PARTIAL or FINAL for the request it serves.  Each
        is checked as :func:`codec.decode` checks it; anything else (and
        anything that would be refused) is left to the general path: returns
        False."""
        count = len(frames)
        if count < 2:
            return False
        header = frames[0]
        if header == WORKER_HEADER:
            worker = self.workers.get(key)  # registered: its binding takes workers
            if worker is None:
                return False
            command = frames[1]
            if command == W_HEARTBEAT:
                if count != 2:
                    return False
                worker.liveness.heard(self.now)
                return True
            final = command == W_FINAL
            if not (final or command == W_PARTIAL) or count < 5 or frames[3] != b"":
                return False
            request = worker.current
            if request is None or frames[2] != request.envelope:
                return False
            body = frames[4:]
            if not final and count == 5 and body[0] == codec.RESTART_MARKER:
                return False
            worker.liveness.heard(self.now)
            self._replyPart(worker, request, body, final)
            return True
        if (header == CLIENT_HEADER and count >= 4 and frames[1] == C_REQUEST
                and key[0].clients and is_service_name(frames[2])):
            self._request(key, frames[2], frames[3:], RFC)
            return True
        return False

    def _peerGone(self, key: PeerKey) -> None:
        """A transport lost the peer *key* (or cut it off): forget it at once."""
        worker = self.workers.get(key)
        if worker is not None:
            log.info("worker {peer} for {service} disconnected",
                     peer=peer_label(key[1]), service=label(worker.service.name))
            self._removeWorker(worker)
        services = self._ledger.byClient.get(key)
        if services:
            for service in list(services):
                service.dropClient(key)
                self._forgetIfEmpty(service)

    # --- clients ------------------------------------------------------------

    def _onRequest(self, key: PeerKey, command: ClientRequest, dialect: str) -> None:
        self._request(key, command.service, command.body, dialect)

    def _request(self, key: PeerKey, name: bytes, body: Sequence[bytes], dialect: str) -> None:
        """A client's REQUEST for service *name* (valid) with *body*."""
        now = self.now
        content = sum(map(len, body))
        request = PendingRequest(key, name, body, dialect, now,
                                 content + FRAME_OVERHEAD * len(body), arrivedAt=now)
        metrics = self.metrics
        if metrics is not None:
            metrics.request(name)
        admission = self.admission
        if admission is not None and name != mmi.BINARYSTAR:
            if not admission.admitClient(now):
                self._activeSince = None
                if metrics is not None:
                    metrics.refuse(name, "passive")
                return  # not serving: the client times out and tries elsewhere
            if self._activeSince is None:
                self._activeSince = now
            self._passive = False  # admitted: active now, even before a tick says so
        access = self.access
        visible = None
        if access is not None:
            identity = _identity(key)
            if name.startswith(_MMI_PREFIX):
                visible = partial(access.mayCall, identity)
            elif not access.mayCall(identity, name):
                if metrics is not None:
                    metrics.deny(name, "call")
                self._refuse(request, codec.STATUS_FORBIDDEN, "forbidden",
                             f"{_who(identity)} may not call {name.decode('ascii')!r}")
                return
        if name.startswith(_MMI_PREFIX):
            request.state = DONE
            self._reply(request, mmi.answer(self, name, body, visible), final=True)
            if metrics is not None:
                metrics.replied(name, None, None)
            return
        limits = self.limits
        if (content + len(key[1]) + _REQUEST_OVERHEAD > limits.maxMessageBytes
                or len(body) + _REQUEST_FRAMES > limits.maxFrames):
            tooLarge = limits.oversize(content + len(key[1]) + _REQUEST_OVERHEAD,
                                       len(body) + _REQUEST_FRAMES)
            self._refuse(request, codec.STATUS_TOO_LARGE, "too-large",
                         f"request too large for a worker: {tooLarge}")
            return
        service = self.services.get(name)
        if service is not None and service.idle and not service.size:
            # a worker is waiting and no request is ahead: hand it over
            self._assign(service.idle.popitem(last=False)[1], request)
            return
        queued = service.size if service is not None else 0
        queuedBytes = service.bytes if service is not None else 0
        ledger = self._ledger
        if (ledger.count >= self.maxQueue or queued >= self.maxServiceQueue
                or ledger.bytes + request.size > self.maxQueueBytes
                or queuedBytes + request.size > self.maxServiceQueueBytes):
            self._refuse(request, codec.STATUS_OVERLOADED, "overloaded",
                         f"broker queue full for service {name.decode('ascii')!r} "
                         f"({queued} requests, {queuedBytes} bytes queued for it; "
                         f"{ledger.count} requests, {ledger.bytes} bytes in all)")
            return
        if service is None:
            service = self._service(name)
            # no worker has registered for it: its requests wait unknownServiceExpiry
            service.unknownUntil = deadline = self._unknownDeadline()
            service.askedAt = self.now
            if not self._unknown:
                self._emit(WakeAt(deadline))
            self._unknown.append((deadline, service))
        service.enqueue(request)
        self._dispatch(service)

    def _unknownDeadline(self) -> float:
        """When the requests of a service first asked for now are given up
        if no worker registers: ``unknownServiceExpiry`` from now, but not
        before the workers of a broker that has just become active (a Binary
        Star failover) had time to find it: ``interval × (liveness + 1)``
        after it did (their heartbeats expire, then they move)."""
        deadline = self.now + min(self.unknownServiceExpiry, self.requestExpiry)
        if self._activeSince is not None:
            learning = self._activeSince + self.heartbeat.interval * (self.heartbeat.liveness + 1)
            deadline = max(deadline, min(learning, self.now + self.requestExpiry))
        return deadline

    def _refuse(self, request: PendingRequest, code: bytes, kind: str, message: str) -> None:
        """Answer *request* at once with an error reply, logged (throttled)."""
        request.state = DONE
        self.throttle.warn(log, kind, "refused a request for {service} from {peer}: {message}",
                           service=label(request.service), peer=peer_label(request.client[1]),
                           message=message)
        self._reply(request, codec.error_body(code, message), final=True)
        metrics = self.metrics
        if metrics is not None:
            if kind == "overloaded":
                metrics.refuse(request.service, kind)
            metrics.replied(request.service, None, code)

    def _service(self, name: bytes) -> ServiceQueue:
        service = self.services.get(name)
        if service is None:
            service = self.services[name] = ServiceQueue(name, self._ledger)
        return service

    def clientCount(self) -> int:
        """Clients with a request in the broker (queued or with a worker)."""
        clients = set(self._ledger.byClient)
        clients.update(w.current.client for w in self.workers.values() if w.current is not None)
        return len(clients)

    def _forgetIfEmpty(self, service: ServiceQueue) -> None:
        """Drop a service with no worker and no request, once its linger is over."""
        if service.workers or service.size or self.services.get(service.name) is not service:
            return
        if (not service.registered and service.unknownUntil > self.now
                and len(self._unknown) <= MAX_UNKNOWN_KEPT):
            return  # a retry of its requests waits in the same window
        if not self._lingering(service):
            del self.services[service.name]

    def isServiceAvailable(self, name: bytes) -> bool:
        """True if *name* has a live worker, or lost its last one less than
        ``serviceLinger`` seconds ago (workers restarting keep it known)."""
        service = self.services.get(name)
        if service is None:
            return False
        return bool(service.workers) or self._lingering(service)

    def admissionStatus(self) -> Optional[dict[str, Any]]:
        """What the ``admission`` says of itself (``mmi.binarystar``), or None
        without one."""
        return self.admission.status(self.now) if self.admission is not None else None

    def _lingering(self, service: ServiceQueue) -> bool:
        """Its last worker left less than ``serviceLinger`` seconds ago."""
        return (service.abandonedAt is not None
                and self.now - service.abandonedAt < self.serviceLinger)

    @property
    def queued(self) -> int:
        """Requests waiting in all service queues."""
        return self._ledger.count

    @property
    def queuedBytes(self) -> int:
        """Bytes of request bodies waiting in all service queues."""
        return self._ledger.bytes

    def snapshot(self, serviceLimit: Optional[int] = None, workerLimit: Optional[int] = None,
                 service: Optional[bytes] = None, *,
                 visible: Optional[Callable[[bytes], bool]] = None) -> BrokerSnapshot:
        """A read-only view of the broker now: its services (by name; only the
        first *serviceLimit* if given) and registered workers (in the order
        they registered; only *service*'s if given, and only the first
        *workerLimit*), with the totals; with *visible*, only the services
        (and their workers) it allows, and totals of those (but with
        *serviceLimit* 0 the total of all services, not asked).  Costs a
        pass over the workers and, with a *serviceLimit*, a partial sort of
        the service names."""
        now = self.now
        services = self.services
        if visible is None or serviceLimit == 0:
            shown: Any = services  # (no services wanted: their total unfiltered)
        else:
            shown = [name for name in services if visible(name)]
        if serviceLimit is None:
            names = sorted(shown)
        else:
            names = heapq.nsmallest(serviceLimit, shown)
        serviceViews = []
        for name in names:
            queue = services[name]
            idle = len(queue.idle)
            serviceViews.append(ServiceSnapshot(name, idle, queue.workers - idle, queue.size,
                                                queue.bytes))
        chosen = [w for w in self.workers.values()
                  if (service is None or w.service.name == service)
                  and (visible is None or visible(w.service.name))]
        workers = chosen if workerLimit is None else chosen[:workerLimit]
        workerViews = tuple(
            WorkerSnapshot(peer_label(w.key[1]), w.service.name, w.dialect, w.state is BUSY,
                           w.liveness.silence(now))
            for w in workers)
        return BrokerSnapshot(now, tuple(serviceViews), workerViews, len(shown), len(chosen),
                              self._ledger.count, self._ledger.bytes)

    def _reply(self, request: PendingRequest, body: Sequence[bytes], final: bool) -> None:
        self._emit(Send(request.client, codec.encode_client_reply(request.service, body, final,
                                                                  request.dialect)))

    # --- workers ------------------------------------------------------------

    def _onWorkerCommand(self, key: PeerKey, command: Any, dialect: str) -> None:
        worker = self.workers.get(key)
        kind = type(command)
        if worker is None:
            if kind is Ready:
                self._gone.pop(key, None)
                self._onReady(key, command.service, dialect)
            elif kind is not Disconnect:
                late = (kind is WorkerFinal or kind is WorkerPartial) and self._late(key, command)
                if key in self._gone:
                    # DISCONNECT went to it or came from it: MDP/0.2 says no
                    # further commands (its messages that crossed ours end here)
                    if not late:
                        self.throttle.info(log, "gone", "{command} from worker {peer} after its "
                                           "DISCONNECT: dropped", command=kind.__name__,
                                           peer=peer_label(key[1]))
                    return
                if late:
                    pass  # a reply of an assignment taken back from it: logged
                else:
                    if self.metrics is not None:
                        self.metrics.reject("unregistered")
                    self.throttle.warn(log, "unregistered", "{command} from unregistered worker "
                                       "{peer}: sending DISCONNECT", command=kind.__name__,
                                       peer=peer_label(key[1]))
                self._sendDisconnect(key, dialect)
            return
        worker.liveness.heard(self.now)
        if kind is Heartbeat:
            return
        if kind is WorkerFinal or kind is WorkerPartial:
            request = worker.current
            if request is None or command.client != request.envelope:
                if command.client == worker.lastEnvelope:
                    if self.metrics is not None:
                        self.metrics.dropped("stale")
                    self.throttle.warn(log, "stale", "dropped a second {command} from worker {peer} "
                                       "for a request it already answered",
                                       command=kind.__name__, peer=peer_label(key[1]))
                elif request is None:
                    self._unexpected(worker, f"{kind.__name__} while idle")
                else:
                    self._invalid(key, f"{kind.__name__} for a request it does not serve",
                                  "not-serving")
            elif kind is WorkerPartial and len(command.body) == 1 and command.body[0] == codec.RESTART_MARKER:
                # only the broker may say a reply starts over
                self._invalid(key, "PARTIAL holding the broker's restart marker",
                              "restart-marker")
            else:
                self._replyPart(worker, request, command.body, kind is WorkerFinal)
        elif kind is Disconnect:
            log.info("worker {peer} for {service} disconnected",
                     peer=peer_label(key[1]), service=label(worker.service.name))
            self._removeWorker(worker)
            self._markGone(key)
        else:  # READY again, or REQUEST from a worker: valid but unexpected
            self._unexpected(worker, f"{kind.__name__} from a registered worker")

    def _replyPart(self, worker: WorkerRef, request: PendingRequest, body: Sequence[bytes],
                   final: bool) -> None:
        """A PARTIAL or FINAL of *worker* for the *request* it serves."""
        if final:
            worker.current = None
            worker.lastEnvelope = request.envelope
            self._forward(worker, request, body, final=True)
            if self._passive:
                self._release(worker)  # to the active broker
                return
            service = worker.service
            worker.state = IDLE
            service.idle[worker.key] = worker
            if service.size:
                self._dispatch(service)
        else:
            self._forward(worker, request, body, final=False)

    def _forward(self, worker: WorkerRef, request: PendingRequest, body: Sequence[bytes],
                 final: bool) -> None:
        """Pass a worker's reply part to the client, unless it would be too
        large for the link back (then the request fails with 413)."""
        if request.state is ANSWERED:
            # already answered with an error: the worker's rest is void
            if final:
                request.state = DONE
            if self.metrics is not None:
                self.metrics.dropped("void")
            return
        if final:
            request.state = DONE
        # the worker's message was within the limits, and the client's has one
        # frame less and the service name for the envelope: it can only be
        # larger when the name is longer
        if len(request.service) > len(request.envelope):
            size = sum(map(len, body)) + len(codec.CLIENT_HEADER) + 1 + len(request.service)
            tooLarge = self.limits.oversize(size, len(body) + 4)
            if tooLarge is not None:
                if not final:
                    request.state = ANSWERED
                self.throttle.warn(log, "too-large", "reply from worker {peer} for {service} is "
                                   "too large for the client: {reason}",
                                   peer=peer_label(worker.key[1]), service=label(request.service),
                                   reason=tooLarge)
                self._reply(request, codec.error_body(
                    codec.STATUS_TOO_LARGE, f"reply too large for the client: {tooLarge}"),
                    final=True)
                if self.metrics is not None:
                    self.metrics.replied(request.service, self.now - request.assignedAt,
                                         codec.STATUS_TOO_LARGE)
                return
        if final:
            if request.dialect == RFC:  # _reply, inline: the hot path
                self._outbox.append(Send(request.client, [CLIENT_HEADER, C_FINAL, request.service,
                                                          *body]))
            else:
                self._reply(request, body, True)
            if self.logRequests or self.metrics is not None:
                self._served(request, body, worker.key)
        else:
            request.partials += 1
            if request.dialect == RFC:
                self._outbox.append(Send(request.client, [CLIENT_HEADER, C_PARTIAL, request.service,
                                                          *body]))
            else:
                self._reply(request, body, False)

    def _served(self, request: PendingRequest, body: Sequence[bytes], worker: PeerKey) -> None:
        """A worker's FINAL went to the client: one debug line, and the metrics."""
        served = self.now - request.assignedAt
        if self.logRequests:
            log.debug("{service}: request from client {client} served by worker {worker} in "
                      "{served:.4f}s after {queued:.4f}s queued", service=label(request.service),
                      client=peer_label(request.client[1]), worker=peer_label(worker[1]),
                      served=served, queued=request.assignedAt - request.arrivedAt)
        metrics = self.metrics
        if metrics is not None:
            error = codec.parse_error_body(body)
            metrics.replied(request.service, served, error[0] if error is not None else None)

    def _late(self, key: PeerKey, command: Any) -> bool:
        """A reply from a worker the broker gave up on (silent: its handler
        may have blocked its reactor; or gone: a DISCONNECT, a lost
        connection), for an assignment taken back from that very worker.
        A FINAL (with no PARTIAL before it) answers the request
        if it was queued again and no other worker has it yet: else the
        request would run again, maybe as long.  A PARTIAL spoils that (the
        client would get a reply without its beginning): the request runs
        again.  False if the reply is for no assignment taken back from it."""
        entry = self._takenBack.get(command.client)
        if entry is None or entry[0] != key:
            return False
        del self._takenBack[command.client]
        request = entry[1]
        if (type(command) is WorkerPartial or request.state is not QUEUED
                or request.envelope != command.client):
            if self.metrics is not None:
                self.metrics.dropped("orphaned")
            log.info("dropped the late {command} of worker {peer} for {service}: the broker had "
                     "given that worker up (silent, or gone), and its request is elsewhere now "
                     "or runs again",
                     command=type(command).__name__, peer=peer_label(key[1]),
                     service=label(request.service))
            return True
        service = self.services[request.service]
        service.remove(request)
        log.info("accepted the late reply of worker {peer} for {service}: the broker had given "
                 "that worker up (silent, or gone), and the request was still queued",
                 peer=peer_label(key[1]),
                 service=label(request.service))
        self._reply(request, command.body, final=True)
        self._served(request, command.body, key)
        self._forgetIfEmpty(service)
        return True

    def _onReady(self, key: PeerKey, name: bytes, dialect: str) -> None:
        service = self.services.get(name)
        access = self.access
        if access is not None and not access.mayServe(identity := _identity(key), name):
            why = f"{_who(identity)} may not serve it"
            if self.metrics is not None:
                self.metrics.deny(name, "serve")
        elif self.admission is not None and not self._admitWorker():
            why = "this broker is not the active one of its Binary Star pair"
        elif len(self.workers) >= self.maxWorkers:
            why = f"{len(self.workers)} workers already registered"
        elif service is not None and service.workers >= self.maxServiceWorkers:
            why = f"{service.workers} workers already serve {name.decode('ascii')!r}"
        else:
            self._register(key, name, dialect)
            return
        self.throttle.warn(log, "refused-ready", "refused READY from {peer} for {service}: {why}",
                           peer=peer_label(key[1]), service=label(name), why=why)
        self._sendDisconnect(key, dialect)

    def _admitWorker(self) -> bool:
        if not self.admission.admitWorker(self.now):
            return False
        self._passive = False  # admitted: active now, even before a tick says so
        return True

    def _register(self, key: PeerKey, name: bytes, dialect: str) -> None:
        service = self._service(name)
        worker = WorkerRef(key, service, dialect, Liveness(self.heartbeat, self.now))
        self.workers[key] = worker
        service.workers += 1
        service.abandonedAt = None
        service.registered = True
        log.info("worker {peer} ready for {service}", peer=peer_label(key[1]), service=label(name))
        self._makeIdle(worker)
        self._dispatch(service)

    def _makeIdle(self, worker: WorkerRef) -> None:
        worker.state = IDLE
        worker.service.idle[worker.key] = worker

    def _dispatch(self, service: ServiceQueue) -> None:
        """Hand queued requests to idle workers, least recently used first
        (none while passive)."""
        if self._passive:
            return
        while service.size and service.idle:
            _, worker = service.idle.popitem(last=False)
            self._assign(worker, service.nextRequest())

    def _assign(self, worker: WorkerRef, request: PendingRequest) -> None:
        """Send *request* to the idle *worker*, under a new envelope."""
        worker.state = BUSY
        worker.current = request
        request.state = ASSIGNED
        request.deliveries += 1
        request.assignedAt = now = self.now
        if self.metrics is not None:
            self.metrics.assigned(request.service, now - request.queuedAt)
        request.envelope = envelope = request.client[1] + next(self._assignments).to_bytes(8, "big")
        if getattr(worker.key[0], "copyOut", False):
            # the worker's transport takes bytes only: hold the copy it gets,
            # not that and the uncopied frames too (a requeue sends it again)
            request.body = as_bytes(request.body)
        if worker.dialect == RFC:  # codec.encode_worker_request, inline: the hot path
            frames = [WORKER_HEADER, W_REQUEST, envelope, b"", *request.body]
        else:
            frames = codec.encode_worker_request(envelope, request.body, worker.dialect)
        self._outbox.append(Send(worker.key, frames))
        worker.liveness.lastSent = now

    def _removeWorker(self, worker: WorkerRef) -> None:
        """Forget *worker*; re-queue the request it held (workers are
        idempotent), unless it has been handed out ``maxDeliveries`` times."""
        if self.workers.pop(worker.key, None) is None:
            return
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
        """The *worker* serving *request* is gone: queue it again."""
        if request.state is not ASSIGNED:  # ANSWERED (413): nothing is owed
            request.state = DONE
            return
        if request.deliveries >= self.maxDeliveries:
            request.state = DONE
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
        service.requeue(request)
        self._dispatch(service)

    def _unexpected(self, worker: WorkerRef, what: str) -> None:
        self.invalid += 1
        if self.metrics is not None:
            self.metrics.reject("unexpected")
        self.throttle.warn(log, "unexpected", "unexpected {what} from worker {peer}: sending "
                           "DISCONNECT", what=what, peer=peer_label(worker.key[1]))
        self._removeWorker(worker)
        self._sendDisconnect(worker.key, worker.dialect)

    def _invalid(self, key: PeerKey, reason: str, kind: str) -> None:
        """Drop an invalid message, and the connection that carried it (on
        transports that have one per peer: a peer that sends garbage holds no
        connection slot); a registered worker that sent it is no longer
        trusted: it gets DISCONNECT and is forgotten.  *kind* is the reason's
        metric label."""
        self.invalid += 1
        if self.metrics is not None:
            self.metrics.reject(kind)
        self.throttle.warn(log, "invalid", "dropped invalid message from {peer}: {reason}",
                           peer=peer_label(key[1]), reason=reason)
        worker = self.workers.get(key)
        if worker is not None:
            self._removeWorker(worker)
            self._sendDisconnect(key, worker.dialect)
        else:
            self._emit(DropPeer(key))

    def _sendDisconnect(self, key: PeerKey, dialect: str) -> None:
        """DISCONNECT, then close the connection (MDP: the worker must close
        its socket and reconnect; closing ours as well keeps a peer that only
        gets DISCONNECTs from holding a connection slot)."""
        self._send(key, dialect, codec.DISCONNECT)
        self._emit(DropPeer(key))
        self._markGone(key)

    def _markGone(self, key: PeerKey) -> None:
        """*key* is told DISCONNECT, or said it: nothing more goes to it
        (bounded: the oldest such keys go first)."""
        gone = self._gone
        gone[key] = self.now
        gone.move_to_end(key)
        if len(gone) > MAX_GONE:
            gone.popitem(last=False)

    def _send(self, key: PeerKey, dialect: str, command: Any) -> None:
        self._emit(Send(key, codec.encode(command, dialect)))

    # --- time ----------------------------------------------------------------

    def _tick(self, now: float) -> None:
        """Once per heartbeat interval: heartbeats, dead workers, expired
        requests, services at the end of their linger."""
        for worker in list(self.workers.values()):
            liveness = worker.liveness
            if liveness.dead(now):
                log.warn("worker {peer} for {service} silent for {silence:.1f}s: removed",
                         peer=peer_label(worker.key[1]), service=label(worker.service.name),
                         silence=liveness.silence(now))
                if self.metrics is not None:
                    self.metrics.expired(worker.service.name)
                self._removeWorker(worker)
            elif liveness.due(now, 0.5):
                self._send(worker.key, worker.dialect, codec.HEARTBEAT)
                liveness.sent(now)
        gone, since = self._gone, now - self.heartbeat.expiry
        while gone and next(iter(gone.values())) < since:
            gone.popitem(last=False)
        self._expire(now - self.requestExpiry)
        self._giveUpUnknown(now)
        if self._takenBack:
            # forget assignments whose request left the queue: no late reply
            # can answer them, and their bodies should not linger here
            self._takenBack = OrderedDict(
                (envelope, entry) for envelope, entry in self._takenBack.items()
                if entry[1].state is QUEUED and entry[1].envelope == envelope)
        if self.admission is not None:
            self._checkAdmission(now)
        abandoned = self._abandoned
        while abandoned and abandoned[0][0] + self.serviceLinger <= now:
            self._forgetIfEmpty(abandoned.popleft()[1])

    def _checkAdmission(self, now: float) -> None:
        """What the admission says now.  A broker that has just become active
        learns its workers (_unknownDeadline): notice when, even before a
        client asks.  A passive one (its Binary Star peer took over while it
        was stalled) serves nothing more: its queued requests are dropped
        unanswered, as a request it refuses is (a client still waiting for
        one times out and sends it to the active broker, where a 503 would
        end it), and its workers get DISCONNECT so they register there, a
        busy one once it replied."""
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
        if self._passive and (self.workers or self._ledger.count):
            self._giveUpQueued()
            idle = [worker for worker in self.workers.values() if worker.current is None]
            for worker in idle:
                self._release(worker)
            if idle:
                self.throttle.info(log, "released", "this broker is passive: sent DISCONNECT "
                                   "to {count} idle workers, so they go to the active one",
                                   count=len(idle))

    def _release(self, worker: WorkerRef) -> None:
        self._removeWorker(worker)
        self._sendDisconnect(worker.key, worker.dialect)

    def _giveUpQueued(self) -> None:
        dropped = 0
        for service in list(self.services.values()):
            while service.size:
                request = service.nextRequest()
                request.state = DONE
                dropped += 1
                if self.metrics is not None:
                    self.metrics.refuse(request.service, "passive")
            self._forgetIfEmpty(service)
        if dropped:
            log.info("this broker is passive: dropped {count} queued requests unanswered "
                     "(their clients send them to the active broker)", count=dropped)

    def _expire(self, deadline: float) -> None:
        """Answer 503 to every request queued at or before *deadline*."""
        byAge = self._ledger.byAge
        while byAge and byAge[0][0] <= deadline:
            queuedAt, request = byAge.popleft()
            if request.state is not QUEUED or request.queuedAt != queuedAt:
                continue  # it left the queue (or was queued again) since
            service = self.services[request.service]
            service.remove(request)
            why = ("no worker for service" if not service.workers
                   else "no worker free for service")
            self._unavailable(request, f"{why} {label(service.name)!r} within "
                              f"{self.requestExpiry:g}s")
            self._forgetIfEmpty(service)

    def _unavailable(self, request: PendingRequest, message: str) -> None:
        self._reply(request, codec.error_body(codec.STATUS_UNAVAILABLE, message), final=True)
        if self.metrics is not None:
            self.metrics.replied(request.service, None, codec.STATUS_UNAVAILABLE)

    def _giveUpUnknown(self, now: float) -> None:
        """Answer 503 to the requests of each service no worker registered
        for within ``unknownServiceExpiry`` of its first request (MDP/0.2:
        queue requests for an unknown service, expire them after a
        configurable time), and forget it."""
        unknown = self._unknown
        while unknown and unknown[0][0] <= now + 1e-9:
            deadline, service = unknown.popleft()
            if service.registered or self.services.get(service.name) is not service:
                continue
            service.unknownUntil = 0.0
            message = (f"no worker for service {label(service.name)!r}: none registered "
                       f"within {deadline - service.askedAt:g}s")
            while service.size:
                request = service.nextRequest()
                request.state = DONE
                self._unavailable(request, message)
            self._forgetIfEmpty(service)
        if unknown:
            self._emit(WakeAt(unknown[0][0]))


class Broker(BrokerMachine):
    """An MDP/0.2 broker: the :class:`BrokerMachine` driven over real
    transports.  Bind it with :meth:`listen` (several times for separate
    client and worker endpoints) or hand out :meth:`streamFactory`.  The
    driver owns the bindings, the one periodic timer and the Deferreds; every
    decision is the machine's."""

    def __init__(self, reactor: Optional[Any] = None, *, curveSecret: Optional[str] = None,
                 curveAllow: Optional[str] = None, **options: Any) -> None:
        self.reactor = default_reactor(reactor)
        #: the key pair and allow-list of its zmq: endpoints (docs/security.md)
        self.curve = curve_server(curveSecret, curveAllow)
        super().__init__(now=self.reactor.seconds(), **options)
        self.bindings: list[Binding] = []
        self._ticker = task.LoopingCall(self.tick)
        self._ticker.clock = self.reactor
        self._wakeCall: Any = None

    def received(self, key: PeerKey, frames: list[bytes]) -> None:
        """A message from peer *key* (the (binding, peer id) it came from)."""
        self._perform(self.handleMessage(key, frames, self.reactor.seconds()))

    def peerGone(self, key: PeerKey) -> None:
        """A transport lost the peer *key*."""
        self._perform(self.handlePeerGone(key, self.reactor.seconds()))

    def admissionChanged(self) -> None:
        """Tell the broker its admission changed state (``BrokerService``
        does, on its Binary Star's changes): a broker gone passive lets its
        workers and queue go at once, not at its next tick."""
        self._perform(self.handleAdmissionChange(self.reactor.seconds()))

    def tick(self) -> None:
        try:
            self._perform(self.handleTick(self.reactor.seconds()))
        except Exception:  # the tick must go on: heartbeats depend on it
            log.failure("broker tick failed")

    def _wake(self) -> None:
        self._wakeCall = None
        try:
            self._perform(self.handleWake(self.reactor.seconds()))
        except Exception:
            log.failure("broker wake-up failed")

    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            kind = type(action)
            if kind is Send:
                binding, peer = action.key
                transport = binding.transport
                if transport is not None:  # Binding.send, inline: the hot path
                    frames = action.frames
                    transport.sendMessage(peer, as_bytes(frames) if binding.copyOut else frames)
            elif kind is DropPeer:
                binding, peer = action.key
                binding.disconnect(peer)
            else:
                self._wakeAt(action.time)

    def _wakeAt(self, when: float) -> None:
        call = self._wakeCall
        if call is not None and call.active():
            if call.getTime() <= when:
                return
            call.cancel()
        self._wakeCall = self.reactor.callLater(max(0.0, when - self.reactor.seconds()), self._wake)

    def snapshot(self, serviceLimit: Optional[int] = None, workerLimit: Optional[int] = None,
                 service: Optional[bytes] = None, *,
                 visible: Optional[Callable[[bytes], bool]] = None) -> BrokerSnapshot:
        self.now = self.reactor.seconds()
        return super().snapshot(serviceLimit, workerLimit, service, visible=visible)

    def isServiceAvailable(self, name: bytes) -> bool:
        self.now = self.reactor.seconds()
        return super().isServiceAvailable(name)

    def admissionStatus(self) -> Optional[dict[str, Any]]:
        self.now = self.reactor.seconds()
        return super().admissionStatus()

    # --- lifecycle -----------------------------------------------------------

    def listen(
        self, endpoint: str, clients: bool = True, workers: bool = True
    ) -> defer.Deferred[IRouterTransport]:
        """Bind *endpoint*; it accepts clients, workers or both.  A malformed
        endpoint raises :class:`~mdp.errors.TransportError` at once; a failure
        to bind fails the Deferred."""
        binding = Binding(self, clients, workers)

        def bound(routerTransport: IRouterTransport) -> IRouterTransport:
            self._bind(binding, routerTransport)
            return routerTransport

        security = transport.curve_listen_for(endpoint, self.curve)
        transport.warn_if_open(endpoint, security, "MDP broker")
        return transport.listen(endpoint, binding, self.reactor, limits=self.limits,
                                security=security).addCallback(bound)

    def streamFactory(self, clients: bool = True, workers: bool = True) -> IProtocolFactory:
        """An :class:`IProtocolFactory` whose connections (speaking the
        stream transport's records) this broker serves, for listening with a
        Twisted endpoint, a TLS wrapper or an ``Application`` of one's own::

            port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
                broker.streamFactory())

        Its peers connect with ``tcp:host=HOST:port=PORT`` (or the matching
        stream scheme).  :meth:`close` drops its connections; stopping the
        port is the caller's."""
        binding = Binding(self, clients, workers)
        router = StreamRouter(binding, self.reactor, limits=self.limits)
        self._bind(binding, router)
        return router.factory()

    def _bind(self, binding: Binding, routerTransport: IRouterTransport) -> None:
        binding.transport = routerTransport
        self.bindings.append(binding)
        # frames one binding delivers uncopied go out as bytes where the
        # transport takes nothing else (loopback, a test double)
        buffers = any(getattr(b.transport, "deliversBuffers", False) for b in self.bindings)
        for each in self.bindings:
            each.copyOut = buffers and not getattr(each.transport, "acceptsBuffers", False)
        roles = "+".join(r for r, on in (("clients", binding.clients),
                                         ("workers", binding.workers)) if on)
        if routerTransport.endpoint:
            log.info("MDP broker listening on {endpoint} for {roles}",
                     endpoint=routerTransport.endpoint, roles=roles)
        else:  # (streamFactory: listening is its caller's, and not done yet)
            log.info("MDP broker serving {roles} through a protocol factory", roles=roles)
        if not self._ticker.running:
            self._ticker.start(self.wakeEvery, now=False)

    def close(self) -> defer.Deferred[None]:
        """Unbind every endpoint and stop the heartbeat tick."""
        if self._ticker.running:
            self._ticker.stop()
        if self._wakeCall is not None and self._wakeCall.active():
            self._wakeCall.cancel()
        self._wakeCall = None
        bindings, self.bindings = self.bindings, []
        closing = [b.transport for b in bindings if b.transport is not None]
        self.reset()
        return transport.close_all(closing, "a broker listener")


# (not a class decorator: compiled, the class is an extension type, which takes none)
classImplements(Broker, IBroker)
