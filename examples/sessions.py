"""Sessions: messages that survive broken connections, in a page.

A SessionServer answers each message in upper case.  A SessionClient sends
one; the server goes away; the client sends another, which waits in the
session until a server is back on the port, and gets its answer.  Then an
MDP broker, worker and client run over ``session+tcp`` endpoints, unchanged::

    python examples/sessions.py
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task

from mdp import Broker, Client, Worker
from mdp.handlers import echo
from mdp.session import SessionClient, SessionServer


def upper_server(reactor: Any) -> SessionServer:
    """Answers every message in upper case."""
    server = SessionServer(lambda routingId, frames: server.reply(
        routingId, *[f.upper() for f in frames]), reactor)
    return server


async def main(reactor: Any) -> tuple[list[list[bytes]], list[bytes]]:
    answers: list[list[bytes]] = []
    server = upper_server(reactor)
    endpoint = await server.listen("tcp:host=127.0.0.1:port=0")
    client = SessionClient(endpoint, reactor)
    client.subscribe(answers.append)
    client.send(b"hello")
    while len(answers) < 1:
        await task.deferLater(reactor, 0.01)

    # the server goes away; what the client sends meanwhile waits in the session
    await server.close()
    client.send(b"sessions")
    port = endpoint.rpartition("=")[2]
    server = upper_server(reactor)
    await server.listen(f"tcp:port={port}:interface=127.0.0.1")
    while len(answers) < 2:
        await task.deferLater(reactor, 0.01)
    print("session answers:", answers)
    await client.close()
    await server.close()

    broker = Broker(reactor)
    bound = await broker.listen("session+tcp:host=127.0.0.1:port=0")
    worker = Worker(bound.endpoint, "echo", echo, reactor)
    worker.start()
    mdp = Client(bound.endpoint, reactor)
    reply = await mdp.request("echo", b"over a session")
    print("MDP over a session:", reply)
    await mdp.close()
    await worker.stop()
    await broker.close()
    return answers, reply


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
