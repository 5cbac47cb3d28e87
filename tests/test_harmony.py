"""Harmony nodes on the loopback transports (messages and beacons in
memory), driven by a Clock: discovery, groups, timing, and bad input."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task

from mdp.errors import TransportError
from mdp.harmony import BeaconDiscovery, EndpointDiscovery, Event, Node, UnknownPeer, codec
from mdp.transport import datagram
from tests.conftest import refuse_connections

_lans = itertools.count(1)


class Lan:
    """A loopback LAN: nodes on it hear each other's beacons."""

    def __init__(self, net: Any) -> None:
        self.net = net
        self.name = f"lan{next(_lans)}"
        self.hosts = itertools.count(1)

    async def node(self, name: str, *groups: str, start: bool = True, **options: Any) -> Node:
        host = f"10.0.0.{next(self.hosts)}"
        options.setdefault("discovery", BeaconDiscovery(f"loopback:{self.name}:host={host}",
                                                        reactor=self.net.reactor))
        options.setdefault("endpoint", f"loopback:{host}:*")
        node = Node(name, self.net.reactor, headers={"X-NAME": name}, **options)
        node.seen = []  # type: ignore[attr-defined]
        node.subscribe(node.seen.append)  # type: ignore[attr-defined]
        for group in groups:
            node.join(group)
        if start:
            await self.net.wait(node.start())
            self.net.addCleanup(node.stop)
        return node


def kinds(node: Node, peer: Any = None) -> list[tuple[str, Any]]:
    return [(e.kind, e.group) for e in node.seen if peer is None or e.peer == peer.uuid]


@pytest.fixture
def lan(clocknet: Any) -> Lan:
    return Lan(clocknet)


@pytest_twisted.ensureDeferred
async def test_two_nodes_find_each_other_within_a_beacon_interval(lan: Lan) -> None:
    alice = await lan.node("alice")
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers() and bob.peers(), timeout=1.0)
    assert alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid]
    enter = [e for e in alice.seen if e.kind == "ENTER"][0]
    assert (enter.name, enter.headers["X-NAME"], enter.endpoint) == ("bob", "bob", bob.endpoint)
    assert alice.peerName(bob.uuid) == "bob" and alice.peerHeaders(bob.uuid) == {"X-NAME": "bob"}
    assert alice.peerEndpoint(bob.uuid) == bob.endpoint


@pytest_twisted.ensureDeferred
async def test_groups_shout_whisper_join_leave(lan: Lan) -> None:
    alice = await lan.node("alice", "chat", "ops")
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers() and bob.peers())
    assert kinds(bob, alice) == [("ENTER", None), ("JOIN", "chat"), ("JOIN", "ops")]
    assert bob.peerGroups() == ["chat", "ops"] and bob.peersByGroup("chat") == [alice.uuid]
    bob.join("chat")
    await lan.net.until(lambda: ("JOIN", "chat") in kinds(alice, bob))
    assert bob.ownGroups() == ["chat"]
    alice.shout("chat", b"hello", b"all")
    alice.shout("nobody-here", b"lost")
    bob.whisper(alice.uuid, b"psst")
    await lan.net.until(lambda: ("SHOUT", "chat") in kinds(bob) and ("WHISPER", None) in kinds(alice))
    shout = [e for e in bob.seen if e.kind == "SHOUT"]
    assert [(e.group, e.frames) for e in shout] == [("chat", (b"hello", b"all"))]
    assert [e.frames for e in alice.seen if e.kind == "WHISPER"] == [(b"psst",)]
    alice.leave("ops")
    await lan.net.until(lambda: ("LEAVE", "ops") in kinds(bob))
    assert bob.peerGroups() == ["chat"]
    bob.shout("ops", b"no one")  # alice left: nothing goes
    lan.net.advance(0.1)
    assert ("SHOUT", "ops") not in kinds(alice)


