"""Broker + worker + client behaviour, the same scenarios over every transport.

``net`` is parametrized over loopback (driven by a Clock), TCP and ZeroMQ.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import (
    Broker,
    Client,
    Final,
    HeartbeatPolicy,
    ServiceUnavailable,
    Worker,
    WorkerError,
)
from mdp.majordomo import codec
from tests.conftest import Net, RawPeer

# Fast heartbeats so that real-time expiry tests finish quickly; the margins
# (worker heartbeat gap <= 1.5 intervals, expiry 3 intervals) stay wide.
FAST = HeartbeatPolicy(interval=0.2, liveness=3)


async def start_broker(net: Net, **kwargs: Any) -> tuple[Broker, str]:
    broker = Broker(net.reactor, **kwargs)
    bound = await net.wait(broker.listen(net.bindEndpoint()))
    net.addCleanup(broker.close)
    return broker, bound.endpoint


def start_worker(net: Net, endpoint: str, service: str, handler: Any, **kwargs: Any) -> Worker:
    worker = Worker(endpoint, service, handler, net.reactor, **kwargs)
    worker.start()
    net.addCleanup(worker.stop)
    return worker


def make_client(net: Net, endpoint: str, **kwargs: Any) -> Client:
    client = Client(endpoint, net.reactor, **kwargs)
    net.addCleanup(client.close)
    return client


def echo(frames: list[bytes]) -> list[bytes]:
    return frames


@pytest_twisted.ensureDeferred
async def test_request_reply(net: Net) -> None:
    _, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint)
    reply = await net.wait(client.request("echo", b"hello", "world"))
    assert reply == [b"hello", b"world"]


@pytest_twisted.ensureDeferred
async def test_concurrent_requests_each_get_their_own_reply(net: Net) -> None:
    _, endpoint = await start_broker(net)
    for _ in range(3):
        start_worker(net, endpoint, "upper", lambda frames: [f.upper() for f in frames])
    client = make_client(net, endpoint, timeout=10)
    requests = [client.request("upper", f"req-{n}".encode()) for n in range(30)]
    replies = await net.wait(defer.gatherResults(requests))
    assert replies == [[f"REQ-{n}".encode()] for n in range(30)]


@pytest_twisted.ensureDeferred
async def test_deferred_and_coroutine_handlers(net: Net) -> None:
    _, endpoint = await start_broker(net)

    def later(frames: list[bytes]) -> defer.Deferred:
        return defer.succeed([b"deferred"] + frames)

    async def coro(frames: list[bytes]) -> bytes:
        return b"coroutine:" + frames[0]

    start_worker(net, endpoint, "later", later)
    start_worker(net, endpoint, "coro", coro)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("later", b"x")) == [b"deferred", b"x"]
    assert await net.wait(client.request("coro", b"y")) == [b"coroutine:y"]


@pytest_twisted.ensureDeferred
async def test_partial_replies_stream_before_final(net: Net) -> None:
    _, endpoint = await start_broker(net)

    async def count(frames: list[bytes]) -> Any:
        for n in range(int(frames[0])):
            yield [b"part", str(n).encode()]
        yield Final(b"done")

    start_worker(net, endpoint, "count", count)
    client = make_client(net, endpoint)
    partials: list[list[bytes]] = []
    final = await net.wait(client.request("count", b"5", onPartial=partials.append))
    assert partials == [[b"part", str(n).encode()] for n in range(5)]
    assert final == [b"done"]

    parts = []

    async def collect() -> None:
        async for part in client.stream("count", b"3"):
            parts.append(part)

    await net.wait(defer.ensureDeferred(collect()))
    assert parts == [[b"part", b"0"], [b"part", b"1"], [b"part", b"2"], [b"done"]]


@pytest_twisted.ensureDeferred
async def test_handler_exception_becomes_worker_error(net: Net) -> None:
    _, endpoint = await start_broker(net)

    def broken(frames: list[bytes]) -> None:
        raise KeyError("no such row")

    worker = start_worker(net, endpoint, "broken", broken)
    client = make_client(net, endpoint)
    with pytest.raises(WorkerError) as info:
        await net.wait(client.request("broken", b"x"))
    assert info.value.code == b"500"
    assert "KeyError" in info.value.message
    # the worker stays usable after a failing request
    assert await net.wait(client.request("broken", b"y").addErrback(lambda f: f.type)) is WorkerError
    assert worker.connected


@pytest_twisted.ensureDeferred
async def test_silent_worker_expires_and_its_request_is_requeued(net: Net) -> None:
    broker, endpoint = await start_broker(net, heartbeat=FAST)
    silent = RawPeer(net, endpoint)
    silent.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    await net.until(lambda: b"svc" in broker.services and broker.services[b"svc"].workers == 1)

    client = make_client(net, endpoint, timeout=30, retries=1)
    reply = client.request("svc", b"payload")
    # the silent worker gets the request, and never answers nor heartbeats
    await net.until(lambda: any(m[1] == codec.W_REQUEST for m in silent.received))
    start_worker(net, endpoint, "svc", lambda f: [b"served"] + f, heartbeat=FAST)
    assert await net.wait(reply) == [b"served", b"payload"]
    assert len(broker.workers) == 1  # the silent one is gone


@pytest_twisted.ensureDeferred
async def test_request_for_unknown_service_waits_for_a_worker(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    client = make_client(net, endpoint, timeout=30, retries=1)
    reply = client.request("late", b"early bird")
    await net.until(lambda: b"late" in broker.services and broker.services[b"late"].size == 1)
    start_worker(net, endpoint, "late", echo)
    assert await net.wait(reply) == [b"early bird"]


@pytest_twisted.ensureDeferred
async def test_queued_request_expires_with_service_unavailable(net: Net) -> None:
    broker, endpoint = await start_broker(net, heartbeat=FAST, requestExpiry=0.5)
    client = make_client(net, endpoint, timeout=30, retries=1)
    with pytest.raises(ServiceUnavailable) as info:
        await net.wait(client.request("nobody", b"x"))
    assert info.value.code == b"503"
    assert b"nobody" not in broker.services


@pytest_twisted.ensureDeferred
async def test_heartbeat_before_ready_gets_disconnect(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    peer = RawPeer(net, endpoint)
    peer.send(codec.WORKER_HEADER, codec.W_HEARTBEAT)
    assert await peer.nextMessage() == [codec.WORKER_HEADER, codec.W_DISCONNECT]
    assert broker.workers == {}


@pytest_twisted.ensureDeferred
async def test_second_ready_gets_disconnect_and_worker_is_removed(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    peer = RawPeer(net, endpoint)
    peer.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    await net.until(lambda: len(broker.workers) == 1)
    peer.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    assert await peer.nextMessage() == [codec.WORKER_HEADER, codec.W_DISCONNECT]
    assert broker.workers == {}


@pytest_twisted.ensureDeferred
async def test_final_from_idle_worker_gets_disconnect(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    peer = RawPeer(net, endpoint)
    peer.send(b"", codec.WORKER_HEADER, codec.W_READY, b"svc")  # majortomo dialect
    await net.until(lambda: len(broker.workers) == 1)
    peer.send(b"", codec.WORKER_HEADER, codec.W_FINAL, b"someone", b"", b"body")
    # answered in the dialect the peer used
    assert await peer.nextMessage() == [b"", codec.WORKER_HEADER, codec.W_DISCONNECT]
    assert broker.workers == {}


MALFORMED = [
    [b"garbage"],
    [b"MDPC02"],
    [b"MDPC02", b"\x01"],
    [b"MDPC02", b"\x01", b""],                    # empty service name
    [b"MDPC02", b"\x01", b"echo"],                # no body
    [b"MDPC02", b"\x01", b"ec\x07ho", b"x"],      # non-printable service
    [b"MDPC02", b"\x09", b"echo", b"x"],          # unknown command
    [b"MDPW02"],
    [b"MDPW02", b"\x01"],                         # READY without service
    [b"MDPW02", b"\x02", b"c", b"", b"x"],        # REQUEST to the broker (valid but unexpected)
    [b"MDPW02", b"\x05", b"extra"],
    [b"MDPW02", b"\x04", b"c", b"not-empty", b"x"],
    [b"MDPW02", b"\x77"],
    [b"", b""],
    [b""],
]


@pytest_twisted.ensureDeferred
async def test_malformed_messages_are_dropped_without_harming_others(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("echo", b"before")) == [b"before"]

    vandal = RawPeer(net, endpoint)
    for frames in MALFORMED:
        vandal.send(*frames)
    assert await net.wait(client.request("echo", b"after")) == [b"after"]
    # the vandal never registered as a worker or queued a request
    assert len(broker.workers) == 1
    assert set(broker.services) == {b"echo"}
    assert broker.services[b"echo"].size == 0
    # only DISCONNECTs (for the valid-but-unexpected REQUEST / HEARTBEAT) went back
    assert all(m[-1] == codec.W_DISCONNECT for m in vandal.received)


@pytest_twisted.ensureDeferred
async def test_worker_disconnect_requeues_its_request(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    quitter = RawPeer(net, endpoint)
    quitter.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=30, retries=1)
    reply = client.request("svc", b"job")
    await net.until(lambda: any(m[1] == codec.W_REQUEST for m in quitter.received))
    quitter.send(codec.WORKER_HEADER, codec.W_DISCONNECT)
    start_worker(net, endpoint, "svc", lambda f: [b"second"] + f)
    assert await net.wait(reply) == [b"second", b"job"]


@pytest.mark.parametrize("net", ["loopback", "tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_lost_connection_requeues_at_once_on_stream_transports(net: Net) -> None:
    # heartbeats far too slow to matter: only the disconnect report can help
    broker, endpoint = await start_broker(net, heartbeat=HeartbeatPolicy(60, 3))
    dying = RawPeer(net, endpoint)
    dying.send(codec.WORKER_HEADER, codec.W_READY, b"svc")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=30, retries=1)
    reply = client.request("svc", b"job")
    await net.until(lambda: any(m[1] == codec.W_REQUEST for m in dying.received))
    await net.wait(dying.transport.close())
    await net.until(lambda: len(broker.workers) == 0)
    start_worker(net, endpoint, "svc", lambda f: [b"rescued"] + f)
    assert await net.wait(reply, timeout=10) == [b"rescued", b"job"]


@pytest_twisted.ensureDeferred
async def test_workers_are_used_least_recently_used_first(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    served: list[str] = []
    for name in ("a", "b", "c"):
        start_worker(net, endpoint, "lru", lambda f, name=name: served.append(name) or [name])
    await net.until(lambda: b"lru" in broker.services and broker.services[b"lru"].workers == 3)
    client = make_client(net, endpoint)
    for _ in range(6):
        await net.wait(client.request("lru", b"x"))
    # one request at a time: each worker goes to the back of the line after serving
    assert served[:3] == served[3:]
    assert sorted(served[:3]) == ["a", "b", "c"]


@pytest_twisted.ensureDeferred
async def test_separate_frontend_and_backend(net: Net) -> None:
    broker = Broker(net.reactor)
    net.addCleanup(broker.close)
    front = await net.wait(broker.listen(net.bindEndpoint(), clients=True, workers=False))
    back = await net.wait(broker.listen(net.bindEndpoint(), clients=False, workers=True))
    start_worker(net, back.endpoint, "echo", echo)
    client = make_client(net, front.endpoint)
    assert await net.wait(client.request("echo", b"split")) == [b"split"]
    # a worker on the client-only endpoint is refused
    stray = RawPeer(net, front.endpoint)
    stray.send(codec.WORKER_HEADER, codec.W_READY, b"echo")
    await net.wait(client.request("echo", b"again"))
    assert broker.services[b"echo"].workers == 1


@pytest_twisted.ensureDeferred
async def test_client_fails_over_to_the_next_broker(net: Net) -> None:
    from tests.conftest import raw_router

    silent = await raw_router(net)  # accepts requests, never answers
    _, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, [silent.transport.endpoint, endpoint], timeout=0.5, retries=3)
    assert await net.wait(client.request("echo", b"first")) == [b"first"]
    assert len(silent.received) == 1  # tried there first, then moved on
    assert client.endpoint == endpoint
    assert await net.wait(client.request("echo", b"second")) == [b"second"]
    assert len(silent.received) == 1  # and stays on the broker that answers


@pytest_twisted.ensureDeferred
async def test_one_client_pipelines_many_requests_across_workers(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    for _ in range(4):
        start_worker(net, endpoint, "work", lambda frames: [b"done"] + frames)
    # 300 in flight from one client object, over a pool of 40 connections
    client = make_client(net, endpoint, timeout=30, retries=1, maxConnections=40)
    requests = [client.request("work", str(n)) for n in range(300)]
    replies = await net.wait(defer.gatherResults(requests))
    assert replies == [[b"done", str(n).encode()] for n in range(300)]
    assert len(client.machine._channels) <= 40
    assert broker.queued == 0


@pytest_twisted.ensureDeferred
async def test_long_stream_of_partials_arrives_whole_and_in_order(net: Net) -> None:
    _, endpoint = await start_broker(net)

    def burst(frames: list[bytes]) -> Any:
        for n in range(int(frames[0])):  # all sent in one reactor turn
            yield str(n)
        yield Final(b"end")

    start_worker(net, endpoint, "burst", burst)
    client = make_client(net, endpoint, timeout=60, retries=1)
    partials: list[list[bytes]] = []
    # more than socket buffers absorb on real sockets (a Clock's call list is
    # re-sorted on every callLater, so loopback gets a shorter burst)
    count = 3000 if net.kind == "loopback" else 20000
    final = await net.wait(client.request("burst", str(count), onPartial=partials.append), 60)
    assert final == [b"end"]
    assert partials == [[str(n).encode()] for n in range(count)]


@pytest_twisted.ensureDeferred
async def test_stream_beyond_the_send_queue_waits_instead_of_dropping(net: Net, monkeypatch: Any) -> None:
    """A handler streaming faster than the broker takes PARTIALs in is paused
    while the worker's send queue is full: none are lost.  (On ZeroMQ the
    queue's high-water mark is made tiny so that the burst overflows it.)"""
    if net.kind == "zmq":
        from mdp.transport import zeromq

        _, dealer = zeromq._connection_classes()
        monkeypatch.setattr(dealer, "highWaterMark", 20)
    _, endpoint = await start_broker(net)

    async def burst(frames: list[bytes]) -> Any:
        for n in range(int(frames[0])):
            yield [str(n).encode(), b"x" * 512]
        yield Final(b"end")

    worker = start_worker(net, endpoint, "burst", burst)
    client = make_client(net, endpoint, timeout=60, retries=1)
    partials: list[list[bytes]] = []
    count = 2000 if net.kind == "loopback" else 20000
    final = await net.wait(client.request("burst", str(count), onPartial=partials.append), 60)
    assert final == [b"end"]
    assert [p[0] for p in partials] == [str(n).encode() for n in range(count)]
    if net.kind != "loopback":  # real sockets filled up and the handler waited
        assert worker.streamPauses > 0


