"""Twisted services, to add a broker, a worker, a Freelance server or Titanic
to an existing Application."""

from __future__ import annotations

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
from mdp.policy import PIRATE, Backoff, HeartbeatPolicy, Limits

log = Logger()


class BrokerService(Service):
    """Runs a :class:`~mdp.majordomo.broker.Broker` bound to *endpoint* (clients and
    workers) or to a separate *frontend* (clients) and *backend* (workers).

    Other keyword arguments (``heartbeat``, ``requestExpiry``, ``serviceLinger``,
    the queue, worker and delivery bounds, ``limits``) go to the
    :class:`~mdp.majordomo.broker.Broker`.

    Given a *binaryStar* (:class:`~mdp.binarystar.BinaryStar`), the broker is
    one of a primary/backup pair: the service starts its state exchange
    before it binds, the broker serves only while it is active, and a fatal
    error of the pair closes the broker (and, with *exitOnFailure*, exits 1).

    A malformed endpoint raises :class:`~mdp.errors.TransportError` here, at
    once.  With *exitOnFailure* (as ``twist mdp-broker`` uses it), failing to bind
    logs the reason, stops the reactor and exits with status 1 instead of
    idling unbound."""

    def __init__(
        self,
        endpoint: Optional[str] = None,
        backend: Optional[str] = None,
        reactor: Optional[Any] = None,
        *,
        exitOnFailure: bool = False,
        binaryStar: Optional[BinaryStar] = None,
        **brokerOptions: Any,
    ) -> None:
        if endpoint is None and backend is None:
            raise ValueError("BrokerService needs an endpoint, a backend or both")
        for bound in (endpoint, backend):
            if bound is not None:
                transport.check(bound, transport.LISTEN)
        self.endpoint = endpoint
        self.backend = backend
        self.binaryStar = binaryStar
        if binaryStar is not None:
            brokerOptions["admission"] = binaryStar
            binaryStar.onFatal(self._fatal)
            binaryStar.onActive(self._admissionChanged)
            binaryStar.onPassive(self._admissionChanged)
        self.broker = Broker(reactor, **brokerOptions)
        self.exitOnFailure = exitOnFailure
        self.transports: list[Any] = []

    def startService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().startService()
        if self.binaryStar is None:
            return self._listen()
        return self.binaryStar.start().addCallbacks(lambda _: self._listen(), self._failed)

    def _admissionChanged(self, reason: str) -> None:
        self.broker.admissionChanged()

    def _fatal(self, reason: str) -> None:
        """The Binary Star pair is broken: this broker stops."""
        self.broker.close()
        if self.exitOnFailure:
            _stop_and_exit(self.broker.reactor, 1)

    def _listen(self) -> defer.Deferred[None]:
        listening = []
        # (maybeDeferred: an endpoint refused at once fails like one that cannot bind)
        if self.endpoint is not None:
            listening.append(defer.maybeDeferred(self.broker.listen, self.endpoint, clients=True,
                                                 workers=self.backend is None))
        if self.backend is not None:
            listening.append(defer.maybeDeferred(self.broker.listen, self.backend,
                                                 clients=self.endpoint is None, workers=True))
        return defer.gatherResults(listening, consumeErrors=True).addCallbacks(
            self._listening, self._failed
        )

    def _listening(self, transports: list[Any]) -> None:
        self.transports = transports

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        """Unbind every endpoint and stop the broker's heartbeat tick."""
        super().stopService()
        self.transports = []
        closing = [self.broker.close()]
        if self.binaryStar is not None:
            closing.append(self.binaryStar.stop())
        return defer.gatherResults(closing).addCallback(lambda _: None)

    def _failed(self, failure: Failure) -> Optional[Failure]:
        if isinstance(failure.value, defer.FirstError):
            failure = failure.value.subFailure
        # error, not critical: twist would print a critical line logged before
        # its logging starts twice (on stderr, then in the log)
        log.error("MDP broker cannot listen: {error}", error=failure.getErrorMessage())
        if self.binaryStar is not None:
            # a broker that does not serve must not tell its peer it is there
            self.binaryStar.stop()
        if not self.exitOnFailure:
            return failure
        self.broker.close()
        _stop_and_exit(self.broker.reactor, 1)
        return None


