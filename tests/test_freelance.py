"""Freelance (brokerless) request-reply, models 1-3, over every transport."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import NoServerAvailable, RequestTimeout, WorkerError
from mdp.freelance import FreelanceServer, ServerState, freelance_client
from mdp.policy import HeartbeatPolicy
from tests.conftest import Net

FAST = {"heartbeat": HeartbeatPolicy(0.2, 3), "timeout": 0.3, "deadline": 5.0}


class Server(FreelanceServer):
    """A server that can be frozen (answers nothing, not even PING) or killed."""

    def __init__(self, name: str, reactor: Any, handler: Any = None) -> None:
        super().__init__(handler or (lambda frames: [name.encode(), *frames]), reactor)
        self.name = name
        self.frozen = False
        self.endpoint = ""

    def received(self, routerTransport: Any, peer: bytes, frames: list[bytes]) -> None:
        if not self.frozen:
            super().received(routerTransport, peer, frames)


async def start_server(net: Net, name: str, endpoint: str = "", handler: Any = None) -> Server:
    server = Server(name, net.reactor, handler)
    bound = await net.wait(server.listen(endpoint or net.bindEndpoint()))
    server.endpoint = bound.endpoint
    net.addCleanup(server.close)
    return server


def client_for(net: Net, endpoints: list[str], model: int = 3, **options: Any) -> Any:
    if model == 3:
        options = {**FAST, **options}
    client = freelance_client(endpoints, model, net.reactor, **options)
    net.addCleanup(client.close)
    return client


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_every_model_gets_replies(net: Net, model: int) -> None:
    servers = [await start_server(net, name) for name in ("a", "b", "c")]
    client = client_for(net, [s.endpoint for s in servers], model)
    for n in range(5):
        reply = await net.wait(client.request(b"req", str(n)))
        assert reply[0] in (b"a", b"b", b"c")
        assert reply[1:] == [b"req", str(n).encode()]


@pytest.mark.parametrize("model", [2, 3])
@pytest_twisted.ensureDeferred
async def test_concurrent_requests_are_correlated(net: Net, model: int) -> None:
    servers = [await start_server(net, name) for name in ("a", "b")]
    client = client_for(net, [s.endpoint for s in servers], model)
    replies = await net.wait(defer.gatherResults([client.request(str(n)) for n in range(30)]))
    assert [r[1:] for r in replies] == [[str(n).encode()] for n in range(30)]


@pytest_twisted.ensureDeferred
async def test_model3_answers_with_one_server_killed_and_one_frozen(net: Net) -> None:
    killed, frozen, healthy = [await start_server(net, n) for n in ("killed", "frozen", "healthy")]
    client = client_for(net, [killed.endpoint, frozen.endpoint, healthy.endpoint])
    await net.until(lambda: len(client.live()) == 3)
    await net.wait(killed.close())
    frozen.frozen = True
    before = healthy.served
    for n in range(20):
        reply = await net.wait(client.request(str(n)), timeout=FAST["deadline"] + 1)
        assert reply == [b"healthy", str(n).encode()]
    assert healthy.served - before == 20
    assert client.live() == [healthy.endpoint]  # both others found dead by heartbeats


@pytest_twisted.ensureDeferred
async def test_a_server_that_comes_back_is_used_again(net: Net) -> None:
    first = await start_server(net, "first")
    second = await start_server(net, "second")
    client = client_for(net, [first.endpoint, second.endpoint])
    await net.until(lambda: len(client.live()) == 2)
    await net.wait(first.close())
    await net.until(lambda: client.live() == [second.endpoint])
    assert (await net.wait(client.request(b"x")))[0] == b"second"

    revived = await start_server(net, "revived", endpoint=first.endpoint)  # same endpoint
    await net.until(lambda: len(client.live()) == 2)  # its PONG came back
    await net.wait(second.close())
    await net.until(lambda: client.live() == [first.endpoint])
    assert await net.wait(client.request(b"y")) == [b"revived", b"y"]
    assert revived.served == 1


@pytest_twisted.ensureDeferred
async def test_reply_after_the_client_gave_up_is_ignored(net: Net) -> None:
    held: list[defer.Deferred] = []

    def slow_first(frames: list[bytes]) -> Any:
        if frames == [b"too slow"]:
            d: defer.Deferred = defer.Deferred()
            held.append(d)
            return d
        return frames

    server = await start_server(net, "slow", handler=slow_first)
    client = client_for(net, [server.endpoint], timeout=5.0, deadline=1.0)
    with pytest.raises(RequestTimeout):
        await net.wait(client.request(b"too slow"))
    assert client.machine.pending == {}
    held[0].callback([b"late"])  # the server answers after the client gave up
    assert await net.wait(client.request(b"next")) == [b"next"]  # not the late reply
    assert client.machine.pending == {}


@pytest_twisted.ensureDeferred
async def test_no_server_available_at_once_when_all_are_dead(net: Net) -> None:
    servers = [await start_server(net, name) for name in ("a", "b")]
    client = client_for(net, [s.endpoint for s in servers])
    await net.until(lambda: len(client.live()) == 2)
    pending = client.request(b"in flight")  # answered before the servers go away
    await net.wait(pending)
    for server in servers:
        await net.wait(server.close())
    await net.until(lambda: all(s.state is ServerState.DEAD for s in client.servers.values()))
    d = client.request(b"x")
    assert d.called  # at once, not after the timeout
    with pytest.raises(NoServerAvailable):
        await net.wait(d)


@pytest_twisted.ensureDeferred
async def test_servers_added_at_runtime(net: Net) -> None:
    client = client_for(net, [])
    with pytest.raises(NoServerAvailable):
        await net.wait(client.request(b"nobody"))
    server = await start_server(net, "late")
    client.connect(server.endpoint)
    assert await net.wait(client.request(b"hi")) == [b"late", b"hi"]


@pytest_twisted.ensureDeferred
async def test_handler_error_is_a_worker_error(net: Net) -> None:
    def broken(frames: list[bytes]) -> None:
        raise ValueError("bad input")

    server = await start_server(net, "broken", handler=broken)
    client = client_for(net, [server.endpoint])
    with pytest.raises(WorkerError, match="ValueError: bad input"):
        await net.wait(client.request(b"x"))


@pytest_twisted.ensureDeferred
async def test_model1_skips_a_dead_server_after_its_timeout(net: Net) -> None:
    dead = await start_server(net, "dead")
    alive = await start_server(net, "alive")
    dead.frozen = True
    client = client_for(net, [dead.endpoint, alive.endpoint], model=1, timeout=0.3)
    assert await net.wait(client.request(b"x")) == [b"alive", b"x"]


def test_an_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError):
        freelance_client([], model=4)


@pytest_twisted.ensureDeferred
async def test_a_server_that_let_an_attempt_time_out_gets_no_new_requests(clocknet: Net) -> None:
    stuck = await start_server(clocknet, "stuck")
    good = await start_server(clocknet, "good")
    client = client_for(clocknet, [stuck.endpoint, good.endpoint], heartbeat=HeartbeatPolicy(1.0, 3),
                        timeout=0.3, deadline=5.0)
    await clocknet.until(lambda: len(client.live()) == 2)
    stuck.frozen = True
    start = clocknet.reactor.seconds()
    assert await clocknet.wait(client.request(b"1")) == [b"good", b"1"]
    assert clocknet.reactor.seconds() - start >= 0.3  # the first one waited for its attempt
    start = clocknet.reactor.seconds()
    assert await clocknet.wait(client.request(b"2")) == [b"good", b"2"]
    assert clocknet.reactor.seconds() - start < 0.3  # the next went straight to "good"
    assert client.live() == [good.endpoint]


# --- timeout (per attempt) and deadline (the whole request) -----------------------

def test_timeouts_default_to_the_guides_values() -> None:
    from twisted.internet.task import Clock

    from mdp.freelance import AgentClient, SequentialClient, ShotgunClient

    clock = Clock()
    assert (SequentialClient([], clock).timeout, SequentialClient([], clock).deadline) == (1.0, 30.0)
    assert (ShotgunClient([], clock).timeout, ShotgunClient([], clock).deadline) == (3.0, None)
    agent = AgentClient([], clock)
    assert (agent.timeout, agent.deadline, agent.heartbeat) == (1.0, 3.0, HeartbeatPolicy(1.0, 3))
    agent.close()


def test_every_declared_interface_verifies() -> None:
    from zope.interface import implementedBy
    from zope.interface.verify import verifyObject

    from mdp import freelance
    from mdp.freelance import AgentClient, ShotgunClient
    from mdp.testing import Script

    script = Script()
    server = FreelanceServer(lambda frames: frames, script.clock)
    bound = server.listen(script.endpoint("server"))
    binding = script.routers[script.endpoint("server")].receiver
    shotgun = ShotgunClient([script.endpoint("s")], script.clock)
    agent = AgentClient([script.endpoint("a")], script.clock)
    instances = [binding, shotgun.pipes[script.endpoint("s")], agent, server]
    declared = {cls for cls in vars(freelance).values()
                if isinstance(cls, type) and cls.__module__ == freelance.__name__
                and list(implementedBy(cls))}
    assert declared <= {type(obj) for obj in instances}  # every @implementer class is checked
    for obj in instances:
        for interface in implementedBy(type(obj)):
            assert verifyObject(interface, obj)
    assert not list(implementedBy(FreelanceServer))  # its bindings are the receivers
    assert bound.called
    agent.close()
    shotgun.close()
    script.forget()


# --- caller mistakes raise at once ---------------------------------------------------

@pytest.mark.parametrize("model", [1, 2, 3])
def test_a_frame_that_is_not_bytes_or_str_raises_type_error_at_once(model: int) -> None:
    from mdp.testing import Script

    script = Script()
    client = freelance_client([script.endpoint("s")], model, script.clock)
    with pytest.raises(TypeError, match="request frame 1 is int"):
        client.request(b"ok", 5)
    with pytest.raises(TypeError, match="request frame 0 is NoneType"):
        client.request(None)
    with pytest.raises(ValueError):
        client.request()
    assert client.machine.pending == {}
    assert script.sent() == []  # nothing went out
    client.close()
    with pytest.raises(TypeError):  # a closed client too: the call itself is wrong
        client.request(["a list"])
    script.forget()


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "zmq:tcp://127.0.0.1", "nowhere",
                                      "tcp:host=127.0.0.1:port=0"])
def test_a_malformed_endpoint_raises_transport_error_at_once(model: int, endpoint: str) -> None:
    from twisted.internet.task import Clock

    from mdp.errors import TransportError
    from mdp.testing import Script

    script = Script()
    good = script.endpoint("good")
    with pytest.raises(TransportError):
        freelance_client([good, endpoint], model, script.clock)
    assert script.actions == []  # checked before the good one was opened
    client = freelance_client([good], model, Clock())
    with pytest.raises(TransportError):
        client.connect(endpoint)
    assert client.machine.endpoints == [good]
    client.close()
    script.forget()


def test_listen_on_a_malformed_endpoint_raises_transport_error_at_once() -> None:
    from twisted.internet.task import Clock

    from mdp.errors import TransportError

    server = FreelanceServer(lambda frames: frames, Clock())
    for endpoint in ("tcp://127.0.0.1:5555", "zmq:tcp://127.0.0.1", "tcp:host=127.0.0.1", ""):
        with pytest.raises(TransportError):
            server.listen(endpoint)
    assert server.transports == []


def test_a_heartbeat_that_is_not_a_policy_is_refused() -> None:
    from twisted.internet.task import Clock

    from mdp.freelance import AgentClient

    with pytest.raises(TypeError, match="HeartbeatPolicy"):
        AgentClient([], Clock(), heartbeat=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        freelance_client([], 1, Clock(), timeout=0)
    with pytest.raises(TypeError):
        freelance_client([], 2, Clock(), deadline="soon")


# --- embedding ---------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_stream_factory_serves_on_a_port_the_caller_listens_on() -> None:
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint
    from twisted.internet.interfaces import IProtocolFactory

    from mdp.freelance import SequentialClient

    server = FreelanceServer(lambda frames: [b"embedded", *frames], reactor)
    factory = server.streamFactory()
    assert IProtocolFactory.providedBy(factory)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    client = SequentialClient([f"tcp:host=127.0.0.1:port={port.getHost().port}"], reactor,
                              timeout=10.0)
    try:
        assert await client.request(b"hi", "there").addTimeout(20, reactor) == [
            b"embedded", b"hi", b"there"]
        assert server.served == 1
    finally:
        await client.close()
        await server.close()
        await port.stopListening()


def test_error_replies_are_mdps_error_bodies_and_raise_the_same_errors() -> None:
    from mdp import freelance
    from mdp.errors import MessageTooLarge, RemoteError, ServiceOverloaded, ServiceUnavailable
    from mdp.majordomo import codec
    from mdp.messages import error_body, remote_error

    for code in (b"500", b"503", b"429", b"413", b"418"):
        body = error_body(code, "why ✓")
        assert body == codec.error_body(code, "why ✓")
        ours, mdps = freelance.remote_error(body), remote_error(b"freelance", body)
        assert type(ours) is type(mdps) and (ours.code, ours.message) == (code, "why ✓")
    assert {type(freelance.remote_error(error_body(c, ""))) for c in
            (b"500", b"503", b"429", b"413", b"418")} == {
        WorkerError, ServiceUnavailable, ServiceOverloaded, MessageTooLarge, RemoteError}
    assert freelance.remote_error([b"an", b"ordinary", b"reply"]) is None


# --- requests that cannot be served, servers that are busy --------------------------------


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_a_request_over_the_limits_raises_at_once_and_costs_no_other(
        net: Net, model: int) -> None:
    """Sent, it would make the server's transport drop the connection, and
    with it the replies of every other request on it: it is refused at once
    (``RequestTooLarge``), as the MDP client refuses one."""
    from twisted.internet import task

    from mdp.errors import RequestTooLarge

    runs: list[bytes] = []

    def handler(frames: list[bytes]) -> Any:
        runs.append(frames[0])
        return task.deferLater(net.reactor, 0.1, lambda: [b"ok", frames[0]])

    servers = [await start_server(net, name, handler=handler) for name in "ab"]
    client = freelance_client([s.endpoint for s in servers], model, net.reactor,
                              **(FAST if model == 3 else {}))
    net.addCleanup(client.close)
    if model == 3:
        await net.until(lambda: len(client.live()) == 2)
    normal = client.request(b"normal")
    with pytest.raises(RequestTooLarge, match="10002 frames"):
        client.request(*[b"x"] * 10_001)
    assert await net.wait(normal, timeout=10) == [b"ok", b"normal"]
    assert runs.count(b"normal") == (2 if model == 2 else 1)


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_a_busy_server_429_sends_the_request_to_another(net: Net, model: int) -> None:
    """A 429 means nothing ran: model 1 goes on to the next server at once,
    model 2 waits for another server's answer, model 3 counts the server as
    SUSPECT and sends to the next live one; only when every server said 429
    is it the answer."""
    from mdp.errors import ServiceOverloaded

    busy = Server("busy", net.reactor)
    busy.maxPendingBytes = 0  # refuses every request: 429
    bound = await net.wait(busy.listen(net.bindEndpoint()))
    busy.endpoint = bound.endpoint
    net.addCleanup(busy.close)
    good = await start_server(net, "good")
    client = freelance_client([busy.endpoint, good.endpoint], model, net.reactor,
                              **(FAST if model == 3 else {}))
    net.addCleanup(client.close)
    if model == 3:
        await net.until(lambda: len(client.live()) == 2)
    for n in range(3):
        assert await net.wait(client.request(b"%d" % n)) == [b"good", b"%d" % n]
    good.frozen = True  # only the busy one answers now
    if model == 3:  # the good one is dead for its silence: the 429 is the answer
        await net.until(lambda: client.live() == [busy.endpoint])
        with pytest.raises(ServiceOverloaded):
            await net.wait(client.request(b"last"), timeout=30)
    else:  # the good one's attempt runs out
        with pytest.raises(RequestTimeout):
            await net.wait(client.request(b"last"), timeout=30)


@pytest_twisted.ensureDeferred
async def test_a_late_reply_is_not_sent_again_by_its_servers_return(clocknet: Any) -> None:
    """A server that let an attempt time out is SUSPECT and the request
    waits; its late reply answers the request before the server's coming
    back sends what waits: the handler runs once."""
    from twisted.internet import task


    runs: list[list[bytes]] = []

    def handler(frames: list[bytes]) -> Any:
        runs.append(frames)
        return task.deferLater(clocknet.reactor, 0.5, lambda: [b"done", *frames])

    server = await start_server(clocknet, "late", handler=handler)
    client = client_for(clocknet, [server.endpoint], heartbeat=HeartbeatPolicy(1.0, 3))
    await clocknet.until(lambda: client.live() == [server.endpoint])
    assert await clocknet.wait(client.request(b"pay")) == [b"done", b"pay"]
    clocknet.advance(1.0)
    assert runs == [[b"pay"]]


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_connect_after_close_is_refused(clocknet: Any, model: int) -> None:
    from mdp.errors import ClientClosed

    server = FreelanceServer(lambda f: f, clocknet.reactor)
    bound = await clocknet.wait(server.listen(clocknet.bindEndpoint()))
    clocknet.addCleanup(server.close)
    client = freelance_client([bound.endpoint, bound.endpoint], model, clocknet.reactor)
    client.connect(bound.endpoint)
    assert client.added == [bound.endpoint]
    await clocknet.wait(client.close())
    with pytest.raises(ClientClosed):
        client.connect(bound.endpoint)
    clocknet.advance(1.0)
    opened = client.router.pipes if model == 3 else client.pipes
    assert not opened


# --- the drivers: a caller's callback that re-enters the client -----------------------------


def _timers_of(reactor: Any, client: Any) -> list[Any]:
    """The DelayedCalls of *client*'s requests (attempts and deadlines)."""
    return [c for c in reactor.getDelayedCalls()
            if getattr(c.func, "__self__", None) is client and c.func.__name__ == "_fire"]


