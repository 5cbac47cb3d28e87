"""Titanic's dialog over loopback with a Clock: every status code and every
malformed body (the dispatcher is tested on its own)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import pytest_twisted

from mdp.titanic import protocol
from mdp.titanic.server import TitanicServer
from mdp.titanic.store import MemoryStore
from tests.conftest import LoopbackNet
from tests.test_mdp_behaviour import make_client, start_broker


async def titanic(net: LoopbackNet, store: Any = None) -> tuple[Any, Any, Any]:
    broker, endpoint = await start_broker(net)
    store = store if store is not None else MemoryStore()
    await net.wait(store.open())
    stored: list[str] = []
    server = TitanicServer(endpoint, store, net.reactor, onStored=stored.append)
    server.start()
    net.addCleanup(server.stop)
    await net.until(lambda: len(broker.workers) == 3)
    return make_client(net, endpoint), store, stored


@pytest_twisted.ensureDeferred
async def test_request_reply_close_dialog(clocknet: LoopbackNet) -> None:
    client, store, stored = await titanic(clocknet)
    status, requestId = await clocknet.wait(client.request(protocol.REQUEST, b"echo", b"hi", b""))
    assert status == protocol.OK and str(uuid.UUID(requestId.decode())) == requestId.decode()
    assert stored == [requestId.decode()]  # the dispatcher hears of it once it is committed
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [protocol.PENDING]
    await clocknet.wait(store.complete(requestId.decode(), [b"HI", b""], clocknet.reactor.seconds()))
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [
        protocol.OK, b"HI", b""]
    assert await clocknet.wait(client.request(protocol.CLOSE, requestId)) == [protocol.OK]
    assert await clocknet.wait(client.request(protocol.CLOSE, requestId)) == [protocol.OK]
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [protocol.UNKNOWN]
    unknown = str(uuid.uuid4()).encode()
    assert await clocknet.wait(client.request(protocol.REPLY, unknown)) == [protocol.UNKNOWN]


@pytest.mark.parametrize("service, body, says", [
    (protocol.REQUEST, [b"echo"], b"needs a service name and at least one request frame"),
    (protocol.REQUEST, [b"", b"x"], b"service name of 0 bytes"),
    (protocol.REQUEST, [b"ech\xffo", b"x"], b"not printable ASCII"),
    (protocol.REQUEST, [b"titanic.request", b"x"], b"Titanic's own service"),
    (protocol.REPLY, [b"not-a-uuid"], b"is not a request id"),
    (protocol.REPLY, [b"a", b"b"], b"takes one frame"),
    (protocol.CLOSE, [b"{12345678-1234-5678-1234-567812345678}"], b"RFC 4122 text form"),
])
@pytest_twisted.ensureDeferred
async def test_malformed_bodies_get_500_saying_why(clocknet: LoopbackNet, service: bytes,
                                                   body: list[bytes], says: bytes) -> None:
    client, store, stored = await titanic(clocknet)
    reply = await clocknet.wait(client.request(service, *body))
    assert reply[0] == protocol.FAILED and says in reply[1]
    assert stored == [] and await clocknet.wait(store.pending(10)) == []


class FailingStore(MemoryStore):
    def add(self, service: bytes, frames: list[bytes], now: float) -> Any:
        from twisted.internet import defer

        return defer.fail(OSError("disk full"))


@pytest_twisted.ensureDeferred
async def test_a_request_the_store_cannot_keep_is_not_acknowledged(clocknet: LoopbackNet) -> None:
    client, _, stored = await titanic(clocknet, FailingStore())
    reply = await clocknet.wait(client.request(protocol.REQUEST, b"echo", b"x"))
    assert reply == [protocol.FAILED, b"the store failed to store: disk full"]
    assert stored == []
