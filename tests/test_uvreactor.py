"""mdp.uvreactor: Twisted's asyncio reactor over the real uvloop package, in
processes of their own (a reactor is installed once per process): nodes over
ZeroMQ and TCP with their timers, ``twist --reactor=uvloop`` with a clean
SIGTERM, and the errors of an install that cannot be done."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from typing import Any

import pytest
import pytest_twisted

from tests.procs import ENV, Process, bound_endpoint, finished, reactor, script

pytest.importorskip("uvloop")

pytestmark = pytest.mark.timeout(60)

#: a whole stack in one process on the uvloop reactor: many requests over each
#: transport, an async handler, and a request that times out (the reactor's timers)
STACK = textwrap.dedent("""
    import asyncio
    import sys

    from mdp import uvreactor

    reactor = uvreactor.install()

    import uvloop
    from twisted.internet import defer, task

    from mdp import Broker, Client, Worker
    from mdp.errors import RequestTimeout

    assert isinstance(asyncio.get_event_loop(), uvloop.Loop), asyncio.get_event_loop()
    assert reactor._asyncioEventloop is asyncio.get_event_loop()
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor
    assert isinstance(reactor, AsyncioSelectorReactor), reactor

    async def later(frames):
        await task.deferLater(reactor, 0.01, lambda: None)
        return [b"late:" + f for f in frames]

    async def main(reactor):
        for bind in ("zmq:tcp://127.0.0.1:*", "tcp:host=127.0.0.1:port=0"):
            broker = Broker(reactor)
            bound = await broker.listen(bind)
            upper = Worker(bound.endpoint, "upper", lambda frames: [f.upper() for f in frames],
                           reactor)
            slow = Worker(bound.endpoint, "later", later, reactor)
            upper.start()
            slow.start()
            client = Client(bound.endpoint, reactor, timeout=5, retries=1)
            replies = await defer.gatherResults(
                [client.request("upper", b"r%d" % i) for i in range(300)])
            assert replies == [[b"R%d" % i] for i in range(300)], replies[:3]
            assert await client.request("later", b"x") == [b"late:x"]
            quick = Client(bound.endpoint, reactor, timeout=0.3, retries=1)
            try:
                await quick.request("nobody", b"x")
            except RequestTimeout:
                pass
            else:
                raise AssertionError("a request nobody serves did not time out")
            for node in (quick, client, upper, slow, broker):
                await (node.close() if hasattr(node, "close") else node.stop())
            print("OK", bind.split(":")[0], flush=True)

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
""")


#: 200 timers over 0.2 s on the uvloop reactor: how many times the reactor woke
#: for its timers, and how late the calls ran
TIMERS = textwrap.dedent("""
    import random

    from mdp import uvreactor

    reactor = uvreactor.install()
    wakes = [0]
    onTimer = reactor._onTimer

    def counted():
        wakes[0] += 1
        onTimer()

    reactor._onTimer = counted
    late = []
    random.seed(1)
    for _ in range(200):
        delay = random.uniform(0, 0.2)
        due = reactor.seconds() + delay
        reactor.callLater(delay, lambda due=due: late.append(reactor.seconds() - due))
    reactor.callLater(0.3, reactor.stop)
    reactor.run()
    print("RAN", len(late), "WAKES", wakes[0], "EARLIEST", min(late), "LATEST", max(late))
