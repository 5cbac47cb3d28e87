"""Prometheus metrics for brokers, workers and Freelance servers (docs/metrics.md):
a node counts events as they happen; its state is read at scrape time."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Protocol
from twisted.logger import Logger, LogLevel
from twisted.python import log as legacy_log
from twisted.web.http import HTTPChannel, Request
from twisted.web.resource import Resource
from twisted.web.server import Site

from mdp.messages import text as label
from mdp.policy import LogThrottle, default_reactor, positive_seconds, whole_number
from mdp.transport import twisted_private

log = Logger()

#: Histogram buckets (seconds) for queue and service times.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Most distinct service names given their own label values.
MAX_SERVICES = 1000
#: The label value of services beyond ``maxServices``.
OTHER = "_other"


def _samples(family: Any, totals: dict[tuple[str, ...], float]) -> Any:
    """*family* with one sample per label set of *totals*."""
    for labels, total in totals.items():
        family.add_metric(list(labels), total)
    return family


class _Metrics:
    """Counters, and a histogram for each ``*_seconds`` name, in *registry* (default: a fresh
    one): one a row of attribute, name after *prefix*, help and labels; :meth:`collect`, the
    registry's custom-collector hook, reads the node's state at scrape time."""

    _node: Any = None  # what :meth:`watch` was given

    def __init__(self, registry: Optional[CollectorRegistry], prefix: str,
                 rows: list[tuple[str, str, str, list[str]]]) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for attribute, name, doc, labels in rows:
            kind = partial(Histogram, buckets=SECONDS_BUCKETS) if name.endswith("_seconds") else Counter
            setattr(self, attribute, kind(f"{prefix}_{name}", doc, labels, registry=self.registry))
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # not known before a scrape: never checked for duplicates

    def watch(self, node: Any) -> None:
        """Read *node*'s state at each scrape."""
        self._node = node


