"""A hostile peer for admission tests, run as its own process: opens COUNT
connections to 127.0.0.1:PORT, sends one cheap message on each and holds
them, reopening every one the server closes (at most RATE a second), until
it is killed.  KIND says what it sends:

* ``mdp``: a READY for a service nobody calls, or a REQUEST for a service
  nobody serves (every other connection);
* ``echo``: one REQUEST for ``echo``, a service that is served;
* ``sp``: only the 8-byte SP header of a REQ peer.

``python -m tests.flood_connections KIND PORT COUNT [RATE]``; prints
``holding N`` once every connection has been opened once, then ``reopened
N`` now and then."""

from __future__ import annotations

import select
import socket
import sys
import time

from mdp.majordomo import codec
from mdp.transport.framing import encode_record
from mdp.transport.spframing import REQ, header


def payload(kind: str, n: int) -> bytes:
    if kind == "sp":
        return header(REQ)
    if kind == "echo":
        return encode_record([codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", b"x"])
    if n % 2:
        return encode_record([codec.CLIENT_HEADER, codec.C_REQUEST, b"nobody-%d" % n, b"x"])
    return encode_record([codec.WORKER_HEADER, codec.W_READY, b"junk-%d" % n])


def open_one(port: int, kind: str, n: int) -> socket.socket | None:
    sock = socket.socket()
    sock.settimeout(2.0)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(payload(kind, n))
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def main(kind: str, port: int, count: int, rate: float) -> None:
    socks: dict[socket.socket, int] = {}
    for n in range(count):
        sock = open_one(port, kind, n)
        if sock is not None:
            socks[sock] = n
    print(f"holding {len(socks)}", flush=True)
    reopened, last, n = 0, time.monotonic(), count
    allowed, tick = 0.0, time.monotonic()
    while True:
        readable, _, _ = select.select(list(socks), [], [], 0.05)
        closed = []
        for sock in readable:
            try:
                if not sock.recv(65536):
                    closed.append(sock)
            except OSError:
                closed.append(sock)
        for sock in closed:
            del socks[sock]
            sock.close()
        now = time.monotonic()
        allowed, tick = min(allowed + (now - tick) * rate, rate / 10), now
        while len(socks) < count and allowed >= 1:
            allowed -= 1
            n += 1
            sock = open_one(port, kind, n)
            if sock is not None:
                socks[sock] = n
                reopened += 1
        if time.monotonic() - last > 1.0:
            last = time.monotonic()
            print(f"reopened {reopened}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
         float(sys.argv[4]) if len(sys.argv) > 4 else 200.0)
