"""The request-context extension (docs/mdp.md, "Deadlines, cancellation and trace context"):
its codec, and the broker, worker and client machines driven by events with their times."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted

from mdp.errors import ProtocolError
from mdp.majordomo import codec, extension
from mdp.majordomo.broker_machine import BrokerMachine, Dropped, Refused, Send, WakeAt
from mdp.majordomo.extension import RequestContext
from mdp.policy import HeartbeatPolicy

HB = HeartbeatPolicy(interval=1.0, liveness=3)
W, C = codec.WORKER_HEADER, codec.CLIENT_HEADER
ROUTE = "binding"
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def envelope(client: bytes, assignment: int) -> bytes:
    return client + assignment.to_bytes(8, "big")


def context(deadline: int | None = None, **fields: Any) -> bytes:
    return extension.encode_context(RequestContext(deadline, **fields))


def sends(actions: list[Any]) -> list[tuple[bytes, list[bytes]]]:
    return [(a.key[1], list(a.frames)) for a in actions if type(a) is Send]


def kinds(actions: list[Any], kind: type) -> list[str]:
    return [a.kind for a in actions if type(a) is kind]


# --- codec ---------------------------------------------------------------------


def test_a_context_frame_round_trips_and_skips_fields_it_does_not_know() -> None:
    full = RequestContext(2500, TRACEPARENT, b"vendor=opaque,other=1")
    assert extension.decode_context(extension.encode_context(full)) == full
    assert extension.decode_context(extension.CONTEXT_MARKER + b"\nnext-thing=1\ndeadline=7") == \
        RequestContext(7)
    assert extension.split_context([context(5), b"body"]) == (RequestContext(5), [b"body"])
    assert extension.split_context([b"body"]) == (None, [b"body"])


@pytest.mark.parametrize("frame, why", [
    (extension.CONTEXT_MARKER + b"\ndeadline=0", "deadline"),
    (extension.CONTEXT_MARKER + b"\ndeadline=-5", "deadline"),
    (extension.CONTEXT_MARKER + b"\ndeadline=99999999999", "deadline"),
    (extension.CONTEXT_MARKER + b"\ndeadline=1e3", "deadline"),
    (extension.CONTEXT_MARKER + b"\ntraceparent=00-xyz-01", "traceparent"),
    (extension.CONTEXT_MARKER + b"\ntraceparent=00-" + b"0" * 32 + b"-b7ad6b7169203331-01", "traceparent"),
    (extension.CONTEXT_MARKER + b"\nno equals sign", "malformed context field"),
    (extension.CONTEXT_MARKER + b"\ndeadline=5" + b"\nx=" + b"y" * 1100, "bytes"),
])
def test_a_malformed_context_frame_is_refused_with_the_reason(frame: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        extension.decode_context(frame)


def test_a_context_out_of_range_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="deadline"):
        extension.encode_context(RequestContext(0))


# --- broker --------------------------------------------------------------------


def broker(**options: Any) -> BrokerMachine:
    machine = BrokerMachine(heartbeat=HB, **options)
    return machine


def ready(machine: BrokerMachine, name: bytes, extended: bool, now: float = 0.0) -> None:
    """Worker *name* registers; *extended*: it asks ``mmi.extensions`` first, as ours does."""
    if extended:
        assert sends(machine.handleMessage((ROUTE, name), extension.ASK_EXTENSIONS, now)) == [
            (name, [C, codec.C_FINAL, extension.MMI_EXTENSIONS, b"200", extension.FEATURES])]
    machine.handleMessage((ROUTE, name), [W, codec.W_READY, b"echo"], now)


def request(machine: BrokerMachine, client: bytes, body: list[bytes], now: float) -> list[Any]:
    return machine.handleMessage((ROUTE, client), [C, codec.C_REQUEST, b"echo", *body], now)


def test_only_a_worker_that_declared_the_extension_gets_the_context_with_the_time_left() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    ready(machine, b"P", extended=False)
    # X, registered first, takes the first request, 0.4 s into its 2 s
    machine.handleMessage((ROUTE, b"C1"), [C, codec.C_REQUEST, b"echo",
                                           context(2000, traceparent=TRACEPARENT), b"hi"], 0.0)
    assert machine.workers[(ROUTE, b"X")].current is not None
    assert sends(request(machine, b"C2", [context(1000), b"ho"], 0.1)) == [
        (b"P", [W, codec.W_REQUEST, envelope(b"C2", 2), b"", b"ho"])]  # a plain worker: the body alone
    # the extended worker's request carried what was left when it went (all of it here)
    machine2 = broker()
    ready(machine2, b"X", extended=True)
    machine2.handleMessage((ROUTE, b"P0"), [W, codec.W_READY, b"other"], 0.0)
    request(machine2, b"C0", [context(9000), b"first"], 0.0)  # X busy
    request(machine2, b"C1", [context(2000, traceparent=TRACEPARENT), b"hi"], 0.0)
    [(worker, frames)] = sends(machine2.handleMessage(
        (ROUTE, b"X"), [W, codec.W_FINAL, envelope(b"C0", 1), b"", b"done"], 0.4)[1:])
    assert worker == b"X" and frames[:4] == [W, codec.W_REQUEST, envelope(b"C1", 2), b""]
    assert extension.decode_context(frames[4]) == RequestContext(1600, TRACEPARENT)
    assert frames[5:] == [b"hi"]


def test_a_request_whose_deadline_passes_in_the_queue_is_answered_504_and_never_served() -> None:
    machine = broker()
    ready(machine, b"W", extended=True)
    request(machine, b"C0", [b"busy"], 0.0)  # the only worker is busy from now on
    actions = request(machine, b"C1", [context(50), b"late"], 0.25)
    assert WakeAt(0.3) in actions  # the broker wakes at the deadline
    assert machine.queued == 1
    actions = machine.handleWake(0.3)
    assert sends(actions) == [(b"C1", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER,
                                       extension.STATUS_DEADLINE, sends(actions)[0][1][5]])]
    assert b"deadline passed after 0.050s in the broker" in sends(actions)[0][1][5]
    assert kinds(actions, Refused) == ["deadline"] and machine.queued == 0
    # the worker's FINAL frees it; nothing is waiting, so nothing goes to it
    assert sends(machine.handleMessage((ROUTE, b"W"), [W, codec.W_FINAL, envelope(b"C0", 1), b"",
                                                         b"ok"], 0.1)) == [
        (b"C0", [C, codec.C_FINAL, b"echo", b"ok"])]


def test_a_request_past_its_deadline_when_a_worker_frees_up_is_not_handed_out() -> None:
    machine = broker()
    ready(machine, b"W", extended=True)
    request(machine, b"C0", [b"busy"], 0.0)
    request(machine, b"C1", [context(50), b"late"], 0.0)
    request(machine, b"C2", [context(5000), b"fine"], 0.0)
    # the worker frees up after C1's deadline, before the wake-up came: C1 504, C2 served
    actions = machine.handleMessage((ROUTE, b"W"), [W, codec.W_FINAL, envelope(b"C0", 1), b"", b"ok"],
                                    0.2)
    assert [(peer, frames[:5]) for peer, frames in sends(actions)] == [
        (b"C0", [C, codec.C_FINAL, b"echo", b"ok"]),
        (b"C1", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_DEADLINE]),
        (b"W", [W, codec.W_REQUEST, envelope(b"C2", 2), b"", context(4800)])]


def test_a_cancelled_request_is_dropped_from_the_queue_or_its_worker_told() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    ready(machine, b"P", extended=False)
    request(machine, b"C1", [context(9000), b"one"], 0.0)  # to X
    request(machine, b"C2", [context(9000), b"two"], 0.0)  # to P
    request(machine, b"C3", [context(9000), b"three"], 0.0)  # queued
    cancel = [C, codec.C_CANCEL, b"echo"]
    # queued: gone from the queue, its client answered 499
    actions = machine.handleMessage((ROUTE, b"C3"), cancel, 0.1)
    assert [(p, f[:5]) for p, f in sends(actions)] == [
        (b"C3", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_CANCELLED])]
    assert machine.queued == 0 and kinds(actions, Refused) == ["cancelled"]
    # with a worker that takes CANCEL: it is told, and its answer is the client's reply
    actions = machine.handleMessage((ROUTE, b"C1"), cancel, 0.2)
    assert sends(actions) == [(b"X", [W, codec.W_CANCEL, envelope(b"C1", 1)])]
    reply = [W, codec.W_FINAL, envelope(b"C1", 1), b"", codec.ERROR_MARKER, extension.STATUS_CANCELLED,
             b"cancelled"]
    assert sends(machine.handleMessage((ROUTE, b"X"), reply, 0.25)) == [
        (b"C1", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_CANCELLED, b"cancelled"])]
    # with a plain worker: the client hears now; the worker's answer is void, the worker free again
    actions = machine.handleMessage((ROUTE, b"C2"), cancel, 0.3)
    assert [(p, f[:5]) for p, f in sends(actions)] == [
        (b"C2", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_CANCELLED])]
    actions = machine.handleMessage((ROUTE, b"P"), [W, codec.W_FINAL, envelope(b"C2", 2), b"", b"TWO"], 0.4)
    assert sends(actions) == [] and kinds(actions, Dropped) == ["void"]
    assert [w.state.value for w in machine.workers.values()] == ["idle", "idle"]


def test_a_cancel_for_no_request_is_dropped_and_named() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    actions = machine.handleMessage((ROUTE, b"C"), [C, codec.C_CANCEL, b"echo"], 0.0)
    assert sends(actions) == [] and kinds(actions, Dropped) == ["cancel-unknown"]
    request(machine, b"C", [context(9000), b"x"], 0.0)
    machine.handleMessage((ROUTE, b"X"), [W, codec.W_FINAL, envelope(b"C", 1), b"", b"x"], 0.1)
    # the reply and the cancel crossed: nothing to do
    actions = machine.handleMessage((ROUTE, b"C"), [C, codec.C_CANCEL, b"echo"], 0.2)
    assert sends(actions) == [] and kinds(actions, Dropped) == ["cancel-unknown"]


def test_a_client_gone_while_served_has_its_request_cancelled_at_the_worker() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    request(machine, b"C", [context(9000), b"x"], 0.0)
    assert sends(machine.handlePeerGone((ROUTE, b"C"), 0.1)) == [
        (b"X", [W, codec.W_CANCEL, envelope(b"C", 1)])]


def test_a_malformed_context_is_answered_400_and_the_broker_goes_on() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    actions = request(machine, b"C", [extension.CONTEXT_MARKER + b"\ndeadline=-1", b"x"], 0.0)
    [(peer, frames)] = sends(actions)
    assert peer == b"C" and frames[4] == codec.STATUS_BAD_REQUEST and b"deadline" in frames[5]
    assert kinds(actions, Refused) == ["bad-context"]
    assert sends(request(machine, b"C", [b"x"], 0.1)) == [
        (b"X", [W, codec.W_REQUEST, envelope(b"C", 1), b"", b"x"])]


def test_mmi_extensions_names_what_the_broker_takes() -> None:
    machine = broker()
    actions = machine.handleMessage((ROUTE, b"C"), [C, codec.C_REQUEST, extension.MMI_EXTENSIONS, b""], 0.0)
    assert sends(actions) == [(b"C", [C, codec.C_FINAL, extension.MMI_EXTENSIONS, b"200",
                                      extension.FEATURES])]


# --- worker --------------------------------------------------------------------


def worker_script(handler: Any) -> tuple[Any, Any, str]:
    from mdp import Worker
    from mdp.testing import Script

    script = Script(autoConnect=True)
    pipe = script.endpoint("broker") + "#1"
    worker = Worker(script.endpoint("broker"), "echo", handler, reactor=script.clock, heartbeat=HB)
    worker.start()
    script.feed()
    return script, worker, pipe


def test_a_handler_sees_its_deadline_and_is_cancelled_when_the_broker_says_so() -> None:
    from twisted.internet import defer

    import mdp
    from mdp.testing import Elapse, Receive
    from mdp.testing import Send as ScriptSend

    seen: list[Any] = []
    pending: list[defer.Deferred[Any]] = []

    def slow(frames: list[bytes]) -> defer.Deferred[Any]:
        seen.append((mdp.current_deadline(), mdp.cancelled()))
        d: defer.Deferred[Any] = defer.Deferred(lambda _: seen.append("cancelled"))
        pending.append(d)
        return d

    script, worker, pipe = worker_script(slow)
    script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c1", b"", context(30_000), b"work"]))
    assert seen == [(30.0, False)] and worker.busy == 1
    # well before the deadline, the broker passes on the client's CANCEL
    assert script.feed(Elapse(0.4), Receive(pipe, [W, codec.W_CANCEL, b"c1"])) == [
        ScriptSend(pipe, [W, codec.W_FINAL, b"c1", b"", codec.ERROR_MARKER, extension.STATUS_CANCELLED,
                          b"cancelled by its caller"])]
    assert seen[-1] == "cancelled" and worker.busy == 0
    # a CANCEL that crossed the reply finds nothing in hand and is not an error
    assert script.feed(Receive(pipe, [W, codec.W_CANCEL, b"c1"])) == []
    # the worker is free for the next request
    script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c2", b"", b"plain"]))
    assert seen[-1] == (None, False) and worker.busy == 1


def test_a_handler_still_running_at_its_deadline_is_given_up_with_504() -> None:
    from twisted.internet import defer

    from mdp.testing import Elapse, Receive
    from mdp.testing import Send as ScriptSend

    held: list[defer.Deferred[Any]] = []
    script, worker, pipe = worker_script(lambda frames: held.append(defer.Deferred()) or held[-1])
    script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c", b"", context(250), b"work"]))
    assert script.feed(Elapse(0.2)) == []
    assert script.feed(Elapse(0.05)) == [
        ScriptSend(pipe, [W, codec.W_FINAL, b"c", b"", codec.ERROR_MARKER, extension.STATUS_DEADLINE,
                          b"its deadline passed at the worker"])]
    assert worker.busy == 0


def test_a_streaming_handler_given_up_is_closed() -> None:
    from twisted.internet import defer

    from mdp.testing import Receive

    closed: list[str] = []

    async def stream(frames: list[bytes]) -> Any:
        try:
            yield b"part"
            await defer.Deferred()  # waits for ever
        finally:
            closed.append("closed")

    script, worker, pipe = worker_script(stream)
    script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c", b"", context(9000), b"go"]))
    actions = script.feed(Receive(pipe, [W, codec.W_CANCEL, b"c"]))
    assert [list(a.frames)[5] for a in actions] == [extension.STATUS_CANCELLED]
    assert closed == ["closed"] and worker.busy == 0


def test_a_request_with_a_malformed_context_is_answered_400() -> None:
    from mdp.testing import Receive

    script, worker, pipe = worker_script(lambda frames: frames)
    [send] = script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c", b"",
                                        extension.CONTEXT_MARKER + b"\ndeadline=x", b"go"]))
    assert list(send.frames)[4:6] == [codec.ERROR_MARKER, codec.STATUS_BAD_REQUEST]
    assert worker.busy == 0


# --- client, broker and worker together ------------------------------------------


async def _broker(net: Any) -> tuple[Any, str]:
    """A broker on *net*, closed after the test, and its endpoint."""
    from mdp import Broker

    broker = Broker(net.reactor, heartbeat=HB)
    net.addCleanup(broker.close)
    return broker, (await broker.listen(net.bindEndpoint())).endpoint


def _slow_handler(net: Any, log: list[Any]) -> Any:
    """A handler that would take 30 s; it logs when it is given up, and answers at once for 'quick'."""
    from twisted.internet import defer, task

    import mdp

    async def handle(frames: list[bytes]) -> Any:
        if frames == [b"quick"]:
            return [b"quick", str(mdp.current_deadline() is not None).encode()]
        log.append(("started", net.reactor.seconds(), mdp.current_deadline()))
        try:
            return await task.deferLater(net.reactor, 30.0, lambda: [b"slow"])
        except defer.CancelledError:
            log.append(("given up", net.reactor.seconds(), mdp.cancelled()))
            raise
    return handle


async def _client_that_gives_up(kind: str, cancel: bool) -> None:
    """A client gives up (*cancel*: cancels; else times out after 1 s) on a request whose
    handler would take 30 s: the handler is given up as soon, and the worker is free."""
    from twisted.internet import defer

    from mdp import Client, RequestTimeout, Worker
    from tests.conftest import RealNet

    net = RealNet(kind)
    try:
        broker, endpoint = await _broker(net)
        log: list[Any] = []
        worker = Worker(endpoint, "slow", _slow_handler(net, log), net.reactor, heartbeat=HB)
        worker.start()
        net.addCleanup(worker.stop)
        client = Client(endpoint, net.reactor, timeout=1.0, retries=1)
        net.addCleanup(client.close)
        await net.wait(client.request("slow", b"quick"))  # (went while the client asked the broker)
        await net.until(lambda: client.machine.extended is not None)
        assert client.machine.extended is True
        assert await net.wait(client.request("slow", b"quick")) == [b"quick", b"True"]
        d = client.request("slow", b"work")
        await net.until(lambda: log != [])
        if cancel:
            d.cancel()
            gaveUpAt = net.reactor.seconds()
            with pytest.raises(defer.CancelledError):
                await net.wait(d)
        else:
            with pytest.raises(RequestTimeout):
                await net.wait(d)
            gaveUpAt = net.reactor.seconds()
        await net.until(lambda: len(log) == 2)
        (_, started, deadline), (_, givenUpAt, flagged) = log
        assert 0.9 < deadline <= 1.0 and flagged
        # the handler heard within a fraction of a second of its caller giving up, and the
        # worker serves the next request
        assert givenUpAt - gaveUpAt < 0.5
        assert await net.wait(client.request("slow", b"quick")) == [b"quick", b"True"]
        assert worker.busy == 0
    finally:
        await net.cleanup()


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_a_handler_is_given_up_when_its_client_cancels(kind: str) -> None:
    await _client_that_gives_up(kind, cancel=True)


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_a_handler_is_given_up_when_its_client_times_out(kind: str) -> None:
    await _client_that_gives_up(kind, cancel=False)


async def _deadline_stack(
        net: Any, maxConnections: int, slack: float = 0.0) -> tuple[Any, Any, list[float]]:
    """A broker, a worker whose handler takes 20 ms, and a client whose attempts last 50 ms,
    which has learnt that the broker takes the extension; and the list in which the handler
    notes by how much it started past its request's deadline.  *slack* allows for the real
    time between the worker's last look at the deadline and the handler's start, in which a
    loaded machine may preempt the process."""
    from twisted.internet import task

    from mdp import Client, Worker, handlers

    lateStarts: list[float] = []

    def twentyMs(frames: list[bytes]) -> Any:
        scope = handlers._serving.get()  # the exact deadline: current_deadline() stops at 0
        if scope is None:  # (no context: sent before the client learnt of the extension)
            return task.deferLater(net.reactor, 0.02, lambda: frames)
        lateBy = scope.clock() - scope.job.deadline
        if lateBy >= slack:
            lateStarts.append(lateBy)
        return task.deferLater(net.reactor, 0.02, lambda: frames)

    broker, endpoint = await _broker(net)
    worker = Worker(endpoint, "slow", twentyMs, net.reactor, heartbeat=HB)
    worker.start()
    net.addCleanup(worker.stop)
    client = Client(endpoint, net.reactor, timeout=0.05, retries=1, maxConnections=maxConnections)
    net.addCleanup(client.close)
    for _ in range(20):  # (the first goes while the client asks the broker)
        if client.machine.extended is not None:
            break
        await net.wait(client.request("slow", b"warm"))
    assert client.machine.extended
    return broker, client, lateStarts


@pytest_twisted.ensureDeferred
async def test_requests_that_cannot_be_served_in_their_deadline_fail_fast_and_never_start() -> None:
    """1,000 requests with a 50 ms deadline to one worker that takes 20 ms each (loopback,
    on a Clock): no handler starts past its request's deadline, and each request fails by
    its deadline: with DeadlineExceeded from the broker, or its own timeout at that instant
    (the broker drops it then all the same)."""

    from mdp import DeadlineExceeded, RequestTimeout
    from tests.conftest import LoopbackNet

    net = LoopbackNet()
    net.step = 0.005
    try:
        broker, client, lateStarts = await _deadline_stack(net, 1_000)
        sentAt = net.reactor.seconds()
        outcomes: list[Any] = []
        for n in range(1_000):
            client.request("slow", b"%d" % n).addBoth(
                lambda r: outcomes.append((net.reactor.seconds(), r)))
        net.advance(0.06)
        assert len(outcomes) == 1_000
        served = [r for _, r in outcomes if isinstance(r, list)]
        failed = [r.value for _, r in outcomes if not isinstance(r, list)]
        assert 2 <= len(served) <= 3 and lateStarts == []  # 50 ms of a 20 ms worker
        assert {type(e) for e in failed} <= {DeadlineExceeded, RequestTimeout}
        assert max(t for t, _ in outcomes) - sentAt <= 0.05 + net.step
        assert broker.queued == 0
    finally:
        await net.cleanup()


# --- trace context ---------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_call_through_two_services_is_one_trace_of_client_broker_and_worker_spans() -> None:
    """With OpenTelemetry: the client's call, the broker's queue wait and the handler make one
    tree, and a call the handler makes to a second service joins it."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mdp import Client, Worker, tracing
    from tests.conftest import LoopbackNet

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.reset()

    net = LoopbackNet()
    try:
        broker, endpoint = await _broker(net)
        inner = Client(endpoint, net.reactor)
        net.addCleanup(inner.close)

        async def front(frames: list[bytes]) -> list[bytes]:
            return [b"front"] + await inner.request("back", *frames)

        for service, handler in (("front", front), ("back", lambda frames: [b"back"] + frames)):
            worker = Worker(endpoint, service, handler, net.reactor, heartbeat=HB)
            worker.start()
            net.addCleanup(worker.stop)
        client = Client(endpoint, net.reactor)
        net.addCleanup(client.close)
        for each in (client, inner):  # (each learns that the broker takes contexts)
            await net.wait(each.request("back", b"warm"))
            await net.until(lambda each=each: each.machine.extended is not None)
        exporter.clear()
        assert await net.wait(client.request("front", b"x")) == [b"front", b"back", b"x"]
        spans = {span.name: span for span in exporter.get_finished_spans()}
        assert sorted(spans) == ["mdp.handle back", "mdp.handle front", "mdp.queue back",
                                 "mdp.queue front", "mdp.request back", "mdp.request front"]
        assert len({span.context.trace_id for span in spans.values()}) == 1
        parent = {name: span.parent.span_id if span.parent else None for name, span in spans.items()}
        ids = {name: span.context.span_id for name, span in spans.items()}
        assert parent["mdp.request front"] is None
        assert parent["mdp.queue front"] == parent["mdp.handle front"] == ids["mdp.request front"]
        assert parent["mdp.request back"] == ids["mdp.handle front"]
        assert parent["mdp.queue back"] == parent["mdp.handle back"] == ids["mdp.request back"]
    finally:
        exporter.shutdown()  # (the provider stays this process's: later spans go nowhere)
        await net.cleanup()


