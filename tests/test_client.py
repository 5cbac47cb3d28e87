"""Client state machine against a scripted broker, on loopback with a Clock."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.python.failure import Failure

from mdp import Client, ClientClosed, RequestTimeout, StreamRestarted
from mdp.majordomo import codec
from tests.conftest import LoopbackNet, RawRouter, raw_router


def requests(router) -> list[tuple[float, bytes, list[bytes]]]:
    return [(t, p, f) for t, p, f in router.received if f[:2] == [codec.CLIENT_HEADER, codec.C_REQUEST]]


def final(router, peer: bytes, service: bytes, *body: bytes) -> None:
    router.send(peer, codec.CLIENT_HEADER, codec.C_FINAL, service, *body)


async def broker_and_client(clocknet: LoopbackNet, **kwargs):
    """A scripted broker and a client of it, closed after the test."""
    router = await raw_router(clocknet)
    kwargs.setdefault("extensions", False)  # (a scripted broker: no mmi.extensions first)
    client = Client(router.transport.endpoint, clocknet.reactor, **kwargs)
    clocknet.addCleanup(client.close)
    return router, client


@pytest_twisted.ensureDeferred
async def test_request_frames_on_the_wire(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet)
    d = client.request("echo", b"a", "b")
    clocknet.advance(0)
    (_, peer, frames), = requests(router)
    assert frames == [b"MDPC02", b"\x01", b"echo", b"a", b"b"]
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"echo", b"p")
    final(router, peer, b"echo", b"f1", b"f2")
    assert await clocknet.wait(d) == [b"f1", b"f2"]


@pytest_twisted.ensureDeferred
async def test_bytearray_and_memoryview_frames_are_sent_as_bytes(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet)
    d = client.request("echo", bytearray(b"x"), memoryview(b"y"))
    clocknet.advance(0)
    (_, peer, frames), = requests(router)
    assert frames == [b"MDPC02", b"\x01", b"echo", b"x", b"y"]
    assert all(type(f) is bytes for f in frames)
    final(router, peer, b"echo", b"ok")
    assert await clocknet.wait(d) == [b"ok"]
@pytest_twisted.ensureDeferred
async def test_timeout_retries_on_fresh_connections_then_fails(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=3)
    d = client.request("svc", b"x")
    with pytest.raises(RequestTimeout) as info:
        await clocknet.wait(d)
    sent = requests(router)
    assert [t for t, _, _ in sent] == pytest.approx([0.0, 1.0, 2.0])
    assert len({p for _, p, _ in sent}) == 3  # a new socket per attempt
    assert info.value.attempts == 3
    assert info.value.elapsed == pytest.approx(3.0)
    assert info.value.service == b"svc"


@pytest_twisted.ensureDeferred
async def test_a_client_closed_by_a_timeout_errback_keeps_no_timer(clocknet: LoopbackNet) -> None:
    """One request times out while another's deadline is still ahead; the
    first's errback closes the client: no timer of the client's is left
    (trial would find the reactor unclean, and a closed client would wake)."""
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=1)
    first = client.request("svc", b"a")
    second = client.request("svc", b"b", timeout=2.0)
    closed: list[float] = []

    def closeOnTimeout(failure: Failure) -> None:
        failure.trap(RequestTimeout)
        closed.append(clocknet.reactor.seconds())
        client.close()

    first.addErrback(closeOnTimeout)
    second.addErrback(lambda failure: failure.trap(ClientClosed))
    clocknet.advance(1.0)
    assert closed == [pytest.approx(1.0)] and second.called
    assert [call for call in clocknet.reactor.getDelayedCalls()
            if getattr(call.func, "__self__", None) is client] == []


@pytest_twisted.ensureDeferred
async def test_late_reply_to_an_abandoned_attempt_is_never_delivered(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=2)
    d = client.request("svc", b"x")
    clocknet.advance(1.5)  # first attempt timed out, second in flight
    (_, first, _), (_, second, _) = requests(router)
    final(router, first, b"svc", b"stale")
    clocknet.advance(0)
    assert not d.called
    final(router, second, b"svc", b"fresh")
    assert await clocknet.wait(d) == [b"fresh"]


@pytest_twisted.ensureDeferred
async def test_concurrent_requests_are_correlated_by_connection(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet)
    ds = [client.request("svc", str(n).encode()) for n in range(10)]
    clocknet.advance(0)
    sent = requests(router)
    assert len({p for _, p, _ in sent}) == 10
    for _, peer, frames in reversed(sent):  # answer in reverse order
        final(router, peer, b"svc", b"re:" + frames[3])
    results = await clocknet.wait(defer.gatherResults(ds))
    assert results == [[b"re:" + str(n).encode()] for n in range(10)]


@pytest_twisted.ensureDeferred
async def test_pool_is_bounded_and_connections_are_reused(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, maxConnections=2)
    ds = [client.request("svc", str(n).encode()) for n in range(5)]
    answered = 0
    while answered < 5:
        clocknet.advance(0)
        pending = requests(router)[answered:]
        assert len(pending) <= 2
        for _, peer, frames in pending:
            final(router, peer, b"svc", frames[3])
            answered += 1
    assert await clocknet.wait(defer.gatherResults(ds)) == [[str(n).encode()] for n in range(5)]
    assert len({p for _, p, _ in requests(router)}) == 2


@pytest_twisted.ensureDeferred
async def test_cancel_abandons_the_request(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=5)
    d = client.request("svc", b"x")
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    d.cancel()
    with pytest.raises(defer.CancelledError):
        await clocknet.wait(d)
    final(router, peer, b"svc", b"ignored")
    clocknet.advance(10)  # no timer left behind, no retry
    assert len(requests(router)) == 1
    assert clocknet.reactor.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_a_stream_failed_on_restart_frees_the_connection_for_one_waiting(
        clocknet: LoopbackNet) -> None:
    """A streamed reply that starts over fails a request with no onRestart
    (StreamRestarted) while its connection still waits for that reply, as a
    cancelled request's does: a request waiting for that connection gets a
    fresh one at once, not at the failed request's deadline."""
    router, client = await broker_and_client(clocknet, timeout=5.0, retries=1, maxConnections=1)
    parts: list[list[bytes]] = []
    streamed = client.request("svc", b"A", onPartial=parts.append)
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    waiting = client.request("svc", b"B")
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"part")
    clocknet.advance(1.0)
    assert parts == [[b"part"]] and len(requests(router)) == 1
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", codec.RESTART_MARKER)
    clocknet.advance(0)
    with pytest.raises(StreamRestarted):
        await clocknet.wait(streamed)
    (_, _, _), (sentAt, other, frames) = requests(router)
    assert frames[-1] == b"B" and other != peer
    assert sentAt == pytest.approx(1.0)
    # the restarted reply's parts reach nobody: its connection is gone
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"again")
    final(router, peer, b"svc", b"late")
    final(router, other, b"svc", b"ok")
    assert await clocknet.wait(waiting) == [b"ok"]
    assert parts == [[b"part"]]
    assert client.machine._abandoned == 0


