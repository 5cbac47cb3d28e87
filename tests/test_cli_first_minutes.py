"""The command line as a newcomer meets it: versions, and Ctrl-C."""

from __future__ import annotations

import signal

import pytest
import pytest_twisted

import mdp
from tests.procs import ENV, Process, reactor, script, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("argv", [
    ["mdp", "--version"], ["mdp", "call", "--version"],
    ["twist", "mdp-broker", "--version"], ["twist", "mdp-worker", "--version"],
    ["twist", "mdp-titanic", "--version"], ["twist", "sp-rep", "--version"],
])
@pytest_twisted.ensureDeferred
async def test_version_is_txmajordomos(argv: list[str]) -> None:
    proc = Process(reactor(), [script(argv[0]), *argv[1:]], env=ENV)
    await proc.ended(60)
    assert proc.exitCode == 0, proc.output
    assert f"txmajordomo {mdp.__version__}".encode() in proc.output


@pytest_twisted.ensureDeferred
async def test_ctrl_c_on_mdp_call_exits_130_without_a_traceback() -> None:
    """The request reaches a broker that never answers; Ctrl-C then."""
    from mdp import transport
    from tests.conftest import RawRouter

    silent = RawRouter()
    silent.clock = reactor()
    silent.transport = await transport.listen("zmq:tcp://127.0.0.1:*", silent, reactor())
    proc = Process(reactor(), [script("mdp"), "call", "--broker", silent.transport.endpoint,
                               "--timeout", "30", "echo", "hi"], env=ENV)
    try:
        await wait_until(lambda: silent.received, 30)  # the client is up and waiting
        proc.signalProcess(signal.SIGINT)
        await proc.ended(30)
        assert proc.exitCode == 130, proc.output
        assert b"Traceback" not in proc.output and b"timed out" not in proc.output
    finally:
        await proc.stop()
        await silent.transport.close()


@pytest_twisted.ensureDeferred
async def test_mmi_queries_need_no_body_from_the_api_and_the_shell() -> None:
    """``mmi.services`` and ``mmi.workers`` with an empty body, as docs/mdp.md
    shows them; other services still need a frame."""
    import json

    from mdp import Broker, Client, Worker
    from mdp.handlers import echo

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", echo, reactor())
    worker.start()
    client = Client(bound.endpoint, reactor())
    try:
        assert await client.request("mmi.service", b"echo") in ([b"200"], [b"404"])
        services = json.loads((await client.request("mmi.services"))[0])
        while not services.get("echo", {}).get("workers"):  # the worker's READY is on its way
            services = json.loads((await client.request("mmi.services"))[0])
        assert services["echo"]["workers"] == 1
        workers = json.loads((await client.request("mmi.workers"))[0])
        assert [w["service"] for w in workers] == ["echo"]
        with pytest.raises(ValueError, match="at least one body frame"):
            client.request("echo")
        proc = Process(reactor(), [script("mdp"), "call", "--broker", bound.endpoint,
                                   "mmi.services"], env=ENV)
        await proc.ended(30)
        assert proc.exitCode == 0, proc.output
        assert json.loads(proc.output.strip().splitlines()[-1])["echo"]["workers"] == 1
        refused = Process(reactor(), [script("mdp"), "call", "--broker", bound.endpoint,
                                      "echo"], env=ENV)
        await refused.ended(30)
        assert refused.exitCode == 2 and b"at least one request frame" in refused.output
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
