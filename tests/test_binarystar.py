"""Binary Star over transports, driven by a Clock: the state exchange, the
client vote, failover and recovery, the configuration guard, and a pair of
MDP brokers with a worker and a client that fail over between them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import task
from twisted.logger import globalLogPublisher

from mdp import Broker, Client, Worker
from mdp.binarystar import (
    HEADER,
    MAX_SUBSCRIBERS,
    SUBSCRIBE,
    BinaryStar,
    Role,
    State,
    decode_state,
    encode_state,
)
from mdp.errors import ProtocolError, RequestTimeout, TransportError
from mdp.policy import HeartbeatPolicy
from tests.conftest import LoopbackNet, RawPeer


class Pair:
    """Two state endpoints on a loopback net, and the servers started on them."""

    def __init__(self, net: LoopbackNet) -> None:
        self.net = net
        name = net.bindEndpoint()
        self.endpoints = {Role.PRIMARY: f"{name}-primary", Role.BACKUP: f"{name}-backup"}
        self.events: list[tuple[str, str, str]] = []

    def start(self, role: Role, *, configured: Role | None = None, **options: Any) -> BinaryStar:
        """A server of *role* (configured as *configured*, to test the guard)."""
        other = Role.BACKUP if role is Role.PRIMARY else Role.PRIMARY
        star = BinaryStar(configured or role, self.endpoints[role], self.endpoints[other],
                          self.net.reactor, **options)
        label = role.value
        star.onActive(lambda why: self.events.append((label, "active", why)))
        star.onPassive(lambda why: self.events.append((label, "passive", why)))
        star.onFatal(lambda why: self.events.append((label, "fatal", why)))
        self.net.reactor.advance(0)
        star.start()
        self.net.addCleanup(star.stop)
        return star

    def kinds(self, label: str) -> list[str]:
        return [kind for who, kind, _ in self.events if who == label]


@pytest.fixture
def logged() -> Any:
    lines: list[str] = []

    def observer(event: dict) -> None:
        from twisted.logger import formatEvent

        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observer)
    yield lines
    globalLogPublisher.removeObserver(observer)


# --- the wire form --------------------------------------------------------------------


RUN = "0123456789abcdef"


def test_state_message_round_trip() -> None:
    frames = encode_state(State.PASSIVE, Role.BACKUP, 12.5, RUN, 1.0)
    assert frames == [HEADER, b"STATE", b"4", b"backup", b"12.500000", RUN.encode(), b"1.0"]
    assert decode_state(frames) == (State.PASSIVE, Role.BACKUP, 12.5, RUN, 1.0)


def state(*fields: bytes) -> list[bytes]:
    """A STATE message: *fields* replace the first of state, role, uptime, run, heartbeat."""
    good = [b"1", b"primary", b"0", RUN.encode(), b"1.0"]
    return [HEADER, b"STATE", *fields, *good[len(fields):]]


@pytest.mark.parametrize("frames", [
    [],
    [HEADER, SUBSCRIBE],
    [b"BSTAR02", *state()[1:]],
    state()[:5],
    [*state(), b"extra"],
    state(b"5"),
    state(b"x"),
    state(b"1", b"leader"),
    state(b"1", b"primary", b"-1"),
    state(b"1", b"primary", b"nan"),
    state(b"1", b"primary", b"0", b"short"),
    state(b"1", b"primary", b"0", b"0123456789ABCDEF"),
    state(b"1", b"primary", b"0", RUN.encode(), b"0"),
    state(b"1", b"primary", b"0", RUN.encode(), b"inf"),
    state(b"1", b"primary", b"0", RUN.encode(), b"one"),
])
def test_bad_state_messages_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_state(frames)


def test_configuration_is_checked_at_once() -> None:
    clock = task.Clock()
    with pytest.raises(ValueError, match="primary' or 'backup"):
        BinaryStar("leader", "loopback:a", "loopback:b", clock)
    with pytest.raises(TypeError):
        BinaryStar(1, "loopback:a", "loopback:b", clock)  # type: ignore[arg-type]
    with pytest.raises(TransportError):
        BinaryStar("primary", "tcp://127.0.0.1:5000", "loopback:b", clock)
    with pytest.raises(TransportError):
        BinaryStar("primary", "loopback:a", "nowhere:b", clock)
    with pytest.raises(ValueError):
        BinaryStar("primary", "loopback:a", "loopback:b", clock, heartbeat=0)


# --- a pair ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_state_channel_other_machines_can_reach_is_warned_about(
        clocknet: LoopbackNet, logged: list[str], monkeypatch: Any) -> None:
    """The state channel has no authentication: listening where other
    machines reach it is logged as a warning (here the loopback net stands
    in for such an address: no test listens beyond 127.0.0.1)."""
    import mdp.transport

    pair = Pair(clocknet)
    pair.start(Role.PRIMARY)
    await clocknet.until(lambda: any("state published on" in line for line in logged), timeout=5)
    assert not any("reachable from other machines" in line for line in logged)
    monkeypatch.setattr(mdp.transport, "beyond_loopback", lambda endpoint: True)
    pair.start(Role.BACKUP)
    await clocknet.until(lambda: any("reachable from other machines" in line for line in logged),
                         timeout=5)
    warning = next(line for line in logged if "reachable from other machines" in line)
    assert "Binary Star backup's state channel" in warning
    assert pair.endpoints[Role.BACKUP] in warning and "private network" in warning


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("first", [Role.PRIMARY, Role.BACKUP])
async def test_pair_settles_primary_active_backup_passive(clocknet: LoopbackNet,
                                                          first: Role) -> None:
    pair = Pair(clocknet)
    second = Role.BACKUP if first is Role.PRIMARY else Role.PRIMARY
    stars = {first: pair.start(first)}
    clocknet.advance(1.5)  # alone, within the failover timeout
    stars[second] = pair.start(second)
    await clocknet.until(lambda: stars[Role.PRIMARY].state is State.ACTIVE
                         and stars[Role.BACKUP].state is State.PASSIVE, timeout=5)
    assert pair.kinds("primary") == ["active"] and pair.kinds("backup") == ["passive"]
    assert stars[Role.PRIMARY].serving and not stars[Role.BACKUP].serving
    clocknet.advance(10)  # the pair stays as it is
    assert pair.kinds("primary") == ["active"] and pair.kinds("backup") == ["passive"]
    # a client request at the passive one is refused while the primary talks
    assert stars[Role.BACKUP].admitClient() is False
    assert stars[Role.PRIMARY].admitClient() is True
    status = stars[Role.BACKUP].status()
    assert status["role"] == "backup" and status["state"] == "passive"
    assert status["peer"] == "active" and status["peerSilence"] <= 1.0
    assert status["serving"] is False


@pytest_twisted.ensureDeferred
async def test_a_peer_heard_then_silent_is_warned_about_with_what_this_server_does(
        clocknet: LoopbackNet, logged: list[str]) -> None:
    """A primary heard, then stopped: the backup says its peer went silent
    and what it does meanwhile, not "no failover" (it may just have failed
    over), and then, active, that it serves alone."""
    pair = Pair(clocknet)
    stars = {role: pair.start(role) for role in (Role.PRIMARY, Role.BACKUP)}
    await clocknet.until(lambda: stars[Role.BACKUP].state is State.PASSIVE, timeout=5)
    stars[Role.PRIMARY].stop()
    clocknet.advance(11)
    (warned,) = [line for line in logged if "silent for" in line]
    assert "Binary Star backup: the peer at" in warned and "(it was heard before)" in warned
    assert warned.endswith("this server is passive and becomes active at the next client's request")
    assert not any("no failover" in line for line in logged)
    assert stars[Role.BACKUP].admitClient() is True  # a client's vote
    clocknet.advance(61)
    assert [line for line in logged if "silent for" in line][-1].endswith(
        "this server is active and serves alone until the peer is back")


@pytest_twisted.ensureDeferred
async def test_a_vote_that_an_observer_answers_with_stop_is_not_served(
        clocknet: LoopbackNet, logged: list[str]) -> None:
    """The client's vote makes the backup active; an observer of that stops
    it: the request that voted is not served by a stopped server."""
    pair = Pair(clocknet)
    primary, backup = pair.start(Role.PRIMARY), pair.start(Role.BACKUP)
    await clocknet.until(lambda: backup.state is State.PASSIVE, timeout=5)
    await clocknet.wait(primary.stop())
    clocknet.advance(12)
    stopping = []
    backup.onActive(lambda reason: stopping.append(backup.stop()))
    assert backup.admitClient() is False
    assert stopping
    await clocknet.wait(stopping[0])


@pytest_twisted.ensureDeferred
async def test_failover_needs_a_client_vote_and_the_failover_timeout(
        clocknet: LoopbackNet, logged: list[str]) -> None:
    pair = Pair(clocknet)
    primary, backup = pair.start(Role.PRIMARY), pair.start(Role.BACKUP)
    await clocknet.until(lambda: backup.state is State.PASSIVE, timeout=5)
    await clocknet.wait(primary.stop())  # the primary dies
    died = clocknet.reactor.seconds()
    clocknet.advance(1.5)
    assert backup.admitClient() is False  # silent for less than 2 s
    clocknet.advance(10)
    assert backup.state is State.PASSIVE  # no vote, no takeover
    assert backup.admitClient() is True  # the client's vote
    assert backup.state is State.ACTIVE and backup.serving
    assert pair.kinds("backup") == ["passive", "active"]
    assert clocknet.reactor.seconds() - died >= backup.machine.failoverTimeout
    assert any("backup: passive -> active" in line for line in logged)

    # the primary comes back: passive, as there is no automatic fail-back
    primary2 = pair.start(Role.PRIMARY)
    await clocknet.until(lambda: primary2.state is State.PASSIVE, timeout=5)
    clocknet.advance(5)
    assert backup.state is State.ACTIVE and primary2.state is State.PASSIVE
    assert primary2.admitClient() is False
    # then the backup dies: the primary takes over on the next vote
    await clocknet.wait(backup.stop())
    clocknet.advance(2.5)
    assert primary2.admitClient() is True and primary2.state is State.ACTIVE


@pytest_twisted.ensureDeferred
async def test_states_are_kept_for_no_one(clocknet: LoopbackNet) -> None:
    """Like the Guide's PUB socket: states published while no one listens
    are gone; a subscriber that comes later gets the current state only."""
    pair = Pair(clocknet)
    backup = pair.start(Role.BACKUP)
    clocknet.advance(30)  # 30 states published to no one
    assert backup.state is State.BACKUP and backup.admitClient() is False  # waits for a primary
    late = RawPeer(clocknet, pair.endpoints[Role.BACKUP])
    clocknet.reactor.advance(0)
    late.send(HEADER, SUBSCRIBE)
    clocknet.advance(0.5)
    assert len(late.received) == 1
    heard = decode_state(late.received[0])
    assert (heard.state, heard.role) == (State.BACKUP, Role.BACKUP) and heard.uptime >= 30
    # a backup started first waits for its primary, then goes passive
    primary = pair.start(Role.PRIMARY)
    await clocknet.until(lambda: backup.state is State.PASSIVE, timeout=5)
    assert primary.state is State.ACTIVE
    assert pair.kinds("primary") == ["active"] and pair.kinds("backup") == ["passive"]


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("role", [Role.PRIMARY, Role.BACKUP])
async def test_the_same_role_twice_stops_the_later_server(clocknet: LoopbackNet,
                                                          logged: list[str], role: Role) -> None:
    pair = Pair(clocknet)
    earlier = pair.start(Role.PRIMARY, configured=role)
    clocknet.advance(1.5)  # more than a heartbeat: no tie
    later = pair.start(Role.BACKUP, configured=role)
    await clocknet.until(lambda: later.machine.stopped is not None, timeout=5)
    assert pair.kinds("backup") == ["fatal"]  # the later one, on the backup's endpoints
    assert not later.serving and later.admitClient() is False
    assert later.endpoint is None  # its state channel is closed
    assert earlier.machine.stopped is None
    assert any(f"both servers are configured {role.value}; this one started later" in line
               for line in logged)


@pytest_twisted.ensureDeferred
async def test_bad_input_on_the_state_endpoint_is_dropped_and_logged(
        clocknet: LoopbackNet, logged: list[str]) -> None:
    pair = Pair(clocknet)
    primary = pair.start(Role.PRIMARY)
    clocknet.advance(0.1)
    intruder = RawPeer(clocknet, pair.endpoints[Role.PRIMARY])
    clocknet.reactor.advance(0)
    intruder.send(b"hello")
    clocknet.advance(0.1)
    assert any("not a subscription" in line for line in logged)
    # a subscriber gets the state at once, then every heartbeat
    intruder.send(HEADER, SUBSCRIBE)
    first = await intruder.nextMessage()
    assert decode_state(first)[:2] == (State.PRIMARY, Role.PRIMARY)
    # a bad state from the "peer" is dropped, and is no state
    fake = RawRouterPeer(clocknet, pair.endpoints[Role.BACKUP])
    await fake.listen()
    await clocknet.until(lambda: fake.subscribers, timeout=5)
    fake.send(state(b"9", b"backup"))
    clocknet.advance(0.1)
    assert any("dropped a bad message" in line for line in logged)
    assert primary.peerState is None and primary.state is State.PRIMARY


@pytest_twisted.ensureDeferred
async def test_subscribers_are_bounded(clocknet: LoopbackNet, logged: list[str]) -> None:
    pair = Pair(clocknet)
    primary = pair.start(Role.PRIMARY)
    clocknet.advance(0.1)
    peers = [RawPeer(clocknet, pair.endpoints[Role.PRIMARY]) for _ in range(MAX_SUBSCRIBERS + 2)]
    clocknet.reactor.advance(0)
    for peer in peers:
        peer.send(HEADER, SUBSCRIBE)
    clocknet.advance(0.1)
    subscribers = primary._subscribers
    assert len(subscribers) == MAX_SUBSCRIBERS
    assert any("the least recently heard" in line for line in logged)
    # the peer, which asks every heartbeat, gets a place back at once
    peers[0].send(HEADER, SUBSCRIBE)
    clocknet.advance(0.1)
    assert len(subscribers) == MAX_SUBSCRIBERS and len(peers[0].received) == 2
    # silent subscribers are forgotten after the failover timeout
    clocknet.advance(2 * primary.machine.failoverTimeout)
    assert not primary._subscribers


class RawRouterPeer:
    """A bound endpoint standing in for a peer's publisher."""

    def __init__(self, net: LoopbackNet, endpoint: str) -> None:
        self.net = net
        self.endpoint = endpoint
        self.subscribers: list[bytes] = []
        self.transport: Any = None

    async def listen(self) -> None:
        from mdp import transport

        self.transport = await self.net.wait(transport.listen(self.endpoint, self,
                                                              self.net.reactor))
        self.net.addCleanup(self.transport.close)

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        if peer not in self.subscribers:
            self.subscribers.append(peer)

    def peerDisconnected(self, peer: bytes) -> None:
        pass

    def send(self, frames: list[bytes]) -> None:
        for peer in self.subscribers:
            self.transport.sendMessage(peer, frames)


