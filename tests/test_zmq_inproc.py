"""``zmq:inproc://`` with the connecting side first.

libzmq lets an inproc DEALER connect before anything binds the address: the
pipe waits, holding what is sent, and the bind attaches it.  It does so inside
the bind call without signalling the bound socket's FD, so a ROUTER that only
reads when its FD says so would never hear that peer, not even messages sent
long after the bind.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import pytest_twisted

from mdp import transport
from tests.procs import reactor, wait_until
from tests.test_transport_conformance import Dealer, PeerReceiver, Router

_names = itertools.count()

TIMEOUT = 10.0


def _endpoint() -> str:
    return f"zmq:inproc://connect-first-{next(_names)}"


class Replying(Router):
    """A router receiver that answers every message with STATE."""

    bound: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        super().messageReceived(peer, frames)
        self.bound.sendMessage(peer, [b"STATE", *frames])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sendFirst", [True, False], ids=["sent-before-bind", "nothing-before-bind"])
@pytest_twisted.ensureDeferred
async def test_a_dealer_connected_before_the_bind_is_heard(sendFirst: bool) -> None:
    endpoint = _endpoint()
    dealer = Dealer()
    router = Replying()
    pipe = transport.connect(endpoint, dealer, reactor())
    try:
        await wait_until(lambda: dealer.made == 1, TIMEOUT)
        sent = []
        if sendFirst:
            pipe.sendMessage([b"SUB1"])
            sent.append([b"SUB1"])
        router.bound = await transport.listen(endpoint, router, reactor())
        try:
            for i in range(2, 7):
                pipe.sendMessage([b"SUB%d" % i])
                sent.append([b"SUB%d" % i])
                # one at a time: each must get through on its own, not only
                # when a later send happens to wake the router
                await wait_until(lambda: len(dealer.received) == len(sent), TIMEOUT)
            assert [frames for _, frames in router.received] == sent
            assert dealer.received == [[b"STATE", *frames] for frames in sent]
            assert dealer.lost == []
        finally:
            await router.bound.close()
    finally:
        await pipe.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_connecting_router_connected_before_the_bind_is_heard() -> None:
    endpoint = _endpoint()
    receiver = PeerReceiver()
    peers = transport.connect_peers(receiver, reactor())
    router = Replying()
    try:
        peers.connect(endpoint)
        # the pipe of an inproc connect exists at once: this waits in it
        peers.sendMessage(endpoint, [b"PING"])
        router.bound = await transport.listen(endpoint, router, reactor())
        try:
            await wait_until(lambda: bool(router.received), TIMEOUT)
            assert router.received[0][1] == [b"PING"]
            await wait_until(lambda: bool(receiver.received), TIMEOUT)
            assert receiver.received[0] == (endpoint, [b"STATE", b"PING"])
            count = len(router.received)
            peers.sendMessage(endpoint, [b"AGAIN"])
            await wait_until(lambda: len(router.received) > count, TIMEOUT)
            assert router.received[-1][1] == [b"AGAIN"]
        finally:
            await router.bound.close()
    finally:
        await peers.close()
