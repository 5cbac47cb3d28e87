"""pynng peers run as separate processes by the SP tests.

    python -m tests.sp_peers rep URL        # Rep0 echoing b"nng:" + request; prints its port
"""

from __future__ import annotations

import sys

import pynng


def rep(url: str) -> None:
    with pynng.Rep0(listen=url) as sock:
        # pynng 0.9's local_address.port is in network byte order; its str() is right
        print("listening on", str(sock.listeners[0].local_address).rpartition(":")[2], flush=True)
        while True:
            sock.send(b"nng:" + sock.recv())


if __name__ == "__main__":
    {"rep": rep}[sys.argv[1]](*sys.argv[2:])