@pytest_twisted.ensureDeferred
async def test_cancelling_a_request_in_flight_frees_its_connection_for_one_already_waiting(
        clocknet: LoopbackNet) -> None:
    """A request waits for the only connection; the one in flight on it is
    cancelled: the waiting one goes out at once (the next reactor turn), not
    at the cancelled request's deadline."""
    router, client = await broker_and_client(clocknet, timeout=5.0, retries=1, maxConnections=1)
    inFlight = client.request("svc", b"A")
    inFlight.addErrback(lambda failure: failure.trap(defer.CancelledError))
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    waiting = client.request("svc", b"B")
    clocknet.advance(1.0)
    assert len(requests(router)) == 1
    inFlight.cancel()
    clocknet.advance(0)
    (_, _, _), (sentAt, other, frames) = requests(router)
    assert frames[-1] == b"B" and other != peer and sentAt == pytest.approx(1.0)
    final(router, other, b"svc", b"ok")
    assert await clocknet.wait(waiting) == [b"ok"]


@pytest_twisted.ensureDeferred
async def test_cancelling_a_batch_in_flight_and_waiting_opens_no_connection(
        clocknet: LoopbackNet) -> None:
    """Cancelling every request, the one in flight first and then those
    waiting, in one go: nothing waits any more when the connection would be
    given, so none is closed or opened for them."""
    router, client = await broker_and_client(clocknet, timeout=5.0, retries=1, maxConnections=1)
    calls = [client.request("svc", b"%d" % n) for n in range(5)]
    for call in calls:
        call.addErrback(lambda failure: failure.trap(defer.CancelledError))
    clocknet.advance(0)
    assert len(requests(router)) == 1
    (channel,) = client.machine._channels
    for call in calls:
        call.cancel()
    clocknet.advance(0)
    assert len(requests(router)) == 1 and client.machine._channels == {channel}