# --- a pair of brokers ------------------------------------------------------------------

HB = HeartbeatPolicy(0.25, 4)


async def start_broker(net: LoopbackNet, pair: Pair, role: Role) -> tuple[Broker, BinaryStar, str]:
    star = pair.start(role)
    broker = Broker(net.reactor, heartbeat=HB, admission=star)
    endpoint = f"{pair.endpoints[role]}-mdp"
    await net.wait(broker.listen(endpoint))
    net.addCleanup(broker.close)
    return broker, star, endpoint


async def binarystar_status(net: LoopbackNet, endpoint: str) -> dict:
    client = Client(endpoint, net.reactor, timeout=1, retries=1)
    try:
        reply = await net.wait(client.request("mmi.binarystar", b""))
    finally:
        await net.wait(client.close())
    return json.loads(reply[0])


@pytest_twisted.ensureDeferred
async def test_brokers_fail_over_with_their_clients_and_workers(clocknet: LoopbackNet) -> None:
    pair = Pair(clocknet)
    primary, primaryStar, a = await start_broker(clocknet, pair, Role.PRIMARY)
    backup, backupStar, b = await start_broker(clocknet, pair, Role.BACKUP)
    await clocknet.until(lambda: backupStar.state is State.PASSIVE, timeout=5)

    worker = Worker([b, a], "echo", lambda frames: frames, clocknet.reactor, heartbeat=HB)
    worker.start()
    clocknet.addCleanup(worker.stop)
    client = Client([a, b], clocknet.reactor, timeout=1.0, retries=10)
    clocknet.addCleanup(client.close)
    # the worker tried the passive backup first: refused there, registered at the primary
    assert await clocknet.wait(client.request("echo", b"1")) == [b"1"]
    assert len(primary.workers) == 1 and not backup.workers
    assert (await binarystar_status(clocknet, a))["state"] == "active"
    passive = await binarystar_status(clocknet, b)  # answered, though passive
    assert passive["state"] == "passive" and passive["peer"] == "active"
    # the passive broker answers no other request
    lost = Client(b, clocknet.reactor, timeout=1, retries=2)
    clocknet.addCleanup(lost.close)
    with pytest.raises(RequestTimeout):
        await clocknet.wait(lost.request("echo", b"x"))
    with pytest.raises(RequestTimeout):
        await clocknet.wait(lost.request("mmi.service", b"echo"))

    # the primary dies: its broker and state channel go at once
    await clocknet.wait(primaryStar.stop())
    await clocknet.wait(primary.close())
    died = clocknet.reactor.seconds()
    replies = [client.request("echo", b"%d" % n) for n in range(5)]
    for n, d in enumerate(replies):
        assert await clocknet.wait(d) == [b"%d" % n]
    assert backupStar.state is State.ACTIVE and len(backup.workers) == 1
    assert clocknet.reactor.seconds() - died < 4  # vote after 2 s, the worker within 1.25 s

    # the primary comes back: passive, it refuses workers and clients
    primary2 = Broker(clocknet.reactor, heartbeat=HB)
    star2 = BinaryStar("primary", pair.endpoints[Role.PRIMARY], pair.endpoints[Role.BACKUP],
                       clocknet.reactor)
    primary2.admission = star2
    star2.start()
    clocknet.addCleanup(star2.stop)
    await clocknet.wait(primary2.listen(a))
    clocknet.addCleanup(primary2.close)
    await clocknet.until(lambda: star2.state is State.PASSIVE, timeout=5)
    assert await clocknet.wait(client.request("echo", b"again")) == [b"again"]
    assert not primary2.workers
    # recovery by hand: stop the backup, the primary takes over on a vote
    await clocknet.wait(backupStar.stop())
    await clocknet.wait(backup.close())
    assert await clocknet.wait(client.request("echo", b"back")) == [b"back"]
    assert star2.state is State.ACTIVE and len(primary2.workers) == 1


