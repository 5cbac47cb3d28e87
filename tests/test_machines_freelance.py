"""The Freelance state machines driven by lists of events (mdp.testing), with
no transport and no real reactor: each test says what goes in and asserts
exactly what comes out, at what fake time."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from twisted.internet import defer
from twisted.python.failure import Failure

from mdp.errors import (
    ClientClosed,
    NoServerAvailable,
    RequestTimeout,
    ServiceOverloaded,
    WorkerError,
)
from mdp.freelance import (
    PING,
    PONG,
    AgentClient,
    FreelanceServer,
    RequestState,
    SequentialClient,
    ServerState,
    ShotgunClient,
)
from mdp.messages import ERROR_MARKER
from mdp.policy import HeartbeatPolicy, Limits
from mdp.testing import Close, Disconnect, Elapse, Lost, Open, Receive, Script, Send


@pytest.fixture
def script() -> Any:
    s = Script()
    yield s
    s.forget()


@pytest.fixture
def connected() -> Any:
    """A script whose pipes are up as soon as they are opened (the agent
    sends only on connected pipes)."""
    s = Script(autoConnect=True)
    yield s
    s.forget()


def did(script: Script, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list]:
    """Call *call* (an API call of the node, outside feed) and return its
    result and the actions it caused."""
    mark = len(script.actions)
    result = call(*args, **kwargs)
    script.clock.advance(0)
    return result, script.actions[mark:]


class Outcome:
    """What a request's Deferred fired with, if it has."""

    def __init__(self, d: defer.Deferred) -> None:
        self.box: list[Any] = []
        d.addBoth(self.box.append)

    @property
    def fired(self) -> bool:
        return bool(self.box)

    @property
    def result(self) -> Any:
        assert self.box, "the request is still pending"
        assert not isinstance(self.box[0], Failure), self.box[0]
        return self.box[0]

    def error(self, kind: type) -> Any:
        assert self.box, "the request is still pending"
        assert isinstance(self.box[0], Failure), f"succeeded with {self.box[0]!r}"
        assert self.box[0].check(kind), self.box[0]
        return self.box[0].value


def request(script: Script, client: Any, *frames: Any, **options: Any) -> tuple[Outcome, list]:
    d, actions = did(script, client.request, *frames, **options)
    return Outcome(d), actions


# --- server --------------------------------------------------------------------------

def serve(script: Script, handler: Any = None, **options: Any) -> FreelanceServer:
    server = FreelanceServer(handler or (lambda frames: [b"re", *frames]), script.clock, **options)
    server.listen(script.endpoint("server"))
    return server


def test_server_answers_a_request_with_its_sequence(script: Script) -> None:
    server = serve(script)
    assert script.feed(Receive(b"C", [b"7", b"hi", b"there"])) == [
        Send(b"C", [b"7", b"re", b"hi", b"there"])]
    assert script.feed(Receive(b"D", [b"7", b"x"]), Receive(b"C", [b"8", b""])) == [
        Send(b"D", [b"7", b"re", b"x"]), Send(b"C", [b"8", b"re", b""])]
    assert (server.served, server.pending, server.pendingBytes) == (3, 0, 0)


def test_server_answers_ping_with_pong(script: Script) -> None:
    serve(script)
    assert script.feed(Receive(b"C", [PING]), Receive(b"D", [PING])) == [
        Send(b"C", [PONG]), Send(b"D", [PONG])]


def test_server_answers_a_handler_error_with_a_500_error_reply(script: Script) -> None:
    def broken(frames: list[bytes]) -> None:
        raise ValueError("bad input")

    server = serve(script, broken)
    assert script.feed(Receive(b"C", [b"1", b"x"])) == [
        Send(b"C", [b"1", ERROR_MARKER, b"500", b"ValueError: bad input"])]
    assert (server.served, server.pending) == (1, 0)


def test_server_answers_a_deferred_handler_when_it_fires(script: Script) -> None:
    held: list[defer.Deferred] = []
    serve(script, lambda frames: held.append(defer.Deferred()) or held[-1])
    assert script.feed(Receive(b"C", [b"1", b"x"])) == []
    _, actions = did(script, held[0].callback, [b"later"])
    assert actions == [Send(b"C", [b"1", b"later"])]


def test_server_drops_garbage_and_the_peer_that_sent_it(script: Script) -> None:
    server = serve(script)
    assert script.feed(Receive(b"C", [b"not a ping"]), Receive(b"D", [])) == [
        Disconnect(b"C"), Disconnect(b"D")]
    assert server.served == 0