class BrokerMetrics(_Metrics):
    """What a :class:`~mdp.majordomo.broker.Broker` counts, in *registry* (default: a fresh one)."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, *,
                 maxServices: int = MAX_SERVICES) -> None:
        self.maxServices = maxServices
        self._values: dict[bytes, str] = {}  # service names given a label value of their own
        super().__init__(registry, "mdp_broker", [
            ("requests", "requests", "Client requests received, by service.", ["service"]),
            ("replies", "replies", "Replies (FINAL) passed from workers to clients, by service.",
             ["service"]),
            ("errorReplies", "error_replies", "Error replies to clients (the broker's own and "
             "workers'), by service and status code.", ["service", "code"]),
            ("refused", "requests_refused", "Requests refused at once: queues full (overloaded, "
             "429), or this broker is the passive one of a Binary Star pair (passive).",
             ["service", "reason"]),
            ("givenUp", "requests_given_up", "Requests given up: cancelled by their client "
             "(cancelled), or past their deadline before a worker took them (deadline).",
             ["service", "reason"]),
            ("denied", "access_denied", "Calls (403) and READYs (DISCONNECT) the access policy "
             "refused, by service and what was asked (call, serve).", ["service", "what"]),
            ("queueSeconds", "queue_seconds", "Time a request waited before a worker took it.",
             ["service"]),
            ("workerSeconds", "worker_seconds", "Time from handing a request to a worker until "
             "its FINAL came back.", ["service"]),
            ("expiries", "heartbeat_expiries", "Workers removed after a silence of heartbeat x "
             "liveness.", ["service"]),
            ("droppedReplies", "dropped_replies", "Worker replies not passed on, by reason: stale "
             "(a second FINAL), void (the rest of a reply already answered with an error), "
             "orphaned (a late reply of a worker given up, for a request that went elsewhere).",
             ["reason"]),
            ("rejected", "rejected_messages", "Messages rejected as malformed or out of place, "
             "by reason.", ["reason"]),
        ])

    def _labels(self, name: bytes) -> str:
        """*name*'s label value: :data:`OTHER` beyond ``maxServices`` names, and beyond half
        for names no worker registered for (they cannot crowd out real services)."""
        value = self._values.get(name)
        if value is None:
            count, broker = len(self._values), self._node
            unregistered = broker is not None and not getattr(broker.services.get(name), "registered", False)
            if count >= self.maxServices or (count >= self.maxServices // 2 and unregistered):
                return OTHER
            value = self._values[name] = label(name)
        return value

    def request(self, service: bytes) -> None:
        self.requests.labels(self._labels(service)).inc()

    def assigned(self, service: bytes, waited: float) -> None:
        self.queueSeconds.labels(self._labels(service)).observe(waited)

    def replied(self, service: bytes, served: Optional[float], code: Optional[bytes]) -> None:
        """A FINAL went to the client: a worker's after *served* seconds
        (None for the broker's own answers), an error reply if *code*."""
        name = self._labels(service)
        if code is not None:  # labelled three digits, or "other"
            self.errorReplies.labels(name, code.decode() if len(code) == 3 and code.isdigit()
                                     else "other").inc()
        else:
            self.replies.labels(name).inc()
        if served is not None:
            self.workerSeconds.labels(name).observe(served)

    def refuse(self, service: bytes, reason: str) -> None:
        self.refused.labels(self._labels(service), reason).inc()

    def giveUp(self, service: bytes, reason: str) -> None:
        self.givenUp.labels(self._labels(service), reason).inc()

    def deny(self, service: bytes, what: str) -> None:
        self.denied.labels(self._labels(service), what).inc()

    def expired(self, service: bytes) -> None:
        self.expiries.labels(self._labels(service)).inc()

    def dropped(self, reason: str) -> None:
        self.droppedReplies.labels(reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def collect(self) -> Iterable[Metric]:
        broker = self._node
        if broker is None:
            return
        snapshot = broker.snapshot(workerLimit=0)
        workers: dict[tuple[str, ...], float] = {}
        queued: dict[tuple[str, ...], float] = {}
        for service in snapshot.services:
            name = self._labels(service.name)
            for state, count in (("idle", service.idle), ("busy", service.busy)):
                workers[name, state] = workers.get((name, state), 0) + count
            queued[name,] = queued.get((name,), 0) + service.queued
        yield _samples(GaugeMetricFamily("mdp_broker_workers", "Registered workers, by service and "
                                     "state (idle or busy).", labels=["service", "state"]), workers)
        yield _samples(GaugeMetricFamily("mdp_broker_queued_requests",
                                     "Requests waiting for a worker, by service.",
                                     labels=["service"]), queued)
        yield GaugeMetricFamily("mdp_broker_queued_bytes",
                                "Bytes of request bodies waiting, in all.", value=snapshot.queuedBytes)
        yield GaugeMetricFamily("mdp_broker_services", "Services the broker knows.",
                                value=snapshot.serviceCount)
        yield _samples(GaugeMetricFamily("mdp_broker_peers", "Peers the broker deals with: "
                                         "registered workers, and clients with a request in the "
                                         "broker.", labels=["role"]),
                       {("worker",): snapshot.workerCount, ("client",): broker.clientCount()})
        yield from transport_metrics("mdp_broker",
                                     [b.transport for b in getattr(broker, "bindings", ())])


#: the counters bound transports keep themselves: attribute, metric name and help
_TRANSPORT_COUNTERS = {
    "dropped": ("undelivered_messages", "Messages a transport could not deliver: the peer was "
                "gone, or cut off for not reading."),
    "overflows": ("slow_peers_cut", "Peers cut off for reading slower than they were sent to."),
    "oversizedCount": ("oversized_messages", "Messages dropped on arrival for exceeding the "
                       "message limits."),
    "handshakesRefused": ("handshakes_refused", "CURVE handshakes refused: a peer key not in "
                          "the allow-list."),
    "evicted": ("connections_evicted", "Connections closed to admit a newcomer at a full "
                "stream listener: those that had done least."),
    "refused": ("connections_refused", "Newcomers refused at a full stream listener (or "
                "sessions at maxSessions)."),
}


def transport_metrics(prefix: str, transports: Iterable[Any]) -> Iterable[Metric]:
    """The counters bound transports keep themselves (:data:`_TRANSPORT_COUNTERS`)."""
    counted: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in _TRANSPORT_COUNTERS}
    for bound in transports:
        if bound is None:
            continue
        endpoint = str(getattr(bound, "endpoint", None) or "factory")
        for attribute, totals in counted.items():
            count = getattr(bound, attribute, None)
            if count is not None:
                totals[endpoint,] = totals.get((endpoint,), 0) + count
    for attribute, (name, doc) in _TRANSPORT_COUNTERS.items():
        yield _samples(CounterMetricFamily(f"{prefix}_{name}", doc, labels=["endpoint"]),
                       counted[attribute])


class WorkerMetrics(_Metrics):
    """What a :class:`~mdp.majordomo.worker.Worker` counts; workers may share one."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self._workers: weakref.WeakSet[Any] = weakref.WeakSet()
        super().__init__(registry, "mdp_worker", [
            ("requests", "requests", "Requests handed to the handler.", ["service"]),
            ("failures", "failures", "Requests answered with an error: the handler raised "
             "(error), its reply was over the message limits (too-large), its caller cancelled "
             "it (cancelled) or its deadline passed (deadline).",
             ["service", "reason"]),
            ("handlerSeconds", "handler_seconds", "Time from a request to its FINAL.", ["service"]),
            ("reconnects", "reconnects", "Times the worker gave up a broker connection (silence "
             "or DISCONNECT) and opened a new one.", ["service"]),
            ("blocked", "reactor_blocked", "Times the reactor was blocked (by a handler) longer "
             "than a heartbeat interval.", ["service"]),
        ])

    def watch(self, worker: Any) -> None:
        self._workers.add(worker)

    def request(self, service: bytes) -> None:
        self.requests.labels(label(service)).inc()

    def replied(self, service: bytes, seconds: float, failure: Optional[str]) -> None:
        name = label(service)
        self.handlerSeconds.labels(name).observe(seconds)
        if failure is not None:
            self.failures.labels(name, failure).inc()

    def reconnected(self, service: bytes) -> None:
        self.reconnects.labels(label(service)).inc()

    def blockedReactor(self, service: bytes) -> None:
        self.blocked.labels(label(service)).inc()

    def collect(self) -> Iterable[Metric]:
        connected: dict[tuple[str, ...], float] = {}
        busy: dict[tuple[str, ...], float] = {}
        for worker in list(self._workers):
            if not worker.started:
                continue
            name = label(worker.service)
            key = (name, worker.endpoint)
            connected[key] = connected.get(key, 0) + (1 if worker.registered else 0)
            busy[name,] = busy.get((name,), 0) + (1 if worker.current is not None else 0)
        yield _samples(GaugeMetricFamily("mdp_worker_connected", "Workers registered with a broker "
                                     "(it answered since READY).", labels=["service", "broker"]),
                   connected)
        yield _samples(GaugeMetricFamily("mdp_worker_busy", "Workers serving a request.",
                                     labels=["service"]), busy)


class FreelanceMetrics(_Metrics):
    """What a :class:`~mdp.freelance.FreelanceServer` counts."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        super().__init__(registry, "mdp_freelance", [
            ("requests", "requests", "Requests received.", []),
            ("pings", "pings", "PINGs answered with PONG.", []),
            ("refused", "requests_refused", "Requests refused (429): too many in hand.", []),
            ("failures", "failures", "Requests answered with an error: the handler raised "
             "(error), or its reply was over the limits (too-large).", ["reason"]),
            ("rejected", "rejected_messages", "Messages rejected as malformed.", []),
            ("handlerSeconds", "handler_seconds", "Time from a request to its reply.", []),
        ])

    def collect(self) -> Iterable[Metric]:
        server = self._node
        if server is None:
            return
        yield GaugeMetricFamily("mdp_freelance_pending", "Requests being handled.",
                                value=server.pending)
        yield from transport_metrics("mdp_freelance", server.transports)


