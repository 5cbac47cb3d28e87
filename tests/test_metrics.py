"""Prometheus metrics: counters and gauges move as the nodes work (a Clock on
the loopback transport), and ``/metrics`` is scraped over real sockets from a
broker, a worker and a Freelance server, in process and as ``twist``
processes."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer
from twisted.internet.protocol import Protocol

from mdp import Broker, Client, HeartbeatPolicy, Worker
from mdp.errors import ServiceOverloaded, ServiceUnavailable, WorkerError
from mdp.majordomo import codec
from mdp.metrics import BrokerMetrics, FreelanceMetrics, WorkerMetrics, serve_metrics
from tests.conftest import RawPeer
from tests.procs import ENV, Process, bounded, reactor, script, wait_until
from tests.test_fuzz import FuzzPeer

pytestmark = pytest.mark.timeout(60)

HB = HeartbeatPolicy(interval=1.0, liveness=3)


def value(metrics: Any, name: str, **labels: str) -> Optional[float]:
    return metrics.registry.get_sample_value(name, labels)


def upper(frames: list[bytes]) -> list[bytes]:
    return [f.upper() for f in frames]


def failing(frames: list[bytes]) -> list[bytes]:
    raise RuntimeError("no")


@pytest_twisted.ensureDeferred
async def test_broker_counters_and_gauges_move_with_its_work(clocknet: Any) -> None:
    metrics = BrokerMetrics()
    broker = Broker(clocknet.reactor, heartbeat=HB, maxServiceQueue=1, metrics=metrics)
    bound = await clocknet.wait(broker.listen(clocknet.bindEndpoint()))
    clocknet.addCleanup(broker.close)
    worker = Worker(bound.endpoint, "echo", upper, clocknet.reactor, heartbeat=HB)
    worker.start()
    clocknet.addCleanup(worker.stop)
    client = Client(bound.endpoint, clocknet.reactor, timeout=10.0, retries=1)
    clocknet.addCleanup(client.close)
    await clocknet.until(lambda: value(metrics, "mdp_broker_workers", service="echo",
                                       state="idle") == 1)
    for n in range(3):
        assert await clocknet.wait(client.request("echo", f"r{n}")) == [f"R{n}".encode()]
    assert value(metrics, "mdp_broker_requests_total", service="echo") == 3
    assert value(metrics, "mdp_broker_replies_total", service="echo") == 3
    assert value(metrics, "mdp_broker_queue_seconds_count", service="echo") == 3
    assert value(metrics, "mdp_broker_worker_seconds_count", service="echo") == 3
    assert value(metrics, "mdp_broker_peers", role="worker") == 1

    # nobody serves "slow": one request waits, the next is refused (429)
    waiting = client.request("slow", b"1")
    await clocknet.until(lambda: value(metrics, "mdp_broker_queued_requests", service="slow") == 1)
    assert value(metrics, "mdp_broker_peers", role="client") == 1
    with pytest.raises(ServiceOverloaded):
        await clocknet.wait(client.request("slow", b"2"))
    assert value(metrics, "mdp_broker_requests_refused_total", service="slow",
                  reason="overloaded") == 1
    assert value(metrics, "mdp_broker_error_replies_total", service="slow", code="429") == 1
    # ... and the waiting one hears 503 when no worker registered in time
    with pytest.raises(ServiceUnavailable):
        await clocknet.wait(waiting)
    assert value(metrics, "mdp_broker_error_replies_total", service="slow", code="503") == 1
    assert value(metrics, "mdp_broker_queued_requests", service="slow") is None  # forgotten

    # a malformed message is rejected, by reason
    raw = RawPeer(clocknet, bound.endpoint)
    raw.send(b"MDPC02", b"\x09", b"what")
    await clocknet.until(lambda: value(metrics, "mdp_broker_rejected_messages_total",
                                       reason="malformed") == 1)

    # a worker's error reply is counted by its code
    broken = Worker(bound.endpoint, "broken", failing, clocknet.reactor, heartbeat=HB)
    broken.start()
    clocknet.addCleanup(broken.stop)
    with pytest.raises(WorkerError):
        await clocknet.wait(client.request("broken", b"x"))
    assert value(metrics, "mdp_broker_error_replies_total", service="broken", code="500") == 1

    # a worker that falls silent is removed by its heartbeat expiry
    await clocknet.wait(worker.stop())
    silent = RawPeer(clocknet, bound.endpoint)
    silent.send(b"", codec.WORKER_HEADER, codec.W_READY, b"quiet")
    await clocknet.until(lambda: value(metrics, "mdp_broker_workers", service="quiet",
                                       state="idle") == 1)
    clocknet.advance(HB.interval * (HB.liveness + 1.5))
    assert value(metrics, "mdp_broker_heartbeat_expiries_total", service="quiet") == 1
    assert value(metrics, "mdp_broker_workers", service="quiet", state="idle") in (None, 0)


@pytest_twisted.ensureDeferred
async def test_dropped_replies_are_counted_by_reason(clocknet: Any) -> None:
    """A second FINAL for one assignment is dropped as stale."""
    metrics = BrokerMetrics()
    broker = Broker(clocknet.reactor, heartbeat=HB, metrics=metrics)
    bound = await clocknet.wait(broker.listen(clocknet.bindEndpoint()))
    clocknet.addCleanup(broker.close)
    worker = RawPeer(clocknet, bound.endpoint)
    worker.send(b"", codec.WORKER_HEADER, codec.W_READY, b"echo")
    client = Client(bound.endpoint, clocknet.reactor, timeout=10.0, retries=1)
    clocknet.addCleanup(client.close)
    reply = client.request("echo", b"hi")
    request = await worker.nextMessage()
    envelope = request[3]
    worker.send(b"", codec.WORKER_HEADER, codec.W_FINAL, envelope, b"", b"HI")
    worker.send(b"", codec.WORKER_HEADER, codec.W_FINAL, envelope, b"", b"again")
    assert await clocknet.wait(reply) == [b"HI"]
    await clocknet.until(lambda: value(metrics, "mdp_broker_dropped_replies_total",
                                       reason="stale") == 1)


def test_service_labels_are_bounded() -> None:
    """Clients name services: beyond maxServices, they share one label."""
    metrics = BrokerMetrics(maxServices=2)
    for name in (b"a", b"b", b"c", b"d", b"a"):
        metrics.request(name)
    assert value(metrics, "mdp_broker_requests_total", service="a") == 2
    assert value(metrics, "mdp_broker_requests_total", service="b") == 1
    assert value(metrics, "mdp_broker_requests_total", service="_other") == 2
    metrics.request(b"caf\xc3\xa9\xff")
    assert value(metrics, "mdp_broker_requests_total", service="_other") == 3


@pytest_twisted.ensureDeferred
async def test_worker_counts_requests_failures_and_handler_time(clocknet: Any) -> None:
    broker = Broker(clocknet.reactor, heartbeat=HB)
    bound = await clocknet.wait(broker.listen(clocknet.bindEndpoint()))
    clocknet.addCleanup(broker.close)
    metrics = WorkerMetrics()

    def handler(frames: list[bytes]) -> Any:
        if frames == [b"fail"]:
            raise ValueError("asked to")
        from twisted.internet import task

        return task.deferLater(clocknet.reactor, 0.5, lambda: frames)

    worker = Worker(bound.endpoint, "work", handler, clocknet.reactor, heartbeat=HB, metrics=metrics)
    worker.start()
    clocknet.addCleanup(worker.stop)
    client = Client(bound.endpoint, clocknet.reactor, timeout=10.0, retries=1)
    clocknet.addCleanup(client.close)
    await clocknet.until(lambda: value(metrics, "mdp_worker_connected", service="work",
                                       broker=bound.endpoint) == 1)
    assert await clocknet.wait(client.request("work", b"a")) == [b"a"]
    with pytest.raises(WorkerError):
        await clocknet.wait(client.request("work", b"fail"))
    assert value(metrics, "mdp_worker_requests_total", service="work") == 2
    assert value(metrics, "mdp_worker_failures_total", service="work", reason="error") == 1
    assert value(metrics, "mdp_worker_handler_seconds_count", service="work") == 2
    # the deferred one took 0.5 s of (fake) time
    assert value(metrics, "mdp_worker_handler_seconds_bucket", service="work", le="0.25") == 1
    assert value(metrics, "mdp_worker_handler_seconds_bucket", service="work", le="0.5") == 2
    assert value(metrics, "mdp_worker_busy", service="work") == 0


async def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET *url*; the samples by name, then by sorted labels."""
    from twisted.web.client import Agent, readBody

    response = await Agent(reactor()).request(b"GET", url.encode())
    assert response.code == 200
    assert response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/plain")
    body = (await readBody(response)).decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