@pytest_twisted.ensureDeferred
async def test_mmi_binarystar_without_a_pair_is_not_implemented(clocknet: LoopbackNet) -> None:
    broker = Broker(clocknet.reactor)
    endpoint = clocknet.bindEndpoint()
    await clocknet.wait(broker.listen(endpoint))
    clocknet.addCleanup(broker.close)
    client = Client(endpoint, clocknet.reactor)
    clocknet.addCleanup(client.close)
    assert await clocknet.wait(client.request("mmi.binarystar", b"")) == [b"501"]


# --- options ----------------------------------------------------------------------------


def test_twist_broker_bstar_options() -> None:
    from twisted.python import usage

    from mdp.app.tap import BrokerOptions

    def parse(*args: str) -> BrokerOptions:
        options = BrokerOptions()
        options.parseOptions(list(args))
        return options

    pair = ("--bstar-local", "zmq:tcp://127.0.0.1:5003", "--bstar-remote", "zmq:tcp://127.0.0.1:5004")
    with pytest.raises(usage.UsageError, match="go together"):
        parse("--bstar", "primary")
    with pytest.raises(usage.UsageError, match="go together"):
        parse(*pair)
    with pytest.raises(usage.UsageError, match="primary or backup"):
        parse("--bstar", "leader", *pair)
    with pytest.raises(usage.UsageError, match="--bstar-remote: bad endpoint"):
        parse("--bstar", "backup", "--bstar-local", "zmq:tcp://127.0.0.1:5003",
              "--bstar-remote", "tcp://127.0.0.1:5004")
    service = parse("--bstar", "backup", "--bstar-heartbeat", "0.5", *pair).makeService()
    star = service.binaryStar
    assert star.role is Role.BACKUP and star.machine.heartbeat == 0.5
    assert (star.local, star.remote) == ("zmq:tcp://127.0.0.1:5003", "zmq:tcp://127.0.0.1:5004")
    assert service.broker.admission is star
    assert parse().makeService().binaryStar is None


