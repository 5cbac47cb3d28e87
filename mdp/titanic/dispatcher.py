"""Titanic's dispatcher: stored requests to their services, replies to the store.
:class:`DispatchMachine` decides, :class:`Dispatcher` drives it with a store and
an MDP client (docs/titanic.md, "The dispatcher")."""

from __future__ import annotations

import enum
import inspect
import json
import math
import uuid
from collections import Counter
from typing import Any, Callable, Optional, Sequence, Union

import attrs
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from mdp import transport
from mdp.errors import ClientClosed, RemoteError, ReplyTooLarge, RequestTooLarge
from mdp.machine import Machine, action_type
from mdp.majordomo import mmi
from mdp.majordomo.client import Client
from mdp.majordomo.idempotence import STAMP_MARKER, stamp
from mdp.messages import STATUS_TOO_LARGE, STATUS_WORKER_ERROR, error_body
from mdp.policy import Backoff, Limits, LogThrottle, call_at, default_reactor, positive_seconds, whole_number
from mdp.titanic.client import TRANSIENT
from mdp.titanic.store import ITitanicStore, StoredRequest, report_failure

log = Logger()

#: Seconds a reply is kept after it is stored: one day.
DEFAULT_KEEP = 24 * 3600.0
DEFAULT_PURGE_EVERY = 60.0
DEFAULT_CONCURRENCY = 4
#: Seconds one attempt of a request may take before it is tried again.
DEFAULT_TIMEOUT = 30.0
#: Wait before asking again about a parked service.
DEFAULT_BACKOFF = Backoff(1.0, 32.0)
#: What a ``titanic.reply`` answer adds to a stored reply (a stream must fit the limits less this).
REPLY_RESERVE_BYTES = 512
REPLY_RESERVE_FRAMES = 8
#: Seconds an answer that a service has workers is trusted.
DEFAULT_RECHECK = 5.0
#: Seconds between two ``mmi.services`` listings: how soon a service that appears is served.
DEFAULT_LIST_EVERY = 1.0
#: Seconds between two reads of a store shared with other Titanics (at most half its lease).
REREAD_EVERY = 1.0
#: ``mmi.services`` unanswered this many times in a row: go on as without a listing.
LIST_TRIES = 3


class ServiceState(enum.Enum):
    """What the dispatcher knows of a service."""

    UNKNOWN = "unknown"
    #: the broker asked, no answer yet
    CHECKING = "checking"
    #: it has a worker, or the broker still knows it: requests go out
    AVAILABLE = "available"
    #: no worker and unknown to the broker, or a request failed: ask again later
    PARKED = "parked"


@attrs.define
class _Service:
    name: bytes
    state: ServiceState = ServiceState.UNKNOWN
    #: parks since the last stored reply (the backoff step)
    failures: int = 0
    #: AVAILABLE: trusted until; PARKED: parked until
    until: float = 0.0
    #: as the broker last said (None: not known; 0: none, but still known)
    workers: Optional[int] = None


#: Read up to *limit* pending requests, oldest first, without these (or only *onlyServices*').
LoadPending = action_type(__name__, "LoadPending", "limit", "skipServices", "skipIds", onlyServices=None)
#: Ask the broker which services it knows (``mmi.services``).
ListServices = action_type(__name__, "ListServices")
#: Ask the broker how many workers *service* has, or whether it knows it.
CheckService = action_type(__name__, "CheckService", "service")
Dispatch = action_type(__name__, "Dispatch", "request")
StoreReply = action_type(__name__, "StoreReply", "requestId", "frames")
#: Drop replies stored before *before*.
Purge = action_type(__name__, "Purge", "before")
#: A service was parked for *delay* seconds (for the log).
Parked = action_type(__name__, "Parked", "service", "delay", "reason")
#: Call :meth:`DispatchMachine.handleWake` at *when* (``None``: never).
WakeAt = action_type(__name__, "WakeAt", "when")
Action = Any