def test_a_passive_broker_answers_mmi_extensions_and_takes_it_for_no_vote() -> None:
    """Asking for the extensions is no client's vote for a Binary Star failover."""
    votes: list[float] = []

    class Passive:
        def admitClient(self, now: float) -> bool:
            votes.append(now)
            return False

        def admitWorker(self, now: float) -> bool:
            return False

        def status(self, now: float) -> dict[str, Any]:
            return {"state": "passive", "serving": False}

    machine = BrokerMachine(heartbeat=HB, admission=Passive())
    actions = machine.handleMessage((ROUTE, b"C"), [C, codec.C_REQUEST, extension.MMI_EXTENSIONS, b""], 1.0)
    assert sends(actions) == [(b"C", [C, codec.C_FINAL, extension.MMI_EXTENSIONS, b"200",
                                      extension.FEATURES])]
    assert votes == []
    machine.handleMessage((ROUTE, b"C"), [C, codec.C_REQUEST, b"echo", b"x"], 2.0)
    assert votes == [2.0]  # (a request for a service is one)


def test_a_worker_asks_for_the_extensions_before_its_ready_and_not_where_that_cost_it() -> None:
    """Our worker declares the extension by asking ``mmi.extensions`` before READY; a broker
    that drops the connection for it (one that takes no client command from a worker) is
    sent READY alone from then on."""
    from mdp.majordomo.worker import SendToBroker, WorkerMachine

    machine = WorkerMachine(["a"], b"echo", heartbeat=HB)
    machine.handleStart(0.0)
    assert machine.handlePipeUp(0.1) == [SendToBroker(extension.ASK_EXTENSIONS),
                                         SendToBroker([W, codec.W_READY, b"echo"])]
    # the answer, whatever it says, is no message for the worker
    assert machine.handleMessage([C, codec.C_FINAL, extension.MMI_EXTENSIONS, b"501"], 0.2) == []
    machine.handlePipeLost(0.3)
    assert machine.handlePipeUp(0.4)[0] == SendToBroker(extension.ASK_EXTENSIONS)
    machine.handlePipeLost(0.5)  # lost before the broker said a thing: once may be bad luck
    assert machine.handlePipeUp(0.6)[0] == SendToBroker(extension.ASK_EXTENSIONS)
    machine.handlePipeLost(0.7)  # twice in a row: that broker is not asked again
    assert machine.handlePipeUp(0.8) == [SendToBroker([W, codec.W_READY, b"echo"])]


