"""Titanic: a request that waits, on disk, for a worker that is not there yet.

Run::

    python examples/titanic.py [DATABASE]

In one process: a broker on a free port of 127.0.0.1, Titanic keeping its
requests in DATABASE (a SQLite file; default: one in a temporary directory),
and a client that submits a request for ``shout``, a service no worker
offers yet.  The client prints the request id and stops caring.  A worker
for ``shout`` starts a little later; Titanic sends it the stored request; the
client (it could be another process, a day later) collects the reply by id
and closes it.

The same with separate processes::

    twist mdp-broker &
    twist mdp-titanic --db titanic.db &
    mdp titanic submit shout hello          # prints the id
    twist mdp-worker --service shout --handler echo &
    mdp titanic result --wait ID
    mdp titanic close ID
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Optional

from twisted.internet import defer, task

from mdp import Broker, Worker
from mdp.titanic import Titanic, TitanicClient


def shout(frames: list[bytes]) -> list[bytes]:
    return [frame.upper() for frame in frames]


async def main(reactor: Any, database: Optional[str] = None) -> list[bytes]:
    with tempfile.TemporaryDirectory() as scratch:
        database = database or os.path.join(scratch, "titanic.db")
        broker = Broker(reactor)
        bound = await broker.listen("zmq:tcp://127.0.0.1:*")
        titanic = Titanic(bound.endpoint, database, reactor)
        await titanic.start()
        client = TitanicClient(bound.endpoint, reactor, pollInterval=0.1)
        worker = Worker(bound.endpoint, "shout", shout, reactor)
        try:
            requestId = await client.submit("shout", "hello, whenever you can")
            print(f"stored as {requestId}; no worker for shout yet")
            await task.deferLater(reactor, 0.5, lambda: None)
            print(f"still pending: {await client.poll(requestId) is None}")
            worker.start()
            print("a worker for shout started")
            reply = await client.result(requestId)
            print(f"reply: {b' '.join(reply).decode()}")
            await client.close(requestId)
            return reply
        finally:
            await client.disconnect()
            await worker.stop()
            await titanic.stop()
            await broker.close()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, *sys.argv[1:2])))
