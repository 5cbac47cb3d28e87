"""A worker that serves several requests at once: ``concurrency`` N registers N
MDP worker sessions from one process, each an ordinary worker to the broker."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import Broker, Client, HeartbeatPolicy, Worker
from mdp.errors import MessageTooLarge
from mdp.majordomo import codec
from mdp.metrics import WorkerMetrics
from mdp.policy import Limits
from tests.conftest import LoopbackNet, RealNet, raw_router

HB = HeartbeatPolicy(interval=1.0, liveness=3)


class Held:
    """A handler whose replies the test releases; it counts what is in hand."""

    def __init__(self) -> None:
        self.waiting: list[tuple[list[bytes], defer.Deferred[Any]]] = []
        self.most = 0

    def __call__(self, frames: list[bytes]) -> defer.Deferred[Any]:
        d: defer.Deferred[Any] = defer.Deferred()
        self.waiting.append((frames, d))
        self.most = max(self.most, len(self.waiting))
        return d

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            frames, d = self.waiting.pop(0)
            d.callback([b"done"] + frames)


async def broker_on(net: Any) -> str:
    broker = Broker(net.reactor, heartbeat=HB)
    bound = await broker.listen(net.bindEndpoint())
    net.addCleanup(broker.close)
    return bound.endpoint


def started(net: Any, endpoint: str, handler: Any, **kwargs: Any) -> Worker:
    worker = Worker(endpoint, "svc", handler, net.reactor, heartbeat=HB, **kwargs)
    worker.start()
    net.addCleanup(worker.stop)
    return worker


def client_of(net: Any, endpoint: str) -> Client:
    client = Client(endpoint, net.reactor, timeout=600, retries=1)
    net.addCleanup(client.close)
    return client


@pytest_twisted.ensureDeferred
async def test_n_requests_in_hand_at_once_and_never_more(clocknet: LoopbackNet) -> None:
    endpoint = await broker_on(clocknet)
    handler = Held()
    worker = started(clocknet, endpoint, handler, concurrency=4)
    await clocknet.until(lambda: all(s.registered for s in worker.sessions))
    client = client_of(clocknet, endpoint)
    replies = [client.request("svc", str(n)) for n in range(10)]
    await clocknet.until(lambda: len(handler.waiting) == 4)
    clocknet.advance(1.0)
    assert len(handler.waiting) == 4 and worker.busy == 4
    handler.release()
    await clocknet.until(lambda: len(handler.waiting) == 4 and replies[0].called)
    handler.release(4)
    await clocknet.until(lambda: len(handler.waiting) == 4)
    handler.release(4)
    await clocknet.until(lambda: len(handler.waiting) == 1)
    handler.release(1)
    answered = [await clocknet.wait(d) for d in replies]
    assert sorted(answered) == sorted([b"done", str(n).encode()] for n in range(10))
    assert handler.most == 4
    assert worker.concurrency == 4 and worker.busy == 0
    assert sum(s.requestsServed for s in worker.sessions) == 10


@pytest_twisted.ensureDeferred
async def test_a_slow_request_does_not_hold_up_the_others(clocknet: LoopbackNet) -> None:
    endpoint = await broker_on(clocknet)
    never: defer.Deferred[Any] = defer.Deferred()

    def handler(frames: list[bytes]) -> Any:
        return never if frames == [b"slow"] else [b"fast"] + frames

    worker = started(clocknet, endpoint, handler, concurrency=2)
    await clocknet.until(lambda: all(s.registered for s in worker.sessions))
    client = client_of(clocknet, endpoint)
    client.request("svc", "slow").addErrback(lambda _: None)
    await clocknet.until(lambda: worker.busy == 1)
    fast = [await clocknet.wait(client.request("svc", str(n)), timeout=5) for n in range(20)]
    assert fast == [[b"fast", str(n).encode()] for n in range(20)]
    assert worker.busy == 1
    never.callback([b"late"])


@pytest_twisted.ensureDeferred
async def test_each_session_is_an_ordinary_worker_to_the_broker(clocknet: LoopbackNet) -> None:
    router = await raw_router(clocknet)
    worker = started(clocknet, router.transport.endpoint, lambda f: f, concurrency=3,
                     extensions=False)
    clocknet.advance(0.1)
    readies = [(peer, f) for _, peer, f in router.received if f[1] == codec.W_READY]
    assert [f for _, f in readies] == [[codec.WORKER_HEADER, codec.W_READY, b"svc"]] * 3
    assert len({peer for peer, _ in readies}) == 3
    # a session the broker sends away registers again; the others stay and serve
    first, second = readies[0][0], readies[1][0]
    router.transport.sendMessage(first, [codec.WORKER_HEADER, codec.W_DISCONNECT])
    router.transport.sendMessage(second, [codec.WORKER_HEADER, codec.W_REQUEST, b"c", b"", b"x"])
    clocknet.advance(0.5)
    finals = [(peer, f) for _, peer, f in router.received if f[1] == codec.W_FINAL]
    assert finals == [(second, [codec.WORKER_HEADER, codec.W_FINAL, b"c", b"", b"x"])]
    clocknet.advance(2.0)
    again = [f for _, _, f in router.received if f[1] == codec.W_READY]
    assert len(again) == 4
    assert worker.sessions[0].registered or worker.sessions[0].connected


@pytest_twisted.ensureDeferred
async def test_limits_hold_per_session(clocknet: LoopbackNet) -> None:
    endpoint = await broker_on(clocknet)

    def handler(frames: list[bytes]) -> Any:
        return [b"x" * 5000] if frames == [b"big"] else frames

    worker = started(clocknet, endpoint, handler, concurrency=2,
                     limits=Limits(maxMessageBytes=1000))
    await clocknet.until(lambda: all(s.registered for s in worker.sessions))
    client = client_of(clocknet, endpoint)
    big = client.request("svc", "big")
    small = [client.request("svc", str(n)) for n in range(4)]
    with pytest.raises(MessageTooLarge, match="413"):
        await clocknet.wait(big)
    assert [await clocknet.wait(d) for d in small] == [[str(n).encode()] for n in range(4)]


@pytest_twisted.ensureDeferred
async def test_metrics_count_busy_and_registered_sessions(clocknet: LoopbackNet) -> None:
    endpoint = await broker_on(clocknet)
    handler = Held()
    metrics = WorkerMetrics()
    worker = started(clocknet, endpoint, handler, concurrency=3, metrics=metrics)
    await clocknet.until(lambda: all(s.registered for s in worker.sessions))
    client = client_of(clocknet, endpoint)
    replies = [client.request("svc", str(n)) for n in range(2)]
    await clocknet.until(lambda: len(handler.waiting) == 2)
    assert metrics.registry.get_sample_value("mdp_worker_busy", {"service": "svc"}) == 2
    assert metrics.registry.get_sample_value(
        "mdp_worker_connected", {"service": "svc", "broker": endpoint}) == 3
    handler.release(2)
    for d in replies:
        await clocknet.wait(d)
    assert metrics.registry.get_sample_value("mdp_worker_busy", {"service": "svc"}) == 0


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_over_real_sockets_stream_sessions_share_one_connection(kind: str) -> None:
    net = RealNet(kind)
    try:
        broker = Broker(net.reactor, heartbeat=HB)
        bound = await broker.listen(net.bindEndpoint())
        net.addCleanup(broker.close)
        handler = Held()
        worker = started(net, bound.endpoint, handler, concurrency=4)
        await net.until(lambda: len(broker.workers) == 4)
        assert len({s.transport for s in worker.sessions}) == 4
        if kind == "tcp":  # four channels of one connection, at the broker
            channels = bound.channels
            assert len(channels) == 4
            assert len({connection for connection, _ in channels.values()}) == 1
        client = client_of(net, bound.endpoint)
        replies = [client.request("svc", str(n)) for n in range(8)]
        await net.until(lambda: len(handler.waiting) == 4)
        handler.release(4)
        await net.until(lambda: len(handler.waiting) == 4)
        handler.release(4)
        assert [await net.wait(d) for d in replies] == [[b"done", str(n).encode()]
                                                        for n in range(8)]
    finally:
        await net.cleanup()


def test_concurrency_is_a_whole_number_of_one_or_more() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Worker("loopback:x", "svc", lambda f: f, concurrency=0)
    for bad in (1.5, "4", True):
        with pytest.raises(TypeError, match="concurrency"):
            Worker("loopback:x", "svc", lambda f: f, concurrency=bad)


@pytest_twisted.ensureDeferred
async def test_one_session_stopped_leaves_the_others_serving(clocknet: LoopbackNet) -> None:
    endpoint = await broker_on(clocknet)
    worker = started(clocknet, endpoint, lambda f: [b"ok"] + f, concurrency=3)
    await clocknet.until(lambda: all(s.registered for s in worker.sessions))
    await clocknet.wait(worker.sessions[1].stop())
    clocknet.advance(HB.interval * HB.liveness * 2)
    assert [s.registered for s in worker.sessions] == [True, False, True]
    client = client_of(clocknet, endpoint)
    assert await clocknet.wait(client.request("svc", "x")) == [b"ok", b"x"]


@pytest_twisted.ensureDeferred
async def test_a_blocked_reactor_is_counted_once_for_all_sessions(clocknet: LoopbackNet) -> None:
    router = await raw_router(clocknet)
    metrics = WorkerMetrics()

    def blocks(frames: list[bytes]) -> list[bytes]:
        clocknet.reactor.rightNow += 5.0  # the handler held the reactor for 5 s
        return frames

    started(clocknet, router.transport.endpoint, blocks, concurrency=3, metrics=metrics)
    clocknet.advance(0.1)
    peer = next(peer for _, peer, f in router.received if f[1] == codec.W_READY)
    router.transport.sendMessage(peer, [codec.WORKER_HEADER, codec.W_REQUEST, b"c", b"", b"x"])
    clocknet.advance(3.0)
    assert metrics.registry.get_sample_value("mdp_worker_reactor_blocked_total",
                                             {"service": "svc"}) == 1
