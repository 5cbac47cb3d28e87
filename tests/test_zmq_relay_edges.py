"""Relayed peers over ZeroMQ: what a relay hop must not change (one pipe's
reply over the limits, a routing id claimed under CURVE, a slow reader with
many hops, a broker that is passive when asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import defer, threads

from mdp import Broker, Client, HeartbeatPolicy, Worker
from mdp.errors import ReplyTooLarge
from mdp.majordomo import codec
from mdp.messages import relayed_peer
from mdp.policy import Limits
from mdp.transport import zmqchannels
from mdp.transport.curve import keygen
from tests.curve_router import Recorder, claim, curve_router
from tests.procs import bounded, reactor, wait_until

pytestmark = pytest.mark.timeout(60)

HB = HeartbeatPolicy(interval=0.5, liveness=6)


def _curve(tmp_path: Path) -> dict[str, str]:
    for name in ("server", "client", "worker"):
        keygen(name, str(tmp_path))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("client", "worker"):
        (allowed / f"{name}.key").write_text((tmp_path / f"{name}.key").read_text())
    return {"secret": str(tmp_path / "server.key_secret"), "allow": str(allowed),
            "public": str(tmp_path / "server.key")}


async def _one_big_reply(curve: dict[str, str] | None) -> dict[str, Any]:
    """Three slow requests in flight, the last two on relay hops; then one on a
    hop whose reply is over the client's limits; then the slow ones are let go,
    and one more slow request goes out on a pipe freed meanwhile."""
    broker = Broker(reactor(), heartbeat=HB,
                    **({} if curve is None else {"curveSecret": curve["secret"],
                                                 "curveAllow": curve["allow"]}))
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    held: list[defer.Deferred[None]] = []

    def handler(frames: list[bytes]) -> Any:
        if frames[0] == b"big":
            return [b"x" * 100_000]
        d: defer.Deferred[None] = defer.Deferred()
        held.append(d)
        return d.addCallback(lambda _: [b"reply to " + frames[0]])

    keys: dict[str, Any] = {}
    wkeys: dict[str, Any] = {}
    if curve is not None:
        keys = {"curveServerPublic": curve["public"],
                "curveSecret": curve["public"].replace("server.key", "client.key_secret")}
        wkeys = {"curveServerPublic": curve["public"],
                 "curveSecret": curve["public"].replace("server.key", "worker.key_secret")}
    worker = Worker(bound.endpoint, "svc", handler, reactor(), heartbeat=HB, concurrency=6, **wkeys)
    client = Client(bound.endpoint, reactor(), timeout=8, retries=1, maxConnections=8,
                    limits=Limits(maxMessageBytes=64 * 1024), **keys)
    outcome: dict[str, Any] = {}
    try:
        worker.start()
        await wait_until(lambda: len(broker.workers) == 6, 10)
        slow = [client.request("svc", f"s{n}") for n in range(3)]
        results: dict[int, Any] = {}
        for n, r in enumerate(slow):
            r.addBoth(lambda v, n=n: results.setdefault(n, getattr(v, "value", v)))
        await wait_until(lambda: len(held) == 3, 10)
        (link,) = client._links.values()
        assert link.state is zmqchannels.RELAYING and len(link.relayed) == 2
        big = client.request("svc", "big")
        try:
            await bounded(big, 10)
        except ReplyTooLarge:
            pass  # right: that one reply was over the client's limits
        from twisted.internet import task

        await task.deferLater(reactor(), 0.5, lambda: None)
        outcome["failedMeanwhile"] = [type(results[n]).__name__ for n in range(3) if n in results]
        later = [client.request("svc", f"later{n}") for n in range(2)]
        await task.deferLater(reactor(), 1.0, lambda: None)
        while held:
            held.pop(0).callback(None)
        await wait_until(lambda: len(results) == 3, 10)
        outcome["slow"] = [results[n] for n in range(3)]
        outcome["later"] = [await bounded(r.addErrback(lambda f: f.value), 20) for r in later]
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
    return outcome


@pytest_twisted.ensureDeferred
async def test_one_reply_over_the_limits_fails_only_its_own_request() -> None:
    outcome = await _one_big_reply(None)
    # the first slow request is on a DEALER of its own; s1 and s2 share the
    # hop's DEALER with the big one: they must not fail for its size
    assert outcome["slow"] == [[b"reply to s0"], [b"reply to s1"], [b"reply to s2"]], outcome


@pytest_twisted.ensureDeferred
async def test_under_curve_no_reply_goes_to_the_next_request_on_a_reused_pipe(
        tmp_path: Path) -> None:
    outcome = await _one_big_reply(_curve(tmp_path))
    assert outcome["later"] == [[b"reply to later0"], [b"reply to later1"]], outcome


class RelayRecorder(Recorder):
    """A router receiver that relays, keeping what its transport reported."""

    relayHeaders = frozenset({b"", codec.CLIENT_HEADER, codec.WORKER_HEADER})


@pytest_twisted.ensureDeferred
async def test_under_curve_a_claimed_id_takes_over_no_relayed_peer_of_another_key(
        tmp_path: Path) -> None:
    recorder = RelayRecorder()
    alice_peer = relayed_peer(b"conn-1", b"hop1")
    async with curve_router(tmp_path, recorder, reactor()) as (_, dealer):
        alice = dealer("alice", b"conn-1")
        alice.send_multipart([b"hop1", codec.WORKER_HEADER, b"from alice"])
        await wait_until(lambda: len(recorder.events) == 1, 10)
        alice.close()

        def mallory_spoke() -> bool:
            return any(e[0] == "message" and e[2] == b"from mallory" for e in recorder.events)

        await claim(dealer, b"conn-1",
                    lambda sock: sock.send_multipart([b"hop1", codec.WORKER_HEADER,
                                                      b"from mallory"]), mallory_spoke)
        first = next(i for i, e in enumerate(recorder.events)
                     if e[0] == "message" and e[2] == b"from mallory")
        # alice's relayed peer must be reported gone before another key speaks as it
        assert ("gone", alice_peer) in recorder.events[:first], recorder.events


def _slow_reader(address: str, hops: int) -> None:
    """In a thread: one DEALER that asks *hops* echo requests, each on a hop of
    its own, and reads nothing."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    socket.connect(address)
    body = b"y" * 4096
    for n in range(hops):
        socket.send_multipart([b"h%d" % n, codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", body])
    return socket  # (kept open by the caller)


@pytest_twisted.ensureDeferred
async def test_one_connection_cannot_make_the_broker_hold_more_than_max_output_bytes() -> None:
    limit = 256 * 1024
    broker = Broker(reactor(), heartbeat=HB, limits=Limits(maxOutputBytes=limit))
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", lambda frames: frames, reactor(), heartbeat=HB,
                    concurrency=4)
    socket = None
    try:
        worker.start()
        await wait_until(lambda: len(broker.workers) == 4, 10)
        socket = await threads.deferToThread(_slow_reader, bound.endpoint[4:], 2000)

        def held() -> int:
            return sum(b.bytes for b in bound.backlogs.values())

        await wait_until(lambda: held() > 4 * limit or broker.queued == 0 and not
                         any(w.current for w in broker.workers.values()), 30)
        # one connection, one reader: past maxOutputBytes it is cut off, as one
        # peer is; not a backlog of maxOutputBytes for each hop it names
        assert held() <= limit, (held(), len(bound.backlogs), bound.overflows)
    finally:
        if socket is not None:
            socket.close()
        await worker.stop()
        await broker.close()


class Passive:
    """A Binary Star stand-in: passive until told otherwise."""

    def __init__(self) -> None:
        self.active = False

    def admitClient(self, now: float) -> bool:
        return self.active

    def admitWorker(self, now: float) -> bool:
        return self.active

    def status(self, now: float) -> dict[str, Any]:
        return {"state": "active" if self.active else "passive", "serving": self.active}


@pytest_twisted.ensureDeferred
async def test_a_broker_passive_when_probed_relays_once_active() -> None:
    admission = Passive()
    broker = Broker(reactor(), heartbeat=HB, admission=admission)
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", lambda frames: frames, reactor(),
                    heartbeat=HeartbeatPolicy(interval=0.25, liveness=3), concurrency=3)
    try:
        worker.start()
        await wait_until(lambda: all(link.state is not zmqchannels.PROBING
                                     for link in worker.links.values()), 5)
        admission.active = True  # the pair failed over to this broker
        await wait_until(lambda: len(broker.workers) == 3, 15)
        # every session re-registered since (DISCONNECT while passive): the
        # broker relays now, so the later ones should be hops on one DEALER
        (link,) = worker.links.values()
        assert link.state is zmqchannels.RELAYING, link.state
    finally:
        await worker.stop()
        await broker.close()


