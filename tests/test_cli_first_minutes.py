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