def test_a_worker_on_a_worker_only_endpoint_may_ask_for_the_extensions() -> None:
    machine = broker()
    actions = machine.handleMessage((ROUTE, b"X"), extension.ASK_EXTENSIONS, 0.0, clients=False)
    assert sends(actions) == [(b"X", [C, codec.C_FINAL, extension.MMI_EXTENSIONS, b"200",
                                      extension.FEATURES])]
    machine.handleMessage((ROUTE, b"X"), [W, codec.W_READY, b"echo"], 0.0, clients=False)
    assert machine.workers[(ROUTE, b"X")].extended
    [dropped, _] = machine.handleMessage((ROUTE, b"C"), [C, codec.C_REQUEST, b"echo", b"x"], 0.1,
                                         clients=False)
    assert dropped.kind == "wrong-endpoint"  # any other client command is refused there


# --- what a read-through of the extension found ------------------------------------


def test_the_broker_holds_no_refused_or_answered_request_for_a_cancel() -> None:
    machine = broker(maxServiceQueue=1)
    ready(machine, b"X", extended=True)
    request(machine, b"C1", [context(9000), b"one"], 0.0)  # to X
    request(machine, b"C2", [context(9000), b"two"], 0.0)  # queued
    request(machine, b"C3", [context(9000), b"x" * 1000], 0.0)  # 429: the queue is full
    assert set(machine._latest) == {(ROUTE, b"C1"), (ROUTE, b"C2")}
    machine.handleMessage((ROUTE, b"X"), [W, codec.W_FINAL, envelope(b"C1", 1), b"", b"ONE"], 0.1)
    assert set(machine._latest) == {(ROUTE, b"C2")}  # C1 answered; C2 now with X


