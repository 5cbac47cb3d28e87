"""A worker whose handler streams PARTIAL replies, and a client reading them.

    python examples/streaming_worker.py [ENDPOINT]

With no ENDPOINT it starts its own broker on a free 127.0.0.1 port.
"""

from __future__ import annotations

import sys

from twisted.internet import defer, task

from mdp import Broker, Client, Final, Worker


async def countdown(frames: list[bytes]):
    """Yield one PARTIAL per number, then a FINAL."""
    for n in range(int(frames[0]), 0, -1):
        yield str(n)
    yield Final("liftoff")


async def main(reactor, endpoint: str | None = None) -> None:
    broker = None
    if endpoint is None:
        broker = Broker(reactor)
        endpoint = (await broker.listen("zmq:tcp://127.0.0.1:*")).endpoint
    worker = Worker(endpoint, "countdown", countdown, reactor)
    worker.start()
    client = Client(endpoint, reactor)
    async for part in client.stream("countdown", "3"):
        print(part[0].decode())
    await client.close()
    await worker.stop()
    if broker is not None:
        await broker.close()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, *sys.argv[1:2])))