@pytest_twisted.ensureDeferred
async def test_metrics_are_scraped_over_http_from_a_broker_a_worker_and_a_freelance_server() -> None:
    from mdp.freelance import AgentClient, FreelanceServer

    brokerMetrics, workerMetrics, freelanceMetrics = BrokerMetrics(), WorkerMetrics(), FreelanceMetrics()
    broker = Broker(reactor(), metrics=brokerMetrics, maxServiceQueue=1)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", upper, reactor(), metrics=workerMetrics)
    worker.start()
    client = Client(bound.endpoint, reactor())
    server = FreelanceServer(upper, reactor(), metrics=freelanceMetrics)
    serverBound = await server.listen("zmq:tcp://127.0.0.1:*")
    freelance = AgentClient([serverBound.endpoint], reactor())
    ports = [await serve_metrics("tcp:0:interface=127.0.0.1", m.registry, reactor())
             for m in (brokerMetrics, workerMetrics, freelanceMetrics)]
    urls = [f"http://127.0.0.1:{p.getHost().port}/metrics" for p in ports]
    raw = FuzzPeer(bound.endpoint, reactor()).transport  # only sends
    waiting = client.request("slow", b"1")  # nobody serves it: it waits...
    try:
        for n in range(4):
            assert await client.request("echo", f"{n}") == [f"{n}".encode()]
        with pytest.raises(ServiceOverloaded):  # ... and the next one is refused
            await client.request("slow", b"2")
        raw.sendMessage([b"MDPC02", b"\x09", b"junk"])  # no such command
        assert await freelance.request(b"x") == [b"X"]
        await wait_until(lambda: value(brokerMetrics, "mdp_broker_rejected_messages_total",
                                       reason="malformed") == 1, 30)
        broker_, worker_, freelance_ = [await scrape(url) for url in urls]
        assert broker_["mdp_broker_requests_refused_total"][
            (("reason", "overloaded"), ("service", "slow"))] == 1
        assert broker_["mdp_broker_error_replies_total"][(("code", "429"), ("service", "slow"))] == 1
        assert broker_["mdp_broker_queued_requests"][(("service", "slow"),)] == 1
        assert broker_["mdp_broker_rejected_messages_total"][(("reason", "malformed"),)] == 1
        assert broker_["mdp_broker_requests_total"][(("service", "echo"),)] == 4
        assert broker_["mdp_broker_replies_total"][(("service", "echo"),)] == 4
        assert broker_["mdp_broker_workers"][(("service", "echo"), ("state", "idle"))] == 1
        assert broker_["mdp_broker_undelivered_messages_total"][(("endpoint", bound.endpoint),)] == 0
        assert worker_["mdp_worker_requests_total"][(("service", "echo"),)] == 4
        assert worker_["mdp_worker_handler_seconds_count"][(("service", "echo"),)] == 4
        assert freelance_["mdp_freelance_requests_total"][()] == 1
        assert freelance_["mdp_freelance_pings_total"][()] >= 1
        assert freelance_["mdp_freelance_pending"][()] == 0
    finally:
        waiting.addErrback(lambda _: None)
        await raw.close()
        for port in ports:
            await port.stopListening()
        await freelance.close()
        await server.close()
        await client.close()
        await worker.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_twist_plugins_serve_metrics_with_the_metrics_option() -> None:
    """``twist mdp-broker --metrics`` and ``twist mdp-worker --metrics``:
    the log says where; a scrape shows the request the test sent."""
    import re

    broker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                                 "--endpoint", "zmq:tcp://127.0.0.1:*",
                                 "--metrics", "tcp:0:interface=127.0.0.1"], env=ENV)
    worker: Optional[Process] = None
    client: Optional[Client] = None
    try:
        await broker.waitFor("MDP broker listening on", timeout=60)
        await broker.waitFor("/metrics", timeout=60)
        text = broker.output.decode()
        endpoint = re.search(r"listening on (zmq:tcp://\S+)", text).group(1)
        brokerUrl = re.search(r"metrics at (http://\S+/metrics)", text).group(1)
        worker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-worker",
                                     "--broker", endpoint, "--service", "echo",
                                     "--metrics", "tcp:0:interface=127.0.0.1"], env=ENV)
        await worker.waitFor("sent READY", timeout=60)
        workerUrl = re.search(r"metrics at (http://\S+/metrics)", worker.output.decode()).group(1)
        client = Client(endpoint, reactor())
        assert await client.request("echo", b"hi") == [b"hi"]
        samples = await scrape(brokerUrl)
        assert samples["mdp_broker_replies_total"][(("service", "echo"),)] == 1
        samples = await scrape(workerUrl)
        assert samples["mdp_worker_requests_total"][(("service", "echo"),)] == 1
        # a scrape is not a log line
        assert "GET /metrics" not in broker.output.decode()
    finally:
        if client is not None:
            await client.close()
        if worker is not None:
            await worker.stop()
        await broker.stop()


