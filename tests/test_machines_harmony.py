"""HarmonyMachine alone: events with their time in, actions out."""

from __future__ import annotations

import uuid
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.harmony import codec
from mdp.harmony.machine import (
    CloseLink,
    Emit,
    HarmonyMachine,
    Notice,
    OpenLink,
    SendOn,
    UnknownPeer,
    identity_of,
)

US = uuid.UUID(int=1)
PEER = uuid.UUID(int=2)
OTHER = uuid.UUID(int=3)
OUR_EP = "tcp://10.0.0.1:40001"
PEER_EP = "tcp://10.0.0.2:40002"


def started(**options: Any) -> HarmonyMachine:
    machine = HarmonyMachine(US, "us", headers={"X-US": "yes"}, **options)
    machine.handleStart(OUR_EP, 0.0)
    return machine


def sent(actions: list[Any]) -> list[codec.Message]:
    return [codec.decode(a.frames) for a in actions if isinstance(a, SendOn)]


def quiet(actions: list[Any]) -> list[Any]:
    """*actions* but the notices the driver logs."""
    return [a for a in actions if not isinstance(a, Notice)]


def events(actions: list[Any]) -> list[tuple[str, Optional[str]]]:
    return [(a.event.kind, a.event.group) for a in actions if isinstance(a, Emit)]


def hello(sequence: int = 1, endpoint: str = PEER_EP, groups: tuple[str, ...] = (),
          status: int = 0, name: str = "peer") -> list[bytes]:
    return codec.encode(codec.Hello(sequence, endpoint, groups, status, name, {"X-P": "1"}))


def greeted(machine: HarmonyMachine, peer: uuid.UUID = PEER, groups: tuple[str, ...] = (),
            now: float = 0.0) -> list[Any]:
    return machine.handleMessage(identity_of(peer), hello(groups=groups), now)


def test_a_beacon_opens_a_link_with_hello_first_and_announces_nothing() -> None:
    machine = started()
    machine.join("chat", 0.0)
    actions = machine.handleBeacon(PEER, PEER_EP, 0.5)
    assert isinstance(actions[0], OpenLink) and actions[0].endpoint == PEER_EP
    assert sent(actions) == [codec.Hello(1, OUR_EP, ("chat",), 1, "us", {"X-US": "yes"})]
    assert events(actions) == []
    assert machine.handleBeacon(PEER, PEER_EP, 0.7) == []  # known: refreshed only


def test_hello_announces_the_peer_then_its_groups_on_the_link_already_open() -> None:
    machine = started()
    machine.handleBeacon(PEER, PEER_EP, 0.0)
    actions = greeted(machine, groups=("a", "b"))
    assert events(actions) == [("ENTER", None), ("JOIN", "a"), ("JOIN", "b")]
    enter = actions[0].event
    assert (enter.peer, enter.name, enter.headers, enter.endpoint) == (PEER, "peer", {"X-P": "1"},
                                                                      PEER_EP)
    assert not any(isinstance(a, OpenLink) for a in actions)


def test_hello_from_a_stranger_makes_us_connect_back_first() -> None:
    machine = started()
    actions = greeted(machine)
    assert [type(a) for a in actions[:2]] == [OpenLink, SendOn]
    assert actions[0].endpoint == PEER_EP
    assert isinstance(sent(actions)[0], codec.Hello)
    assert events(actions) == [("ENTER", None)]


def test_nothing_counts_before_hello() -> None:
    machine = started()
    machine.handleBeacon(PEER, PEER_EP, 0.0)
    whisper = codec.encode(codec.Whisper(1, (b"early",)))
    assert events(machine.handleMessage(identity_of(PEER), whisper, 0.1)) == []
    assert events(machine.handleMessage(identity_of(OTHER), whisper, 0.1)) == []
    assert PEER not in machine.peers and PEER in machine.strangers


def test_whisper_shout_and_ping_in_sequence() -> None:
    machine = started()
    greeted(machine)
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Whisper(2, (b"a", b"b"))), 1)
    assert [a.event.frames for a in actions if isinstance(a, Emit)] == [(b"a", b"b")]
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Shout(3, "g", (b"s",))), 1)
    assert events(actions) == [("SHOUT", "g")]
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Ping(4)), 1)
    assert sent(actions) == [codec.PingOk(2)]  # our HELLO was 1


def test_a_sequence_gap_drops_the_peer() -> None:
    machine = started()
    greeted(machine)
    link = machine.peers[PEER].link
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Ping(3)), 1)
    assert events(actions) == [("EXIT", None)]
    assert CloseLink(link) in actions
    assert PEER not in machine.peers


def test_a_repeated_sequence_number_drops_the_peer() -> None:
    machine = started()
    greeted(machine)
    machine.handleMessage(identity_of(PEER), codec.encode(codec.Ping(2)), 1)
    assert events(machine.handleMessage(identity_of(PEER), codec.encode(codec.Ping(2)), 1)) \
        == [("EXIT", None)]


def test_incoming_sequence_wraps_either_way() -> None:
    for after in (0, 65535):
        machine = started()
        greeted(machine)
        machine.peers[PEER].received = 65534
        actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Ping(after)), 1)
        assert events(actions) == [] and PEER in machine.peers


