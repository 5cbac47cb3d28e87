"""A blocking worker with ``concurrency`` N: N sessions, the handler in N
threads, the connections and heartbeats in the thread that runs it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import task, threads

from mdp import Broker, Client, errors
from mdp.blocking import Worker
from mdp.policy import Backoff, HeartbeatPolicy
from tests.procs import bounded, reactor, wait_until

BINDS = {"zmq": "zmq:tcp://127.0.0.1:*", "tcp": "tcp:host=127.0.0.1:port=0"}
HB = HeartbeatPolicy(interval=0.1, liveness=3)


class Gate:
    """A handler that holds each request until the test opens the gate, and
    counts how many it holds at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened = threading.Event()
        self.inside = 0
        self.most = 0
        self.seen = 0

    def __call__(self, frames: list[bytes]) -> Any:
        with self.lock:
            self.inside += 1
            self.seen += 1
            self.most = max(self.most, self.inside)
        try:
            if not self.opened.wait(30):
                raise RuntimeError("the gate stayed shut")
            if frames == [b"fail"]:
                raise ValueError("asked to fail")
            if frames == [b"stream"]:
                return (str(n).encode() for n in range(50))
            return [b"ok"] + frames
        finally:
            with self.lock:
                self.inside -= 1


async def running(kind: str, handler: Any, concurrency: int) -> tuple[Any, Any, Client, Any]:
    broker = Broker(reactor(), heartbeat=HB)
    bound = await broker.listen(BINDS[kind])
    worker = Worker(bound.endpoint, "gated", handler, heartbeat=HB, backoff=Backoff(0.1, 1.0),
                    concurrency=concurrency)
    done = threads.deferToThread(worker.run)
    client = Client(bound.endpoint, reactor(), timeout=20, retries=1)
    await wait_until(lambda: len(broker.workers) == concurrency, 20)
    return broker, worker, client, done


async def stopped(broker: Any, worker: Any, client: Client, done: Any) -> None:
    worker.stop()
    await bounded(done, 20)
    await client.close()
    await broker.close()


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_n_handlers_at_once_and_never_more(kind: str) -> None:
    gate = Gate()
    broker, worker, client, done = await running(kind, gate, 3)
    try:
        replies = [client.request("gated", str(n)) for n in range(7)]
        failing = client.request("gated", "fail")
        streamed: list[list[bytes]] = []
        stream = client.request("gated", "stream", onPartial=streamed.append)
        await wait_until(lambda: gate.inside == 3, 20)
        await task.deferLater(reactor(), 0.3)  # over the heartbeat expiry: still one broker
        assert gate.inside == 3 and worker.busy == 3 and len(broker.workers) == 3
        gate.opened.set()
        assert [await bounded(d, 20) for d in replies] == [[b"ok", str(n).encode()]
                                                          for n in range(7)]
        with pytest.raises(errors.WorkerError, match="ValueError: asked to fail"):
            await bounded(failing, 20)
        assert await bounded(stream, 20) == [b""]
        assert streamed == [[str(n).encode()] for n in range(50)]
        assert gate.most == 3 and gate.seen == 9
        assert sum(s.requestsServed for s in worker.sessions) == 8
    finally:
        gate.opened.set()
        await stopped(broker, worker, client, done)


@pytest_twisted.ensureDeferred
async def test_stop_answers_the_requests_in_hand_first() -> None:
    gate = Gate()
    broker, worker, client, done = await running("tcp", gate, 2)
    try:
        replies = [client.request("gated", str(n)) for n in range(2)]
        await wait_until(lambda: gate.inside == 2, 20)
        worker.stop()
        await task.deferLater(reactor(), 0.2)
        assert not done.called
        gate.opened.set()
        assert [await bounded(d, 20) for d in replies] == [[b"ok", b"0"], [b"ok", b"1"]]
        await bounded(done, 20)
        await wait_until(lambda: not broker.workers, 20)
    finally:
        gate.opened.set()
        await stopped(broker, worker, client, done)


def test_concurrency_is_checked_at_once() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Worker("tcp:host=127.0.0.1:port=1", "svc", lambda f: f, concurrency=0)
    with pytest.raises(TypeError, match="concurrency"):
        Worker("tcp:host=127.0.0.1:port=1", "svc", lambda f: f, concurrency=2.0)
    assert Worker("tcp:host=127.0.0.1:port=1", "svc", lambda f: f, concurrency=4).concurrency == 4



@pytest.mark.parametrize("kind", sorted(BINDS))
def test_sessions_all_reconnecting_at_once_keep_running(kind: str) -> None:
    """No broker: every session waits to connect again at the same time, and
    the worker keeps trying until told to stop."""
    from time import monotonic

    endpoint = ("zmq:tcp://127.0.0.1:1" if kind == "zmq" else "tcp:host=127.0.0.1:port=1")
    worker = Worker(endpoint, "svc", lambda f: f, heartbeat=HB, backoff=Backoff(0.05, 0.1),
                    concurrency=3)
    ends = monotonic() + 1.0
    worker.run(until=lambda: monotonic() > ends)
    assert not any(s.registered for s in worker.sessions)


@pytest_twisted.ensureDeferred
async def test_a_handler_that_exits_is_answered_and_ends_run() -> None:
    def exits(frames: list[bytes]) -> Any:
        raise SystemExit(3)

    broker, worker, client, done = await running("tcp", exits, 2)
    try:
        with pytest.raises(errors.WorkerError, match="SystemExit"):
            await bounded(client.request("gated", "x"), 20)
        with pytest.raises(SystemExit):
            await bounded(done, 20)
    finally:
        await client.close()
        await broker.close()


def test_closing_after_an_interrupted_release_lets_every_handler_go() -> None:
    # Ctrl-C in the middle of release() leaves settled acks among the paced ones;
    # close() must still settle the rest, or their handler threads wait forever
    from concurrent.futures import Future

    from mdp.handlerthreads import HandlerThreads

    class Loop:
        pipes: dict = {}

        def watch(self, fd: int, flags: int) -> None:
            pass

        def forget(self, fd: int) -> None:
            self.pipes.pop(fd, None)

    threads = HandlerThreads(Loop(), 1)
    settled: Future[bool] = Future()
    waiting: Future[bool] = Future()
    settled.set_result(True)
    threads.paced = [(None, None, settled), (None, None, waiting)]
    threads.close()
    assert waiting.result(timeout=5) is False


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_a_handler_in_a_thread_sees_its_deadline_and_its_cancellation(kind: str) -> None:
    """A blocking handler polls ``mdp.cancelled()``: the Twisted client's cancel reaches it
    through the broker, and it stops; it saw its deadline."""
    import mdp

    seen: list[Any] = []
    started = threading.Event()

    def poll(frames: list[bytes]) -> Any:
        if frames == [b"quick"]:
            return [b"quick"]
        seen.append(mdp.current_deadline())
        started.set()
        for _ in range(3000):  # (at most 30 s)
            if mdp.cancelled():
                seen.append("cancelled")
                return [b"stopped"]
            threading.Event().wait(0.01)
        return [b"never cancelled"]

    broker, worker, client, done = await running(kind, poll, 2)
    try:
        await client.request("gated", "quick")
        await wait_until(lambda: client.machine.extended is not None, 20)
        d = client.request("gated", "work")
        await wait_until(started.is_set, 20)
        d.cancel()
        await wait_until(lambda: "cancelled" in seen, 20)
        assert 19 < seen[0] <= 20  # the client's timeout, as the time left
        assert await client.request("gated", "quick") == [b"quick"]  # its session is free again
    finally:
        await stopped(broker, worker, client, done)