@pytest_twisted.ensureDeferred
async def test_events_as_an_async_iterator_that_ends_when_the_node_stops(lan: Lan) -> None:
    alice = await lan.node("alice")
    stream = alice.events()
    bob = await lan.node("bob", "g")
    got: list[Event] = []

    async def read() -> None:
        async for event in stream:
            got.append(event)

    reading = defer.ensureDeferred(read())
    await lan.net.until(lambda: len(got) >= 2)
    assert [(e.kind, e.peer) for e in got] == [("ENTER", bob.uuid), ("JOIN", bob.uuid)]
    await lan.net.wait(alice.stop())
    await lan.net.wait(reading)
    assert [e async for e in alice] == []  # a stopped node has no more events


@pytest_twisted.ensureDeferred
async def test_stop_is_an_exit_at_once_through_a_port_zero_beacon(lan: Lan) -> None:
    alice = await lan.node("alice")
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers())
    stopped = lan.net.reactor.seconds()
    await lan.net.wait(bob.stop())
    await lan.net.until(lambda: ("EXIT", None) in kinds(alice))
    assert lan.net.reactor.seconds() - stopped < 0.1
    assert alice.peers() == []


def kill(node: Node) -> None:
    """The node vanishes: no port-0 beacon, nothing more from it."""
    if isinstance(node.discovery, BeaconDiscovery):
        node.discovery.loop.stop()  # type: ignore[union-attr]
        node.discovery.socket.close()  # type: ignore[union-attr]
    node._tick.stop()  # type: ignore[union-attr]
    node.router.close()
    for link in node.links.values():
        link.close()
    node.running = False


@pytest_twisted.ensureDeferred
async def test_a_silent_peer_is_evasive_then_expired_on_time(lan: Lan) -> None:
    alice = await lan.node("alice", evasive=5.0, expired=30.0)
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers())
    killed = lan.net.reactor.seconds()
    kill(bob)
    await lan.net.until(lambda: ("EVASIVE", None) in kinds(alice), timeout=10)
    evasive = lan.net.reactor.seconds() - killed
    await lan.net.until(lambda: ("EXIT", None) in kinds(alice), timeout=40)
    expired = lan.net.reactor.seconds() - killed
    # silent from the last beacon (up to 1 s before the kill), seen at the next tick (1 s)
    assert 4.0 <= evasive <= 6.0 and 29.0 <= expired <= 31.0
    assert kinds(alice, bob).count(("EVASIVE", None)) == 1


@pytest_twisted.ensureDeferred
async def test_an_answering_peer_is_never_evasive(lan: Lan) -> None:
    """Only beacons stop: the peer's PING-OKs keep it alive."""
    alice = await lan.node("alice", evasive=2.0, expired=6.0)
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers())
    bob.discovery.loop.stop()  # type: ignore[attr-defined]
    lan.net.advance(20)
    assert alice.peers() == [bob.uuid]
    assert ("EXIT", None) not in kinds(alice)


@pytest_twisted.ensureDeferred
async def test_a_restarted_node_is_an_exit_and_a_new_enter(lan: Lan) -> None:
    endpoints = ["loopback:10.1.0.1:7001", "loopback:10.1.0.2:7002"]
    alice = await lan.node("alice", discovery=EndpointDiscovery(endpoints), endpoint=endpoints[0])
    bob = await lan.node("bob", discovery=EndpointDiscovery(endpoints), endpoint=endpoints[1],
                         start=False)
    await lan.net.wait(bob.start())
    await lan.net.until(lambda: alice.peers() and bob.peers())
    kill(bob)
    bob2 = await lan.node("bob2", discovery=EndpointDiscovery(endpoints), endpoint=endpoints[1])
    await lan.net.until(lambda: bob2.uuid in alice.peers())
    assert bob.uuid not in alice.peers()
    assert kinds(alice, bob) == [("ENTER", None), ("EXIT", None)]
    assert alice.uuid in bob2.peers()


