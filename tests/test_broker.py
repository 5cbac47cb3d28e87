"""Broker features beyond plain MDP/0.2: MMI, service linger, bounded queues."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import Broker, HeartbeatPolicy, ServiceOverloaded
from mdp.majordomo import codec
from tests.conftest import LoopbackNet, Net, RawPeer, logged_at
from tests.test_mdp_behaviour import echo, make_client, start_broker, start_worker


def check_counts(broker: Broker) -> None:
    """The broker's running total matches its queues."""
    assert broker.queued == sum(s.size for s in broker.services.values())
    for service in broker.services.values():
        assert service.size == sum(len(q) for q in service.pending.values())
        assert service.workers == sum(1 for w in broker.workers.values() if w.service is service)


@pytest_twisted.ensureDeferred
async def test_mmi_service(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint)
    await net.wait(client.request("echo", b"warm up"))
    assert await net.wait(client.request("mmi.service", b"echo")) == [b"200"]
    assert await net.wait(client.request("mmi.service", b"nothing")) == [b"404"]
    assert await net.wait(client.request("mmi.bogus", b"x")) == [b"501"]
    # MMI requests are answered by the broker, never queued
    assert set(broker.services) == {b"echo"}


@pytest_twisted.ensureDeferred
async def test_mmi_services_and_workers(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    start_worker(net, endpoint, "echo", echo)
    start_worker(net, endpoint, "other", echo)
    await net.until(lambda: len(broker.workers) == 3)
    client = make_client(net, endpoint)
    (services,) = await net.wait(client.request("mmi.services", b""))
    assert json.loads(services) == {
        "echo": {"workers": 2, "idle": 2, "queued": 0},
        "other": {"workers": 1, "idle": 1, "queued": 0},
    }
    (workers,) = await net.wait(client.request("mmi.workers", b"echo"))
    listed = json.loads(workers)
    assert [w["service"] for w in listed] == ["echo", "echo"]
    assert all(w["busy"] is False and w["dialect"] == "rfc" for w in listed)
    (everyone,) = await net.wait(client.request("mmi.workers", b""))
    assert len(json.loads(everyone)) == 3


@pytest_twisted.ensureDeferred
async def test_service_of_a_dead_worker_lingers_then_is_404(clocknet: LoopbackNet) -> None:
    hb = HeartbeatPolicy(interval=1.0, liveness=3)
    broker, endpoint = await start_broker(clocknet, heartbeat=hb, serviceLinger=5.0)
    ghost = RawPeer(clocknet, endpoint)
    ghost.send(codec.WORKER_HEADER, codec.W_READY, b"flaky")
    await clocknet.until(lambda: len(broker.workers) == 1)
    # the worker goes silent: expired after 3-4 s, the service then lingers 5 s
    assert broker.isServiceAvailable(b"flaky")
    await clocknet.until(lambda: not broker.workers)
    died = clocknet.reactor.seconds()
    assert broker.isServiceAvailable(b"flaky")
    client = make_client(clocknet, endpoint)
    assert await clocknet.wait(client.request("mmi.service", b"flaky")) == [b"200"]
    await clocknet.until(lambda: not broker.isServiceAvailable(b"flaky"))
    assert clocknet.reactor.seconds() - died == pytest.approx(5.0, abs=0.05)
    assert await clocknet.wait(client.request("mmi.service", b"flaky")) == [b"404"]
    await clocknet.until(lambda: b"flaky" not in broker.services, timeout=2)  # and forgotten


@pytest_twisted.ensureDeferred
async def test_a_worker_returning_within_the_linger_keeps_the_service(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet, serviceLinger=5.0)
    first = RawPeer(clocknet, endpoint)
    first.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    await clocknet.until(lambda: len(broker.workers) == 1)
    first.send(codec.WORKER_HEADER, codec.W_DISCONNECT)
    clocknet.advance(2)
    assert broker.isServiceAvailable(b"svc")
    start_worker(clocknet, endpoint, "svc", echo)
    clocknet.advance(10)
    assert broker.isServiceAvailable(b"svc")


@pytest_twisted.ensureDeferred
async def test_full_service_queue_refuses_with_service_overloaded(net: Net) -> None:
    broker, endpoint = await start_broker(net, maxServiceQueue=3, maxQueue=5)
    client = make_client(net, endpoint, timeout=30, retries=1)
    waiting = [client.request("slow", str(n)) for n in range(3)]
    await net.until(lambda: broker.queued == 3)
    with pytest.raises(ServiceOverloaded) as info:
        await net.wait(client.request("slow", b"one too many"))
    assert info.value.code == b"429"
    # the broker-wide bound
    others = [client.request("other", str(n)) for n in range(2)]
    await net.until(lambda: broker.queued == 5)
    with pytest.raises(ServiceOverloaded):
        await net.wait(client.request("third", b"x"))
    check_counts(broker)
    # nothing already accepted is lost: workers drain everything
    start_worker(net, endpoint, "slow", echo)
    start_worker(net, endpoint, "other", echo)
    replies = await net.wait(defer.gatherResults(waiting + others))
    assert replies == [[b"0"], [b"1"], [b"2"], [b"0"], [b"1"]]
    check_counts(broker)
    assert broker.queued == 0


@pytest_twisted.ensureDeferred
async def test_worker_table_is_bounded(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet, maxWorkers=2)
    peers = [RawPeer(clocknet, endpoint) for _ in range(3)]
    for peer in peers:
        peer.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    clocknet.advance(0)
    assert len(broker.workers) == 2
    assert peers[2].received == [[codec.WORKER_HEADER, codec.W_DISCONNECT]]


@pytest_twisted.ensureDeferred
async def test_snapshot_is_a_read_only_view(clocknet: LoopbackNet) -> None:
    from mdp.majordomo.broker_records import BrokerSnapshot, ServiceSnapshot

    broker, endpoint = await start_broker(clocknet)
    busy = RawPeer(clocknet, endpoint)
    busy.send(codec.WORKER_HEADER, codec.W_READY, b"echo")
    start_worker(clocknet, endpoint, "echo", echo)
    start_worker(clocknet, endpoint, "other", echo)
    await clocknet.until(lambda: len(broker.workers) == 3)
    client = make_client(clocknet, endpoint, timeout=30, retries=1)
    # the raw worker was first in line and never answers: it stays busy
    client.request("echo", b"held")
    client.request("nobody", b"queued")
    await clocknet.until(lambda: broker.queued == 1)
    clocknet.advance(0.5)
    snapshot = broker.snapshot()
    assert isinstance(snapshot, BrokerSnapshot)
    assert snapshot.at == clocknet.reactor.seconds()
    assert snapshot.services == (
        ServiceSnapshot(b"echo", idle=1, busy=1, queued=0, queuedBytes=0),
        ServiceSnapshot(b"nobody", idle=0, busy=0, queued=1, queuedBytes=6 + 64),
        ServiceSnapshot(b"other", idle=1, busy=0, queued=0, queuedBytes=0),
    )
    assert snapshot.services[0].workers == 2
    assert (snapshot.serviceCount, snapshot.workerCount) == (3, 3)
    assert (snapshot.queued, snapshot.queuedBytes) == (1, 70)
    assert [(w.service, w.busy, w.dialect) for w in snapshot.workers] == [
        (b"echo", True, "rfc"), (b"echo", False, "rfc"), (b"other", False, "rfc")]
    assert all(0 <= w.silence <= 2.5 for w in snapshot.workers)
    assert all(len(w.peer) % 2 == 0 and int(w.peer, 16) >= 0 for w in snapshot.workers)
    # limits and a service filter
    some = broker.snapshot(serviceLimit=1, workerLimit=1, service=b"echo")
    assert [s.name for s in some.services] == [b"echo"] and some.serviceCount == 3
    assert [w.service for w in some.workers] == [b"echo"] and some.workerCount == 2
    # frozen
    with pytest.raises(AttributeError):
        snapshot.queued = 0  # type: ignore[misc]


def test_mmi_reads_only_the_public_view() -> None:
    """mmi.py uses the broker's snapshot, isServiceAvailable and
    admissionStatus, nothing private."""
    import ast
    import inspect

    from mdp.majordomo import mmi

    tree = ast.parse(inspect.getsource(mmi))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "broker"}
    assert used == {"snapshot", "isServiceAvailable", "admissionStatus"}


