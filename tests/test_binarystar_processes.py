"""Binary Star with real processes, over ZeroMQ and TCP, with default
heartbeats: ``twist mdp-broker --bstar primary|backup``, ``twist mdp-worker``
processes given both brokers, and clients in this process running a steady
stream of requests.  SIGKILL the primary: the backup takes over on the first
client vote and every request completes; restart the primary (it comes up
passive), SIGKILL the backup: the primary takes over.  The state channel
runs through TCP proxies the test controls, so it can be cut alone: with
clients reaching one side only, the other side never becomes active."""

from __future__ import annotations

import json
import re
import signal
from typing import Any, Optional

import pytest
import pytest_twisted
from twisted.internet import defer, task

from tests.procs import ENV, Process, Proxy, bounded, reactor, script, twist_worker, wait_until

pytestmark = pytest.mark.timeout(60)

BIND = {"zmq": "zmq:tcp://127.0.0.1:*", "tcp": "tcp:host=127.0.0.1:port=0"}


def state_endpoint(kind: str, port: int) -> str:
    return f"zmq:tcp://127.0.0.1:{port}" if kind == "zmq" else f"tcp:host=127.0.0.1:port={port}"


def port_of(endpoint: str) -> int:
    match = re.search(r"(?:port=|:)(\d+)$", endpoint)
    assert match, endpoint
    return int(match.group(1))


# --- a pair of broker processes --------------------------------------------------------


class Pair:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proxies = {"primary": Proxy(), "backup": Proxy()}
        self.brokers: dict[str, Process] = {}
        self.endpoints: dict[str, str] = {}
        self.workers: list[Process] = []
        self.clients: list[Any] = []
        self.old: list[Process] = []

    def other(self, role: str) -> str:
        return "backup" if role == "primary" else "primary"

    async def start(self, role: str) -> Process:
        """Start (or restart, on the same client endpoint) the broker of *role*."""
        endpoint = self.endpoints.get(role, BIND[self.kind])
        remote = state_endpoint(self.kind, self.proxies[self.other(role)].address)
        broker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                                     "--endpoint", endpoint, "--bstar", role,
                                     "--bstar-local", BIND[self.kind],
                                     "--bstar-remote", remote], ENV)
        if role in self.brokers:
            self.old.append(self.brokers[role])
        self.brokers[role] = broker
        state = await bounded(broker.waitFor(r"state published on (\S+),", 60), 60)
        self.proxies[role].port = port_of(state.group(1).decode())
        bound = await bounded(broker.waitFor(r"MDP broker listening on (\S+)", 60), 60)
        self.endpoints[role] = bound.group(1).decode()
        return broker

    def startWorker(self) -> Process:
        worker = twist_worker(reactor(), self.endpoints["primary"], "echo", "echo",
                              "--broker", self.endpoints["backup"])
        self.workers.append(worker)
        return worker

    def client(self, *roles: str) -> Any:
        from mdp import Client

        # the default attempt; enough of them to ride out a failover
        client = Client([self.endpoints[r] for r in roles], reactor(), timeout=2.5, retries=8)
        self.clients.append(client)
        return client

    async def status(self, role: str) -> dict:
        from mdp import Client

        client = Client(self.endpoints[role], reactor(), timeout=2, retries=3)
        try:
            return json.loads((await bounded(client.request("mmi.binarystar", b""), 10))[0])
        finally:
            await client.close()

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        for process in [*self.workers, *self.brokers.values(), *self.old]:
            await process.stop()
        for proxy in self.proxies.values():
            await proxy.close()


