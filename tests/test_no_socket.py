"""When no socket can be had (a process out of descriptors), a node says so
and tries again later, as it does when a broker cannot be reached: it never
stops for good, nor waits forever on a pipe that nobody reopens."""

from __future__ import annotations

import errno
import threading
from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import task
from twisted.logger import formatEvent

from mdp import HeartbeatPolicy, Worker, errors
from mdp.blocking import Client
from mdp.blocking import Worker as BlockingWorker
from mdp.majordomo import codec
from mdp.policy import Backoff, Limits
from mdp.transport.zeromq import ZmqDealer
from tests.conftest import (
    LoopbackNet,
    ScriptedBroker,
    ScriptReply,
    failures_logged,
    raw_router,
    refuse_connections,
    warnings_logged,
)

FINAL = b"\x03"


def out_of_descriptors() -> zmq.ZMQError:
    return zmq.ZMQError(errno.EMFILE)


class FlakyContext:
    """A ZeroMQ context whose next *failing* sockets cannot be had."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.failing = 0
        self.refused = 0

    def socket(self, kind: int) -> zmq.Socket:
        if self.failing:
            self.failing -= 1
            self.refused += 1
            raise out_of_descriptors()
        return self.context.socket(kind)

    def term(self) -> None:
        self.context.term()


class Events:
    """An IDealerReceiver that writes down what it is told."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def connectionMade(self) -> None:
        self.told.append("made")

    def connectionLost(self, reason: Any) -> None:
        self.told.append(type(reason.value))

    def messageReceived(self, frames: list[bytes]) -> None:
        self.told.append(frames)


def logged(events: list[dict], text: str) -> list[str]:
    return [line for line in map(formatEvent, events) if text in line]


def test_a_zmq_dealer_without_a_fresh_socket_tries_again(monkeypatch: Any) -> None:
    """The Twisted dealer drops its socket for a message over the limits; if
    no fresh one can be had it says so, tells its receiver the pipe is lost,
    and tries again after its retry policy's delay (it used to raise out of a
    timer, its receiver never told, the pipe dead for good)."""
    import mdp.transport

    clock = task.Clock()
    receiver = Events()
    dealer = mdp.transport.connect("zmq:inproc://no-socket-dealer", receiver, clock,
                                   retryPolicy=lambda attempt: 1.5 * attempt)
    try:
        clock.advance(0)
        assert receiver.told == ["made"]
        opened = ZmqDealer._open
        failing = [1, 1]

        def flaky(self: ZmqDealer) -> None:
            if failing:
                failing.pop()
                raise out_of_descriptors()
            opened(self)

        monkeypatch.setattr(ZmqDealer, "_open", flaky)
        with warnings_logged() as events:
            dealer.oversized(None, 2, 10**9)
            clock.advance(0)
            assert receiver.told == ["made", errors.OversizedMessage]
            assert dealer.connection is None
            assert logged(events, "cannot open a socket") and logged(events, "again in 1.5s")
            clock.advance(1.5)  # fails again: the policy's second delay
            assert dealer.connection is None
            assert logged(events, "again in 3s")
        clock.advance(2.99)
        assert receiver.told[-1] is errors.OversizedMessage
        clock.advance(0.01)  # a socket at last, and the pipe up once more
        clock.advance(0)
        assert receiver.told == ["made", errors.OversizedMessage, "made"]
        assert dealer.connection is not None
    finally:
        dealer.close()


def test_closing_a_dealer_that_waits_for_a_socket_ends_its_retries(monkeypatch: Any) -> None:
    clock = task.Clock()
    receiver = Events()
    dealer = ZmqDealer("zmq:inproc://no-socket-close", receiver, clock)
    clock.advance(0)

    def never(self: ZmqDealer) -> None:
        raise out_of_descriptors()

    monkeypatch.setattr(ZmqDealer, "_open", never)
    with warnings_logged() as events:
        dealer.oversized(None, 2, 10**9)
        clock.advance(0)
        # mdp.policy.RECONNECT, by default: 0.5 s, up to a quarter less
        (retry,) = [e for e in events if "delay" in e]
        assert 0.375 <= retry["delay"] <= 0.5
        assert clock.getDelayedCalls()  # the next try
        dealer.close()
    assert not clock.getDelayedCalls()


@pytest_twisted.ensureDeferred
async def test_a_worker_that_cannot_open_its_pipe_says_so_and_tries_again(
        clocknet: LoopbackNet, monkeypatch: Any) -> None:
    """The transport raises when the worker opens its pipe: logged with the
    endpoint, and the worker connects once the broker's silence runs out
    (it used to raise out of the reconnection timer, or out of start())."""
    import mdp.transport

    router = await raw_router(clocknet)
    refused = refuse_connections(monkeypatch, mdp.transport)
    worker = Worker(router.transport.endpoint, "svc", lambda f: f, clocknet.reactor,
                    heartbeat=HeartbeatPolicy(interval=1.0, liveness=3),
                    backoff=Backoff(initial=1, maximum=2), extensions=False)
    with failures_logged() as events:
        worker.start()
        clocknet.addCleanup(worker.stop)
        clocknet.advance(0)
    assert refused == [router.transport.endpoint]
    assert logged(events, f"cannot connect to {router.transport.endpoint!r}")
    assert not router.received
    clocknet.advance(5)  # silence (3 s, seen at a tick), then the backoff (1 s)
    assert [frames for _, _, frames in router.received] == [
        [codec.WORKER_HEADER, codec.W_READY, b"svc"]]


