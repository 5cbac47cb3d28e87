"""A bound CURVE ROUTER with an allow-list of two keys, alice and mallory, and
raw DEALERs that connect to it with either key and a routing id of their
choosing: what the tests of a routing id claimed by another key share."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import zmq

from mdp.transport.curve import keygen
from tests.procs import wait_until


class Recorder:
    """A router receiver keeping what its transport reported, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.transport: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.events.append(("message", peer, frames[-1], self.transport.peerIdentity(peer)))

    def peerDisconnected(self, peer: bytes) -> None:
        self.events.append(("gone", peer))


@contextlib.asynccontextmanager
async def curve_router(tmp_path: Path, recorder: Recorder, reactor: Any
                       ) -> AsyncIterator[tuple[Any, Callable[[str, bytes], Any]]]:
    """``(router, dealer)``: the router reports to *recorder*; ``dealer(name,
    routingId)`` connects a raw DEALER with *name*'s key.  All closed on exit."""
    from mdp import transport
    from mdp.transport.curve import curve_client, curve_server

    for name in ("server", "alice", "mallory"):
        keygen(name, str(tmp_path))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("alice", "mallory"):  # both may connect: the policy tells them apart
        (allowed / f"{name}.key").write_text((tmp_path / f"{name}.key").read_text())
    router = await transport.listen(
        "zmq:tcp://127.0.0.1:*", recorder, reactor,
        security=curve_server(str(tmp_path / "server.key_secret"), str(allowed)))
    recorder.transport = router
    context = zmq.Context()
    sockets: list[Any] = []

    def dealer(name: str, routingId: bytes) -> Any:
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        curve_client(str(tmp_path / "server.key"),
                     str(tmp_path / f"{name}.key_secret")).apply(sock)
        sock.routing_id = routingId
        sock.connect(router.endpoint[len("zmq:"):])
        sockets.append(sock)
        return sock

    try:
        yield router, dealer
    finally:
        for sock in sockets:
            sock.close()
        context.term()
        await router.close()


async def claim(dealer: Callable[[str, bytes], Any], routingId: bytes,
                say: Callable[[Any], None], done: Callable[[], bool]) -> None:
    """Connect as mallory with *routingId* and ``say(socket)`` until *done*()."""
    claimer = [dealer("mallory", routingId), 0]  # the connection, tries on it

    def claimed() -> bool:
        if done():
            return True
        if claimer[1] == 10:
            # a connection made while the id was still taken is parked by
            # libzmq, and not looked at again once it holds a message:
            # connect anew, as a refused peer would
            claimer[0].close()
            claimer[:] = [dealer("mallory", routingId), 0]
        say(claimer[0])  # until the id is free and this gets through
        claimer[1] += 1
        return False

    await wait_until(claimed, 20, step=0.05)