class DispatchMachine(Machine):
    """Which stored request goes out when.  With *listEvery*, only the requests of the services the broker
    lists (asked that often) are read; without it, or without a full listing, each service is asked about
    (``mmi.workers``, ``mmi.service``) and parked with a backoff of its own.  With *rereadEvery*
    (a store shared with other Titanics), the store is read that often besides: requests others
    stored, or whose claims lapsed with a Titanic that died, are found."""

    def __init__(self, *, concurrency: int = DEFAULT_CONCURRENCY, backoff: Backoff = DEFAULT_BACKOFF,
                 keep: float = DEFAULT_KEEP, purgeEvery: float = DEFAULT_PURGE_EVERY,
                 recheck: float = DEFAULT_RECHECK, window: Optional[int] = None,
                 listEvery: Optional[float] = None, rereadEvery: Optional[float] = None,
                 now: float = 0.0) -> None:
        super().__init__(now)
        self.rereadEvery = None if rereadEvery is None else positive_seconds("rereadEvery", rereadEvery)
        self.concurrency = whole_number("concurrency", concurrency)
        self.backoff = backoff
        self.keep = positive_seconds("keep", keep)
        self.purgeEvery = positive_seconds("purgeEvery", purgeEvery)
        self.recheck = positive_seconds("recheck", recheck)
        self.listEvery = None if listEvery is None else positive_seconds("listEvery", listEvery)
        #: most requests held at once (out + waiting)
        self.window = window if window is not None else max(2 * concurrency, 16)
        self._wake: Optional[float] = None
        self._forgetAll()

    def _forgetAll(self) -> None:
        self.running = False
        #: loaded, not yet out, oldest first
        self.queue: list[StoredRequest] = []
        #: out (or their reply being stored), by id
        self.inflight: dict[str, StoredRequest] = {}
        self.services: dict[bytes, _Service] = {}
        #: replies being stored, by request id (kept until committed)
        self._storing: dict[str, list[bytes]] = {}
        #: replies whose store failed, to store again once the store works
        self._unsaved: set[str] = set()
        self._dirty = False  # the store may hold pending requests we have not read
        #: services holding as many requests as they may; read more once one is done
        self._full: set[bytes] = set()
        #: read beyond their service's share (at most a window): the next to go
        self._spare: list[StoredRequest] = []
        self._loading = False
        self._storeFailures = 0
        self._storeRetryAt: Optional[float] = None
        #: services the broker lists, with their workers (None: no full listing, ask each)
        self.listing: Optional[dict[bytes, int]] = None
        #: when to list next (None: a listing is asked for, or listing is off)
        self._nextList: Optional[float] = None
        #: no answer to the first listing yet: read nothing before it
        self._unlisted = self.listEvery is not None
        self._listedAt = -math.inf  # when the last listing was asked for
        self._listFailures = 0  # in a row
        self._nextReread: Optional[float] = None

    def handleStart(self, now: float) -> list[Action]:
        self.now = now
        self.running = True
        self._dirty = True
        self._nextPurge = now
        self._nextList = None if self.listEvery is None else now
        self._nextReread = None if self.rereadEvery is None else now
        return self._tick()

    def handleListed(self, listing: Optional[dict[bytes, int]], now: float) -> list[Action]:
        """The services the broker knows, with their workers (``None``: no full listing)."""
        self.now = now
        if listing is not None:
            self._listFailures = 0
        if not self.running or self.listEvery is None:
            return self._drain()
        old, self.listing = self.listing, listing
        self._unlisted = False
        self._nextList = now + (self.listEvery if listing is not None else self.backoff.maximum)
        if listing != old:
            self._relisted(old or {}, listing or {})
        return self._pumped()

    def _relisted(self, old: dict[bytes, int], new: dict[bytes, int]) -> None:
        """What the listing says now holds; a service with workers again is unparked."""
        self._dirty = True
        self._full = {name for name in self._full if name in new and new[name] == old.get(name)}
        for name, entry in self.services.items():
            appeared = new.get(name) and not old.get(name)
            if entry.state is ServiceState.AVAILABLE or (appeared and entry.state is ServiceState.PARKED):
                entry.state = ServiceState.UNKNOWN

    def handleListFailed(self, reason: str, now: float) -> list[Action]:
        """No listing (the broker away): keep the last; after :data:`LIST_TRIES`, go without."""
        self.now = now
        self._listFailures += 1
        if self._listFailures >= LIST_TRIES:
            return self.handleListed(None, now)
        if self.running and self.listEvery is not None:
            self._nextList = now + self.listEvery
        return self._pumped()

    def handleStored(self, requestId: str, now: float) -> list[Action]:
        """A request was stored: read it, and list soon (its service may be new)."""
        self.now = now
        self._dirty = True
        if self.listEvery is not None and self._nextList is not None:
            self._nextList = min(self._nextList, max(now, self._listedAt + self.listEvery / 4))
        return self._pumped()

    def handleLoaded(self, requests: Sequence[StoredRequest], limit: int, now: float) -> list[Action]:
        """The answer to LoadPending(*limit*)."""
        self.now = now
        self._loading = False
        if not self._unsaved:
            self._storeFailures = 0
        if len(requests) >= limit:
            self._dirty = True  # there may be more
        if self.running:
            held = {r.id for r in self._heldRequests()}
            self.queue.extend(r for r in requests if r.id not in held)
            self.queue.sort(key=lambda r: r.created)
        return self._pumped()

    def handleLoadFailed(self, reason: str, now: float) -> list[Action]:
        self.now = now
        self._loading = False
        return self._storeTrouble()

    def handleChecked(self, service: bytes, available: bool, reason: str, now: float) -> list[Action]:
        """No worker count (``mmi.service``, or a failure): bound by *concurrency* alone."""
        return self._checked(service, None, available, reason, now)

    def handleCounted(self, service: bytes, workers: int, now: float) -> list[Action]:
        """``mmi.workers`` counted *workers* (none: parked); as many may be out at once."""
        return self._checked(service, workers, workers > 0,
                             "" if workers > 0 else "no worker (mmi.workers)", now)

    def handleLingering(self, service: bytes, now: float) -> list[Action]:
        """No worker counted but ``mmi.service`` says ``200`` (restarting): one out at a time."""
        return self._checked(service, 0, True, "", now)

    def _checked(self, service: bytes, workers: Optional[int], available: bool, reason: str,
                 now: float) -> list[Action]:
        self.now = now
        entry = self.services.get(service)
        if entry is not None and entry.state is ServiceState.CHECKING:
            if service in self._full and (workers is not None or entry.workers is not None):
                self._dirty = True  # it may take more now
            entry.workers = workers
            if available:
                entry.state = ServiceState.AVAILABLE
                entry.until = now + self.recheck
            else:
                self._park(entry, reason)
        return self._pumped()

    def handleReply(self, requestId: str, frames: list[bytes], now: float) -> list[Action]:
        """A request's final reply (or final error reply) arrived."""
        self.now = now
        if self.running and requestId in self.inflight and requestId not in self._storing:
            self._storing[requestId] = frames
            self._emit(StoreReply(requestId, frames))
        return self._drain()

    def handleFailed(self, requestId: str, reason: str, now: float) -> list[Action]:
        """A retryable failure (timeout, no worker, overload, no broker): it stays pending."""
        self.now = now
        request = self.inflight.pop(requestId, None)
        if request is not None:
            self._park(self._service(request.service), reason)
            self._dirty = True
            self._full.discard(request.service)
        return self._pumped()

    def handleReplyStored(self, requestId: str, now: float) -> list[Action]:
        self.now = now
        request = self.inflight.pop(requestId, None)
        self._storing.pop(requestId, None)
        if request is not None:
            entry = self._service(request.service)
            entry.failures = 0
            if entry.workers == 0 and entry.state is ServiceState.AVAILABLE:
                # it replied with no worker counted: count again, not one at a time
                entry.state = ServiceState.UNKNOWN
            self._freed(request.service)
        self._storeFailures = 0
        return self._pumped()

    def handleStoreFailed(self, requestId: str, reason: str, now: float) -> list[Action]:
        """Keep the reply (the request stays out, not run again); store it again after a backoff."""
        self.now = now
        if self.running and requestId in self._storing:
            self._unsaved.add(requestId)
        return self._storeTrouble()

    def handleClosed(self, requestId: str, now: float) -> list[Action]:
        self.now = now
        request = next((r for r in self.queue if r.id == requestId), None)
        if request is not None:
            self.queue.remove(request)
            self._freed(request.service)
        self._spare = [r for r in self._spare if r.id != requestId]
        return self._pumped()

    def handleWake(self, now: float) -> list[Action]:
        self.now = now
        self._wake = None
        return self._tick()

    def handleStop(self, now: float) -> list[Action]:
        self.now = now
        self._forgetAll()
        self._setWake(None)
        return self._drain()

    def _pumped(self) -> list[Action]:
        self._pump()
        return self._drain()

    def _service(self, name: bytes) -> _Service:
        entry = self.services.get(name)
        if entry is None:
            entry = self.services[name] = _Service(name)
        return entry

    def _freed(self, service: bytes) -> None:
        """One of *service*'s requests is held no more: read any left in the store."""
        if service in self._full and not any(r.service == service for r in self._spare):
            self._full.discard(service)
            self._dirty = True

    def _park(self, entry: _Service, reason: str) -> None:
        if entry.state is ServiceState.PARKED:
            return  # one outage, one step of backoff
        delay = self.backoff.delay(entry.failures)
        entry.failures += 1
        entry.state = ServiceState.PARKED
        # on a whole second: services parked together are read again in one go
        entry.until = float(math.ceil(self.now + delay))
        self._emit(Parked(entry.name, delay, reason))

    def _storeTrouble(self) -> list[Action]:
        self._storeRetryAt = self.now + self.backoff.delay(self._storeFailures)
        self._storeFailures += 1
        self._dirty = True
        return self._pumped()

    def _tick(self) -> list[Action]:
        """What is due at :attr:`now`: unpark, retry the store, purge, list."""
        if not self.running:
            return self._drain()
        for entry in self.services.values():
            if entry.state is ServiceState.PARKED and entry.until <= self.now:
                entry.state = ServiceState.UNKNOWN
                self._dirty = True
        if self._storeRetryAt is not None and self._storeRetryAt <= self.now:
            self._storeRetryAt = None
            for requestId in sorted(self._unsaved):
                self._emit(StoreReply(requestId, self._storing[requestId]))
            self._unsaved.clear()
        self._forgetIdleServices()
        if self._nextPurge <= self.now:
            self._emit(Purge(self.now - self.keep))
            self._nextPurge = self.now + self.purgeEvery
        self._rereadIfDue()
        self._listIfDue()
        return self._pumped()

    def _rereadIfDue(self) -> None:
        if self._nextReread is not None and self.rereadEvery is not None and self._nextReread <= self.now:
            self._dirty = True
            self._nextReread = self.now + self.rereadEvery

    def _listIfDue(self) -> None:
        if self._nextList is not None and self._nextList <= self.now:
            self._nextList = None
            self._listedAt = self.now
            self._emit(ListServices())

    def _forgetIdleServices(self) -> None:
        """Drop idle services: the table must not grow with every name ever submitted."""
        held = {r.service for r in self._heldRequests()}
        for name, entry in list(self.services.items()):
            if name in held or entry.state in (ServiceState.PARKED, ServiceState.CHECKING):
                continue
            if entry.until < self.now - 2 * self.backoff.maximum or entry.failures == 0 and (
                    entry.state is ServiceState.UNKNOWN or entry.until <= self.now):
                del self.services[name]
                self._full.discard(name)

    def _heldRequests(self) -> list[StoredRequest]:
        return [*self.queue, *self.inflight.values(), *self._spare]

    def _pump(self) -> None:
        if not self.running:
            return
        held = self._placeQueue()
        if self._timeToRead():
            self._readPending(held)
        due = (self._storeRetryAt, self._nextList, self._nextPurge, self._nextReread)
        parked = (e.until for e in self.services.values() if e.state is ServiceState.PARKED)
        self._setWake(min([*parked, *(when for when in due if when is not None)]))

    def _placeQueue(self) -> Counter[bytes]:
        """Send, keep, set aside or leave in the store each waiting request; returns held by service."""
        if self._spare:
            self.queue = sorted(self.queue + self._spare, key=lambda r: r.created)
            self._spare = []
        out = Counter(r.service for r in self.inflight.values())
        held = Counter(out)
        self.queue = [request for request in self.queue if self._placeRequest(request, out, held)]
        return held

    def _placeRequest(self, request: StoredRequest, out: Counter[bytes], held: Counter[bytes]) -> bool:
        """Send *request* if it may go out; True if it waits in the queue."""
        if not request.frames:
            # no frames could be read back: the driver answers it with an error
            return not self._send(request)
        if self.listing is not None and request.service not in self.listing:
            return False  # back to the store's keeping until a listing names its service
        entry = self._entryFor(request.service)
        if entry.state is ServiceState.PARKED:
            return False  # back to the store's keeping; read again once unparked
        service = request.service
        if (entry.state is ServiceState.AVAILABLE and out[service] < self._mostOut(entry)
                and self._send(request)):
            out[service] += 1
            held[service] += 1
            return False
        if held[service] < 2 * self._mostOut(entry):
            held[service] += 1
            return True
        if len(self._spare) < self.window:  # kept aside, the next of its to go
            self._spare.append(request)
        else:  # back to the store's keeping, read again once one of its is done
            self._full.add(service)
        return False

    def _entryFor(self, service: bytes) -> _Service:
        """*service*'s entry, asked about if what is known is too old."""
        entry = self._service(service)
        if entry.state is ServiceState.AVAILABLE and entry.until <= self.now:
            entry.state = ServiceState.UNKNOWN
        if entry.state is ServiceState.UNKNOWN and self.listing and self.listing.get(service):
            entry.workers = self.listing[service]  # as many out as it has workers
            entry.state = ServiceState.AVAILABLE
            entry.until = self.now + self.recheck
        elif entry.state is ServiceState.UNKNOWN:  # listed with no worker: restarting, or not
            entry.state = ServiceState.CHECKING
            self._emit(CheckService(entry.name))
        return entry

    def _send(self, request: StoredRequest) -> bool:
        if len(self.inflight) >= self.concurrency:
            return False
        self.inflight[request.id] = request
        self._emit(Dispatch(request))
        return True

    def _room(self) -> int:
        return self.window - len(self.queue) - len(self.inflight)

    def _timeToRead(self) -> bool:
        """One read for many: for half a window at least, unless nothing waiting goes out soon."""
        room = self._room()
        if self._readHeld() or room <= 0:
            return False
        if room >= self.window // 2 or not self.queue:
            return True
        return len(self.inflight) < self.concurrency and not any(
            self.services[r.service].state is ServiceState.CHECKING
            for r in self.queue if r.frames)

    def _readHeld(self) -> bool:
        """Nothing new to read, a read under way, the store failing, or no listing yet."""
        return not self._dirty or self._loading or self._storeRetryAt is not None or self._unlisted

    def _readPending(self, held: Counter[bytes]) -> None:
        full = [e.name for e in self.services.values() if e.state is not ServiceState.PARKED
                and held[e.name] >= 2 * self._mostOut(e)]
        self._full.update(full)
        parked = {e.name for e in self.services.values() if e.state is ServiceState.PARKED}
        skip = parked | set(full) | {r.service for r in self._spare}
        only = self._listedFor(skip)
        if only == []:
            return  # nothing listed may take more: read once a listing changes
        self._dirty = False
        self._loading = True
        self._emit(LoadPending(self._room(), sorted(skip), [r.id for r in self._heldRequests()], only))

    def _listedFor(self, skip: set[bytes]) -> Optional[list[bytes]]:
        """The listed services whose requests to read (None: no listing, read any)."""
        if self.listing is None:
            return None
        return sorted(name for name in self.listing
                      if name not in skip and not name.startswith((b"titanic.", b"mmi.")))

    def _mostOut(self, entry: _Service) -> int:
        """As many out as workers (one if none but known; the window if not counted)."""
        return self.window if entry.workers is None else max(entry.workers, 1)

    def _setWake(self, when: Optional[float]) -> None:
        if when != self._wake:
            self._wake = when
            self._emit(WakeAt(when))