@pytest_twisted.ensureDeferred
async def test_a_bad_metrics_endpoint_is_a_usage_error() -> None:
    proc = Process(reactor(), [script("twist"), "mdp-broker", "--metrics", "nonsense:1"], env=ENV)
    await proc.ended(60)
    assert proc.exitCode != 0
    assert b"--metrics" in proc.output


def test_label_values_stay_few_and_series_unique() -> None:
    """Beyond the bound, services share ``_other`` and their gauges are
    summed into one series; made-up names get at most half the labels;
    workers cannot make up status codes."""
    from mdp.majordomo.broker import BrokerMachine

    metrics = BrokerMetrics(maxServices=2)
    machine = BrokerMachine()
    metrics.watch(machine)
    machine.services[b"real"] = type("S", (), {"registered": True})()
    metrics.request(b"junk")  # made up: takes the one label made-up names may have
    metrics.request(b"junk2")  # made up, over half the bound: _other
    metrics.request(b"real")  # registered: still gets its own
    assert value(metrics, "mdp_broker_requests_total", service="junk") == 1
    assert value(metrics, "mdp_broker_requests_total", service="_other") == 1
    assert value(metrics, "mdp_broker_requests_total", service="real") == 1
    del machine.services[b"real"]
    metrics.replied(b"real", 0.1, b"\x00" * 1000)
    metrics.replied(b"real", 0.1, b"503")
    assert value(metrics, "mdp_broker_error_replies_total", service="real", code="other") == 1
    assert value(metrics, "mdp_broker_error_replies_total", service="real", code="503") == 1
    # a machine without bindings scrapes, and services over the bound share one series
    metrics = BrokerMetrics(maxServices=1)
    machine = BrokerMachine()
    metrics.watch(machine)
    for name in (b"a", b"b", b"c"):
        machine.handleMessage((type("B", (), {"clients": True, "workers": True})(), b"C" + name),
                              [codec.CLIENT_HEADER, codec.C_REQUEST, name, b"x"], 0.0)
    from prometheus_client.exposition import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert text.count('mdp_broker_queued_requests{service="_other"}') == 1
    assert value(metrics, "mdp_broker_queued_requests", service="_other") == 3  # all made up