@pytest_twisted.ensureDeferred
async def test_a_stream_failed_on_restart_keeps_its_connection_for_the_reply(
        clocknet: LoopbackNet) -> None:
    """With nobody waiting, the connection of a request failed by a restart
    is kept for its reply, which it discards, and then serves the next
    request; counted once, it is never taken from a live request later."""
    router, client = await broker_and_client(clocknet, timeout=5.0, retries=1, maxConnections=1)
    streamed = client.request("svc", b"A", onPartial=lambda part: None)
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", b"part")
    router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"svc", codec.RESTART_MARKER)
    with pytest.raises(StreamRestarted):
        await clocknet.wait(streamed)
    streamed.cancel()  # fired already: nothing more to abandon
    assert client.machine._abandoned == 1
    final(router, peer, b"svc", b"late")
    clocknet.advance(0)
    # the late reply freed the connection: the next request goes out on it,
    # and the one after waits for it rather than close it
    second, third = client.request("svc", b"B"), client.request("svc", b"C")
    clocknet.advance(0)
    (_, _, _), (_, again, frames) = requests(router)
    assert again == peer and frames[-1] == b"B"
    final(router, peer, b"svc", b"b")
    assert await clocknet.wait(second) == [b"b"]
    clocknet.advance(0)
    (_, lastPeer, frames) = requests(router)[-1]
    assert lastPeer == peer and frames[-1] == b"C"
    final(router, peer, b"svc", b"c")
    assert await clocknet.wait(third) == [b"c"]
    assert client.machine._abandoned == 0


@pytest_twisted.ensureDeferred
async def test_reply_for_another_service_is_dropped(clocknet: LoopbackNet) -> None:
    router, client = await broker_and_client(clocknet, timeout=5)
    d = client.request("svc", b"x")
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    final(router, peer, b"other", b"wrong")
    router.send(peer, b"garbage")
    clocknet.advance(0)
    assert not d.called
    final(router, peer, b"svc", b"right")
    assert await clocknet.wait(d) == [b"right"]


@pytest_twisted.ensureDeferred
async def test_close_fails_pending_requests(clocknet: LoopbackNet) -> None:
    router = await raw_router(clocknet)
    client = Client(router.transport.endpoint, clocknet.reactor, maxConnections=1,
                    extensions=False)
    d1 = client.request("svc", b"in flight")
    d2 = client.request("svc", b"queued")
    clocknet.advance(0)
    await clocknet.wait(client.close())
    for d in (d1, d2):
        with pytest.raises(ClientClosed):
            await clocknet.wait(d)
    with pytest.raises(ClientClosed):
        await clocknet.wait(client.request("svc", b"after"))


