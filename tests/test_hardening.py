"""Wrong results under hostile input and hard failures: one regression test per
fix (a reply only ever completes the request it answers, cancelling is cheap and
never raises, timeouts count queue time, restarted streams are announced,
everything queued expires, what the reply store does and does not cover)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp import (
    ClientClosed,
    Final,
    RequestTimeout,
    ServiceUnavailable,
    StreamRestarted,
    transport,
)
from mdp.majordomo import codec
from mdp.majordomo.idempotence import MemoryReplyStore
from tests.conftest import LoopbackNet, Net, RawPeer, RawRouter, raw_router
from tests.test_client import broker_and_client, final, requests
from tests.test_mdp_behaviour import FAST, make_client, start_broker, start_worker

W = codec.WORKER_HEADER


async def nth_request(worker: RawPeer, n: int) -> list[bytes]:
    """The *n*-th REQUEST (from 0) a scripted worker receives (heartbeats aside)."""

    def seen() -> list[list[bytes]]:
        return [m for m in worker.received if m[1] == codec.W_REQUEST]

    await worker.net.until(lambda: len(seen()) > n)
    return seen()[n]


async def rebind(net: Net, endpoint: str) -> RawRouter:
    """A scripted broker bound again where an earlier one was."""
    router = RawRouter()
    router.clock = net.reactor
    router.transport = await net.wait(transport.listen(endpoint, router, net.reactor))
    net.addCleanup(router.transport.close)
    return router


# --- 1. a reply completes only the request it answers -------------------------------

@pytest.mark.parametrize("net", ["loopback", "tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_request_issued_while_the_broker_is_down_goes_out_once(net: Net) -> None:
    """The request waits for the broker and is sent once when it is back, so no
    second FINAL can complete the next request on the same connection."""
    # ZeroMQ reports no disconnects, so the client never resends by itself there;
    # a request lost with a dead pipe is retried after its timeout
    router = await raw_router(net)
    endpoint = router.transport.endpoint
    client = make_client(net, endpoint, maxConnections=1, timeout=60, retries=1,
                         extensions=False)
    first = client.request("svc", b"one")
    await net.until(lambda: len(requests(router)) == 1)
    final(router, requests(router)[0][1], b"svc", b"re:one")
    assert await net.wait(first) == [b"re:one"]

    await net.wait(router.transport.close())  # the broker goes down
    (channel,) = client.machine._channels
    await net.until(lambda: not channel.up)
    second = client.request("svc", b"two")  # issued while it is down
    router = await rebind(net, endpoint)
    await net.until(lambda: len(requests(router)) == 1, timeout=30)
    (_, peer, _), = requests(router)
    final(router, peer, b"svc", b"re:two")
    assert await net.wait(second) == [b"re:two"]
    third = client.request("svc", b"three")
    await net.until(lambda: len(requests(router)) == 2)
    assert [f[-1] for _, _, f in requests(router)] == [b"two", b"three"]  # "two" once
    final(router, requests(router)[1][1], b"svc", b"re:three")
    assert await net.wait(third) == [b"re:three"]


@pytest.mark.parametrize("net", ["loopback", "tcp"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_request_in_flight_when_the_connection_breaks_is_sent_again_once(net: Net) -> None:
    router = await raw_router(net)
    endpoint = router.transport.endpoint
    client = make_client(net, endpoint, timeout=60, retries=1, extensions=False)
    reply = client.request("svc", b"lost")
    await net.until(lambda: len(requests(router)) == 1)
    await net.wait(router.transport.close())
    router = await rebind(net, endpoint)
    await net.until(lambda: len(requests(router)) == 1, timeout=30)
    final(router, requests(router)[0][1], b"svc", b"found")
    assert await net.wait(reply) == [b"found"]
    assert len(requests(router)) == 1


@pytest_twisted.ensureDeferred
async def test_unexpected_reply_is_discarded_and_its_connection_replaced(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=5)
    d = client.request("svc", b"a")
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    final(router, peer, b"svc", b"re:a")
    assert await clocknet.wait(d) == [b"re:a"]
    final(router, peer, b"svc", b"stray")  # nothing is in flight on that connection
    clocknet.advance(0)
    assert client.machine._channels == set()
    later = client.request("svc", b"b")
    clocknet.advance(0)
    (_, newPeer, _) = requests(router)[-1]
    assert newPeer != peer
    final(router, peer, b"svc", b"stray again")  # the old connection is gone
    clocknet.advance(0)
    assert not later.called
    final(router, newPeer, b"svc", b"re:b")
    assert await clocknet.wait(later) == [b"re:b"]


# --- 2. one FINAL per assigned request ---------------------------------------------

@pytest_twisted.ensureDeferred
async def test_second_final_from_a_worker_never_reaches_the_next_request(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    worker = RawPeer(net, endpoint)
    worker.send(W, codec.W_READY, b"svc")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, maxConnections=1, timeout=60, retries=1)
    a = client.request("svc", b"a")
    b = client.request("svc", b"b")  # same client connection, right after a
    requestA = await nth_request(worker, 0)
    envelopeA = requestA[2]
    worker.send(W, codec.W_FINAL, envelopeA, b"", b"reply-a")
    assert await net.wait(a) == [b"reply-a"]
    requestB = await nth_request(worker, 1)
    assert requestB[-1] == b"b"
    assert requestB[2] != envelopeA  # every assignment has its own envelope
    worker.send(W, codec.W_FINAL, envelopeA, b"", b"reply-a again")  # the worker's bug
    worker.send(W, codec.W_FINAL, requestB[2], b"", b"reply-b")
    assert await net.wait(b) == [b"reply-b"]
    assert len(broker.workers) == 1  # dropped with a warning, worker kept
    assert all(m[1] != codec.W_DISCONNECT for m in worker.received)


# --- 3. cancelling -----------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_cancel_takes_a_request_out_of_the_queue_and_reuses_the_connection(
        clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=5, maxConnections=1)
    inFlight = client.request("svc", b"1")
    waiting = client.request("svc", b"2")
    clocknet.advance(0)
    waiting.cancel()
    inFlight.cancel()
    for d in (inFlight, waiting):
        with pytest.raises(defer.CancelledError):
            await clocknet.wait(d)
    (_, peer, _), = requests(router)  # "2" never went out
    # nobody waits: "1"'s connection is kept for its reply, then serves again
    final(router, peer, b"svc", b"late reply to 1")  # discarded; the connection is free
    clocknet.advance(0)
    again = client.request("svc", b"3")
    clocknet.advance(0)
    assert [(p, f[-1]) for _, p, f in requests(router)] == [(peer, b"1"), (peer, b"3")]
    final(router, peer, b"svc", b"re:3")
    assert await clocknet.wait(again) == [b"re:3"]
    # "4" cancelled in flight; "5" would wait for its connection with its
    # clock running: that connection goes, a new one carries "5"
    abandoned = client.request("svc", b"4")
    clocknet.advance(0)
    abandoned.cancel()
    with pytest.raises(defer.CancelledError):
        await clocknet.wait(abandoned)
    later = client.request("svc", b"5")
    clocknet.advance(0)
    sent = requests(router)
    assert [f[-1] for _, _, f in sent] == [b"1", b"3", b"4", b"5"]
    assert sent[2][1] == peer and sent[3][1] != peer
    final(router, peer, b"svc", b"late reply to 4")  # its connection is gone: nobody has it
    final(router, sent[3][1], b"svc", b"re:5")
    assert await clocknet.wait(later) == [b"re:5"]


@pytest_twisted.ensureDeferred
async def test_abandoned_request_without_a_reply_frees_its_connection_at_its_deadline(
        clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=2, maxConnections=2)
    d = client.request("svc", b"1")
    clocknet.advance(0)
    d.cancel()
    clocknet.advance(1.9)
    assert len(client.machine._channels) == 1  # kept for its reply
    clocknet.advance(0.2)  # the abandoned one's deadline: its connection goes
    assert len(client.machine._channels) == 0
    later = client.request("svc", b"2", timeout=10)
    clocknet.advance(0)
    first, second = requests(router)
    assert first[1] != second[1]
    final(router, second[1], b"svc", b"re:2")
    assert await clocknet.wait(later) == [b"re:2"]


@pytest.mark.parametrize("net", ["zmq"], indirect=True)
@pytest_twisted.ensureDeferred
async def test_cancelling_ten_thousand_zmq_requests(net: Net) -> None:
    """Cancelling never raises, every Deferred fires, and no socket is opened
    for it (this used to open one per cancel, up to "Too many open files")."""
    router = await raw_router(net)
    client = make_client(net, router.transport.endpoint, timeout=60, retries=1, extensions=False)
    ds = [client.request("svc", str(n)) for n in range(10_000)]
    await net.until(lambda: len(requests(router)) == 64)
    outcomes: list[Any] = []
    for d in ds:
        d.addErrback(lambda f: outcomes.append(f.type))
        d.cancel()
    assert outcomes == [defer.CancelledError] * 10_000
    assert len(client.machine._channels) == 64
    peers = [p for _, p, _ in requests(router)]
    for peer in peers:  # the abandoned requests' replies arrive and are discarded
        final(router, peer, b"svc", b"late")
    await net.until(lambda: len(client.machine._idle) == 64)
    after = client.request("svc", b"after")
    await net.until(lambda: len(requests(router)) == 65)
    (_, peer, frames) = requests(router)[-1]
    assert frames[-1] == b"after" and peer in peers  # a freed connection, not a new one
    final(router, peer, b"svc", b"re:after")
    assert await net.wait(after) == [b"re:after"]


@pytest_twisted.ensureDeferred
async def test_request_cancelled_before_it_went_out_frees_its_connection_at_once(
        clocknet: LoopbackNet) -> None:
    endpoint = clocknet.bindEndpoint()  # nothing listens yet: the pipe is not up
    client = make_client(clocknet, endpoint, maxConnections=1, timeout=60, retries=1,
                         extensions=False)
    never = client.request("svc", b"cancelled")
    clocknet.advance(0)
    never.cancel()
    later = client.request("svc", b"after", timeout=5)
    router = await rebind(clocknet, endpoint)
    clocknet.advance(0.1)
    assert [f[-1] for _, _, f in requests(router)] == [b"after"]  # not held for 60 s
    final(router, requests(router)[0][1], b"svc", b"re:after")
    assert await clocknet.wait(later) == [b"re:after"]
    with pytest.raises(defer.CancelledError):
        await clocknet.wait(never)


def answer_each(clocknet: LoopbackNet, router: Any, client: Any, count: int) -> Iterator[None]:
    """Send *count* requests one after the other, answering each; yields
    after each answer."""
    for n in range(count):
        d = client.request("svc", b"x" * 1000, str(n))
        clocknet.reactor.advance(0)
        final(router, requests(router)[-1][1], b"svc", b"ok")
        clocknet.reactor.advance(0)
        assert d.called
        yield


@pytest_twisted.ensureDeferred
async def test_finished_requests_are_not_kept_until_their_deadline(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=600)
    for _ in answer_each(clocknet, router, client, 3000):
        # answered in the order asked: nothing of it is kept (its reply
        # would live as long as the entry, and the garbage collector would
        # walk it in every full pass)
        assert client.machine._deadlines == []


@pytest_twisted.ensureDeferred
async def test_finished_requests_behind_a_slow_one_are_not_kept_either(
        clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=600, maxConnections=2)
    slow = client.request("svc", b"slow")
    clocknet.reactor.advance(0)
    for _ in answer_each(clocknet, router, client, 3000):
        pass
    assert not slow.called  # its entry heads the heap: the ones after it wait for a sweep
    assert len(client.machine._deadlines) <= 1024 + 2 * len(client.machine._channels) + 1
    # what an entry still refers to is a finished call without its request
    head = client.machine._deadlines[0][2]
    assert not head.done
    assert all(call.done and call.message is None for _, _, call in client.machine._deadlines[1:])
    final(router, requests(router)[0][1], b"svc", b"slow done")
    clocknet.reactor.advance(0)
    assert slow.called and client.machine._deadlines == []  # the rest go with it


@pytest_twisted.ensureDeferred
async def test_close_from_a_callback_during_a_retry_opens_nothing(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=3)
    d = client.request("svc", b"x", onPartial=lambda p: None, onRestart=lambda: client.close())
    clocknet.advance(0)
    router.send(requests(router)[0][1], codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"p")
    clocknet.advance(1.0)  # the retry calls onRestart, which closes the client
    with pytest.raises(ClientClosed):
        await clocknet.wait(d)
    clocknet.advance(5)
    assert client.machine._channels == set() and len(requests(router)) == 1
    assert clocknet.reactor.getDelayedCalls() == []


# --- 4. the timeout counts time in the client's own queue ---------------------------

@pytest_twisted.ensureDeferred
async def test_timeout_counts_time_spent_waiting_in_the_client_queue(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, maxConnections=1)
    client.request("svc", b"holds the only connection", timeout=60, retries=1)
    with pytest.raises(RequestTimeout) as info:
        await clocknet.wait(client.request("svc", b"queued", timeout=0.5, retries=1))
    assert info.value.elapsed == pytest.approx(0.5)
    assert info.value.attempts == 1
    with pytest.raises(RequestTimeout) as info:
        await clocknet.wait(client.request("svc", b"queued", timeout=0.5, retries=3))
    assert info.value.elapsed == pytest.approx(1.5)
    assert info.value.attempts == 3
    assert len(requests(router)) == 1  # neither ever went out


# --- 5. restarted streams ----------------------------------------------------------

def counting(prefix: bytes) -> Any:
    """A streaming handler: int(frames[0]) PARTIALs ``prefix-N``, then FINAL ``done``."""

    async def count(frames: list[bytes]) -> Any:
        for n in range(int(frames[0])):
            yield b"%s-%d" % (prefix, n)
        yield Final(b"done")

    return count


async def streaming_request_whose_worker_dies(net: Net, **options: Any) -> tuple[Any, list, Any]:
    """A request whose first worker streams two PARTIALs and leaves; a second
    worker streams three and a FINAL."""
    broker, endpoint = await start_broker(net)
    first = RawPeer(net, endpoint)
    first.send(W, codec.W_READY, b"count")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=60, retries=1)
    parts: list[list[bytes]] = []
    reply = client.request("count", b"3", onPartial=parts.append, **options)
    request = await nth_request(first, 0)
    for n in range(2):
        first.send(W, codec.W_PARTIAL, request[2], b"", b"first-%d" % n)
    await net.until(lambda: len(parts) == 2)
    first.send(W, codec.W_DISCONNECT)
    start_worker(net, endpoint, "count", counting(b"second"))
    return reply, parts, client


@pytest_twisted.ensureDeferred
async def test_stream_restarted_on_another_worker_is_announced(net: Net) -> None:
    events: list[Any] = []
    reply, parts, _ = await streaming_request_whose_worker_dies(
        net, onRestart=lambda: events.append(("restart", len(parts))))
    assert await net.wait(reply) == [b"done"]
    assert events == [("restart", 2)]
    assert parts == [[b"first-0"], [b"first-1"], [b"second-0"], [b"second-1"], [b"second-2"]]


@pytest_twisted.ensureDeferred
async def test_stream_restart_without_on_restart_fails_the_request(net: Net) -> None:
    reply, parts, client = await streaming_request_whose_worker_dies(net)
    with pytest.raises(StreamRestarted):
        await net.wait(reply)
    assert parts == [[b"first-0"], [b"first-1"]]  # nothing of the new attempt
    await net.until(lambda: bool(client.machine._idle))  # its reply still drains off its connection


@pytest_twisted.ensureDeferred
async def test_reply_stream_raises_restarted_then_yields_the_new_attempt(net: Net) -> None:
    broker, endpoint = await start_broker(net)
    first = RawPeer(net, endpoint)
    first.send(W, codec.W_READY, b"count")
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=60, retries=1)
    stream = client.stream("count", b"2")
    request = await nth_request(first, 0)
    first.send(W, codec.W_PARTIAL, request[2], b"", b"old")
    seen: list[Any] = []

    async def consume() -> None:
        while True:
            try:
                async for part in stream:
                    seen.append(part)
                    if part == [b"old"]:
                        first.send(W, codec.W_DISCONNECT)
                        start_worker(net, endpoint, "count", counting(b"new"))
                return
            except StreamRestarted:
                seen.append("restarted")

    await net.wait(defer.ensureDeferred(consume()))
    assert seen == [[b"old"], "restarted", [b"new-0"], [b"new-1"], [b"done"]]


@pytest_twisted.ensureDeferred
async def test_retry_after_partials_is_announced_or_not_made(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=2)
    restarts: list[float] = []
    d = client.request("svc", b"x", onPartial=lambda p: None,
                       onRestart=lambda: restarts.append(clocknet.reactor.seconds()))
    clocknet.advance(0)
    router.send(requests(router)[0][1], codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"p")
    clocknet.advance(1.0)  # timed out after a PARTIAL: retried, and said so first
    assert restarts == [pytest.approx(1.0)]
    assert len(requests(router)) == 2
    final(router, requests(router)[1][1], b"svc", b"done")
    assert await clocknet.wait(d) == [b"done"]

    # without onRestart, a request whose reply had begun is not run again
    d = client.request("svc", b"y", onPartial=lambda p: None)
    clocknet.advance(0)
    router.send(requests(router)[2][1], codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"p")
    with pytest.raises(RequestTimeout) as info:
        await clocknet.wait(d)
    assert info.value.attempts == 1
    assert len(requests(router)) == 3


# --- 6. everything queued expires ----------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_requests_queued_behind_a_hung_worker_expire(net: Net) -> None:
    broker, endpoint = await start_broker(net, heartbeat=FAST, requestExpiry=0.5)
    start_worker(net, endpoint, "hangs", lambda frames: defer.Deferred(), heartbeat=FAST)
    await net.until(lambda: len(broker.workers) == 1)
    client = make_client(net, endpoint, timeout=60, retries=1)
    held = client.request("hangs", b"0")
    await net.until(lambda: broker.services[b"hangs"].idle == {})
    queued = [client.request("hangs", str(n)) for n in range(1, 10)]
    outcomes = await net.wait(defer.DeferredList(queued, consumeErrors=True))
    assert all(not ok and failure.check(ServiceUnavailable) for ok, failure in outcomes)
    assert "no worker free" in outcomes[0][1].value.message
    assert broker.queued == 0 and broker.queuedBytes == 0
    assert not held.called  # the one the worker holds is the worker's business


# --- 7. what the reply store covers (docs/reliability.md says the same) ---------------

@pytest_twisted.ensureDeferred
async def test_reply_store_covers_finished_requests_not_ones_in_progress(clocknet: LoopbackNet) -> None:
    """A retry of an answered request is served from the store; a retry that
    reaches another worker while the first is still running runs again."""
    broker, endpoint = await start_broker(clocknet)
    store = MemoryReplyStore()
    runs: list[defer.Deferred] = []

    def slow(frames: list[bytes]) -> defer.Deferred:
        runs.append(defer.Deferred())
        return runs[-1]

    for _ in range(2):
        start_worker(clocknet, endpoint, "pay", slow, replies=store)
    await clocknet.until(lambda: len(broker.workers) == 2)
    client = make_client(clocknet, endpoint, stamp=True, timeout=1.0, retries=2)
    reply = client.request("pay", b"10 EUR")
    await clocknet.until(lambda: len(runs) == 2)  # the retry ran on the other worker
    runs[1].callback(b"paid")
    assert await clocknet.wait(reply) == [b"paid"]
    runs[0].callback(b"paid")  # the first run finishes too: it ran twice
    clocknet.advance(0)
    assert len(runs) == 2
