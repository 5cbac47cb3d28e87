"""Freelance (brokerless) request-reply: failover with a model-3 agent client.

    python examples/freelance.py

Starts three servers (alpha, beta, gamma) on free 127.0.0.1 ports, each
replying with its name.  The agent sends each request to the first server it
knows to be alive, in the order the servers were given: alpha answers.  Stop
alpha, and the next request, unanswered by alpha within the attempt's
timeout, goes to beta, which answers this one and the ones after; stop beta,
and gamma takes over.  The output is the same on every run:

    alpha, beta and gamma are alive
    request 1 answered by alpha
    request 2 answered by alpha
    alpha stopped
    request 3 answered by beta
    request 4 answered by beta
    beta stopped
    request 5 answered by gamma

Against servers started with ``twist mdp-freelance-server --endpoint
zmq:tcp://127.0.0.1:5556 --handler echo``, pass their endpoints to
``AgentClient`` instead (or try one from the shell: ``mdp freelance-call
--server zmq:tcp://127.0.0.1:5556 hello``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task

from mdp.freelance import AgentClient, FreelanceServer

NAMES = ("alpha", "beta", "gamma")


async def every_server_alive(client: AgentClient, endpoints: list[str], reactor: Any,
                             within: float = 10.0) -> None:
    """Wait until the agent has heard from every server (its first PONGs), so
    which server gets the first request does not depend on which PONG came
    first."""
    deadline = reactor.seconds() + within
    while client.live() != endpoints:
        if reactor.seconds() > deadline:
            raise RuntimeError(f"servers not alive within {within} s: {endpoints}")
        await task.deferLater(reactor, 0.01)


async def main(reactor: Any) -> list[str]:
    """Run the demonstration; return (and print) what happened, line by line."""
    lines: list[str] = []

    def say(line: str) -> None:
        print(line)
        lines.append(line)

    servers, endpoints = [], []
    for name in NAMES:
        server = FreelanceServer(lambda frames, name=name: [name, *frames], reactor)
        endpoints.append((await server.listen("zmq:tcp://127.0.0.1:*")).endpoint)
        servers.append(server)
    # each attempt (one server) may take timeout seconds, the whole request deadline
    client = AgentClient(endpoints, reactor, timeout=0.5, deadline=5.0)
    count = 0

    async def ask(times: int) -> None:
        nonlocal count
        for _ in range(times):
            count += 1
            server, *_ = await client.request(f"request {count}")
            say(f"request {count} answered by {server.decode()}")

    try:
        await every_server_alive(client, endpoints, reactor)
        say(f"{', '.join(NAMES[:-1])} and {NAMES[-1]} are alive")
        await ask(2)
        for stopped in range(2):  # alpha, then beta
            await servers[stopped].close()
            say(f"{NAMES[stopped]} stopped")
            await ask(2 if stopped == 0 else 1)
    finally:
        await client.close()
        for server in servers:
            await server.close()
    return lines


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor)).addCallback(lambda _: None))