@pytest_twisted.ensureDeferred
async def test_a_worker_with_no_broker_is_not_counted_connected() -> None:
    """On ZeroMQ a pipe is up whether or not a broker listens: only a
    broker's answer makes the worker registered."""
    from tests.test_cli_first_minutes import _free_port

    metrics = WorkerMetrics()
    endpoint = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    worker = Worker(endpoint, "echo", upper, reactor(), metrics=metrics)
    worker.start()
    try:
        await wait_until(lambda: worker.connected, 10)  # READY went out
        assert value(metrics, "mdp_worker_connected", service="echo", broker=endpoint) == 0
    finally:
        await worker.stop()
    assert value(metrics, "mdp_worker_connected", service="echo", broker=endpoint) is None


# --- the endpoint's bounds (a client cannot push it past them) ---------------------------


class HTTPPeer(Protocol):
    """A raw HTTP/1.1 client over TCP: writes what it is given and keeps what
    it hears; with *reading* False it reads nothing until :meth:`read`.
    ``closed`` fires when the connection ends."""

    def __init__(self, reading: bool = True) -> None:
        self.reading = reading
        self.received = bytearray()
        self.closed: defer.Deferred[None] = defer.Deferred()
        self._waiting: list[tuple[Any, defer.Deferred[None]]] = []

    def connectionMade(self) -> None:
        if not self.reading:
            self.transport.pauseProducing()

    def read(self) -> None:
        self.transport.resumeProducing()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        for waiting in list(self._waiting):
            if waiting[0](self):
                self._waiting.remove(waiting)
                waiting[1].callback(None)

    def until(self, predicate: Any) -> defer.Deferred[None]:
        """Fires once *predicate(self)* holds after something arrives."""
        d: defer.Deferred[None] = defer.Deferred()
        if predicate(self):
            d.callback(None)
        else:
            self._waiting.append((predicate, d))
        return d

    def connectionLost(self, reason: Any = None) -> None:
        self.closed.callback(None)