@pytest_twisted.ensureDeferred
async def test_a_listed_peer_that_comes_later_is_found(lan: Lan) -> None:
    endpoints = ["loopback:10.2.0.1:7001", "loopback:10.2.0.2:7002"]
    alice = await lan.node("alice", discovery=EndpointDiscovery(endpoints), endpoint=endpoints[0])
    lan.net.advance(10)
    bob = await lan.node("bob", discovery=EndpointDiscovery([]), endpoint=endpoints[1])
    await lan.net.until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid])


@pytest_twisted.ensureDeferred
async def test_a_listed_peer_whose_link_cannot_be_opened_is_dialled_again(
        lan: Lan, monkeypatch: Any) -> None:
    """No socket for the first link to a listed endpoint (out of
    descriptors): logged, and that endpoint is dialled again once
    ``expired`` has passed, as one where nobody answers (it was dropped
    from the dials for good: the peers never met)."""
    from mdp.harmony import node as harmony_node

    endpoints = ["loopback:10.3.0.1:7001", "loopback:10.3.0.2:7002"]
    bob = await lan.node("bob", discovery=EndpointDiscovery([]), endpoint=endpoints[1])
    refused = refuse_connections(monkeypatch, harmony_node)
    alice = await lan.node("alice", discovery=EndpointDiscovery(endpoints[1:]),
                           endpoint=endpoints[0], expired=6.0)
    lan.net.advance(1)
    assert refused and not alice.peers() and not bob.peers()
    await lan.net.until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid],
                        timeout=10)


@pytest_twisted.ensureDeferred
async def test_a_peer_met_on_a_dial_whose_link_failed_gets_a_link_of_its_own(
        lan: Lan, monkeypatch: Any) -> None:
    """Alice's link to bob cannot be opened, then bob's HELLO reaches her:
    she opens a new link to him rather than take over the one that failed
    (on it, all she sent him was lost until he expired)."""
    from mdp.harmony import node as harmony_node

    endpoints = ["loopback:10.4.0.1:7001", "loopback:10.4.0.2:7002"]
    refused = refuse_connections(monkeypatch, harmony_node, to=lambda e: e.endswith(":7002"))
    alice = await lan.node("alice", discovery=EndpointDiscovery(endpoints[1:]),
                           endpoint=endpoints[0], expired=30.0)
    bob = await lan.node("bob", discovery=EndpointDiscovery(endpoints[:1]),
                         endpoint=endpoints[1], expired=30.0)
    await lan.net.until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid],
                        timeout=5)
    assert refused
    alice.whisper(bob.uuid, b"psst")
    await lan.net.until(lambda: ("WHISPER", None) in kinds(bob), timeout=1)


@pytest_twisted.ensureDeferred
async def test_twenty_nodes_form_a_full_mesh_and_a_shout_reaches_all(lan: Lan) -> None:
    nodes = [await lan.node(f"n{i}", "all") for i in range(20)]
    await lan.net.until(lambda: all(len(n.peers()) == 19 for n in nodes), timeout=3)
    nodes[0].shout("all", b"to everyone")
    await lan.net.until(lambda: all(("SHOUT", "all") in kinds(n) for n in nodes[1:]))
    assert ("SHOUT", "all") not in kinds(nodes[0])


@pytest_twisted.ensureDeferred
async def test_bad_beacons_and_junk_datagrams_are_ignored(lan: Lan) -> None:
    alice = await lan.node("alice")
    junk = datagram.open_datagrams(f"loopback:{lan.name}:host=10.9.9.9", _Deaf(), lan.net.reactor)
    sender = await lan.net.wait(junk)
    lan.net.addCleanup(sender.close)
    for data in (b"ZRE\x01" + bytes(17), b"ZRE\x01" + bytes(40), b"ZRE", b"\x00" * 22, b"hello"):
        sender.send(data)
    sender.send(codec.encode_beacon(alice.uuid, 9))  # our own UUID from elsewhere
    lan.net.advance(2)
    assert alice.peers() == [] and alice.seen == []
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers() == [bob.uuid])


class _Deaf:
    def datagramReceived(self, data: bytes, host: str) -> None:
        pass


