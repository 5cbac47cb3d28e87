"""Shared fixtures: the same scenarios run over loopback (Clock), TCP and ZeroMQ."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest_twisted
import zmq
from twisted.internet import defer, task
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp import transport
from mdp.interfaces import IDealerReceiver, IRouterReceiver
from tests.suite_guard import *  # noqa: F401,F403  (hooks: the suite cannot hang)

_names = itertools.count()

#: the test files that take longest (process, chaos, Spark and benchmark
#: runs), longest first: the test processes (``--dist loadfile``) are handed
#: whole files in collection order, so starting these first lets them end
#: together instead of one waiting on a long file taken last
LONGEST_FIRST = (
    "test_benchmarks_smoke.py", "test_docs_commands.py", "test_binarystar_processes.py",
    "test_spark.py", "test_blocking.py", "test_faults.py", "test_suite_guard.py",
    "test_hostile_processes.py", "test_compiled.py", "test_cli_first_minutes.py",
    "test_titanic_faults.py", "test_harmony_netns.py", "test_freelance.py", "test_zmq_frames.py",
    "test_docs_snippets.py", "test_blocking_edges.py", "test_processes.py", "test_security.py",
    "test_readme_recipes.py", "test_first_hour_cli.py", "test_titanic_postgres.py",
    "test_simulated_hosts.py", "test_side_by_side.py",
)


def pytest_xdist_auto_num_workers(config: Any) -> int:
    """Half as many test processes again as there are cores (3 on 2): many tests spend
    most of their time waiting on real sockets, processes and heartbeats, which leaves
    a core per process idle a good part of the run."""
    import os

    return max(2, -(-3 * (os.cpu_count() or 1) // 2))


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """Move the files of :data:`LONGEST_FIRST` to the front, in that order;
    the rest keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


class Net:
    """How a test reaches a transport and waits for things to happen.

    ``wait(d)`` returns the result of Deferred *d*; ``until(predicate)`` returns
    once *predicate()* is true.  Both fail the test after *timeout* seconds
    (fake seconds on loopback, real ones otherwise): a hung scenario fails.
    """

    kind: str
    reactor: Any

    def __init__(self) -> None:
        self.cleanups: list[Callable[[], Any]] = []

    def bindEndpoint(self) -> str:
        raise NotImplementedError

    def addCleanup(self, fn: Callable[[], Any]) -> None:
        self.cleanups.append(fn)

    async def cleanup(self) -> None:
        for fn in reversed(self.cleanups):
            result = fn()
            if isinstance(result, defer.Deferred):
                await self.wait(result)


class LoopbackNet(Net):
    kind = "loopback"
    step = 0.01

    def __init__(self) -> None:
        super().__init__()
        self.reactor = task.Clock()

    def bindEndpoint(self) -> str:
        return f"loopback:test-{next(_names)}"

    def _step(self, end: float) -> None:
        # set the time exactly (no float drift from repeated additions), then
        # run everything due
        self.reactor.rightNow = round(min(self.reactor.seconds() + self.step, end), 9)
        self.reactor.advance(0)

    def advance(self, seconds: float) -> None:
        """Move fake time forward in small steps, delivering as it goes."""
        end = round(self.reactor.seconds() + seconds, 9)
        self.reactor.advance(0)
        while self.reactor.seconds() < end:
            self._step(end)

    async def wait(self, d: defer.Deferred, timeout: float = 30.0) -> Any:
        box: list[Any] = []
        d.addBoth(box.append)
        self.reactor.advance(0)
        deadline = self.reactor.seconds() + timeout
        while not box and self.reactor.seconds() < deadline:
            self._step(deadline)
        if not box:
            d.cancel()
            raise AssertionError(f"Deferred did not fire within {timeout} fake seconds")
        if isinstance(box[0], Failure):
            box[0].raiseException()
        return box[0]

    async def until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        self.reactor.advance(0)
        deadline = self.reactor.seconds() + timeout
        while not predicate():
            if self.reactor.seconds() >= deadline:
                raise AssertionError(f"condition not met within {timeout} fake seconds")
            self._step(deadline)


class RealNet(Net):
    def __init__(self, kind: str) -> None:
        super().__init__()
        from twisted.internet import reactor

        self.kind = kind
        self.reactor = reactor

    def bindEndpoint(self) -> str:
        return "tcp:host=127.0.0.1:port=0" if self.kind == "tcp" else "zmq:tcp://127.0.0.1:*"

    def advance(self, seconds: float) -> None:
        raise NotImplementedError("real time cannot be advanced")

    async def wait(self, d: defer.Deferred, timeout: float = 30.0) -> Any:
        return await d.addTimeout(timeout, self.reactor)

    async def until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = self.reactor.seconds() + timeout
        while not predicate():
            if self.reactor.seconds() >= deadline:
                raise AssertionError(f"condition not met within {timeout}s")
            await task.deferLater(self.reactor, 0.005)