def test_a_request_cancelled_while_its_worker_dies_is_not_run_again() -> None:
    machine = broker()
    ready(machine, b"X", extended=True)
    request(machine, b"C", [context(9000), b"x"], 0.0)
    machine.handleMessage((ROUTE, b"C"), [C, codec.C_CANCEL, b"echo"], 0.1)  # X told
    actions = machine.handleMessage((ROUTE, b"X"), [W, codec.W_DISCONNECT], 0.2)  # X goes first
    assert [(p, f[:5]) for p, f in sends(actions)] == [
        (b"C", [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_CANCELLED])]
    ready(machine, b"Y", extended=True, now=0.3)
    assert machine.queued == 0 and machine.workers[(ROUTE, b"Y")].current is None


def test_the_size_check_counts_the_context_an_extended_worker_gets() -> None:
    from mdp.policy import Limits

    machine = broker(limits=Limits(maxMessageBytes=1000))
    ready(machine, b"X", extended=True)
    body = [context(9000, traceparent=TRACEPARENT), b"x" * 900]
    [(peer, frames)] = sends(request(machine, b"C", body, 0.0))
    assert peer == b"C" and frames[4] == codec.STATUS_TOO_LARGE  # not sent on, over the limit


def test_a_client_sends_a_context_and_a_cancel_only_where_its_broker_takes_them() -> None:
    from mdp.majordomo.client_machine import CancelOn, ClientMachine, OpenChannel, SendOn

    machine = ClientMachine(["a", "b"], timeout=1e6, retries=1, maxConnections=4)
    machine.extended = True  # (as if "a" had answered mmi.extensions)
    call = machine.newCall("echo", [b"x"], None, None, None, None, 0.0)
    [channel] = [a.channel for a in machine.handleRequest(call, 0.0) if type(a) is OpenChannel]
    [sent] = [a for a in machine.handlePipeUp(channel, 0.1) if type(a) is SendOn]
    # a timeout of a million seconds still makes a deadline the broker takes (a week at most)
    assert extension.decode_context(sent.frames[3]).deadline == extension.MAX_DEADLINE_MS
    # the client moves on to "b", which takes the extension too; "a"'s pipe comes back:
    # what goes to "a" again goes without a context, and no CANCEL follows it
    machine._moveOn()
    machine.extended = True
    machine.handlePipeLost(channel, None, 0.2)
    [resent] = [a for a in machine.handlePipeUp(channel, 0.3) if type(a) is SendOn]
    assert resent.frames == [C, codec.C_REQUEST, b"echo", b"x"]
    assert [a for a in machine.handleCancel(call, 0.4) if type(a) is CancelOn] == []


