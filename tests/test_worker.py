"""Worker state machine against a scripted broker, on loopback with a Clock."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import Backoff, HeartbeatPolicy, Worker
from mdp.majordomo import codec
from tests.conftest import LoopbackNet, raw_router

HB = HeartbeatPolicy(interval=1.0, liveness=3)


def readies(router) -> list[tuple[float, bytes]]:
    return [(t, peer) for t, peer, frames in router.received if frames[1] == codec.W_READY]


async def broker_and_worker(clocknet: LoopbackNet, handler=lambda f: f, **kwargs):
    """A scripted broker and a started worker of service "svc", stopped after the test."""
    router = await raw_router(clocknet)
    kwargs.setdefault("extensions", False)  # (a scripted broker: READY first)
    worker = Worker(router.transport.endpoint, "svc", handler, clocknet.reactor, **kwargs)
    worker.start()
    clocknet.addCleanup(worker.stop)
    return router, worker


@pytest_twisted.ensureDeferred
async def test_ready_then_heartbeats(clocknet: LoopbackNet) -> None:
    router, worker = await broker_and_worker(clocknet, heartbeat=HB)
    clocknet.advance(0)
    assert [f for _, _, f in router.received] == [[codec.WORKER_HEADER, codec.W_READY, b"svc"]]
    clocknet.advance(2.5)
    beats = [t for t, _, f in router.received if f == [codec.WORKER_HEADER, codec.W_HEARTBEAT]]
    assert beats == pytest.approx([1.0, 2.0])


@pytest_twisted.ensureDeferred
async def test_silent_broker_reconnects_with_doubling_backoff(clocknet: LoopbackNet) -> None:
    router, worker = await broker_and_worker(clocknet, heartbeat=HB, backoff=Backoff(initial=1, maximum=32))
    clocknet.advance(200)
    times = [t for t, _ in readies(router)]
    peers = {p for _, p in readies(router)}
    assert len(peers) == len(times)  # every registration on a fresh socket
    # silence is noticed 3.5 s after the last sign of life (ticks of half an
    # interval, 0.5 s, expiry 3 s); what remains of each gap is the backoff delay
    delays = [b - a - 3.5 for a, b in zip(times, times[1:])]
    assert delays[:7] == pytest.approx([1, 2, 4, 8, 16, 32, 32], abs=0.02)


@pytest_twisted.ensureDeferred
async def test_backoff_resets_once_the_broker_speaks(clocknet: LoopbackNet) -> None:
    router, worker = await broker_and_worker(clocknet, heartbeat=HB, backoff=Backoff(initial=1, maximum=32))
    await clocknet.until(lambda: len(readies(router)) == 4)  # after three failures
    assert worker.machine.failures == 3
    last_peer = readies(router)[-1][1]
    router.send(last_peer, codec.WORKER_HEADER, codec.W_HEARTBEAT)
    clocknet.advance(0)
    assert worker.machine.failures == 0


@pytest_twisted.ensureDeferred
async def test_disconnect_from_broker_reregisters_on_a_new_socket(clocknet: LoopbackNet) -> None:
    router, worker = await broker_and_worker(clocknet, heartbeat=HB)
    clocknet.advance(0)
    (_, first), = readies(router)
    router.send(first, codec.WORKER_HEADER, codec.W_DISCONNECT)
    clocknet.advance(0.1)
    assert len(readies(router)) == 2
    assert readies(router)[1][1] != first


@pytest_twisted.ensureDeferred
async def test_reply_from_before_a_reconnection_is_dropped(clocknet: LoopbackNet) -> None:
    router = await raw_router(clocknet)
    pending: list[defer.Deferred] = []

    def slow(frames: list[bytes]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        pending.append(d)
        return d

    worker = Worker(router.transport.endpoint, "svc", slow, clocknet.reactor, heartbeat=HB,
                    extensions=False)
    worker.start()
    clocknet.addCleanup(worker.stop)
    clocknet.advance(0)
    (_, peer), = readies(router)
    router.send(peer, codec.WORKER_HEADER, codec.W_REQUEST, b"client", b"", b"job")
    clocknet.advance(0)
    assert len(pending) == 1
    clocknet.advance(10)  # broker silent: the worker re-registers elsewhere
    assert len(readies(router)) >= 2
    pending[0].callback([b"too late"])
    clocknet.advance(0)
    finals = [f for _, _, f in router.received if f[1] == codec.W_FINAL]
    assert finals == []


@pytest.mark.parametrize("deferred", [False, True])
@pytest_twisted.ensureDeferred
async def test_a_reply_that_cannot_be_encoded_is_a_500_and_the_worker_goes_on(
        clocknet: LoopbackNet, deferred: bool) -> None:
    """A str UTF-8 cannot encode (os.fsdecode of bad bytes) is the handler's
    error: a 500, not a worker busy for good."""
    def handler(frames: list[bytes]):
        reply = "caf\udce9" if frames == [b"bad"] else frames
        return defer.succeed(reply) if deferred else reply

    router, worker = await broker_and_worker(clocknet, handler, heartbeat=HB)
    clocknet.advance(0)
    (_, peer), = readies(router)
    router.send(peer, codec.WORKER_HEADER, codec.W_REQUEST, b"client", b"", b"bad")
    clocknet.advance(0)
    router.send(peer, codec.WORKER_HEADER, codec.W_REQUEST, b"client", b"", b"good")
    clocknet.advance(0)
    finals = [f[2:] for _, _, f in router.received if f[1] == codec.W_FINAL]
    assert finals[0][:3] == [b"client", b"", codec.ERROR_MARKER] and b"500" in finals[0]
    assert finals[1] == [b"client", b"", b"good"]


@pytest_twisted.ensureDeferred
async def test_stop_sends_disconnect(clocknet: LoopbackNet) -> None:
    router = await raw_router(clocknet)
    worker = Worker(router.transport.endpoint, "svc", lambda f: f, clocknet.reactor, heartbeat=HB,
                    extensions=False)
    worker.start()
    clocknet.advance(0)
    await clocknet.wait(worker.stop())
    clocknet.advance(0)
    assert router.received[-1][2] == [codec.WORKER_HEADER, codec.W_DISCONNECT]


@pytest_twisted.ensureDeferred
async def test_majortomo_dialect_puts_an_empty_frame_first(clocknet: LoopbackNet) -> None:
    router, worker = await broker_and_worker(clocknet, heartbeat=HB, dialect="majortomo")
    clocknet.advance(0)
    _, peer, frames = router.received[0]
    assert frames == [b"", codec.WORKER_HEADER, codec.W_READY, b"svc"]
    router.send(peer, b"", codec.WORKER_HEADER, codec.W_REQUEST, b"c", b"", b"ping")
    clocknet.advance(0)
    assert router.received[-1][2] == [b"", codec.WORKER_HEADER, codec.W_FINAL, b"c", b"", b"ping"]


@pytest_twisted.ensureDeferred
async def test_fails_over_to_the_next_broker(clocknet: LoopbackNet) -> None:
    silent = await raw_router(clocknet)
    alive = await raw_router(clocknet)
    endpoints = [silent.transport.endpoint, alive.transport.endpoint]
    worker = Worker(endpoints, "svc", lambda f: f, clocknet.reactor, heartbeat=HB, extensions=False)
    worker.start()
    clocknet.addCleanup(worker.stop)
    await clocknet.until(lambda: bool(readies(alive)))
    assert len(readies(silent)) == 1
    assert worker.endpoint == alive.transport.endpoint


@pytest_twisted.ensureDeferred
async def test_unreachable_broker_counts_as_dead(clocknet: LoopbackNet) -> None:
    alive = await raw_router(clocknet)
    endpoints = ["loopback:nobody-listens-here", alive.transport.endpoint]
    worker = Worker(endpoints, "svc", lambda f: f, clocknet.reactor, heartbeat=HB, extensions=False)
    worker.start()
    clocknet.addCleanup(worker.stop)
    await clocknet.until(lambda: bool(readies(alive)), timeout=10)
    assert worker.connected


def test_a_malformed_endpoint_raises_at_once() -> None:
    from mdp.errors import TransportError

    with pytest.raises(TransportError, match="bad endpoint"):
        Worker("tcp:host=127.0.0.1", "svc", lambda f: f)
    with pytest.raises(TransportError, match="bad endpoint"):
        Worker(["loopback:fine", "zmq:tcp://127.0.0.1"], "svc", lambda f: f)
    with pytest.raises(ValueError):
        Worker([], "svc", lambda f: f)
    with pytest.raises(ValueError, match="empty service name"):
        Worker("loopback:fine", "", lambda f: f)
    with pytest.raises(TypeError, match="service name"):
        Worker("loopback:fine", 5, lambda f: f)


def test_endpoints_given_as_bytes_raise_a_clear_type_error() -> None:
    # bytes were iterated: "an endpoint is a string, not int: 122"
    for bad in (b"zmq:tcp://127.0.0.1:5555", bytearray(b"loopback:x"), 5555, None):
        with pytest.raises(TypeError, match=f"endpoints are str .*not {type(bad).__name__}"):
            Worker(bad, "svc", lambda f: f)
    assert Worker(("loopback:a", "loopback:b"), "svc", lambda f: f).endpoints == [
        "loopback:a", "loopback:b"]


def test_a_handler_that_is_not_callable_raises_at_once() -> None:
    # accepted, it would have answered every request with a 500
    with pytest.raises(TypeError, match="a handler is a callable .*not int: 5"):
        Worker("loopback:fine", "echo", 5)
    with pytest.raises(TypeError, match="not NoneType"):
        Worker("loopback:fine", "echo", None)


def test_provides_its_interfaces() -> None:
    from twisted.internet import task
    from zope.interface.verify import verifyObject

    from mdp.interfaces import IDealerReceiver, IWorker

    worker = Worker("loopback:nobody", "svc", lambda f: f, task.Clock())
    assert verifyObject(IWorker, worker)
    assert verifyObject(IDealerReceiver, worker)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_worker_says_why_it_cannot_connect_or_lost_its_broker() -> None:
    """Over TCP: a refused connection is logged with its reason (only
    ClientService's "Scheduling retry" was), and so is a lost one (a TLS
    handshake refused, say: the worker said only "lost; reconnecting")."""
    import socket

    from twisted.internet import protocol
    from twisted.internet import reactor as real
    from twisted.internet.endpoints import TCP4ServerEndpoint
    from twisted.logger import formatEvent

    from tests.conftest import logged_at
    from tests.procs import wait_until

    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()  # nothing listens there now: refused
    with logged_at(("info", "warn")) as events:
        worker = Worker(f"tcp:host=127.0.0.1:port={port}", "echo", lambda f: f, real,
                        heartbeat=HeartbeatPolicy(interval=10.0, liveness=3))
        worker.start()
        try:
            await wait_until(lambda: any("cannot connect to" in formatEvent(e) for e in events), 10)
            said = next(formatEvent(e) for e in events if "cannot connect to" in formatEvent(e))
            assert f"port={port}" in said and said.endswith("connection refused; trying again")
            await wait_until(lambda: sum("Scheduling retry" in formatEvent(e)
                                         for e in events) >= 3, 15)
            # once a reason, not at every retry (until interval x liveness pass)
            assert sum("cannot connect to" in formatEvent(e) for e in events) == 1
        finally:
            await worker.stop()

    class Hangup(protocol.Protocol):
        def connectionMade(self) -> None:
            self.transport.loseConnection()

    listening = await TCP4ServerEndpoint(real, 0, interface="127.0.0.1").listen(
        protocol.Factory.forProtocol(Hangup))
    with logged_at(("info", "warn")) as events:
        worker = Worker(f"tcp:host=127.0.0.1:port={listening.getHost().port}", "echo",
                        lambda f: f, real)
        worker.start()
        try:
            await wait_until(lambda: any("lost" in formatEvent(e) for e in events), 10)
            said = next(formatEvent(e) for e in events if "lost" in formatEvent(e))
            assert "closed cleanly" in said and "reconnecting" in said
        finally:
            await worker.stop()
            await listening.stopListening()