@pytest_twisted.ensureDeferred
async def test_each_request_times_out_at_its_own_deadline(clocknet: LoopbackNet) -> None:
    """One timer serves the whole client: a shorter deadline set later still
    fires first, a reply cancels nothing the others need, and the timer stops
    when no request is in flight."""
    router, client = await broker_and_client(clocknet, timeout=5.0, retries=1)
    timedOut: dict[str, float] = {}

    def watch(d: defer.Deferred, name: str) -> None:
        d.addErrback(lambda f: f.trap(RequestTimeout) and timedOut.setdefault(
            name, clocknet.reactor.seconds()))

    watch(client.request("svc", b"slow"), "slow")  # deadline 5.0
    clocknet.advance(1.0)
    watch(client.request("svc", b"fast", timeout=1.5), "fast")  # deadline 2.5
    answered = client.request("svc", b"answered")  # deadline 6.0
    clocknet.advance(0)
    peer = next(p for _, p, f in requests(router) if f[-1] == b"answered")
    final(router, peer, b"svc", b"ok")
    assert await clocknet.wait(answered) == [b"ok"]
    clocknet.advance(6.0)
    assert timedOut == {"fast": pytest.approx(2.5), "slow": pytest.approx(5.0)}
    assert not clocknet.reactor.getDelayedCalls()
    # a retry's later deadline does not hide an earlier one of another request
    start = clocknet.reactor.seconds()
    timedOut.clear()
    watch(client.request("svc", b"retried", timeout=1.0, retries=2), "retried")  # +1, then +2
    clocknet.advance(0.5)
    watch(client.request("svc", b"between", timeout=1.0), "between")  # +1.5
    clocknet.advance(3.0)
    assert {k: v - start for k, v in timedOut.items()} == {
        "retried": pytest.approx(2.0), "between": pytest.approx(1.5)}


def test_a_request_needs_a_body() -> None:
    from twisted.internet import task

    client = Client("loopback:nowhere", task.Clock())
    with pytest.raises(ValueError):
        client.request("svc")


def test_caller_mistakes_raise_at_once() -> None:
    from twisted.internet import task

    clock = task.Clock()
    client = Client("loopback:nowhere", clock)
    # a frame of another type: bytes(5) would have sent five zero bytes
    with pytest.raises(TypeError, match="request frame 0 is int"):
        client.request("echo", 5)
    with pytest.raises(TypeError, match="request frame 1 is NoneType"):
        client.request("echo", b"ok", None)
    with pytest.raises(TypeError, match="service name"):
        client.request(5, b"x")
    with pytest.raises(TypeError):
        client.stream("echo", 1.5)
    with pytest.raises(ValueError, match="empty service name"):
        client.request("", b"x")
    with pytest.raises(ValueError, match="not ASCII"):
        client.request("écho", b"x")
    with pytest.raises(ValueError, match="timeout"):
        client.request("echo", b"x", timeout=-1)
    with pytest.raises(ValueError, match="retries"):
        client.request("echo", b"x", retries=0)
    with pytest.raises(ValueError, match="timeout"):
        client.stream("echo", b"x", timeout=-0.5)
    # nothing was queued or opened for any of them
    assert client.machine._channels == set() and not clock.getDelayedCalls()
    with pytest.raises(ValueError):
        Client("loopback:nowhere", clock, timeout=-1)
    with pytest.raises(ValueError):
        Client("loopback:nowhere", clock, retries=0)


