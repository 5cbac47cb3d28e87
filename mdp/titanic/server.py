"""Titanic's three MDP services over a store (:class:`TitanicServer`), and :class:`Titanic`:
those services, the dispatcher and the store in one.  A request is acknowledged only once
the store committed it; the dispatcher learns of it through *onStored*."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer
from twisted.logger import Logger, LogLevel

from mdp import policy
from mdp.majordomo.worker import Worker
from mdp.policy import DEFAULT_MAX_MESSAGE_BYTES, PIRATE, Backoff, HeartbeatPolicy, Limits, default_reactor
from mdp.titanic import dispatcher, protocol
from mdp.titanic.dispatcher import Dispatcher
from mdp.titanic.store import (
    DEFAULT_LEASE,
    DEFAULT_MAX_STORE_BYTES,
    ITitanicStore,
    ReplyStatus,
    open_store,
    report_failure,
)

log = Logger()

#: MDP workers per Titanic service: concurrent submissions share one commit
DEFAULT_SERVICE_WORKERS = 4
#: Most bytes of request frames one ``titanic.request`` may store (by default, what MDP carries).
DEFAULT_MAX_REQUEST_BYTES = DEFAULT_MAX_MESSAGE_BYTES


class TitanicServer:
    """The Titanic services of one store, registered with *broker* (one endpoint or a
    failover list), each served by *workers* MDP workers; the caller opens and closes the store."""

    def __init__(self, broker: Union[str, Sequence[str]], store: ITitanicStore,
                 reactor: Optional[Any] = None, *, onStored: Optional[Callable[[str], Any]] = None,
                 onClosed: Optional[Callable[[str], Any]] = None,
                 workers: int = DEFAULT_SERVICE_WORKERS, heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
                 backoff: Backoff = PIRATE, limits: Limits = Limits(),
                 maxRequestBytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None) -> None:
        for name, value in (("workers", workers), ("maxRequestBytes", maxRequestBytes)):
            policy.whole_number(name, value)
        #: at most the store's own limit: a larger request would be refused for ever
        self.maxRequestBytes = min(maxRequestBytes, getattr(store, "maxBytes", maxRequestBytes))
        self.reactor = default_reactor(reactor)
        self._throttle = policy.LogThrottle(self.reactor, 10.0)
        self.store = store
        self.onStored = onStored
        self.onClosed = onClosed
        handlers = {protocol.REQUEST: self.request, protocol.REPLY: self.reply, protocol.CLOSE: self.close}
        self.workers: list[Worker] = [
            Worker(broker, name, handler, self.reactor, heartbeat=heartbeat, backoff=backoff,
                   limits=limits, curveServerPublic=curveServerPublic, curveSecret=curveSecret)
            for name, handler in handlers.items() for _ in range(workers)]
        for worker in self.workers:  # several per service: Titanic says once what it serves
            worker.readyLogLevel = LogLevel.debug

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def stop(self) -> defer.Deferred[None]:
        return defer.gatherResults([w.stop() for w in self.workers]).addCallback(lambda _: None)

    # --- the three services --------------------------------------------------------

    def request(self, body: list[bytes]) -> Any:
        """``titanic.request``: store it; ``200`` + its id once committed."""
        try:
            service, frames = protocol.parse_request(body)
        except protocol.MalformedTitanicRequest as e:
            return protocol.failed(str(e))

        def stored(requestId: str) -> list[bytes]:
            self._tell(self.onStored, requestId)
            return [protocol.OK, requestId.encode("ascii")]

        def failed(failure: Any) -> list[bytes]:
            if failure.check(protocol.TitanicRefused):
                return self._refuse(service, failure.value)
            return self._storeFailed(failure, "store")

        size = sum(map(len, frames))
        if size > self.maxRequestBytes:
            return self._refuse(service, protocol.TitanicRequestTooLarge(
                f"a request of {size} bytes is over Titanic's limit of {self.maxRequestBytes} "
                f"bytes a request"))
        return self.store.add(service, frames, self.reactor.seconds()).addCallbacks(stored, failed)

    def reply(self, body: list[bytes]) -> Any:
        """``titanic.reply``: ``200`` + the reply, ``300`` pending, ``400`` unknown."""
        try:
            requestId = protocol.parse_id(body, protocol.REPLY)
        except protocol.MalformedTitanicRequest as e:
            return protocol.failed(str(e))

        def answer(found: tuple[ReplyStatus, list[bytes]]) -> list[bytes]:
            status, frames = found
            if status is ReplyStatus.DONE:
                return [protocol.OK, *frames]
            return [protocol.PENDING if status is ReplyStatus.PENDING else protocol.UNKNOWN]

        return self.store.reply(requestId).addCallbacks(answer, self._storeFailed, errbackArgs=("read",))

    def close(self, body: list[bytes]) -> Any:
        """``titanic.close``: forget the request and its reply; ``200``."""
        try:
            requestId = protocol.parse_id(body, protocol.CLOSE)
        except protocol.MalformedTitanicRequest as e:
            return protocol.failed(str(e))

        def forgotten(_: None) -> list[bytes]:
            self._tell(self.onClosed, requestId)
            return [protocol.OK]

        return self.store.forget(requestId).addCallbacks(forgotten, self._storeFailed,
                                                         errbackArgs=("forget",))

    def _refuse(self, service: bytes, error: protocol.TitanicRefused) -> list[bytes]:
        self._throttle.warn(log, type(error).__name__, "Titanic refused a request for {service}: "
                            "{reason}", service=service.decode("ascii"), reason=error)
        return protocol.refused(error)

    @staticmethod
    def _tell(hook: Optional[Callable[[str], Any]], requestId: str) -> None:
        if hook is not None:
            try:
                hook(requestId)
            except Exception:
                log.failure("Titanic's hook {hook} failed for {id}", hook=hook, id=requestId)

    def _storeFailed(self, failure: Any, what: str) -> list[bytes]:
        report_failure(log, failure, "Titanic's store failed to {what}", what=what)
        return protocol.failed(f"the store failed to {what}: {failure.getErrorMessage()}")


class Titanic:
    """A whole Titanic: the three services, the dispatcher and the store.  *store* is an
    :class:`~mdp.titanic.store.ITitanicStore` or a database path or URL (:func:`open_store`, with
    *maxStoreBytes* and *storeLease*), opened in :meth:`start` and closed in :meth:`stop`."""

    def __init__(self, broker: Union[str, Sequence[str]], store: Union[str, ITitanicStore],
                 reactor: Optional[Any] = None, *, concurrency: int = dispatcher.DEFAULT_CONCURRENCY,
                 timeout: float = dispatcher.DEFAULT_TIMEOUT,
                 backoff: Backoff = dispatcher.DEFAULT_BACKOFF, keep: float = dispatcher.DEFAULT_KEEP,
                 purgeEvery: float = dispatcher.DEFAULT_PURGE_EVERY,
                 listEvery: Optional[float] = dispatcher.DEFAULT_LIST_EVERY,
                 workers: int = DEFAULT_SERVICE_WORKERS, heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
                 limits: Limits = Limits(), maxRequestBytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 maxStoreBytes: int = DEFAULT_MAX_STORE_BYTES, storeLease: float = DEFAULT_LEASE,
                 stamp: bool = False, curveServerPublic: Optional[str] = None,
                 curveSecret: Optional[str] = None) -> None:
        self.reactor = default_reactor(reactor)
        self.store = (open_store(store, self.reactor, maxBytes=maxStoreBytes, lease=storeLease)
                      if isinstance(store, str) else store)
        curve = {"curveServerPublic": curveServerPublic, "curveSecret": curveSecret}
        self.dispatcher = Dispatcher(broker, self.store, self.reactor, concurrency=concurrency,
                                     timeout=timeout, backoff=backoff, keep=keep, purgeEvery=purgeEvery,
                                     listEvery=listEvery, limits=limits, stamp=stamp, **curve)
        if hasattr(self.store, "onLost"):  # a shared store: what another took over is not sent
            self.store.onLost = self.dispatcher.closed
        self.server = TitanicServer(broker, self.store, self.reactor, onStored=self.dispatcher.stored,
                                    onClosed=self.dispatcher.closed, workers=workers, heartbeat=heartbeat,
                                    limits=limits, maxRequestBytes=maxRequestBytes, **curve)
        self._started = False
        self._starting: Optional[defer.Deferred[None]] = None
        self._stopping = False

    def _opened(self, _: None) -> None:
        if self._stopping:  # stopped while opening: stop closes it
            return
        self._started = True
        self.server.start()
        self.dispatcher.start()
        log.info("Titanic started: services {services} ({workers} workers each) via {broker}; "
                 "store {store}, {concurrency} request(s) out at once",
                 services=", ".join(name.decode("ascii") for name in protocol.SERVICES),
                 workers=len(self.server.workers) // len(protocol.SERVICES),
                 broker=" or ".join(self.dispatcher.endpoints),
                 store=getattr(self.store, "path", None) or type(self.store).__name__,
                 concurrency=self.dispatcher.machine.concurrency)

    def start(self) -> defer.Deferred[None]:
        """Open the store (:class:`~mdp.errors.StoreError` if damaged, unreadable or in use),
        then serve and dispatch."""
        if self._started or (self._starting is not None and not self._starting.called):
            raise RuntimeError("Titanic is already started")
        self._stopping = False
        self._starting = self.store.open().addCallback(self._opened)
        return self._starting

    async def _stop(self) -> None:
        self._stopping = True
        starting = self._starting
        if starting is not None and not starting.called:
            await defer.DeferredList([starting])  # undone below; its failure is start's
        if self._started:
            self._started = False
            await self.dispatcher.stop()
            await self.server.stop()
        await self.store.close()

    def stop(self) -> defer.Deferred[None]:
        """Stop dispatching and serving, and close the store; requests out go out again on the next start."""
        return defer.ensureDeferred(self._stop())