def test_provides_its_interfaces() -> None:
    from twisted.internet import task
    from zope.interface.verify import verifyObject

    from mdp.interfaces import IBroker, IRouterReceiver
    from mdp.majordomo.broker import Binding

    broker = Broker(task.Clock())
    assert verifyObject(IBroker, broker)
    assert verifyObject(IRouterReceiver, Binding(broker, True, True))
    assert not IRouterReceiver.providedBy(broker)


def test_its_records_show_their_fields() -> None:
    """A request and a worker as the broker holds them, in a log line or a
    debugger: every field by name (plain classes, compiled as extension
    types, show what attrs ones did)."""
    from mdp.majordomo.broker_records import IDLE, NEW, PendingRequest, WorkerRef

    request = PendingRequest(("binding", b"peer"), b"echo", [b"x"], codec.RFC, 1.5, 10)
    assert repr(request) == (
        f"PendingRequest(client=('binding', b'peer'), service=b'echo', body=[b'x'], "
        f"dialect={codec.RFC!r}, queuedAt=1.5, size=10, state={NEW!r}, envelope=b'', "
        "deliveries=0, partials=0, arrivedAt=1.5, assignedAt=0.0, context=None, "
        "deadline=None, holder=None, givenUp=False)")
    worker = WorkerRef(("binding", b"w"), None, codec.RFC, None)  # type: ignore[arg-type]
    worker.current = request
    assert repr(worker).startswith(f"WorkerRef(key=('binding', b'w'), service=None, "
                                   f"dialect={codec.RFC!r}, liveness=None, state={IDLE!r}, "
                                   "current=PendingRequest(client=")
    assert repr(worker).endswith(", lastEnvelope=b'', extended=False)")


