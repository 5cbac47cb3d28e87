"""Peers of the tests of bounded streams (tests/test_worker_streams.py,
tests/test_framing_budget.py): a handler that streams without end, a peer
that opens stream records it never completes, and a broker to attack.

``python -m tests.stream_peers HOST PORT COUNT BYTES`` opens COUNT
connections, starts on each a record of BYTES bytes of frames and sends all
of it but its last byte; then, for each line on stdin, prints ``held N`` (N
connections still open), and at the line ``close`` closes them and exits.

``python -m tests.stream_peers broker BUDGET`` runs a broker on a TCP port of
127.0.0.1 with ``maxBufferedBytes`` BUDGET and an ``echo`` worker, logs to
stdout, and prints ``listening on PORT``."""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Iterator


def endless(frames: list[bytes]) -> Iterator[bytes]:
    """Stream PARTIALs of int(frames[0]) bytes without end, writing how many
    it has yielded to the file frames[1] every 16 (past 4,096: every 256)."""
    part = b"x" * int(frames[0])
    count = 0
    while True:
        yield part
        count += 1
        if count % (16 if count < 4096 else 256) == 0:
            with open(frames[1] + b".new", "w") as f:
                f.write(str(count))
            os.replace(frames[1] + b".new", frames[1])


def partial_records(host: str, port: int, count: int, size: int) -> list[socket.socket]:
    """*count* connections, each with a record of *size* bytes of frames sent
    but for its last byte."""
    frame = struct.pack(">I", size)
    header = struct.pack(">I", len(frame) + size)
    held = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        try:
            sock.sendall(header + frame + b"x" * (size - 1))
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def broker(budget: int) -> None:
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)])

    from mdp import Broker, Worker
    from mdp.policy import Limits

    def listening(router: object) -> None:
        endpoint = router.endpoint  # type: ignore[attr-defined]
        Worker(endpoint, "echo", lambda frames: frames, reactor).start()
        print("listening on", endpoint.rpartition("port=")[2], flush=True)

    limits = Limits(maxBufferedBytes=budget)
    Broker(reactor, limits=limits).listen("tcp:host=127.0.0.1:port=0").addCallback(listening)
    reactor.run()


if __name__ == "__main__" and sys.argv[1] == "broker":
    broker(int(sys.argv[2]))
elif __name__ == "__main__":
    host, port, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    socks = partial_records(host, port, count, size)
    print("sent", len(socks), flush=True)
    for line in sys.stdin:
        print("held", sum(map(_still_open, socks)), flush=True)
        if line.strip() == "close":
            break
    for sock in socks:
        sock.close()
    print("closed", flush=True)