@pytest_twisted.ensureDeferred
async def test_raw_peer_input_never_breaks_the_node(lan: Lan) -> None:
    """Hypothesis-made messages, good and bad, straight into the node's
    ROUTER from links with ZRE identities; the node keeps its good peer."""
    from tests.conftest import RawPeer

    alice = await lan.node("alice")
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers())
    frames = st.lists(st.binary(max_size=20).map(lambda b: b"\xaa\xa1" + b) | st.binary(max_size=6),
                      min_size=1, max_size=3)
    identities = st.binary(min_size=16, max_size=16).map(lambda b: b"\x01" + b)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(identities, st.lists(frames, max_size=5))
    def fuzz(identity: bytes, messages: list[list[bytes]]) -> None:
        from mdp.transport import connect

        peer = RawPeer(lan.net, alice.router.endpoint)
        peer.transport.close()
        peer.transport = connect(alice.router.endpoint, peer, lan.net.reactor, identity=identity)
        for message in messages:
            peer.send(*message)
        lan.net.advance(0.01)
        peer.transport.close()

    fuzz()
    lan.net.advance(1)
    assert alice.peers() == [bob.uuid]
    bob.whisper(alice.uuid, b"still here")
    await lan.net.until(lambda: ("WHISPER", None) in kinds(alice))


@pytest_twisted.ensureDeferred
async def test_api_errors_are_typed(lan: Lan) -> None:
    alice = await lan.node("alice")
    with pytest.raises(UnknownPeer):
        alice.whisper(alice.uuid, b"x")
    with pytest.raises(UnknownPeer):
        alice.peerName(alice.uuid)
    with pytest.raises(TypeError, match="bytes, not str"):
        alice.shout("g", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="255 bytes"):
        alice.join("g" * 256)
    with pytest.raises(TypeError):
        alice.join(b"g")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="evasive"):
        Node("x", lan.net.reactor, evasive=30, expired=5, discovery=EndpointDiscovery())


@pytest_twisted.ensureDeferred
async def test_a_failing_callback_is_logged_not_raised(lan: Lan) -> None:
    alice = await lan.node("alice")

    def broken(event: Event) -> None:
        raise RuntimeError("application bug")

    unsubscribe = alice.subscribe(broken)
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers() == [bob.uuid])
    assert ("ENTER", None) in kinds(alice)
    unsubscribe()
    unsubscribe()


@pytest_twisted.ensureDeferred
async def test_an_unreachable_announced_endpoint_forgets_that_peer(lan: Lan) -> None:
    alice = await lan.node("alice")
    from mdp.harmony.machine import identity_of
    from mdp.transport import connect
    from tests.conftest import RawPeer

    peer = RawPeer(lan.net, alice.router.endpoint)
    peer.transport.close()
    stranger = identity_of(__import__("uuid").uuid4())
    peer.transport = connect(alice.router.endpoint, peer, lan.net.reactor, identity=stranger)
    lan.net.addCleanup(peer.transport.close)
    for endpoint in ("nowhere:at-all", "inproc://broker", "tcp://10.0.0.1:5555"):
        peer.send(*codec.encode(codec.Hello(1, endpoint, (), 0, "liar", {})))
    lan.net.advance(0.1)
    assert alice.peers() == [] and alice.machine.peers == {} and alice.seen == []