async def _agent_with_a_late_reply_to_come(clocknet: Any) -> tuple[Any, list[bytes], Any, Any]:
    """An agent whose one server answers "A" after A's attempt ran out:
    when A's late reply comes, the server is ALIVE again and "B", waiting
    meanwhile, goes out in the same event.  Returns the client, the requests
    the server ran, A's and B's Deferreds."""
    from twisted.internet import task


    seen: list[bytes] = []

    def handler(frames: list[bytes]) -> Any:
        seen.append(frames[0])
        if frames[0] == b"A":
            return task.deferLater(clocknet.reactor, 1.5, lambda: [b"ok", *frames])
        return [b"ok", *frames]

    server = await start_server(clocknet, "late", handler=handler)
    # a long heartbeat: no PONG brings the server back before A's late reply
    client = client_for(clocknet, [server.endpoint], heartbeat=HeartbeatPolicy(5.0, 3),
                        timeout=1.0, deadline=30.0)
    await clocknet.until(lambda: client.live() == [server.endpoint])
    a = client.request(b"A")
    clocknet.advance(1.1)  # A's attempt ran out: the server is SUSPECT, A waits
    b = client.request(b"B")  # no live server: B waits
    assert seen == [b"A"] and client.live() == []
    return client, seen, a, b


@pytest_twisted.ensureDeferred
async def test_a_request_cancelled_by_a_late_replys_callback_is_not_sent(clocknet: Any) -> None:
    """A's late reply brings its server back, which sends B; A's callback,
    run first, cancels B: B is neither sent nor timed."""
    client, seen, a, b = await _agent_with_a_late_reply_to_come(clocknet)
    failed: list[Any] = []
    b.addErrback(failed.append)
    a.addCallback(lambda _: b.cancel())
    clocknet.advance(1.0)  # A's late reply
    assert a.called and failed and failed[0].check(defer.CancelledError)
    assert not _timers_of(clocknet.reactor, client)
    clocknet.advance(5.0)
    assert seen == [b"A"] and not client.machine.pending