@pytest.mark.parametrize("args, brokers", [
    ([], ["zmq:tcp://127.0.0.1:5555"]),
    (["--broker", "zmq:tcp://a:1"], ["zmq:tcp://a:1"]),
    (["--broker", "zmq:tcp://a:1", "-b", "tcp:host=b:port=2"], ["zmq:tcp://a:1", "tcp:host=b:port=2"]),
    (["--broker", "zmq:tcp://a:1,zmq:tcp://b:2", "--broker", "zmq:tcp://c:3"],
     ["zmq:tcp://a:1", "zmq:tcp://b:2", "zmq:tcp://c:3"]),
])
def test_broker_given_once_per_broker(args: list[str], brokers: list[str]) -> None:
    from mdp.app.cli import CallOptions
    from mdp.app.tap import TitanicOptions, WorkerOptions

    worker = WorkerOptions()
    worker.parseOptions([*args, "--service", "echo"])
    assert worker["brokers"] == brokers
    titanic = TitanicOptions()
    titanic.parseOptions(args)
    assert titanic["brokers"] == brokers
    call = CallOptions()
    call.parseOptions([*args, "echo", "x"])
    assert call["brokers"] == brokers


def test_a_bad_broker_among_several_is_a_usage_error() -> None:
    from twisted.python import usage

    from mdp.app.tap import WorkerOptions

    with pytest.raises(usage.UsageError, match="--broker: bad endpoint 'tcp://b:2'"):
        WorkerOptions().parseOptions(["--broker", "zmq:tcp://a:1", "--broker", "tcp://b:2",
                                      "--service", "echo"])


