"""Twisted services running a broker, worker, Freelance server, SP peer or Titanic."""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Optional, Sequence, Union

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from mdp import transport
from mdp.binarystar import BinaryStar
from mdp.majordomo.broker import Broker
from mdp.majordomo.worker import Handler, Worker
from mdp.policy import default_reactor

log = Logger()


class _FailableService(Service):
    """A service that can fail to start (a port taken, a store unreadable): the failure is logged;
    with *exitOnFailure* the process exits 1, else ``startService`` returns the failure."""

    #: started by a runner that calls privilegedStartService first (twistd)
    _twistd = False

    def __init__(self, reactor: Any, exitOnFailure: Optional[bool]) -> None:
        self.reactor = reactor
        self.exitOnFailure = exitOnFailure  # None: when twistd runs it

    def privilegedStartService(self) -> None:
        self._twistd = True
        super().privilegedStartService()

    def startService(self) -> defer.Deferred[Any]:  # type: ignore[override]
        super().startService()
        if _exiting(self.reactor):
            return defer.succeed(None)
        return self._start()

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        return self._stop()

    def _endsProcess(self) -> bool:
        """*exitOnFailure*, or if None, run by ``twistd`` (which drops what startService returns)."""
        return self._twistd if self.exitOnFailure is None else self.exitOnFailure

    def _failedToStart(self, failure: Failure, message: str, **fields: Any) -> Optional[Failure]:
        """Log *message* (a format of *fields* and ``error``); return *failure*, or end the process."""
        if isinstance(failure.value, defer.FirstError):
            failure = failure.value.subFailure
        fields["error"] = failure.getErrorMessage()
        if not self._endsProcess():
            log.error(message, **fields)
            return failure
        if not self.reactor.running and not self._twistd:
            log.critical(message, **fields)
            _exit(1)
        log.error(message, **fields)
        _stop_and_exit(self.reactor, 1)
        return None

    def _cannotListen(self, failure: Failure, message: str, **fields: Any) -> Optional[Failure]:
        if not self.running:
            return None  # stopped while binding
        return self._failedToStart(failure, message, **fields)


class BrokerService(_FailableService):
    """Runs a :class:`~mdp.majordomo.broker.Broker` bound to *endpoint* (clients and workers) and/or
    *backend* (workers); other keyword arguments go to the broker.  With a *binaryStar* it serves
    only while active.  A malformed endpoint raises :class:`~mdp.errors.TransportError`."""

    def __init__(self, endpoint: Optional[str] = None, backend: Optional[str] = None,
                 reactor: Optional[Any] = None, *, exitOnFailure: Optional[bool] = None,
                 binaryStar: Optional[BinaryStar] = None, **brokerOptions: Any) -> None:
        if endpoint is None and backend is None:
            raise ValueError("BrokerService needs an endpoint, a backend or both")
        for bound in (endpoint, backend):
            if bound is not None:
                transport.check(bound, transport.LISTEN)
        self.endpoint, self.backend, self.binaryStar = endpoint, backend, binaryStar
        if binaryStar is not None:
            brokerOptions["admission"] = binaryStar
            binaryStar.onFatal(self._fatal)
            binaryStar.onActive(lambda reason: self.broker.admissionChanged())
            binaryStar.onPassive(lambda reason: self.broker.admissionChanged())
        self.broker = Broker(reactor, **brokerOptions)
        super().__init__(self.broker.reactor, exitOnFailure)
        self.transports: list[Any] = []

    def _start(self) -> defer.Deferred[None]:
        if self.binaryStar is None:
            return self._listen()
        return self.binaryStar.start().addCallbacks(lambda _: self._listen(), self._failed)

    def _fatal(self, reason: str) -> None:
        """The Binary Star pair is broken: this broker stops."""
        self.broker.close()
        if self._endsProcess():
            _stop_and_exit(self.reactor, 1)

    def _listen(self) -> defer.Deferred[None]:
        roles = [(self.endpoint, True, self.backend is None), (self.backend, self.endpoint is None, True)]
        listening = [defer.maybeDeferred(self.broker.listen, bound, clients=clients, workers=workers)
                     for bound, clients, workers in roles if bound is not None]
        return defer.gatherResults(listening, consumeErrors=True).addCallbacks(self._listening, self._failed)

    def _listening(self, transports: list[Any]) -> None:
        self.transports = transports

    def _stop(self) -> defer.Deferred[None]:
        self.transports = []
        stopping = [self.broker.close()]  # first: the pair's peer hears of it only then
        if self.binaryStar is not None:
            stopping.append(self.binaryStar.stop())
        return defer.gatherResults(stopping).addCallback(lambda _: None)

    def _failed(self, failure: Failure) -> Optional[Failure]:
        if self.binaryStar is not None:
            # a broker that does not serve must not tell its peer it is there
            self.binaryStar.stop()
        if self._endsProcess():
            self.broker.close()
        return self._failedToStart(failure, "MDP broker cannot listen: {error}")


