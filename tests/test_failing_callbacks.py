"""What a node does when something fails inside a reactor callback (a
receiver's method that raises, a message that cannot be encoded, a
connection that cannot be made): it says so, refuses at the call what it
cannot send, and goes on. Raised out of the reactor instead, such a failure
left a connection never made again, a request never answered or a peer
never dialled again."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.logger import formatEvent

from mdp.policy import Backoff
from mdp.transport.stream import StreamChannels, StreamDealer, StreamRouter
from tests.conftest import RealNet, failures_logged, warnings_logged

RETRY = Backoff(initial=0.05, maximum=0.1).retryPolicy()


class Server:
    """A stream router's receiver that keeps what comes."""

    def __init__(self) -> None:
        self.got: list[list[bytes]] = []
        self.peers: set[bytes] = set()

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.got.append(frames)
        self.peers.add(peer)

    def peerDisconnected(self, peer: bytes) -> None:
        pass


class Receiver:
    """A dealer's receiver whose first ``connectionMade`` raises."""

    def __init__(self) -> None:
        self.made = self.lost = 0

    def connectionMade(self) -> None:
        self.made += 1
        if self.made == 1:
            raise RuntimeError("a receiver's bug")

    def connectionLost(self, reason: Any) -> None:
        self.lost += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        pass


@pytest_twisted.async_yield_fixture
async def tcp() -> Any:
    net = RealNet("tcp")
    yield net
    await net.cleanup()


async def listening(net: RealNet, server: Server, endpoint: str = "tcp:0:interface=127.0.0.1"
                    ) -> Any:
    router = await net.wait(StreamRouter.listen(endpoint, server, net.reactor))
    net.addCleanup(router.close)
    return router


@pytest.mark.parametrize("kind", ["dealer", "channels"])
@pytest_twisted.ensureDeferred
async def test_a_receiver_whose_connection_made_raises_keeps_its_connection(
        tcp: RealNet, kind: str) -> None:
    """Logged; the connection stands, what was queued goes out, and once
    lost it is made again (the connection used to be left half made: never
    made again, and ``close()`` raised)."""
    server = Server()
    router = await listening(tcp, server)
    receiver = Receiver()
    with failures_logged() as failures:
        if kind == "dealer":
            dealer = StreamDealer(router.endpoint, receiver, tcp.reactor, retryPolicy=RETRY)
            pipe = dealer
        else:
            dealer = StreamChannels(router.endpoint, tcp.reactor, retryPolicy=RETRY)
            pipe = dealer.open(receiver)
        pipe.sendMessage([b"queued"])
        await tcp.until(lambda: server.got == [[b"queued"]])
    assert receiver.made == 1
    assert [f for f in failures if "connectionMade failed" in str(f.get("log_format"))]
    pipe.sendMessage([b"sent"])
    await tcp.until(lambda: server.got == [[b"queued"], [b"sent"]])
    for peer in server.peers:
        router.disconnectPeer(peer)
    await tcp.until(lambda: receiver.made == 2)
    pipe.sendMessage([b"again"])
    await tcp.until(lambda: server.got[-1] == [b"again"])
    await tcp.wait(dealer.close())


@pytest.mark.parametrize("kind", ["dealer", "channels"])
@pytest_twisted.ensureDeferred
async def test_a_frame_that_is_not_bytes_is_refused_while_down_too(
        tcp: RealNet, tmp_path: Any, kind: str) -> None:
    """Sent while the connection is down, a message with a ``str`` frame
    raises ``TypeError`` at the call, as while it is up; the messages around
    it go out (it used to be queued, fail the next connection's start, and
    take the messages behind it along)."""
    server = Server()
    endpoint = f"unix:path={tmp_path / 'd.sock'}"
    if kind == "dealer":
        dealer = pipe = StreamDealer(endpoint, Receiver(), tcp.reactor, retryPolicy=RETRY)
    else:
        dealer = StreamChannels(endpoint, tcp.reactor, retryPolicy=RETRY)
        pipe = dealer.open(Client())
    tcp.addCleanup(dealer.close)
    pipe.sendMessage([b"one"])
    with pytest.raises(TypeError):
        pipe.sendMessage(["two"])  # type: ignore[list-item]
    pipe.sendMessage([b"three"])
    assert len(dealer.queue) == 2
    with failures_logged():
        await listening(tcp, server, endpoint)
        await tcp.until(lambda: server.got == [[b"one"], [b"three"]])