# --- configuration mistakes and restarts ------------------------------------------------


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("role", [Role.PRIMARY, Role.BACKUP])
async def test_the_same_role_started_together_stops_exactly_one(clocknet: LoopbackNet,
                                                                role: Role) -> None:
    """Starts closer than a heartbeat are a tie: the run ids decide, the same
    way on both sides."""
    pair = Pair(clocknet)
    one = pair.start(Role.PRIMARY, configured=role)
    two = pair.start(Role.BACKUP, configured=role)
    await clocknet.until(lambda: one.machine.stopped or two.machine.stopped, timeout=5)
    clocknet.advance(10)
    assert sorted(kind for _, kind, _ in pair.events) == ["fatal"]
    stopped = one if one.machine.stopped else two
    kept = two if stopped is one else one
    assert stopped.machine.instance > kept.machine.instance
    assert kept.machine.stopped is None


@pytest_twisted.ensureDeferred
async def test_a_server_subscribed_to_itself_stops(clocknet: LoopbackNet) -> None:
    name = clocknet.bindEndpoint()
    star = BinaryStar("primary", name, name, clocknet.reactor)
    fatal: list[str] = []
    star.onFatal(fatal.append)
    star.start()
    clocknet.addCleanup(star.stop)
    await clocknet.until(lambda: bool(fatal), timeout=5)
    assert "hears its own state" in fatal[0]
    assert not star.serving


@pytest_twisted.ensureDeferred
async def test_different_heartbeats_stop_both(clocknet: LoopbackNet) -> None:
    pair = Pair(clocknet)
    primary = pair.start(Role.PRIMARY, heartbeat=1.0)
    backup = pair.start(Role.BACKUP, heartbeat=3.0)
    await clocknet.until(lambda: primary.machine.stopped and backup.machine.stopped, timeout=10)
    assert "heartbeat is 3 s, this one's 1 s" in primary.machine.stopped
    assert "heartbeat is 1 s, this one's 3 s" in backup.machine.stopped


@pytest_twisted.ensureDeferred
async def test_a_restart_is_a_fresh_run(clocknet: LoopbackNet) -> None:
    """stop() then start(): back to the role's first state, the peer unknown;
    here the peer took over meanwhile, so the primary comes back passive."""
    pair = Pair(clocknet)
    primary, backup = pair.start(Role.PRIMARY), pair.start(Role.BACKUP)
    await clocknet.until(lambda: primary.serving and backup.state is State.PASSIVE, timeout=5)
    first = primary.machine.instance
    await clocknet.wait(primary.stop())
    clocknet.advance(3)
    assert backup.admitClient() is True
    started = primary.start()
    assert primary.state is State.PRIMARY and not primary.serving and primary.peerState is None
    assert primary.machine.instance != first
    await clocknet.wait(started)
    await clocknet.until(lambda: primary.state is State.PASSIVE, timeout=5)
    assert backup.state is State.ACTIVE and backup.machine.stopped is None


