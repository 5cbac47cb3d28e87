"""Relayed peers over ZeroMQ (docs/mdp.md, "Relayed peers"): the broker takes
a first frame that is not an MDP header for a relay hop and the peer behind it
for a peer of its own; our client and a worker of several sessions put their
pipes on one DEALER that way once the broker answers the probe, and go a
DEALER each where it does not (majortomo's broker)."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import defer, threads

from mdp import Broker, Client, HeartbeatPolicy, Worker
from mdp.majordomo import codec
from mdp.messages import RELAYED, envelope, is_relayed, relayed_peer, routing_id
from mdp.transport import zmqchannels
from tests.procs import Process, bounded, python, reactor, wait_until
from tests.test_interop_majortomo import PEERS, bound_endpoint

pytestmark = pytest.mark.timeout(60)

HB = HeartbeatPolicy(interval=0.5, liveness=6)


def test_a_relayed_peer_key_round_trips_to_its_envelope() -> None:
    key = relayed_peer(b"\x00k\x8bEh", b"hopC")
    assert key.startswith(RELAYED) and is_relayed(key)
    assert routing_id(key) == b"\x00k\x8bEh"
    assert envelope(key, [b"MDPC02", b"\x03"]) == [b"\x00k\x8bEh", b"hopC", b"MDPC02", b"\x03"]
    # routing ids libzmq makes are five bytes, however they begin; a peer's own never begin with 0
    assert not is_relayed(b"\x00\x00\x00\x01\x02")
    assert envelope(b"\x00\x00\x00\x01\x02", [b"x"]) == [b"\x00\x00\x00\x01\x02", b"x"]
    assert routing_id(b"worker-1") == b"worker-1"


def _raw_peers(address: str) -> dict[str, list[list[bytes]]]:
    """In a thread: a worker and a client, each a raw DEALER speaking through
    relay hops, and a plain RFC client beside them."""
    context = zmq.Context.instance()
    sockets = []

    def dealer() -> Any:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        sockets.append(socket)
        return socket

    def receive(socket: Any) -> list[bytes]:
        if not socket.poll(10_000):
            raise TimeoutError("no answer within 10 s")
        return socket.recv_multipart()

    try:
        worker, client, plain = dealer(), dealer(), dealer()
        worker.send_multipart([b"w1", codec.WORKER_HEADER, codec.W_READY, b"echo"])
        # (the READY first: the broker queues requests for a service it does not know yet)
        plain.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"echo"])
        assert receive(plain)[-1] == b"200"
        client.send_multipart([b"hopA", codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", b"a"])
        client.send_multipart([b"hopB", codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", b"b"])
        plain.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", b"c"])
        requests = []
        for _ in range(3):
            hop, header, command, address_, empty, *body = receive(worker)
            assert (hop, header, command, empty) == (b"w1", codec.WORKER_HEADER, codec.W_REQUEST, b"")
            requests.append(body)
            worker.send_multipart([b"w1", codec.WORKER_HEADER, codec.W_FINAL, address_, b"",
                                   b"echo:" + body[0]])
        return {"requests": requests, "client": [receive(client), receive(client)],
                "plain": [receive(plain)]}
    finally:
        for socket in sockets:
            socket.close()


@pytest_twisted.ensureDeferred
async def test_the_broker_serves_peers_behind_relay_hops_and_answers_on_their_hop() -> None:
    broker = Broker(reactor(), heartbeat=HB)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    try:
        seen = await bounded(threads.deferToThread(_raw_peers, bound.endpoint[4:]), 30)
        assert sorted(body[0] for body in seen["requests"]) == [b"a", b"b", b"c"]
        assert sorted(seen["client"]) == [
            [b"hopA", codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"echo:a"],
            [b"hopB", codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"echo:b"]]
        assert seen["plain"] == [[codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"echo:c"]]
        (worker,) = broker.workers.values()
        assert is_relayed(worker.key[1]) and worker.key[1].endswith(b"w1")
    finally:
        await broker.close()


def _posing(address: str) -> bool:
    """In a thread: a DEALER whose routing id looks like a relayed peer's asks
    ``mmi.service``; whether it was answered within a second."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTING_ID, relayed_peer(b"victim", b"hop1"))
    socket.connect(address)
    try:
        socket.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"echo"])
        return bool(socket.poll(1000))
    finally:
        socket.close()


@pytest_twisted.ensureDeferred
async def test_a_routing_id_posing_as_a_relayed_peer_is_dropped() -> None:
    broker = Broker(reactor(), heartbeat=HB)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    try:
        assert not await bounded(threads.deferToThread(_posing, bound.endpoint[4:]), 20)
        assert bound.hostileIds == 1
    finally:
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_a_client_and_a_concurrent_worker_share_one_socket_each() -> None:
    broker = Broker(reactor(), heartbeat=HB)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    held: list[defer.Deferred[None]] = []

    def handler(frames: list[bytes]) -> defer.Deferred[list[bytes]]:
        d: defer.Deferred[None] = defer.Deferred()
        held.append(d)
        return d.addCallback(lambda _: [b"ok", *frames])

    worker = Worker(bound.endpoint, "slow", handler, reactor(), heartbeat=HB, concurrency=4)
    client = Client(bound.endpoint, reactor(), timeout=20, retries=1, maxConnections=8)
    try:
        worker.start()
        await wait_until(lambda: len(broker.workers) == 4, 10)
        replies = [client.request("slow", str(n)) for n in range(8)]
        await wait_until(lambda: len(held) == 4, 10)  # four at once, never five
        assert worker.busy == 4
        while held:
            held.pop(0).callback(None)
            await wait_until(lambda: held or all(r.called for r in replies), 10)
        assert [await bounded(r, 20) for r in replies] == [[b"ok", str(n).encode()]
                                                            for n in range(8)]
        # after the probe's answer: the worker's later sessions and the client's
        # later pipes are relay hops on one DEALER each
        links = [*worker.links.values(), *client._links.values()]
        assert [link.state for link in links] == [zmqchannels.RELAYING] * 2
        relayed = [ref.key[1] for ref in broker.workers.values() if is_relayed(ref.key[1])]
        assert len(relayed) == 3
        assert len({routing_id(peer) for peer in relayed}) == 1
    finally:
        await client.close()
        await worker.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_against_majortomo_each_pipe_is_a_dealer_of_its_own() -> None:
    mt_broker = Process(reactor(), python(PEERS, "broker"))
    worker = client = None
    try:
        endpoint = await bound_endpoint(mt_broker)
        worker = Worker(endpoint, "up", lambda frames: [f.upper() for f in frames], reactor(),
                        heartbeat=HB, dialect="majortomo", concurrency=2)
        worker.start()
        client = Client(endpoint, reactor(), timeout=10, retries=1, dialect="majortomo",
                        maxConnections=4)
        replies = await bounded(defer.gatherResults(
            [client.request("up", f"x{n}") for n in range(8)]), 20)
        assert replies == [[f"X{n}".encode()] for n in range(8)]
        links = [*worker.links.values(), *client._links.values()]
        assert [link.state for link in links] == [zmqchannels.UNANSWERED] * 2
        assert all(not link.relayed for link in links)
    finally:
        if client is not None:
            await client.close()
        if worker is not None:
            await worker.stop()
        await mt_broker.stop()