# --- sessions -----------------------------------------------------------------------------

class Client(Receiver):
    """A session dealer's receiver."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[list[bytes]] = []

    def connectionMade(self) -> None:
        self.made += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        self.got.append(frames)


@pytest_twisted.ensureDeferred
async def test_a_session_refuses_a_frame_that_is_not_bytes_at_the_call(tcp: RealNet) -> None:
    """Both ways, a ``str`` frame raises ``TypeError`` and is not kept; the
    messages around it are delivered, in order (it used to be numbered and
    kept, fail every resend, and hold back every message after it)."""
    from mdp import transport

    server = Server()
    router = await tcp.wait(transport.listen("session+tcp:host=127.0.0.1:port=0", server,
                                             tcp.reactor))
    tcp.addCleanup(router.close)
    client = Client()
    dealer = transport.connect(router.endpoint, client, tcp.reactor)
    tcp.addCleanup(dealer.close)
    await tcp.until(lambda: client.made == 1)
    dealer.send([b"first"])
    with pytest.raises(TypeError, match="frame 1 is str"):
        dealer.send([b"x", "a str"])  # type: ignore[list-item]
    dealer.send([b"later", bytearray(b"kept as bytes")])  # type: ignore[list-item]
    await tcp.until(lambda: len(server.got) == 2)
    assert server.got == [[b"first"], [b"later", b"kept as bytes"]]
    (peer,) = server.peers
    with pytest.raises(TypeError, match="frame 0 is str"):
        router.sendMessage(peer, ["a str"])
    router.sendMessage(peer, [b"reply"])
    await tcp.until(lambda: client.got == [[b"reply"]])


# --- SP REP -------------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_an_sp_reply_that_cannot_be_encoded_lets_its_request_go(tcp: RealNet) -> None:
    """A handler's ``str`` reply that UTF-8 cannot encode is logged and not
    sent, and its request no longer holds one of the server's ``maxPending``
    places (it used to, for good: with one place, every later request was
    refused as overloaded)."""
    from mdp.sp.peers import SPClient, SPServer

    server = SPServer(lambda payload: "bad \ud800" if payload == b"bad" else payload.upper(),
                      tcp.reactor, maxPending=1)
    router = await server.listen("tcp://127.0.0.1:0")
    tcp.addCleanup(server.close)
    client = SPClient(f"tcp://127.0.0.1:{router.port.getHost().port}", tcp.reactor, resend=0.2)
    tcp.addCleanup(client.close)
    with failures_logged() as failures:
        bad = client.request(b"bad")
        bad.addErrback(lambda failure: None)  # (never answered: cancelled at the end)
        tcp.addCleanup(bad.cancel)
        await tcp.until(lambda: bool(failures))
        assert await tcp.wait(client.request(b"ok"), timeout=10) == b"OK"
    assert "UTF-8 cannot encode" in str(failures[0].get("log_format"))


# --- the Freelance agent's connecting router --------------------------------------------

@pytest.mark.parametrize("net", ["tcp", "zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_an_agent_connects_again_to_a_server_it_had_no_socket_for(
        net: Any, monkeypatch: Any) -> None:
    """The first connection to the server cannot be made (a raw
    ``zmq.ZMQError``, out of descriptors): logged, and made at the agent's
    next PING, so the request is answered (it raised out of ``connect()``,
    and the server was never connected)."""
    import errno

    import zmq

    from mdp import transport
    from mdp.freelance import freelance_client
    from mdp.transport.zeromq import ZmqPeerRouter
    from tests.test_freelance import FAST, start_server

    server = await start_server(net, "a")
    refused: list[str] = []
    # what opens the connection: a ZeroMQ router's connect, or a stream dealer
    owner, name, at = (ZmqPeerRouter, "connect", 1) if net.kind == "zmq" else (
        transport, "connect", 0)
    opened = getattr(owner, name)

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(args[at])
            raise zmq.ZMQError(errno.EMFILE)
        return opened(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    with warnings_logged() as warnings:
        client = freelance_client([server.endpoint], 3, net.reactor, **FAST)
        net.addCleanup(client.close)
        assert await net.wait(client.request(b"req"), timeout=10) == [b"a", b"req"]
    assert refused == [server.endpoint]
    assert any(f"cannot connect to {server.endpoint}" in formatEvent(e) for e in warnings)
    assert not client.router.unconnected