def test_a_504_ends_the_attempt_and_the_client_tries_again() -> None:
    from mdp.majordomo.client_machine import ClientMachine, Fail, OpenChannel, Retrying

    machine = ClientMachine(["a"], timeout=1.0, retries=2, maxConnections=4, extensions=False)
    call = machine.newCall("echo", [b"x"], None, None, None, None, 0.0)
    [channel] = [a.channel for a in machine.handleRequest(call, 0.0) if type(a) is OpenChannel]
    machine.handlePipeUp(channel, 0.0)
    late = [C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, extension.STATUS_DEADLINE, b"late"]
    actions = machine.handleMessage(channel, late, 0.999)
    assert [type(a) for a in actions if type(a) in (Retrying, Fail)] == [Retrying]
    machine.handlePipeUp(channel, 1.0)
    actions = machine.handleMessage(channel, late, 1.999)  # the last attempt: the call fails
    [fail] = [a for a in actions if type(a) is Fail]
    assert type(fail.error).__name__ == "DeadlineExceeded"


@pytest_twisted.ensureDeferred
async def test_what_a_handler_started_sees_no_deadline_once_its_request_is_answered() -> None:
    from twisted.internet import defer

    import mdp
    from mdp.testing import Receive

    later: list[defer.Deferred[None]] = []
    seen: list[Any] = []

    async def background() -> None:
        await later[-1]
        seen.append((mdp.current_deadline(), mdp.cancelled()))

    def handler(frames: list[bytes]) -> list[bytes]:
        later.append(defer.Deferred())
        defer.ensureDeferred(background())  # outlives the request
        return frames

    script, worker, pipe = worker_script(handler)
    script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c", b"", context(5000), b"x"]))
    later[-1].callback(None)
    assert seen == [(None, False)]


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_ten_thousand_requests_with_a_50ms_deadline_to_one_20ms_worker(kind: str) -> None:
    """Over real sockets: no handler starts after its request's deadline, and every request
    that could not be served fails with a typed error soon after its deadline."""
    from twisted.internet import task

    from mdp import DeadlineExceeded, RequestTimeout
    from tests.conftest import RealNet

    net = RealNet(kind)
    try:
        broker, client, lateStarts = await _deadline_stack(net, 10_000, slack=0.01)
        outcomes: list[Any] = []
        sent = []
        for batch in range(50):  # 200 every 10 ms: a steady load the worker cannot keep up with
            for n in range(batch * 200, batch * 200 + 200):
                sent.append(net.reactor.seconds())
                client.request("slow", b"%d" % n).addBoth(
                    lambda r, n=n: outcomes.append((n, net.reactor.seconds(), r)))
            await task.deferLater(net.reactor, 0.01, lambda: None)
        await net.until(lambda: len(outcomes) == 10_000, timeout=60)
        failed = [r.value for _, _, r in outcomes if not isinstance(r, list)]
        assert lateStarts == [] and len(failed) > 9_000  # (the worker serves some 25)
        assert {type(e) for e in failed} <= {DeadlineExceeded, RequestTimeout}
        # each ended soon after its own deadline (none waited for the worker to get to it)
        late = max(t - (sent[n] + 0.05) for n, t, r in outcomes if not isinstance(r, list))
        assert late < 2.0, late
        await net.until(lambda: broker.queued == 0, timeout=10)
    finally:
        await net.cleanup()


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_processes_a_handler_hears_its_client_give_up_and_the_worker_serves_on(
        kind: str, tmp_path: Any) -> None:
    """``twist mdp-broker`` and ``twist mdp-worker`` processes: a client whose 1 s attempt
    runs out on a request whose handler would take 30 s: the handler is given up at once,
    and the worker serves the next request."""
    import os
    import time

    from mdp import Client, DeadlineExceeded, RequestTimeout
    from tests.procs import BROKER_HB, WORKER_HB, bounded, reactor, twist_broker, twist_worker, wait_until

    binds = {"tcp": "tcp:host=127.0.0.1:port=0", "zmq": "zmq:tcp://127.0.0.1:*"}
    broker, endpoint = await twist_broker(reactor(), binds[kind], *BROKER_HB)
    worker = twist_worker(reactor(), endpoint, "slow", "tests.handlers_for_tests:until_cancelled",
                          *WORKER_HB)
    client = Client(endpoint, reactor(), timeout=1.0, retries=1)
    heard = tmp_path / "heard"
    try:
        await bounded(worker.waitFor("sent READY"), 60)
        while client.machine.extended is None:
            await bounded(client.request("slow", b"quick"), 30)
        assert client.machine.extended
        # (the worker's own deadline ends the request at the same moment: on a busy machine
        # its 504 may reach the client before the client's timer fires)
        with pytest.raises((RequestTimeout, DeadlineExceeded)):
            await bounded(client.request("slow", str(heard).encode()), 30)
        gaveUp = time.time()
        await wait_until(lambda: os.path.exists(heard) and os.path.getsize(heard) > 0, 10)
        at, left = heard.read_text().split()
        assert float(at) - gaveUp < 0.5 and 0.9 < float(left) <= 1.0
        assert await bounded(client.request("slow", b"quick"), 30) == [b"quick"]
    finally:
        await client.close()
        await worker.stop()
        await broker.stop()