def test_outgoing_sequence_counts_from_hello_and_wraps_as_pyre_does() -> None:
    machine = started()
    greeted(machine)
    first = sent(machine.whisper(PEER, [b"x"], 1))
    machine.peers[PEER].sent = 65533
    later = sent(machine.whisper(PEER, [b"y"], 1) + machine.whisper(PEER, [b"z"], 1))
    assert [m.sequence for m in first + later] == [2, 65534, 0]


def test_our_status_goes_up_by_one_per_join_and_leave() -> None:
    machine = started()
    greeted(machine)
    statuses = []
    for step in ["a", "b", "-a", "a", "a", "-zz"]:
        actions = machine.leave(step[1:], 1) if step.startswith("-") else machine.join(step, 1)
        statuses += [(type(m).__name__, m.group, m.status) for m in sent(actions)]
    assert statuses == [("Join", "a", 1), ("Join", "b", 2), ("Leave", "a", 3), ("Join", "a", 4)]
    assert list(machine.ownGroups) == ["b", "a"]


def test_our_status_wraps_at_256() -> None:
    machine = started()
    greeted(machine)
    machine.status = 255
    assert sent(machine.join("g", 1)) == [codec.Join(2, "g", 0)]


def test_peer_join_and_leave_track_groups_and_status() -> None:
    machine = started()
    greeted(machine, groups=("a",))
    machine.peers[PEER].status = 7
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Join(2, "b", 8)), 1)
    assert events(actions) == [("JOIN", "b")]
    actions = machine.handleMessage(identity_of(PEER), codec.encode(codec.Leave(3, "a", 9)), 1)
    assert events(actions) == [("LEAVE", "a")]
    assert machine.peers[PEER].groups == {"b"} and machine.peers[PEER].status == 9
    # a status out of step is taken as it comes (logged); the peer stays
    machine.handleMessage(identity_of(PEER), codec.encode(codec.Join(4, "c", 42)), 1)
    assert machine.peers[PEER].status == 42 and PEER in machine.peers


def test_shout_goes_only_to_peers_in_the_group() -> None:
    machine = started()
    greeted(machine, PEER, groups=("g",))
    machine.handleMessage(identity_of(OTHER), hello(endpoint="tcp://10.0.0.3:1"), 0)
    actions = machine.shout("g", [b"hi"], 1)
    assert [a.link for a in actions] == [machine.peers[PEER].link]
    assert sent(actions) == [codec.Shout(2, "g", (b"hi",))]


def test_whisper_to_an_unknown_peer_is_an_error() -> None:
    machine = started()
    try:
        machine.whisper(PEER, [b"x"], 0)
    except UnknownPeer:
        pass
    else:
        raise AssertionError("no UnknownPeer")


def test_silence_pings_then_expires() -> None:
    machine = started(evasive=5.0, expired=30.0)
    greeted(machine, now=0.0)
    assert machine.handleTick(4.9) == []
    first = machine.handleTick(5.0)
    assert events(first) == [("EVASIVE", None)] and sent(first) == [codec.Ping(2)]
    second = machine.handleTick(6.0)
    assert events(second) == [] and sent(second) == [codec.Ping(3)]  # one EVASIVE per silence
    machine.handleMessage(identity_of(PEER), codec.encode(codec.PingOk(2)), 6.5)
    assert machine.handleTick(11.0) == []  # refreshed at 6.5
    assert events(machine.handleTick(11.5)) == [("EVASIVE", None)]
    assert events(machine.handleTick(36.4)) == []
    assert events(machine.handleTick(36.5)) == [("EXIT", None)]


def test_beacons_keep_a_peer_alive() -> None:
    machine = started(evasive=5.0, expired=30.0)
    greeted(machine)
    for t in range(1, 40):
        machine.handleBeacon(PEER, PEER_EP, float(t))
        assert events(machine.handleTick(t + 0.5)) == []


def test_port_zero_beacon_is_an_exit() -> None:
    machine = started()
    greeted(machine)
    assert events(machine.handleBeacon(PEER, None, 1)) == [("EXIT", None)]
    assert machine.handleBeacon(PEER, None, 1) == []


def test_hello_again_is_a_restart_exit_then_enter_on_a_new_link() -> None:
    machine = started()
    greeted(machine)
    old = machine.peers[PEER].link
    actions = greeted(machine, now=6)  # past evasive (5 s) since its HELLO
    assert events(actions) == [("EXIT", None), ("ENTER", None)]
    assert CloseLink(old) in actions
    assert [a for a in actions if isinstance(a, OpenLink)][0].link != old


def test_hello_again_soon_is_its_new_link_not_a_restart() -> None:
    """Within evasive of its HELLO, from the endpoint known: the peer made
    its link again (as we made ours); its sequence starts again, and nothing
    goes back, which it would take for a restart in turn."""
    machine = started()
    greeted(machine, groups=("old",))
    link = machine.peers[PEER].link
    actions = greeted(machine, groups=("chat",), now=2)
    assert events(actions) == [("LEAVE", "old"), ("JOIN", "chat")]
    assert not [a for a in actions if isinstance(a, (OpenLink, CloseLink))]
    # our HELLO goes back on our link, numbered 1 (it may have lost us)
    assert [a.link for a in actions if isinstance(a, SendOn)] == [link]
    assert [m.sequence for m in sent(actions)] == [1] and isinstance(sent(actions)[0], codec.Hello)
    assert machine.peers[PEER].received == 1
    # once an evasive period: its answer to ours is not answered again
    again = greeted(machine, groups=("chat",), now=2.1)
    assert not [a for a in again if isinstance(a, (OpenLink, CloseLink, SendOn))]
    ping = codec.encode(codec.Ping(2))
    assert sent(machine.handleMessage(identity_of(PEER), ping, 2.5)) == [codec.PingOk(2)]


