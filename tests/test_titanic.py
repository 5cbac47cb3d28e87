"""Titanic's dialog over loopback with a Clock: every status code and every
malformed body (the dispatcher is tested on its own)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, task

from mdp.errors import TitanicError, UnknownRequest, WorkerError
from mdp.majordomo.idempotence import MemoryReplyStore
from mdp.policy import Backoff
from mdp.titanic import Titanic, TitanicClient, protocol
from mdp.titanic.server import TitanicServer
from mdp.titanic.store import MemoryStore, ReplyStatus
from tests.conftest import LoopbackNet
from tests.test_mdp_behaviour import echo, make_client, start_broker, start_worker


async def titanic(net: LoopbackNet, store: Any = None) -> tuple[Any, Any, Any]:
    broker, endpoint = await start_broker(net)
    store = store if store is not None else MemoryStore()
    await net.wait(store.open())
    stored: list[str] = []
    server = TitanicServer(endpoint, store, net.reactor, onStored=stored.append)
    server.start()
    net.addCleanup(server.stop)
    await net.until(lambda: len(broker.workers) == len(server.workers) == 12)
    return make_client(net, endpoint), store, stored


@pytest_twisted.ensureDeferred
async def test_request_reply_close_dialog(clocknet: LoopbackNet) -> None:
    client, store, stored = await titanic(clocknet)
    status, requestId = await clocknet.wait(client.request(protocol.REQUEST, b"echo", b"hi", b""))
    assert status == protocol.OK and str(uuid.UUID(requestId.decode())) == requestId.decode()
    assert stored == [requestId.decode()]  # the dispatcher hears of it once it is committed
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [protocol.PENDING]
    await clocknet.wait(store.complete(requestId.decode(), [b"HI", b""], clocknet.reactor.seconds()))
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [
        protocol.OK, b"HI", b""]
    assert await clocknet.wait(client.request(protocol.CLOSE, requestId)) == [protocol.OK]
    assert await clocknet.wait(client.request(protocol.CLOSE, requestId)) == [protocol.OK]
    assert await clocknet.wait(client.request(protocol.REPLY, requestId)) == [protocol.UNKNOWN]
    unknown = str(uuid.uuid4()).encode()
    assert await clocknet.wait(client.request(protocol.REPLY, unknown)) == [protocol.UNKNOWN]


@pytest.mark.parametrize("service, body, says", [
    (protocol.REQUEST, [b"echo"], b"needs a service name and at least one request frame"),
    (protocol.REQUEST, [b"", b"x"], b"service name of 0 bytes"),
    (protocol.REQUEST, [b"ech\xffo", b"x"], b"not printable ASCII"),
    (protocol.REQUEST, [b"titanic.request", b"x"], b"Titanic's own service"),
    (protocol.REQUEST, [b"mmi.service", b"echo"], b"answered by the broker at once"),
    (protocol.REPLY, [b"not-a-uuid"], b"is not a request id"),
    (protocol.REPLY, [b"a", b"b"], b"takes one frame"),
    (protocol.CLOSE, [b"{12345678-1234-5678-1234-567812345678}"], b"canonical text form"),
    (protocol.REPLY, [b"0ECE3045-1234-5678-1234-567812345678"], b"8-4-4-4-12 lowercase hex"),
])
@pytest_twisted.ensureDeferred
async def test_malformed_bodies_get_500_saying_why(clocknet: LoopbackNet, service: bytes,
                                                   body: list[bytes], says: bytes) -> None:
    client, store, stored = await titanic(clocknet)
    reply = await clocknet.wait(client.request(service, *body))
    assert reply[0] == protocol.FAILED and says in reply[1]
    assert stored == [] and await clocknet.wait(store.pending(10)) == []


class FailingStore(MemoryStore):
    def add(self, service: bytes, frames: list[bytes], now: float) -> Any:
            return defer.fail(OSError("disk full"))


@pytest_twisted.ensureDeferred
async def test_a_request_the_store_cannot_keep_is_not_acknowledged(clocknet: LoopbackNet) -> None:
    client, _, stored = await titanic(clocknet, FailingStore())
    reply = await clocknet.wait(client.request(protocol.REQUEST, b"echo", b"x"))
    assert reply == [protocol.FAILED, b"the store failed to store: disk full"]
    assert stored == []


# --- the whole Titanic: services, dispatcher and store over loopback ------------------


async def whole(net: LoopbackNet, store: Any = None,
                **options: Any) -> tuple[Any, Any, str, Any]:
    broker, endpoint = await start_broker(net)
    store = store if store is not None else MemoryStore()
    node = Titanic(endpoint, store, net.reactor, **options)
    await net.wait(node.start())
    net.addCleanup(node.stop)
    await net.until(lambda: len(broker.workers) == len(node.server.workers))
    client = TitanicClient(endpoint, net.reactor, pollInterval=0.5)
    net.addCleanup(client.disconnect)
    return broker, client, endpoint, node


@pytest_twisted.ensureDeferred
async def test_a_request_for_a_service_with_no_worker_is_done_once_one_starts(
        clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet, backoff=Backoff(1.0, 4.0))
    requestId = await clocknet.wait(client.submit("upper", b"hello", b""))
    for _ in range(30):  # asked mmi.service first: nothing waits in the broker for "upper"
        clocknet.advance(1)
        assert all(s.queued == 0 for s in broker.snapshot().services)
    assert await clocknet.wait(client.poll(requestId)) is None  # still pending
    start_worker(clocknet, endpoint, "upper", lambda frames: [f.upper() for f in frames])
    assert await clocknet.wait(client.result(requestId)) == [b"HELLO", b""]
    await clocknet.wait(client.close(requestId))
    with pytest.raises(UnknownRequest):
        await clocknet.wait(client.poll(requestId))


@pytest_twisted.ensureDeferred
async def test_a_request_for_a_service_whose_worker_is_restarting_waits_in_the_broker(
        clocknet: LoopbackNet) -> None:
    """Its worker left a moment ago: the broker keeps the service for its
    linger (mmi.workers counts none, mmi.service answers 200) and queues a
    request for it.  Titanic sends the request there rather than park the
    service for a backoff step, so it is served as soon as the worker is back."""
    from mdp.titanic.dispatcher import ServiceState

    broker, client, endpoint, node = await whole(clocknet)
    name = b"restarting"
    worker = start_worker(clocknet, endpoint, name.decode(), echo)
    await clocknet.until(lambda: broker.snapshot(service=name).workerCount == 1)
    await clocknet.wait(worker.stop())
    await clocknet.until(lambda: broker.snapshot(service=name).workerCount == 0)
    assert broker.isServiceAvailable(name)  # known still: within its linger

    def queued() -> int:
        return sum(s.queued for s in broker.snapshot().services if s.name == name)

    ids = [await clocknet.wait(client.submit(name.decode(), b"%d" % n)) for n in range(3)]
    await clocknet.until(lambda: queued() == 1, timeout=0.5)
    assert node.dispatcher.machine.services[name].state is ServiceState.AVAILABLE  # not parked
    clocknet.advance(2)
    assert queued() == 1  # one at a time while no worker is there
    served: list[float] = []
    back = clocknet.reactor.seconds()
    start_worker(clocknet, endpoint, name.decode(),
                 lambda f: (served.append(clocknet.reactor.seconds()), f)[1])
    assert [await clocknet.wait(client.result(i)) for i in ids] == [[b"0"], [b"1"], [b"2"]]
    assert len(served) == 3 and served[0] - back < 0.5  # at once, not a backoff step later


@pytest_twisted.ensureDeferred
async def test_call_is_submit_result_close(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet)
    start_worker(clocknet, endpoint, "echo", echo)
    assert await clocknet.wait(client.call("echo", b"a", "b")) == [b"a", b"b"]


class Recorded(MemoryStore):
    """Keeps the ids it gave out."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []

    def add(self, service: bytes, frames: list[bytes], now: float) -> Any:
        return super().add(service, frames, now).addCallback(
            lambda requestId: (self.ids.append(requestId), requestId)[1])


