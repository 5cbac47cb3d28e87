"""Fuzzing the state machines with random and mutated frame lists (hypothesis),
on the loopback transport with a Clock.

Properties: no exception escapes or is logged as a failure; a well-behaved
client and worker running alongside keep being served; the broker's tables
stay within their bounds.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task

from mdp import Broker, Client, HeartbeatPolicy, Worker, transport
from mdp.majordomo import codec
from tests.conftest import RawRouter, failures_logged
from tests.test_broker import check_counts

_names = itertools.count()

VALID = [
    [b"MDPW02", b"\x01", b"echo"],
    [b"MDPW02", b"\x01", b"fuzzed"],
    [b"MDPW02", b"\x02", b"client", b"", b"body"],
    [b"MDPW02", b"\x03", b"client", b"", b"part"],
    [b"MDPW02", b"\x04", b"client", b"", b"final"],
    [b"MDPW02", b"\x05"],
    [b"MDPW02", b"\x06"],
    [b"MDPC02", b"\x01", b"echo", b"x"],
    [b"MDPC02", b"\x01", b"fuzzed", b"x"],
    [b"MDPC02", b"\x01", b"mmi.service", b"echo"],
    [b"MDPC02", b"\x01", b"mmi.workers", b""],
    [b"MDPC02", b"\x02", b"echo", b"p"],
    [b"MDPC02", b"\x03", b"echo", b"f"],
    [b"MDPC02", b"\x03", b"svc", b"f"],
]


@st.composite
def mutated(draw: Any) -> list[bytes]:
    """A valid message with a few random edits."""
    frames = list(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(["drop", "replace", "insert", "delimit", "truncate"]))
        index = draw(st.integers(0, max(len(frames) - 1, 0)))
        if edit == "drop" and frames:
            del frames[index]
        elif edit == "replace" and frames:
            frames[index] = draw(st.binary(max_size=8))
        elif edit == "insert":
            frames.insert(index, draw(st.binary(max_size=8)))
        elif edit == "delimit":
            frames.insert(0, b"")
        elif edit == "truncate" and frames:
            frames[index] = frames[index][: draw(st.integers(0, 3))]
    return frames


messages = st.one_of(mutated(), st.lists(st.binary(max_size=10), max_size=6))
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def result_of(d: defer.Deferred) -> list[Any]:
    box: list[Any] = []
    d.addBoth(box.append)
    return box


class FuzzPeer:
    """A dealer that only sends."""

    def __init__(self, endpoint: str, clock: task.Clock) -> None:
        self.transport = transport.connect(endpoint, self, clock)

    def connectionMade(self) -> None:
        pass

    def connectionLost(self, reason: object) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        pass


@given(st.lists(st.tuples(st.integers(0, 2), messages), max_size=40))
@FUZZ
def test_broker_survives_fuzzing_and_keeps_serving(script: list[tuple[int, list[bytes]]]) -> None:
    clock = task.Clock()
    name = f"loopback:fuzz-broker-{next(_names)}"
    broker = Broker(clock, heartbeat=HeartbeatPolicy(1.0, 3), requestExpiry=5.0,
                    serviceLinger=2.0, maxQueue=20, maxServiceQueue=10, maxWorkers=5)
    with failures_logged() as failures:
        broker.listen(name)
        worker = Worker(name, "echo", lambda f: f, clock, heartbeat=HeartbeatPolicy(1.0, 3))
        worker.start()
        client = Client(name, clock, timeout=30, retries=1)
        peers = [FuzzPeer(name, clock) for _ in range(3)]
        clock.advance(0)
        for index, frames in script:
            peers[index].transport.sendMessage(frames)
            clock.advance(0)
            assert len(broker.workers) <= broker.maxWorkers
            assert broker.queued <= broker.maxQueue
            check_counts(broker)
        clock.advance(0.5)
        reply = result_of(client.request("echo", b"still here"))
        for _ in range(200):
            if reply:
                break
            clock.advance(0.1)
        assert reply == [[b"still here"]]
        for _ in range(200):  # 20 s, tick by tick: what the fuzzers left behind expires
            clock.advance(0.1)
        check_counts(broker)
        assert broker.queued == 0
        assert set(broker.services) <= {b"echo"}
        for peer in peers:
            peer.transport.close()
        client.close()
        worker.stop()
        broker.close()
        clock.advance(0)
    assert failures == []


def loopback_router(clock: task.Clock, name: str) -> RawRouter:
    """A scripted broker bound on a fresh loopback name, driven by *clock*."""
    router = RawRouter()
    router.clock = clock
    router.transport = transport.listen(f"loopback:{name}-{next(_names)}", router, clock).result
    return router


@given(st.lists(messages, max_size=30))
@FUZZ
def test_worker_survives_fuzzing_from_its_broker(script: list[list[bytes]]) -> None:
    clock = task.Clock()
    router = loopback_router(clock, "fuzz-worker")
    worker = Worker(router.transport.endpoint, "echo", lambda f: f, clock,
                    heartbeat=HeartbeatPolicy(1.0, 3))
    with failures_logged() as failures:
        worker.start()
        clock.advance(0)
        ready = [codec.WORKER_HEADER, codec.W_READY, b"echo"]

        def newest() -> bytes:
            return [p for _, p, f in router.received if f == ready][-1]

        for frames in script:
            router.send(newest(), *frames)
            clock.advance(0)
        for _ in range(400):  # DISCONNECTs in a row make it back off (1 s, 2 s, ...)
            if worker.connected:
                break
            clock.advance(0.1)
        # whatever happened, the worker is registered on its newest connection and serves
        peer = newest()
        before = len(router.received)
        router.send(peer, codec.WORKER_HEADER, codec.W_REQUEST, b"me", b"", b"ping")
        clock.advance(0)
        assert [codec.WORKER_HEADER, codec.W_FINAL, b"me", b"", b"ping"] in [
            f for _, p, f in router.received[before:] if p == peer
        ]
        worker.stop()
        router.transport.close()
        clock.advance(0)
    assert failures == []


@given(st.lists(messages, max_size=30))
@FUZZ
def test_client_survives_fuzzing_from_its_broker(script: list[list[bytes]]) -> None:
    clock = task.Clock()
    router = loopback_router(clock, "fuzz-client")
    client = Client(router.transport.endpoint, clock, timeout=30, retries=1)
    with failures_logged() as failures:
        reply = result_of(client.request("svc", b"q"))
        clock.advance(0)
        ((_, peer, _),) = router.received
        expected = None
        for frames in script:
            router.send(peer, *frames)
            if expected is None:
                try:
                    command = codec.decode(codec.expect(frames, codec.RFC))
                except codec.ProtocolError:
                    command = None
                if isinstance(command, codec.ClientFinal) and command.service == b"svc":
                    expected = list(command.body)
        router.send(peer, codec.CLIENT_HEADER, codec.C_FINAL, b"svc", b"answer")
        clock.advance(0)
        assert reply == [expected or [b"answer"]]
        client.close()
        router.transport.close()
        clock.advance(0)
    assert failures == []
