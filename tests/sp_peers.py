"""pynng peers run as separate processes by the SP tests.

    python -m tests.sp_peers rep URL        # Rep0 echoing b"nng:" + request; prints its port
    python -m tests.sp_peers device BACK    # nng_device: raw Rep0 on a free port -> raw Req0 dialing BACK
"""

from __future__ import annotations

import sys

import pynng


def pynng_port(sock: pynng.Socket) -> int:
    """The TCP port *sock* listens on (pynng 0.9's ``local_address.port`` is
    in network byte order; its ``str()`` is right)."""
    return int(str(sock.listeners[0].local_address).rpartition(":")[2])


def rep(url: str) -> None:
    with pynng.Rep0(listen=url) as sock:
        print("listening on", pynng_port(sock), flush=True)
        while True:
            sock.send(b"nng:" + sock.recv())


def device(back: str) -> None:
    front = pynng.Rep0(opener=pynng.lib.nng_rep0_open_raw, listen="tcp://127.0.0.1:0")
    upstream = pynng.Req0(opener=pynng.lib.nng_req0_open_raw, dial=back, block_on_dial=False)
    print("listening on", pynng_port(front), flush=True)
    pynng.lib.nng_device(front.socket, upstream.socket)  # forwards until the process ends


if __name__ == "__main__":
    {"rep": rep, "device": device}[sys.argv[1]](*sys.argv[2:])
