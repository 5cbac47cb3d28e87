"""A ZeroMQ ROUTER closed while the reactor shuts down does not hang the
process: its close() waits on a monitor socket that must be closed before the
context terminates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import ENV

SCRIPT = """
from twisted.internet import reactor
from mdp.transport import listen

class Receiver:
    def messageReceived(self, peer, frames): pass
    def peerDisconnected(self, peer): pass

routers = []
# a close() that begins during the shutdown, after the 'before' phase
reactor.addSystemEventTrigger("during", "shutdown", lambda: routers[0].close())
listen("zmq:tcp://127.0.0.1:*", Receiver(), reactor).addCallback(
    lambda router: (routers.append(router), reactor.callLater(0.1, reactor.stop)))
reactor.run()
print("exited cleanly")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attempt", range(3))
def test_router_closed_during_shutdown_lets_the_process_exit(attempt: int) -> None:
    import os

    env = dict(os.environ, **ENV)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=30, env=env)
    assert done.returncode == 0 and "exited cleanly" in done.stdout, done.stderr