@pytest_twisted.ensureDeferred
async def test_a_client_closed_by_a_late_replys_callback_sends_and_arms_nothing(
        clocknet: Any) -> None:
    from mdp.errors import ClientClosed

    client, seen, a, b = await _agent_with_a_late_reply_to_come(clocknet)
    failed: list[Any] = []
    b.addErrback(failed.append)
    a.addCallback(lambda _: client.close())
    clocknet.advance(1.0)
    assert a.called and failed and failed[0].check(ClientClosed)
    assert not _timers_of(clocknet.reactor, client)
    clocknet.advance(5.0)
    assert seen == [b"A"]


@pytest_twisted.ensureDeferred
async def test_a_request_made_by_a_late_replys_callback_goes_out(clocknet: Any) -> None:
    """What a callback starts is its own: the late reply's other actions
    (B sent, B's timer) still go ahead, and so does the new request."""
    client, seen, a, b = await _agent_with_a_late_reply_to_come(clocknet)
    made: list[Any] = []
    a.addCallback(lambda _: made.append(client.request(b"C")))
    clocknet.advance(1.0)
    assert a.called and len(made) == 1
    assert await clocknet.wait(b) == [b"ok", b"B"]
    assert await clocknet.wait(made[0]) == [b"ok", b"C"]
    assert sorted(seen) == [b"A", b"B", b"C"]
    assert not _timers_of(clocknet.reactor, client)


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_a_client_closed_by_a_replys_callback_leaves_no_timer(clocknet: Any,
                                                                    model: int) -> None:
    """Every model: close() in a reply's callback fails the other requests
    and leaves no timer behind; nothing more is sent."""
    from twisted.internet import task

    from mdp.errors import ClientClosed

    seen: list[bytes] = []

    def handler(frames: list[bytes]) -> Any:
        seen.append(frames[0])
        delay = 0.1 if frames[0] == b"first" else 0.5
        return task.deferLater(clocknet.reactor, delay, lambda: [b"ok", *frames])

    server = await start_server(clocknet, "a", handler=handler)
    client = client_for(clocknet, [server.endpoint], model, timeout=1.0, deadline=10.0)
    if model == 3:
        await clocknet.until(lambda: client.live() == [server.endpoint])
    first, second = client.request(b"first"), client.request(b"second")
    failed: list[Any] = []
    second.addErrback(failed.append)
    first.addCallback(lambda _: client.close())
    await clocknet.until(lambda: first.called)
    assert failed and failed[0].check(ClientClosed)
    assert not _timers_of(clocknet.reactor, client)
    clocknet.advance(5.0)
    assert seen == [b"first", b"second"]


def test_what_a_failing_agent_tick_decided_is_still_done() -> None:
    """An agent's tick that raises part-way (logged) still performs the
    actions it had decided: here, telling that a server is dead."""
    from twisted.internet.task import Clock

    from mdp.freelance import AgentClient
    from mdp.freelance.machines import ServerChanged
    from tests.conftest import logged_at

    agent = AgentClient([], Clock())
    machine = agent.machine

    def failingTick(now: float) -> list:
        machine._emit(ServerChanged("tcp://127.0.0.1:1", ServerState.DEAD))
        raise RuntimeError("a bug in the tick")

    machine.handleTick = failingTick
    with logged_at(("warn",)) as events:
        agent.tick()
    agent.close()
    assert [event["log_format"] for event in events] == [
        "Freelance agent: its tick failed", "Freelance server {endpoint} is dead"]
