"""The ZeroMQ read path under bursts: after a busy read the transport reads
until a recv finds nothing instead of asking EVENTS before every message; no
message is lost or reordered, and a lone message after a burst (its FD
signalled once) still arrives."""

from __future__ import annotations

import itertools

import pytest
import pytest_twisted

from mdp import transport
from tests.procs import reactor, wait_until
from tests.test_transport_conformance import Dealer, Router

_names = itertools.count()
TIMEOUT = 20.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["inproc", "tcp"])
@pytest_twisted.ensureDeferred
async def test_bursts_then_lone_messages_arrive_in_order(scheme: str) -> None:
    address = (f"inproc://burst-{next(_names)}" if scheme == "inproc" else "tcp://127.0.0.1:*")
    router = Router()
    bound = await transport.listen(f"zmq:{address}", router, reactor())
    dealer = Dealer()
    pipe = transport.connect(bound.endpoint, dealer, reactor())
    try:
        await wait_until(lambda: dealer.made == 1, TIMEOUT)
        pipe.sendMessage([b"hello"])
        await wait_until(lambda: len(router.received) == 1, TIMEOUT)
        peer = router.received[0][0]
        expected: list[list[bytes]] = []
        for round_ in range(3):
            burst = [[b"burst", b"%d" % round_, b"%d" % i] for i in range(500)]
            for frames in burst:
                bound.sendMessage(peer, frames)
            expected += burst
            await wait_until(lambda n=len(expected): len(dealer.received) == n, TIMEOUT)
            for i in range(3):  # one at a time, each waited for
                lone = [b"lone", b"%d" % round_, b"%d" % i]
                bound.sendMessage(peer, lone)
                expected.append(lone)
                await wait_until(lambda n=len(expected): len(dealer.received) == n, TIMEOUT)
        assert dealer.received == expected
        # and the other way, into the router
        for i in range(500):
            pipe.sendMessage([b"up", b"%d" % i])
        await wait_until(lambda: len(router.received) == 501, TIMEOUT)
        assert [f for _, f in router.received[1:]] == [[b"up", b"%d" % i] for i in range(500)]
    finally:
        await pipe.close()
        await bound.close()