class Net:
    """Machines that deliver to one another, each hop 1 ms, bounded."""

    def __init__(self, routes: Optional[dict[str, str]] = None) -> None:
        self.machines: dict[str, HarmonyMachine] = {}
        self.routes = dict(routes or {})
        self.links: dict[tuple[uuid.UUID, int], Optional[str]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.queue: list[tuple[float, uuid.UUID, str, list[bytes]]] = []
        self.now = 0.0

    def add(self, name: str, endpoint: str) -> HarmonyMachine:
        machine = HarmonyMachine(uuid.uuid4(), name)
        self.machines[endpoint] = machine
        self.perform(machine, machine.handleStart(endpoint, self.now))
        return machine

    def perform(self, machine: HarmonyMachine, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, OpenLink):
                self.links[(machine.uuid, action.link)] = self.routes.get(action.endpoint,
                                                                          action.endpoint)
            elif isinstance(action, CloseLink):
                self.links.pop((machine.uuid, action.link), None)
            elif isinstance(action, SendOn):
                to = self.links.get((machine.uuid, action.link))
                if to in self.machines:
                    self.queue.append((self.now + 0.001, machine.uuid, to, action.frames))
            elif isinstance(action, Emit):
                self.events.append((machine.name, action.event.kind, action.event.name))

    def run(self, limit: int = 500) -> int:
        count = 0
        while self.queue and count < limit:
            self.now, sender, to, frames = self.queue.pop(0)
            target = self.machines[to]
            self.perform(target, target.handleMessage(identity_of(sender), frames, self.now))
            count += 1
        return count


@pytest.mark.parametrize("routes", [
    {"tcp://gateway:9000": "tcp://10.0.0.2:7001"},           # a forwarded port
    {"tcp://hostb:7001": "tcp://10.0.0.2:7001",              # two peers on one port,
     "tcp://hostc:7001": "tcp://10.0.0.3:7001"},             # listed by host name
])
def test_peers_listed_under_other_names_meet_once(routes: dict[str, str]) -> None:
    net = Net(routes)
    a = net.add("A", "tcp://10.0.0.1:7001")
    for endpoint in sorted(set(routes.values())):
        net.add(endpoint, endpoint)
    for listed in routes:
        net.perform(a, a.handleDial(listed, net.now))
    assert net.run() < 50 and not net.queue
    assert not [e for e in net.events if e[1] == "EXIT"]
    assert all(machine.peers for machine in net.machines.values())


def test_a_forged_hello_naming_a_peers_endpoint_does_not_set_off_a_loop() -> None:
    net = Net()
    a = net.add("A", "tcp://10.0.0.1:40001")
    other = net.add("L", "tcp://10.0.0.2:40002")
    net.perform(a, a.handleBeacon(other.uuid, "tcp://10.0.0.2:40002", net.now))
    net.run()
    net.now = 10.0  # long after they met
    forged = codec.encode(codec.Hello(1, "tcp://10.0.0.2:40002", (), 0, "impostor", {}))
    net.perform(a, a.handleMessage(identity_of(uuid.uuid4()), forged, net.now))
    assert net.run() < 20 and not net.queue


def test_a_new_uuid_at_a_known_endpoint_replaces_the_old_peer_once_it_says_hello() -> None:
    """Its beacon alone (which anyone may forge) changes nothing: no EXIT, no
    second link there; its HELLO (it heard our beacon) replaces the old peer."""
    machine = started()
    greeted(machine)
    assert quiet(machine.handleBeacon(OTHER, PEER_EP, 3)) == []
    assert list(machine.peers) == [PEER] and machine.strangers == {}
    actions = greeted(machine, OTHER, now=3.5)
    assert events(actions) == [("EXIT", None), ("ENTER", None)]
    assert list(machine.peers) == [OTHER]


def test_malformed_or_unknown_messages_drop_a_known_peer_and_never_raise() -> None:
    for bad in ([b"\xaa\xa1\x09\x02\x00\x02"], [b"garbage"], [b"\xaa\xa1\x06\x02\x00\x02\x01"]):
        machine = started()
        greeted(machine)
        assert events(machine.handleMessage(identity_of(PEER), bad, 1)) == [("EXIT", None)]
        (notice,) = machine.handleMessage(identity_of(OTHER), bad, 1)
        assert notice.topic == "malformed" and f"unknown peer {OTHER}" in notice.text


def test_identities_that_are_not_a_zre_uuid_are_ignored() -> None:
    machine = started()
    for identity in (b"", b"\x00" + PEER.bytes, b"\x01" + PEER.bytes[:8], b"x" * 40):
        (notice,) = machine.handleMessage(identity, hello(), 0)
        assert notice.topic == "identity" and "is not 0x01 and a UUID" in notice.text
    assert machine.handleMessage(identity_of(US), hello(), 0) == []  # ourselves
    assert machine.handleBeacon(US, OUR_EP, 0) == []


def test_a_dialled_endpoint_is_adopted_by_the_peer_whose_hello_names_it() -> None:
    machine = started()
    actions = machine.handleDial("tcp://localhost:40002", 0)
    link = actions[0].link
    assert sent(actions)[0].sequence == 1
    actions = machine.handleMessage(identity_of(PEER), hello(endpoint="tcp://127.0.0.1:40002"), 1)
    assert not any(isinstance(a, OpenLink) for a in actions)
    assert machine.peers[PEER].link == link
    assert [m.sequence for m in sent(machine.whisper(PEER, [b"x"], 1))] == [2]
    # gone: dialled again, so a restarted node there is found
    actions = machine.handleBeacon(PEER, None, 2)
    assert events(actions)[0] == ("EXIT", None)
    assert [a.endpoint for a in actions if isinstance(a, OpenLink)] == ["tcp://localhost:40002"]


def test_dial_skips_ourselves_and_endpoints_known() -> None:
    machine = started()
    greeted(machine)
    assert machine.handleDial(OUR_EP, 0) == []
    assert machine.handleDial(PEER_EP, 0) == []


def test_the_peer_table_is_bounded() -> None:
    machine = started(maxPeers=2)
    for n in range(10):
        machine.handleMessage(identity_of(uuid.UUID(int=100 + n)),
                              hello(endpoint=f"tcp://10.0.1.{n}:1"), 0)
    assert len(machine.peers) == 2
    assert "(maxPeers)" in greeted(machine, uuid.UUID(int=99))[0].text


def test_a_node_refused_while_the_table_is_full_is_met_once_there_is_room() -> None:
    """Its HELLO was refused, but it has ours: its beacons make no stranger
    while the table is full, and the first once there is room brings it our
    HELLO again, so it says HELLO again."""
    net = Net()
    a = net.add("A", OUR_EP)
    a.maxPeers = 1
    net.perform(a, a.handleMessage(identity_of(OTHER), hello(endpoint="tcp://10.0.0.3:1"), 0))
    b = net.add("B", PEER_EP)
    for t in range(1, 40):
        net.now = float(t)
        net.perform(a, a.handleBeacon(b.uuid, PEER_EP, net.now))
        net.perform(b, b.handleBeacon(a.uuid, OUR_EP, net.now))
        net.run()
        net.now = t + 0.5
        net.perform(a, a.handleTick(net.now))
        net.perform(b, b.handleTick(net.now))
        net.run()
        assert len(a.strangers) <= (OTHER not in a.peers)
    assert list(a.peers) == [b.uuid] and list(b.peers) == [a.uuid]
    assert net.events.count(("B", "ENTER", "A")) - net.events.count(("B", "EXIT", "A")) == 1


def test_a_strangers_hello_refused_by_a_full_table_forgets_it() -> None:
    """Our HELLO went before the table filled: the stranger goes with its
    refused HELLO, no stranger comes while full, and once there is room its
    beacon brings it our HELLO again."""
    machine = started(maxPeers=1)
    link = machine.handleBeacon(PEER, PEER_EP, 0)[0].link
    machine.handleMessage(identity_of(OTHER), hello(endpoint="tcp://10.0.0.3:1"), 0.1)
    actions = greeted(machine, now=0.2)
    assert quiet(actions) == [CloseLink(link)] and machine.strangers == {}
    assert quiet(machine.handleBeacon(PEER, PEER_EP, 1)) == [] and machine.strangers == {}
    machine.handleBeacon(OTHER, None, 2)
    assert [m.id for m in sent(machine.handleBeacon(PEER, PEER_EP, 3))] == [codec.Hello.id]


def test_what_one_peer_may_make_us_keep_is_bounded() -> None:
    """A HELLO listing more than maxGroups groups (or maxHeaders headers)
    is refused before it is read further; a peer whose JOINs go beyond
    maxGroups is dropped (EXIT); up to the bound all is as usual."""
    machine = started(maxGroups=3, maxHeaders=1)
    assert events(greeted(machine, groups=("a", "b", "c", "d"))) == []
    assert PEER not in machine.peers
    many = codec.encode(codec.Hello(1, PEER_EP, (), 0, "peer", {"X-1": "1", "X-2": "2"}))
    assert events(machine.handleMessage(identity_of(PEER), many, 0.0)) == []
    assert PEER not in machine.peers
    assert events(greeted(machine, groups=("a", "b"))) == [("ENTER", None), ("JOIN", "a"),
                                                            ("JOIN", "b")]
    join = machine.handleMessage(identity_of(PEER), codec.encode(codec.Join(2, "c", 1)), 1)
    assert events(join) == [("JOIN", "c")]
    again = machine.handleMessage(identity_of(PEER), codec.encode(codec.Join(3, "a", 2)), 1)
    assert events(again) == [] and PEER in machine.peers  # already in it: no growth
    over = machine.handleMessage(identity_of(PEER), codec.encode(codec.Join(4, "d", 3)), 1)
    assert events(over) == [("EXIT", None)] and PEER not in machine.peers
    for group in "xyz":  # and we keep to the bound ourselves
        machine.join(group, 2)
    with pytest.raises(ValueError, match="maxGroups"):
        machine.join("w", 2)
    machine.join("x", 2)  # one we are in: nothing to add
    with pytest.raises(ValueError, match="maxHeaders 1"):
        HarmonyMachine(US, "us", headers={"A": "1", "B": "2"}, maxHeaders=1)
    with pytest.raises(codec.MalformedZre, match="more than the 1024 allowed"):
        codec.decode(codec.encode(codec.Hello(1, PEER_EP, tuple(map(str, range(1025))), 0,
                                              "peer", {})))


def test_stop_closes_every_link_without_events() -> None:
    machine = started()
    greeted(machine)
    machine.handleDial("tcp://10.9.9.9:1", 0)
    actions = machine.handleStop(1)
    assert sorted(a.link for a in actions if isinstance(a, CloseLink)) == [1, 2]
    assert events(actions) == [] and machine.peers == {}


identities = st.sampled_from([identity_of(PEER), identity_of(OTHER), b"\x01" + bytes(16), b"zz"])
garbage = st.lists(st.binary(max_size=24).map(lambda b: b"\xaa\xa1" + b) | st.binary(max_size=8),
                   min_size=0, max_size=3)
valid = st.sampled_from([hello(), codec.encode(codec.Ping(2)), codec.encode(codec.Whisper(3, (b"w",))),
                         codec.encode(codec.Join(2, "g", 1))])


@settings(max_examples=200)
@given(st.lists(st.tuples(identities, valid | garbage, st.floats(0, 100)), max_size=30))
def test_any_input_leaves_the_machine_consistent(inputs: list[tuple[bytes, list[bytes], float]]) -> None:
    machine = started()
    now = 0.0
    for identity, frames, step in inputs:
        now += step
        machine.handleMessage(identity, frames, now)
        machine.handleTick(now)
        for peer in machine.peers.values():
            assert peer.expiredAt > now
    links = [p.link for p in machine.peers.values()]
    assert len(links) == len(set(links))


def test_a_dial_by_another_name_is_adopted_by_its_port_not_doubled() -> None:
    """Dialled as bob.lan, the peer announces its address: one link, no
    second HELLO (which the peer would take for a restart, again and again)."""
    machine = started()
    link = machine.handleDial("tcp://bob.lan:40002", 0)[0].link
    actions = machine.handleMessage(identity_of(PEER), hello(endpoint=PEER_EP), 1)
    assert not any(isinstance(a, OpenLink) for a in actions)
    assert events(actions) == [("ENTER", None)] and machine.peers[PEER].link == link
    assert machine.dials == {}


def test_a_dial_nobody_answers_is_made_again_after_the_expiry() -> None:
    machine = started(evasive=5.0, expired=30.0)
    first = machine.handleDial("tcp://10.0.0.9:1", 0)[0].link
    assert machine.handleTick(29) == []
    actions = machine.handleTick(30)
    assert CloseLink(first) in actions
    assert [a.endpoint for a in actions if isinstance(a, OpenLink)] == ["tcp://10.0.0.9:1"]
    assert [m.sequence for m in sent(actions)] == [1]


def test_a_hello_not_numbered_one_is_dropped_without_events() -> None:
    machine = started()
    assert events(machine.handleMessage(identity_of(PEER), hello(sequence=2), 0)) == []
    assert PEER not in machine.peers
    machine.handleBeacon(PEER, PEER_EP, 0)
    assert events(machine.handleMessage(identity_of(PEER), hello(sequence=5), 0)) == []
    assert PEER not in machine.peers  # never announced: no EXIT either


def test_a_peer_whose_endpoint_we_cannot_dial_is_ignored_before_any_event() -> None:
    machine = HarmonyMachine(US, "us", reachable=lambda e: None if e.startswith("tcp://")
                             else "is not tcp://HOST:PORT")
    machine.handleStart(OUR_EP, 0)
    assert quiet(machine.handleMessage(identity_of(PEER), hello(endpoint="inproc://broker"),
                                       0)) == []
    assert quiet(machine.handleBeacon(PEER, "loopback:x", 0)) == [] and machine.peers == {}


def test_a_peer_that_names_our_own_endpoint_is_ignored() -> None:
    """A link to ourselves would be a peer no one answers for."""
    machine = started()
    assert quiet(machine.handleMessage(identity_of(PEER), hello(endpoint=OUR_EP), 0)) == []
    assert quiet(machine.handleBeacon(PEER, OUR_EP, 0)) == [] and machine.peers == {}


def test_a_peer_that_lost_us_soon_after_meeting_is_greeted_back() -> None:
    """One side drops the other for its own reason (a malformed message)
    and greets it again within evasive: the other, which lost nothing, says
    HELLO back, so the first takes what it says again."""
    net = Net()
    a = net.add("A", "tcp://10.0.0.1:40001")
    b = net.add("B", "tcp://10.0.0.2:40002")
    net.perform(a, a.handleBeacon(b.uuid, "tcp://10.0.0.2:40002", net.now))
    net.run()
    assert b.uuid in a.peers and a.uuid in b.peers
    net.now = 1.0
    net.perform(b, b.handleMessage(identity_of(a.uuid), [b"garbage"], net.now))
    assert a.uuid not in b.peers
    net.perform(b, b.handleBeacon(a.uuid, "tcp://10.0.0.1:40001", net.now))
    net.run()
    assert a.uuid in b.peers
    net.perform(a, a.whisper(b.uuid, [b"still there?"], net.now))
    net.run()
    assert ("B", "WHISPER", "A") in net.events


def test_an_unanswered_dial_is_made_again_less_and_less_often() -> None:
    """A node listed at an address it does not announce (a forwarded port)
    takes each new dial for our restart: they come after expired, then twice
    as long each time, up to 8 * expired; a peer known resets the wait."""
    machine = started(evasive=5.0, expired=30.0)
    machine.handleDial("tcp://gateway:9000", 0)
    redials = []
    for now in range(1, 2000):
        if any(isinstance(a, OpenLink) for a in machine.handleTick(float(now))):
            redials.append(now)
    assert redials[:6] == [30, 90, 210, 450, 690, 930]
    machine = started(evasive=5.0, expired=30.0)
    machine.handleDial("tcp://bob.lan:40002", 0)
    machine.handleTick(30.0)
    link = next(a.link for a in machine.handleTick(90.0) if isinstance(a, OpenLink))
    assert machine.dials["tcp://bob.lan:40002"].tries == 2
    machine.handleMessage(identity_of(PEER), hello(endpoint=PEER_EP), 91.0)
    assert machine.peers[PEER].link == link and machine.dials == {}
    machine.handleMessage(identity_of(PEER), [b"garbage"], 92.0)   # dropped: dialled again
    assert machine.dials["tcp://bob.lan:40002"].tries == 0


# --- strangers: peers heard only by their beacons ----------------------------------------


def spoofed(n: int) -> tuple[uuid.UUID, str]:
    return uuid.UUID(int=1000 + n), f"tcp://10.0.9.{n % 250}:{20000 + n}"


def test_a_beacon_makes_a_stranger_and_its_hello_a_peer_on_the_same_link() -> None:
    machine = started()
    link = machine.handleBeacon(PEER, PEER_EP, 0)[0].link
    assert machine.peers == {} and list(machine.strangers) == [PEER]
    actions = greeted(machine, now=0.1)
    assert events(actions) == [("ENTER", None)]
    assert not [a for a in actions if isinstance(a, (OpenLink, CloseLink))]
    assert machine.peers[PEER].link == link and machine.strangers == {}
    assert [m.sequence for m in sent(machine.whisper(PEER, [b"x"], 0.2))] == [2]


def test_strangers_are_bounded_apart_and_the_oldest_goes_with_its_link() -> None:
    machine = started(maxStrangers=3, maxPeers=2)
    links = []
    for n in range(10):
        actions = machine.handleBeacon(*spoofed(n), n / 100)
        links.append(next(a.link for a in actions if isinstance(a, OpenLink)))
        assert len(machine.strangers) == min(n + 1, 3)
        if n >= 3:  # the oldest is forgotten, its link closed, and that is logged
            assert CloseLink(links[n - 3]) in actions
            assert [a.topic for a in actions if isinstance(a, Notice)] == ["strangers"]
    assert list(machine.strangers) == [spoofed(n)[0] for n in (7, 8, 9)]
    assert machine.peers == {}  # beacons never take a place in the table
    # a HELLO is heard whatever the strangers, up to maxPeers
    assert events(greeted(machine, PEER, now=0.2)) == [("ENTER", None)]
    machine.handleMessage(identity_of(OTHER), hello(endpoint="tcp://10.0.0.3:1"), 0.3)
    assert len(machine.peers) == 2 and len(machine.strangers) == 3


def test_a_stranger_is_forgotten_hello_wait_after_its_last_beacon() -> None:
    machine = started(helloWait=3.0)
    link = machine.handleBeacon(PEER, PEER_EP, 0)[0].link
    machine.handleBeacon(OTHER, "tcp://10.0.0.3:1", 0)
    assert machine.handleBeacon(PEER, PEER_EP, 2.0) == []  # refreshed: no second link, no HELLO
    assert machine.handleTick(2.9) == []
    actions = quiet(machine.handleTick(3.0))
    assert actions == [CloseLink(link + 1)] and list(machine.strangers) == [PEER]
    assert machine.handleTick(4.9) == []
    assert quiet(machine.handleTick(5.0)) == [CloseLink(link)] and machine.strangers == {}
    # a port-0 beacon forgets one at once, silently
    machine.handleBeacon(PEER, PEER_EP, 6)
    assert quiet(machine.handleBeacon(PEER, None, 6.1)) == [CloseLink(link + 2)]


def test_a_beacon_naming_an_endpoint_a_link_goes_to_opens_no_other() -> None:
    """One stranger per endpoint (spoofed UUIDs on one port cost one link),
    none at a peer's endpoint or a listed one; a HELLO from there by another
    UUID closes the stranger's link and gets our HELLO on a new one."""
    machine = started()
    machine.handleBeacon(OTHER, PEER_EP, 0)
    for n in range(5):
        assert quiet(machine.handleBeacon(uuid.UUID(int=500 + n), PEER_EP, 0)) == []
    machine.handleDial("tcp://10.0.0.7:7", 0)
    assert quiet(machine.handleBeacon(PEER, "tcp://10.0.0.7:7", 0)) == []
    link = machine.strangers[OTHER].link
    actions = greeted(machine, PEER, now=0.5)
    assert [a for a in actions if isinstance(a, (OpenLink, CloseLink))] == [
        CloseLink(link), OpenLink(link + 2, PEER_EP)]
    assert [m.id for m in sent(actions)] == [codec.Hello.id]
    assert machine.peers[PEER].link == link + 2 and machine.strangers == {}
    assert quiet(machine.handleBeacon(OTHER, PEER_EP, 1)) == []


FORGED_EP = "tcp://10.6.6.6:6666"


def link_of_whisper(machine: HarmonyMachine, opened: dict[int, str], now: float) -> str:
    return opened[next(a.link for a in machine.whisper(PEER, [b"x"], now) if isinstance(a, SendOn))]


@pytest.mark.parametrize("flood", [0, 64])
def test_a_beacon_forged_with_a_peers_uuid_does_not_take_its_link(flood: int) -> None:
    """Forged before its real beacon, or after a flood pushed its stranger out:
    its HELLO names its endpoint: it gets our HELLO on a link there."""
    machine, opened, hellos = started(), {}, []

    def do(actions: list[Any]) -> list[Any]:
        opened.update((a.link, a.endpoint) for a in actions if isinstance(a, OpenLink))
        hellos.extend(opened[a.link] for a in actions
                      if isinstance(a, SendOn) and isinstance(codec.decode(a.frames), codec.Hello))
        return actions
    if flood:
        do(machine.handleBeacon(PEER, PEER_EP, 0))
        for n in range(flood):
            do(machine.handleBeacon(*spoofed(n), 0.01))
    do(machine.handleBeacon(PEER, FORGED_EP, 0.02))
    do(machine.handleBeacon(PEER, PEER_EP, 0.5))
    do(greeted(machine, now=0.6))
    assert hellos[-1] == PEER_EP and opened[machine.peers[PEER].link] == PEER_EP
    assert FORGED_EP not in [stranger.endpoint for stranger in machine.strangers.values()]
    for t in range(1, 40):
        do(machine.handleBeacon(PEER, PEER_EP, t))
        do(machine.handleTick(t + 0.1))
    assert link_of_whisper(machine, opened, 41) == PEER_EP


def test_a_peers_own_beacon_after_a_forged_one_brings_it_our_hello() -> None:
    """Its beacons name two endpoints: the stranger goes, and the one its last
    beacon names gets our HELLO (it may not hear our beacons to say HELLO)."""
    machine = started()
    forged = machine.handleBeacon(PEER, FORGED_EP, 0)[0].link
    actions = machine.handleBeacon(PEER, PEER_EP, 0.5)
    assert quiet(actions)[:2] == [CloseLink(forged), OpenLink(forged + 1, PEER_EP)]
    assert [m.id for m in sent(actions)] == [codec.Hello.id]
    assert machine.strangers[PEER].endpoint == PEER_EP
    assert machine.handleBeacon(PEER, PEER_EP, 1.0) == []  # the same endpoint: refreshed only


def test_a_node_restarted_on_its_port_before_it_answered_gets_our_hello() -> None:
    """B1 had our HELLO and was killed before its own left; B2, on its port
    under a new UUID, says HELLO: it must get ours too, on a new link."""
    net = Net()
    a = net.add("A", OUR_EP)
    b1 = net.add("B1", PEER_EP)
    net.perform(a, a.handleBeacon(b1.uuid, PEER_EP, net.now))
    net.run(limit=1)            # B1 gets our HELLO ...
    net.queue.clear()           # ... and is killed before its HELLO leaves
    net.now = 1.0
    b2 = net.add("B2", PEER_EP)
    net.perform(b2, b2.handleBeacon(a.uuid, OUR_EP, net.now))
    net.perform(a, a.handleBeacon(b2.uuid, PEER_EP, net.now))
    net.run()
    assert list(a.peers) == [b2.uuid] and list(b2.peers) == [a.uuid]
    assert ("B2", "ENTER", "A") in net.events


def test_a_node_restarted_on_a_silent_peers_port_is_met_though_it_cannot_hear_us() -> None:
    """B1 is killed; B2, on its port under a new UUID, hears none of our
    beacons (one-way UDP): B2's beacon drops B1, silent past evasive, and
    brings B2 our HELLO, not 30 s later when B1 expires."""
    net = Net()
    a = net.add("A", OUR_EP)
    b1 = net.add("B1", PEER_EP)
    net.perform(a, a.handleBeacon(b1.uuid, PEER_EP, net.now))
    net.run()
    assert list(a.peers) == [b1.uuid] and list(b1.peers) == [a.uuid]
    net.now = 10.0
    b2 = net.add("B2", PEER_EP)
    for t in range(10, 13):
        net.now = t + 0.1
        net.perform(a, a.handleBeacon(b2.uuid, PEER_EP, net.now))
        net.run()
        net.now = t + 0.5
        net.perform(a, a.handleTick(net.now))
        net.perform(b2, b2.handleTick(net.now))
        net.run()
    assert list(a.peers) == [b2.uuid] and list(b2.peers) == [a.uuid]
    assert ("A", "EXIT", "B1") in net.events and ("B2", "ENTER", "A") in net.events


def test_a_beacon_from_a_new_uuid_drops_the_peer_there_only_once_it_is_evasive() -> None:
    machine = started(evasive=5.0)
    link = greeted(machine)[0].link
    machine.handleTick(4.9)
    assert quiet(machine.handleBeacon(OTHER, PEER_EP, 4.95)) == []
    assert list(machine.peers) == [PEER] and machine.strangers == {}
    machine.handleTick(5.0)
    actions = machine.handleBeacon(OTHER, PEER_EP, 5.1)
    assert events(actions) == [("EXIT", None)] and CloseLink(link) in actions
    assert OpenLink(link + 1, PEER_EP) in actions and [m.id for m in sent(actions)] == [codec.Hello.id]
    assert machine.peers == {} and list(machine.strangers) == [OTHER]


def test_a_beacon_that_drops_an_evasive_listed_peer_leaves_its_endpoint_dialled() -> None:
    """The dial takes the stranger's place, and goes on if nobody answers."""
    machine = started(evasive=5.0)
    link = machine.handleDial(PEER_EP, 0)[0].link
    greeted(machine)
    machine.handleTick(5.0)
    actions = quiet(machine.handleBeacon(OTHER, PEER_EP, 5.1))
    assert events(actions) == [("EXIT", None)] and CloseLink(link) in actions
    assert OpenLink(link + 1, PEER_EP) in actions and [m.id for m in sent(actions)] == [codec.Hello.id]
    assert list(machine.dials) == [PEER_EP] and machine.strangers == {}
    assert events(greeted(machine, OTHER, now=5.2)) == [("ENTER", None)]
    assert machine.peers[OTHER].link == link + 1 and machine.dials == {}


def test_our_status_reaches_strangers_so_it_counts_on_when_they_meet_us() -> None:
    """zeromq-pyre asserts each JOIN carries its last status + 1: a stranger
    had our HELLO, so it hears our JOINs too."""
    machine = started()
    machine.handleBeacon(PEER, PEER_EP, 0)
    joined = sent(machine.join("chat", 0.1))
    assert joined == [codec.Join(2, "chat", 1)]
    greeted(machine, now=0.2)
    assert sent(machine.join("ops", 0.3)) == [codec.Join(3, "ops", 2)]


def test_a_real_peer_meets_us_during_a_flood_of_spoofed_beacons() -> None:
    """1,200 spoofed beacons a second to both nodes, 64 strangers each at
    most: each node's beacon reaches the other within a second and its
    HELLO goes out before its stranger is pushed out, so they meet."""
    net = Net()
    a = net.add("A", "tcp://10.0.0.1:40001")
    b = net.add("B", "tcp://10.0.0.2:40002")
    for tenth in range(30):
        net.now = tenth / 10
        for n in range(120):
            for machine in (a, b):
                net.perform(machine, machine.handleBeacon(*spoofed(tenth * 120 + n), net.now))
                assert len(machine.strangers) <= 64 and not machine.peers
        if tenth == 5:
            net.perform(a, a.handleBeacon(b.uuid, "tcp://10.0.0.2:40002", net.now))
        net.run(limit=10_000)
        if tenth == 5:
            break
    assert ("A", "ENTER", "B") in net.events and ("B", "ENTER", "A") in net.events
    assert list(a.peers) == [b.uuid] and list(b.peers) == [a.uuid]


ops = st.lists(st.tuples(st.sampled_from(["beacon", "leaving", "hello", "ping", "tick", "join"]),
                         st.integers(0, 7), st.integers(0, 4), st.floats(0, 2)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_strangers_and_peers_stay_bounded_apart_and_no_link_is_lost(
        inputs: list[tuple[str, int, int, float]]) -> None:
    """Whatever beacons, HELLOs and ticks come: at most maxStrangers strangers
    and maxPeers peers, never both for one UUID, every stranger gone
    helloWait after its last beacon, and the links open are exactly theirs."""
    machine = started(maxStrangers=3, maxPeers=4, helloWait=1.0)
    opened: set[int] = set()
    now, lastBeacon = 0.0, {}
    for op, who, where, step in inputs:
        now += step
        peer, endpoint = uuid.UUID(int=200 + who), f"tcp://10.0.2.{where}:9"
        if op == "beacon":
            actions = machine.handleBeacon(peer, endpoint, now)
            lastBeacon[peer] = now
        elif op == "leaving":
            actions = machine.handleBeacon(peer, None, now)
        elif op == "hello":
            actions = machine.handleMessage(identity_of(peer), hello(endpoint=endpoint), now)
        elif op == "ping":
            actions = machine.handleMessage(identity_of(peer), codec.encode(codec.Ping(2)), now)
        elif op == "join":
            actions = machine.join(f"g{who}", now)
        else:
            actions = machine.handleTick(now)
            assert all(now - lastBeacon[s] < 1.0 for s in machine.strangers)
        for action in actions:
            if isinstance(action, OpenLink):
                opened.add(action.link)
            elif isinstance(action, CloseLink):
                opened.discard(action.link)
        assert len(machine.strangers) <= 3 and len(machine.peers) <= 4
        assert not set(machine.strangers) & set(machine.peers)
        assert opened == {p.link for p in [*machine.peers.values(), *machine.strangers.values()]}
        assert sorted(machine._strangerAt.values()) == sorted(machine.strangers)


@pytest.mark.parametrize("options", [{"evasive": 30.0}, {"maxStrangers": 0}, {"helloWait": 0.0}])
def test_bad_timing_or_bounds_are_a_clear_error(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="need 0 < evasive < expired, maxStrangers >= 1"):
        HarmonyMachine(US, "us", **options)  # type: ignore[arg-type]
