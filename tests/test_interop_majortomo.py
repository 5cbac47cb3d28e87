"""Wire compatibility with majortomo 0.2.0 (PyPI), over real ZeroMQ sockets.

majortomo speaks its own dialect of MDP/0.2 (see :mod:`mdp.majordomo.codec`): an empty
frame before the header, worker command codes for client commands, and no
service frame in replies.  Our broker recognises it per peer and answers in
kind; our client and worker speak it when given ``dialect="majortomo"``.
"""

from __future__ import annotations

import os
from typing import Any

import majortomo  # noqa: F401  (a missing majortomo must fail, not skip)
import pytest_twisted
from twisted.internet import defer, threads

from mdp import Broker, Client, Final, HeartbeatPolicy, Worker
from tests.procs import Process, bounded, python, reactor, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "majortomo_peers.py")
HB = HeartbeatPolicy(interval=0.5, liveness=6)


def majortomo_request(endpoint: str, service: bytes, frames: list[bytes]) -> list[bytes]:
    """A blocking majortomo client call (run in a thread)."""
    from majortomo import Client as MTClient

    with MTClient(endpoint) as client:
        client.send(service, *frames)
        return client.recv_all_as_list(timeout=15)


async def our_broker() -> tuple[Broker, str]:
    broker = Broker(reactor(), heartbeat=HB)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    return broker, bound.endpoint


async def bound_endpoint(mt_broker: Process) -> str:
    """The endpoint a majortomo broker process says it bound."""
    match = await bounded(mt_broker.waitFor(r"BOUND (\S+)"), 30)
    return "zmq:" + match.group(1).decode()


@pytest_twisted.ensureDeferred
async def test_majortomo_client_through_our_broker_to_majortomo_worker() -> None:
    broker, endpoint = await our_broker()
    address = endpoint[len("zmq:"):]
    worker = Process(reactor(), python(PEERS, "worker", address, "upper"))
    try:
        await bounded(worker.waitFor("WORKER STARTED"), 30)
        reply = await bounded(threads.deferToThread(
            majortomo_request, address, b"upper", [b"one", b"two"]), 30)
        assert reply == [b"mt:one", b"mt:two"]
        # the broker registered the worker in the majortomo dialect
        (ref,) = broker.workers.values()
        assert ref.dialect == "majortomo"
    finally:
        await worker.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_our_client_through_majortomo_broker_to_our_worker() -> None:
    mt_broker = Process(reactor(), python(PEERS, "broker"))
    worker = client = None
    try:
        endpoint = await bound_endpoint(mt_broker)

        async def stream(frames: list[bytes]) -> Any:
            yield [b"partial"] + frames
            yield Final([b"final"] + frames)

        worker = Worker(endpoint, "ours", stream, reactor(), heartbeat=HB, dialect="majortomo")
        worker.start()
        client = Client(endpoint, reactor(), timeout=10, retries=1, dialect="majortomo")
        partials: list[list[bytes]] = []
        reply = await bounded(client.request("ours", b"x", onPartial=partials.append), 30)
        assert partials == [[b"partial", b"x"]]
        assert reply == [b"final", b"x"]
        for n in range(5):
            assert await bounded(client.request("ours", str(n)), 30) == [b"final", str(n).encode()]
    finally:
        if client is not None:
            await client.close()
        if worker is not None:
            await worker.stop()
        await mt_broker.stop()


@pytest_twisted.ensureDeferred
async def test_mixed_framings_on_one_broker() -> None:
    """majortomo client → our broker → our worker (RFC framing), and
    our client (RFC framing) → our broker → majortomo worker."""
    broker, endpoint = await our_broker()
    address = endpoint[len("zmq:"):]
    ours = Worker(endpoint, "ours", lambda frames: [b"ours:" + f for f in frames], reactor(),
                  heartbeat=HB)
    ours.start()
    mt_worker = Process(reactor(), python(PEERS, "worker", address, "theirs"))
    client = Client(endpoint, reactor(), timeout=15, retries=1)
    try:
        await bounded(mt_worker.waitFor("WORKER STARTED"), 30)
        reply = await bounded(threads.deferToThread(
            majortomo_request, address, b"ours", [b"a"]), 30)
        assert reply == [b"ours:a"]
        assert await bounded(client.request("theirs", b"b"), 30) == [b"mt:b"]
    finally:
        await client.close()
        await ours.stop()
        await mt_worker.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_majortomo_broker_serves_a_concurrent_worker_as_many_workers() -> None:
    mt_broker = Process(reactor(), python(PEERS, "broker"))
    worker = client = None
    try:
        endpoint = await bound_endpoint(mt_broker)
        held: list[defer.Deferred[None]] = []

        def handler(frames: list[bytes]) -> defer.Deferred[list[bytes]]:
            d: defer.Deferred[None] = defer.Deferred()
            held.append(d)
            return d.addCallback(lambda _: [b"ok"] + frames)

        worker = Worker(endpoint, "together", handler, reactor(), heartbeat=HB,
                        dialect="majortomo", concurrency=3)
        worker.start()
        client = Client(endpoint, reactor(), timeout=10, retries=1, dialect="majortomo")
        replies = [client.request("together", str(n)) for n in range(3)]
        await wait_until(lambda: len(held) == 3, 10)  # all three in hand at once
        assert worker.busy == 3
        for d in held:
            d.callback(None)
        assert [await bounded(r, 30) for r in replies] == [[b"ok", str(n).encode()]
                                                            for n in range(3)]
    finally:
        if client is not None:
            await client.close()
        if worker is not None:
            await worker.stop()
        await mt_broker.stop()


@pytest_twisted.ensureDeferred
async def test_our_extended_client_and_broker_with_a_majortomo_worker() -> None:
    """Our client and broker take deadlines and cancellation; a majortomo worker, which
    does not, never sees a context frame, and a request cancelled while it serves it is
    answered at once by the broker (the worker's late reply is dropped)."""
    broker, endpoint = await our_broker()
    address = endpoint[len("zmq:"):]
    mt_worker = Process(reactor(), python(PEERS, "worker", address, "theirs"))
    client = Client(endpoint, reactor(), timeout=15, retries=1)
    try:
        await bounded(mt_worker.waitFor("WORKER STARTED"), 30)
        assert await bounded(client.request("theirs", b"a"), 30) == [b"mt:a"]
        await wait_until(lambda: client.machine.extended is not None, 30)
        assert client.machine.extended is True
        assert await bounded(client.request("theirs", b"b"), 30) == [b"mt:b"]  # no context frame
        slow = client.request("theirs", b"slow")
        await wait_until(lambda: any(w.current is not None for w in broker.workers.values()), 30)
        (held,) = [c for c in client.machine._channels if c.call is not None]
        slow.cancel()
        await wait_until(lambda: held.call is None, 30)  # answered 499 ...
        assert any(w.current is not None for w in broker.workers.values())  # ... by the broker
        slow.addErrback(lambda f: f.trap(defer.CancelledError))
        assert await bounded(client.request("theirs", b"c"), 30) == [b"mt:c"]
    finally:
        await client.close()
        await mt_worker.stop()
        await broker.close()