@pytest_twisted.ensureDeferred
async def test_a_broker_that_cannot_bind_closes_its_state_channel(clocknet: LoopbackNet) -> None:
    from mdp import BrokerService
    from mdp.errors import TransportError as Taken
    from tests.conftest import raw_router

    taken = await raw_router(clocknet)
    pair = Pair(clocknet)
    star = BinaryStar("primary", pair.endpoints[Role.PRIMARY], pair.endpoints[Role.BACKUP],
                      clocknet.reactor)
    service = BrokerService(taken.transport.endpoint, reactor=clocknet.reactor, binaryStar=star)
    with pytest.raises(Taken):
        await clocknet.wait(service.startService())
    assert star.endpoint is None and not star._ticker.running
    # the state endpoint is free again
    again = BinaryStar("primary", pair.endpoints[Role.PRIMARY], pair.endpoints[Role.BACKUP],
                       clocknet.reactor)
    await clocknet.wait(again.start())
    await clocknet.wait(again.stop())


@pytest_twisted.ensureDeferred
async def test_workers_vote_after_a_quiet_failover(clocknet: LoopbackNet) -> None:
    """Default heartbeats, no client traffic when the primary dies: the
    worker's READY at the backup is a vote, so the first request afterwards
    completes within a client's default budget."""
    pair = Pair(clocknet)
    stars, brokers, endpoints = {}, {}, {}
    for role in (Role.PRIMARY, Role.BACKUP):
        stars[role] = pair.start(role)
        brokers[role] = Broker(clocknet.reactor, admission=stars[role])
        endpoints[role] = f"{pair.endpoints[role]}-mdp"
        await clocknet.wait(brokers[role].listen(endpoints[role]))
        clocknet.addCleanup(brokers[role].close)
    both = [endpoints[Role.PRIMARY], endpoints[Role.BACKUP]]
    worker = Worker(both, "echo", lambda frames: frames, clocknet.reactor)
    worker.start()
    clocknet.addCleanup(worker.stop)
    await clocknet.until(lambda: bool(brokers[Role.PRIMARY].workers)
                         and stars[Role.BACKUP].state is State.PASSIVE, timeout=30)
    await clocknet.wait(stars[Role.PRIMARY].stop())
    await clocknet.wait(brokers[Role.PRIMARY].close())
    clocknet.advance(300)  # nobody asks for anything meanwhile
    assert stars[Role.BACKUP].serving and len(brokers[Role.BACKUP].workers) == 1
    client = Client(both, clocknet.reactor)  # 3 attempts of 2.5 s
    clocknet.addCleanup(client.close)
    assert await clocknet.wait(client.request("echo", b"later")) == [b"later"]


@pytest_twisted.ensureDeferred
async def test_a_pair_frozen_together_carries_on_as_it_was(clocknet: LoopbackNet,
                                                           logged: list[str]) -> None:
    """Both servers stopped for 5 s at once (a paused host): each notices its
    stall, ignores what waited on its old state channel, and the pair goes on
    as before: no takeover, no dual active, no fatal error."""
    pair = Pair(clocknet)
    primary, backup = pair.start(Role.PRIMARY), pair.start(Role.BACKUP)
    await clocknet.until(lambda: backup.state is State.PASSIVE, timeout=5)
    old = backup._subscriber
    clocknet.reactor.advance(5.0)  # one jump: every tick was missed
    assert primary.machine.channel == backup.machine.channel == 1
    assert backup._subscriber is not old and old.transport is None
    # the passive one takes no vote on stale silence
    assert backup.admitClient() is False
    await clocknet.until(lambda: primary.serving, timeout=5)
    clocknet.advance(10)
    assert primary.state is State.ACTIVE and backup.state is State.PASSIVE
    assert pair.kinds("primary") == ["active"] and pair.kinds("backup") == ["passive"]
    assert backup.admitClient() is False and primary.admitClient() is True
    assert sum("heard nothing for 5.000 s" in line for line in logged) == 2
    assert any("primary: active again after the stall (the peer is passive)" in line
               for line in logged)


class Switch:
    """An admission switched by hand: active, or passive (a Binary Star peer
    took over)."""

    def __init__(self) -> None:
        self.state = "active"

    def admitClient(self, now: float) -> bool:
        return self.state == "active"

    def admitWorker(self, now: float) -> bool:
        return self.state == "active"

    def status(self, now: float) -> dict:
        return {"state": self.state, "serving": self.state == "active"}