def test_datagram_endpoints_are_checked_before_anything_starts() -> None:
    spec = datagram.resolve("udp:5670:interface=127.0.0.1")
    assert (spec.host, spec.destination, spec.multicast, spec.port) == ("127.0.0.1",
                                                                     "225.25.25.25", True, 5670)
    spec = datagram.resolve("udp:5671:interface=127.0.0.1:broadcast=127.255.255.255")
    assert (spec.destination, spec.multicast) == ("127.255.255.255", False)
    spec = datagram.resolve("udp:5670:interface=lo:group=239.1.2.3")
    assert (spec.host, spec.destination, spec.multicast) == ("127.0.0.1", "239.1.2.3", True)
    assert datagram.resolve("loopback:x:host=10.0.0.7").host == "10.0.0.7"
    for bad, reason in [("udp:", "no port"), ("udp:99999", "out of range"),
                        ("udp:5670:interface=nope0", "no IPv4 interface 'nope0'"),
                        ("udp:5670:group=10.0.0.1", "not an IPv4 multicast group"),
                        ("udp:5670:group=239.1.1.1:broadcast=10.0.0.255", "not both"),
                        ("udp:5670:colour=blue", "unknown colour"),
                        ("tcp:5670", "udp:PORT"), ("loopback:", "loopback:NAME")]:
        with pytest.raises(TransportError, match=reason):
            datagram.resolve(bad)


def test_the_default_interface_is_the_first_real_one_or_loopback(monkeypatch: Any) -> None:
    import ipaddress

    real = [("lo", ipaddress.IPv4Interface("127.0.0.1/8")),
            ("eth0", ipaddress.IPv4Interface("192.0.2.2/24"))]
    monkeypatch.setattr(datagram, "_adapters", lambda: real)
    spec = datagram.resolve("udp:5670")
    assert (spec.host, spec.destination, spec.multicast) == ("192.0.2.2", "192.0.2.255", False)
    monkeypatch.setattr(datagram, "_adapters", lambda: real[:1])
    spec = datagram.resolve("udp:5670")
    assert (spec.host, spec.destination, spec.multicast) == ("127.0.0.1", "225.25.25.25", True)


def test_a_node_on_zeromq_binds_at_the_discovery_address() -> None:
    clock = task.Clock()
    node = Node("z", clock, discovery=EndpointDiscovery(host="127.0.0.1"))
    assert node.bindEndpoint == "zmq:tcp://127.0.0.1:*"


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_nodes_over_zeromq_with_a_list_of_peers() -> None:
    """Real ZeroMQ sockets on 127.0.0.1 (no UDP): bob knows alice's endpoint,
    alice learns bob's from his HELLO and connects back."""
    from twisted.internet import reactor

    from tests.procs import wait_until

    alice = Node("alice", reactor, discovery=EndpointDiscovery(),
                 endpoint="zmq:tcp://127.0.0.1:*")
    await alice.start()
    bob = Node("bob", reactor, discovery=EndpointDiscovery([alice.endpoint]),
               endpoint="zmq:tcp://127.0.0.1:*")
    heard: list[Event] = []
    alice.subscribe(heard.append)
    try:
        assert alice.endpoint.startswith("tcp://127.0.0.1:")
        bob.join("g")
        await bob.start()
        await wait_until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid], 10)
        assert alice.peerEndpoint(bob.uuid) == bob.endpoint
        alice.join("g")
        await wait_until(lambda: alice.uuid in bob.peersByGroup("g"), 10)
        bob.shout("g", b"over", b"zeromq")
        alice.whisper(bob.uuid, b"back")
        bob.whisper(alice.uuid, b"\x00binary\xff")
        await wait_until(lambda: [e.frames for e in heard if e.kind in ("SHOUT", "WHISPER")]
                         == [(b"over", b"zeromq"), (b"\x00binary\xff",)], 10)
    finally:
        await bob.stop()
        await alice.stop()
    assert alice.links == {} and bob.links == {}


@pytest_twisted.ensureDeferred
async def test_start_right_after_stop_waits_for_it_and_works(lan: Lan) -> None:
    alice = await lan.node("alice")
    bob = await lan.node("bob")
    await lan.net.until(lambda: alice.peers() and bob.peers())
    stopping = bob.stop()
    starting = bob.start()  # not waiting for the stop
    await lan.net.wait(stopping)
    await lan.net.wait(starting)
    assert bob.running and bob.router is not None and bob.machine.running
    await lan.net.until(lambda: ("ENTER", None) in kinds(bob) and bob.peers() == [alice.uuid])
    assert kinds(alice, bob) == [("ENTER", None), ("EXIT", None), ("ENTER", None)]


