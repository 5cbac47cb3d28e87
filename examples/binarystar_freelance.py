"""Binary Star around a server that is not a broker: a primary/backup pair of
Freelance servers, one active at a time.

    python examples/binarystar_freelance.py

The pair exchanges states over ZeroMQ ``inproc`` endpoints (both servers
live in this one process; across machines they would be ``zmq:tcp://...``
or ``tcp:host=...:port=...`` endpoints of their own).  A model-3 agent
client talks to both: the passive server answers nothing, not even PING, so
the agent sends everything to the active one.  When the primary goes away,
the agent's next messages to the backup are the clients' votes: after the
failover timeout (2 s) the backup takes over.

Wrapping a server takes three lines: ask the Binary Star before taking a
message (``admitClient()``), and drop the message when it says no.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task

from mdp.binarystar import BinaryStar
from mdp.freelance import AgentClient, FreelanceServer

STATE = {"primary": "zmq:inproc://bstar-example-primary",
         "backup": "zmq:inproc://bstar-example-backup"}


class PairedServer(FreelanceServer):
    """A Freelance server that serves only while its Binary Star is active."""

    def __init__(self, star: BinaryStar, handler: Any, reactor: Any) -> None:
        super().__init__(handler, reactor)
        self.star = star

    def received(self, routerTransport: Any, peer: bytes, frames: list[bytes]) -> None:
        if self.star.admitClient():  # every message is a client's vote
            super().received(routerTransport, peer, frames)


async def start(reactor: Any, role: str) -> tuple[BinaryStar, PairedServer, str]:
    other = "backup" if role == "primary" else "primary"
    star = BinaryStar(role, STATE[role], STATE[other], reactor)
    server = PairedServer(star, lambda frames: [role.encode(), *frames], reactor)
    await star.start()
    bound = await server.listen("zmq:tcp://127.0.0.1:*")
    return star, server, bound.endpoint


async def main(reactor: Any) -> list[list[bytes]]:
    primaryStar, primary, a = await start(reactor, "primary")
    backupStar, backup, b = await start(reactor, "backup")
    settled = defer.Deferred()
    backupStar.onPassive(lambda reason: settled.callback(None))
    await settled  # the primary is active, the backup passive

    client = AgentClient([a, b], reactor, timeout=1.0, deadline=10.0)
    replies = [await client.request("hello")]
    print(replies[-1])  # [b'primary', b'hello']

    await primaryStar.stop()  # the primary goes away
    await primary.close()
    replies.append(await client.request("still there?"))
    print(replies[-1])  # [b'backup', b'still there?'], once the backup took over

    await client.close()
    await backupStar.stop()
    await backup.close()
    return replies


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
