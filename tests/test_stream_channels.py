"""Channels: a client's pipes to a stream endpoint share one connection, and
the broker knows each as a peer of its own (docs/transports.md, "Channels")."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, protocol

from mdp.errors import ReplyTooLarge
from mdp.majordomo import codec
from mdp.policy import Limits
from mdp.transport.framing import CHANNELS_GREETING, RecordDecoder, encode_record
from mdp.transport.stream import StreamChannels, StreamRouter
from tests.conftest import Net, RawRouter
from tests.test_limits import LogLines, binding_of, raw_stream
from tests.test_mdp_behaviour import echo, make_client, start_broker, start_worker

pytestmark = pytest.mark.parametrize("net", ["tcp"], indirect=True)


def on(channel: int, frames: list[bytes]) -> bytes:
    return channel.to_bytes(4, "big") + encode_record(frames)


class RawChannels(protocol.Protocol):
    """A connecting side of our own making that speaks the channels wire
    form byte by byte, as docs/transports.md gives it."""

    def __init__(self) -> None:
        self.decoder = RecordDecoder()
        self.decoder.channels = True
        self.received: list[tuple[bytes, list[bytes]]] = []
        self.lost: defer.Deferred[None] = defer.Deferred()

    def connectionMade(self) -> None:
        self.transport.write(CHANNELS_GREETING)

    def dataReceived(self, data: bytes) -> None:
        self.received += self.decoder.feed(data)

    def connectionLost(self, reason: object = None) -> None:
        self.lost.callback(None)


async def raw_channels(net: Net, endpoint: str) -> RawChannels:
    return await raw_stream(net, endpoint, RawChannels())  # type: ignore[no-any-return]


class Pipe:
    """A pipe's receiver that hands its messages and its loss to *onMessage*
    and *onLost* (name, ...)."""

    def __init__(self, name: str, onMessage: Any = None, onLost: Any = None) -> None:
        self.name = name
        self.onMessage = onMessage or (lambda name, frames: None)
        self.onLost = onLost or (lambda name: None)

    def connectionMade(self) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        self.onMessage(self.name, frames)

    def connectionLost(self, reason: object) -> None:
        self.onLost(self.name)


def request(body: bytes) -> list[bytes]:
    return [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", body]


@pytest_twisted.ensureDeferred
async def test_a_pool_of_pipes_is_one_connection_and_each_pipe_a_peer(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint, maxConnections=8)
    replies = await net.wait(defer.gatherResults(
        [client.request("echo", b"%d" % i) for i in range(40)]))
    assert replies == [[b"%d" % i] for i in range(40)]
    bound = binding_of(broker)
    assert len(bound.connections) == 2  # the worker's and the client's
    assert len(bound.channels) == 8  # the client's pipes, each a peer
    assert {peer[:5] for peer in bound.channels} == {
        c.peer for c in bound.connections.values() if c.channels}
    await client.close()
    await net.until(lambda: len(bound.connections) == 1 and not bound.channels)


@pytest_twisted.ensureDeferred
async def test_both_ends_of_a_stream_connection_send_each_batch_at_once(net: Net) -> None:
    """TCP_NODELAY on the broker's connections and the client's: with several
    replies in flight on one connection, Nagle's algorithm held the last of
    them until the peer's delayed acknowledgment (up to 40 ms)."""
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    client = make_client(net, endpoint, maxConnections=2)
    await net.wait(client.request("echo", b"x"))
    ends = [c.transport for c in binding_of(broker).connections.values()]
    ends += [link.protocol.transport for link in client._links.values()]
    assert len(ends) == 3  # the worker's and the client's, at the broker; the client's own
    for end in ends:
        assert end.getHandle().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    await client.close()


@pytest_twisted.ensureDeferred
async def test_the_wire_form_each_reply_on_the_channel_of_its_request(net: Net) -> None:
    _, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    raw = await raw_channels(net, endpoint)
    raw.transport.write(on(7, request(b"seven")) + on(0xFFFFFFFF, request(b"last")))
    await net.until(lambda: len(raw.received) == 2)
    replies = {channel: frames for channel, frames in raw.received}
    assert replies == {
        (7).to_bytes(4, "big"): [codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"seven"],
        b"\xff" * 4: [codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"last"]}