def _stop_and_exit(reactor: Any, status: int) -> None:
    """Stop *reactor*, then exit with *status* (twist itself always exits
    0); once, however many services fail."""
    if getattr(reactor, "_mdpExiting", False):
        return
    reactor._mdpExiting = True
    reactor.addSystemEventTrigger("after", "shutdown", _exit, status)
    reactor.callWhenRunning(reactor.stop)


def _exit(status: int) -> None:
    """Exit at once with *status*."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class WorkerService(Service):
    """Runs a :class:`~mdp.majordomo.worker.Worker` for one service."""

    def __init__(
        self,
        endpoint: Union[str, Sequence[str]],
        service: Union[str, bytes],
        handler: Handler,
        reactor: Optional[Any] = None,
        *,
        heartbeat: HeartbeatPolicy = HeartbeatPolicy(),
        backoff: Backoff = PIRATE,
        dialect: str = "rfc",
        replies: Optional[Any] = None,
        limits: Limits = Limits(),
        metrics: Optional[Any] = None,
        curveServerPublic: Optional[str] = None,
        curveSecret: Optional[str] = None,
    ) -> None:
        self.worker = Worker(endpoint, service, handler, reactor=reactor, heartbeat=heartbeat,
                             backoff=backoff, dialect=dialect, replies=replies, limits=limits,
                             metrics=metrics, curveServerPublic=curveServerPublic,
                             curveSecret=curveSecret)

    def startService(self) -> None:
        super().startService()
        self.worker.start()

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        return self.worker.stop()


class MetricsService(Service):
    """Serves a Prometheus *registry* at ``/metrics`` on *endpoint* (a
    Twisted server endpoint string: ``tcp:9464:interface=127.0.0.1``) while
    running.  With *exitOnFailure*, failing to listen logs the reason and
    exits 1 (as ``twist`` plugins use it)."""

    def __init__(self, endpoint: str, registry: Any, reactor: Optional[Any] = None, *,
                 exitOnFailure: bool = False) -> None:
        from mdp.policy import default_reactor

        self.endpoint = endpoint
        self.registry = registry
        self.reactor = default_reactor(reactor)
        self.exitOnFailure = exitOnFailure
        self.port: Optional[Any] = None

    def startService(self) -> defer.Deferred[None]:  # type: ignore[override]
        from mdp.metrics import serve_metrics

        super().startService()
        return serve_metrics(self.endpoint, self.registry, self.reactor).addCallbacks(
            self._listening, self._failed)

    def _listening(self, port: Any) -> Optional[defer.Deferred[None]]:
        if not self.running:  # stopped while it was binding
            return defer.maybeDeferred(port.stopListening)
        self.port = port
        return None

    def _failed(self, failure: Failure) -> Optional[Failure]:
        if not self.running:
            return None
        log.error("cannot serve metrics on {endpoint}: {error}", endpoint=self.endpoint,
                  error=failure.getErrorMessage())
        if not self.exitOnFailure:
            return failure
        _stop_and_exit(self.reactor, 1)
        return None

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        port, self.port = self.port, None
        if port is None:
            return defer.succeed(None)
        return defer.maybeDeferred(port.stopListening)


def _cannotListen(service: Service, what: str, endpoint: str, reactor: Any,
                  exitOnFailure: bool, failure: Failure) -> Optional[Failure]:
    """*service*'s server could not bind *endpoint*: log why; with
    *exitOnFailure* (the ``twist`` plugins), stop and exit 1 rather than run
    serving nothing."""
    if isinstance(failure.value, defer.FirstError):
        failure = failure.value.subFailure
    if not service.running:
        return None  # stopped while binding
    log.error("{what} cannot listen on {endpoint}: {error}", what=what, endpoint=endpoint,
              error=failure.getErrorMessage())
    if not exitOnFailure:
        return failure
    _stop_and_exit(reactor, 1)
    return None


class _ServerService(Service):
    """A server object (``listen(endpoint)``, ``close()``) on one endpoint.
    With *exitOnFailure*, a failed bind logs why and exits 1."""

    endpoint: str
    server: Any
    what = "server"
    exitOnFailure = False

    def startService(self) -> defer.Deferred[Any]:  # type: ignore[override]
        super().startService()
        return self.server.listen(self.endpoint).addErrback(
            lambda f: _cannotListen(self, self.what, self.endpoint, self.server.reactor,
                                    self.exitOnFailure, f))

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        return self.server.close()


class FreelanceServerService(_ServerService):
    """Runs a :class:`~mdp.freelance.FreelanceServer` bound to *endpoint*."""

    what = "Freelance server"

    def __init__(self, endpoint: str, handler: Handler, reactor: Optional[Any] = None, *,
                 exitOnFailure: bool = False, **serverOptions: Any) -> None:
        from mdp.freelance import FreelanceServer

        transport.check(endpoint, transport.LISTEN)
        self.endpoint = endpoint
        self.exitOnFailure = exitOnFailure
        self.server = FreelanceServer(handler, reactor, **serverOptions)


class SPServerService(_ServerService):
    """Runs an :class:`~mdp.sp.peers.SPServer` (SP REP) on *endpoint*."""

    what = "SP REP server"

    def __init__(self, endpoint: str, handler: Any, reactor: Optional[Any] = None, *,
                 exitOnFailure: bool = False, **serverOptions: Any) -> None:
        from mdp.sp.codec import endpoint_of
        from mdp.sp.peers import SPServer

        transport.check(endpoint_of(endpoint, listen=True), transport.LISTEN)
        self.endpoint = endpoint
        self.exitOnFailure = exitOnFailure
        self.server = SPServer(handler, reactor, **serverOptions)


class SPDeviceService(Service):
    """Runs an :class:`~mdp.sp.peers.SPDevice` from *front* to *back*."""

    def __init__(self, front: str, back: Union[str, Sequence[str]],
                 reactor: Optional[Any] = None, *, exitOnFailure: bool = False,
                 **deviceOptions: Any) -> None:
        from mdp.sp.codec import endpoint_of
        from mdp.sp.peers import SPDevice

        transport.check(endpoint_of(front, listen=True), transport.LISTEN)
        self.front = front
        self.exitOnFailure = exitOnFailure
        self.back = back
        self.reactor = reactor
        self.deviceOptions = deviceOptions
        self.device: Optional[SPDevice] = None
        self._make = SPDevice

    def startService(self) -> defer.Deferred[Any]:  # type: ignore[override]
        super().startService()
        device = self.device = self._make(self.back, self.reactor, **self.deviceOptions)
        return device.listen(self.front).addErrback(
            lambda f: _cannotListen(self, "SP device", self.front, device.reactor,
                                    self.exitOnFailure, f))

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        device, self.device = self.device, None
        return device.close() if device is not None else defer.succeed(None)


class TitanicService(Service):
    """Runs a :class:`~mdp.titanic.Titanic`: its services, dispatcher and
    store.  A store that cannot be opened (a damaged or unreadable file) is
    logged; with *exitOnFailure* (as ``twist mdp-titanic`` uses it) the
    process then exits with status 1 instead of idling without its data."""

    def __init__(self, broker: Union[str, Sequence[str]], store: Any,
                 reactor: Optional[Any] = None, *, exitOnFailure: bool = False,
                 **titanicOptions: Any) -> None:
        from mdp.titanic import Titanic

        self.titanic = Titanic(broker, store, reactor, **titanicOptions)
        self.exitOnFailure = exitOnFailure

    def startService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().startService()
        return self.titanic.start().addErrback(self._failed)

    def _failed(self, failure: Failure) -> None:
        # error, not critical: as the broker's (twist prints a critical line
        # logged before its logging starts twice)
        log.error("Titanic cannot start: {error}", error=failure.getErrorMessage())
        if not self.exitOnFailure:
            return  # logged: a parent service would drop the failure unseen
        _stop_and_exit(self.titanic.reactor, 1)

    def stopService(self) -> defer.Deferred[None]:  # type: ignore[override]
        super().stopService()
        return self.titanic.stop()
