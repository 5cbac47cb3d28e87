"""Brokers side by side: workers attached to all of them (their sessions spread, never more
requests in hand than their concurrency), and a client that spreads its requests over them
and, when one goes, sends them to the others."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import pytest_twisted

from mdp.majordomo.spread import least_outstanding
from mdp.majordomo.worker import spread_over


def test_the_broker_with_the_fewest_requests_out_is_chosen_and_ties_go_round() -> None:
    brokers = ["a", "b", "c"]
    assert least_outstanding(brokers, Counter(a=2, b=1, c=3), {}, 0.0, 5.0, 0) == "b"
    assert [least_outstanding(brokers, Counter(), {}, 0.0, 5.0, turn) for turn in range(4)] == [
        "a", "b", "c", "a"]


def test_a_broker_that_failed_lately_is_passed_over_unless_every_one_did() -> None:
    brokers = ["a", "b"]
    assert least_outstanding(brokers, Counter(b=5), {"a": 9.0}, 10.0, 5.0, 0) == "b"
    assert least_outstanding(brokers, Counter(b=5), {"a": 4.0}, 10.0, 5.0, 0) == "a"  # long ago
    assert least_outstanding(brokers, Counter(b=5), {"a": 9.0, "b": 9.5}, 10.0, 5.0, 0) == "a"


def test_a_workers_sessions_attached_to_all_start_each_at_its_own_broker() -> None:
    from mdp import Worker

    assert [spread_over(["a", "b"], n)[0] for n in range(4)] == ["a", "b", "a", "b"]
    worker = Worker(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], "echo", lambda f: f,
                    concurrency=4, attach="all")
    assert [s.machine.endpoint[-1] for s in worker.sessions] == ["1", "2", "1", "2"]
    assert all(len(s.machine.endpoints) == 2 for s in worker.sessions)  # each fails over
    assert all(s.machine.homeward is not None for s in worker.sessions)  # and goes back
    failover = Worker(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], "echo", lambda f: f, concurrency=2)
    assert all(s.machine.homeward is None for s in failover.sessions)  # a failover list stays
    with pytest.raises(ValueError, match="concurrency of at least 2"):
        Worker(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], "echo", lambda f: f, attach="all")
    with pytest.raises(ValueError, match="attach must be one of"):
        Worker("tcp:127.0.0.1:1", "echo", lambda f: f, attach="both")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_requests_spread_over_two_brokers_and_move_when_one_goes(kind: str) -> None:
    """Two brokers, two workers of concurrency 2 attached to both, a client of both: each
    broker gets a share; one broker closed under load, every request is answered and no
    worker ever holds more than 2; that broker started again, its sessions come back."""
    from twisted.internet import defer, task

    from mdp import Backoff, Broker, Client, SpreadClient, Worker
    from mdp.policy import HeartbeatPolicy
    from tests.conftest import RealNet

    net = RealNet(kind)
    heartbeat = HeartbeatPolicy(0.1, 3)
    try:
        brokers, endpoints = [], []
        for _ in range(2):
            broker = Broker(net.reactor, heartbeat=heartbeat)
            net.addCleanup(broker.close)
            brokers.append(broker)
            endpoints.append((await broker.listen(net.bindEndpoint())).endpoint)
        most: Counter[str] = Counter()
        held: Counter[str] = Counter()

        def handler_of(name: str) -> Any:
            async def handle(frames: list[bytes]) -> list[bytes]:
                held[name] += 1
                most[name] = max(most[name], held[name])
                try:
                    await task.deferLater(net.reactor, 0.002, lambda: None)
                    return frames
                finally:
                    held[name] -= 1
            return handle

        for name in ("w1", "w2"):
            worker = Worker(endpoints, "echo", handler_of(name), net.reactor, heartbeat=heartbeat,
                            concurrency=2, attach="all", homeward=Backoff(0.5, 1.0))
            worker.start()
            net.addCleanup(worker.stop)
        await net.until(lambda: all(b.machine.services.get(b"echo") is not None and
                                    b.machine.services[b"echo"].workers == 2 for b in brokers),
                        timeout=10)
        client = SpreadClient(endpoints, net.reactor, timeout=2.0, retries=3)
        net.addCleanup(client.close)

        async def load(start: int) -> None:
            replies = await defer.gatherResults(
                [client.request("echo", b"%d" % n) for n in range(start, start + 200)])
            assert replies == [[b"%d" % n] for n in range(start, start + 200)]

        await load(0)
        assert min(client.sent.values()) >= 40, client.sent  # both took a share
        going = defer.ensureDeferred(load(200))  # under way as the broker goes
        await brokers[1].close()
        await going
        # the sessions of the broker gone moved to the other one
        await net.until(lambda: brokers[0].machine.services[b"echo"].workers == 4, timeout=10)
        await load(400)  # all through the broker left
        again = Broker(net.reactor, heartbeat=heartbeat)
        net.addCleanup(again.close)
        await again.listen(endpoints[1])  # (where the other was)
        await net.until(lambda: again.machine.services.get(b"echo") is not None
                        and again.machine.services[b"echo"].workers == 2, timeout=10)
        await net.until(lambda: brokers[0].machine.services[b"echo"].workers == 2,
                        timeout=10)  # each session at its own again
        direct = Client(endpoints[1], net.reactor, timeout=2.0)
        net.addCleanup(direct.close)
        assert await defer.gatherResults([direct.request("echo", b"%d" % n) for n in range(50)]) == [
            [b"%d" % n] for n in range(50)]  # served there again
        assert max(most.values()) <= 2, most
    finally:
        await net.cleanup()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_broker_killed_under_load_loses_no_request_and_no_worker_holds_more(
        tmp_path: Any) -> None:
    """The target: 2 brokers side by side, 4 workers of concurrency 4 attached to both, 4
    clients; SIGKILL one broker under load: every request completes, the longest wait for a
    reply is under the heartbeat expiry, and no worker ever holds more than 4."""
    import os
    import signal

    from twisted.internet import defer

    from mdp import SpreadClient
    from tests.procs import ENV, Process, reactor, script, twist_broker, wait_until

    heartbeat = ("--heartbeat", "0.5", "--liveness", "4")  # expiry: 2 s
    runs = tmp_path / "runs"
    runs.mkdir()
    procs: list[Process] = []
    clients: list[Any] = []
    try:
        endpoints = []
        for _ in range(2):
            broker, endpoint = await twist_broker(reactor(), "tcp:0:interface=127.0.0.1", *heartbeat)
            procs.append(broker)
            endpoints.append(endpoint)
        brokers = [option for e in endpoints for option in ("--broker", e)]
        for _ in range(4):
            procs.append(Process(reactor(), [
                script("twist"), "--log-format", "text", "mdp-worker", *brokers, "--attach", "all",
                "--concurrency", "4", "--service", "work", "--handler",
                "tests.handlers_for_tests:held_tagged", *heartbeat, "--backoff-max", "1"],
                {**ENV, "MDP_TEST_RUNS": str(runs)}))
        # each broker: 2 sessions of each worker
        await wait_until(lambda: all(p.output.count(b"ready for work") >= 8 for p in procs[:2]), 30)
        clients = [SpreadClient(endpoints, reactor(), timeout=0.5, retries=6) for _ in range(4)]
        answered: list[float] = []
        wrong: list[Any] = []

        async def steady(client: Any, first: int) -> None:
            for n in range(first, first + 600, 8):  # 8 out at a time per client
                replies = await defer.gatherResults(
                    [client.request("work", b"%d" % m) for m in range(n, n + 8)])
                answered.append(reactor().seconds())
                wrong.extend(r for m, r in zip(range(n, n + 8), replies) if r[1:] != [b"%d" % m])

        load = defer.gatherResults([defer.ensureDeferred(steady(c, 1000 * i))
                                    for i, c in enumerate(clients)])
        await wait_until(lambda: len(answered) >= 100, 30)
        procs[1].signalProcess(signal.SIGKILL)
        await load
        gaps = [b - a for a, b in zip(answered, answered[1:])]
        assert len(answered) == 4 * 75 and not wrong
        assert max(gaps) < 2.0, max(gaps)
        most = [int((runs / name).read_text()) for name in os.listdir(runs)]
        assert len(most) == 4 and max(most) <= 4, most
        assert all(c.sent[endpoints[0]] > 0 and c.sent[endpoints[1]] > 0 for c in clients)
    finally:
        for client in clients:
            await client.close()
        for proc in procs:
            await proc.stop()


def test_the_sessions_of_a_broker_that_goes_spread_over_the_others() -> None:
    lists = [spread_over(["a", "b", "c"], n) for n in range(6)]
    assert [s[0] for s in lists] == ["a", "b", "c", "a", "b", "c"]
    assert [s[1] for s in lists if s[0] == "a"] == ["b", "c"]  # a's two sessions: b, then c


def test_a_broker_that_failed_gets_one_request_at_a_time_until_one_succeeds() -> None:
    brokers = ["a", "b"]
    # its avoid time is over, and it has one request out: the others go elsewhere
    assert least_outstanding(brokers, Counter(a=1, b=9), {"a": 0.0}, 10.0, 5.0, 0, ["a"]) == "b"
    assert least_outstanding(brokers, Counter(a=0, b=9), {"a": 0.0}, 10.0, 5.0, 0, ["a"]) == "a"


@pytest_twisted.ensureDeferred
async def test_a_spread_client_probes_a_failed_broker_and_checks_what_it_is_given() -> None:
    from twisted.internet import defer, task

    from mdp import ServiceUnavailable, SpreadClient

    clock = task.Clock()
    client = SpreadClient(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], clock, avoid=5.0)
    answers: dict[str, list[Any]] = {e: [] for e in client.endpoints}

    class Fake:
        def __init__(self, endpoint: str) -> None:
            self.endpoint = endpoint

        def request(self, service: Any, *frames: Any, **_: Any) -> Any:
            d: defer.Deferred[list[bytes]] = defer.Deferred()
            answers[self.endpoint].append(d)
            return d

        def close(self) -> Any:
            return defer.succeed(None)

    client.clients = {e: Fake(e) for e in client.endpoints}
    a, b = client.endpoints
    with pytest.raises(ValueError):
        client.request("echo")  # no frames: a caller's mistake, at once
    first = client.request("echo", b"1")
    answers[a][0].errback(ServiceUnavailable(b"echo", b"503", "no worker"))  # tried on b next
    assert len(answers[b]) == 1
    answers[b][0].callback([b"1"])
    assert (await first) == [b"1"]
    clock.advance(6)  # past the avoid time: a is probed with one request, the rest go to b
    for n in range(4):
        client.request("echo", b"%d" % n)
    assert (len(answers[a]), len(answers[b])) == (2, 4)
    await client.close()


def test_a_session_moved_to_another_broker_goes_back_to_its_own_once_idle() -> None:
    """Its own broker gone, the session moves on; *homeward* later, idle, it says DISCONNECT
    and tries its own again; not there yet, it moves on again and waits twice as long; a
    session with a request in hand goes back once its FINAL is out."""
    from twisted.internet import defer

    from mdp import Backoff, Worker
    from mdp.majordomo import codec
    from mdp.testing import Close, Elapse, Open, Receive, Script, Send
    from tests.test_machines_majordomo import DISCONNECT, HB, HEARTBEAT, READY, W

    script = Script(autoConnect=True)
    own, other = script.endpoint("b1"), script.endpoint("b2")
    held: list[defer.Deferred[list[bytes]]] = []

    def handler(frames: list[bytes]) -> defer.Deferred[list[bytes]]:
        held.append(defer.Deferred())
        return held[-1]

    worker = Worker([own, other], "echo", handler, reactor=script.clock, heartbeat=HB,
                    extensions=False, backoff=Backoff(initial=1.0, maximum=32.0))
    worker.machine.homeward = Backoff(initial=10.0, maximum=40.0)  # (as attach="all" sets)
    worker.start()
    script.feed()

    def served_by(pipe: str, seconds: float) -> list[Any]:
        """*seconds* pass with the broker at *pipe* answering each heartbeat."""
        actions: list[Any] = []
        for _ in range(int(seconds * 2)):
            actions += script.feed(Elapse(0.5))
            if Close(pipe) in actions:
                break
            actions += script.feed(Receive(pipe, HEARTBEAT))
        return [a for a in actions if a != Send(pipe, HEARTBEAT)]

    going = [Send(other + "#1", DISCONNECT), Close(other + "#1"), Open(own + "#2"), Send(own + "#2", READY)]
    tail = script.feed(Elapse(3.5))  # its own silent: moved on, at 3.5 s
    assert tail[-3:] == [Close(own + "#1"), Open(other + "#1"), Send(other + "#1", READY)]
    assert served_by(other + "#1", 9.5) == []  # 13 s
    assert served_by(other + "#1", 0.5) == going  # 13.5 s: back to its own
    assert script.feed(Elapse(3.5))[-3:] == [  # its own still silent: on again
        Close(own + "#2"), Open(other + "#2"), Send(other + "#2", READY)]
    assert served_by(other + "#2", 19.5) == []  # twice as long this time
    script.feed(Receive(other + "#2", [W, codec.W_REQUEST, b"c", b"", b"x"]))  # in hand
    assert served_by(other + "#2", 1.0) == []  # due, but busy
    held[-1].callback([b"X"])
    assert script.actions[-3:] == [Send(other + "#2", [W, codec.W_FINAL, b"c", b"", b"X"]),
                                   Send(other + "#2", DISCONNECT), Close(other + "#2")]
    assert script.feed() == [Open(own + "#3"), Send(own + "#3", READY)]
    script.feed(Receive(own + "#3", HEARTBEAT))  # its own answers: the schedule starts over
    assert worker.machine.homeTries == 0 and worker.endpoint == own


@pytest_twisted.ensureDeferred
async def test_a_request_no_broker_answered_fails_naming_every_broker_tried() -> None:
    from twisted.internet import defer, task

    from mdp import BrokerUnreachable, RequestTimeout, SpreadClient

    clock = task.Clock()
    client = SpreadClient(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], clock, retries=3)
    a, b = client.endpoints
    failures = iter([RequestTimeout(b"echo", 1, 2.5, [a]),
                     BrokerUnreachable({b: "connection refused"}),
                     RequestTimeout(b"echo", 1, 2.5, [a])])

    class Failing:
        def request(self, service: Any, *frames: Any, **_: Any) -> Any:
            clock.advance(2.5)
            return defer.fail(next(failures))

        def close(self) -> Any:
            return defer.succeed(None)

    client.clients = {e: Failing() for e in client.endpoints}
    with pytest.raises(RequestTimeout) as raised:
        await client.request("echo", b"x")
    assert raised.value.attempts == 3 and raised.value.elapsed == 7.5
    assert raised.value.endpoints == (a, b)
    assert str(raised.value) == (f"no reply from brokers at {a}, {b} (connection refused) after "
                                 "3 attempts (7.5 s) to a request for service 'echo'")


def test_a_session_its_own_broker_turns_away_waits_twice_as_long_before_trying_again() -> None:
    from mdp import Backoff, Worker
    from mdp.testing import Close, Elapse, Open, Receive, Script, Send
    from tests.test_machines_majordomo import DISCONNECT, HB, HEARTBEAT, READY

    script = Script(autoConnect=True)
    own, other = script.endpoint("b1"), script.endpoint("b2")
    worker = Worker([own, other], "echo", lambda f: f, reactor=script.clock, heartbeat=HB,
                    extensions=False, backoff=Backoff(initial=1.0, maximum=32.0))
    worker.machine.homeward = Backoff(initial=10.0, maximum=40.0)
    worker.start()
    script.feed(Elapse(3.5))  # its own silent: moved on
    for _ in range(20):  # 10 s, the other answering
        script.feed(Elapse(0.5))
        if Close(other + "#1") in script.actions:
            break
        script.feed(Receive(other + "#1", HEARTBEAT))
    assert script.actions[-2:] == [Open(own + "#2"), Send(own + "#2", READY)]
    # its own turns it away (at its worker limit, say): on at once, and a longer wait
    assert script.feed(Receive(own + "#2", DISCONNECT)) == [
        Close(own + "#2"), Open(other + "#2"), Send(other + "#2", READY)]
    assert worker.machine.homeTries == 1 and worker.machine.homeAt == script.clock.seconds() + 20.0


@pytest_twisted.ensureDeferred
async def test_a_spread_stream_gives_its_parts_and_is_not_tried_again_part_way() -> None:
    from twisted.internet import defer, task

    from mdp import RequestTimeout, SpreadClient

    clock = task.Clock()
    client = SpreadClient(["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"], clock, retries=3)
    asked: list[str] = []

    class Streaming:
        def __init__(self, endpoint: str, fails: bool) -> None:
            self.endpoint, self.fails = endpoint, fails

        def request(self, service: Any, *frames: Any, onPartial: Any = None, **_: Any) -> Any:
            asked.append(self.endpoint)
            onPartial([b"part"])
            if self.fails:
                return defer.fail(RequestTimeout(b"echo", 1, 2.5, [self.endpoint]))
            return defer.succeed([b"last"])

        def close(self) -> Any:
            return defer.succeed(None)

    a, b = client.endpoints
    client.clients = {a: Streaming(a, fails=False), b: Streaming(b, fails=True)}
    parts: list[list[bytes]] = []
    assert await client.request("echo", b"x", onPartial=parts.append) == [b"last"]
    assert parts == [[b"part"]] and asked == [a]
    with pytest.raises(RequestTimeout):  # b, part-way: its parts would come twice from a
        await client.request("echo", b"y", onPartial=parts.append)
    assert asked == [a, b] and parts == [[b"part"]] * 2