@pytest_twisted.ensureDeferred
async def test_an_ended_channel_is_a_disconnected_peer_and_the_rest_go_on(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    start_worker(net, endpoint, "echo", echo)
    bound = binding_of(broker)
    gone: list[bytes] = []
    receiver = bound.receiver
    original = receiver.peerDisconnected
    receiver.peerDisconnected = lambda peer: (gone.append(peer), original(peer))
    net.addCleanup(lambda: setattr(receiver, "peerDisconnected", original))
    raw = await raw_channels(net, endpoint)
    raw.transport.write(on(1, request(b"a")) + on(2, request(b"b")))
    await net.until(lambda: len(raw.received) == 2 and len(bound.channels) == 2)
    raw.transport.write(on(1, []))  # ends channel 1
    await net.until(lambda: len(bound.channels) == 1)
    assert len(gone) == 1 and gone[0].endswith((1).to_bytes(4, "big"))
    raw.transport.write(on(2, request(b"c")))
    await net.until(lambda: len(raw.received) == 3)
    assert raw.received[2] == ((2).to_bytes(4, "big"),
                               [codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"c"])


@pytest_twisted.ensureDeferred
async def test_a_channel_the_broker_ends_comes_back_under_a_new_one(net: Net) -> None:
    """The router's disconnectPeer ends one channel: the broker hears that
    peer is gone, the pipe is lost and made again under a new channel, and
    the request it had in flight goes again there; the connection stays."""
    broker, endpoint = await start_broker(net)
    bound = binding_of(broker)
    held: list[defer.Deferred[None]] = []

    def slow(frames: list[bytes]) -> defer.Deferred[list[bytes]]:
        d: defer.Deferred[None] = defer.Deferred()
        held.append(d)
        return d.addCallback(lambda _: frames)

    start_worker(net, endpoint, "slow", slow)
    client = make_client(net, endpoint, maxConnections=1, timeout=30)
    first = client.request("slow", b"held")
    await net.until(lambda: len(held) == 1)
    (peer,) = bound.channels
    connection = bound.channels[peer][0]
    bound.disconnectPeer(peer)
    await net.until(lambda: bool(bound.channels) and peer not in bound.channels)
    held[0].callback(None)  # its reply goes to the ended peer: nowhere
    await net.until(lambda: len(held) == 2)
    held[1].callback(None)
    assert await net.wait(first) == [b"held"]
    (again,) = bound.channels
    assert bound.channels[again][0] is connection and len(bound.connections) == 2


@pytest_twisted.ensureDeferred
async def test_an_oversized_reply_fails_its_request_only(net: Net) -> None:
    """The client's limits end the connection for one pipe's reply: that
    request fails with ReplyTooLarge (sent again it would only run again);
    the others in flight on the same connection go again and complete."""
    _, endpoint = await start_broker(net)
    runs: list[bytes] = []
    held: list[defer.Deferred[None]] = []

    def handler(frames: list[bytes]) -> Any:
        runs.append(frames[0])
        if frames[0] == b"big":
            return [b"r" * 10_000]
        d: defer.Deferred[None] = defer.Deferred()
        held.append(d)
        return d.addCallback(lambda _: frames)

    start_worker(net, endpoint, "svc", handler)
    start_worker(net, endpoint, "svc", handler)
    client = make_client(net, endpoint, maxConnections=2, timeout=30,
                         limits=Limits(maxMessageBytes=4096))
    small = client.request("svc", b"small")
    await net.until(lambda: len(held) == 1)
    with pytest.raises(ReplyTooLarge):
        await net.wait(client.request("svc", b"big"))
    # the held request's connection was lost: it goes again once back
    await net.until(lambda: len(held) == 2)
    for d in held:
        d.callback(None)
    assert await net.wait(small) == [b"small"]
    assert runs.count(b"big") == 1


@pytest_twisted.ensureDeferred
async def test_channels_count_against_max_connections(net: Net) -> None:
    """A connection's first channel takes its own place; each further one
    counts as a connection, and one over the cap is ended with a warning."""
    broker, endpoint = await start_broker(net, limits=Limits(maxConnections=3))
    bound = binding_of(broker)
    start_worker(net, endpoint, "echo", echo)
    refusals = LogLines(net, "opened a channel over the cap")
    raw = await raw_channels(net, endpoint)
    raw.transport.write(on(1, request(b"1")) + on(2, request(b"2")) + on(3, request(b"3")))
    await net.until(lambda: len(raw.received) == 3)
    got = dict(raw.received)
    assert got[(3).to_bytes(4, "big")] == []  # ended: worker + 2 channels fill the cap
    assert got[(1).to_bytes(4, "big")][-1] == b"1" and got[(2).to_bytes(4, "big")][-1] == b"2"
    assert bound.refused == 1 and refusals.lines
    # until the peer says it knows, what comes on the ended channel is ignored
    raw.transport.write(on(3, request(b"again")) + on(1, request(b"one")))
    await net.until(lambda: len(raw.received) == 4)
    assert raw.received[3][0] == (1).to_bytes(4, "big")


@pytest_twisted.ensureDeferred
async def test_pipes_discard_only_their_own_stale_messages(net: Net) -> None:
    """discardReceived drops what is still to come, in the read being
    delivered, for that pipe alone."""
    links = StreamChannels("tcp:host=127.0.0.1:port=1", net.reactor)
    seen: dict[str, list[list[bytes]]] = {"a": [], "b": []}
    pipes: dict[str, Any] = {}

    def received(name: str, frames: list[bytes]) -> None:
        seen[name].append(frames)
        if frames == [b"a1"]:
            assert pipes["b"].discardReceived() == 2

    pipes["a"] = links.open(Pipe("a", onMessage=received))
    pipes["b"] = links.open(Pipe("b", onMessage=received))
    proto: Any = type("P", (), {"closing": False})()
    links.protocol = proto
    pipes["a"].up = pipes["b"].up = True
    a, b = pipes["a"].id, pipes["b"].id
    links._dispatch(proto, [(b, [b"b0"]), (a, [b"a1"]), (b, [b"b1"]), (a, [b"a2"]), (b, [b"b2"])])
    assert seen == {"a": [[b"a1"], [b"a2"]], "b": [[b"b0"]]}
    links.protocol = None
    await links.close()


@pytest_twisted.ensureDeferred
async def test_every_pipe_is_down_before_any_hears_the_connection_is_lost(net: Net) -> None:
    """A receiver told of the loss may send on another pipe at once: that
    pipe is already down, so what it sends waits for the next connection."""
    from twisted.internet.error import ConnectionLost
    from twisted.python.failure import Failure

    links = StreamChannels("tcp:host=127.0.0.1:port=1", net.reactor)
    told: list[str] = []
    pipes: dict[str, Any] = {}

    def lost(name: str) -> None:
        told.append(name)
        other = pipes["b" if name == "a" else "a"]
        assert not other.connected
        other.sendMessage([b"sent while down"])

    pipes["a"] = links.open(Pipe("a", onLost=lost))
    pipes["b"] = links.open(Pipe("b", onLost=lost))
    proto: Any = type("P", (), {"closing": False, "refusal": None})()
    links.protocol = proto
    pipes["a"].up = pipes["b"].up = True
    links._lost(proto, Failure(ConnectionLost()))
    assert sorted(told) == ["a", "b"]
    assert [frames for _, frames in links.queue] == [[b"sent while down"]] * 2
    assert links.queued == 2
    await links.close()
    assert links.queued == links.queuedBytes == 0


@pytest_twisted.ensureDeferred
async def test_a_pipe_sends_what_it_was_given_before_it_came_up(net: Net) -> None:
    """A pipe opened while the connection is up comes up a reactor turn
    later, and one the far side ended comes back after the reconnection
    delay: what it is given meanwhile goes out once it is up, on its own
    channel, not at some later connection."""
    router = RawRouter()
    router.clock = net.reactor
    bound = await net.wait(StreamRouter.listen(net.bindEndpoint(), router, net.reactor))
    net.addCleanup(bound.close)
    links = StreamChannels(bound.endpoint, net.reactor, retryPolicy=lambda attempt: 0.01)
    net.addCleanup(links.close)
    first = links.open(Pipe("first"))
    await net.until(lambda: first.connected)
    pipes: dict[str, Any] = {}
    # told its channel was ended, it sends at once, before it is made again
    pipes["second"] = second = links.open(Pipe(
        "second", onLost=lambda name: pipes[name].sendMessage([b"while ended"])))
    assert not second.connected
    second.sendMessage([b"before it was up"])
    await net.until(lambda: len(router.received) == 1, timeout=10)
    _, peer, frames = router.received[0]
    assert frames == [b"before it was up"] and peer == bound.connections[peer[:5]].peer + second.id
    bound.disconnectPeer(peer)
    await net.until(lambda: len(router.received) == 2, timeout=10)
    _, again, frames = router.received[1]
    assert frames == [b"while ended"] and again != peer and again[:5] == peer[:5]
    assert links.queued == links.queuedBytes == 0


@pytest_twisted.ensureDeferred
async def test_a_listener_full_of_channels_refuses_rather_than_drop_another_listeners_peer(
        net: Net) -> None:
    """A listener at its own maxConnections (here: two channels on one
    connection) makes room only from its own silent connections: with none,
    the newcomer is refused, and another listener's silent connection, far
    below that one's cap, stays."""
    full = RawRouter()
    full.clock = net.reactor
    capped = await net.wait(StreamRouter.listen(net.bindEndpoint(), full, net.reactor,
                                                limits=Limits(maxConnections=2)))
    net.addCleanup(capped.close)
    roomy = RawRouter()
    roomy.clock = net.reactor
    other = await net.wait(StreamRouter.listen(net.bindEndpoint(), roomy, net.reactor))
    net.addCleanup(other.close)
    raw = await raw_channels(net, capped.endpoint)
    raw.transport.write(on(1, [b"one"]) + on(2, [b"two"]))
    await net.until(lambda: len(capped.channels) == 2)
    silent = await raw_stream(net, other.endpoint)
    await net.until(lambda: len(other.connections) == 1)
    newcomer = await raw_stream(net, capped.endpoint)
    await net.until(lambda: newcomer.lost.called or silent.lost.called, timeout=10)
    assert newcomer.lost.called and not silent.lost.called
    assert capped.refused == 1 and len(capped.channels) == 2
    assert len(other.connections) == 1 and roomy.disconnected == []
