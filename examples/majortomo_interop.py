"""Talk to a majortomo broker (PyPI ``majortomo``) with our client and worker.

    python -m majortomo.broker -b tcp://127.0.0.1:5555 &
    python examples/majortomo_interop.py zmq:tcp://127.0.0.1:5555

majortomo speaks its own MDP/0.2 dialect; ``dialect="majortomo"`` selects it.
Our broker needs no option: it recognises each peer's dialect by itself.
"""

from __future__ import annotations

import sys

from twisted.internet import defer, task

from mdp import Client, Worker


async def main(reactor, endpoint: str) -> None:
    worker = Worker(endpoint, "echo", lambda frames: frames, reactor, dialect="majortomo")
    worker.start()
    client = Client(endpoint, reactor, dialect="majortomo")
    print(await client.request("echo", "hello majortomo"))
    await client.close()
    await worker.stop()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1])))
