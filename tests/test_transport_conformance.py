"""The contract every registered transport keeps, checked over each of them.

A transport moves lists of byte frames between a bound side
(:class:`~mdp.interfaces.IRouterTransport`) and connecting sides
(:class:`~mdp.interfaces.IDealerTransport`).  Whatever the medium: messages
arrive whole and in order, frames keep their boundaries (empty ones too),
large messages pass and messages over the limit never do, the loss of a
peer is reported where the medium has connections, ``writable``/``drained()``
tell a sender when to wait, ``close()`` may be called twice, and every
mistake is a :class:`~mdp.errors.TransportError`.

Each registered scheme is listed in ``BINDS`` below; a scheme registered
without an entry fails :func:`test_every_registered_scheme_is_covered`.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import os
from typing import Any, Callable, Optional

import pytest
import pytest_twisted
from twisted.internet import defer, task
from zope.interface import implementer
from zope.interface.verify import verifyObject

from mdp import transport
from mdp.errors import TransportError
from mdp.interfaces import (
    IDealerReceiver,
    IDealerTransport,
    IPeerRouterReceiver,
    IPeerRouterTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.policy import Limits

_names = itertools.count()

#: schemes that are stand-ins, not media (they move no message)
NOT_MEDIA = {"script"}


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


def _certificate(directory: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost: (key, cert) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    keyPath = os.path.join(directory, "key.pem")
    certPath = os.path.join(directory, "cert.pem")
    with open(keyPath, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(certPath, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return keyPath, certPath


def _port(endpoint: str) -> str:
    return endpoint.rpartition("port=")[2].partition(":")[0]


# scheme -> (bind endpoint for a temp directory, how to reach the bound endpoint)
BINDS: dict[str, tuple[Callable[[str], str], Callable[[str, str], str]]] = {
    "zmq": (lambda d: "zmq:tcp://127.0.0.1:*", lambda bound, d: bound),
    "loopback": (lambda d: f"loopback:conformance-{next(_names)}", lambda bound, d: bound),
    "tcp": (lambda d: "tcp:host=127.0.0.1:port=0", lambda bound, d: bound),
    # tcp6: only listens; tcp: connects to IPv6 hosts
    "tcp6": (lambda d: r"tcp6:port=0:interface=\:\:1", lambda bound, d: bound),
    "unix": (lambda d: f"unix:path={d}/s.sock", lambda bound, d: f"unix:path={d}/s.sock"),
    "ssl": (lambda d: f"ssl:0:interface=127.0.0.1:privateKey={d}/key.pem:certKey={d}/cert.pem"
            , lambda bound, d: f"ssl:host=127.0.0.1:port={_port(bound)}"),
    # tls: only connects; it reaches an ssl: listener and checks its certificate
    "tls": (lambda d: f"ssl:0:interface=127.0.0.1:privateKey={d}/key.pem:certKey={d}/cert.pem"
            ,
            lambda bound, d: f"tls:host=127.0.0.1:port={_port(bound)}:trustRoots={d}/roots"),
    # sessions over three media: the same contract, with connections hidden
    "session+zmq": (lambda d: "session+zmq:tcp://127.0.0.1:*", lambda bound, d: bound),
    "session+tcp": (lambda d: "session+tcp:host=127.0.0.1:port=0", lambda bound, d: bound),
    "session+loopback": (lambda d: f"session+loopback:conformance-{next(_names)}",
                         lambda bound, d: bound),
}
SCHEMES = sorted(BINDS)


def sessions(p: Pair) -> bool:
    return p.scheme.startswith("session+")


def test_every_registered_scheme_is_covered() -> None:
    registered = {s.name for s in transport.schemes()} - NOT_MEDIA
    assert registered <= set(BINDS), f"no conformance entry for {registered - set(BINDS)}"


@implementer(IRouterReceiver)
class Router:
    def __init__(self) -> None:
        self.received: list[tuple[bytes, list[bytes]]] = []
        self.gone: list[bytes] = []

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.received.append((peer, frames))

    def peerDisconnected(self, peer: bytes) -> None:
        self.gone.append(peer)


@implementer(IDealerReceiver)
class Dealer:
    def __init__(self) -> None:
        self.received: list[list[bytes]] = []
        self.made = 0
        self.lost: list[Any] = []

    def connectionMade(self) -> None:
        self.made += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        self.received.append(frames)

    def connectionLost(self, reason: object) -> None:
        self.lost.append(reason)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    r = reactor()
    deadline = r.seconds() + timeout
    while not predicate():
        if r.seconds() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await task.deferLater(r, 0.002)


class Pair:
    """A bound router and a way to connect dealers to it, closed at the end."""

    def __init__(self, scheme: str, directory: str) -> None:
        self.scheme = scheme
        self.directory = directory
        self.closing: list[Any] = []
        self.router = Router()
        self.bound: Optional[Any] = None

    async def listen(self, limits: Limits = Limits()) -> Any:
        bind, _ = BINDS[self.scheme]
        self.bound = await transport.listen(bind(self.directory), self.router, reactor(), limits=limits)
        self.closing.append(self.bound)
        return self.bound

    @property
    def endpoint(self) -> str:
        assert self.bound is not None
        return BINDS[self.scheme][1](self.bound.endpoint, self.directory)

    async def connect(self, limits: Limits = Limits(), identity: Optional[bytes] = None
                      ) -> tuple[Dealer, Any]:
        receiver = Dealer()
        pipe = transport.connect(self.endpoint, receiver, reactor(), limits=limits,
                                 retryPolicy=lambda attempt: 0.05, identity=identity)
        self.closing.append(pipe)
        await until(lambda: receiver.made >= 1)
        return receiver, pipe

    async def hello(self, pipe: Any) -> bytes:
        """Send one message so the router learns the peer; return its id."""
        count = len(self.router.received)
        pipe.sendMessage([b"hello"])
        await until(lambda: len(self.router.received) > count)
        return self.router.received[-1][0]

    async def close(self) -> None:
        for t in reversed(self.closing):
            await t.close()


@pytest_twisted.async_yield_fixture(params=SCHEMES)
async def pair(request: Any, tmp_path: Any) -> Any:
    directory = str(tmp_path)
    if request.param in ("ssl", "tls"):
        _, cert = _certificate(directory)
        os.mkdir(f"{directory}/roots")
        os.link(cert, f"{directory}/roots/root.pem")
    p = Pair(request.param, directory)
    yield p
    await p.close()


def connections(p: Pair) -> bool:
    return transport.lookup(p.endpoint, transport.CONNECT).connections


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_interfaces_are_provided(pair: Pair) -> None:
    bound = await pair.listen()
    _, pipe = await pair.connect()
    verifyObject(IRouterTransport, bound)
    verifyObject(IDealerTransport, pipe)
    assert isinstance(bound.endpoint, str) and bound.endpoint


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_order_multipart_and_empty_frames_both_ways(pair: Pair) -> None:
    await pair.listen()
    dealer, pipe = await pair.connect()
    peer = await pair.hello(pipe)
    messages = [[b"%d" % n, b"", b"x" * (n % 7), b""] for n in range(200)]
    for m in messages:
        pipe.sendMessage(m)
    await until(lambda: len(pair.router.received) == 201)
    assert [frames for _, frames in pair.router.received[1:]] == messages
    assert {p for p, _ in pair.router.received} == {peer}
    for m in messages:
        pair.bound.sendMessage(peer, m)
    await until(lambda: len(dealer.received) == 200)
    assert dealer.received == messages
    pipe.sendMessage([b""])  # a message of one empty frame
    await until(lambda: len(pair.router.received) == 202)
    assert pair.router.received[-1] == (peer, [b""])


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_large_messages_pass(pair: Pair) -> None:
    await pair.listen()
    dealer, pipe = await pair.connect()
    peer = await pair.hello(pipe)
    big = [os.urandom(4 * 1024 * 1024), b"tail"]
    pipe.sendMessage(big)
    pair.bound.sendMessage(peer, big)
    await until(lambda: len(pair.router.received) == 2 and len(dealer.received) == 1)
    assert pair.router.received[1][1] == big
    assert dealer.received[0] == big


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_message_over_the_limit_is_never_delivered(pair: Pair) -> None:
    limits = Limits(maxMessageBytes=1000)
    await pair.listen(limits)
    dealer, pipe = await pair.connect(limits)
    peer = await pair.hello(pipe)
    pipe.sendMessage([b"x" * 1001])
    pipe.sendMessage([b"after"])
    if sessions(pair):
        # the session drops the message (logged) and goes on, connection and all
        await until(lambda: any(f == [b"after"] for _, f in pair.router.received[1:]))
        dealer2, pipe2 = await pair.connect(limits)
        peer2 = await pair.hello(pipe2)
        pair.bound.sendMessage(peer2, [b"y" * 1001])
        pair.bound.sendMessage(peer2, [b"small"])
        await until(lambda: dealer2.received == [[b"small"]])
        assert all(len(b"".join(f)) <= 1000 for _, f in pair.router.received)
        assert dealer2.lost == [] and dealer2.made == 1
        return
    if connections(pair):
        # the offending connection ends, and its loss is reported; nothing
        # sent after it on that connection is delivered
        await until(lambda: peer in pair.router.gone)
        assert (peer, [b"after"]) not in pair.router.received
    else:
        # libzmq drops the offending pipe (ZMQ_MAXMSGSIZE), with what followed
        # on it, and the DEALER reconnects under a new routing id
        for _n in range(200):
            if any(f == [b"after"] for _, f in pair.router.received[1:]):
                break
            pipe.sendMessage([b"after"])
            await task.deferLater(reactor(), 0.02)
        assert any(f == [b"after"] for _, f in pair.router.received[1:])
    assert all(len(b"".join(f)) <= 1000 for _, f in pair.router.received)
    # the dealer side refuses oversized input as well
    dealer2, pipe2 = await pair.connect(limits)
    peer2 = await pair.hello(pipe2)
    pair.bound.sendMessage(peer2, [b"y" * 1001])
    pair.bound.sendMessage(peer2, [b"small"])
    # every transport ends the pipe that carried it, and says so
    await until(lambda: len(dealer2.lost) >= 1)
    await until(lambda: dealer2.made >= 2)  # and a new one comes up
    assert [b"y" * 1001] not in dealer2.received


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_disconnects_are_reported_where_the_medium_has_connections(pair: Pair) -> None:
    await pair.listen()
    dealer, pipe = await pair.connect()
    peer = await pair.hello(pipe)
    if not connections(pair):
        # ZeroMQ and sessions hide connections (heartbeats find lost peers): disconnectPeer
        # is a no-op and the pipe keeps carrying messages both ways
        pair.bound.disconnectPeer(peer)
        pair.bound.sendMessage(peer, [b"still here"])
        await until(lambda: dealer.received == [[b"still here"]])
        await pair.hello(pipe)
        assert dealer.lost == [] and pair.router.gone == []
        return
    await pipe.close()
    await until(lambda: pair.router.gone == [peer])
    # and the other way: the router drops a peer, the dealer hears of it
    dealer2, pipe2 = await pair.connect()
    peer2 = await pair.hello(pipe2)
    pair.bound.disconnectPeer(peer2)
    await until(lambda: len(dealer2.lost) == 1 and peer2 in pair.router.gone)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_writable_and_drained(pair: Pair) -> None:
    """drained() fires at once while writable; after a burst larger than any
    buffer it fires once the far side has read, and nothing is lost."""
    await pair.listen()
    dealer, pipe = await pair.connect()
    await pair.hello(pipe)
    assert pipe.writable is True
    fired: list[Any] = []
    pipe.drained().addBoth(fired.append)
    assert fired == [None]
    chunk = b"z" * 65536
    for n in range(256):  # 16 MiB: past socket buffers and high-water marks
        pipe.sendMessage([b"%d" % n, chunk])
    await pipe.drained()
    await until(lambda: len(pair.router.received) == 257, timeout=30)
    assert [f[0] for _, f in pair.router.received[1:]] == [b"%d" % n for n in range(256)]
    assert pipe.writable is True


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_close_is_idempotent(pair: Pair) -> None:
    bound = await pair.listen()
    _, pipe = await pair.connect()
    for t in (pipe, bound):
        await t.close()
        await t.close()
    pipe.sendMessage([b"after close"])  # ignored, never raises
    bound.sendMessage(b"nobody", [b"after close"])


@pytest.mark.parametrize("scheme", ["loopback", "zmq", "tcp"])
@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_closing_a_set_of_pipes_closes_every_pipe(scheme: str, tmp_path: Any) -> None:
    """``connect_channels(...).close()`` closes every pipe it opened for good,
    whether they share a connection (stream channels) or each has its own
    (ZeroMQ, loopback): none is up after, and nothing sent on one then
    reaches the router."""
    p = Pair(scheme, str(tmp_path))
    try:
        await p.listen()
        link = transport.connect_channels(p.endpoint, reactor(), retryPolicy=lambda attempt: 0.05)
        receivers = [Dealer() for _ in range(3)]
        pipes = [link.open(receiver) for receiver in receivers]
        await until(lambda: all(pipe.connected for pipe in pipes))
        await link.close()
        if connections(p):  # (a ZeroMQ DEALER says it is connected for good)
            assert not any(pipe.connected for pipe in pipes)
        for pipe in pipes:
            pipe.sendMessage([b"after close"])
        # a message from a pipe opened later marks what came before it
        # (one pipe of a set of its own: its stale messages, were they
        # sent, would come first on a stream and on loopback)
        marker, pipe = await p.connect()
        pipe.sendMessage([b"marker"])
        await until(lambda: any(frames == [b"marker"] for _, frames in p.router.received))
        assert [frames for _, frames in p.router.received] == [[b"marker"]]
    finally:
        await p.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_connect_can_choose_the_identity_the_router_sees(pair: Pair) -> None:
    await pair.listen()
    if not transport.lookup(pair.endpoint, transport.CONNECT).identities:
        # a session is named by the router (a short routing id), not the client
        with pytest.raises(TransportError, match="cannot choose their identity"):
            transport.connect(pair.endpoint, Dealer(), reactor(), identity=b"session-42")
        return
    dealer, pipe = await pair.connect(identity=b"session-42")
    assert await pair.hello(pipe) == b"session-42"
    pair.bound.sendMessage(b"session-42", [b"to you"])
    await until(lambda: dealer.received == [[b"to you"]])


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_binding_twice_fails_with_a_transport_error(pair: Pair) -> None:
    bound = await pair.listen()
    if sessions(pair):
        inner = bound.endpoint.replace("session+", "", 1)
        again = "session+" + (inner.replace("host=", "interface=") if inner.startswith("tcp:")
                              else inner)
    elif pair.scheme in ("tcp", "tcp6", "ssl", "tls", "zmq"):
        again = bound.endpoint if pair.scheme != "tls" else None
        if pair.scheme == "ssl" or pair.scheme == "tls":
            again = BINDS["ssl"][0](pair.directory).replace(":0:", f":{_port(bound.endpoint)}:")
        elif pair.scheme in ("tcp", "tcp6"):
            again = bound.endpoint.replace("host=", "interface=")
    else:
        again = BINDS[pair.scheme][0](pair.directory) if pair.scheme == "unix" else bound.endpoint
    with pytest.raises(TransportError):
        second = await transport.listen(again, Router(), reactor())
        pair.closing.append(second)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_malformed_endpoints_raise_a_transport_error_at_once(scheme: str) -> None:
    broken = {"zmq": "zmq:tcp://127.0.0.1", "loopback": "loopback:", "tcp": "tcp:host=127.0.0.1",
              "tcp6": "tcp:host=\\:\\:1", "unix": "unix:", "ssl": "ssl:host=127.0.0.1",
              "tls": "tls:host=127.0.0.1", "session+zmq": "session+zmq:tcp://127.0.0.1",
              "session+tcp": "session+tcp:host=127.0.0.1",
              "session+loopback": "session+loopback:"}[scheme]
    with pytest.raises(TransportError, match="bad endpoint"):
        transport.connect(broken, Dealer(), task.Clock())
    unbindable = {"zmq": "zmq:tcp://127.0.0.1:65536", "loopback": "loopback:",
                  "tcp": "tcp:port=x", "tcp6": "tcp6:port=99999", "unix": "unix:",
                  "ssl": "ssl:0:privateKey=/nonexistent.pem", "tls": "tls:host=a:port=1",
                  "session+zmq": "session+zmq:tcp://127.0.0.1:65536",
                  "session+tcp": "session+tcp:port=x",
                  "session+loopback": "session+loopback:"}[scheme]
    with pytest.raises(TransportError, match="bad endpoint"):
        transport.listen(unbindable, Router(), task.Clock())


@pytest.mark.parametrize("endpoint, says", [
    ("tcp://127.0.0.1:5555", "did you mean zmq:tcp://127.0.0.1:5555"),
    ("zmq:tcp://127.0.0.1", "no port; did you mean zmq:tcp://127.0.0.1:5555?"),
    ("zmq:tcp://127.0.0.1:70000", "port 70000 is out of range"),
    ("zmq:tcp://127.0.0.1:*", "'*' picks a port when binding"),
    ("nope:path=1", "unknown scheme 'nope'"),
    ("nope:1", "an address with no scheme; did you mean zmq:tcp://nope:1"),
    ("ipc:5555", "'ipc' is a ZeroMQ transport: name it after zmq:, as in zmq:ipc://..."),
    ("5555", "no scheme"),
    ("tcp:host=127.0.0.1:port=0", "port 0 is out of range"),
    ("TCP://127.0.0.1:5555", "did you mean zmq:tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1", "did you mean zmq:tcp://127.0.0.1:PORT (ZeroMQ) or "
                        "tcp:host=127.0.0.1:port=PORT (framed TCP)?"),
    ("tcp://*:5555", "did you mean zmq:tcp://127.0.0.1:5555"),
    ("tcp://[::1]:5555", "did you mean zmq:tcp://[::1]:5555 (ZeroMQ) or "
                         "tcp:host=\\:\\:1:port=5555 (framed TCP)?"),
])
def test_endpoint_mistakes_name_the_endpoint_and_what_was_meant(endpoint: str, says: str) -> None:
    with pytest.raises(TransportError) as caught:
        transport.connect(endpoint, Dealer(), task.Clock())
    assert endpoint in str(caught.value) and says in str(caught.value)


def test_a_new_scheme_is_one_registration() -> None:
    made: list[str] = []

    def check(endpoint: str, role: str) -> None:
        if endpoint.endswith(":"):
            raise TransportError(f"bad endpoint {endpoint!r}: empty")

    def connect(endpoint: str, receiver: Any, reactor: Any, limits: Limits, retryPolicy: Any,
                identity: Optional[bytes]) -> Any:
        made.append(endpoint)
        return object()

    transport.register(transport.Scheme("pigeon", check, None, connect, "by bird"))
    try:
        transport.connect("pigeon:coop", Dealer(), task.Clock())
        assert made == ["pigeon:coop"]
        with pytest.raises(TransportError, match="empty"):
            transport.connect("pigeon:", Dealer(), task.Clock())
        with pytest.raises(TransportError, match="cannot listen"):
            transport.listen("pigeon:coop", Router(), task.Clock())
        with pytest.raises(ValueError, match="already registered"):
            transport.register(transport.Scheme("pigeon", check))
    finally:
        transport.unregister("pigeon")
    with pytest.raises(TransportError, match="unknown scheme"):
        transport.connect("pigeon:coop", Dealer(), task.Clock())


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "zmq" and not s.startswith("session+")])
@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_newer_connection_takes_over_an_identity(scheme: str, tmp_path: Any) -> None:
    """The older connection is dropped (and told so); the identity itself is
    never reported gone, and what is sent to it reaches the newer one.
    (ZeroMQ: ``ZMQ_ROUTER_HANDOVER`` does the same inside libzmq, unseen.)"""
    directory = str(tmp_path)
    if scheme in ("ssl", "tls"):
        _, cert = _certificate(directory)
        os.mkdir(f"{directory}/roots")
        os.link(cert, f"{directory}/roots/root.pem")
    p = Pair(scheme, directory)
    try:
        await p.listen()
        first, second = Dealer(), Dealer()
        slow = {"retryPolicy": lambda attempt: 60.0}  # the old one does not come back
        a = transport.connect(p.endpoint, first, reactor(), identity=b"me", **slow)
        p.closing.append(a)
        await until(lambda: first.made == 1)
        assert await p.hello(a) == b"me"
        b = transport.connect(p.endpoint, second, reactor(), identity=b"me", **slow)
        p.closing.append(b)
        await until(lambda: second.made == 1)
        assert await p.hello(b) == b"me"
        await until(lambda: len(first.lost) == 1)
        p.bound.sendMessage(b"me", [b"to the newer one"])
        await until(lambda: second.received == [[b"to the newer one"]])
        assert first.received == [] and p.router.gone == []
    finally:
        await p.close()


@pytest.mark.parametrize("endpoint", [
    "zmq:tcp://a b:5555", "zmq:tcp://127.0.0.1:+5555", "zmq:tcp://127.0.0.1:\u0665\u0665",
    "tcp:host=127.0.0.1:port= 80", "zmq:tcp://:5555", "zmq:pgm://eth0;239.1.1.1:5555",
])
def test_every_endpoint_mistake_is_a_transport_error_before_anything_starts(endpoint: str) -> None:
    with pytest.raises(TransportError, match="bad endpoint"):
        transport.connect(endpoint, Dealer(), task.Clock())


def test_what_the_medium_raises_is_a_transport_error() -> None:
    def connect(*args: Any) -> Any:
        raise RuntimeError("the medium said no")

    def listen(*args: Any) -> Any:
        raise OSError("no such device")

    transport.register(transport.Scheme("fragile", lambda e, r: None, listen, connect))
    try:
        with pytest.raises(TransportError, match="the medium said no"):
            transport.connect("fragile:x", Dealer(), task.Clock())
        failed: list[Any] = []
        transport.listen("fragile:x", Router(), task.Clock()).addErrback(failed.append)
        assert failed and failed[0].check(TransportError)
    finally:
        transport.unregister("fragile")


def test_identities_and_endpoints_are_checked_for_type() -> None:
    with pytest.raises(ValueError, match="identity"):
        transport.connect("loopback:x", Dealer(), task.Clock(), identity=b"\x00zero")
    with pytest.raises(TransportError, match="an endpoint is a string"):
        transport.connect(42, Dealer(), task.Clock())  # type: ignore[arg-type]


@implementer(IPeerRouterReceiver)
class PeerReceiver:
    def __init__(self) -> None:
        self.received: list[tuple[str, list[bytes]]] = []

    def messageReceived(self, endpoint: str, frames: list[bytes]) -> None:
        self.received.append((endpoint, frames))


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_connecting_router_addresses_servers_by_endpoint(pair: Pair) -> None:
    """IPeerRouterTransport (the Freelance agent's): one connection to many
    servers, each named by the endpoint it was connected with; nothing is
    queued for a server whose pipe is not up, as on a ZeroMQ ROUTER."""
    await pair.listen()
    receiver = PeerReceiver()
    peers = transport.connect_peers(receiver, reactor())
    verifyObject(IPeerRouterTransport, peers)
    try:
        peers.connect(pair.endpoint)
        peers.connect(pair.endpoint)  # again: no second connection
        for _ in range(500):
            if pair.router.received:
                break
            peers.sendMessage(pair.endpoint, [b"PING"])
            await task.deferLater(reactor(), 0.01)
        peer, frames = pair.router.received[0]
        assert frames == [b"PING"]
        pair.bound.sendMessage(peer, [b"PONG", b""])
        await until(lambda: receiver.received == [(pair.endpoint, [b"PONG", b""])])
        peers.sendMessage("tcp:host=127.0.0.1:port=9", [b"to nobody"])  # unknown: dropped
    finally:
        await peers.close()
        await peers.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_stream_delivers_what_came_before_an_oversized_record_in_the_same_read() -> None:
    """A read holds whole messages and then the header of one over the
    limits: those messages are delivered, then the connection ends on the
    oversized one (they were thrown away with it)."""
    import struct

    from twisted.internet import protocol
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from mdp.errors import OversizedMessage
    from mdp.transport.framing import encode_record

    class Sends(protocol.Protocol):
        def connectionMade(self) -> None:  # one write: one read, on loopback
            self.transport.write(encode_record([b"first"]) + encode_record([b"second", b"2"])
                                 + struct.pack(">I", 50_000))

    listening = await TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(
        protocol.Factory.forProtocol(Sends))
    dealer = Dealer()
    pipe = transport.connect(f"tcp:host=127.0.0.1:port={listening.getHost().port}", dealer,
                             reactor(), limits=Limits(maxMessageBytes=1000))
    try:
        await until(lambda: len(dealer.lost) >= 1)
        assert dealer.received[:2] == [[b"first"], [b"second", b"2"]]
        assert isinstance(getattr(dealer.lost[0], "value", dealer.lost[0]), OversizedMessage)
    finally:
        await pipe.close()
        await listening.stopListening()



@pytest.mark.parametrize("scheme", ["tls", "tcp", "tcp-speaking"])
@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_connections_that_fail_their_tls_handshake_back_off(scheme: str, tmp_path: Any) -> None:
    """A listener that takes the TCP connection and then refuses the TLS
    handshake (here: a certificate the connecting side does not trust), or
    that ends a plain TCP connection at once, saying nothing (a listener at
    its cap), is retried with a growing delay, as a refused connection is; a
    connection over which the far side spoke starts the backoff again."""
    from twisted.internet import protocol
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from mdp.transport.framing import encode_record

    directory = str(tmp_path)
    _certificate(directory)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    _, foreign = _certificate(str(stranger))
    os.mkdir(f"{directory}/roots")
    os.link(foreign, f"{directory}/roots/root.pem")  # not the listener's certificate
    p = Pair(scheme, directory)
    if scheme == "tls":
        await p.listen()
        endpoint = p.endpoint
    else:
        class Ends(protocol.Protocol):
            def connectionMade(self) -> None:
                if scheme == "tcp-speaking":
                    self.transport.write(encode_record([b"a word, then gone"]))
                self.transport.loseConnection()

        listening = await TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(
            protocol.Factory.forProtocol(Ends))
        p.closing.append(type("Port", (), {"close": lambda self: listening.stopListening()})())
        endpoint = f"tcp:host=127.0.0.1:port={listening.getHost().port}"
    attempts: list[int] = []
    three: defer.Deferred[None] = defer.Deferred()

    def policy(attempt: int) -> float:
        attempts.append(attempt)
        if len(attempts) == 3:  # (not from within ClientService's transition)
            reactor().callLater(0, three.callback, None)
        return 0.01

    dealer = Dealer()
    p.closing.append(transport.connect(endpoint, dealer, reactor(), retryPolicy=policy))
    try:
        await three
        assert attempts[:3] == ([1, 1, 1] if scheme == "tcp-speaking" else [1, 2, 3])
    finally:
        await p.close()
