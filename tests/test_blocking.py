"""The blocking client (:mod:`mdp.blocking`) against real broker and worker
processes, over ZeroMQ and TCP: the behaviour tests of the Twisted client
that apply to it (replies, typed errors, timeouts, retries, failover, streams,
limits, the map window, no wrong reply across a broker restart), and that it
needs no reactor.

The broker and workers run as processes under the test's reactor; each
blocking client lives in one thread of the reactor's pool for the whole of
what it does (``run``), as a ZeroMQ socket wants.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import pytest
import pytest_twisted
from twisted.internet import defer, task, threads

from mdp import errors
from mdp.blocking import Client, Worker
from mdp.errors import TransportError
from mdp.policy import Limits
from tests.procs import ENV, ROOT, Cluster, bounded, reactor, wait_until

BINDS = {"zmq": "zmq:tcp://127.0.0.1:*", "tcp": "tcp:host=127.0.0.1:port=0"}


def run(work: Callable[[], Any], seconds: float = 60) -> defer.Deferred:
    """*work* in a thread of the reactor's pool (where it may block), bounded."""
    return threads.deferToThread(work).addTimeout(seconds, reactor())


def run_program(program: str) -> defer.Deferred:
    """``python -c PROGRAM`` (with the checkout importable), to completion."""
    return run(lambda: subprocess.run([sys.executable, "-c", program], capture_output=True,
                                      text=True, timeout=60, env={**ENV, "PATH": ""}), 90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def cluster_with(kind: str, workers: int = 1, service: str = "work",
                       handler: str = "tests.handlers_for_tests:tagged",
                       *brokerOptions: str) -> Cluster:
    cluster = Cluster(*brokerOptions)
    await cluster.startBroker(BINDS[kind])
    await cluster.startWorkers(workers, service, handler)
    return cluster


# --- replies and typed errors ----------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_request_returns_the_reply_frames_and_raises_typed_errors(kind: str) -> None:
    cluster = await cluster_with(kind, 1, "work", "tests.handlers_for_tests:tagged",
                                 "--unknown-service-expiry", "0.5")
    try:
        await cluster.startWorkers(1, "upper", "tests.handlers_for_tests:upper")
        await cluster.startWorkers(1, "fail", "tests.handlers_for_tests:fails")

        def work() -> dict[str, Any]:
            seen: dict[str, Any] = {}
            # a wait longer than one poll takes (2**31 ms) is several
            with Client(cluster.endpoint, timeout=3e6, retries=1) as patient:
                seen["patient"] = patient.request("upper", b"long")
            with Client(cluster.endpoint, timeout=5, retries=2) as client:
                seen["upper"] = client.request("upper", b"hello", "world")
                seen["tagged"] = client.request(b"work", b"one")
                for service in ("nobody", "fail"):
                    try:
                        client.request(service, b"x")
                    except Exception as e:
                        seen[service] = e
                # caller mistakes raise at once, nothing is sent
                for bad in (lambda: client.request(1, b"x"),  # type: ignore[arg-type]
                            lambda: client.request("upper", 2),  # type: ignore[arg-type]
                            lambda: client.request("", b"x"),
                            lambda: client.request("upper", b"x", timeout=0),
                            lambda: client.request("upper", b"x", retries=0)):
                    try:
                        bad()
                    except (TypeError, ValueError) as e:
                        seen.setdefault("mistakes", []).append(type(e))
                seen["after"] = client.request("upper", b"still")
            try:
                client.request("upper", b"closed")
            except errors.ClientClosed as e:
                seen["closed"] = e
            return seen

        seen = await run(work)
        assert seen["upper"] == [b"HELLO", b"WORLD"] and seen["patient"] == [b"LONG"]
        assert seen["tagged"][1] == b"one"
        assert isinstance(seen["nobody"], errors.ServiceUnavailable)
        assert isinstance(seen["fail"], errors.WorkerError)
        assert seen["mistakes"] == [TypeError, TypeError, ValueError, ValueError, ValueError]
        assert seen["after"] == [b"STILL"]
        assert isinstance(seen["closed"], errors.ClientClosed)
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_request_over_the_limits_is_refused_and_a_reply_over_them_dropped() -> None:
    cluster = await cluster_with("zmq", 1, "sized", "tests.handlers_for_tests:sized")
    try:
        def work() -> tuple[Any, Any, Any]:
            with Client(cluster.endpoint, timeout=5, retries=1,
                        limits=Limits(maxMessageBytes=1000)) as client:
                try:
                    client.request("sized", b"x" * 2000)
                except errors.RequestTooLarge as e:
                    refused = e
                try:
                    client.request("sized", b"5000")
                except errors.ReplyTooLarge as e:
                    dropped = e
                return refused, dropped, client.request("sized", b"10")

        refused, dropped, fine = await run(work)
        assert "not sent" in str(refused)
        assert "too large" in str(dropped)
        assert fine == [b"x" * 10]
    finally:
        await cluster.stop()


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_partials_reach_on_partial_before_the_final(kind: str) -> None:
    cluster = await cluster_with(kind, 1, "burst", "tests.handlers_for_tests:burst")
    try:
        def work() -> tuple[list[list[bytes]], list[bytes]]:
            parts: list[list[bytes]] = []
            with Client(cluster.endpoint, timeout=10, retries=1) as client:
                final = client.request("burst", b"50", onPartial=parts.append)
            return parts, final

        parts, final = await run(work)
        assert parts == [[str(n).encode()] for n in range(50)]
        assert final == [b"end"]
    finally:
        await cluster.stop()


# --- timeouts, retries, failover ---------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_no_broker_times_out_after_its_attempts_naming_the_endpoint() -> None:
    endpoint = f"zmq:tcp://127.0.0.1:{free_port()}"

    def work() -> tuple[Any, float]:
        started = time.monotonic()
        with Client(endpoint, timeout=0.2, retries=3) as client:
            try:
                client.request("echo", b"x")
            except errors.RequestTimeout as e:
                return e, time.monotonic() - started
        raise AssertionError("no timeout")

    error, elapsed = await run(work)
    assert error.attempts == 3
    assert endpoint in str(error) and "3 attempts" in str(error)
    assert 0.55 <= elapsed < 5


@pytest_twisted.ensureDeferred
async def test_refused_tcp_everywhere_is_broker_unreachable_at_once() -> None:
    endpoints = [f"tcp:host=127.0.0.1:port={free_port()}", f"unix:path={ROOT}/no-such.sock"]

    def work() -> tuple[Any, float]:
        started = time.monotonic()
        with Client(endpoints, timeout=5, retries=3) as client:
            try:
                client.request("echo", b"x")
            except errors.BrokerUnreachable as e:
                # no connection is left trying in the background
                assert not client._loop.timed and not client._loop.pipes
                return e, time.monotonic() - started
        raise AssertionError("no error")

    error, elapsed = await run(work)
    assert elapsed < 4  # not after the attempts ran out
    assert "connection refused" in str(error) and "no such socket" in str(error)


@pytest.mark.parametrize("dead", ["zmq", "tcp"])
@pytest_twisted.ensureDeferred
async def test_fails_over_to_the_next_broker(dead: str) -> None:
    cluster = await cluster_with("zmq", 1)
    try:
        port = free_port()
        silent = {"zmq": f"zmq:tcp://127.0.0.1:{port}", "tcp": f"tcp:host=127.0.0.1:port={port}"}

        def work() -> tuple[list[bytes], float, str]:
            started = time.monotonic()
            with Client([silent[dead], cluster.endpoint], timeout=0.5, retries=3) as client:
                reply = client.request("work", b"over")
                return reply, time.monotonic() - started, client.endpoint

        reply, elapsed, now_at = await run(work)
        assert reply[1] == b"over"
        assert now_at == cluster.endpoint
        if dead == "tcp":
            assert elapsed < 0.5  # refused: left at once, not after an attempt
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_request_is_retried_until_a_worker_comes() -> None:
    cluster = Cluster("--unknown-service-expiry", "120")
    try:
        await cluster.startBroker(BINDS["zmq"])

        def work() -> list[bytes]:
            with Client(cluster.endpoint, timeout=0.5, retries=120) as client:
                return client.request("late", b"hi")

        started = threads.deferToThread(work)
        await task.deferLater(reactor(), 1.2)  # a couple of attempts run out meanwhile
        await cluster.startWorkers(1, "late", "tests.handlers_for_tests:upper")
        assert await bounded(started, 60) == [b"HI"]
    finally:
        await cluster.stop()


# --- map ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_map_yields_replies_in_order_within_its_window(kind: str) -> None:
    cluster = await cluster_with(kind, 4)
    try:
        def work() -> tuple[list[list[bytes]], list[int]]:
            consumed = 0
            atYield: list[int] = []

            def requests() -> Any:
                nonlocal consumed
                for n in range(200):
                    consumed += 1
                    yield f"r{n}" if n % 2 else [f"r{n}".encode()]

            replies = []
            with Client(cluster.endpoint, timeout=10, retries=2) as client:
                for reply in client.map("work", requests(), window=8):
                    atYield.append(consumed)
                    replies.append(reply)
            return replies, atYield

        replies, atYield = await run(work)
        assert [r[1] for r in replies] == [f"r{n}".encode() for n in range(200)]
        assert len({r[0] for r in replies}) == 4  # spread over the workers
        # the window: 8 read before the first reply, one more per reply after
        assert atYield[:5] == [8, 9, 10, 11, 12]
        assert atYield[-1] == 200
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_wide_map_asks_only_the_sockets_that_were_signalled_or_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64 requests in flight are 64 DEALER sockets: a wake-up asks ZeroMQ
    about the ones whose descriptor was signalled or that were used since
    (a handful a reply), not about all 64; and no reply is missed for it."""
    from mdp.transport import pipes as blocking

    cluster = await cluster_with("zmq", 4)
    asked = 0
    # every EVENTS query, in C or through pyzmq (the pipe's class is not
    # patched: compiled, it is an extension type)
    events = blocking._events

    def counting(handle: Any) -> int:
        nonlocal asked
        asked += 1
        return events(handle)

    try:
        def work() -> list[list[bytes]]:
            with Client(cluster.endpoint, timeout=10, retries=2, maxConnections=64) as client:
                list(client.map("work", [b"warm"] * 200, window=64))
                monkeypatch.setattr(blocking, "_events", counting)
                return list(client.map("work", [f"r{n}" for n in range(2000)], window=64))

        replies = await run(work)
        assert [r[1] for r in replies] == [f"r{n}".encode() for n in range(2000)]
        # three a reply (signalled, read, used again); all 64 a wake-up would be 10 or more
        assert 2000 <= asked < 5 * 2000, asked
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_map_raises_the_first_error_or_returns_them() -> None:
    cluster = await cluster_with("zmq", 2, "upper", "tests.handlers_for_tests:upper",
                                 "--unknown-service-expiry", "0.5")
    try:
        await cluster.startWorkers(1, "fail", "tests.handlers_for_tests:fails")

        def work() -> tuple[list[Any], Any, list[Any]]:
            with Client(cluster.endpoint, timeout=5, retries=1) as client:
                got = []
                try:
                    for reply in client.map("fail", [b"a", b"b", b"c"], window=2):
                        got.append(reply)
                except errors.WorkerError as e:
                    raised = e
                mixed = list(client.map("nobody", [b"a", b"b"], window=2, returnExceptions=True))
                after = list(client.map("upper", [b"a", b"b"], window=2))
                try:
                    client.map("upper", [b"a"], window=65)
                except ValueError as e:
                    after.append(e)
            return got, raised, mixed + after

        got, raised, rest = await run(work)
        assert got == [] and isinstance(raised, errors.WorkerError)
        assert [type(e) for e in rest[:2]] == [errors.ServiceUnavailable] * 2
        assert rest[2:4] == [[b"A"], [b"B"]]
        assert "maxConnections" in str(rest[4])
    finally:
        await cluster.stop()


# --- a broker restart ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_no_wrong_reply_across_a_broker_restart(kind: str) -> None:
    """Two blocking clients (one synchronous, one mapping with a window of 8)
    run while the broker is SIGKILLed and restarted on the same endpoint:
    every request is answered, each with its own body."""
    cluster = await cluster_with(kind, 2)
    try:
        def sync() -> list[tuple[bytes, list[bytes]]]:
            with Client(cluster.endpoint, timeout=1.0, retries=60) as client:
                return [(b"s%d" % n, client.request("work", b"s%d" % n)) for n in range(300)]

        def mapped() -> list[tuple[bytes, list[bytes]]]:
            bodies = [b"m%d" % n for n in range(600)]
            with Client(cluster.endpoint, timeout=1.0, retries=60) as client:
                return list(zip(bodies, client.map("work", bodies, window=8)))

        runs = [run(sync, 120), run(mapped, 120)]
        first = cluster.broker
        assert first is not None
        await task.deferLater(reactor(), 0.5)  # mid-run: requests are flowing
        first.signalProcess(signal.SIGKILL)
        await first.ended(30)
        await cluster.startBroker(cluster.endpoint)
        results = await bounded(defer.gatherResults(runs, consumeErrors=True), 150)
        flat = [r for per in results for r in per]
        assert len(flat) == 900
        for body, reply in flat:
            assert reply[1] == body, (body, reply)
        broker = cluster.broker
        await wait_until(lambda: broker.output.count(b"ready for work") >= 2, 30)
    finally:
        await cluster.stop()


# --- no reactor ------------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_the_blocking_client_needs_no_reactor() -> None:
    cluster = await cluster_with("zmq", 1, "upper", "tests.handlers_for_tests:upper")
    try:
        program = (
            "import sys\n"
            "from mdp.blocking import Client\n"
            f"with Client({cluster.endpoint!r}, timeout=5, retries=2) as c:\n"
            "    print(c.request('upper', b'plain'))\n"
            "    print(list(c.map('upper', [b'a', b'b'], window=2)))\n"
            "print('twisted.internet.reactor' in sys.modules)\n"
        )

        done = await run_program(program)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["[b'PLAIN']", "[[b'A'], [b'B']]", "False"]
    finally:
        await cluster.stop()


@pytest.mark.parametrize("timeout", [float("inf"), 1e308, float("nan"), 0])
def test_a_timeout_no_timer_takes_is_refused_at_once(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be"):
        Client("zmq:tcp://127.0.0.1:5555", timeout=timeout)


def test_endpoints_it_cannot_speak_are_refused_at_once() -> None:
    for endpoint in ("ssl:host=127.0.0.1:port=1", "loopback:x", "session+tcp:host=h:port=1"):
        with pytest.raises(TransportError):
            Client(endpoint)
    with pytest.raises(TransportError):
        Client("zmq:nonsense")
    with pytest.raises(ValueError):
        Client("zmq:tcp://127.0.0.1:1", timeout=0)
    # the scheme is checked first, whatever else is wrong
    with pytest.raises(TransportError, match="blocking nodes speak"):
        Worker("loopback:x", "echo", 42)  # type: ignore[arg-type]


def test_close_releases_the_clients_descriptors() -> None:
    """The poller's descriptor goes with the client's close, not whenever
    the client object is collected."""
    before = len(os.listdir("/proc/self/fd"))
    client = Client("zmq:tcp://127.0.0.1:1")
    assert len(os.listdir("/proc/self/fd")) > before  # its poller
    client.close()
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises(errors.ClientClosed):
        client.request("echo", b"x")


def test_a_worker_releases_its_descriptors_when_run_returns() -> None:
    """Its poller and sockets go when :meth:`run` returns (not when the
    object is collected), and a second run makes them again."""
    from mdp.blocking import Worker

    before = len(os.listdir("/proc/self/fd"))
    worker = Worker(f"tcp:host=127.0.0.1:port={free_port()}", "echo", lambda frames: frames)
    for _ in range(2):
        turns = iter(range(3))
        worker.run(until=lambda turns=turns: next(turns, None) is None)
        assert len(os.listdir("/proc/self/fd")) == before


# --- the Spark bridge's choice of client --------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_spark_batches_use_the_blocking_client_when_no_reactor_runs() -> None:
    cluster = await cluster_with("zmq", 2, "upper", "tests.handlers_for_tests:upper")
    try:
        program = (
            "import sys\n"
            "from mdp.spark import ServiceCall, call_many, _local\n"
            f"call = ServiceCall('upper', ({cluster.endpoint!r},), window=4, onError='column')\n"
            "print(call_many(call, [[b'a'], None, [b'b', b'c']] + [[b'x']] * 20)[:3])\n"
            "print(type(_local.clients[call]).__module__)\n"
            "print('twisted.internet.reactor' in sys.modules)\n"
        )

        done = await run_program(program)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "[[b'A'], ValueError('null input'), [b'B', b'C']]", "mdp.blocking", "False"]
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_spark_batches_go_through_a_reactor_already_running() -> None:
    from mdp import spark
    from mdp.errors import MDPSparkError
    from mdp.majordomo.client import Client as TwistedClient

    cluster = await cluster_with("zmq", 1, "upper", "tests.handlers_for_tests:upper")
    call = spark.ServiceCall("upper", (cluster.endpoint,), window=4)
    try:
        assert spark.running_reactor() is None  # this is the reactor's thread
        replies = await run(lambda: spark.call_many(call, [[b"a"], [b"b"]]))
        assert replies == [[b"A"], [b"B"]]
        assert isinstance(spark._clients[call], TwistedClient)
        with pytest.raises(MDPSparkError, match="null input"):
            await run(lambda: spark.call_many(call, [[b"a"], None]))
    finally:
        client = spark._clients.pop(call, None)
        if client is not None:
            await client.close()
        await cluster.stop()


def test_spark_rows_that_finish_at_once_behind_a_full_window_do_not_recurse() -> None:
    """Rows that fail before they are sent (a null input) queued behind a full
    window finish in one loop when a reply frees it: the batch completes,
    however many there are."""
    from twisted.internet import defer

    from mdp import spark

    call = spark.ServiceCall("echo", ("tcp://127.0.0.1:1",), onError="column", window=4)
    pending: list[defer.Deferred] = []

    class Unanswered:
        def request(self, service: str, *frames: bytes) -> defer.Deferred:
            pending.append(defer.Deferred())
            return pending[-1]

    spark._clients[call] = Unanswered()
    try:
        done = spark._call_many(call, [[b"x"]] * 4 + [None] * 5000)
        results: list[Any] = []
        done.addBoth(results.append)
        for d in list(pending):
            d.callback([b"reply"])
        assert len(results) == 1 and len(results[0]) == 5004
        assert results[0][:4] == [[b"reply"]] * 4
        assert all(isinstance(r, ValueError) for r in results[0][4:])
    finally:
        spark._clients.pop(call, None)


def slow_echo(peer: bytes, body: list[bytes]) -> list[Any]:
    """A worker that takes 0.2 s a request (in the scripted broker's thread)."""
    import time

    time.sleep(0.2)
    return [(peer, b"\x03", body)]


@pytest_twisted.ensureDeferred
async def test_spark_batches_through_a_reactor_keep_the_window_and_the_error_policy() -> None:
    """Through a running reactor as without one: at most ``window`` requests
    in flight (one waiting for a connection would spend its attempts: eight
    rows of 0.2 s through a window of 1 with a 1 s timeout all succeed); a
    row over the limits is an error of its row (``onError`` decides); with
    ``onError="fail"`` nothing more is sent after the first failure."""
    from mdp import spark
    from mdp.errors import MDPSparkError, RequestTooLarge
    from mdp.policy import DEFAULT_MAX_FRAMES
    from tests.conftest import ScriptedBroker

    broker = ScriptedBroker(slow_echo)
    calls = [spark.ServiceCall("echo", (broker.endpoint,), timeout=1.0, retries=1, window=1,
                               onError=onError) for onError in ("column", "fail")]
    try:
        rows = [[b"%d" % n] for n in range(8)]
        assert await run(lambda: spark.call_many(calls[0], rows)) == rows
        huge = [b"x"] * (DEFAULT_MAX_FRAMES + 1)
        got = await run(lambda: spark.call_many(calls[0], [[b"a"], huge, [b"b"]]))
        assert got[0] == [b"a"] and isinstance(got[1], RequestTooLarge) and got[2] == [b"b"]
        with pytest.raises(MDPSparkError, match="null input"):
            await run(lambda: spark.call_many(calls[1], [[b"a"], None, [b"c"], [b"d"]]))
        assert await run(lambda: spark.call_many(calls[1], [[b"then"]])) == [[b"then"]]
        assert [b"c"] not in broker.seen and [b"d"] not in broker.seen
        assert broker.seen[-1] == [b"then"]
    finally:
        for call in calls:
            client = spark._clients.pop(call, None)
            if client is not None:
                await client.close()
        await run(broker.stop)


@pytest_twisted.ensureDeferred
async def test_spark_batches_without_a_reactor_honour_the_error_policy_for_oversized_rows(
        ) -> None:
    from mdp import spark
    from mdp.errors import RequestTooLarge
    from mdp.policy import DEFAULT_MAX_FRAMES
    from tests.conftest import ScriptedBroker

    broker = ScriptedBroker(lambda peer, body: [(peer, b"\x03", body)])
    call = spark.ServiceCall("echo", (broker.endpoint,), timeout=2.0, retries=1, window=2,
                             onError="null")

    def batch() -> list[Any]:
        try:
            return spark._call_many_blocking(
                call, [[b"a"], [b"x"] * (DEFAULT_MAX_FRAMES + 1), [b"b"]])
        finally:
            spark._local.clients.pop(call).close()

    try:
        got = await run(batch)
        assert got[0] == [b"a"] and isinstance(got[1], RequestTooLarge) and got[2] == [b"b"]
    finally:
        await run(broker.stop)


# --- the blocking worker ---------------------------------------------------------------------

def streams(frames: list[bytes]) -> Any:
    """A generator handler: int(frames[0]) PARTIALs, then a FINAL."""
    from mdp import Final

    for n in range(int(frames[0])):
        yield str(n)
    yield Final(b"end")


def raises(frames: list[bytes]) -> Any:
    raise RuntimeError("no such thing")


def serve(endpoint: str, service: str, handler: Any) -> tuple[Any, defer.Deferred, Any]:
    """A blocking worker running in a thread of the reactor's pool until the
    returned event is set."""
    import threading

    from mdp.blocking import Worker
    from mdp.policy import Backoff, HeartbeatPolicy

    done = threading.Event()
    worker = Worker(endpoint, service, handler, heartbeat=HeartbeatPolicy(0.25, 4),
                    backoff=Backoff(0.1, 1.0))
    return worker, threads.deferToThread(worker.run, done.is_set), done


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_blocking_worker_serves_replies_errors_and_streams(kind: str) -> None:
    cluster = Cluster()
    running = []
    try:
        await cluster.startBroker(BINDS[kind])
        broker = cluster.broker
        for service, handler in (("upper", lambda f: [x.upper() for x in f]),
                                 ("fail", raises), ("burst", streams)):
            running.append(serve(cluster.endpoint, service, handler))
        await wait_until(lambda: broker.output.count(b"ready for") >= 3, 30)
        client = cluster.client(timeout=5, retries=1)
        assert await bounded(client.request("upper", b"a", b"b"), 10) == [b"A", b"B"]
        with pytest.raises(errors.WorkerError, match="RuntimeError: no such thing"):
            await bounded(client.request("fail", b"x"), 10)
        parts: list[list[bytes]] = []
        final = await bounded(client.request("burst", b"20", onPartial=parts.append), 10)
        assert parts == [[str(n).encode()] for n in range(20)] and final == [b"end"]
        assert running[0][0].requestsServed == 1
        # stopping says DISCONNECT: the broker forgets the worker at once
        for _, finished, stop in running:
            stop.set()
            await bounded(finished, 10)
        await wait_until(lambda: broker.output.count(b"disconnected") >= 3, 10)
    finally:
        for *_, stop in running:
            stop.set()
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_blocking_worker_registers_again_with_a_restarted_broker() -> None:
    cluster = Cluster()
    running = None
    try:
        await cluster.startBroker(BINDS["zmq"])
        running = serve(cluster.endpoint, "upper", lambda f: [x.upper() for x in f])
        first = cluster.broker
        await wait_until(lambda: first.output.count(b"ready for upper") >= 1, 30)
        first.signalProcess(signal.SIGKILL)
        await first.ended(30)
        await cluster.startBroker(cluster.endpoint)
        second = cluster.broker
        # the worker finds the broker silent (0.25 s x 4), reconnects, READY again
        await wait_until(lambda: second.output.count(b"ready for upper") >= 1, 30)
        client = cluster.client(timeout=5, retries=2)
        assert await bounded(client.request("upper", b"back"), 15) == [b"BACK"]
    finally:
        if running is not None:
            running[2].set()
            await bounded(running[1], 10)
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_whole_blocking_stack_needs_no_reactor() -> None:
    cluster = Cluster()
    try:
        await cluster.startBroker(BINDS["zmq"])
        program = (
            "import sys, threading\n"
            "from mdp.blocking import Client, Worker\n"
            "done = threading.Event()\n"
            f"worker = Worker({cluster.endpoint!r}, 'upper', lambda f: [x.upper() for x in f])\n"
            "thread = threading.Thread(target=worker.run, args=(done.is_set,))\n"
            "thread.start()\n"
            f"with Client({cluster.endpoint!r}, timeout=5, retries=3) as c:\n"
            "    print(list(c.map('upper', [b'a', b'b', b'c'], window=3)))\n"
            "done.set(); thread.join(10)\n"
            "print(thread.is_alive(), 'twisted.internet.reactor' in sys.modules)\n"
        )

        done = await run_program(program)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["[[b'A'], [b'B'], [b'C']]", "False False"]
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_client_does_not_cross_a_fork() -> None:
    cluster = await cluster_with("zmq", 1, "upper", "tests.handlers_for_tests:upper")
    try:
        program = (
            "import os\n"
            "from mdp.blocking import Client\n"
            "from mdp.errors import ClientClosed\n"
            f"c = Client({cluster.endpoint!r}, timeout=5, retries=2)\n"
            "print(c.request('upper', b'before'), flush=True)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    try:\n"
            "        c.request('upper', b'child')\n"
            "    except ClientClosed as e:\n"
            "        print('child:', c.forked, e, flush=True)\n"
            "    c.close()  # leaves the parent's sockets alone\n"
            "    with Client(c.endpoints, timeout=5, retries=2) as fresh:\n"
            "        print('child:', fresh.request('upper', b'fresh'), flush=True)\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print(c.forked, c.request('upper', b'after'))\n"
        )

        done = await run_program(program)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "[b'BEFORE']" and lines[-1] == "False [b'AFTER']"
        assert lines[1].startswith("child: True") and lines[2] == "child: [b'FRESH']"
    finally:
        await cluster.stop()