@pytest_twisted.ensureDeferred
async def test_zmq_broker_cuts_off_a_client_that_does_not_read(monkeypatch: Any) -> None:
    """ZeroMQ: replies a client does not read wait in its backlog, counted in
    bytes; past ``maxOutputBytes`` the broker cuts that client off (logged with
    the peer and the reason) and goes on serving everyone else."""
    import zmq
    from twisted.logger import formatEvent, globalLogPublisher

    from mdp.policy import Limits
    from mdp.transport import zeromq
    from tests.conftest import RealNet

    router, _ = zeromq._connection_classes()
    monkeypatch.setattr(router, "highWaterMark", 10)
    net = RealNet("zmq")
    try:
        broker, endpoint = await start_broker(net, limits=Limits(maxOutputBytes=256 * 1024))
        bound = broker.bindings[0].transport

        async def burst(frames: list[bytes]) -> Any:
            for _ in range(int(frames[0])):
                yield b"x" * 1024
            yield Final(b"end")

        start_worker(net, endpoint, "burst", burst)
        lines: list[str] = []

        def observe(event: dict) -> None:
            if "cut off peer" in (event.get("log_format") or ""):
                lines.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        net.addCleanup(lambda: globalLogPublisher.removeObserver(observe))
        # a client that never reads, with a tiny receive queue of its own
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.RCVHWM, 10)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"slow-client")
        raw.connect(endpoint.removeprefix("zmq:"))
        net.addCleanup(raw.close)
        raw.send_multipart([b"MDPC02", b"\x01", b"burst", b"20000"])
        await net.until(lambda: bool(lines), timeout=30)
        assert b"slow-client".hex() in lines[0] and "reads slower" in lines[0]
        assert bound.overflows == 1 and bound.backlogs == {}
        # the broker still serves others
        client = make_client(net, endpoint, timeout=10, retries=1)
        start_worker(net, endpoint, "echo", lambda frames: frames)
        assert await net.wait(client.request("echo", b"hi"), 15) == [b"hi"]
    finally:
        await net.cleanup()