@pytest_twisted.async_yield_fixture(params=["loopback", "tcp", "zmq"])
async def net(request: Any) -> Any:
    n: Net = LoopbackNet() if request.param == "loopback" else RealNet(request.param)
    yield n
    await n.cleanup()


@pytest_twisted.async_yield_fixture
async def clocknet() -> Any:
    n = LoopbackNet()
    yield n
    await n.cleanup()


@implementer(IDealerReceiver)
class RawPeer:
    """A scripted DEALER peer that records what it receives."""

    def __init__(self, net: Net, endpoint: str) -> None:
        self.net = net
        self.received: list[list[bytes]] = []
        self.connections = 0
        self.transport = transport.connect(endpoint, self, net.reactor)
        net.addCleanup(self.transport.close)

    def connectionMade(self) -> None:
        self.connections += 1

    def connectionLost(self, reason: object) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        self.received.append(frames)

    def send(self, *frames: bytes) -> None:
        self.transport.sendMessage(list(frames))

    async def nextMessage(self, timeout: float = 10.0) -> list[bytes]:
        count = len(self.received)
        await self.net.until(lambda: len(self.received) > count, timeout)
        return self.received[count]


@implementer(IRouterReceiver)
class RawRouter:
    """A scripted bound peer (a fake broker) that records what it receives."""

    def __init__(self) -> None:
        self.received: list[tuple[float, bytes, list[bytes]]] = []
        self.disconnected: list[bytes] = []
        self.transport: Optional[Any] = None
        self.clock: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self.received.append((self.clock.seconds(), peer, frames))

    def peerDisconnected(self, peer: bytes) -> None:
        self.disconnected.append(peer)

    def send(self, peer: bytes, *frames: bytes) -> None:
        self.transport.sendMessage(peer, list(frames))


async def raw_router(net: Net) -> RawRouter:
    router = RawRouter()
    router.clock = net.reactor
    router.transport = await net.wait(transport.listen(net.bindEndpoint(), router, net.reactor))
    net.addCleanup(router.transport.close)
    return router


@contextlib.contextmanager
def logged_at(levels: tuple[str, ...]) -> Iterator[list[dict]]:
    """Collect the log events at one of *levels* (names of ``LogLevel``s)
    or carrying a failure."""
    events: list[dict] = []

    def observe(event: dict) -> None:
        if "log_failure" in event or getattr(event.get("log_level"), "name", "") in levels:
            events.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield events
    finally:
        globalLogPublisher.removeObserver(observe)


def failures_logged() -> Any:
    """Collect log events that carry a failure or are errors."""
    return logged_at(("error", "critical"))


def warnings_logged() -> Any:
    """Collect the log events of level warning and above."""
    return logged_at(("warn", "error", "critical"))


def refuse_connections(monkeypatch: Any, module: Any, times: int = 1,
                       to: Callable[[str], bool] = lambda endpoint: True) -> list[str]:
    """Make *module*'s ``connect(endpoint, ...)`` raise ``TransportError``,
    as when the process is out of descriptors, for the first *times*
    endpoints that *to* accepts; returns the endpoints refused, as they are."""
    from mdp.errors import TransportError

    connect = module.connect
    refused: list[str] = []

    def refusing(endpoint: str, *args: Any, **kwargs: Any) -> Any:
        if len(refused) < times and to(endpoint):
            refused.append(endpoint)
            raise TransportError(f"cannot connect to {endpoint!r}: too many open files")
        return connect(endpoint, *args, **kwargs)

    monkeypatch.setattr(module, "connect", refusing)
    return refused


#: what a scripted broker does with a request from a peer: the replies to
#: send, (peer, command, body) each
ScriptReply = tuple[bytes, bytes, list[bytes]]
Script = Callable[[bytes, list[bytes]], list[ScriptReply]]


class ScriptedBroker:
    """A plain pyzmq ROUTER on 127.0.0.1 that answers each MDP client
    request as *script* says (with the request's service), in a thread of its
    own until stopped; ``seen`` holds the request bodies in the order they
    came, ``answered`` counts the requests whose replies were sent."""

    def __init__(self, script: Script, context: Optional[zmq.Context] = None,
                 address: Optional[str] = None) -> None:
        self.script = script
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if address is None:
            address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.socket.bind(address)
        self.endpoint = f"zmq:{address}"
        self.seen: list[list[bytes]] = []
        self.answered = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock = self.socket
        while not self.stopping.is_set():
            if not sock.poll(50):
                continue
            peer, header, _, service, *body = sock.recv_multipart()
            self.seen.append(body)
            for to, command, reply in self.script(peer, body):
                sock.send_multipart([to, header, command, service, *reply])
            self.answered += 1
            self.served(body)

    def served(self, body: list[bytes]) -> None:
        """The request of *body* has been answered (for a subclass to note)."""

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.socket.close()
        self.context.term()
