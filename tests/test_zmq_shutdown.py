"""A ZeroMQ ROUTER closed while the reactor shuts down does not hang the
process: its close() waits on a monitor socket that must be closed before the
context terminates; and a ROUTER's ipc:// name is not taken from another."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

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


@pytest.mark.timeout(30)
def test_a_second_listener_on_an_ipc_path_in_use_is_refused(tmp_path: Any) -> None:
    """libzmq unlinks the socket file of an ipc:// address in use and takes
    the name, leaving the first listener unreachable (tcp:// and unix: say
    "in use"): refused; as is a path that is a file and no socket (libzmq
    deleted it); a socket file nobody listens on any more is taken over."""
    script = f"""
from twisted.internet import reactor, defer
from mdp.errors import TransportError
from mdp.transport import listen

class Receiver:
    def messageReceived(self, peer, frames): pass
    def peerDisconnected(self, peer): pass

@defer.inlineCallbacks
def main():
    endpoint = "zmq:ipc://{tmp_path}/broker.ipc"
    first = yield listen(endpoint, Receiver(), reactor)
    try:
        yield listen(endpoint, Receiver(), reactor)
        print("second bound")
    except TransportError as e:
        print("refused:", e)
    yield first.close()
    import os
    print("left:", os.path.exists("{tmp_path}/broker.ipc"))
    again = yield listen(endpoint, Receiver(), reactor)
    print("bound again")
    yield again.close()
    with open("{tmp_path}/data.db", "w") as f:
        f.write("precious")
    try:
        yield listen("zmq:ipc://{tmp_path}/data.db", Receiver(), reactor)
        print("bound over a file")
    except TransportError as e:
        print("refused:", e)
    print("kept:", open("{tmp_path}/data.db").read())
    reactor.stop()

reactor.callWhenRunning(main)
reactor.run()
"""
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True,
                          text=True, timeout=25)
    assert "refused: cannot bind" in done.stdout and "address in use" in done.stdout, done
    assert "left: True" in done.stdout and "bound again" in done.stdout, done  # a leftover socket
    assert "data.db exists and is not a socket" in done.stdout, done
    assert "kept: precious" in done.stdout, done  # libzmq deleted a file in the way