# --- the blocking nodes -------------------------------------------------------------------

def huge(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    return [(peer, FINAL, [b"x" * (2 << 20)] if body == [b"huge"] else body)]


@pytest.fixture
def broker() -> Any:
    running = ScriptedBroker(huge)
    try:
        yield running
    finally:
        running.stop()


def test_a_blocking_client_pipe_without_a_fresh_socket_tries_again(broker: ScriptedBroker) -> None:
    """The blocking client drops the socket that carried a reply over its
    limits; if no fresh one can be had, the connection tries again after
    0.5 s, and the next request on it goes out then, on its first attempt
    (it used to stay down: that request timed out once)."""
    context = FlakyContext()
    try:
        with warnings_logged() as events, Client(
                broker.endpoint, timeout=5, retries=1, maxConnections=1,
                limits=Limits(maxMessageBytes=1 << 20), context=context) as client:
            assert client.request("s", b"warm") == [b"warm"]
            context.failing = 1
            with pytest.raises(errors.ReplyTooLarge):
                client.request("s", b"huge")
            assert context.refused == 1
            assert logged(events, "cannot open a socket")
            assert client.request("s", b"after") == [b"after"]
            assert not client._loop.timed
    finally:
        context.term()


def test_closing_a_blocking_client_whose_pipe_waits_for_a_socket(broker: ScriptedBroker) -> None:
    """Closed while its pipe waits to try again: nothing is tried later."""
    context = FlakyContext()
    client = Client(broker.endpoint, timeout=5, retries=1, maxConnections=1,
                    limits=Limits(maxMessageBytes=1 << 20), context=context)
    try:
        with warnings_logged():
            assert client.request("s", b"warm") == [b"warm"]
            (channel,) = client.machine._channels
            pipe = channel.pipe
            context.failing = 1
            with pytest.raises(errors.ReplyTooLarge):
                client.request("s", b"huge")
            assert pipe.socket is None and pipe.retryAt is not None
            assert client._loop.timed == {pipe}
            client.close()
        assert not client._loop.timed and pipe.retryAt is None
        pipe.wake(pipe.retryAt or 1e18)  # a late wake-up opens nothing
        assert pipe.socket is None
    finally:
        client.close()
        context.term()


def test_a_blocking_worker_that_cannot_open_its_pipe_says_so_and_tries_again() -> None:
    """No socket for the worker's first connection: logged, and the worker
    registers once the broker's silence runs out (``run`` used to raise)."""
    context = FlakyContext()
    router = context.context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"zmq:tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    context.failing = 1
    worker = BlockingWorker(endpoint, "svc", lambda f: f, heartbeat=HeartbeatPolicy(0.1, 3),
                            backoff=Backoff(0.05, 0.1), context=context, extensions=False)
    done = threading.Event()
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(done.is_set)
        except BaseException as e:
            crashed.append(e)

    with failures_logged() as events:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            assert router.poll(10_000), crashed
            assert router.recv_multipart()[-3:] == [codec.WORKER_HEADER, codec.W_READY, b"svc"]
        finally:
            done.set()
            thread.join(10)
            router.close()
            context.term()
    assert not thread.is_alive() and not crashed
    assert context.refused == 1
    assert logged(events, f"cannot connect to {endpoint!r}")


# --- Freelance --------------------------------------------------------------------------

@pytest.mark.parametrize("model", [1, 2])
@pytest_twisted.ensureDeferred
async def test_a_freelance_client_without_a_socket_moves_on_and_tries_again(
        clocknet: LoopbackNet, monkeypatch: Any, model: int) -> None:
    """The first connection to server "a" cannot be opened: logged, and the
    request still gets its reply (model 1 from "b" once the attempt at "a"
    ends; model 2 from either, "a" being opened again at the next send).
    It used to raise out of ``request()`` (model 1: and out of the attempt's
    timer, the request never ending) or out of the constructor (model 2)."""
    import mdp.transport
    from mdp.freelance import freelance_client
    from tests.test_freelance import start_server

    servers = [await start_server(clocknet, name) for name in ("a", "b")]
    refused = refuse_connections(monkeypatch, mdp.transport, times=2,
                                 to=lambda endpoint: endpoint == servers[0].endpoint)
    with warnings_logged() as events:
        client = freelance_client([s.endpoint for s in servers], model, clocknet.reactor,
                                  timeout=1.0)
        clocknet.addCleanup(client.close)
        reply = client.request(b"req")
        clocknet.advance(0)
    # opened, and again at the send: the attempt at "a" goes unanswered
    assert refused == [servers[0].endpoint] * 2
    assert logged(events, f"cannot connect to {servers[0].endpoint!r}")
    if model == 1:
        assert not reply.called
        clocknet.advance(1.0)
    assert await clocknet.wait(reply) == [b"b", b"req"]
    if model == 2:  # "a" is opened at the next send, and answers too
        assert (await clocknet.wait(client.request(b"again")))[1:] == [b"again"]
        clocknet.advance(0)
        assert servers[0].served == 1
