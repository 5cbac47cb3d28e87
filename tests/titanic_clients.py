"""Titanic client processes for the fault tests.

``python -m tests.titanic_clients submit ENDPOINT SERVICE COUNT IDS_FILE``
    Submit COUNT requests (bodies ``req-0`` ...), write ``id body`` lines to
    IDS_FILE once all are acknowledged, print ``submitted COUNT`` and exit.
``python -m tests.titanic_clients collect ENDPOINT IDS_FILE``
    Collect the reply of every id in IDS_FILE; print ``collected N ok`` if
    each reply is ``[pid, body]`` for its own body, else what is wrong (exit 1).
``python -m tests.titanic_clients flood ENDPOINT COUNT SIZE``
    Submit COUNT requests of SIZE bytes, each for its own service nobody serves
    (``parked-0`` ...), 50 at a time; print ``flooded {outcome: count}`` (JSON:
    ``stored`` or the error's class name) and exit.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from twisted.internet import defer, task

from mdp.titanic import TitanicClient


async def submit(reactor: Any, endpoint: str, service: str, count: int, path: str) -> None:
    client = TitanicClient(endpoint, reactor, timeout=5.0, retries=6)
    lines = []
    for n in range(count):
        body = f"req-{n}"
        lines.append(f"{await client.submit(service, body)} {body}\n")
    with open(path, "w") as out:
        out.writelines(lines)
    print(f"submitted {count}", flush=True)
    await client.disconnect()


async def collect(reactor: Any, endpoint: str, path: str) -> None:
    client = TitanicClient(endpoint, reactor, timeout=5.0, retries=6, pollInterval=0.2)
    wrong = []
    with open(path) as ids:
        wanted = [line.split() for line in ids if line.strip()]
    for requestId, body in wanted:
        reply = await client.result(requestId)
        if len(reply) != 2 or reply[1] != body.encode():
            wrong.append((requestId, body, reply))
    await client.disconnect()
    if wrong:
        print(f"{len(wrong)} wrong replies: {wrong[:5]}", flush=True)
        raise SystemExit(1)
    print(f"collected {len(wanted)} ok", flush=True)


async def flood(reactor: Any, endpoint: str, count: int, size: int) -> None:
    client = TitanicClient(endpoint, reactor, timeout=10.0, retries=3)
    outcomes: Counter[str] = Counter()

    async def one(n: int) -> None:
        try:
            await client.submit(f"parked-{n}", b"x" * size)
            outcomes["stored"] += 1
        except Exception as e:
            outcomes[type(e).__name__] += 1

    for start in range(0, count, 50):
        await defer.gatherResults([defer.ensureDeferred(one(n))
                                   for n in range(start, min(count, start + 50))])
    print(f"flooded {json.dumps(dict(outcomes), sort_keys=True)}", flush=True)
    await client.disconnect()


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "flood":
        endpoint, count, size = args
        run = lambda reactor: flood(reactor, endpoint, int(count), int(size))  # noqa: E731
    elif command == "submit":
        endpoint, service, count, path = args
        run = lambda reactor: submit(reactor, endpoint, service, int(count), path)  # noqa: E731
    else:
        endpoint, path = args
        run = lambda reactor: collect(reactor, endpoint, path)  # noqa: E731
    task.react(lambda reactor: defer.ensureDeferred(run(reactor)))


if __name__ == "__main__":
    main()
