"""A message that came before a request is never taken for its reply.

MDP/0.2 replies carry no request id: a client knows its reply by the
connection it sent the request on.  A broker that answers twice, or sends a
FINAL nobody asked for, leaves a message waiting on that connection; both
clients drop what waits there before they send the next request on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import task

from mdp import Client
from mdp.blocking import Client as BlockingClient
from mdp.transport.loopback import LoopbackDealer, LoopbackNetwork, LoopbackRouter
from tests.conftest import ScriptedBroker, ScriptReply
from tests.procs import bounded, reactor, wait_until

FINAL = b"\x03"


@pytest.fixture(params=["dup", "unsolicited"])
def rogue(request: Any) -> Iterator[ScriptedBroker]:
    """A broker that answers every request with its own body, then (the
    param) once more (``dup``) or with a FINAL nobody asked for
    (``unsolicited``); ``answered`` counts the extra messages sent so far."""
    extra = None if request.param == "dup" else [b"UNSOLICITED"]

    def script(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
        return [(peer, FINAL, body), (peer, FINAL, extra or body)]

    broker = ScriptedBroker(script)
    yield broker
    broker.stop()


def _arrived(client: BlockingClient) -> None:
    """Wait (bounded) until the rogue's extra message is on the client's
    socket, or was read with the reply and dropped (no request in flight:
    the connection was replaced, so no pipe is left)."""
    pipes = list(client._loop.pipes.values())
    if not pipes:
        return
    (pipe,) = pipes
    assert pipe.socket.poll(5000, zmq.POLLIN), "the extra message never came"


def test_the_blocking_client_drops_what_came_between_requests(rogue: ScriptedBroker) -> None:
    with BlockingClient(rogue.endpoint, timeout=5.0, retries=1, extensions=False) as client:
        for n in range(5):
            # the extra message is on the socket by the time the next request
            # goes (one that comes later still is indistinguishable from a
            # reply: MDP replies carry no request id)
            assert client.request("echo", b"req%d" % n) == [b"req%d" % n]
            _arrived(client)


@pytest_twisted.ensureDeferred
async def test_the_twisted_client_drops_what_came_before_its_next_request(
        rogue: ScriptedBroker) -> None:
    client = Client(rogue.endpoint, reactor(), timeout=5.0, retries=1, extensions=False)

    def settled(n: int) -> bool:
        """The extra message after reply *n* has reached the client: it
        waits on the socket (the next request drops it) or was read and
        dropped (no request in flight: the connection was replaced)."""
        if rogue.answered <= n:
            return False
        channels = list(client.machine._channels)
        pipe = channels[0].pipe if len(channels) == 1 else None
        if pipe is None or pipe.connection is not sockets[-1]:
            return True
        return bool(pipe.connection.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    try:
        for n in range(5):
            reply = client.request("echo", b"req%d" % n)
            (channel,) = client.machine._channels
            sockets = [channel.pipe.connection]
            assert await bounded(reply, 10) == [b"req%d" % n]
            # an extra that comes after the next request went is no longer
            # stale: MDP replies carry no request id
            await wait_until(lambda n=n: settled(n), 10, 0.001)  # type: ignore[misc]
    finally:
        await bounded(client.close(), 10)


def test_a_loopback_dealer_drops_what_it_has_not_delivered() -> None:
    clock = task.Clock()
    net = LoopbackNetwork()
    got: list[list[bytes]] = []

    class Receiver:
        def connectionMade(self) -> None:
            pass

        def messageReceived(self, frames: list[bytes]) -> None:
            got.append(frames)

        def connectionLost(self, reason: object) -> None:
            pass

    class RouterReceiver:
        def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
            pass

        def peerDisconnected(self, peer: bytes) -> None:
            pass

    router = LoopbackRouter("stale", RouterReceiver(), clock, net=net)  # type: ignore[arg-type]
    dealer = LoopbackDealer("stale", Receiver(), clock, net=net)  # type: ignore[arg-type]
    clock.advance(0)
    assert dealer.peer is not None
    router.sendMessage(dealer.peer, [b"old1"])
    router.sendMessage(dealer.peer, [b"old2"])
    assert dealer.discardReceived() == 2
    assert dealer.discardReceived() == 0  # counted once
    router.sendMessage(dealer.peer, [b"new"])
    clock.advance(0)
    assert got == [[b"new"]]