class ForgetFails(Recorded):
    def forget(self, requestId: str) -> Any:
        return defer.fail(OSError("database or disk is full"))


@pytest_twisted.ensureDeferred
async def test_call_returns_the_reply_in_hand_when_the_close_fails(
        clocknet: LoopbackNet) -> None:
    """The reply is in hand and titanic.close fails (the store cannot write):
    call() returns the reply and logs the request's id (it raised, the reply
    thrown away, and a retry ran the service again)."""
    from tests.conftest import warnings_logged

    runs: list[list[bytes]] = []
    broker, client, endpoint, node = await whole(clocknet, ForgetFails())
    start_worker(clocknet, endpoint, "charge", lambda f: (runs.append(f), [b"charged " + f[0]])[1])
    with warnings_logged() as warnings:
        assert await clocknet.wait(client.call("charge", b"$10")) == [b"charged $10"]
    assert runs == [[b"$10"]]
    (requestId,) = node.store.ids
    assert (await clocknet.wait(node.store.reply(requestId)))[0] is ReplyStatus.DONE  # kept
    assert any("titanic.close failed" in str(e.get("log_format"))
               and e.get("requestId") == requestId for e in warnings)


@pytest_twisted.ensureDeferred
async def test_call_keeps_a_stored_reply_that_titanic_reply_cannot_carry(
        clocknet: LoopbackNet) -> None:
    """A reply that fits Titanic's limits as stored, not with titanic.reply's
    status frame and envelope (413): call() fails with TitanicError and
    leaves the request, so the work done can be fetched with larger limits."""
    from mdp import Limits

    runs: list[int] = []
    broker, client, endpoint, node = await whole(clocknet, Recorded(),
                                                 limits=Limits(maxMessageBytes=10_000))
    start_worker(clocknet, endpoint, "report", lambda f: (runs.append(1), [b"r" * 9_985])[1])
    with pytest.raises(TitanicError, match="stays in Titanic's store"):
        await clocknet.wait(client.call("report", b"go"))
    (requestId,) = node.store.ids
    assert runs == [1]
    assert (await clocknet.wait(node.store.reply(requestId)))[0] is ReplyStatus.DONE