def _sized_reply(address: str, service: bytes, body: int) -> list[bytes]:
    """In a thread: a raw worker of *service* answering with *body* bytes, and
    a raw client on relay hop ``HOP1``; what the client gets."""
    context = zmq.Context.instance()
    worker, client = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    try:
        for socket in (worker, client):
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        worker.send_multipart([codec.WORKER_HEADER, codec.W_READY, service])
        client.send_multipart([b"HOP1", codec.CLIENT_HEADER, codec.C_REQUEST, service, b"go"])
        if not worker.poll(10_000):
            raise TimeoutError("no request within 10 s")
        _, _, envelope, empty, _ = worker.recv_multipart()
        worker.send_multipart([codec.WORKER_HEADER, codec.W_FINAL, envelope, empty, b"r" * body])
        if not client.poll(10_000):
            raise TimeoutError("no reply within 10 s")
        return client.recv_multipart()
    finally:
        worker.close()
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_reply_that_fits_a_worker_but_not_a_relayed_client_is_refused() -> None:
    """The hop goes with the reply: a FINAL that fits the worker's link but not
    the client's (service name and hop) is a 413, as for any client."""
    broker = Broker(reactor(), heartbeat=HB, limits=Limits(maxMessageBytes=4096))
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    service = b"s" * 20  # shorter than the relayed client's envelope; with the hop, longer
    try:
        reply = await threads.deferToThread(_sized_reply, bound.endpoint[4:], service, 4068)
        assert reply[:4] == [b"HOP1", codec.CLIENT_HEADER, codec.C_FINAL, service]
        assert reply[4:6] == [b"\x00MDP-ERROR", codec.STATUS_TOO_LARGE], reply[4:6]
    finally:
        await broker.close()