def test_server_refuses_beyond_max_pending_with_429(script: Script) -> None:
    held: list[defer.Deferred] = []
    server = serve(script, lambda frames: held.append(defer.Deferred()) or held[-1], maxPending=2)
    assert script.feed(Receive(b"C", [b"1", b"a"]), Receive(b"C", [b"2", b"b"]),
                       Receive(b"D", [b"1", b"c"])) == [
        Send(b"D", [b"1", ERROR_MARKER, b"429", b"server busy: 2 requests in hand"])]
    assert (server.pending, server.refused) == (2, 1)
    _, actions = did(script, held[0].callback, [b"A"])
    assert actions == [Send(b"C", [b"1", b"A"])]
    assert script.feed(Receive(b"D", [b"2", b"c"])) == []  # room again: accepted
    assert (server.pending, len(held)) == (2, 3)


def test_server_refuses_beyond_max_pending_bytes_with_429(script: Script) -> None:
    held: list[defer.Deferred] = []
    server = serve(script, lambda frames: held.append(defer.Deferred()) or held[-1],
                   maxPendingBytes=200)  # a 36-byte frame costs 100 (64 overhead)
    actions = script.feed(Receive(b"C", [b"1", b"x" * 36]), Receive(b"C", [b"2", b"x" * 36]),
                          Receive(b"C", [b"3", b"x"]))
    assert actions == [Send(b"C", [b"3", ERROR_MARKER, b"429", b"server busy: 2 requests in hand"])]
    assert (server.pendingBytes, server.refused) == (200, 1)


def test_server_replaces_a_reply_over_the_message_limits_with_413(script: Script) -> None:
    serve(script, lambda frames: [b"y" * 100], limits=Limits(maxMessageBytes=64))
    [reply] = script.feed(Receive(b"C", [b"1", b"x"]))
    assert reply.to == b"C" and reply.frames[:3] == (b"1", ERROR_MARKER, b"413")
    assert reply.frames[3].startswith(b"reply too large to send: message of 101 bytes")


def test_server_close_closes_its_endpoint(script: Script) -> None:
    server = serve(script)
    _, actions = did(script, server.close)
    assert actions == [Close(script.endpoint("server"))]


# --- every client -------------------------------------------------------------------

@pytest.mark.parametrize("kind", [SequentialClient, ShotgunClient, AgentClient])
def test_a_client_with_no_server_fails_at_once(connected: Script, kind: type) -> None:
    client = kind([], connected.clock)
    outcome, actions = request(connected, client, b"x")
    assert actions == [] and client.machine.pending == {}
    outcome.error(NoServerAvailable)
    client.connect(connected.endpoint("late"))  # added at runtime: used from now on
    if kind is AgentClient:
        connected.feed(Receive(connected.endpoint("late"), [PONG]))
    answered, actions = request(connected, client, b"y")
    assert Send(f"{connected.endpoint('late')}#1", [b"1", b"y"]) in actions
    connected.feed(Receive(connected.endpoint("late"), [b"1", b"Y"]))
    assert answered.result == [b"Y"]
    client.close()


# --- model 1: SequentialClient ---------------------------------------------------------