@pytest.mark.parametrize("kind", ["tcp", "zmq"])
@pytest_twisted.ensureDeferred
async def test_processes_ten_thousand_requests_with_a_50ms_deadline(kind: str,
                                                                   tmp_path: Any) -> None:
    """The same as over sockets in one process, with ``twist`` broker and worker processes:
    no handler starts without its deadline or past it; the unserved fail by their deadline."""
    from twisted.internet import defer, task

    from mdp import Client, DeadlineExceeded, RequestTimeout
    from tests.procs import BROKER_HB, WORKER_HB, bounded, reactor, twist_broker, twist_worker

    binds = {"tcp": "tcp:host=127.0.0.1:port=0", "zmq": "zmq:tcp://127.0.0.1:*"}
    broker, endpoint = await twist_broker(reactor(), binds[kind], *BROKER_HB)
    worker = twist_worker(reactor(), endpoint, "slow", "tests.handlers_for_tests:twenty_ms_on_time",
                          *WORKER_HB)
    client = Client(endpoint, reactor(), timeout=0.05, retries=1, maxConnections=10_000)
    late = tmp_path / "late"
    try:
        await bounded(worker.waitFor("sent READY"), 60)
        while client.machine.extended is None:
            await bounded(client.request("slow", b"warm").addErrback(lambda f: None), 30)
        assert client.machine.extended
        pending = []
        for _ in range(50):  # 200 every 10 ms
            pending += [client.request("slow", str(late).encode()) for _ in range(200)]
            await task.deferLater(reactor(), 0.01, lambda: None)
        outcomes = await bounded(defer.DeferredList(pending, consumeErrors=True), 60)
        failed = [r.value for ok, r in outcomes if not ok]
        assert len(failed) > 9_000 and {type(e) for e in failed} <= {DeadlineExceeded, RequestTimeout}
        assert not late.exists(), late.read_text()[:500]
        served = (tmp_path / "late.started").read_text().count("started")
        assert served >= 5  # the worker was kept busy (a handler past its deadline is given up)
    finally:
        await client.close()
        await worker.stop()
        await broker.stop()