class MetricsResource(Resource):
    """``/metrics``: *registry* in Prometheus' text format, collected in the reactor
    thread where the nodes' state lives (not prometheus_client's thread pool)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)


#: Connections the metrics endpoint keeps open at once (see ``_MetricsSite.buildProtocol``).
MAX_CONNECTIONS = 64
#: Seconds a connection has for a whole request, and for a response to be taken.
REQUEST_TIMEOUT = 10.0
#: The largest request body (bytes) the metrics endpoint reads.
MAX_BODY_BYTES = 64 * 1024

_TOO_LARGE = (b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n"
              b"Connection: close\r\n\r\n")


def _peer(address: Any) -> str:
    """*address* as ``host:port`` (or as Twisted prints it, a local socket's)."""
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    return f"{host}:{port}" if host is not None and port is not None else str(address)


class _RefusedConnection(Protocol):
    """A connection over ``maxConnections``, aborted (a TLS wrapper keeps a ``None`` protocol's open)."""

    def connectionMade(self) -> None:
        self.transport.abortConnection()


class _MetricsChannel(HTTPChannel):
    """twisted.web's HTTP/1.1 channel within the bounds of :func:`metrics_site`.  While
    the transport holds more output than its buffer size, ``paused`` (LineReceiver's):
    no request waiting is handled, and nothing more is read, until it is sent."""

    site: _MetricsSite
    #: the request's body was refused (413): what still comes is dropped
    _refused = False
    #: closed when idle at the deadline; aborted if it does not end in time
    _closing = False
    #: requests answered: a connection that has none gives way to a newcomer
    served = 0

    def connectionMade(self) -> None:
        self.site.channels[self] = None
        super().connectionMade()

    def connectionLost(self, reason: Any) -> None:
        self.site.channels.pop(self, None)
        super().connectionLost(reason)

    def resetTimeout(self) -> None:
        """Input does not put the deadline off (trickled bytes would hold it for ever)."""

    def rawDataReceived(self, data: bytes) -> None:
        if not self._refused:  # (the headers are read in line mode: a refused body comes here)
            super().rawDataReceived(data)

    def allHeadersReceived(self) -> None:
        if self.length is None or self.length > self.site.maxBodyBytes:  # None: chunked
            self._refused = True
            self.clearLineBuffer()
            self.site.throttle.info(
                log, "too-large", "metrics endpoint answered 413 to {peer}: a request body of "
                "{length} bytes (maxBodyBytes {limit})", peer=_peer(self.transport.getPeer()),
                length="unknown (chunked)" if self.length is None else self.length,
                limit=self.site.maxBodyBytes)
            self.transport.write(_TOO_LARGE)
            self.loseConnection()
            return
        super().allHeadersReceived()

    def requestDone(self, request: Request) -> None:
        self.served += 1
        super().requestDone(request)
        if self.paused:  # no more read either
            twisted_private.pause_channel_reads(self)
        if not self.persistent:  # closing once the last response is sent: in time
            self.setTimeout(self.site.timeOut)

    def pauseProducing(self) -> None:
        self.paused = True
        super().pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        super().resumeProducing()
        self.dataReceived(b"")  # the requests that wait

    def timeoutConnection(self) -> None:
        if not (self.paused or self.requests or twisted_private.line_buffered(self) or self._closing):
            self._closing = True  # idle between requests (a scraper keeping it open): close
            self.loseConnection()
            self.setTimeout(self.site.timeOut)
            return
        why = ("its responses were not taken" if self.paused
               else "no whole request came" if self.requests or twisted_private.line_buffered(self)
               else "it did not close")
        self.site.throttle.info(log, "timeout", "metrics endpoint closed the connection from "
                                "{peer}: {why} within {timeout:g}s (requestTimeout)",
                                peer=_peer(self.transport.getPeer()), why=why, timeout=self.site.timeOut)
        self.transport.abortConnection()


class _MetricsSite(Site):
    """A Site that logs no line per request and bounds its connections."""

    noisy = False
    protocol = _MetricsChannel  # type: ignore[assignment]  # HTTP/1.1 only
    #: connections refused at maxConnections, and closed there to admit a newcomer
    refused = evicted = 0

    def __init__(self, resource: Resource, reactor: Any, *, maxConnections: int,
                 requestTimeout: float, maxBodyBytes: int) -> None:
        super().__init__(resource, timeout=requestTimeout, reactor=reactor)
        self.maxConnections = maxConnections
        self.maxBodyBytes = maxBodyBytes
        self.throttle = LogThrottle(reactor)
        #: open connections, oldest first
        self.channels: dict[_MetricsChannel, None] = {}

    def buildProtocol(self, addr: Any) -> Any:
        """At maxConnections, the oldest connection that has had no answer (a slow or silent client) is
        closed to admit the newcomer; if every one has had an answer, the newcomer is refused."""
        if len(self.channels) >= self.maxConnections:
            idle = next((channel for channel in self.channels if not channel.served), None)
            if idle is None:
                self.refused += 1
                self.throttle.warn(log, "refused", "metrics endpoint refused a connection from "
                                   "{peer}: {limit} open (maxConnections)", peer=_peer(addr),
                                   limit=self.maxConnections)
                return _RefusedConnection()
            del self.channels[idle]
            self.evicted += 1
            self.throttle.info(log, "evicted", "metrics endpoint closed the connection from {peer}, "
                               "which had no answer yet, to admit {newcomer}: {limit} open "
                               "(maxConnections)", peer=_peer(idle.transport.getPeer()),
                               newcomer=_peer(addr), limit=self.maxConnections)
            idle.transport.abortConnection()
        return super().buildProtocol(addr)

    def log(self, request: Any) -> None:
        pass

    def logPrefix(self) -> str:
        return "Metrics"


def metrics_site(registry: CollectorRegistry, reactor: Optional[Any] = None, *,
                 maxConnections: int = MAX_CONNECTIONS, requestTimeout: float = REQUEST_TIMEOUT,
                 maxBodyBytes: int = MAX_BODY_BYTES) -> Site:
    """A quiet Site serving *registry* at ``/metrics``, within bounds a client cannot push it past:
    *maxConnections* open, a whole request within *requestTimeout* seconds, no body over *maxBodyBytes*
    (413), no reading while responses are unsent beyond the transport's buffer."""
    root = Resource()
    root.putChild(b"metrics", MetricsResource(registry))
    return _MetricsSite(root, default_reactor(reactor),
                        maxConnections=whole_number("maxConnections", maxConnections),
                        requestTimeout=positive_seconds("requestTimeout", requestTimeout),
                        maxBodyBytes=whole_number("maxBodyBytes", maxBodyBytes, 0))


def serve_metrics(endpoint: str, registry: CollectorRegistry, reactor: Optional[Any] = None,
                  **bounds: Any) -> defer.Deferred[IListeningPort]:
    """Serve :func:`metrics_site` (with its keyword *bounds*) on the Twisted server
    *endpoint* (``tcp:9464:interface=127.0.0.1``); fires with the listening port."""
    from twisted.internet.endpoints import serverFromString

    from mdp.transport import warn_if_open

    reactor = default_reactor(reactor)
    site = metrics_site(registry, reactor, **bounds)
    # the port's own "starting on" line is debug: the line below says where
    listening = legacy_log.callWithContext({"log_level": LogLevel.debug},
                                           serverFromString(reactor, endpoint).listen, site)

    def listened(port: IListeningPort) -> IListeningPort:
        log.info("metrics at http://{where}/metrics", where=_peer(port.getHost()))
        warn_if_open(endpoint, None, "the metrics endpoint",
                     "anyone who can reach it may read the counters (service names, peers, "
                     "load). Keep it on loopback (tcp:9464:interface=127.0.0.1) or a private "
                     "network, or behind a proxy that authenticates")
        return port

    return listening.addCallback(listened)