def test_a_malformed_endpoint_raises_at_once() -> None:
    from twisted.internet import task

    from mdp.errors import TransportError

    broker = Broker(task.Clock())
    for endpoint in ("tcp:host=127.0.0.1", "zmq:tcp://127.0.0.1", "tcp:port=http",
                     "nope:x", "loopback:"):
        with pytest.raises(TransportError, match="bad endpoint"):
            broker.listen(endpoint)
    assert broker.bindings == [] and not broker._ticker.running


@pytest_twisted.ensureDeferred
async def test_stream_factory_serves_a_port_of_ones_own() -> None:
    """A broker embedded with serverFromString(...).listen(broker.streamFactory())."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString

    from mdp import Client, Worker
    from tests.conftest import RealNet

    net = RealNet("tcp")
    broker = Broker(reactor)
    factory = broker.streamFactory()
    assert broker._ticker.running and len(broker.bindings) == 1
    port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(factory)
    try:
        endpoint = f"tcp:host=127.0.0.1:port={port.getHost().port}"
        worker = Worker(endpoint, "echo", echo, reactor)
        worker.start()
        client = Client(endpoint, reactor, timeout=10, retries=1)
        try:
            assert await net.wait(client.request("echo", b"over", b"tcp"), 15) == [b"over", b"tcp"]
            assert [w.service for w in broker.snapshot().workers] == [b"echo"]
        finally:
            await client.close()
            await worker.stop()
    finally:
        await port.stopListening()
        await broker.close()
    assert broker.bindings == [] and not broker._ticker.running


@pytest_twisted.ensureDeferred
async def test_a_listener_that_fails_to_close_is_logged_and_the_others_are_closed(
        clocknet: LoopbackNet) -> None:
    from tests.conftest import failures_logged

    broker = Broker(clocknet.reactor)
    first = await clocknet.wait(broker.listen(clocknet.bindEndpoint()))
    second = await clocknet.wait(broker.listen(clocknet.bindEndpoint()))
    (failing, other) = [b.transport for b in broker.bindings]
    closed = []
    failing.close = lambda: defer.fail(RuntimeError("stuck"))  # type: ignore[method-assign]
    otherClose = other.close
    other.close = lambda: closed.append(other) or otherClose()  # type: ignore[method-assign]
    with failures_logged() as events:
        assert await clocknet.wait(broker.close()) is None
    assert closed == [other] and first.endpoint != second.endpoint
    (event,) = events
    assert event["what"] == "a broker listener" and event["log_failure"].check(RuntimeError)


def test_what_a_failing_tick_decided_is_still_done() -> None:
    """A tick that raises part-way (logged) still performs the actions it
    had decided: here, the wake-up it asked for."""
    from twisted.internet.task import Clock

    from mdp.majordomo.broker_machine import BrokerMachine, WakeAt

    class FailingTick(BrokerMachine):
        def handleTick(self, now: float) -> list:
            self._emit(WakeAt(now + 5))
            raise RuntimeError("a bug in the tick")

    clock = Clock()
    broker = Broker(reactor=clock)
    broker.machine = FailingTick(now=clock.seconds())
    with logged_at(()) as events:
        broker.tick()
    assert broker._wakeCall is not None and broker._wakeCall.getTime() == 5
    assert [event["log_format"] for event in events] == ["broker tick failed"]


def test_a_send_that_raises_in_a_tick_does_not_stop_the_ticks() -> None:
    """A transport that raises once while the tick's heartbeat goes out is
    logged; the ticks go on, so a silent worker still expires."""
    from twisted.internet.task import Clock

    from mdp.majordomo.broker import Binding

    class FlakyRouter:
        endpoint = ""

        def __init__(self) -> None:
            self.failOnce = True

        def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
            if frames[-1] == codec.W_HEARTBEAT and self.failOnce:
                self.failOnce = False
                raise RuntimeError("transport hiccup")

        def disconnectPeer(self, peer: bytes) -> None:
            pass

    clock = Clock()
    broker = Broker(clock)
    binding = Binding(broker, True, True)
    broker._bind(binding, FlakyRouter())
    binding.messageReceived(b"w1", [codec.WORKER_HEADER, codec.W_READY, b"echo"])
    with logged_at(()) as events:
        for _ in range(40):
            clock.advance(0.5)
    assert broker._ticker.running
    assert (binding, b"w1") not in broker.machine.workers
    assert "broker tick failed" in [event["log_format"] for event in events]