def responses(data: bytes) -> list[int]:
    """The status codes of the complete responses at the start of *data*."""
    codes, at = [], 0
    while True:
        end = data.find(b"\r\n\r\n", at)
        if end < 0:
            return codes
        head = bytes(data[at:end]).split(b"\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head[1:]
                       if line.lower().startswith(b"content-length:")), 0)
        if len(data) < end + 4 + length:
            return codes
        codes.append(int(head[0].split(b" ")[1]))
        at = end + 4 + length


GET = b"GET /metrics HTTP/1.1\r\nHost: metrics\r\n\r\n"


async def connect(port: Any, peer: HTTPPeer) -> HTTPPeer:
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

    return await connectProtocol(TCP4ClientEndpoint(reactor(), "127.0.0.1", port.getHost().port), peer)


def bytesRead(site: Any) -> list[int]:
    """Counts, per connection in order, the bytes *site*'s channels read."""
    counts: list[int] = []
    build = site.buildProtocol

    def buildProtocol(addr: Any) -> Any:
        channel = build(addr)
        index = len(counts)
        counts.append(0)
        dataReceived = channel.dataReceived

        def counting(data: bytes) -> None:
            counts[index] += len(data)
            dataReceived(data)

        channel.dataReceived = counting
        return channel

    site.buildProtocol = buildProtocol
    return counts


@pytest_twisted.ensureDeferred
async def test_only_the_metrics_path_is_served() -> None:
    from twisted.web.client import Agent, readBody

    from mdp.metrics import metrics_site

    metrics = BrokerMetrics()
    metrics.request(b"echo")
    port = reactor().listenTCP(0, metrics_site(metrics.registry), interface="127.0.0.1")
    base = f"http://127.0.0.1:{port.getHost().port}"
    try:
        assert "mdp_broker_requests_total" in await scrape(base + "/metrics")
        assert "mdp_broker_requests_total" in await scrape(base + "/metrics?x=1")
        for path in ("/", "/metrics/", "/metrics/x", "/metrics/x/y", "/other"):
            response = await Agent(reactor()).request(b"GET", (base + path).encode())
            body = await readBody(response)
            assert (path, response.code) == (path, 404)
            assert b"mdp_broker" not in body
    finally:
        await port.stopListening()


