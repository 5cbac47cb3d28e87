"""What a broker keeps: its requests and registered workers, their states
and transitions (what :class:`~mdp.majordomo.broker_machine.BrokerMachine`
decides is written here), and the service queues that hold them.

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

A single tick per heartbeat interval sends heartbeats, removes silent workers
(re-queueing the request each held), expires requests queued longer than
``requestExpiry`` (503), and forgets services whose last worker left more than
``serviceLinger`` seconds ago.  Each worker's silence is judged by a
:class:`~mdp.policy.Liveness`.

Limits (``docs/reliability.md`` has the table): queues hold at most
``maxQueue`` requests and ``maxQueueBytes`` of bodies in all, and
``maxServiceQueue`` / ``maxServiceQueueBytes`` per service (beyond: 429;
requests taken back from a lost worker are re-queued even past them); at most
``maxWorkers`` in all and ``maxServiceWorkers`` per service register (beyond:
DISCONNECT); a request or reply beyond ``limits`` fails with 413; a request
whose worker is lost ``maxDeliveries`` times fails with 500.

A registered worker (a :class:`WorkerRef`, in a :class:`WorkerState`):

=========  =========================================  =====  ===============================
state      event                                      next   actions
=========  =========================================  =====  ===============================
(none)     READY within ``maxWorkers`` and            IDLE   at the back of its service's
           ``maxServiceWorkers``, admitted                   idle line
(none)     READY refused; any other command           --     DISCONNECT
IDLE       a request for its service, none ahead      BUSY   REQUEST under a new envelope
BUSY       PARTIAL with the current envelope          BUSY   PARTIAL to the client
BUSY       FINAL with the current envelope            IDLE   FINAL to the client (then BUSY
                                                             with the next queued request)
BUSY       FINAL with the envelope it answered last   same   dropped (a second FINAL)
any        any message                                same   its silence restarts
any        tick, nothing sent for half an interval    same   HEARTBEAT
any        DISCONNECT; peer lost; silent for more     GONE   its request is taken back
           than ``interval × liveness``
any        invalid or unexpected command (PARTIAL or  GONE   DISCONNECT; its request is
           FINAL while IDLE or for another envelope,         taken back
           READY again, REQUEST)
=========  =========================================  =====  ===============================

A client request (a :class:`PendingRequest`, in a :class:`RequestState`):

========  ==========================================  ========  ============================
state     event                                       next      actions
========  ==========================================  ========  ============================
NEW       refused by the ``admission`` (a passive     DONE      none: the client tries
          Binary Star), unless ``mmi.binarystar``               another broker
NEW       ``mmi.*``; too large; queues full           DONE      answered at once (413, 429)
NEW       an idle worker and nothing queued           ASSIGNED  REQUEST to the worker
NEW       else                                        QUEUED    waits in its service's queue
QUEUED    a worker of its service is idle             ASSIGNED  REQUEST to the worker
QUEUED    waited ``requestExpiry``; no worker ever    DONE      503 error reply
          registered ``unknownServiceExpiry`` after
          its service's first request
QUEUED    a late FINAL of the worker it was taken     DONE      FINAL to the client
          back from (no PARTIAL of it went out)
QUEUED    its client is lost                          DONE      forgotten
ASSIGNED  PARTIAL; FINAL                              same;     to the client
                                                      DONE
ASSIGNED  a reply part too large for the client       ANSWERED  413 error reply (a FINAL:
                                                                DONE)
ANSWERED  PARTIAL; FINAL or its worker GONE           same;     dropped
                                                      DONE
ASSIGNED  its worker is GONE                          QUEUED    at the head; the restart
                                                                marker first if PARTIALs
                                                                went out
ASSIGNED  its worker is GONE ``maxDeliveries`` times  DONE      500 error reply
========  ==========================================  ========  ============================
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import Any, Hashable, Optional, Sequence

import attrs

from mdp.policy import Liveness

#: ``(route, peer id)``: the route (which binding) is the driver's, opaque here
PeerKey = tuple[Hashable, bytes]


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
    plain class, not attrs: compiled, it is an extension type.)"""

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
            self.ledger.byClient.setdefault(client, set()).add(self)
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


@attrs.frozen
class ServiceSnapshot:
    """One service as :meth:`BrokerMachine.snapshot` saw it."""

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
    """One registered worker as :meth:`BrokerMachine.snapshot` saw it."""

    peer: str  # its peer id, printable (hex)
    service: bytes
    dialect: str
    busy: bool
    silence: float  # seconds since it was last heard from


@attrs.frozen
class BrokerSnapshot:
    """A read-only view of a broker at one moment (:meth:`BrokerMachine.snapshot`)."""

    at: float  # the broker's clock
    services: tuple[ServiceSnapshot, ...]  # by name (the first ``serviceLimit``)
    workers: tuple[WorkerSnapshot, ...]  # by registration (the first ``workerLimit``)
    serviceCount: int  # services known, listed or not
    workerCount: int  # registered workers (of the service asked for), listed or not
    queued: int  # requests waiting, in all
    queuedBytes: int
