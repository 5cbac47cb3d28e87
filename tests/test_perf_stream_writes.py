"""The stream transport coalesces what it sends: the records sent while one
read is handled go to the socket in one system call, as do those sent within
one reactor turn outside a read; a burst larger than FLUSH_BYTES still meets
the transport's flow control as it goes."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted

from mdp import transport
from mdp.transport.stream import FLUSH_BYTES
from tests.procs import reactor, wait_until
from tests.test_transport_conformance import Dealer

TIMEOUT = 20.0


class Fanout:
    """A router receiver that answers every message with *count* replies."""

    bound: Any = None
    count = 50

    def __init__(self) -> None:
        self.peers: list[bytes] = []

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.peers.append(peer)
        for i in range(self.count):
            self.bound.sendMessage(peer, [b"reply", b"%d" % i, *frames])

    def peerDisconnected(self, peer: bytes) -> None:
        pass


def _count_calls(obj: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(obj, name)

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    setattr(obj, name, counted)
    return calls


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_replies_to_one_read_leave_in_one_send() -> None:
    router = Fanout()
    router.bound = await transport.listen("tcp:host=127.0.0.1:port=0", router, reactor())
    dealer = Dealer()
    pipe = transport.connect(router.bound.endpoint, dealer, reactor())
    try:
        await wait_until(lambda: dealer.made == 1, TIMEOUT)
        pipe.sendMessage([b"first"])
        await wait_until(lambda: len(dealer.received) == 50, TIMEOUT)
        [connection] = router.bound.connections.values()
        sends = _count_calls(connection.transport, "writeSomeData")
        writes = _count_calls(connection.transport, "write")
        pipe.sendMessage([b"second"])
        await wait_until(lambda: len(dealer.received) == 100, TIMEOUT)
        assert sends[0] == 1 and writes[0] == 0
        assert dealer.received[50:] == [[b"reply", b"%d" % i, b"second"] for i in range(50)]

        # sent outside a read: flushed once, within the reactor turn
        for i in range(30):
            router.bound.sendMessage(router.peers[0], [b"push", b"%d" % i])
        assert sends[0] == 1  # not yet
        await wait_until(lambda: len(dealer.received) == 130, TIMEOUT)
        assert sends[0] == 2
        assert dealer.received[100:] == [[b"push", b"%d" % i] for i in range(30)]
    finally:
        await pipe.close()
        await router.bound.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_dealer_reads_without_going_through_the_services_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the TCP connection and the connecting side's protocol are the
    endpoint's wrapper and ClientService's proxy, which forwards what it
    lacks through ``__getattr__`` (each lookup failing first, an
    AttributeError made): the outer one is given ``dataReceived`` itself,
    so reads skip both."""
    from twisted.application import _client_service

    looked: list[str] = []
    forward = _client_service._ReconnectingProtocolProxy.__getattr__

    def counted(self: Any, item: str) -> Any:
        looked.append(item)
        return forward(self, item)

    monkeypatch.setattr(_client_service._ReconnectingProtocolProxy, "__getattr__", counted)
    router = Fanout()
    router.count = 3
    router.bound = await transport.listen("tcp:host=127.0.0.1:port=0", router, reactor())
    dealer = Dealer()
    pipe = transport.connect(router.bound.endpoint, dealer, reactor())
    try:
        await wait_until(lambda: dealer.made == 1, TIMEOUT)
        protocol = pipe.protocol
        outer = protocol.transport.protocol
        assert isinstance(outer._wrappedProtocol, _client_service._ReconnectingProtocolProxy)
        assert outer._wrappedProtocol._protocol is protocol
        assert outer.dataReceived == protocol.dataReceived
        for i in range(5):
            pipe.sendMessage([b"%d" % i])
            await wait_until(lambda i=i: len(dealer.received) == 3 * (i + 1), TIMEOUT)
        assert "dataReceived" not in looked
        assert dealer.received[-1] == [b"reply", b"2", b"4"]
    finally:
        await pipe.close()
        await router.bound.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_dealer_burst_is_handed_over_as_it_grows_and_paced() -> None:
    """A dealer sending far more than its socket takes at once (as a
    streaming worker does) hands records over every FLUSH_BYTES, so Twisted's
    flow control pauses it (writable goes false) and drained() fires later;
    everything arrives, in order."""
    received: list[list[bytes]] = []

    class Sink:
        def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
            received.append(frames)

        def peerDisconnected(self, peer: bytes) -> None:
            pass

    bound = await transport.listen("tcp:host=127.0.0.1:port=0", Sink(), reactor())
    dealer = Dealer()
    pipe = transport.connect(bound.endpoint, dealer, reactor())
    try:
        await wait_until(lambda: dealer.made == 1, TIMEOUT)
        chunk = b"z" * 4096
        total = 16 * 1024 * 1024 // len(chunk)  # 16 MiB: more than the socket buffers hold
        paused = 0
        for i in range(total):
            pipe.sendMessage([b"%d" % i, chunk])
            if not pipe.writable:
                paused += 1
                await pipe.drained()
        assert paused > 0
        assert 16 * 1024 * 1024 > 100 * FLUSH_BYTES
        await wait_until(lambda: len(received) == total, TIMEOUT)
        assert [int(f[0]) for f in received] == list(range(total))
    finally:
        await pipe.close()
        await bound.close()


@pytest.mark.parametrize("endpoint, backlog", [
    ("tcp:host=127.0.0.1:port=0", 1024),  # a pool of 100 connections opened at once fits
    ("tcp:host=127.0.0.1:port=0:backlog=7", 7),  # the endpoint's own wins
])
@pytest_twisted.ensureDeferred
async def test_a_stream_listener_queues_a_whole_pool_of_connections(endpoint: str,
                                                                    backlog: int) -> None:
    bound = await transport.listen(endpoint, Fanout(), reactor())
    try:
        assert bound.port.backlog == backlog
    finally:
        await bound.close()