def test_the_endpoint_bounds_are_checked() -> None:
    from mdp.metrics import metrics_site

    registry = BrokerMetrics().registry
    for bad in (dict(maxConnections=0), dict(maxBodyBytes=-1), dict(requestTimeout=0),
                dict(requestTimeout=float("inf")), dict(requestTimeout=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            metrics_site(registry, **bad)
    with pytest.raises(TypeError, match="maxConnections"):
        metrics_site(registry, maxConnections=1.5)


@pytest_twisted.ensureDeferred
async def test_a_large_request_body_is_refused_unread() -> None:
    """Content-Length over maxBodyBytes, or chunked: 413 and closed, from the
    headers alone; the body is not read (nor spooled to disk)."""
    from mdp.metrics import metrics_site

    site = metrics_site(BrokerMetrics().registry)
    read = bytesRead(site)
    port = reactor().listenTCP(0, site, interface="127.0.0.1")
    try:
        body = b"x" * (4 << 20)
        peer = await connect(port, HTTPPeer())
        peer.transport.write(b"POST /metrics HTTP/1.1\r\nHost: metrics\r\n"
                             b"Content-Length: 100000000000\r\n\r\n" + body)
        await bounded(peer.closed, 30)
        assert peer.received.startswith(b"HTTP/1.1 413 ")
        assert read[0] < len(body) // 8  # far less than was sent
        assert not site.channels

        peer = await connect(port, HTTPPeer())
        peer.transport.write(b"POST /metrics HTTP/1.1\r\nHost: metrics\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n10\r\n" + b"x" * 16 + b"\r\n")
        await bounded(peer.closed, 30)
        assert peer.received.startswith(b"HTTP/1.1 413 ")

        # a small body is read (and the method still not allowed)
        peer = await connect(port, HTTPPeer())
        peer.transport.write(b"POST /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n"
                             b"Content-Length: 5\r\n\r\nhello")
        await bounded(peer.closed, 30)
        assert responses(peer.received) == [405]
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_connections_beyond_max_connections_are_closed_at_once() -> None:
    from mdp.metrics import metrics_site

    site = metrics_site(BrokerMetrics().registry, maxConnections=2)
    port = reactor().listenTCP(0, site, interface="127.0.0.1")
    peers: list[HTTPPeer] = []
    try:
        for _ in range(2):
            peer = await connect(port, HTTPPeer())
            peers.append(peer)
            peer.transport.write(GET)
            await bounded(peer.until(lambda p: responses(p.received) == [200]), 30)
        extra = await connect(port, HTTPPeer())
        await bounded(extra.closed, 30)
        assert extra.received == b""
        assert site.refused == 1
        # the two still answer, and one leaving makes room
        peers[0].transport.write(GET)
        await bounded(peers[0].until(lambda p: responses(p.received) == [200, 200]), 30)
        peers[1].transport.loseConnection()
        await bounded(peers[1].closed, 30)
        await wait_until(lambda: len(site.channels) == 1, 30)
        peer = await connect(port, HTTPPeer())
        peers.append(peer)
        peer.transport.write(GET)
        await bounded(peer.until(lambda p: responses(p.received) == [200]), 30)
    finally:
        for peer in peers:
            peer.transport.loseConnection()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_full_endpoint_closes_a_connection_that_had_no_answer_for_a_newcomer() -> None:
    """At maxConnections, the oldest connection with no answer yet (a slow
    or silent client) is closed to admit a newcomer; the one that was answered
    stays."""
    from mdp.metrics import metrics_site

    site = metrics_site(BrokerMetrics().registry, maxConnections=2)
    port = reactor().listenTCP(0, site, interface="127.0.0.1")
    peers: list[HTTPPeer] = []
    try:
        answered = await connect(port, HTTPPeer())
        answered.transport.write(GET)
        await bounded(answered.until(lambda p: responses(p.received) == [200]), 30)
        slow = await connect(port, HTTPPeer())
        slow.transport.write(b"GET /metr")
        await wait_until(lambda: len(site.channels) == 2, 30)
        newcomer = await connect(port, HTTPPeer())
        peers += [answered, slow, newcomer]
        newcomer.transport.write(GET)
        await bounded(newcomer.until(lambda p: responses(p.received) == [200]), 30)
        await bounded(slow.closed, 30)
        assert slow.received == b"" and (site.evicted, site.refused) == (1, 0)
        answered.transport.write(GET)
        await bounded(answered.until(lambda p: responses(p.received) == [200, 200]), 30)
    finally:
        for peer in peers:
            peer.transport.loseConnection()
        await port.stopListening()


SLOW_CLIENTS = """
import socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def slow():
    s = socket.create_connection((host, port))
    s.sendall(b"GET /metr")  # never more
    s.setblocking(False)
    return s
held = [slow() for _ in range(count)]
print("holding", count, flush=True)
import selectors
selector = selectors.DefaultSelector()
for s in held:
    selector.register(s, selectors.EVENT_READ)
for _ in range(100000):  # reopen each connection the server closes, until killed
    for key, _ in selector.select(timeout=1.0):
        selector.unregister(key.fileobj)
        key.fileobj.close()
        try:
            selector.register(slow(), selectors.EVENT_READ)
        except OSError:
            pass
"""


@pytest_twisted.ensureDeferred
async def test_slow_clients_holding_every_connection_keep_no_scrape_out() -> None:
    """``twist mdp-broker --metrics``: another process holds as many slow
    connections as the endpoint takes (64) and reopens each one it loses;
    each of 50 scrapes is still answered within 2 s."""
    import re
    import time

    from tests.procs import python

    broker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                                 "--endpoint", "tcp:0:interface=127.0.0.1",
                                 "--metrics", "tcp:0:interface=127.0.0.1"], env=ENV)
    attacker: Optional[Process] = None
    try:
        await broker.waitFor("metrics at", timeout=60)
        url = re.search(r"metrics at (http://\S+/metrics)", broker.output.decode()).group(1)
        host, port = re.match(r"http://([^:/]+):(\d+)/", url).groups()
        attacker = Process(reactor(), python("-c", SLOW_CLIENTS, host, port, "64"), env=ENV)
        await attacker.waitFor("holding 64", timeout=60)
        for _ in range(50):
            started = time.monotonic()
            samples = await bounded(defer.ensureDeferred(scrape(url)), 2.0)
            assert time.monotonic() - started < 2.0 and "mdp_broker_peers" in samples
        assert "closed the connection from" in broker.output.decode()
    finally:
        if attacker is not None:
            await attacker.stop()
        await broker.stop()


