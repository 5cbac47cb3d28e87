"""Every IService starts and stops: what it binds is released, what it runs
stops (``BrokerService.stopService`` was once unreachable)."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted

from mdp import BrokerService, WorkerService
from mdp.app.service import ServerService
from tests.conftest import Net, raw_router
from tests.test_mdp_behaviour import echo, make_client


@pytest.mark.parametrize("net", ["tcp", "zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_broker_service_releases_its_endpoint_and_stops_ticking(net: Net) -> None:
    service = BrokerService(net.bindEndpoint(), reactor=net.reactor)
    await net.wait(service.startService())
    (bound,) = service.transports
    assert service.running and service.broker._ticker.running
    endpoint = bound.endpoint
    worker = WorkerService(endpoint, "echo", echo, reactor=net.reactor)
    worker.startService()
    net.addCleanup(lambda: worker.stopService() if worker.running else None)
    client = make_client(net, endpoint)
    assert await net.wait(client.request("echo", b"up")) == [b"up"]

    await net.wait(service.stopService())
    assert not service.running and not service.broker._ticker.running
    assert service.transports == [] and service.broker.bindings == []
    # the port is free again: a new service binds the very same endpoint
    again = BrokerService(endpoint, reactor=net.reactor)
    await net.wait(again.startService())
    net.addCleanup(again.stopService)
    assert again.transports[0].endpoint == endpoint


@pytest_twisted.ensureDeferred
async def test_broker_service_with_separate_frontend_and_backend(net: Net) -> None:
    service = BrokerService(net.bindEndpoint(), backend=net.bindEndpoint(), reactor=net.reactor)
    await net.wait(service.startService())
    front, back = service.transports
    worker = WorkerService(back.endpoint, "echo", echo, reactor=net.reactor)
    worker.startService()
    client = make_client(net, front.endpoint)
    assert await net.wait(client.request("echo", b"split")) == [b"split"]
    await net.wait(worker.stopService())
    assert not worker.worker._ticker.running and worker.worker.transport is None
    await net.wait(service.stopService())
    assert service.broker.bindings == []


@pytest_twisted.ensureDeferred
async def test_worker_service_registers_and_says_goodbye(net: Net) -> None:
    from mdp.majordomo import codec

    router = await raw_router(net)
    service = WorkerService(router.transport.endpoint, "echo", echo, reactor=net.reactor)
    service.startService()
    await net.until(lambda: any(f[1:] == [codec.W_READY, b"echo"] for _, _, f in router.received))
    await net.wait(service.stopService())
    await net.until(lambda: any(f[1:] == [codec.W_DISCONNECT] for _, _, f in router.received))
    assert not service.running and not service.worker._ticker.running


@pytest_twisted.ensureDeferred
async def test_freelance_server_service_releases_its_endpoint(net: Net) -> None:
    from mdp.freelance import FreelanceServer, SequentialClient

    service = ServerService(net.bindEndpoint(), FreelanceServer(echo, net.reactor))
    bound: Any = await net.wait(service.startService())
    client = SequentialClient([bound.endpoint], net.reactor, timeout=5, deadline=10)
    net.addCleanup(client.close)
    assert await net.wait(client.request(b"hi")) == [b"hi"]
    await net.wait(service.stopService())
    assert service.server.transports == []
    if net.kind != "loopback":
        again = ServerService(bound.endpoint, FreelanceServer(echo, net.reactor))
        rebound: Any = await net.wait(again.startService())
        net.addCleanup(again.stopService)
        assert rebound.endpoint == bound.endpoint