def test_a_timeout_must_be_positive() -> None:
    from twisted.internet import task

    clock = task.Clock()
    # as for the Freelance clients and `mdp call`: an attempt of no time cannot be answered
    for bad in (0, 0.0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be positive, got"):
            Client("loopback:nowhere", clock, timeout=bad)
    client = Client("loopback:nowhere", clock)
    for bad in (0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be positive, got"):
            client.request("echo", b"x", timeout=bad)
        with pytest.raises(ValueError, match="timeout must be positive, got"):
            client.stream("echo", b"x", timeout=bad)
    assert client.machine._channels == set() and not clock.getDelayedCalls()


def test_a_client_needs_at_least_one_connection() -> None:
    from twisted.internet import task

    clock = task.Clock()
    # with no connection allowed, every request would wait for one until it timed out
    for bad in (0, -1):
        with pytest.raises(ValueError, match="maxConnections must be at least 1, got"):
            Client("loopback:nowhere", clock, maxConnections=bad)
    with pytest.raises(TypeError, match="maxConnections"):
        Client("loopback:nowhere", clock, maxConnections=2.5)
    assert Client("loopback:nowhere", clock, maxConnections=1).machine.maxConnections == 1


def test_a_malformed_endpoint_raises_at_once() -> None:
    from mdp.errors import TransportError

    with pytest.raises(TransportError, match="bad endpoint"):
        Client("tcp:host=127.0.0.1")
    with pytest.raises(TransportError, match="bad endpoint"):
        Client(["loopback:fine", "zmq:tcp://127.0.0.1"])
    with pytest.raises(TransportError, match="unknown scheme"):
        Client("nope:whatever")
    with pytest.raises(ValueError):
        Client([])


def test_endpoints_given_as_bytes_raise_a_clear_type_error() -> None:
    from twisted.internet import task

    clock = task.Clock()
    # bytes were iterated: "an endpoint is a string, not int: 122"
    for bad in (b"zmq:tcp://127.0.0.1:5555", bytearray(b"loopback:x"), memoryview(b"x"), 5555,
                None):
        with pytest.raises(TypeError, match=f"endpoints are str .*not {type(bad).__name__}"):
            Client(bad, clock)
    assert Client(("loopback:a", "loopback:b"), clock).endpoints == ["loopback:a", "loopback:b"]


def test_provides_its_interfaces() -> None:
    from twisted.internet import task
    from zope.interface.verify import verifyObject

    from mdp.interfaces import IClient, IDealerReceiver
    from mdp.majordomo.client import _ChannelPipe
    from mdp.majordomo.client_machine import _Channel

    client = Client("loopback:nowhere", task.Clock())
    assert verifyObject(IClient, client)
    assert verifyObject(IDealerReceiver, _ChannelPipe(client, _Channel(client.endpoint)))


@pytest_twisted.ensureDeferred
async def test_a_stream_wakes_its_consumer_once_for_the_parts_of_a_read(
        clocknet: LoopbackNet) -> None:
    """PARTIALs that arrive together reach an ``async for`` in one wake-up
    (one reactor turn later), in order, not one wake-up a part."""
    router, client = await broker_and_client(clocknet)
    stream = client.stream("echo", b"x")
    clocknet.advance(0)
    (_, peer, _), = requests(router)
    seen: list[list[bytes]] = []
    wakeups = 0

    async def consume() -> None:
        async for part in stream:
            seen.append(part)

    original = stream._wake

    def counted() -> None:
        nonlocal wakeups
        wakeups += 1 if stream._waiter is not None else 0
        original()

    stream._wake = counted  # type: ignore[method-assign]
    done = defer.ensureDeferred(consume())
    for n in range(3):
        router.send(peer, codec.CLIENT_HEADER, codec.C_PARTIAL, b"echo", b"%d" % n)
    assert seen == []  # not yet: the consumer is woken a turn later
    clocknet.advance(0)
    assert seen == [[b"0"], [b"1"], [b"2"]]
    assert wakeups == 1
    final(router, peer, b"echo", b"end")
    await clocknet.wait(done)
    assert seen == [[b"0"], [b"1"], [b"2"], [b"end"]]


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_timeout_names_why_each_connection_was_lost() -> None:
    """A broker whose connections end as soon as they are made (a TLS
    handshake refused, say): the timeout says so (it said only that no
    reply came)."""
    from twisted.internet import protocol
    from twisted.internet import reactor as real
    from twisted.internet.endpoints import TCP4ServerEndpoint

    class Hangup(protocol.Protocol):
        def connectionMade(self) -> None:
            self.transport.loseConnection()

    listening = await TCP4ServerEndpoint(real, 0, interface="127.0.0.1").listen(
        protocol.Factory.forProtocol(Hangup))
    client = Client(f"tcp:host=127.0.0.1:port={listening.getHost().port}", real,
                    timeout=1.5, retries=1)
    try:
        with pytest.raises(RequestTimeout, match="connection lost: .*closed cleanly"):
            await client.request("echo", b"x")
    finally:
        await client.close()
        await listening.stopListening()


@pytest_twisted.ensureDeferred
async def test_close_in_a_callback_opens_and_schedules_nothing_after(clocknet: LoopbackNet) -> None:
    """A request times out and its errback closes the client while another
    waits for the one connection: the connection the machine asked for
    before the close is not opened, no timer is left."""
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=1, maxConnections=1)
    first = client.request("svc", b"A")
    first.addErrback(lambda f: client.close())
    clocknet.advance(0.5)
    second = client.request("svc", b"B")
    clocknet.advance(1.0)
    with pytest.raises(ClientClosed):
        await clocknet.wait(second)
    clocknet.advance(5.0)
    assert [f[-1] for _, _, f in requests(router)] == [b"A"]
    assert client._links == {}
    assert client._timer is None or not client._timer.active()


@pytest_twisted.ensureDeferred
async def test_a_callback_cancelling_another_failed_request_breaks_nothing(
        clocknet: LoopbackNet) -> None:
    """Requests failing together (close, or timeouts in one sweep), the first
    one's errback cancelling the next: each Deferred fires once, the close
    completes, and the client's timer goes on serving later requests."""
    router, client = await broker_and_client(clocknet, timeout=1.0, retries=1)
    a, b = client.request("svc", b"A"), client.request("svc", b"B")
    retried = client.request("svc", b"C", retries=3)
    outcomes: list[str] = []
    a.addErrback(lambda f: (outcomes.append(f.type.__name__), b.cancel()))
    b.addErrback(lambda f: outcomes.append(f.type.__name__))
    clocknet.advance(1.0)
    assert outcomes == ["RequestTimeout", "CancelledError"]
    with pytest.raises(RequestTimeout):
        await clocknet.wait(retried)
    assert clocknet.reactor.seconds() == pytest.approx(3.0)
    later = client.request("svc", b"D")
    with pytest.raises(RequestTimeout):
        await clocknet.wait(later)
    assert clocknet.reactor.seconds() == pytest.approx(4.0)
    x, y = client.request("svc", b"X"), client.request("svc", b"Y")
    x.addErrback(lambda f: (outcomes.append(f.type.__name__), y.cancel()))
    y.addErrback(lambda f: outcomes.append(f.type.__name__))
    await clocknet.wait(client.close())
    assert outcomes[2:] == ["ClientClosed", "CancelledError"]


@pytest.mark.parametrize("lost", [1, 2])
@pytest_twisted.ensureDeferred
async def test_a_retry_goes_to_the_next_broker_not_an_idle_connection_to_the_silent_one(
        clocknet: LoopbackNet, lost: int) -> None:
    """Connections left idle to broker A by earlier requests are closed when
    the client moves on to B, and several attempts timing out on A at once
    move it on once, not back to A."""
    a, b = await raw_router(clocknet), await raw_router(clocknet)
    client = Client([a.transport.endpoint, b.transport.endpoint], clocknet.reactor,
                    timeout=1.0, retries=2)
    clocknet.addCleanup(client.close)
    warm = [client.request("svc", b"warm%d" % n) for n in range(4)]
    clocknet.advance(0)
    for _, peer, frames in requests(a):
        final(a, peer, b"svc", frames[-1])
    for d in warm:
        await clocknet.wait(d)
    silent = [client.request("svc", b"lost%d" % n, retries=1) for n in range(lost)]
    clocknet.advance(0)
    d = client.request("svc", b"x")
    clocknet.advance(1.0)
    for lost in silent:
        with pytest.raises(RequestTimeout):
            await clocknet.wait(lost)
    assert client.endpoint == b.transport.endpoint
    clocknet.advance(0.5)
    (_, peer, frames), = [r for r in requests(b)]
    assert frames[-1] == b"x"
    final(b, peer, b"svc", b"ok")
    assert await clocknet.wait(d) == [b"ok"]


@pytest_twisted.ensureDeferred
async def test_close_fires_once_its_connections_are_closed() -> None:
    """Over TCP: when close() has fired, no connection of the client is
    left open (a trial test, or a service stopping, finds none)."""
    from twisted.internet import reactor as real

    from mdp import Broker, Worker
    from tests.test_mdp_behaviour import echo

    broker = Broker(real)
    bound = await broker.listen("tcp:0:interface=127.0.0.1")
    endpoint = bound.endpoint
    worker = Worker(endpoint, "echo", echo, real)
    worker.start()
    client = Client(endpoint, real, timeout=5.0, retries=1)
    try:
        assert await client.request("echo", b"x") == [b"x"]
        (link,) = client._links.values()
        sockets = [link.protocol.transport]
        await client.close()
        assert all(s.disconnected for s in sockets)
    finally:
        await worker.stop()
        await broker.close()


async def _b_cancelled_when_a_fails(clocknet: LoopbackNet, timeout: float) -> tuple[RawRouter, Client]:
    """Two connections at most; A (1 s) and B go out, then C and D wait
    (*timeout* for B, C, D).  At 1.0 s A times out, and its errback cancels
    B (the caller gives up a batch one of which failed).  Returns at 1.1 s
    the broker and the client."""
    router = await raw_router(clocknet)
    client = Client(router.transport.endpoint, clocknet.reactor, maxConnections=2,
                    extensions=False)
    clocknet.addCleanup(client.close)
    a = client.request("svc", b"A", timeout=1.0, retries=1)
    b = client.request("svc", b"B", timeout=timeout, retries=1)
    b.addErrback(lambda f: f.trap(defer.CancelledError))
    a.addErrback(lambda f: (f.trap(RequestTimeout), b.cancel()))
    clocknet.advance(0)
    assert len(requests(router)) == 2
    clocknet.advance(0.5)
    for body in (b"C", b"D"):
        client.request("svc", body, timeout=timeout, retries=1).addErrback(lambda f: None)
    clocknet.advance(0.6)
    return router, client


@pytest_twisted.ensureDeferred
async def test_a_cancel_from_a_failure_callback_gives_the_connection_at_once(
        clocknet: LoopbackNet) -> None:
    """A request cancelled in the errback of another (one of a batch
    failed) while others wait: the machine asks for a wake-up now, which the
    wake-up of the outer batch of actions, older, must not undo."""
    router, client = await _b_cancelled_when_a_fails(clocknet, 10.0)
    sent = {f[-1]: t for t, _, f in requests(router)}
    assert b"C" in sent  # A's connection replaced: C went out
    # B's connection is abandoned while D waits: D should go out at once
    assert b"D" in sent, (client.machine._wakeAt, sent)


@pytest_twisted.ensureDeferred
async def test_deadlines_after_a_cancel_from_a_failure_callback_are_kept(
        clocknet: LoopbackNet) -> None:
    """The same: the wake-up the machine believes pending is the one armed,
    so a later request's deadline still ends it on time."""
    router, client = await _b_cancelled_when_a_fails(clocknet, 30.0)
    e = client.request("svc", b"E", timeout=1.0, retries=1)  # deadline 2.1
    failed = []
    e.addErrback(lambda f: failed.append((clocknet.reactor.seconds(), f.value)))
    clocknet.advance(2.0)  # t = 3.1
    assert failed and isinstance(failed[0][1], RequestTimeout), \
        ("E (1 s, 1 attempt) not failed by t=3.1", client.machine._wakeAt,
         [c.getTime() for c in clocknet.reactor.getDelayedCalls()])
