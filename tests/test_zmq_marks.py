"""A bound ZeroMQ ROUTER's send high-water mark.

A pipe holds at most ``ROUTER_SEND_WATER_MARK`` messages, small or large, so
libzmq never holds more than that many for a peer that does not read (the
rest wait in the peer's backlog, bounded in bytes:
tests/test_hostile_processes.py measures the whole).  The mark is set before
the bind and never changed: libzmq 4.3.5 passes a changed mark on to pipes
whose far end it may have freed (a crash: tests/test_zmq_router_abandoned.py).
The backlog's retries run on a Clock; the sockets are real.
"""

from __future__ import annotations

import errno
import time
from typing import Any, Iterator

import pytest
from twisted.internet.task import Clock

from mdp.transport.zeromq import ZmqRouter, zmq_factory
from mdp.transport.zmqio import ROUTER_HIGH_WATER_MARK, ROUTER_SEND_WATER_MARK
from tests.test_transport_conformance import Router

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(60)

PEER = b"slow-peer"
#: over 16 KiB (a size that once brought the mark down)
SMALL_MESSAGE_BYTES = 16 * 1024
SMALL = [b"s" * 100]
LARGE = [b"L" * (SMALL_MESSAGE_BYTES - len(PEER) + 1)]


def _bound(endpoint: str) -> Iterator[tuple[ZmqRouter, Any, Clock]]:
    clock = Clock()
    router = ZmqRouter(endpoint, Router(), clock)
    peer = zmq_factory().context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.ROUTING_ID, PEER)
    peer.connect(router.endpoint.removeprefix("zmq:"))
    # the peer is known to the ROUTER once its first message is in
    peer.send(b"hello")
    assert router.connection.socket.poll(5000)
    yield router, peer, clock
    peer.close()


@pytest.fixture
def bound() -> Iterator[tuple[ZmqRouter, Any, Clock]]:
    """(router, peer, clock): a ROUTER bound on TCP on a Clock, and a DEALER
    peer that reads only when a test says so."""
    yield from _bound("zmq:tcp://127.0.0.1:*")


def close(router: ZmqRouter, clock: Clock) -> None:
    """Close the router (its wait for libzmq to free the address is on the
    Clock: at most ``unbindTimeout`` of it)."""
    closing = router.close()
    for _ in range(int(router.unbindTimeout / 0.001) + 10):
        if closing.called:
            return
        clock.advance(0.001)
    raise AssertionError("the router did not close")


def queued(router: ZmqRouter) -> int:
    backlog = router.backlogs.get(PEER)
    return 0 if backlog is None else len(backlog)


def mark(router: ZmqRouter) -> int:
    return router.connection.socket.get(zmq.SNDHWM)


def retry(router: ZmqRouter, clock: Clock) -> None:
    """What the reactor does when the peer has read: libzmq's notice that a
    pipe drained is taken in (an EVENTS check, as doRead makes), and the
    backlog's retry runs (the pacer waits at most 50 ms)."""
    router.connection.socket.get(zmq.EVENTS)
    clock.advance(0.05)


def read(peer: Any, count: int, router: ZmqRouter, clock: Clock) -> list[list[bytes]]:
    """*count* messages the peer reads, within 10 s, the backlog retried
    meanwhile whether or not something came (as the reactor's timer does: a
    retry made before libzmq took in the reader's notice finds the pipe
    still full, and nothing may come until the next one)."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + 10.0
    while len(got) < count and time.monotonic() < deadline:
        if peer.poll(10):
            while peer.poll(0):
                got.append(peer.recv_multipart())
        retry(router, clock)
    return got


def test_the_mark_stays_what_it_was_at_the_bind(bound: Any) -> None:
    router, peer, clock = bound
    try:
        assert mark(router) == ROUTER_SEND_WATER_MARK
        router.sendMessage(PEER, SMALL)
        router.sendMessage(PEER, [b"x" * (SMALL_MESSAGE_BYTES - len(PEER))])
        router.sendMessage(PEER, LARGE)
        clock.advance(3600)
        router.sendMessage(PEER, SMALL)
        router.sendMessage(PEER, LARGE)
        assert mark(router) == ROUTER_SEND_WATER_MARK
        assert read(peer, 5, router, clock) == [
            SMALL, [b"x" * (SMALL_MESSAGE_BYTES - len(PEER))], LARGE, SMALL, LARGE]
    finally:
        close(router, clock)


@pytest.mark.parametrize("count", [1, ROUTER_SEND_WATER_MARK])
def test_a_drained_pipe_takes_a_large_message(
        bound: Any, count: int) -> None:
    router, peer, clock = bound
    try:
        for n in range(count):
            router.sendMessage(PEER, [b"%d" % n])
        assert queued(router) == 0
        assert read(peer, count, router, clock) == [[b"%d" % n] for n in range(count)]
        router.sendMessage(PEER, LARGE)
        assert mark(router) == ROUTER_SEND_WATER_MARK
        assert read(peer, 1, router, clock) == [LARGE]
        assert queued(router) == 0
    finally:
        close(router, clock)


def test_a_peer_that_does_not_read_still_gets_everything_in_order(bound: Any) -> None:
    """Small and large messages mixed, more than libzmq and the sockets
    hold: what does not fit waits in the backlog, and all of it arrives, in
    order, once the peer reads."""
    router, peer, clock = bound
    try:
        sent = [[b"%d" % n, b"x" * (SMALL_MESSAGE_BYTES if n % 3 else 0)] for n in range(3000)]
        for message in sent:
            router.sendMessage(PEER, message)
        assert queued(router) > 0
        assert read(peer, len(sent), router, clock) == sent
        assert queued(router) == 0
    finally:
        close(router, clock)


def test_inproc_keeps_the_receiving_mark() -> None:
    """On inproc a pipe's marks are the sum of both ends' (and so is the
    reading end's half): the send mark is the receiving one."""
    for router, _, clock in _bound("zmq:inproc://fixed-mark"):
        try:
            router.sendMessage(PEER, LARGE)
            assert mark(router) == ROUTER_HIGH_WATER_MARK
        finally:
            close(router, clock)


def test_a_backlog_for_a_peer_gone_counts_each_message_dropped_once(bound: Any) -> None:
    """When the peer of a backlog is found gone, every message of it is
    dropped and counted once in ``dropped`` (``undelivered_messages``)."""
    router, peer, clock = bound
    try:
        while queued(router) == 0:
            router.sendMessage(PEER, LARGE)
        for _ in range(4):
            router.sendMessage(PEER, LARGE)
        backlog = queued(router)
        assert router.dropped == 0 and backlog == 5

        def gone(frames: Any) -> None:  # what libzmq says of a peer that closed
            raise zmq.ZMQError(errno.EHOSTUNREACH)

        router.connection.send = gone
        router._flush()
        assert router.dropped == backlog and router.backlogs == {}
    finally:
        del router.connection.send
        close(router, clock)
