"""Child processes for integration tests: spawn, read their output, always reap."""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Any, Optional

from twisted.internet import defer, protocol, task
from twisted.protocols import portforward
from twisted.python.failure import Failure


class _Collector(protocol.ProcessProtocol):
    def __init__(self, proc: Process) -> None:
        self.proc = proc

    def outReceived(self, data: bytes) -> None:
        self.proc._output(data)

    def errReceived(self, data: bytes) -> None:
        self.proc._output(data)

    def processEnded(self, reason: Failure) -> None:
        self.proc._ended(reason)


class Process:
    """A child process whose combined stdout/stderr is kept and searchable."""

    def __init__(self, reactor: Any, args: list[str], env: Optional[dict[str, str]] = None,
                 usePTY: bool = False) -> None:
        self.reactor = reactor
        self.args = args
        self.output = b""
        self.exitCode: Optional[int] = None
        self.signal: Optional[int] = None
        self._ended_d: defer.Deferred[None] = defer.Deferred()
        self._watchers: list[tuple[re.Pattern[bytes], defer.Deferred[re.Match[bytes]]]] = []
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(env or {})
        self.transport = reactor.spawnProcess(_Collector(self), args[0], args, env=full_env,
                                              usePTY=usePTY)

    @property
    def running(self) -> bool:
        return not self._ended_d.called

    def _output(self, data: bytes) -> None:
        self.output += data
        for pattern, d in list(self._watchers):
            match = pattern.search(self.output)
            if match:
                self._watchers.remove((pattern, d))
                d.callback(match)

    def _ended(self, reason: Failure) -> None:
        self.exitCode = getattr(reason.value, "exitCode", None)
        self.signal = getattr(reason.value, "signal", None)
        for _, d in self._watchers:
            d.errback(AssertionError(
                f"{self.args} exited ({self.exitCode}, signal {self.signal}) before printing "
                f"the expected line; output:\n{self.output.decode(errors='replace')}"
            ))
        self._watchers = []
        self._ended_d.callback(None)

    def waitFor(self, pattern: str, timeout: float = 30.0) -> defer.Deferred[re.Match[bytes]]:
        """Fire with the first match of *pattern* in the output so far or later."""
        regex = re.compile(pattern.encode())
        match = regex.search(self.output)
        if match:
            return defer.succeed(match)
        if not self.running:
            return defer.fail(AssertionError(f"{self.args} already exited:\n{self.output!r}"))
        d: defer.Deferred[re.Match[bytes]] = defer.Deferred()
        self._watchers.append((regex, d))
        return d.addTimeout(timeout, self.reactor, onTimeoutCancel=self._timedOut(pattern))

    def _timedOut(self, pattern: str) -> Any:
        def describe(result: Any, timeout: float) -> Any:
            raise AssertionError(
                f"{self.args} did not print {pattern!r} within {timeout}s; output:\n"
                f"{self.output.decode(errors='replace')}"
            )
        return describe

    def ended(self, timeout: float = 30.0) -> defer.Deferred[None]:
        """Fire when the process has exited (a copy of the internal Deferred)."""
        d: defer.Deferred[None] = defer.Deferred()
        self._ended_d.addBoth(lambda r: (d.callback(None), r)[1])
        return d.addTimeout(timeout, self.reactor)

    def signalProcess(self, sig: int) -> None:
        if self.running:
            try:
                self.transport.signalProcess(sig)
            except Exception:
                pass

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not gone within *timeout*; reaped."""
        if not self.running:
            return
        self.signalProcess(signal.SIGCONT)
        self.signalProcess(signal.SIGTERM)
        try:
            await self.ended(timeout)
        except defer.TimeoutError:
            self.signalProcess(signal.SIGKILL)
            await self.ended(timeout)


async def finished(args: list[str], env: Optional[dict[str, str]] = None,
                   timeout: float = 60.0) -> Process:
    """Run *args* to their end (stopped if they outlive *timeout*, which
    then fails) and return the process: its output and exit status."""
    proc = Process(reactor(), args, ENV if env is None else env)
    try:
        await proc.ended(timeout)
    finally:
        await proc.stop()
    return proc


def python(*args: str) -> list[str]:
    """Argument list running this interpreter."""
    return [sys.executable, *args]


def script(name: str) -> str:
    """Path of an executable installed beside this interpreter (e.g. ``twist``)."""
    return os.path.join(os.path.dirname(sys.executable), name)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: children import test handlers (tests.handlers_for_tests) from the checkout
ENV = {"PYTHONPATH": ROOT}


async def twist_broker(reactor: Any, endpoint: str, *options: str) -> tuple[Process, str]:
    """Start ``twist mdp-broker``; return it and the endpoint it bound."""
    broker = Process(reactor, [script("twist"), "--log-format", "text", "mdp-broker",
                               "--endpoint", endpoint, *options], ENV)
    return broker, await bound_endpoint(broker, "MDP broker")


async def bound_endpoint(server: Process, what: str) -> str:
    """The endpoint *server* logs ``WHAT listening on ENDPOINT`` for; it is
    stopped if it never does."""
    try:
        match = await server.waitFor(what + r" listening on (\S+)", timeout=60)
    except Exception:
        await server.stop()
        raise
    return match.group(1).decode()


def twist_worker(reactor: Any, endpoint: str, service: str, handler: str, *options: str) -> Process:
    """Start ``twist mdp-worker`` (wait for ``sent READY`` to know it registered)."""
    return Process(reactor, [script("twist"), "--log-format", "text", "mdp-worker",
                             "--broker", endpoint, "--service", service, "--handler", handler,
                             *options], ENV)


# fast heartbeats: a dead worker or broker is noticed within about a second
BROKER_HB = ("--heartbeat", "0.25", "--liveness", "4")
WORKER_HB = ("--heartbeat", "0.25", "--liveness", "4", "--backoff-max", "2")
#: replies [pid, body]: who served a request, and whether it was this request
TAGGED = "tests.handlers_for_tests:tagged"


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


async def bounded(d: defer.Deferred, seconds: float) -> Any:
    return await d.addTimeout(seconds, reactor())


def peer_closed(sock: Any) -> bool:
    """The far side of plain socket *sock* has closed it (a read finds the
    end); never blocks."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1) == b"")
    except BlockingIOError:
        return False
    except OSError:
        return True