@pytest_twisted.ensureDeferred
async def test_a_request_must_arrive_whole_within_the_deadline() -> None:
    """A byte every few seconds does not put the deadline off: the connection
    is closed requestTimeout after it opened, or after the previous response."""
    from twisted.internet.task import Clock

    from mdp.metrics import metrics_site

    clock = Clock()
    site = metrics_site(BrokerMetrics().registry, clock, requestTimeout=10.0)
    read = bytesRead(site)
    port = reactor().listenTCP(0, site, interface="127.0.0.1")
    try:
        peer = await connect(port, HTTPPeer())
        await wait_until(lambda: site.channels, 30)
        for sent, byte in enumerate(b"GET /metr", 1):
            peer.transport.write(bytes([byte]))
            await wait_until(lambda: read[0] == sent, 30)  # noqa: B023
            clock.advance(1.0)
        assert not peer.closed.called
        clock.advance(0.5)  # 9.5 s
        peer.transport.write(b"i")
        await wait_until(lambda: read[0] == 10, 30)
        assert not peer.closed.called
        clock.advance(0.5)  # 10 s after connecting
        await bounded(peer.closed, 30)
        assert peer.received == b""
        assert not site.channels

        # after a response, the next request has requestTimeout again
        peer = await connect(port, HTTPPeer())
        await wait_until(lambda: site.channels, 30)
        clock.advance(9.0)
        peer.transport.write(GET)
        await bounded(peer.until(lambda p: responses(p.received) == [200]), 30)
        clock.advance(9.0)
        assert not peer.closed.called
        clock.advance(1.0)
        await bounded(peer.closed, 30)
    finally:
        await port.stopListening()