""")


@pytest_twisted.ensureDeferred
async def test_timers_wake_the_uvloop_reactor_once_not_until_due() -> None:
    """uvloop runs a timer under half a millisecond at once: without whole
    milliseconds, each call took about 27 wake-ups (5,500 for these 200)."""
    proc = await finished([sys.executable, "-c", TIMERS], timeout=60)
    assert proc.exitCode == 0, proc.output
    words = proc.output.decode().split()
    ran, wakes = int(words[words.index("RAN") + 1]), int(words[words.index("WAKES") + 1])
    earliest, latest = (float(words[words.index(w) + 1]) for w in ("EARLIEST", "LATEST"))
    assert ran == 200
    assert wakes <= 200, wakes  # at most one a call (calls due together share one)
    assert earliest >= 0 and latest < 0.1, (earliest, latest)


@pytest_twisted.ensureDeferred
async def test_nodes_run_on_the_uvloop_reactor_over_zeromq_and_tcp() -> None:
    proc = await finished([sys.executable, "-c", STACK], timeout=90)
    assert proc.exitCode == 0, proc.output
    assert b"OK zmq" in proc.output and b"OK tcp" in proc.output, proc.output


@pytest.mark.parametrize("bind", ["zmq:tcp://127.0.0.1:*", "tcp:host=127.0.0.1:port=0"])
@pytest_twisted.ensureDeferred
async def test_twist_runs_broker_and_worker_on_uvloop_and_stops_on_sigterm(bind: str) -> None:
    uv = [script("twist"), "--reactor=uvloop", "--log-format", "text"]
    broker = Process(reactor(), [*uv, "mdp-broker", "--endpoint", bind, "--heartbeat", "0.5"], ENV)
    endpoint = await bound_endpoint(broker, "MDP broker")
    worker = Process(reactor(), [*uv, "mdp-worker", "--broker", endpoint, "--service", "upper",
                                 "--handler", "tests.handlers_for_tests:upper",
                                 "--heartbeat", "0.5"], ENV)
    try:
        await worker.waitFor("sent READY", timeout=60)
        call = await finished([script("mdp"), "call", "--broker", endpoint, "--timeout", "10",
                               "upper", "shout"])
        assert call.exitCode == 0, call.output
        assert call.output.decode().splitlines() == ["SHOUT"]
    finally:
        await worker.stop()
        await broker.stop()
    for proc in (broker, worker):
        assert b"asyncio reactor over uvloop" in proc.output, proc.output
        # SIGTERM: a clean stop, ending as twist ends on any reactor (by the
        # signal it stopped for), not by the SIGKILL stop() sends after 10 s
        assert b"Received SIGTERM, shutting down." in proc.output, proc.output
        assert proc.signal == signal.SIGTERM, (proc.exitCode, proc.signal, proc.output)


def test_install_refuses_when_a_reactor_is_installed_already() -> None:
    from twisted.internet import reactor as installed
    from twisted.internet.error import ReactorAlreadyInstalledError

    from mdp import uvreactor

    with pytest.raises(ReactorAlreadyInstalledError):
        uvreactor.install()
    from twisted.internet import reactor as after

    assert after is installed


def test_without_uvloop_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from mdp import uvreactor

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(uvreactor.UVLoopMissing, match="pip install uvloop"):
        uvreactor.new_loop()


@pytest_twisted.ensureDeferred
async def test_twist_without_uvloop_says_how_to_install_it_in_one_line(tmp_path: Any) -> None:
    hidden = tmp_path / "uvloop"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('uvloop hidden by the test')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    proc = await finished([script("twist"), "--reactor=uvloop", "mdp-broker",
                           "--endpoint", "zmq:tcp://127.0.0.1:*"], env)
    assert proc.exitCode == 64, proc.output  # twist's usage error
    assert b"Traceback" not in proc.output, proc.output
    first = proc.output.decode().splitlines()[0]
    assert first.startswith("Error: the uvloop reactor needs uvloop: pip install uvloop"), \
        proc.output


def test_call_soon_runs_at_the_end_of_the_turn_on_either_kind_of_reactor() -> None:
    """twisted_private.call_soon: the asyncio loop's call_soon under an asyncio
    reactor (what mdp.uvreactor installs), callLater(0) elsewhere; both run
    once, later, and cancel."""
    import asyncio
    from types import SimpleNamespace

    from twisted.internet import task

    from mdp.transport.twisted_private import call_soon

    loop = asyncio.new_event_loop()
    try:
        ran: list[str] = []
        reactor = SimpleNamespace(_asyncioEventloop=loop)
        call_soon(reactor, ran.append, "asyncio")
        call_soon(reactor, ran.append, "cancelled").cancel()
        assert ran == []
        loop.run_until_complete(asyncio.sleep(0))
        assert ran == ["asyncio"]
    finally:
        loop.close()
    clock = task.Clock()
    call_soon(clock, ran.append, "clock")
    call_soon(clock, ran.append, "cancelled").cancel()
    assert ran == ["asyncio"]
    clock.advance(0)
    assert ran == ["asyncio", "clock"]


def test_a_reader_that_logs_on_its_own_is_read_without_the_legacy_log_context(
        tmp_path: Any) -> None:
    """A reader whose ``needsLogContext`` is false, or a transport whose
    protocol's is, is called straight from the loop (no ``callWithLogger``:
    it sees the context the loop runs in); the others still run with their
    ``logPrefix()`` as the legacy log's ``system``.  Registered once, removed for good; a failed read
    disconnects it as Twisted's own path does, an exception from its
    ``connectionLost`` is logged, and a descriptor the loop cannot poll
    falls back to Twisted's polling."""
    import asyncio

    from twisted.logger import globalLogPublisher
    from twisted.python import context, log

    from mdp import uvreactor
    from mdp.transport.stream import FramedProtocol
    from mdp.transport.zeromq import _connection_classes

    assert all(cls.needsLogContext is False for cls in _connection_classes())
    assert FramedProtocol.needsLogContext is False
    loop = uvreactor.new_loop()
    reactor = uvreactor.reactor_class()(loop)
    pipes = [os.pipe() for _ in range(7)]
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        seen: dict[str, Any] = {}
        lost: dict[str, Any] = {}
        done = loop.create_future()

        class Reader:
            def __init__(self, name: str, fd: int, needs: Any = None, fail: bool = False,
                         failLost: bool = False, protocolNeeds: Any = None) -> None:
                self.name, self.fd, self.fail, self.failLost = name, fd, fail, failLost
                if needs is not None:
                    self.needsLogContext = needs
                if protocolNeeds is not None:  # a transport: its protocol says
                    self.protocol = type("P", (), {"needsLogContext": protocolNeeds})()

            def fileno(self) -> int:
                return self.fd

            def logPrefix(self) -> str:
                return self.name

            def doRead(self) -> Any:
                os.read(self.fd, 100)
                seen[self.name] = context.get(log.ILogContext)["system"]
                self.check()
                return ValueError("bad read") if self.fail else None

            def connectionLost(self, reason: Any) -> None:
                lost[self.name] = reason.value
                self.check()
                if self.failLost:
                    raise RuntimeError("connectionLost failed")

            def check(self) -> None:
                if len(seen) == 7 and len(lost) == 2 and not done.done():
                    loop.call_soon(done.set_result, None)  # after this reader's disconnection

        readers = [Reader("plain", pipes[0][0]), Reader("legacy", pipes[1][0], needs=True),
                   Reader("direct", pipes[2][0], needs=False),
                   Reader("failing", pipes[3][0], needs=False, fail=True),
                   Reader("badLost", pipes[4][0], needs=False, fail=True, failLost=True),
                   Reader("transport", pipes[5][0], protocolNeeds=False),
                   Reader("legacyTransport", pipes[6][0], protocolNeeds=True)]
        for reader in readers:
            reactor.addReader(reader)
        reactor.addReader(readers[2])  # again: still one registration
        for _, w in pipes:
            os.write(w, b"x")
        context.call({log.ILogContext: {"system": "outer"}}, loop.run_until_complete,
                     asyncio.wait_for(done, 10))
        assert seen == {"plain": "plain", "legacy": "legacy", "direct": "outer",
                        "failing": "outer", "badLost": "outer", "transport": "outer",
                        "legacyTransport": "legacyTransport"}
        assert {k: type(v) for k, v in lost.items()} == {"failing": ValueError,
                                                           "badLost": ValueError}
        assert any(e.get("log_failure") is not None
                   and e["log_failure"].check(RuntimeError) for e in logged), logged
        assert readers[3] not in reactor.getReaders()
        assert readers[4] not in reactor.getReaders()
        reactor.removeReader(readers[2])
        assert readers[2] not in reactor.getReaders()
        assert not loop.remove_reader(pipes[2][0])  # gone from the loop too
        # a regular file: epoll refuses it (EPERM); Twisted polls it instead
        with open(tmp_path / "file", "wb") as f:
            plain = Reader("file", f.fileno(), needs=False)
            reactor.addReader(plain)
            assert reactor._continuousPolling.isReading(plain)
            reactor.removeReader(plain)
            assert not reactor._continuousPolling.isReading(plain)
    finally:
        globalLogPublisher.removeObserver(logged.append)
        for reader in reactor.getReaders():
            reactor.removeReader(reader)
        reactor.waker.connectionLost(None)
        loop.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_a_reader_that_reads_on_its_own_is_the_loops_callback() -> None:
    """A reader with ``readNow`` (and no need of the legacy log context) is
    called through it, straight from the loop: its ``doRead`` is not called,
    and no reactor code runs between."""
    import asyncio

    from mdp import uvreactor

    loop = uvreactor.new_loop()
    reactor = uvreactor.reactor_class()(loop)
    r, w = os.pipe()
    calls: list[str] = []
    done = loop.create_future()

    class Reader:
        needsLogContext = False

        def fileno(self) -> int:
            return r

        def logPrefix(self) -> str:
            return "own"

        def doRead(self) -> None:
            calls.append("doRead")

        def readNow(self) -> None:
            os.read(r, 100)
            calls.append("readNow")
            if not done.done():
                done.set_result(None)

    reader = Reader()
    reactor._readOrWrite = lambda *a: calls.append("reactor")  # not to be used
    try:
        reactor.addReader(reader)
        assert reader in reactor.getReaders()
        os.write(w, b"x")
        loop.run_until_complete(asyncio.wait_for(done, 10))
        assert calls == ["readNow"]
        reactor.removeReader(reader)
        assert reader not in reactor.getReaders()
        # gone from the loop too: readable again, it is not called
        os.write(w, b"x")
        loop.run_until_complete(asyncio.sleep(0.05))
        assert calls == ["readNow"]
    finally:
        for each in reactor.getReaders():
            reactor.removeReader(each)
        reactor.waker.connectionLost(None)
        loop.close()
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("error", [OSError("broken socket"), SystemExit(3)])
@pytest_twisted.ensureDeferred
async def test_a_zeromq_socket_whose_read_fails_logs_it_and_stops_reading(
        error: BaseException) -> None:
    """``readNow`` of our ZeroMQ sockets raises nothing into the loop (a
    SystemExit there would stop it, skipping the reactor's shutdown): a read
    that fails is logged, and the socket is no longer read (as Twisted's
    epoll reactor does with a failed ``doRead``)."""
    from twisted.logger import globalLogPublisher

    from mdp import transport
    from tests.test_transport_conformance import Router

    bound = await transport.listen("zmq:tcp://127.0.0.1:*", Router(), reactor())
    connection = bound.connection
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        assert connection in reactor().getReaders()

        class Broken:
            """A socket that fails whatever is asked of it."""

            def __getattr__(self, name: str) -> Any:
                raise error

        socket, connection.socket = connection.socket, Broken()
        handle, connection.handle = connection.handle, 0
        try:
            connection.readNow()  # does not raise
        finally:
            connection.socket, connection.handle = socket, handle
        assert connection not in reactor().getReaders()
        failures = [e for e in logged if e.get("log_failure") is not None]
        assert len(failures) == 1, logged
        assert "reading from a ZeroMQ socket failed" in failures[0]["log_format"]
    finally:
        globalLogPublisher.removeObserver(logged.append)
        await bound.close()