async def wait_until(predicate: Any, seconds: float, step: float = 0.01) -> None:
    """Poll *predicate* until it is true; fail after *seconds*."""
    deadline = reactor().seconds() + seconds
    while not predicate():
        if reactor().seconds() > deadline:
            raise AssertionError(f"condition not met within {seconds}s: {predicate}")
        await task.deferLater(reactor(), step)


class Cluster:
    """A broker process, worker processes and clients, all stopped by
    :meth:`stop`.  *brokerOptions* go to every broker it starts."""

    def __init__(self, *brokerOptions: str) -> None:
        self.brokerOptions = brokerOptions
        self.broker: Optional[Process] = None
        self.endpoint = ""
        self.workers: list[Process] = []
        self.clients: list[Any] = []

    async def startBroker(self, bind: str) -> Process:
        self.broker, self.endpoint = await twist_broker(reactor(), bind, *BROKER_HB,
                                                        *self.brokerOptions)
        return self.broker

    def startWorker(self, service: str = "work", handler: str = TAGGED, *options: str) -> Process:
        worker = twist_worker(reactor(), self.endpoint, service, handler, *WORKER_HB, *options)
        self.workers.append(worker)
        return worker

    async def startWorkers(self, count: int, service: str, handler: str, *options: str) -> list[Process]:
        """Start *count* workers and wait until the broker has registered them."""
        started = [self.startWorker(service, handler, *options) for _ in range(count)]
        for worker in started:
            await bounded(worker.waitFor("sent READY", timeout=60), 60)
        broker = self.broker
        assert broker is not None
        await wait_until(lambda: broker.output.count(f"ready for {service}".encode()) >= count, 30)
        return started

    def client(self, **kwargs: Any) -> Any:
        from mdp import Client

        client = Client(self.endpoint, reactor(), **kwargs)
        self.clients.append(client)
        return client

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        for worker in self.workers:
            await worker.stop()
        if self.broker is not None:
            await self.broker.stop()


# --- a TCP proxy the test can cut ------------------------------------------------------


class _ProxyServer(portforward.ProxyServer):
    def connectionMade(self) -> None:
        if not self.factory.open or self.factory.port is None:
            self.transport.abortConnection()
            return
        self.factory.connections.add(self)
        self.factory.accepted += 1
        super().connectionMade()

    def connectionLost(self, reason: Any) -> None:
        self.factory.connections.discard(self)
        super().connectionLost(reason)


class Proxy(portforward.ProxyFactory):
    """Forwards 127.0.0.1:``listening port`` to ``self.port`` (set later);
    :meth:`cut` closes every connection and refuses new ones until
    :meth:`restore`."""

    protocol = _ProxyServer

    def __init__(self) -> None:
        super().__init__("127.0.0.1", None)
        self.open = True
        self.connections: set[_ProxyServer] = set()
        #: connections let through so far
        self.accepted = 0
        self.listening = reactor().listenTCP(0, self, interface="127.0.0.1")

    @property
    def address(self) -> int:
        return self.listening.getHost().port

    def cut(self) -> None:
        self.open = False
        for connection in list(self.connections):
            connection.transport.abortConnection()
            if connection.peer is not None:
                connection.peer.transport.abortConnection()

    def restore(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        await self.listening.stopListening()