class Padding:
    """A collector of about *size* bytes of text, counting its scrapes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.scrapes = 0

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        self.scrapes += 1
        family = GaugeMetricFamily("padding", "Bytes to send.", labels=["n", "pad"])
        for n in range(self.size // 1000):
            family.add_metric([str(n), "p" * 980], n)
        yield family


@pytest_twisted.ensureDeferred
async def test_pipelined_requests_wait_while_responses_are_not_read() -> None:
    """A client that pipelines requests and reads nothing gets no more
    answered than its transport's buffer holds: the endpoint stops reading
    and handling until the responses are taken, then answers the rest; if
    they are not taken within requestTimeout, the connection is aborted."""
    from prometheus_client import CollectorRegistry
    from twisted.internet.task import Clock

    from mdp.metrics import metrics_site

    registry = CollectorRegistry()
    padding = Padding(50_000)
    registry.register(padding)
    clock = Clock()
    site = metrics_site(registry, clock, requestTimeout=10.0)
    port = reactor().listenTCP(0, site, interface="127.0.0.1")
    count = 200

    async def pipelining() -> tuple[HTTPPeer, Any]:
        """A peer that sent *count* GETs and reads nothing, once the endpoint
        stopped reading from it; and the endpoint's side of it."""
        import socket

        peer = await connect(port, HTTPPeer(reading=False))
        await wait_until(lambda: site.channels, 30)
        (channel,) = site.channels
        server = channel.transport
        # a small kernel buffer: what the kernel takes is not the test's subject
        server.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        peer.transport.write(GET * count)
        await wait_until(lambda: server not in reactor().getReaders(), 30)
        return peer, server

    try:
        peer, server = await pipelining()
        assert padding.scrapes < count // 4
        response = padding.size + 1000
        buffered = len(server.dataBuffer) - server.offset + server._tempDataLen
        assert 0 < buffered <= server.bufferSize + response
        # taken at last: every request is answered, in order
        peer.read()
        await bounded(peer.until(lambda p: len(responses(p.received)) == count), 60)
        assert responses(peer.received) == [200] * count
        assert padding.scrapes == count
        peer.transport.loseConnection()
        await bounded(peer.closed, 30)
        await wait_until(lambda: not site.channels, 30)

        # never taken: aborted at the deadline
        peer, server = await pipelining()
        clock.advance(10.0)
        await wait_until(lambda: not site.channels, 30)
        peer.read()  # a peer that does not read cannot see it closed
        await bounded(peer.closed, 30)
        assert padding.scrapes < count + count // 4
    finally:
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_metrics_endpoint_other_machines_can_reach_is_warned_about() -> None:
    """The endpoint has no authentication: on every interface (a memory
    reactor's port here: no test listens beyond 127.0.0.1) it is logged as
    a warning; on loopback it is not."""
    from twisted.internet.testing import MemoryReactorClock
    from twisted.logger import formatEvent, globalLogPublisher

    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        memory = MemoryReactorClock()
        await serve_metrics("tcp:9464:interface=127.0.0.1", BrokerMetrics().registry, memory)
        assert not [line for line in lines if "reachable from other machines" in line]
        await serve_metrics("tcp:9464", BrokerMetrics().registry, memory)
    finally:
        globalLogPublisher.removeObserver(observer)
    assert [port for port, *_ in memory.tcpServers] == [9464, 9464]
    warnings = [line for line in lines if "reachable from other machines" in line]
    assert len(warnings) == 1 and "the metrics endpoint listens on tcp:9464," in warnings[0]
    assert "tcp:9464:interface=127.0.0.1" in warnings[0]  # the way out


def test_a_full_listener_s_evictions_and_refusals_are_exported() -> None:
    """The counters a stream listener keeps at its connection caps become
    ``_connections_evicted_total`` and ``_connections_refused_total``."""
    from types import SimpleNamespace

    from mdp.metrics import transport_metrics

    listener = SimpleNamespace(endpoint="tcp:port=1", evicted=3, refused=2, dropped=0)
    families = {family.name: family for family in transport_metrics("mdp_broker", [listener, None])}
    assert families["mdp_broker_connections_evicted"].samples[0].value == 3
    assert families["mdp_broker_connections_refused"].samples[0].value == 2
    assert families["mdp_broker_connections_evicted"].samples[0].labels == {"endpoint": "tcp:port=1"}