def test_a_broker_gone_passive_lets_its_queue_and_workers_go() -> None:
    """Its queued requests are dropped unanswered, as the requests it
    refuses are (a client still waiting times out and sends it to the
    active broker: a 503 would end it there), idle workers get DISCONNECT
    at once, busy ones when they have replied; nothing more is dispatched."""
    from mdp.majordomo import codec
    from mdp.testing import Disconnect, Receive, Script, Send

    W, C = codec.WORKER_HEADER, codec.CLIENT_HEADER
    script = Script()
    switch = Switch()
    broker = Broker(reactor=script.clock, heartbeat=HeartbeatPolicy(1.0, 3), admission=switch)
    broker.listen(script.endpoint("broker"))
    script.feed(Receive(b"W1", [W, codec.W_READY, b"echo"]),
                Receive(b"W2", [W, codec.W_READY, b"echo"]),
                Receive(b"W3", [W, codec.W_READY, b"other"]))
    sent = script.feed(*[Receive(b"A", [C, codec.C_REQUEST, b"echo", b"%d" % n])
                         for n in range(3)])
    assert [s.to for s in sent] == [b"W1", b"W2"] and broker.queued == 1
    envelope = sent[0].frames[2]

    switch.state = "passive"
    mark = len(script.actions)
    broker.admissionChanged()
    out = script.actions[mark:]
    assert [a for a in out if isinstance(a, Send) and a.to == b"A"] == []
    assert Send(b"W3", [W, codec.W_DISCONNECT]) in out and Disconnect(b"W3") in out
    assert set(broker.workers) and broker.queued == 0  # W1, W2 busy: still there
    # W1 replies: the reply goes to its client, W1 is let go, not given more
    out = script.feed(Receive(b"W1", [W, codec.W_FINAL, envelope, b"", b"0"]))
    assert out == [Send(b"A", [C, codec.C_FINAL, b"echo", b"0"]),
                   Send(b"W1", [W, codec.W_DISCONNECT]), Disconnect(b"W1")]
    assert [key[1] for key in broker.workers] == [b"W2"]


class TwoClocks:
    """A pair over loopback, each server on a Clock of its own, so that one
    can be stopped alone (as SIGSTOP does) while the other runs on."""

    def __init__(self, name: str) -> None:
        self.clocks = {Role.PRIMARY: task.Clock(), Role.BACKUP: task.Clock()}
        self.stars = {
            role: BinaryStar(role, f"loopback:{name}-{role.value}",
                             f"loopback:{name}-{other.value}", self.clocks[role])
            for role, other in ((Role.PRIMARY, Role.BACKUP), (Role.BACKUP, Role.PRIMARY))}
        for star in self.stars.values():
            star.start()

    def run(self, seconds: float, *roles: Role) -> None:
        """Let time pass in steps of 10 ms for *roles* (both if none given)."""
        for _ in range(round(seconds / 0.01)):
            for role in roles or tuple(Role):
                clock = self.clocks[role]
                clock.rightNow = round(clock.rightNow + 0.01, 9)
                clock.advance(0)

    def stop(self) -> None:
        for star in self.stars.values():
            star.stop()
        for clock in self.clocks.values():
            clock.advance(1)


@pytest.mark.parametrize("takeover", [False, True])
def test_an_active_server_stopped_alone(takeover: bool, logged: list[str]) -> None:
    """The primary, active, is stopped for 2.5 s (its failover timeout is 2 s)
    while the backup runs on.  With a client's vote at the backup meanwhile,
    the backup takes over and the primary, back, goes passive (not a fatal
    dual active); without, the primary serves again and tells the backup at
    once, so that a vote just after it came back is refused there."""
    pair = TwoClocks(f"alone-{takeover}")
    primary, backup = pair.stars[Role.PRIMARY], pair.stars[Role.BACKUP]
    try:
        pair.run(1.0)
        assert primary.admitClient() and backup.state is State.PASSIVE
        pair.run(9.5)
        pair.run(2.5, Role.BACKUP)  # the primary is stopped
        if takeover:
            assert backup.admitClient() is True and backup.state is State.ACTIVE
        pair.clocks[Role.PRIMARY].advance(2.5)  # and goes on: its missed tick at once
        assert not primary.serving  # until it hears the backup on a fresh channel
        pair.run(0.3)
        if takeover:
            assert primary.state is State.PASSIVE and backup.state is State.ACTIVE
            assert any("primary: active -> passive (the peer took over while this server "
                       "was stalled)" in line for line in logged)
        else:
            assert primary.serving
            assert backup.admitClient() is False  # the primary was heard again
        pair.run(5.0)
        assert primary.machine.stopped is None and backup.machine.stopped is None
        assert (primary.serving, backup.serving) == ((False, True) if takeover else (True, False))
    finally:
        pair.stop()