class Stream:
    """Clients sending one request after another until stopped."""

    def __init__(self, clients: list[Any]) -> None:
        self.completed: list[float] = []
        self.failed: list[str] = []
        self.running = True
        self.done = [defer.ensureDeferred(self._run(client, n)) for n, client in enumerate(clients)]

    async def _run(self, client: Any, n: int) -> None:
        count = 0
        while self.running:
            body = b"%d-%d" % (n, count)
            try:
                reply = await client.request("echo", body)
                assert reply == [body], reply
                self.completed.append(reactor().seconds())
            except Exception as e:  # every request must complete
                self.failed.append(f"{body!r}: {e!r}")
            count += 1
            await task.deferLater(reactor(), 0.02)

    async def resumedAfter(self, when: float, count: int = 10) -> float:
        """Wait until *count* requests completed after *when*; the time from
        *when* to the first."""
        await wait_until(lambda: sum(1 for t in self.completed if t > when) >= count, 60, 0.05)
        return min(t for t in self.completed if t > when) - when

    async def stop(self) -> None:
        self.running = False
        await bounded(defer.gatherResults(self.done), 60)


async def settle(pair: Pair, first: str) -> None:
    await pair.start(first)
    await pair.start(pair.other(first))
    await bounded(pair.brokers["primary"].waitFor("primary: primary -> active", 30), 30)
    await bounded(pair.brokers["backup"].waitFor("backup: backup -> passive", 30), 30)


async def with_a_worker(pair: Pair) -> tuple[Process, Process]:
    """The pair settled, the primary active, one worker registered there."""
    await settle(pair, "primary")
    pair.startWorker()
    primary, backup = pair.brokers["primary"], pair.brokers["backup"]
    await wait_until(lambda: primary.output.count(b"ready for echo") >= 1, 60, 0.05)
    return primary, backup


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind,first", [("zmq", "primary"), ("tcp", "backup")])
async def test_failover_and_back_under_a_steady_stream(kind: str, first: str, capsys: Any) -> None:
    pair = Pair(kind)
    stream: Optional[Stream] = None
    try:
        await settle(pair, first)
        for _ in range(2):
            pair.startWorker()
        primary = pair.brokers["primary"]
        await wait_until(lambda: primary.output.count(b"ready for echo") >= 2, 60, 0.05)
        stream = Stream([pair.client("primary", "backup") for _ in range(3)])
        await wait_until(lambda: len(stream.completed) >= 30, 30, 0.05)

        # SIGKILL the primary: the backup takes over on a client's vote
        primary.signalProcess(signal.SIGKILL)
        killed = reactor().seconds()
        backup = pair.brokers["backup"]
        await bounded(backup.waitFor("backup: passive -> active", 30), 30)
        failover = await stream.resumedAfter(killed)
        with capsys.disabled():
            print(f"\n{kind}: failover to the backup took {failover:.2f} s")
        assert failover < 10
        assert b"a vote, the peer silent" in backup.output

        # restart the primary: it comes up passive (no automatic fail-back)
        restarted = await pair.start("primary")
        await bounded(restarted.waitFor("primary: primary -> passive", 30), 30)
        assert (await pair.status("primary"))["state"] == "passive"
        assert (await pair.status("backup"))["state"] == "active"
        await stream.resumedAfter(reactor().seconds())

        # SIGKILL the backup: service goes on at the primary
        backup.signalProcess(signal.SIGKILL)
        killed = reactor().seconds()
        await bounded(restarted.waitFor("primary: passive -> active", 30), 30)
        failback = await stream.resumedAfter(killed)
        with capsys.disabled():
            print(f"{kind}: failover to the restarted primary took {failback:.2f} s")
        assert failback < 10
        await stream.stop()
        assert not stream.failed, stream.failed[:5]
        assert b"fatal" not in restarted.output
    finally:
        if stream is not None and stream.running:
            stream.running = False
        await pair.stop()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", ["zmq", "tcp"])