@pytest_twisted.ensureDeferred
async def test_a_service_gets_as_many_requests_as_it_has_workers_and_no_more(
        clocknet: LoopbackNet) -> None:
    """One worker taking 10 s a request: Titanic sends it one at a time
    (four at once, the last would wait 30 s in the broker's queue, time out,
    and run twice), and its backlog leaves room for another service."""
    from twisted.internet import task

    broker, client, endpoint, node = await whole(clocknet)
    runs: list[bytes] = []

    def slow(frames: list[bytes]) -> Any:
        runs.append(frames[0])
        return task.deferLater(clocknet.reactor, 10.0, lambda: frames)

    start_worker(clocknet, endpoint, "slow", slow)
    fast: list[float] = []
    start_worker(clocknet, endpoint, "fast", lambda f: (fast.append(clocknet.reactor.seconds()), f)[1])
    ids = [await clocknet.wait(client.submit("slow", b"%d" % n)) for n in range(40)]
    submitted = clocknet.reactor.seconds()
    await clocknet.wait(client.submit("fast", b"hi"))
    clocknet.advance(5)
    assert fast and fast[0] - submitted < 5
    for requestId in ids:
        await clocknet.wait(client.result(requestId), timeout=1000)
    assert sorted(runs) == sorted(b"%d" % n for n in range(40))  # each once


@pytest_twisted.ensureDeferred
async def test_a_service_whose_worker_listing_is_too_large_to_read_is_still_served(
        clocknet: LoopbackNet) -> None:
    """Titanic with small message limits, a service with many workers: the
    mmi.workers listing is over them, so Titanic asks mmi.service instead."""
    from mdp import Limits

    broker, client, endpoint, node = await whole(clocknet, limits=Limits(maxMessageBytes=2_000))
    for _ in range(30):
        start_worker(clocknet, endpoint, "echo", echo)
    await clocknet.until(lambda: broker.snapshot().workerCount >= 30 + len(node.server.workers))
    requestId = await clocknet.wait(client.submit("echo", b"hi"))
    assert await clocknet.wait(client.result(requestId), timeout=30) == [b"hi"]


@pytest_twisted.ensureDeferred
async def test_a_handler_that_raises_is_stored_and_raised_as_worker_error(
        clocknet: LoopbackNet) -> None:
    def broken(frames: list[bytes]) -> list[bytes]:
        raise RuntimeError("no can do")

    calls: list[int] = []
    broker, client, endpoint, node = await whole(clocknet)
    start_worker(clocknet, endpoint, "broken", lambda f: (calls.append(1), broken(f))[1])
    requestId = await clocknet.wait(client.submit("broken", b"x"))
    with pytest.raises(WorkerError, match="no can do") as raised:
        await clocknet.wait(client.result(requestId))
    assert raised.value.service == b"broken"
    assert len(calls) == 1  # a final error is not retried