def services_listed(reply: Sequence[bytes]) -> Optional[dict[bytes, int]]:
    """Each service an ``mmi.services`` *reply* lists, with its workers; None if no listing (a ``501``)
    or one that may leave out a service with workers (truncated, yet all listed have some)."""
    try:
        listing = {name.encode("ascii"): int(entry["workers"])
                   for name, entry in json.loads(reply[0]).items()}
    except (ValueError, IndexError, AttributeError, TypeError, KeyError, UnicodeError):
        return None
    return listing if len(reply) == 1 or not all(listing.values()) else None


def _reads_by_service(store: ITitanicStore) -> bool:
    """Whether *store*'s ``pending`` takes ``onlyServices`` (a store written before it did not)."""
    try:
        parameters = inspect.signature(store.pending).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "onlyServices" or p.kind is p.VAR_KEYWORD for p in parameters)


#: Errors after which a request is tried again later.
RETRY = (*TRANSIENT, ClientClosed)


def final_error_body(error: BaseException) -> Optional[list[bytes]]:
    """The error reply to store for a final failure, or ``None`` to retry."""
    if isinstance(error, RETRY):
        return None
    if isinstance(error, (ReplyTooLarge, RequestTooLarge)):
        return error_body(STATUS_TOO_LARGE, str(error))
    if isinstance(error, RemoteError):  # the handler raised, a 413, ...
        return error_body(error.code, error.message)
    return None


