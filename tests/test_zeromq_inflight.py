"""A ZeroMQ DEALER bounds in bytes what it has handed libzmq and libzmq has
not sent (:class:`~mdp.transport.dealercore.DealerCore`): past
``limits.maxOutputBytes`` it is not writable, and ``drained()`` fires once
half of that is on the wire.  Real sockets; the polls run on a Clock."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
from twisted.internet.task import Clock

from mdp.policy import Limits
from mdp.transport.zeromq import ZmqDealer, zmq_factory
from tests.test_transport_conformance import Dealer

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(60)

BOUND = 1024 * 1024
PART = [b"p" * 16 * 1024]


@pytest.fixture
def pair() -> Iterator[tuple[ZmqDealer, Any, Clock]]:
    """(dealer, router, clock): a DEALER on a Clock, connected to a ROUTER
    that reads only when a test says so (small buffers: little in the kernel)."""
    clock = Clock()
    router = zmq_factory().context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 2)
    router.setsockopt(zmq.RCVBUF, 16 * 1024)
    router.bind("tcp://127.0.0.1:*")
    dealer = ZmqDealer("zmq:" + router.getsockopt(zmq.LAST_ENDPOINT).decode(), Dealer(), clock,
                       limits=Limits(maxOutputBytes=BOUND))
    dealer.connection.socket.setsockopt(zmq.SNDBUF, 16 * 1024)
    yield dealer, router, clock
    dealer.close()
    router.close()


def _wait(predicate: Any, clock: Clock, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)
        clock.advance(0.05)


def test_not_writable_past_the_bound_until_half_of_it_drains(
        pair: tuple[ZmqDealer, Any, Clock]) -> None:
    dealer, router, clock = pair
    sent = 0
    while dealer.writable:
        dealer.sendMessage(PART)
        sent += 1
        assert sent * len(PART[0]) < 8 * BOUND, "never paused"
    # libzmq let go of some at once: what it may still hold passed the bound
    assert dealer.core.held() > BOUND
    assert not dealer.core.backlog  # paused before libzmq refused anything
    drained = dealer.drained()
    clock.advance(0.05)
    assert not drained.called
    taken = 0

    def read() -> bool:
        nonlocal taken
        while router.poll(0):
            router.recv_multipart()
            taken += 1
        return drained.called

    _wait(read, clock)
    assert dealer.core.held() <= BOUND // 2 and dealer.writable
    _wait(lambda: read() and taken == sent, clock)


def test_a_lost_socket_wakes_the_waiters(pair: tuple[ZmqDealer, Any, Clock]) -> None:
    dealer, _, _ = pair
    while dealer.writable:
        dealer.sendMessage(PART)
    drained = dealer.drained()
    dealer.close()
    assert drained.called


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_messages_ending_in_any_buffer_are_let_go_of(
        pair: tuple[ZmqDealer, Any, Clock], kind: Any) -> None:
    """A last frame that is not ``bytes`` is tracked too: the dealer is
    writable again once the peer has read (it used to stay paused for good)."""
    dealer, router, clock = pair
    part = [b"head", kind(b"p" * 16 * 1024)]
    sent = 0
    while dealer.writable:
        dealer.sendMessage(part)
        sent += 1
        assert sent * 16 * 1024 < 8 * BOUND, "never paused"
    drained = dealer.drained()
    taken = 0

    def read() -> bool:
        nonlocal taken
        while router.poll(0):
            assert router.recv_multipart()[1:] == [b"head", b"p" * 16 * 1024]
            taken += 1
        return drained.called

    _wait(lambda: read() and taken == sent, clock)
    assert dealer.writable and dealer.core.held() <= BOUND // 2