@pytest_twisted.ensureDeferred
async def test_at_most_concurrency_requests_are_out_at_once(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet, concurrency=2)
    held: list[defer.Deferred] = []

    def slow(frames: list[bytes]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        held.append(d)
        return d.addCallback(lambda _: frames)

    for _ in range(3):
        start_worker(clocknet, endpoint, "slow", slow)
    ids = [await clocknet.wait(client.submit("slow", b"%d" % n)) for n in range(4)]
    await clocknet.until(lambda: len(held) == 2)
    clocknet.advance(5)
    assert len(held) == 2  # three workers, but two requests out
    held[0].callback(None)
    await clocknet.until(lambda: len(held) == 3)
    for d in held[1:]:
        d.callback(None)
    await clocknet.until(lambda: len(held) == 4)
    held[3].callback(None)
    replies = [await clocknet.wait(client.result(i)) for i in ids]
    assert replies == [[b"0"], [b"1"], [b"2"], [b"3"]]


@pytest_twisted.ensureDeferred
async def test_pending_work_resumes_when_titanic_starts_again(clocknet: LoopbackNet) -> None:
    store = MemoryStore()  # outlives both Titanics, as a file outlives a process
    broker, client, endpoint, node = await whole(clocknet, store)
    ids = [await clocknet.wait(client.submit("later", b"%d" % n)) for n in range(3)]
    await clocknet.wait(node.stop())
    await clocknet.until(lambda: len(broker.workers) == 0)
    again = Titanic(endpoint, store, clocknet.reactor)
    await clocknet.wait(again.start())
    clocknet.addCleanup(again.stop)
    start_worker(clocknet, endpoint, "later", echo)
    replies = [await clocknet.wait(client.result(i)) for i in ids]
    assert replies == [[b"0"], [b"1"], [b"2"]]


@pytest_twisted.ensureDeferred
async def test_a_stored_request_that_cannot_be_read_back_is_answered_500_alone(
        clocknet: LoopbackNet) -> None:
    """A damaged stored request comes back without frames (as SQLiteStore
    reads one back): it is answered with an error, and the others go on."""
    store = MemoryStore()
    damaged = await clocknet.wait(store.add(b"echo", [], 0.0))
    noService = await clocknet.wait(store.add(b"", [], 0.0))  # its service damaged too
    broker, client, endpoint, node = await whole(clocknet, store)
    start_worker(clocknet, endpoint, "echo", echo)
    assert await clocknet.wait(client.call("echo", b"fine")) == [b"fine"]
    for requestId in (damaged, noService):
        with pytest.raises(WorkerError, match="the stored request cannot be sent"):
            await clocknet.wait(client.result(requestId))


@pytest_twisted.ensureDeferred
async def test_replies_are_purged_after_the_keep_time(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet, keep=100.0, purgeEvery=10.0)
    start_worker(clocknet, endpoint, "echo", echo)
    requestId = await clocknet.wait(client.submit("echo", b"x"))
    assert await clocknet.wait(client.result(requestId)) == [b"x"]
    clocknet.advance(50)
    assert await clocknet.wait(client.poll(requestId)) == [b"x"]  # kept
    clocknet.advance(70)
    with pytest.raises(UnknownRequest):
        await clocknet.wait(client.poll(requestId))


@pytest_twisted.ensureDeferred
async def test_titanic_errors_are_typed(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet, FailingStore())
    with pytest.raises(TitanicError, match="disk full"):
        await clocknet.wait(client.submit("echo", b"x"))
    with pytest.raises(UnknownRequest):
        await clocknet.wait(client.poll(str(uuid.uuid4())))
    with pytest.raises(ValueError, match="not a Titanic request id"):
        client.poll("nope")
    with pytest.raises(TypeError):
        client.submit("echo", 3)
    with pytest.raises(ValueError):
        client.submit("echo")


class HeldStore(MemoryStore):
    """Adds are committed only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[defer.Deferred] = []

    def add(self, service: bytes, frames: list[bytes], now: float) -> Any:
        d: defer.Deferred = defer.Deferred()
        self.held.append(d)
        return d.addCallback(lambda _: super(HeldStore, self).add(service, frames, now))


@pytest_twisted.ensureDeferred
async def test_submissions_are_stored_several_at_once_and_acknowledged_only_once_committed(
        clocknet: LoopbackNet) -> None:
    store = HeldStore()
    broker, client, endpoint, node = await whole(clocknet, store, workers=3)
    submits = [client.submit("echo", b"%d" % n) for n in range(4)]
    await clocknet.until(lambda: len(store.held) == 3)  # three workers, three at once
    clocknet.advance(1)
    assert len(store.held) == 3 and not any(d.called for d in submits)
    for d in list(store.held):
        d.callback(None)
    await clocknet.until(lambda: len(store.held) == 4)
    store.held[3].callback(None)
    ids = [await clocknet.wait(d) for d in submits]
    assert len(set(ids)) == 4


class SlowOpenStore(MemoryStore):
    """Opens only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.opening: defer.Deferred = defer.Deferred()
        self.closed = 0

    def open(self) -> Any:
        return self.opening

    def close(self) -> Any:
        self.closed += 1
        return defer.succeed(None)


@pytest_twisted.ensureDeferred
async def test_stop_while_the_store_opens_leaves_nothing_running(clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet)
    store = SlowOpenStore()
    node = Titanic(endpoint, store, clocknet.reactor)
    started = node.start()
    stopped = node.stop()
    clocknet.advance(1)
    assert not stopped.called  # it waits for the open to finish, then undoes it
    store.opening.callback(None)
    await clocknet.wait(stopped)
    await clocknet.wait(started)
    clocknet.advance(5)
    assert broker.workers == {} and not node.dispatcher.machine.running and store.closed == 1


@pytest_twisted.ensureDeferred
async def test_a_stopped_titanic_starts_again_and_finishes_its_work(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet)
    requestId = await clocknet.wait(client.submit("later", b"x"))
    await clocknet.wait(node.stop())
    await clocknet.until(lambda: broker.workers == {})
    restarted = node.start()
    with pytest.raises(RuntimeError, match="already started"):
        node.start()
    await clocknet.wait(restarted)
    await clocknet.until(lambda: len(broker.workers) == len(node.server.workers))
    start_worker(clocknet, endpoint, "later", echo)
    assert await clocknet.wait(client.result(requestId)) == [b"x"]


@pytest_twisted.ensureDeferred
async def test_a_streamed_reply_is_stored_as_its_parts_then_its_final(
        clocknet: LoopbackNet) -> None:
    from mdp import Final

    def stream(frames: list[bytes]) -> Any:
        yield b"part1"
        yield [b"part2", b"more"]
        yield Final(b"end")

    broker, client, endpoint, node = await whole(clocknet)
    start_worker(clocknet, endpoint, "stream", stream)
    assert await clocknet.wait(client.call("stream", b"go")) == [b"part1", b"part2", b"more",
                                                                 b"end"]


@pytest_twisted.ensureDeferred
async def test_a_streamed_reply_larger_than_a_reply_may_be_is_answered_413_not_kept(
        clocknet: LoopbackNet) -> None:
    """Each PARTIAL is within the limits, but a stream of them would make a
    reply no titanic.reply could carry: Titanic keeps no more than that,
    stores 413 and abandons the request, and serves the next."""
    from mdp import Final, Limits, MessageTooLarge

    def endless(frames: list[bytes]) -> Any:
        for _ in range(1000):
            yield b"x" * 1000
        yield Final(b"end")

    broker, client, endpoint, node = await whole(clocknet, limits=Limits(maxMessageBytes=10_000))
    start_worker(clocknet, endpoint, "endless", endless)
    start_worker(clocknet, endpoint, "echo", echo)
    kept: list[int] = []
    dispatcher = node.dispatcher
    original = dispatcher.machine.handleReply

    def handleReply(requestId: str, frames: list[bytes], now: float) -> Any:
        kept.append(sum(map(len, frames)))
        return original(requestId, frames, now)

    dispatcher.machine.handleReply = handleReply  # type: ignore[method-assign]
    requestId = await clocknet.wait(client.submit("endless", b"go"))
    with pytest.raises(MessageTooLarge, match="too large to keep"):
        await clocknet.wait(client.result(requestId))
    assert kept and max(kept) < 10_000
    assert await clocknet.wait(client.call("echo", b"next")) == [b"next"]

    def sized(frames: list[bytes]) -> Any:  # nine parts of 1,000 bytes, then the rest
        for _ in range(9):
            yield b"x" * 1000
        yield Final(b"y" * (int(frames[0]) - 9000))

    start_worker(clocknet, endpoint, "sized", sized)
    # what fits with room for titanic.reply's envelope is stored and fetched whole...
    reply = await clocknet.wait(client.call("sized", b"9400"))
    assert len(reply) == 10 and sum(map(len, reply)) == 9400
    # ...and what would leave no room for it is 413 at once, not 413 at every fetch
    with pytest.raises(MessageTooLarge, match="too large to keep: more than 9488 bytes"):
        await clocknet.wait(client.call("sized", b"9600"))


@pytest_twisted.ensureDeferred
async def test_result_polls_on_while_titanic_is_away(clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet)
    requestId = await clocknet.wait(client.submit("echo", b"x"))
    await clocknet.wait(node.stop())
    result = client.result(requestId)
    clocknet.advance(60)  # far beyond one poll's 3 attempts of 2.5 s
    assert not result.called
    await clocknet.wait(node.start())
    start_worker(clocknet, endpoint, "echo", echo)
    assert await clocknet.wait(result) == [b"x"]


class EarlierStore(MemoryStore):
    """A store written to the interface before ``pending`` took ``onlyServices``."""

    def pending(self, limit: int, skipServices: Any = (), skipIds: Any = ()) -> Any:
        return super().pending(limit, skipServices, skipIds)


@pytest_twisted.ensureDeferred
async def test_a_store_whose_pending_takes_no_only_services_is_read_whole(
        clocknet: LoopbackNet) -> None:
    broker, client, endpoint, node = await whole(clocknet, EarlierStore())
    assert node.dispatcher.machine.listEvery is None
    start_worker(clocknet, endpoint, "echo", echo)
    assert await clocknet.wait(client.call("echo", b"served")) == [b"served"]


class RaisingStore(MemoryStore):
    """A store whose ``pending`` raises once, before it returns a Deferred."""

    raised = False

    def pending(self, *args: Any, **options: Any) -> Any:
        if not self.raised:
            self.raised = True
            raise RuntimeError("the store's own bug")
        return super().pending(*args, **options)


@pytest_twisted.ensureDeferred
async def test_a_read_raising_at_once_is_a_failed_read_tried_again(
        clocknet: LoopbackNet) -> None:
    store = RaisingStore()
    broker, client, endpoint, node = await whole(clocknet, store, backoff=Backoff(1.0, 2.0))
    start_worker(clocknet, endpoint, "echo", echo)
    assert await clocknet.wait(client.call("echo", b"served")) == [b"served"]
    assert store.raised


class FirstAddLate(Recorded):
    """Stores its first request *late* seconds after it is asked to (an acknowledgement
    that comes after the client gave up on it)."""

    def __init__(self, reactor: Any, late: float) -> None:
        super().__init__()
        self.reactor, self.late = reactor, late
        self.delayed = False

    def add(self, service: bytes, frames: list[bytes], now: float) -> Any:
        if self.delayed:
            return super().add(service, frames, now)
        self.delayed = True
        return task.deferLater(self.reactor, self.late, lambda: None).addCallback(
            lambda _: super(FirstAddLate, self).add(service, frames, self.reactor.seconds()))


@pytest.mark.parametrize("stamp, runs", [(True, 1), (False, 2)])
@pytest_twisted.ensureDeferred
async def test_a_stamped_submit_stored_twice_runs_once_with_a_reply_store(
        clocknet: LoopbackNet, stamp: bool, runs: int) -> None:
    store = FirstAddLate(clocknet.reactor, late=3.0)
    broker, _, endpoint, node = await whole(clocknet, store)
    ran: list[list[bytes]] = []
    start_worker(clocknet, endpoint, "echo", lambda frames: (ran.append(frames), frames)[1],
                 replies=MemoryReplyStore())
    client = TitanicClient(endpoint, clocknet.reactor, timeout=1.0, retries=3, stamp=stamp,
                           pollInterval=0.5)
    clocknet.addCleanup(client.disconnect)
    requestId = await clocknet.wait(client.submit("echo", b"once"))  # the second attempt's id
    assert await clocknet.wait(client.result(requestId)) == [b"once"]
    await clocknet.until(lambda: len(store.ids) == 2)  # the first attempt, stored late
    first = next(i for i in store.ids if i != requestId)
    assert await clocknet.wait(client.result(first)) == [b"once"]
    assert ran == [[b"once"]] * runs  # stamped: the copy is answered from the reply store