def stamped(request: StoredRequest) -> list[bytes]:
    """*request*'s frames with an idempotence stamp made of its id (the same from any Titanic
    that sends it, each time), unless it came stamped or its id is not a UUID."""
    if request.frames[:1] == [STAMP_MARKER]:
        return request.frames
    try:
        clientId = uuid.UUID(request.id).bytes
    except ValueError:
        return request.frames
    return stamp(clientId, 0, request.frames)


class Dispatcher:
    """A :class:`DispatchMachine` driven with *store* and a client of *broker* (one endpoint
    or a failover list); :meth:`stored` and :meth:`closed` are its events.  With *stamp*, each
    request goes out stamped with its id (:func:`stamped`): workers with a reply store run it
    once however many Titanics, restarts or retries send it."""

    def __init__(self, broker: Union[str, Sequence[str]], store: ITitanicStore,
                 reactor: Optional[Any] = None, *, concurrency: int = DEFAULT_CONCURRENCY,
                 timeout: float = DEFAULT_TIMEOUT, backoff: Backoff = DEFAULT_BACKOFF,
                 keep: float = DEFAULT_KEEP, purgeEvery: float = DEFAULT_PURGE_EVERY,
                 recheck: float = DEFAULT_RECHECK, listEvery: Optional[float] = DEFAULT_LIST_EVERY,
                 limits: Limits = Limits(), stamp: bool = False,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None) -> None:
        reactor = default_reactor(reactor)
        self.stamp = stamp
        self._curve = {"curveServerPublic": curveServerPublic, "curveSecret": curveSecret}
        if listEvery is not None and not _reads_by_service(store):
            log.warn("Titanic: the store's pending() takes no onlyServices: reading every request")
            listEvery = None
        lease = getattr(store, "lease", None)  # shared with other Titanics: read theirs too
        self.machine = DispatchMachine(concurrency=concurrency, backoff=backoff, keep=keep,
                                       purgeEvery=purgeEvery, recheck=recheck, listEvery=listEvery,
                                       rereadEvery=None if lease is None else min(REREAD_EVERY, lease / 2),
                                       now=reactor.seconds())
        self.reactor = reactor
        self.store = store
        self.timeout = timeout
        self.limits = limits
        self.endpoints = transport.endpoint_list(broker)
        self.client = self._newClient()
        self._timer: Any = None
        self._performers: dict[type, Callable[[Any], None]] = {
            Dispatch: self._dispatch, StoreReply: self._storeReply, LoadPending: self._load,
            CheckService: lambda action: defer.ensureDeferred(self._check(action.service)),
            ListServices: lambda action: defer.ensureDeferred(self._list()),
            Purge: self._purge, WakeAt: self._wakeAt,
            Parked: lambda a: log.info("Titanic: service {service} parked for {delay:.1f} s: {reason}",
                                       service=a.service.decode("ascii", "replace"), delay=a.delay,
                                       reason=a.reason)}
        self._events: list[tuple[Any, tuple[Any, ...]]] = []
        self._busy = False
        #: bumped by stop: results of what an earlier run asked are ignored
        self._generation = 0
        self._once = LogThrottle(reactor, math.inf)  # warnings given once

    def _newClient(self) -> Client:
        # every request out, and room for the service checks beside them
        return Client(self.endpoints, self.reactor, timeout=self.timeout, retries=1,
                      maxConnections=self.machine.concurrency + 2, limits=self.limits, **self._curve)

    def start(self) -> None:
        if self.machine.running:
            return
        if self._generation:  # stopped before: its client is closed
            self.client = self._newClient()
        self._feed(self.machine.handleStart)

    def stored(self, requestId: str) -> None:
        """A request was committed: look for it (Titanic's ``onStored``)."""
        self._feed(self.machine.handleStored, requestId)

    def closed(self, requestId: str) -> None:
        """A request was closed: do not send it (Titanic's ``onClosed``)."""
        self._feed(self.machine.handleClosed, requestId)

    def stop(self) -> defer.Deferred[None]:
        """Stop sending; requests out stay pending in the store (a new generation ignores them)."""
        self._generation += 1
        self._feed(self.machine.handleStop)
        return self.client.close()

    def _feed(self, handler: Any, *args: Any) -> None:
        """Handle events one at a time, in order, even when a result arrives synchronously."""
        self._events.append((handler, args))
        if self._busy:
            return
        self._busy = True
        try:
            while self._events:
                handler, args = self._events.pop(0)
                for action in handler(*args, self.reactor.seconds()):
                    self._performers[type(action)](action)
        finally:
            self._busy = False

    def _then(self) -> Callable[..., None]:
        """Feeds a handler its event, unless the dispatcher stopped since this was made."""
        generation = self._generation

        def feed(handler: Any, *args: Any) -> None:
            if generation == self._generation:
                self._feed(handler, *args)

        return feed

    def _troubled(self, handler: Any, format: str, *args: Any, **fields: Any) -> Any:
        """An errback that logs the store's failure and feeds *handler* (*args*, its reason)."""
        feed = self._then()
        return lambda failure: (report_failure(log, failure, format, **fields),
                                feed(handler, *args, failure.getErrorMessage()))

    def _wakeAt(self, action: WakeAt) -> None:
        self._timer = call_at(self._timer, self.reactor, action.when,
                              lambda: self._feed(self.machine.handleWake))

    def _load(self, action: LoadPending) -> None:
        feed = self._then()
        only = {} if action.onlyServices is None else {"onlyServices": action.onlyServices}
        defer.maybeDeferred(self.store.pending, action.limit, action.skipServices,
                            action.skipIds, **only).addCallbacks(
            lambda requests: feed(self.machine.handleLoaded, requests, action.limit),
            self._troubled(self.machine.handleLoadFailed, "Titanic could not read pending requests"))

    async def _list(self) -> None:
        """``mmi.services``: the services the broker knows and their workers."""
        feed = self._then()
        try:
            reply = await self.client.request(b"mmi.services", timeout=min(self.timeout, 5.0))
        except RETRY as e:  # the broker away: keep the last listing
            self._once.warn(log, "list", "Titanic: no answer to mmi.services ({reason}); after "
                            "{tries} in a row, each service is asked about instead", reason=e,
                            tries=LIST_TRIES)
            return feed(self.machine.handleListFailed, str(e))
        except Exception:  # refused, over this client's limits, ...: ask each service
            reply = []
        feed(self.machine.handleListed, services_listed(reply))

    async def _check(self, service: bytes) -> None:
        """``mmi.workers`` counts the workers; none counted, or no listing (a broker without it, a listing
        over this client's limits), ``mmi.service`` says whether the broker knows the service."""
        feed, machine = self._then(), self.machine
        timeout = min(self.timeout, 5.0)
        try:
            workers = mmi.workers_listed(await self.client.request(b"mmi.workers", service, timeout=timeout))
        except RETRY as e:  # the broker away: ask again later
            return feed(machine.handleChecked, service, False, f"mmi.workers failed: {e}")
        except Exception:  # refused, over this client's limits, ...: ask the short way
            workers = None
        if workers:
            return feed(machine.handleCounted, service, workers)
        reason = "no worker (mmi.service)"
        try:
            answer = (await self.client.request(b"mmi.service", service, timeout=timeout))[:1]
        except Exception as e:
            answer, reason = [], f"mmi.service failed: {e}"
        if workers == 0 and answer == [mmi.FOUND]:  # known: its worker restarting
            feed(machine.handleLingering, service)
        elif workers == 0:
            feed(machine.handleCounted, service, 0)
        elif answer == [b"501"]:  # a broker without MMI: send, and see
            self._once.warn(log, "501", "Titanic: the broker does not answer mmi.service (501); "
                            "sending requests without asking")
            feed(machine.handleChecked, service, True, "")
        else:
            available = answer == [mmi.FOUND]
            feed(machine.handleChecked, service, available, "" if available else reason)

    def _dispatch(self, action: Dispatch) -> None:
        """Send a stored request.  A stream that outgrows what one ``titanic.reply`` can carry is answered
        413 and abandoned (cancelled a turn later: this runs inside the client's handler)."""
        request, feed = action.request, self._then()
        mostBytes = max(1, self.limits.maxMessageBytes - REPLY_RESERVE_BYTES)
        mostFrames = max(1, self.limits.maxFrames - REPLY_RESERVE_FRAMES)
        parts: list[bytes] = []
        held = 0  # bytes in parts
        over = False  # answered 413 and abandoned
        calls: list[defer.Deferred[Any]] = []

        def replied(body: list[bytes]) -> None:
            feed(self.machine.handleReply, request.id, body)

        def take(body: list[bytes], final: bool = False) -> None:
            nonlocal held, over
            if over:
                return
            if final and not parts:  # not streamed: within the client's limits
                return replied(body)
            held += sum(map(len, body))
            parts.extend(body)
            if held > mostBytes or len(parts) > mostFrames:
                over = True
                replied(error_body(STATUS_TOO_LARGE, f"the streamed reply is too large to keep: more "
                                   f"than {mostBytes} bytes or {mostFrames} frames in all, the most "
                                   "a titanic.reply can carry"))
                if calls:
                    self.reactor.callLater(0, calls[0].cancel)
            elif final:
                replied(parts)

        def restart() -> None:
            nonlocal held
            parts.clear()
            held = 0

        def failed(failure: Failure) -> None:
            if over:
                return
            body = final_error_body(failure.value)
            if body is None:
                feed(self.machine.handleFailed, request.id, failure.getErrorMessage())
            else:
                replied(body)

        try:
            frames = stamped(request) if self.stamp else request.frames
            d = self.client.request(request.service, *frames, onPartial=take, onRestart=restart)
        except (ValueError, TypeError) as e:  # over this client's limits, or cannot be sent
            return replied(final_error_body(e) or error_body(
                STATUS_WORKER_ERROR, f"the stored request cannot be sent: {e}"))
        calls.append(d)
        d.addCallbacks(take, failed, callbackArgs=(True,))

    def _storeReply(self, action: StoreReply) -> None:
        feed = self._then()
        self.store.complete(action.requestId, action.frames, self.reactor.seconds()).addCallbacks(
            lambda _: feed(self.machine.handleReplyStored, action.requestId),
            self._troubled(self.machine.handleStoreFailed, "Titanic could not store the reply to "
                           "{id}", action.requestId, id=action.requestId))

    def _purge(self, action: Purge) -> None:
        def purged(count: int) -> None:
            if count:
                log.info("Titanic purged {count} replies older than {keep:.0f} s",
                         count=count, keep=self.machine.keep)

        self.store.purge(action.before).addCallbacks(
            purged, lambda f: report_failure(log, f, "Titanic could not purge old replies"))