SPARK_TASK = """
import sys
from mdp.spark import ServiceCall, call_many
call = ServiceCall("slow", (sys.argv[1],), timeout=30, retries=1, window=4)
for _ in range(3):  # (the blocking client reads the broker's answer to its question in a call)
    call_many(call, [[b"quick"]])
call_many(call, [[sys.argv[2].encode()]])
"""


@pytest_twisted.ensureDeferred
async def test_a_spark_task_killed_mid_request_has_its_handler_given_up(tmp_path: Any) -> None:
    """What a Spark executor runs (``mdp.spark.call_many``, the blocking client), killed as
    Spark kills a task's Python worker while its request is served: over TCP the broker sees
    the connection go and the worker gives the handler up."""
    import os
    import signal
    import sys

    from tests.procs import (
        BROKER_HB,
        ENV,
        WORKER_HB,
        Process,
        bounded,
        reactor,
        twist_broker,
        twist_worker,
        wait_until,
    )

    broker, endpoint = await twist_broker(reactor(), "tcp:host=127.0.0.1:port=0", *BROKER_HB)
    worker = twist_worker(reactor(), endpoint, "slow", "tests.handlers_for_tests:until_cancelled",
                          *WORKER_HB)
    heard = tmp_path / "heard"
    task = None
    try:
        await bounded(worker.waitFor("sent READY"), 60)
        task = Process(reactor(), [sys.executable, "-c", SPARK_TASK, endpoint, str(heard)], ENV)
        await wait_until(lambda: os.path.exists(str(heard) + ".started"), 30)
        task.signalProcess(signal.SIGKILL)
        await wait_until(lambda: heard.exists() and heard.stat().st_size > 0, 10)
    finally:
        if task is not None:
            await task.stop()
        await worker.stop()
        await broker.stop()