@pytest_twisted.ensureDeferred
async def test_streams_made_before_start_see_the_first_enter_and_close_cleanly(lan: Lan) -> None:
    import gc

    alice = await lan.node("alice", start=False)
    stream = alice.events()
    await lan.net.wait(alice.start())
    lan.net.addCleanup(alice.stop)
    bob = await lan.node("bob")
    first = await lan.net.wait(stream.__anext__())
    assert (first.kind, first.peer) == ("ENTER", bob.uuid)
    await stream.aclose()
    assert [e async for e in stream] == []
    abandoned = alice.events()
    del abandoned
    gc.collect()
    assert len(alice._streams) == 0  # a reader that went away is not fed for ever


def test_endpoint_lists_and_bind_endpoints_are_checked_at_once() -> None:
    assert EndpointDiscovery("tcp://127.0.0.1:7001").endpoints == ["tcp://127.0.0.1:7001"]
    assert EndpointDiscovery(["zmq:tcp://h:7001"]).endpoints == ["tcp://h:7001"]
    with pytest.raises(TypeError, match="not bytes"):
        EndpointDiscovery([b"tcp://h:1"])  # type: ignore[list-item]
    with pytest.raises(TransportError, match="no port"):
        EndpointDiscovery(["tcp://h"])
    clock = task.Clock()
    for bad in ("zmq:ipc:///tmp/x", "tcp:host=h:port=1"):
        with pytest.raises(TransportError, match="binds zmq:tcp"):
            Node("n", clock, discovery=EndpointDiscovery(), endpoint=bad)


# --- callbacks that call the node ---------------------------------------------------
#
# A batch of actions (links, messages, events) comes out of one event; a
# subscriber hears its events once its links and messages are done, so what
# the subscriber does (whisper, stop, ...) follows them, and a stop voids
# what of the batch is left.


async def _alice_and_bob_gone_quiet(lan: Lan, subnet: str,
                                    aliceGroups: tuple[str, ...]) -> tuple[Node, Node]:
    """Alice (in *aliceGroups*) and bob (in ``g``) on *subnet*, listing each
    other; they meet, then bob stops without a word (no beacons) and 3 s go
    by: alice still has him, and his restart is a new run at the same
    endpoint."""
    endpoints = [f"loopback:{subnet}.0.1:7001", f"loopback:{subnet}.0.2:7002"]
    alice = await lan.node("alice", *aliceGroups, discovery=EndpointDiscovery(endpoints[1:]),
                           endpoint=endpoints[0], evasive=2.0, expired=30.0)
    bob = await lan.node("bob", "g", discovery=EndpointDiscovery(endpoints[:1]),
                         endpoint=endpoints[1], evasive=2.0, expired=30.0)
    await lan.net.until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid])
    await lan.net.wait(bob.stop())
    lan.net.advance(3.0)
    return alice, bob


@pytest_twisted.ensureDeferred
async def test_a_stop_from_an_exit_callback_leaves_no_link_open(lan: Lan) -> None:
    """Bob expires: alice closes his link, tells EXIT and dials his listed
    endpoint again; her EXIT callback stops her.  The new dial is closed by
    the stop: nothing is left to reach the node that comes there next."""
    endpoints = ["loopback:10.5.0.1:7001", "loopback:10.5.0.2:7002"]
    alice = await lan.node("alice", discovery=EndpointDiscovery(endpoints[1:]),
                           endpoint=endpoints[0], evasive=2.0, expired=5.0)
    bob = await lan.node("bob", discovery=EndpointDiscovery([]), endpoint=endpoints[1])
    await lan.net.until(lambda: alice.peers() == [bob.uuid] and bob.peers() == [alice.uuid])
    stopping: list[defer.Deferred[None]] = []
    alice.subscribe(lambda e: stopping.append(alice.stop()) if e.kind == "EXIT" else None)
    kill(bob)
    await lan.net.until(lambda: bool(stopping), timeout=10)
    await lan.net.wait(stopping[0])
    assert not alice.running and alice.links == {} and alice.machine.dials == {}
    bob2 = await lan.node("bob2", discovery=EndpointDiscovery([]), endpoint=endpoints[1])
    lan.net.advance(6.0)
    assert bob2.seen == [] and bob2.peers() == []  # nothing from the stopped alice
    assert kinds(alice) == [("ENTER", None), ("EVASIVE", None), ("EXIT", None)]


