"""Starting servers as a newcomer does: ``twistd -ny examples/application.tac``
on a port already taken, ``twist`` servers that cannot bind, the metrics
endpoint's start line, and what Titanic says when it starts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import protocol

from tests.conftest import LoopbackNet, logged_at, raw_router
from tests.procs import ENV, ROOT, Process, bounded, reactor, script, twist_broker, wait_until

pytestmark = pytest.mark.timeout(60)


class _Holder(protocol.Factory):
    """Holds a port, as another process would, and counts who connects."""

    def __init__(self) -> None:
        self.connections = 0

    def buildProtocol(self, addr: Any) -> protocol.Protocol:
        self.connections += 1
        return protocol.Protocol()


@pytest_twisted.ensureDeferred
async def test_twistd_application_whose_broker_cannot_bind_exits_1_without_its_worker(
        tmp_path: Path) -> None:
    """examples/application.tac, its port taken: the reason once, no
    "Unhandled error in Deferred", exit status 1, the worker never
    registering with whoever holds the port, and twistd's pid file gone."""
    example = (Path(ROOT) / "examples" / "application.tac").read_text()
    assert 'BrokerService("zmq:tcp://127.0.0.1:5555")' in example
    holder = _Holder()
    taken = reactor().listenTCP(0, holder, interface="127.0.0.1")
    endpoint = f"zmq:tcp://127.0.0.1:{taken.getHost().port}"
    tac = tmp_path / "application.tac"
    tac.write_text(example.replace("zmq:tcp://127.0.0.1:5555", endpoint))
    pidfile = tmp_path / "twistd.pid"
    proc = None
    try:
        proc = Process(reactor(), [script("twistd"), "-n", "--pidfile", str(pidfile),
                                   "-y", str(tac)], ENV)
        # (a process that runs on has its worker say READY)
        await wait_until(lambda: not proc.running or b"sent READY" in proc.output, 30)
    finally:
        if proc is not None:
            await proc.stop()
        await taken.stopListening()
    assert proc.exitCode == 1, proc.output
    assert proc.output.count(b"MDP broker cannot listen") == 1, proc.output
    assert re.search(rb"MDP broker cannot listen: .*" + re.escape(endpoint.encode())
                     + rb".*Address already in use", proc.output), proc.output
    for noise in (b"Unhandled error", b"Traceback", b"sent READY"):
        assert noise not in proc.output, proc.output
    assert holder.connections == 0
    assert not pidfile.exists()


@pytest.mark.parametrize("args, says", [
    (["mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:{port}"], b"MDP broker cannot listen"),
    (["mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*",
      "--metrics", "tcp:{port}:interface=127.0.0.1"], b"cannot serve metrics on"),
    (["mdp-freelance-server", "--endpoint", "zmq:tcp://127.0.0.1:{port}"],
     b"Freelance server cannot listen"),
    (["sp-rep", "--endpoint", "tcp://127.0.0.1:{port}"], b"SP REP server cannot listen"),
    (["sp-device", "--front", "tcp://127.0.0.1:{port}", "--back", "tcp://127.0.0.1:{port}"],
     b"SP device cannot listen"),
])
@pytest_twisted.ensureDeferred
async def test_twist_server_that_cannot_bind_exits_before_starting_the_reactor(
        args: list[str], says: bytes) -> None:
    """The reason once, exit status 1, and no "Starting reactor..." after
    it (which read as if the server went on)."""
    taken = reactor().listenTCP(0, _Holder(), interface="127.0.0.1")
    port = taken.getHost().port
    proc = Process(reactor(), [script("twist"), "--log-format", "text",
                               *[a.format(port=port) for a in args]], ENV)
    try:
        await proc.ended(50)
    finally:
        await proc.stop()
        await taken.stopListening()
    assert proc.exitCode == 1, proc.output
    assert proc.output.count(says) == 1, proc.output
    assert f"127.0.0.1:{port}".encode() in proc.output
    assert b"Address already in use" in proc.output
    for noise in (b"Starting reactor", b"Unhandled error", b"Traceback"):
        assert noise not in proc.output, proc.output


@pytest_twisted.ensureDeferred
async def test_the_metrics_endpoint_is_logged_once_with_its_address() -> None:
    proc = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                               "--endpoint", "zmq:tcp://127.0.0.1:*",
                               "--metrics", "tcp:0:interface=127.0.0.1"], ENV)
    try:
        # the services start before the reactor: their lines are all in by then
        await bounded(proc.waitFor("Starting reactor", timeout=50), 50)
    finally:
        await proc.stop()
    assert len(re.findall(rb"metrics at http://127\.0\.0\.1:\d+/metrics", proc.output)) == 1, \
        proc.output
    assert b"starting on" not in proc.output, proc.output


@pytest_twisted.ensureDeferred
async def test_titanic_says_once_what_it_serves() -> None:
    broker, endpoint = await twist_broker(reactor(), "zmq:tcp://127.0.0.1:*")
    titanic = None
    try:
        titanic = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-titanic",
                                      "--broker", endpoint, "--db", ":memory:"], ENV)
        await bounded(titanic.waitFor("Titanic started", timeout=50), 50)
        # all twelve workers (four per service) have registered
        await wait_until(lambda: broker.output.count(b"ready for titanic.") == 12, 30)
    finally:
        if titanic is not None:
            await titanic.stop()
        await broker.stop()
    started = (f"Titanic started: services titanic.request, titanic.reply, titanic.close "
               f"(4 workers each) via {endpoint}").encode()
    assert titanic.output.count(started) == 1, titanic.output
    assert b"sent READY" not in titanic.output, titanic.output


@pytest_twisted.ensureDeferred
async def test_titanic_workers_ready_is_debug_and_other_workers_stay_info() -> None:
    from mdp import Worker
    from mdp.handlers import echo
    from mdp.titanic import MemoryStore, TitanicServer

    net = LoopbackNet()
    router = await raw_router(net)
    server = TitanicServer(router.transport.endpoint, MemoryStore(), net.reactor, workers=2)
    worker = Worker(router.transport.endpoint, "echo", echo, net.reactor)
    try:
        with logged_at(("debug", "info")) as events:
            server.start()
            worker.start()
            await net.until(lambda: sum(f[:2] == [b"MDPW02", b"\x01"] for _, _, f in router.received) == 7)
    finally:
        await net.wait(server.stop())
        await net.wait(worker.stop())
        await net.cleanup()
    ready = [(event["service"], event["log_level"].name) for event in events
             if "sent READY" in event.get("log_format", "")]
    assert sorted(ready) == [("echo", "info")] + [
        (service, "debug") for service in ("titanic.close", "titanic.reply", "titanic.request")
        for _ in range(2)]
