"""Freelance (brokerless) request-reply: three servers, a model-3 agent client.

    python examples/freelance.py

Starts three servers on free 127.0.0.1 ports, sends requests through the agent,
stops one server and shows the agent moving on.  Against servers started with
``twist mdp-freelance-server --endpoint zmq:tcp://127.0.0.1:5556 --handler echo``,
pass their endpoints to ``AgentClient`` instead.
"""

from __future__ import annotations

from twisted.internet import defer, task

from mdp.freelance import AgentClient, FreelanceServer


async def main(reactor) -> None:
    servers, endpoints = [], []
    for name in ("alpha", "beta", "gamma"):
        server = FreelanceServer(lambda frames, name=name: [name, *frames], reactor)
        endpoints.append((await server.listen("zmq:tcp://127.0.0.1:*")).endpoint)
        servers.append(server)
    # each attempt (one server) may take timeout seconds, the whole request deadline
    client = AgentClient(endpoints, reactor, timeout=1.0, deadline=3.0)
    print(await client.request("hello"))            # served by the first live server
    await servers[0].close()                         # alpha goes away
    for n in range(3):
        print(await client.request(f"after alpha stopped {n}"))
    await client.close()
    for server in servers[1:]:
        await server.close()


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