def _exiting(reactor: Any) -> bool:
    """A service failed to start and the process is exiting: later services do nothing (a worker
    would register with whatever holds the broker's port)."""
    return bool(getattr(reactor, "_mdpExiting", False))


def _stop_and_exit(reactor: Any, status: int) -> None:
    """Stop *reactor* and exit with *status* once it has shut down (twist would exit 0); once only."""
    if _exiting(reactor):
        return
    reactor._mdpExiting = True
    reactor.addSystemEventTrigger("after", "shutdown", atexit.register, _exit, status)
    reactor.callWhenRunning(reactor.stop)


def _exit(status: int) -> None:
    """Exit at once with *status* (from ``atexit``, earlier handlers do not run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class WorkerService(Service):
    """Runs a :class:`~mdp.majordomo.worker.Worker`; keyword arguments go to it."""

    def __init__(self, endpoint: Union[str, Sequence[str]], service: Union[str, bytes],
                 handler: Handler, reactor: Optional[Any] = None, **workerOptions: Any) -> None:
        self.worker = Worker(endpoint, service, handler, reactor=reactor, **workerOptions)

    def startService(self) -> None:
        super().startService()
        if not _exiting(self.worker.reactor):
            self.worker.start()

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        return self.worker.stop()


class MetricsService(_FailableService):
    """Serves a Prometheus *registry* at ``/metrics`` on *endpoint*, a Twisted server endpoint string."""

    def __init__(self, endpoint: str, registry: Any, reactor: Optional[Any] = None, *,
                 exitOnFailure: Optional[bool] = None) -> None:
        super().__init__(default_reactor(reactor), exitOnFailure)
        self.endpoint, self.registry = endpoint, registry
        self.port: Optional[Any] = None

    def _start(self) -> defer.Deferred[None]:
        from mdp.metrics import serve_metrics

        return serve_metrics(self.endpoint, self.registry, self.reactor).addCallbacks(
            self._listening, self._cannotListen,
            errbackArgs=("cannot serve metrics on {endpoint}: {error}",),
            errbackKeywords={"endpoint": self.endpoint})

    def _listening(self, port: Any) -> Optional[defer.Deferred[None]]:
        self.port = port
        return None if self.running else self._stop()  # stopped while it was binding

    def _stop(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        return defer.maybeDeferred(port.stopListening) if port else defer.succeed(None)


class ServerService(_FailableService):
    """Runs a server (``listen(endpoint)``, ``close()``; an SP REP, ...) on *endpoint*; *what*
    names it in the log."""

    def __init__(self, endpoint: str, server: Any, *, exitOnFailure: Optional[bool] = None,
                 what: str = "server") -> None:
        super().__init__(server.reactor, exitOnFailure)
        self.endpoint, self.server, self.what = endpoint, server, what

    def _start(self) -> defer.Deferred[Any]:
        return self.server.listen(self.endpoint).addErrback(
            self._cannotListen, "{what} cannot listen on {endpoint}: {error}", what=self.what,
            endpoint=self.endpoint)

    def _stop(self) -> defer.Deferred[None]:
        return self.server.close()


class SPDeviceService(ServerService):
    """Runs an :class:`~mdp.sp.peers.SPDevice` from *front* (``endpoint``) to *back*, made when the
    service starts (it dials *back* at once); the device is ``server``."""

    def __init__(self, front: str, back: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 exitOnFailure: Optional[bool] = None, **deviceOptions: Any) -> None:
        from mdp.sp.codec import endpoint_of

        transport.check(endpoint_of(front, listen=True), transport.LISTEN)
        _FailableService.__init__(self, default_reactor(reactor), exitOnFailure)
        self.endpoint, self.server, self.what = front, None, "SP device"
        self.back, self.deviceOptions = back, deviceOptions

    def _start(self) -> defer.Deferred[Any]:
        from mdp.sp.peers import SPDevice

        self.server = SPDevice(self.back, self.reactor, **self.deviceOptions)
        return super()._start()

    def _stop(self) -> defer.Deferred[None]:
        device, self.server = self.server, None
        return device.close() if device is not None else defer.succeed(None)


class TitanicService(_FailableService):
    """Runs a :class:`~mdp.titanic.Titanic`: its services, dispatcher and store."""

    def __init__(self, broker: Union[str, Sequence[str]], store: Any, reactor: Optional[Any] = None, *,
                 exitOnFailure: Optional[bool] = None, **titanicOptions: Any) -> None:
        from mdp.titanic import Titanic

        self.titanic = Titanic(broker, store, reactor, **titanicOptions)
        super().__init__(self.titanic.reactor, exitOnFailure)

    def _start(self) -> defer.Deferred[None]:
        return self.titanic.start().addErrback(self._failed)

    def _failed(self, failure: Failure) -> None:
        # logged, not returned: a parent service would drop the failure unseen
        self._failedToStart(failure, "Titanic cannot start: {error}")

    def _stop(self) -> defer.Deferred[None]:
        return self.titanic.stop()