def test_sequential_tries_the_next_server_when_one_is_silent_past_timeout(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = SequentialClient([a, b], script.clock, timeout=1.0, deadline=30.0)
    assert script.actions == []  # model 1 opens nothing before a request
    outcome, actions = request(script, client, b"x")
    assert actions == [Open(f"{a}#1"), Send(f"{a}#1", [b"1", b"x"])]
    assert script.nextWake() == 1.0  # the attempt timer (the deadline is at 30)
    assert client.machine.pending[b"1"].state is RequestState.SENT
    assert script.feed(Elapse(0.999)) == []
    assert script.feed(Elapse(0.001)) == [
        Close(f"{a}#1"), Open(f"{b}#1"), Send(f"{b}#1", [b"1", b"x"])]
    assert script.nextWake() == 2.0
    assert script.feed(Receive(f"{b}#1", [b"1", b"from b"])) == [Close(f"{b}#1")]
    assert outcome.result == [b"from b"]
    assert client.machine.pending == {} and script.nextWake() is None


def test_sequential_fails_with_request_timeout_after_a_silent_round(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = SequentialClient([a, b], script.clock, timeout=1.0)
    outcome, _ = request(script, client, "x")
    assert script.feed(Elapse(2.0)) == [
        Close(f"{a}#1"), Open(f"{b}#1"), Send(f"{b}#1", [b"1", b"x"]), Close(f"{b}#1")]
    error = outcome.error(RequestTimeout)
    assert (error.attempts, error.elapsed) == (2, 2.0)
    assert script.nextWake() is None


def test_sequential_deadline_cuts_the_round_short(script: Script) -> None:
    a, b, c = (script.endpoint(n) for n in "abc")
    client = SequentialClient([a, b, c], script.clock, timeout=1.0, deadline=1.5)
    outcome, _ = request(script, client, b"x")
    assert script.feed(Elapse(1.5)) == [
        Close(f"{a}#1"), Open(f"{b}#1"), Send(f"{b}#1", [b"1", b"x"]), Close(f"{b}#1")]
    error = outcome.error(RequestTimeout)
    assert (error.attempts, error.elapsed) == (2, 1.5)
    assert script.nextWake() is None


def test_sequential_request_overrides_timeout_and_deadline(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = SequentialClient([a, b], script.clock)
    outcome, _ = request(script, client, b"x", timeout=0.25, deadline=0.4)
    assert script.nextWake() == 0.25
    assert script.feed(Elapse(0.25)) == [
        Close(f"{a}#1"), Open(f"{b}#1"), Send(f"{b}#1", [b"1", b"x"])]
    assert script.nextWake() == 0.4
    assert script.feed(Elapse(0.15)) == [Close(f"{b}#1")]
    assert outcome.error(RequestTimeout).elapsed == pytest.approx(0.4)


def test_sequential_starts_every_request_at_the_first_server(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = SequentialClient([a, b], script.clock, timeout=1.0)
    first, _ = request(script, client, b"1st")
    script.feed(Elapse(1.0), Receive(b, [b"1", b"ok"]))
    assert first.result == [b"ok"]
    _, actions = request(script, client, b"2nd")
    assert actions == [Open(f"{a}#2"), Send(f"{a}#2", [b"2", b"2nd"])]


def test_sequential_error_reply_and_cancel_and_close(script: Script) -> None:
    a = script.endpoint("a")
    client = SequentialClient([a], script.clock)
    failed, _ = request(script, client, b"x")
    assert script.feed(Receive(a, [b"1", ERROR_MARKER, b"500", b"boom"])) == [Close(f"{a}#1")]
    assert failed.error(WorkerError).message == "boom"
    d, _ = did(script, client.request, b"y")
    cancelled = Outcome(d)
    _, actions = did(script, d.cancel)
    assert actions == [Close(f"{a}#2")]
    cancelled.error(defer.CancelledError)
    closed, _ = request(script, client, b"z")
    _, actions = did(script, client.close)
    assert actions == [Close(f"{a}#3")]
    closed.error(ClientClosed)
    assert script.feed(Receive(f"{a}#3", [b"3", b"late"])) == []  # dropped
    assert script.nextWake() is None


# --- model 2: ShotgunClient ------------------------------------------------------------

def test_shotgun_sends_to_all_and_the_first_reply_wins(script: Script) -> None:
    a, b, c = (script.endpoint(n) for n in "abc")
    client = ShotgunClient([a, b, c], script.clock, timeout=3.0)
    assert script.actions == [Open(f"{a}#1"), Open(f"{b}#1"), Open(f"{c}#1")]
    outcome, actions = request(script, client, b"x")
    assert actions == [Send(f"{p}#1", [b"1", b"x"]) for p in (a, b, c)]
    assert script.nextWake() == 3.0
    assert script.feed(Receive(b, [b"1", b"from b"])) == []
    assert outcome.result == [b"from b"]
    assert script.nextWake() is None  # the round's timer is gone
    assert script.feed(Receive(a, [b"1", b"from a"]), Receive(c, [b"1", b"from c"])) == []
    assert outcome.result == [b"from b"] and client.machine.pending == {}


def test_shotgun_round_times_out(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = ShotgunClient([a, b], script.clock, timeout=3.0)
    outcome, _ = request(script, client, b"x")
    assert script.feed(Elapse(2.9)) == [] and not outcome.fired
    assert script.feed(Elapse(0.1)) == []
    error = outcome.error(RequestTimeout)
    assert (error.attempts, error.elapsed) == (2, pytest.approx(3.0))


def test_shotgun_correlates_concurrent_requests(script: Script) -> None:
    a, b = script.endpoint("a"), script.endpoint("b")
    client = ShotgunClient([a, b], script.clock)
    one, _ = request(script, client, b"one")
    two, _ = request(script, client, b"two")
    script.feed(Receive(b, [b"2", b"TWO"]), Receive(a, [b"1", b"ONE"]),
                Receive(a, [b"2", b"stale"]), Receive(a, [b"9", b"unknown"]), Receive(a, [b"1"]))
    assert (one.result, two.result) == ([b"ONE"], [b"TWO"])
    _, actions = did(script, client.close)
    assert actions == [Close(f"{a}#1"), Close(f"{b}#1")]


def test_shotgun_a_429_answers_only_once_every_server_said_it(script: Script) -> None:
    """A 429 means that server ran nothing: the request fails with it only
    once every server has refused.  One server's 429 sent twice does not
    speak for another, which still answers."""
    a, b = script.endpoint("a"), script.endpoint("b")
    client = ShotgunClient([a, b], script.clock, timeout=3.0)
    busy = [ERROR_MARKER, b"429", b"server busy"]
    outcome, _ = request(script, client, b"x")
    script.feed(Receive(a, [b"1", *busy]), Receive(a, [b"1", *busy]))
    assert not outcome.fired
    script.feed(Receive(b, [b"1", b"from b"]))
    assert outcome.result == [b"from b"]
    # every server refuses: the 429 is the answer
    again, _ = request(script, client, b"y")
    script.feed(Receive(a, [b"2", *busy]))
    assert not again.fired
    script.feed(Receive(b, [b"2", *busy]))
    assert again.error(ServiceOverloaded)


# --- model 3: AgentClient ----------------------------------------------------------------

def agent(script: Script, *names: str, **options: Any) -> tuple[AgentClient, list[str]]:
    endpoints = [script.endpoint(n) for n in names]
    options = {"heartbeat": HeartbeatPolicy(1.0, 3), "timeout": 1.0, "deadline": 10.0, **options}
    client = AgentClient(endpoints, script.clock, **options)
    script.feed()  # the pipes come up
    return client, endpoints


def pings(*endpoints: str) -> list[Send]:
    return [Send(f"{e}#1", [PING]) for e in endpoints]


def test_agent_pings_every_server_on_schedule(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b")
    assert connected.actions == [Open(f"{a}#1"), Open(f"{b}#1")]  # PINGs before "up" are dropped
    assert [s.state for s in client.servers.values()] == [ServerState.UNKNOWN] * 2
    for tick in (1.0, 2.0, 3.0):
        assert connected.nextWake() == tick
        assert connected.feed(Elapse(1.0)) == pings(a, b)
    client.close()
    assert connected.nextWake() is None


def test_agent_pings_on_its_heartbeat_interval(connected: Script) -> None:
    client, (a,) = agent(connected, "a", heartbeat=HeartbeatPolicy(0.25, 4))
    assert connected.nextWake() == 0.25
    assert connected.feed(Elapse(0.5)) == pings(a) * 2
    assert connected.nextWake() == 0.75
    client.close()


def test_agent_waits_for_a_live_server_then_sends(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b")
    outcome, actions = request(connected, client, b"x")
    assert actions == [] and client.machine.pending[b"1"].state is RequestState.WAITING
    assert connected.feed(Receive(b, [PONG])) == [Send(f"{b}#1", [b"1", b"x"])]
    assert client.servers[b].state is ServerState.ALIVE and client.live() == [b]
    assert client.machine.pending[b"1"].state is RequestState.SENT
    assert connected.feed(Receive(b, [b"1", b"done"])) == []
    assert outcome.result == [b"done"]
    client.close()


def test_agent_sends_to_the_first_live_server_and_the_reply_completes(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b")
    connected.feed(Receive(b, [PONG]), Receive(a, [PONG]))
    assert client.live() == [a, b]  # in the order they were added
    outcome, actions = request(connected, client, "x", "y")
    assert actions == [Send(f"{a}#1", [b"1", b"x", b"y"])]
    assert connected.feed(Receive(a, [b"1", b"ok"])) == []
    assert outcome.result == [b"ok"] and client.machine.pending == {}
    client.close()


def test_agent_marks_a_server_silent_past_expiry_dead_and_uses_the_other(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b")
    assert connected.feed(Elapse(1.0), Receive(a, [PONG]), Receive(b, [PONG])) == pings(a, b)
    for _ in range(3):  # t = 2, 3, 4: only b answers; a silent for 3.0 s is not yet dead
        assert connected.feed(Elapse(1.0), Receive(b, [PONG])) == pings(a, b)
    assert client.servers[a].state is ServerState.ALIVE
    outcome, actions = request(connected, client, b"x")  # t = 4: a is still first
    assert actions == [Send(f"{a}#1", [b"1", b"x"])]
    # t = 5: a silent for 4 s > 3 s: dead, and its request goes to b at once
    assert connected.feed(Elapse(1.0)) == [Send(f"{b}#1", [b"1", b"x"])] + pings(a, b)
    assert client.servers[a].state is ServerState.DEAD and client.live() == [b]
    assert connected.feed(Receive(b, [b"1", b"from b"])) == []
    assert outcome.result == [b"from b"]
    _, actions = did(connected, client.request, b"next")
    assert actions == [Send(f"{b}#1", [b"2", b"next"])]
    client.close()


def test_agent_suspects_a_server_that_lets_an_attempt_time_out(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b")
    connected.feed(Receive(a, [PONG]), Receive(b, [PONG]))
    outcome, actions = request(connected, client, b"x")
    assert actions == [Send(f"{a}#1", [b"1", b"x"])]
    assert connected.nextWake() == 1.0  # the first tick, then the attempt timer
    assert connected.feed(Elapse(1.0)) == pings(a, b) + [Send(f"{b}#1", [b"1", b"x"])]
    assert client.servers[a].state is ServerState.SUSPECT and client.live() == [b]
    _, actions = did(connected, client.request, b"y")  # no new requests for a
    assert actions == [Send(f"{b}#1", [b"2", b"y"])]
    connected.feed(Receive(a, [PONG]))  # it speaks again: alive
    assert client.servers[a].state is ServerState.ALIVE and client.live() == [a, b]
    connected.feed(Receive(b, [b"1", b"X"]), Receive(b, [b"2", b"Y"]))
    assert outcome.result == [b"X"]
    client.close()


def test_agent_fails_everything_at_once_when_every_server_is_dead(connected: Script) -> None:
    client, (a, b) = agent(connected, "a", "b", deadline=None)
    waiting, _ = request(connected, client, b"x")
    assert connected.feed(Elapse(3.0)) == pings(a, b) * 3  # t = 3: silent for 3 s, not dead
    assert not waiting.fired
    assert connected.feed(Elapse(1.0)) == pings(a, b)  # t = 4
    assert [s.state for s in client.servers.values()] == [ServerState.DEAD] * 2
    waiting.error(NoServerAvailable)
    refused, actions = request(connected, client, b"y")
    assert actions == [] and refused.fired
    refused.error(NoServerAvailable)
    assert connected.feed(Receive(a, [PONG])) == []  # back again
    _, actions = did(connected, client.request, b"z")
    assert actions == [Send(f"{a}#1", [b"2", b"z"])]  # a refused request takes no number
    client.close()


def test_agent_deadline_bounds_a_request_in_all(connected: Script) -> None:
    client, (a,) = agent(connected, "a", deadline=2.5, heartbeat=HeartbeatPolicy(1.0, 10))
    connected.feed(Receive(a, [PONG]))
    outcome, _ = request(connected, client, b"x")
    # t = 0 sent to a; t = 1 that attempt times out: a SUSPECT, none alive: WAITING;
    # a's PONG: sent again; t = 2 times out again: WAITING; t = 2.5 the deadline
    assert connected.feed(Elapse(1.0)) == pings(a)
    assert client.machine.pending[b"1"].state is RequestState.WAITING
    assert connected.feed(Receive(a, [PONG])) == [Send(f"{a}#1", [b"1", b"x"])]
    assert connected.feed(Elapse(1.5)) == pings(a)
    error = outcome.error(RequestTimeout)
    assert (error.attempts, error.elapsed) == (2, 2.5)
    assert client.machine.waiting == [] and client.machine.pending == {}
    client.close()


def test_agent_ignores_unknown_servers_and_stale_replies(connected: Script) -> None:
    client, (a,) = agent(connected, "a")
    connected.feed(Receive(a, [PONG]))
    outcome, _ = request(connected, client, b"x")
    connected.feed(Receive(a, [b"1", b"first"]), Receive(a, [b"1", b"again"]),
                   Receive(a, [b"42", b"unknown"]))
    assert outcome.result == [b"first"]
    client.close()


def test_agent_close_fails_pending_requests_and_stops_pinging(connected: Script) -> None:
    client, (a,) = agent(connected, "a")
    outcome, _ = request(connected, client, b"x")
    _, actions = did(connected, client.close)
    assert actions == [Close(f"{a}#1")]
    outcome.error(ClientClosed)
    assert connected.nextWake() is None
    assert connected.feed(Lost(f"{a}#1"), Elapse(5.0)) == []


# --- the client machines alone: no reactor, no Clock, no transport ----------------------

def test_sequential_machine_is_a_function_of_events_and_their_times() -> None:
    from mdp.freelance.machines import (
        ATTEMPT,
        DEADLINE,
        Cancel,
        ClosePipe,
        Later,
        OpenPipe,
        Reject,
        Resolve,
        SendPipe,
        SequentialMachine,
    )

    machine = SequentialMachine(timeout=1.0, deadline=30.0)
    machine.handleConnect("a", now=0.0)
    machine.handleConnect("b", now=0.0)
    call = machine.newCall([b"hi"], 1.0, 30.0)
    assert machine.handleRequest(call, now=0.0) == [
        Later(call, DEADLINE, 30.0), OpenPipe(b"1", "a"), SendPipe(b"1", [b"1", b"hi"]),
        Later(call, ATTEMPT, 1.0)]
    # "a" is silent for the attempt: a fresh pipe to "b"
    assert machine.handleTimer(call, ATTEMPT, now=1.0) == [
        ClosePipe(b"1"), OpenPipe(b"1", "b"), SendPipe(b"1", [b"1", b"hi"]),
        Later(call, ATTEMPT, 1.0)]
    assert machine.handleReply([b"1", b"HI"], now=1.5) == [
        Cancel(call, DEADLINE), Cancel(call, ATTEMPT), ClosePipe(b"1"), Resolve(call, [b"HI"])]
    assert machine.handleReply([b"1", b"again"], now=1.6) == []  # late: dropped
    # every server silent: RequestTimeout after the round
    other = machine.newCall([b"x"], 1.0, 30.0)
    machine.handleRequest(other, now=2.0)
    machine.handleTimer(other, ATTEMPT, now=3.0)
    *_, failed = machine.handleTimer(other, ATTEMPT, now=4.0)
    assert isinstance(failed, Reject) and isinstance(failed.error, RequestTimeout)


def test_agent_machine_is_a_function_of_events_and_their_times() -> None:
    from mdp.freelance.machines import ATTEMPT, AgentMachine, ConnectPeer, Later, SendPeer

    machine = AgentMachine(HeartbeatPolicy(1.0, 3), timeout=1.0, deadline=None)
    assert machine.wakeEvery == 1.0
    assert machine.handleConnect("a", now=0.0) == [ConnectPeer("a"), SendPeer("a", [PING])]
    call = machine.newCall([b"hi"], 1.0, None)
    actions = machine.handleRequest(call, now=0.1)
    assert call.state is RequestState.WAITING and machine.waiting == [call]
    # the PONG makes "a" ALIVE, and the waiting request goes to it
    actions = machine.handleMessage("a", [PONG], now=0.2)
    assert SendPeer("a", [b"1", b"hi"]) in actions and Later(call, ATTEMPT, 1.0) in actions
    assert machine.live() == ["a"]
    # silent past 3 s: DEAD at the tick, and what is pending fails
    machine.handleTick(now=1.0)
    actions = machine.handleTick(now=4.0)
    assert machine.servers["a"].state is ServerState.DEAD
    assert [type(a).__name__ for a in actions][-1] == "Reject"
    assert isinstance(actions[-1].error, NoServerAvailable)
    assert isinstance(machine.refusal(), NoServerAvailable)


# --- a caller's callback that cancels another request ----------------------------------------


def test_a_callback_cancelling_another_request_leaves_the_agent_ticking() -> None:
    """Every server dead fails what is pending, one Deferred after another:
    an errback of the first that cancels the second (abandoning related
    work) fires that one; the agent does not fire it again, and its
    heartbeat goes on (a server back is seen)."""
    from mdp.freelance import PONG, AgentClient, ServerState

    s = Script(autoConnect=True)
    a = s.endpoint("a")
    client = AgentClient([a], s.clock, heartbeat=HeartbeatPolicy(1.0, 3), timeout=1.0,
                         deadline=None)
    s.feed()
    try:
        d1, d2 = client.request(b"one"), client.request(b"two")
        seen: list[Any] = []
        d2.addBoth(seen.append)
        d1.addErrback(lambda f: d2.cancel())
        s.feed(Elapse(4.0))  # silent for more than 3 s: dead, both fail
        assert client.servers[a].state is ServerState.DEAD
        assert len(seen) == 1 and isinstance(seen[0], Failure)
        assert client._ticker.running
        s.feed(Elapse(2.0))
        s.feed(Receive(a, [PONG]))
        assert client.servers[a].state is ServerState.ALIVE
    finally:
        client.close()
        s.forget()


def test_a_callback_cancelling_another_request_lets_close_finish() -> None:
    from mdp.freelance import AgentClient

    s = Script(autoConnect=True)
    a = s.endpoint("a")
    client = AgentClient([a], s.clock, heartbeat=HeartbeatPolicy(1.0, 3), timeout=1.0,
                         deadline=None)
    s.feed()
    d1, d2 = client.request(b"one"), client.request(b"two")
    d2.addErrback(lambda f: None)
    d1.addErrback(lambda f: d2.cancel())
    try:
        client.close()
        assert not client._ticker.running
    finally:
        s.forget()


def _late_reply_to_come(script: Script) -> tuple[AgentClient, str, Outcome, defer.Deferred]:
    """An agent whose one server let A's attempt run out (SUSPECT, A
    waiting) and B waiting too; A's late reply will bring the server back
    and send B in the same event."""
    client, (a,) = agent(script, "a", heartbeat=HeartbeatPolicy(5.0, 3), deadline=None)
    script.feed(Receive(a, [PONG]))
    first, actions = did(script, client.request, b"A")
    assert actions == [Send(f"{a}#1", [b"1", b"A"])]
    assert script.feed(Elapse(1.0)) == []
    assert client.servers[a].state is ServerState.SUSPECT
    second, actions = did(script, client.request, b"B")
    assert actions == [] and client.machine.pending[b"2"].state is RequestState.WAITING
    return client, a, first, second


def test_a_request_cancelled_by_a_late_replys_callback_is_neither_sent_nor_timed(
        connected: Script) -> None:
    client, a, first, second = _late_reply_to_come(connected)
    cancelled = Outcome(second)
    first.addCallback(lambda _: second.cancel())
    assert connected.feed(Receive(a, [b"1", b"late"])) == []
    assert client.servers[a].state is ServerState.ALIVE
    cancelled.error(defer.CancelledError)
    assert client.machine.pending == {} and client._timers == {}
    assert connected.nextWake() == 5.0  # the heartbeat's, no attempt's
    client.close()


def test_a_client_closed_by_a_late_replys_callback_sends_and_arms_nothing(
        connected: Script) -> None:
    client, a, first, second = _late_reply_to_come(connected)
    closed = Outcome(second)
    first.addCallback(lambda _: client.close())
    assert connected.feed(Receive(a, [b"1", b"late"])) == [Close(f"{a}#1")]
    closed.error(ClientClosed)
    assert client._timers == {} and connected.nextWake() is None


def test_each_send_names_its_request_and_compares_equal_without_it() -> None:
    """What the driver skips once a request is DONE: the sends (and a model
    1 pipe) say which request they are for; a PING is for none."""
    from mdp.freelance.machines import AgentMachine, OpenPipe, SendPeer, SendPipe, SequentialMachine

    agent = AgentMachine(HeartbeatPolicy(1.0, 3), timeout=1.0, deadline=None)
    (_, ping) = agent.handleConnect("a", now=0.0)
    assert ping == SendPeer("a", [PING]) and ping.call is None
    agent.handleMessage("a", [PONG], now=0.1)
    call = agent.newCall([b"hi"], 1.0, None)
    sends = [x for x in agent.handleRequest(call, now=0.2) if type(x) is SendPeer]
    assert sends == [SendPeer("a", [b"1", b"hi"])] and sends[0].call is call
    sequential = SequentialMachine(timeout=1.0, deadline=None)
    sequential.handleConnect("a", now=0.0)
    call = sequential.newCall([b"hi"], 1.0, None)
    opened = [x for x in sequential.handleRequest(call, now=0.0) if type(x) in (OpenPipe, SendPipe)]
    assert [x.call for x in opened] == [call, call]
