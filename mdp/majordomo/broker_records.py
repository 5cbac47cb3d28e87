"""What a broker keeps: its requests (:class:`PendingRequest`, in a :class:`RequestState`), its
registered workers (:class:`WorkerRef`, in a :class:`WorkerState`) and the :class:`ServiceQueue` of
each service that holds them.  :class:`~mdp.majordomo.broker_machine.BrokerMachine` decides their
transitions (docs/machines.md)."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import Any, Hashable, Optional, Sequence

import attrs

from mdp.policy import Liveness

#: ``(route, peer id)``: the route (which binding) is the driver's, opaque here
PeerKey = tuple[Hashable, bytes]


def as_bytes(frames: Sequence[Any]) -> list[bytes]:
    """*frames* with every non-``bytes`` frame (an uncopied ZeroMQ frame) copied."""
    for frame in frames:
        if type(frame) is not bytes:
            return [f if type(f) is bytes else bytes(f) for f in frames]
    return frames  # type: ignore[return-value]


class RequestState(enum.Enum):
    """What a client request is doing (see the table in the module docstring)."""

    NEW = "new"
    QUEUED = "queued"
    #: handed to a worker, whose reply is forwarded to the client
    ASSIGNED = "assigned"
    #: handed to a worker but already answered (413): the rest is dropped
    ANSWERED = "answered"
    #: answered, expired, or its client is gone
    DONE = "done"


NEW, QUEUED, ASSIGNED, ANSWERED, DONE = RequestState


class WorkerState(enum.Enum):
    """What a registered worker is doing (see the table in the module docstring)."""

    IDLE = "idle"
    #: serving ``WorkerRef.current``
    BUSY = "busy"
    #: forgotten: disconnected, lost, silent or misbehaving
    GONE = "gone"


IDLE, BUSY, GONE = WorkerState


def _fields_repr(record: Any) -> str:
    """``Name(field=value, ...)`` over *record*'s ``__slots__``, as attrs would show it."""
    fields = ", ".join(f"{name}={getattr(record, name)!r}" for name in type(record).__slots__)
    return f"{type(record).__name__}({fields})"


class PendingRequest:
    """A client request accepted and not yet answered (plain class: compiled, an extension type)."""

    __slots__ = ("client", "service", "body", "dialect", "queuedAt", "size", "state", "envelope",
                 "deliveries", "partials", "arrivedAt", "assignedAt", "context", "deadline", "holder",
                 "givenUp")

    def __init__(self, client: PeerKey, service: bytes, body: Sequence[bytes], dialect: str,
                 arrivedAt: float, size: int) -> None:
        self.client = client
        self.service = service
        self.body = body
        self.dialect = dialect
        self.queuedAt = arrivedAt  # when it arrived, or was queued again
        self.size = size  # what holding its body costs (policy.held_bytes)
        self.state = NEW
        self.envelope = b""  # of its current assignment
        self.deliveries = 0  # times handed to a worker
        self.partials = 0  # PARTIALs forwarded to the client by its current worker
        self.arrivedAt = arrivedAt
        self.assignedAt = 0.0  # when its current assignment began
        self.context: Any = None  # its RequestContext (mdp.majordomo.extension), if it came with one
        self.deadline: Optional[float] = None  # when its caller stops waiting, if it said
        self.holder: Optional[PeerKey] = None  # the worker of its current assignment
        self.givenUp = False  # its client cancelled it while a worker had it

    def __repr__(self) -> str:
        return _fields_repr(self)


class WorkerRef:
    """The broker's view of one registered worker (a plain class, as :class:`PendingRequest`)."""

    __slots__ = ("key", "service", "dialect", "liveness", "state", "current", "useful",
                 "lastEnvelope", "extended")

    def __init__(self, key: PeerKey, service: ServiceQueue, dialect: str, liveness: Liveness) -> None:
        self.key = key
        self.service = service
        self.dialect = dialect
        self.liveness = liveness
        self.state = IDLE
        self.current: Optional[PendingRequest] = None  # the request it serves while BUSY
        #: the assignment it finished last (a second FINAL for it is dropped)
        self.lastEnvelope = b""
        self.useful = False  # handed a request, or of a service that was
        self.extended = False  # it declared the request-context extension in READY

    def __repr__(self) -> str:
        return _fields_repr(self)


class QueueLedger:
    """Totals over all service queues, kept by the queues: requests and bytes,
    each client's services with requests waiting, and queued requests by age
    (for expiry; stale entries are skipped lazily)."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.byClient: dict[PeerKey, set[ServiceQueue]] = {}
        self.byAge: deque[tuple[float, PendingRequest]] = deque()


class ServiceQueue:
    """Requests waiting for one service and the workers able to serve it;
    every change is also counted in the broker-wide *ledger*."""

    def __init__(self, name: bytes, ledger: QueueLedger) -> None:
        self.name = name
        self.ledger = ledger
        self.pending: OrderedDict[PeerKey, deque[PendingRequest]] = OrderedDict()
        self.idle: OrderedDict[PeerKey, WorkerRef] = OrderedDict()
        self.workers = 0
        self.size = 0
        self.bytes = 0
        #: when the last worker left (None while it has workers or never had one)
        self.abandonedAt: Optional[float] = None
        #: a worker has registered for it (else requests wait ``unknownServiceExpiry``)
        self.registered = False
        #: kept until then, even empty, while unregistered: retries share the window
        self.unknownUntil = 0.0
        #: when a request first asked for it while unregistered
        self.askedAt = 0.0
        self.wanted = False  # a request for it went to a worker: its workers are useful

    def _dropClientQueue(self, client: PeerKey) -> None:
        del self.pending[client]
        services = self.ledger.byClient[client]
        services.discard(self)
        if not services:
            del self.ledger.byClient[client]

    def enqueue(self, request: PendingRequest, first: bool = False) -> None:
        """Queue *request* after its client's others, or *first* of all (it has waited longest)."""
        client = request.client
        queue = self.pending.get(client)
        if queue is None:
            queue = self.pending[client] = deque()
            self.ledger.byClient.setdefault(client, set()).add(self)
        if first:
            queue.appendleft(request)
            self.pending.move_to_end(client, last=False)
        else:
            queue.append(request)
        request.state = QUEUED
        self._grow(1, request.size)
        ledger = self.ledger
        ledger.byAge.append((request.queuedAt, request))
        if len(ledger.byAge) > 2 * ledger.count + 1024:  # stale entries are many: drop them
            ledger.byAge = deque(e for e in ledger.byAge if e[1].state is QUEUED and e[1].queuedAt == e[0])

    def nextRequest(self) -> PendingRequest:
        """Round-robin: the first client's oldest request; that client goes to the back."""
        client, queue = next(iter(self.pending.items()))
        request = queue.popleft()
        if queue:
            self.pending.move_to_end(client)
        else:
            self._dropClientQueue(client)
        self._grow(-1, -request.size)
        return request

    def remove(self, request: PendingRequest) -> None:
        queue = self.pending[request.client]
        queue.remove(request)
        if not queue:
            self._dropClientQueue(request.client)
        request.state = DONE
        self._grow(-1, -request.size)

    def dropClient(self, client: PeerKey) -> None:
        """Forget every request *client* has queued here."""
        queue = self.pending.get(client)
        if queue:
            self._dropClientQueue(client)
            for request in queue:
                request.state = DONE
            self._grow(-len(queue), -sum(r.size for r in queue))

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