@pytest_twisted.ensureDeferred
async def test_a_stop_from_an_exit_callback_on_a_restart_tells_nothing_more(lan: Lan) -> None:
    """Bob restarts (a new HELLO, after *evasive*): alice closes his link,
    tells EXIT, opens a link for the new run and tells ENTER; her EXIT
    callback stops her: the new link is closed, and she tells nothing after
    the stop (no ENTER for a peer a stopped node does not have)."""
    alice, bob = await _alice_and_bob_gone_quiet(lan, "10.6", ("g",))
    after: list[Event] = []
    stopping: list[defer.Deferred[None]] = []
    linksOnceStopped: list[dict[int, Any]] = []

    def onEvent(event: Event) -> None:
        if stopping:
            after.append(event)
        elif event.kind == "EXIT":
            stopping.append(alice.stop())
            linksOnceStopped.append(dict(alice.links))

    alice.subscribe(onEvent)
    await lan.net.wait(bob.start())
    await lan.net.until(lambda: bool(stopping), timeout=5)
    await lan.net.wait(stopping[0])
    lan.net.advance(1.0)
    assert linksOnceStopped == [{}]  # closed by stop(), not after the callback
    assert not alice.running and alice.links == {} and alice.machine.peers == {}
    assert after == []
    assert kinds(alice, bob) == [("ENTER", None), ("JOIN", "g"), ("EVASIVE", None),
                                 ("EXIT", None)]


@pytest_twisted.ensureDeferred
async def test_a_whisper_from_an_evasive_callback_follows_the_pings_of_that_tick(
        lan: Lan) -> None:
    """One tick PINGs bob, tells EVASIVE(bob), PINGs carol: the whisper to
    carol from the EVASIVE callback goes after her PING, in sequence; she
    hears it and keeps alice."""
    from tests.conftest import warnings_logged

    alice = await lan.node("alice", evasive=5.0, expired=30.0)
    bob = await lan.node("bob")
    carol = await lan.node("carol")
    await lan.net.until(lambda: len(alice.peers()) == 2 and alice.uuid in carol.peers())
    assert alice.peers() == [bob.uuid, carol.uuid]  # the tick comes to bob first
    told: list[float] = []

    def onEvent(event: Event) -> None:
        if event.kind == "EVASIVE" and event.peer == bob.uuid:
            told.append(lan.net.reactor.seconds())
            alice.whisper(carol.uuid, b"bob went quiet")

    alice.subscribe(onEvent)
    with warnings_logged() as logged:
        kill(bob)
        carol.discovery.loop.stop()  # type: ignore[attr-defined]  # she answers PINGs only
        await lan.net.until(lambda: bool(told), timeout=10)
        lan.net.advance(1.0)
    assert [e.peer for e in alice.seen if e.kind == "EVASIVE"] == [bob.uuid, carol.uuid]
    assert [e.frames for e in carol.seen if e.kind == "WHISPER"] == [(b"bob went quiet",)]
    assert kinds(carol, alice) == [("ENTER", None), ("WHISPER", None)]
    assert not [e for e in logged if "messages lost" in e.get("log_format", "")]