async def test_a_cut_state_channel_makes_no_split_brain(kind: str) -> None:
    pair = Pair(kind)
    stream: Optional[Stream] = None
    try:
        primary, backup = await with_a_worker(pair)
        stream = Stream([pair.client("primary") for _ in range(2)])  # clients reach one side
        await wait_until(lambda: len(stream.completed) >= 10, 30, 0.05)

        for proxy in pair.proxies.values():
            proxy.cut()
        cut = reactor().seconds()
        await task.deferLater(reactor(), 5.0)  # well past the failover timeout (2 s)
        await stream.resumedAfter(cut, 20)
        seen = await pair.status("backup")  # not a vote: answered, though passive
        assert seen["state"] == "passive" and seen["peerSilence"] > 2.0
        assert (await pair.status("primary"))["state"] == "active"

        for proxy in pair.proxies.values():
            proxy.restore()
        heard: dict = {}
        deadline = reactor().seconds() + 30
        while not (heard.get("peerSilence") is not None and heard["peerSilence"] < 2.0):
            assert reactor().seconds() < deadline, f"the backup never heard the primary: {heard}"
            heard = await pair.status("backup")
        assert heard["state"] == "passive" and heard["peer"] == "active"
        await stream.stop()
        assert not stream.failed, stream.failed[:5]
        assert primary.running and backup.running
        assert b"-> active" not in backup.output and b"fatal" not in backup.output + primary.output
    finally:
        if stream is not None and stream.running:
            stream.running = False
        await pair.stop()


@pytest_twisted.ensureDeferred
async def test_two_primaries_the_later_one_exits_with_a_fatal_error() -> None:
    pair = Pair("zmq")
    try:
        first = await pair.start("primary")
        await bounded(first.waitFor("state published on", 30), 30)
        # clearly later: starts less than a heartbeat apart are a tie, decided by run id
        await task.deferLater(reactor(), 1.5)
        # a second broker, also configured primary, on the backup's place
        second = Process(reactor(), [
            script("twist"), "--log-format", "text", "mdp-broker",
            "--endpoint", BIND["zmq"], "--bstar", "primary", "--bstar-local", BIND["zmq"],
            "--bstar-remote", state_endpoint("zmq", pair.proxies["primary"].address)], ENV)
        pair.old.append(second)
        state = await bounded(second.waitFor(r"state published on (\S+),", 60), 60)
        pair.proxies["backup"].port = port_of(state.group(1).decode())
        await second.ended(30)
        assert second.exitCode == 1
        assert b"fatal: both servers are configured primary; this one started later" in second.output
        assert first.running
    finally:
        await pair.stop()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", ["zmq", "tcp"])
async def test_an_active_broker_stopped_a_while_goes_passive_when_its_peer_took_over(
        kind: str, capsys: Any) -> None:
    """SIGSTOP the active primary until the backup has taken over on a
    client's vote, then SIGCONT it: it notices its stall, hears the active
    backup on a fresh state channel and goes passive (not the Guide's fatal
    dual actives); its workers move to the backup; every request completes."""
    pair = Pair(kind)
    stream: Optional[Stream] = None
    try:
        primary, backup = await with_a_worker(pair)
        stream = Stream([pair.client("primary", "backup") for _ in range(2)])
        await wait_until(lambda: len(stream.completed) >= 10, 30, 0.05)

        primary.signalProcess(signal.SIGSTOP)
        try:
            await bounded(backup.waitFor("backup: passive -> active", 30), 30)
        finally:
            primary.signalProcess(signal.SIGCONT)
        resumed = reactor().seconds()
        await bounded(primary.waitFor(
            "primary: active -> passive \\(the peer took over while this server was stalled\\)",
            30), 30)
        assert b"heard nothing for" in primary.output
        took = await stream.resumedAfter(resumed, 20)
        with capsys.disabled():
            print(f"\n{kind}: requests resumed {took:.2f} s after the stalled primary came back")
        # the worker moves to the active backup (DISCONNECT from the passive primary)
        await wait_until(lambda: backup.output.count(b"ready for echo") >= 1, 30, 0.05)
        assert (await pair.status("primary"))["state"] == "passive"
        assert (await pair.status("backup"))["state"] == "active"
        await stream.stop()
        assert not stream.failed, stream.failed[:5]
        assert primary.running and backup.running
        assert b"fatal" not in primary.output + backup.output
    finally:
        if stream is not None and stream.running:
            stream.running = False
        await pair.stop()