@pytest.mark.parametrize("first", ["client", "worker"])
def test_a_broker_voted_active_serves_before_its_next_tick(first: str) -> None:
    """A broker seen passive at a tick is voted active by a request (or a
    worker's READY) in between ticks: what is queued is dispatched at once,
    as at any active broker, not left waiting for a tick (a plain
    ``Broker(admission=star)`` is told of no change but through the votes)."""
    from mdp.majordomo import codec
    from mdp.testing import Receive, Script, Send

    W, C = codec.WORKER_HEADER, codec.CLIENT_HEADER
    script = Script()
    switch = Switch()
    switch.state = "passive"
    broker = Broker(reactor=script.clock, heartbeat=HeartbeatPolicy(1.0, 3), admission=switch)
    broker.listen(script.endpoint("broker"))
    script.clock.advance(1.0)  # a tick: passive
    assert broker._passive
    switch.state = "active"    # the peer died, and a vote takes over
    request = Receive(b"A", [C, codec.C_REQUEST, b"echo", b"hi"])
    ready = Receive(b"W1", [W, codec.W_READY, b"echo"])
    sent = script.feed(*((request, ready) if first == "client" else (ready, request)))
    work = [s for s in sent if isinstance(s, Send) and s.to == b"W1"
            and s.frames[1] == codec.W_REQUEST]
    assert len(work) == 1 and work[0].frames[-1] == b"hi" and broker.queued == 0


@pytest_twisted.ensureDeferred
async def test_a_misconfigured_server_restarted_later_stops_again_alone(
        clocknet: LoopbackNet) -> None:
    """The earlier server forgets a conflict once its peer has been silent:
    the same mistake started again ten minutes on (a supervisor restarting
    it) stops that one again, not the server that has been running."""
    pair = Pair(clocknet)
    earlier = pair.start(Role.PRIMARY)
    clocknet.advance(1.5)
    for _ in range(2):
        later = pair.start(Role.BACKUP, configured=Role.PRIMARY)
        await clocknet.until(lambda star=later: star.machine.stopped is not None, timeout=5)
        await clocknet.wait(later.stop())
        clocknet.advance(600)
    assert earlier.machine.stopped is None and earlier.admitClient() is True
    assert pair.kinds("backup") == ["fatal", "fatal"]


@pytest.mark.parametrize("transit", [0.0, 0.0003])
@pytest.mark.parametrize("gap", [0.9996, 0.9999, 1.0, 1.0001, 1.0004])
@pytest.mark.parametrize("greater", ["earlier", "later"])
def test_the_same_role_about_a_heartbeat_apart_stops_exactly_one(gap: float, greater: str,
                                                                 transit: float) -> None:
    """At the edge of the tie, each side's view of the other's start is off
    by the message's transit: whichever way each judges, one stops, not
    both, not neither."""
    from mdp.binarystar import BinaryStarMachine, PublishState

    one = BinaryStarMachine(Role.PRIMARY, heartbeat=1.0, instance="1" * 16, now=0.0)
    two = BinaryStarMachine(Role.PRIMARY, heartbeat=1.0, instance="2" * 16, now=gap)
    if greater == "earlier":
        one.instance, two.instance = two.instance, one.instance
    # each ticks once a heartbeat from its start; a state arrives *transit* later
    events = sorted([(round(k + 0.0, 6), 0, one, two) for k in range(1, 20)]
                    + [(round(gap + k, 6), 0, two, one) for k in range(0, 20)],
                    key=lambda e: e[0])
    while events:
        now, kind, me, peer = events.pop(0)
        if kind == 0:
            for action in me.handleTick(now):
                if isinstance(action, PublishState):
                    frames = encode_state(action.state, action.role, action.uptime,
                                          action.instance, action.heartbeat)
                    events.append((round(now + transit, 6), 1, peer, frames))
                    events.sort(key=lambda e: (e[0], e[1]))
        else:
            said = decode_state(peer)
            me.handlePeerState(said.state, said.role, said.uptime, now,
                               peerInstance=said.instance, peerHeartbeat=said.heartbeat)
    stopped = [m for m in (one, two) if m.stopped is not None]
    assert len(stopped) == 1, [(m.instance, m.stopped) for m in (one, two)]


@pytest_twisted.ensureDeferred
async def test_a_remote_that_is_not_the_peers_state_endpoint_is_warned_about(
        clocknet: LoopbackNet, logged: list[str]) -> None:
    """``--bstar-remote`` given the peer broker's MDP endpoint: the broker
    drops each subscription it cannot read, and the pipe comes back no faster
    than a reconnect interval (no loop within one reactor turn); the server
    says, now and then, that its peer is not heard and why that may be."""
    pair = Pair(clocknet)
    primary, _, mdpEndpoint = await start_broker(clocknet, pair, Role.PRIMARY)
    other = BinaryStar(Role.BACKUP, pair.endpoints[Role.BACKUP], mdpEndpoint, clocknet.reactor)
    other.start()
    clocknet.addCleanup(other.stop)
    clocknet.advance(11)
    warned = [line for line in logged if "no state heard from the peer" in line]
    assert len(warned) == 1 and mdpEndpoint in warned[0] and "(never, since this start)" in warned[0]
    assert "--bstar-remote its --bstar-local" in warned[0]
    clocknet.advance(30)
    assert len([line for line in logged if "no state heard from the peer" in line]) == 1
    clocknet.advance(31)
    assert len([line for line in logged if "no state heard from the peer" in line]) == 2
    assert other.peerState is None and other.machine.stopped is None
