"""A broker served from your own Twisted server: your endpoint, your TLS
wrapper, your Application.

``broker.streamFactory()`` is a plain Twisted ``IProtocolFactory``; listen with
it however you listen with any other factory.  Run::

    python examples/embedded_broker.py

It listens on ``tcp:0:interface=127.0.0.1`` (a port the OS picks), starts a
worker and a client on ``tcp:host=127.0.0.1:port=PORT`` and prints a reply.
Under ``twistd``, the same factory goes into an Application::

    from twisted.application import strports
    broker = Broker()
    strports.service("tcp:5555:interface=127.0.0.1",
                     broker.streamFactory()).setServiceParent(application)
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task
from twisted.internet.endpoints import serverFromString

from mdp import Broker, Client, Worker


def shout(frames: list[bytes]) -> list[bytes]:
    return [frame.upper() for frame in frames]


async def main(reactor: Any, listen: str = "tcp:0:interface=127.0.0.1") -> list[bytes]:
    broker = Broker(reactor)
    port = await serverFromString(reactor, listen).listen(broker.streamFactory())
    endpoint = f"tcp:host=127.0.0.1:port={port.getHost().port}"
    worker = Worker(endpoint, "shout", shout, reactor)
    worker.start()
    client = Client(endpoint, reactor)
    try:
        reply = await client.request("shout", "hello from your own server")
        print(b" ".join(reply).decode())
        return reply
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
        await port.stopListening()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
