"""The installed entry points, as separate processes over real sockets:
``twist mdp-broker``, ``twist mdp-worker`` and ``mdp call`` / ``mdp demo``."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import pytest_twisted

from tests.procs import ENV, Process, finished, script, twist_broker, twist_worker


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


async def run(args: list[str], timeout: float = 60) -> Process:
    """Run a command to completion and return it (output, exit code)."""
    return await finished(args, timeout=timeout)


async def start_broker(endpoint: str) -> tuple[Process, str]:
    return await twist_broker(reactor(), endpoint, "--heartbeat", "0.5")


@pytest.mark.parametrize("bind", ["zmq:tcp://127.0.0.1:*", "tcp:host=127.0.0.1:port=0"])
@pytest_twisted.ensureDeferred
async def test_twist_broker_worker_and_mdp_call(bind: str) -> None:
    broker, endpoint = await start_broker(bind)
    workers = []
    try:
        for service, handler in (("echo", "echo"), ("upper", "tests.handlers_for_tests:upper")):
            worker = twist_worker(reactor(), endpoint, service, handler, "--heartbeat", "0.5")
            workers.append(worker)
            await worker.waitFor("sent READY", timeout=60)

        call = await run([script("mdp"), "call", "--broker", endpoint, "--timeout", "10",
                          "echo", "hello", "world"])
        assert call.exitCode == 0, call.output
        assert call.output.decode().splitlines() == ["hello", "world"]

        call = await run([script("mdp"), "call", "--broker", endpoint, "--timeout", "10",
                          "upper", "shout"])
        assert call.exitCode == 0, call.output
        assert call.output.decode().splitlines() == ["SHOUT"]
    finally:
        for worker in workers:
            await worker.stop()
        await broker.stop()
    # SIGTERM shuts down cleanly: twist ends by the signal it stopped for, on
    # any reactor (only the epoll reactor logs "Main loop terminated.")
    assert b"Received SIGTERM, shutting down." in broker.output, broker.output
    assert broker.signal == signal.SIGTERM, (broker.exitCode, broker.signal, broker.output)


@pytest_twisted.ensureDeferred
async def test_mdp_call_times_out_with_a_clear_message() -> None:
    broker, endpoint = await start_broker("zmq:tcp://127.0.0.1:*")
    try:
        call = await run([script("mdp"), "call", "--broker", endpoint, "--timeout", "0.5",
                          "--retries", "2", "nobody-serves-this", "x"])
    finally:
        await broker.stop()
    assert call.exitCode == 1
    # it names the broker and what was tried
    assert f"no reply from broker at {endpoint} after 2 attempts (1.0 s)".encode() in call.output
    assert b"nobody-serves-this" in call.output


@pytest_twisted.ensureDeferred
async def test_mdp_call_usage_error() -> None:
    call = await run([script("mdp"), "call", "echo"])
    assert call.exitCode == 2
    assert b"at least one request frame" in call.output


@pytest_twisted.ensureDeferred
async def test_mdp_call_rejects_an_unknown_dialect_in_one_line() -> None:
    call = await run([script("mdp"), "call", "--dialect", "bogus", "echo", "x"], timeout=30)
    assert call.exitCode == 2, call.output
    lines = call.output.strip().splitlines()
    assert len(lines) == 1, call.output
    assert lines[0].startswith(b"mdp call: ") and b"unknown MDP dialect 'bogus'" in lines[0]
    assert b"Traceback" not in call.output


@pytest.mark.parametrize("endpoint, says", [
    ("zmq:tcp://127.0.0.1", b"no port; did you mean zmq:tcp://127.0.0.1:5555?"),
    ("tcp://127.0.0.1:5555", b"did you mean zmq:tcp://127.0.0.1:5555 (ZeroMQ) or "
                             b"tcp:host=127.0.0.1:port=5555 (framed TCP)?"),
    ("zmq:tcp://127.0.0.1:70000", b"port 70000 is out of range"),
    ("carrier-pigeon:coop", b"unknown scheme 'carrier-pigeon'"),
])
@pytest_twisted.ensureDeferred
async def test_mdp_call_rejects_a_bad_endpoint_at_once_in_one_line(endpoint: str, says: bytes) -> None:
    """Before anything is sent or started: exit status 2 and one line that
    names the endpoint and says what was probably meant."""
    call = await run([script("mdp"), "call", "--broker", endpoint, "echo", "x"], timeout=30)
    assert call.exitCode == 2
    lines = call.output.strip().splitlines()
    assert len(lines) == 1, call.output
    assert endpoint.encode() in lines[0] and says in lines[0]
    assert b"Traceback" not in call.output


@pytest_twisted.ensureDeferred
async def test_twist_refuses_a_bad_endpoint_as_a_usage_error() -> None:
    for args in (["mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:70000"],
                 ["mdp-worker", "--service", "echo", "--broker", "tcp://127.0.0.1:5555"]):
        proc = await run([script("twist"), *args], timeout=30)
        assert proc.exitCode != 0
        assert proc.output.startswith(f"twist {args[0]}: --".encode()), proc.output
        assert b"bad endpoint" in proc.output, proc.output


@pytest_twisted.ensureDeferred
async def test_twist_broker_that_cannot_bind_exits_with_the_reason() -> None:
    broker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                                 "--endpoint", "zmq:tcp://256.1.1.1:1"], ENV)
    try:
        await broker.ended(60)
    finally:
        await broker.stop()
    assert broker.exitCode == 1
    assert b"MDP broker cannot listen: cannot bind zmq:tcp://256.1.1.1:1" in broker.output


@pytest_twisted.ensureDeferred
async def test_mdp_demo() -> None:
    demo = await run([script("mdp"), "demo"])
    assert demo.exitCode == 0, demo.output
    out = demo.output.decode()
    assert "echo replied: hello 0" in out
    assert "demo done" in out


@pytest.mark.parametrize("form", ["tcp:host=127.0.0.1:port={}", "zmq:tcp://127.0.0.1:{}"])
@pytest_twisted.ensureDeferred
async def test_mdp_demo_on_a_port_in_use_exits_with_the_reason_in_one_line(form: str) -> None:
    from twisted.internet import protocol

    taken = reactor().listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    try:
        endpoint = form.format(taken.getHost().port)
        demo = await run([script("mdp"), "demo", "--endpoint", endpoint], timeout=30)
    finally:
        await taken.stopListening()
    assert demo.exitCode == 1, demo.output
    lines = demo.output.strip().splitlines()
    assert len(lines) == 1, demo.output
    assert lines[0].startswith(b"mdp demo: ") and endpoint.encode() in lines[0], demo.output
    assert b"Traceback" not in demo.output


@pytest_twisted.ensureDeferred
async def test_streams_cross_processes_without_loss() -> None:
    """Bursts of PARTIALs longer than socket buffers, broker and worker in
    their own processes: every part arrives, in order."""
    from mdp import Client

    broker, endpoint = await start_broker("zmq:tcp://127.0.0.1:*")
    worker = twist_worker(reactor(), endpoint, "burst", "tests.handlers_for_tests:burst",
                          "--heartbeat", "0.5")
    client = Client(endpoint, reactor(), timeout=60, retries=1)
    try:
        await worker.waitFor("sent READY", timeout=60)
        for _ in range(20):
            parts: list[list[bytes]] = []
            final = await client.request("burst", b"2000", onPartial=parts.append).addTimeout(
                60, reactor())
            assert final == [b"end"]
            assert parts == [[str(n).encode()] for n in range(2000)]
    finally:
        await client.close()
        await worker.stop()
        await broker.stop()


@pytest_twisted.ensureDeferred
async def test_twist_freelance_server_with_agent_client() -> None:
    from mdp.freelance import AgentClient

    servers, endpoints = [], []
    try:
        for _ in range(2):
            server = Process(reactor(), [script("twist"), "--log-format", "text",
                                         "mdp-freelance-server", "--endpoint",
                                         "zmq:tcp://127.0.0.1:*", "--handler", "echo"], ENV)
            servers.append(server)
            match = await server.waitFor(r"Freelance server listening on (\S+)", timeout=60)
            endpoints.append(match.group(1).decode())
        client = AgentClient(endpoints, reactor())
        try:
            assert await client.request(b"hello").addTimeout(30, reactor()) == [b"hello"]
            await servers[0].stop()  # the agent moves on to the other server
            for n in range(3):
                reply = await client.request(str(n)).addTimeout(30, reactor())
                assert reply == [str(n).encode()]
        finally:
            await client.close()
    finally:
        for server in servers:
            await server.stop()