@pytest_twisted.ensureDeferred
async def test_a_whisper_then_a_stop_from_one_callback_sends_the_whisper(lan: Lan) -> None:
    """What a callback asks before it stops the node is done: its whisper
    goes out; the events still due are not told once the node stopped."""
    alice = await lan.node("alice")
    stopping: list[defer.Deferred[None]] = []

    def onEvent(event: Event) -> None:
        if event.kind == "ENTER" and not stopping:
            alice.whisper(event.peer, b"bye")
            stopping.append(alice.stop())

    alice.subscribe(onEvent)
    bob = await lan.node("bob", "g1", "g2")
    await lan.net.until(lambda: bool(stopping))
    await lan.net.wait(stopping[0])
    await lan.net.until(lambda: ("WHISPER", None) in kinds(bob))
    assert [e.frames for e in bob.seen if e.kind == "WHISPER"] == [(b"bye",)]
    assert kinds(alice) == [("ENTER", None)]  # not bob's JOINs of the same HELLO
    assert not alice.running and alice.links == {}


@pytest_twisted.ensureDeferred
async def test_a_stop_and_a_start_from_an_exit_callback_tell_only_the_new_run(lan: Lan) -> None:
    """The callback restarts the node: what the stopped run had still to
    tell (bob's ENTER, his JOIN) is not told; the new run meets bob again,
    and tells that once."""
    alice, bob = await _alice_and_bob_gone_quiet(lan, "10.7", ())
    restarting: list[defer.Deferred[None]] = []

    def onEvent(event: Event) -> None:
        if event.kind == "EXIT" and not restarting:
            restarting.extend([alice.stop(), alice.start()])

    alice.subscribe(onEvent)
    await lan.net.wait(bob.start())
    await lan.net.until(lambda: len(restarting) == 2, timeout=5)
    await lan.net.wait(restarting[1])
    await lan.net.until(lambda: alice.peers() == [bob.uuid])
    assert kinds(alice, bob) == [("ENTER", None), ("JOIN", "g"), ("EVASIVE", None),
                                 ("EXIT", None), ("ENTER", None), ("JOIN", "g")]
    assert list(alice.links) == [alice.machine.peers[bob.uuid].link]


@pytest_twisted.ensureDeferred
async def test_a_real_peer_is_heard_at_once_during_and_after_a_flood_of_spoofed_beacons(
        lan: Lan) -> None:
    """1,200 beacons a second, each from a new UUID that never says HELLO:
    a node keeps at most maxStrangers of them, none in its peer table (they
    used to fill it, and a real newcomer was refused for as long), and
    meets a new real peer within a beacon interval, during the flood and
    after it; the strangers are gone helloWait after it."""
    import uuid

    alice = await lan.node("alice", maxPeers=100, maxStrangers=16, helloWait=2.0)
    spoofer = await lan.net.wait(datagram.open_datagrams(f"loopback:{lan.name}:host=10.9.9.9",
                                                         _Deaf(), lan.net.reactor))
    lan.net.addCleanup(spoofer.close)
    ports = itertools.count(20000)
    newcomers: list[Node] = []
    most, intruders = [0], set()

    def flood() -> None:
        for _ in range(12):
            spoofer.send(codec.encode_beacon(uuid.uuid4(), next(ports)))
        intruders.update(alice.machine.peers.keys() - {p.uuid for p in newcomers})
        most[0] = max(most[0], len(getattr(alice.machine, "strangers", ())))

    loop = task.LoopingCall(flood)
    loop.clock = lan.net.reactor
    loop.start(0.01)
    for name in ("bob", "carol"):
        lan.net.advance(3)
        started = lan.net.reactor.seconds()
        newcomers.append(await lan.node(name))
        await lan.net.until(lambda: newcomers[-1].uuid in alice.peers(), timeout=1.5)
        assert alice.uuid in newcomers[-1].peers()
        assert lan.net.reactor.seconds() - started < 1.0
    assert most[0] == 16 and not intruders and next(ports) > 20000 + 12 * 500
    loop.stop()
    dave = await lan.node("dave")
    await lan.net.until(lambda: dave.uuid in alice.peers(), timeout=1.5)
    lan.net.advance(3)
    assert alice.machine.strangers == {} and sorted(alice.peers()) == sorted(
        p.uuid for p in (*newcomers, dave))
    assert [e.kind for e in alice.seen] == ["ENTER"] * 3
