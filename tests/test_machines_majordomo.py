"""The Majordomo state machines driven by lists of events (mdp.testing.Script):
recording stand-ins for transports, a Clock for the reactor: every action and
its time exact."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from twisted.python.failure import Failure

from mdp import Backoff, Broker, Client, HeartbeatPolicy, Worker
from mdp.errors import RequestTimeout, StreamRestarted
from mdp.majordomo import codec
from mdp.majordomo.broker_records import WorkerState as BrokerWorkerState
from mdp.majordomo.client_machine import CallState
from mdp.majordomo.worker import WorkerState
from mdp.testing import Close, Connected, Disconnect, Elapse, Lost, Open, Receive, Script, Send

HB = HeartbeatPolicy(interval=1.0, liveness=3)  # dead after more than 3 s of silence

W, C = codec.WORKER_HEADER, codec.CLIENT_HEADER
READY = (W, codec.W_READY, b"echo")
HEARTBEAT = (W, codec.W_HEARTBEAT)
DISCONNECT = (W, codec.W_DISCONNECT)


def envelope(client: bytes, assignment: int) -> bytes:
    """The client address frame of the broker's *assignment*-th REQUEST."""
    return client + assignment.to_bytes(8, "big")


def upper(frames: list[bytes]) -> list[bytes]:
    return [f.upper() for f in frames]


def outcome(d: Any) -> list[Any]:
    box: list[Any] = []
    d.addBoth(box.append)
    return box


# --- broker --------------------------------------------------------------------


def broker_script(**kwargs: Any) -> tuple[Script, Broker]:
    script = Script()
    broker = Broker(reactor=script.clock, heartbeat=HB, **kwargs)
    broker.listen(script.endpoint("broker"))
    return script, broker


def worker_states(broker: Broker) -> dict[bytes, BrokerWorkerState]:
    return {key[1]: ref.state for key, ref in broker.workers.items()}


def test_broker_hands_a_request_to_a_ready_worker_under_an_envelope() -> None:
    script, broker = broker_script()
    assert script.feed(Receive(b"W", READY)) == []
    assert worker_states(broker) == {b"W": BrokerWorkerState.IDLE}
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"])) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"C", 1), b"", b"hi"])]
    assert worker_states(broker) == {b"W": BrokerWorkerState.BUSY}
    # a PARTIAL and the FINAL under that envelope go to the client
    assert script.feed(Receive(b"W", [W, codec.W_PARTIAL, envelope(b"C", 1), b"", b"h"]),
                       Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"])) == [
        Send(b"C", [C, codec.C_PARTIAL, b"echo", b"h"]),
        Send(b"C", [C, codec.C_FINAL, b"echo", b"HI"])]
    assert worker_states(broker) == {b"W": BrokerWorkerState.IDLE}
    # a second FINAL for the same assignment is dropped: it never reaches the client
    assert script.feed(Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"again"])) == []
    # the next request gets an envelope of its own
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"echo", b"two"])) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"C", 2), b"", b"two"])]


def test_broker_requeues_the_request_of_a_silent_worker_to_another() -> None:
    script, broker = broker_script()
    script.feed(Receive(b"W1", READY), Receive(b"W2", READY))
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"])) == [
        Send(b"W1", [W, codec.W_REQUEST, envelope(b"C", 1), b"", b"hi"])]
    # W2 speaks at 2.5 s, W1 never does: heartbeats go to both at 1, 2 and 3 s
    assert script.feed(Elapse(2.5), Receive(b"W2", HEARTBEAT)) == [
        Send(b"W1", HEARTBEAT), Send(b"W2", HEARTBEAT)] * 2
    # at 4 s W1 has been silent for more than 3 s: gone, its request goes to W2
    assert script.feed(Elapse(1.5)) == [
        Send(b"W1", HEARTBEAT), Send(b"W2", HEARTBEAT),
        Send(b"W2", [W, codec.W_REQUEST, envelope(b"C", 2), b"", b"hi"])]
    assert worker_states(broker) == {b"W2": BrokerWorkerState.BUSY}
    # W1's late reply completes nothing: it is told to go away
    assert script.feed(Receive(b"W1", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"late"])) == [
        Send(b"W1", DISCONNECT), Disconnect(b"W1")]
    assert script.feed(Receive(b"W2", [W, codec.W_FINAL, envelope(b"C", 2), b"", b"HI"])) == [
        Send(b"C", [C, codec.C_FINAL, b"echo", b"HI"])]


def test_a_late_reply_of_a_worker_given_up_answers_its_request_still_queued() -> None:
    """A worker whose handler blocked its reactor looks dead to the broker;
    its reply, when it comes, answers the request if no other worker took
    it, so the request does not run again (and block again)."""
    script, broker = broker_script()
    script.feed(Receive(b"W", READY))
    script.feed(Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"]))
    script.feed(Elapse(4.0))  # W silent for more than 3 s: given up, its request queued again
    assert broker.workers == {} and broker.queued == 1
    assert script.feed(Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"])) == [
        Send(b"C", [C, codec.C_FINAL, b"echo", b"HI"]), Send(b"W", DISCONNECT), Disconnect(b"W")]
    assert broker.queued == 0
    # registered again, it gets nothing to run twice
    assert script.feed(Receive(b"W", READY)) == []
    assert worker_states(broker) == {b"W": BrokerWorkerState.IDLE}
    # a second copy of that reply is no answer to anything
    assert script.feed(Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"])) == [
        Send(b"W", DISCONNECT), Disconnect(b"W")]


def test_a_late_partial_or_a_streamed_reply_does_not_count_as_an_answer() -> None:
    """Only a FINAL of a reply that streamed nothing answers late: after
    PARTIALs the client was told the reply starts over."""
    script, broker = broker_script()
    script.feed(Receive(b"W", READY), Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"]))
    assert script.feed(Receive(b"W", [W, codec.W_PARTIAL, envelope(b"C", 1), b"", b"h"])) == [
        Send(b"C", [C, codec.C_PARTIAL, b"echo", b"h"])]
    assert script.feed(Elapse(4.0)) == [Send(b"W", HEARTBEAT)] * 3 + [
        Send(b"C", [C, codec.C_PARTIAL, b"echo", codec.RESTART_MARKER])]
    assert script.feed(Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"])) == [
        Send(b"W", DISCONNECT), Disconnect(b"W")]
    assert broker.queued == 1


def test_broker_answers_503_for_a_service_no_worker_registered_in_time() -> None:
    """MDP/0.2: requests for a service no worker registered are queued, and
    expired after a configurable time: ``unknownServiceExpiry`` (5 s), from
    the service's first request, so that a client retrying every 2.5 s hears
    the 503 within its default 3 attempts."""
    script, broker = broker_script()
    assert script.feed(Receive(b"C0", [C, codec.C_REQUEST, b"nosuch", b"0"])) == []
    # a client that retries on a new connection (the old one closed) keeps the window
    assert script.feed(Elapse(1.0), Lost(b"C0")) == []
    assert script.feed(Elapse(1.0), Receive(b"C1", [C, codec.C_REQUEST, b"nosuch", b"1"])) == []
    assert script.feed(Elapse(0.5), Receive(b"C2", [C, codec.C_REQUEST, b"nosuch", b"2"])) == []
    assert script.feed(Elapse(2.49)) == []
    unavailable = [C, codec.C_FINAL, b"nosuch", codec.ERROR_MARKER, codec.STATUS_UNAVAILABLE,
                   b"no worker for service 'nosuch': none registered within 5s"]
    assert script.feed(Elapse(0.01)) == [Send(b"C1", unavailable), Send(b"C2", unavailable)]
    assert broker.queued == 0 and b"nosuch" not in broker.services
    # a later request waits afresh, and a worker that comes in time serves it
    assert script.feed(Elapse(10), Receive(b"C1", [C, codec.C_REQUEST, b"nosuch", b"3"])) == []
    script.feed(Elapse(4.9))
    assert script.feed(Receive(b"W", (W, codec.W_READY, b"nosuch"))) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"C1", 1), b"", b"3"])]
    # past the window, the request in hand is not answered by the broker
    assert script.feed(Elapse(1.0), Receive(b"W", HEARTBEAT)) == []
    assert worker_states(broker) == {b"W": BrokerWorkerState.BUSY}


def test_unknown_service_expiry_is_positive() -> None:
    with pytest.raises(ValueError, match="unknownServiceExpiry"):
        Broker(unknownServiceExpiry=0)


def test_broker_answers_503_to_a_request_queued_past_its_expiry() -> None:
    script, broker = broker_script(requestExpiry=5.0, unknownServiceExpiry=60.0)
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"nobody", b"hi"])) == []
    assert broker.queued == 1
    assert script.feed(Elapse(4.9)) == []
    assert script.feed(Elapse(0.1)) == [Send(b"C", [
        C, codec.C_FINAL, b"nobody", codec.ERROR_MARKER, codec.STATUS_UNAVAILABLE,
        b"no worker for service 'nobody': none registered within 5s"])]
    assert broker.queued == 0


def test_broker_heartbeats_on_its_tick_only_to_workers_it_has_not_just_sent_to() -> None:
    script, broker = broker_script()
    assert script.nextWake() == 1.0  # the tick starts with the first binding
    script.feed(Receive(b"W", READY))
    assert script.feed(Elapse(1.0)) == [Send(b"W", HEARTBEAT)]
    assert script.nextWake() == 2.0
    # a REQUEST at 1.7 s counts as traffic: no heartbeat at 2 s (0.3 s < half an interval)
    assert script.feed(Elapse(0.7), Receive(b"C", [C, codec.C_REQUEST, b"echo", b"x"])) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"C", 1), b"", b"x"])]
    assert script.feed(Elapse(0.3), Receive(b"W", HEARTBEAT)) == []
    assert script.nextWake() == 3.0
    assert script.feed(Elapse(1.0)) == [Send(b"W", HEARTBEAT)]
    broker.close()
    assert script.nextWake() is None


def test_broker_refuses_ready_beyond_its_worker_limit() -> None:
    script, broker = broker_script(maxWorkers=1)
    assert script.feed(Receive(b"W1", READY)) == []
    assert script.feed(Receive(b"W2", READY)) == [Send(b"W2", DISCONNECT), Disconnect(b"W2")]
    assert list(worker_states(broker)) == [b"W1"]


# --- worker --------------------------------------------------------------------


def test_worker_sends_ready_when_its_pipe_is_up_and_answers_a_request() -> None:
    script = Script()
    pipe = script.endpoint("broker") + "#1"
    worker = Worker(script.endpoint("broker"), "echo", upper, reactor=script.clock, heartbeat=HB,
                    extensions=False)
    worker.start()
    assert script.actions == [Open(pipe)]
    assert worker.state is WorkerState.CONNECTING
    assert script.feed(Connected(pipe)) == [Send(pipe, READY)]
    assert worker.state is WorkerState.READY
    assert script.feed(Receive(pipe, [W, codec.W_REQUEST, b"client", b"", b"hi", b"there"])) == [
        Send(pipe, [W, codec.W_FINAL, b"client", b"", b"HI", b"THERE"])]
    assert worker.requestsServed == 1


def test_worker_streams_partials_then_a_final() -> None:
    from mdp import Final

    def count(frames: list[bytes]) -> Any:
        yield b"1"
        yield b"2"
        yield Final(b"done")

    script = Script(autoConnect=True)
    pipe = script.endpoint("broker") + "#1"
    Worker(script.endpoint("broker"), "echo", count, reactor=script.clock, heartbeat=HB,
           extensions=False).start()
    script.feed()
    assert script.feed(Receive(pipe, [W, codec.W_REQUEST, b"c", b"", b"go"])) == [
        Send(pipe, [W, codec.W_PARTIAL, b"c", b"", b"1"]),
        Send(pipe, [W, codec.W_PARTIAL, b"c", b"", b"2"]),
        Send(pipe, [W, codec.W_FINAL, b"c", b"", b"done"])]


def test_worker_fails_over_to_the_next_broker_after_silence_with_backoff() -> None:
    script = Script(autoConnect=True)
    first, second = script.endpoint("b1"), script.endpoint("b2")
    worker = Worker([first, second], "echo", upper, reactor=script.clock, heartbeat=HB, extensions=False,
                    backoff=Backoff(initial=1.0, maximum=32.0))
    worker.start()
    assert script.feed() == [Send(first + "#1", READY)]
    # heartbeats at 1, 2, 3 s; at 3.5 s (a tick every half interval) the broker
    # has been silent for more than 3 s
    # and another broker is there to try: at once
    assert script.feed(Elapse(3.5)) == [Send(first + "#1", HEARTBEAT)] * 3 + [
        Close(first + "#1"), Open(second + "#1"), Send(second + "#1", READY)]
    assert worker.state is WorkerState.READY and worker.endpoint == second
    # silent again: gone at 7 s, and now the delay is backoff.delay(0) = 1 s, back to the first
    assert script.feed(Elapse(3.5)) == [Send(second + "#1", HEARTBEAT)] * 3 + [Close(second + "#1")]
    assert script.feed(Elapse(0.99)) == []
    assert script.feed(Elapse(0.01)) == [Open(first + "#2"), Send(first + "#2", READY)]
    # the broker speaks: the backoff starts over
    script.feed(Receive(first + "#2", HEARTBEAT))
    assert worker.machine.failures == 0


def test_worker_registers_again_after_disconnect_backing_off_while_refused() -> None:
    script = Script(autoConnect=True)
    broker = script.endpoint("broker")
    worker = Worker(broker, "echo", upper, reactor=script.clock, heartbeat=HB, extensions=False,
                    backoff=Backoff(initial=1.0, maximum=32.0))
    worker.start()
    script.feed()
    # the first DISCONNECT: a fresh pipe at once
    assert script.feed(Receive(broker + "#1", DISCONNECT)) == [
        Close(broker + "#1"), Open(broker + "#2"), Send(broker + "#2", READY)]
    # DISCONNECT again before anything else (a broker at its worker limit): 1 s, then 2 s
    assert script.feed(Receive(broker + "#2", DISCONNECT)) == [Close(broker + "#2")]
    assert worker.state is WorkerState.BACKING_OFF
    assert script.feed(Elapse(0.99)) == []
    assert script.feed(Elapse(0.01)) == [Open(broker + "#3"), Send(broker + "#3", READY)]
    assert script.feed(Receive(broker + "#3", DISCONNECT)) == [Close(broker + "#3")]
    assert script.feed(Elapse(1.99)) == []
    assert script.feed(Elapse(0.01)) == [Open(broker + "#4"), Send(broker + "#4", READY)]
    # a HEARTBEAT means it is registered: the next DISCONNECT reconnects at once again
    script.feed(Receive(broker + "#4", HEARTBEAT))
    assert script.feed(Receive(broker + "#4", DISCONNECT)) == [
        Close(broker + "#4"), Open(broker + "#5"), Send(broker + "#5", READY)]


def test_worker_stop_says_disconnect_and_closes() -> None:
    script = Script(autoConnect=True)
    pipe = script.endpoint("broker") + "#1"
    worker = Worker(script.endpoint("broker"), "echo", upper, reactor=script.clock, heartbeat=HB,
                    extensions=False)
    worker.start()
    script.feed()
    mark = len(script.actions)
    worker.stop()
    assert script.actions[mark:] == [Send(pipe, DISCONNECT), Close(pipe)]
    assert worker.state is WorkerState.STOPPED and script.nextWake() is None


# --- client --------------------------------------------------------------------


def request(service: bytes, *body: bytes) -> list[bytes]:
    return [C, codec.C_REQUEST, service, *body]


def test_client_sends_a_request_once_its_pipe_is_up_and_fires_on_the_reply() -> None:
    script = Script()
    pipe = script.endpoint("broker") + "#1"
    client = Client(script.endpoint("broker"), reactor=script.clock, timeout=1.0, retries=3,
                    extensions=False)
    result = outcome(client.request("echo", b"hi"))
    assert script.actions == [Open(pipe)]  # nothing is handed to a pipe that is down
    assert script.feed(Connected(pipe)) == [Send(pipe, request(b"echo", b"hi"))]
    assert script.feed(Receive(pipe, [C, codec.C_FINAL, b"echo", b"HI"])) == []
    assert result == [[b"HI"]]
    # the timer, left armed, finds nothing to do at the old deadline and stops
    assert script.feed(Elapse(1.0)) == [] and script.nextWake() is None


def test_client_retries_on_a_fresh_pipe_then_times_out() -> None:
    script = Script(autoConnect=True)
    broker = script.endpoint("broker")
    client = Client(broker, reactor=script.clock, timeout=1.0, retries=3,
                    extensions=False)
    result = outcome(client.request("echo", b"hi"))
    assert script.feed() == [Send(broker + "#1", request(b"echo", b"hi"))]
    # each attempt has 1 s: its connection is thrown away, the request resent on a new one
    assert script.feed(Elapse(0.99)) == []
    assert script.feed(Elapse(0.01)) == [
        Close(broker + "#1"), Open(broker + "#2"), Send(broker + "#2", request(b"echo", b"hi"))]
    # a late reply on the discarded connection never reaches the caller
    assert script.feed(Receive(broker + "#1", [C, codec.C_FINAL, b"echo", b"late"])) == []
    assert result == []
    assert script.feed(Elapse(1.0)) == [
        Close(broker + "#2"), Open(broker + "#3"), Send(broker + "#3", request(b"echo", b"hi"))]
    assert script.feed(Elapse(1.0)) == [Close(broker + "#3")]
    (failure,) = result
    assert isinstance(failure, Failure) and failure.check(RequestTimeout)
    assert str(failure.value) == ("no reply from broker at " + broker + " after 3 attempts (3.0 s) "
                                  "to a request for service 'echo'")


def test_client_rotates_endpoints_on_timeout() -> None:
    script = Script(autoConnect=True)
    first, second = script.endpoint("b1"), script.endpoint("b2")
    client = Client([first, second], reactor=script.clock, timeout=1.0, retries=2,
                    extensions=False)
    outcome(client.request("echo", b"hi"))
    assert script.feed() == [Send(first + "#1", request(b"echo", b"hi"))]
    assert script.feed(Elapse(1.0)) == [
        Close(first + "#1"), Open(second + "#1"), Send(second + "#1", request(b"echo", b"hi"))]
    assert client.endpoint == second


def test_client_resends_when_a_broken_pipe_comes_back() -> None:
    script = Script(autoConnect=True)
    pipe = script.endpoint("broker") + "#1"
    client = Client(script.endpoint("broker"), reactor=script.clock, timeout=5.0, retries=1,
                    extensions=False)
    result = outcome(client.request("echo", b"hi"))
    assert script.feed() == [Send(pipe, request(b"echo", b"hi"))]
    # the broker forgot the old connection and what it carried: sent again when back, once
    assert script.feed(Lost(pipe)) == []
    assert script.feed(Connected(pipe)) == [Send(pipe, request(b"echo", b"hi"))]
    assert script.feed(Receive(pipe, [C, codec.C_FINAL, b"echo", b"HI"])) == []
    assert result == [[b"HI"]]


def test_client_tells_a_streaming_request_that_its_reply_starts_over() -> None:
    script = Script(autoConnect=True)
    pipe = script.endpoint("broker") + "#1"
    client = Client(script.endpoint("broker"), reactor=script.clock, timeout=5.0, retries=1,
                    extensions=False)
    seen: list[Any] = []
    result = outcome(client.request("echo", b"hi", onPartial=seen.append,
                                    onRestart=lambda: seen.append("restart")))
    plain = outcome(client.request("echo", b"plain", onPartial=seen.append))
    script.feed()
    (call, other) = sorted((c.call for c in client.machine._channels), key=lambda c: c.message[-1])
    assert call.state is CallState.IN_FLIGHT
    partial = [C, codec.C_PARTIAL, b"echo", b"part"]
    script.feed(Receive(pipe, partial))
    assert call.state is CallState.STREAMING
    # the broker gave it to another worker: the marker, then the parts from the start
    script.feed(Receive(pipe, [C, codec.C_PARTIAL, b"echo", codec.RESTART_MARKER]),
                Receive(pipe, partial), Receive(pipe, [C, codec.C_FINAL, b"echo", b"end"]))
    assert seen == [[b"part"], "restart", [b"part"]] and result == [[b"end"]]
    # without onRestart a restart fails the request rather than repeat its parts
    other_pipe = script.endpoint("broker") + "#2"
    script.feed(Receive(other_pipe, partial), Lost(other_pipe))
    (failure,) = plain
    assert failure.check(StreamRestarted) and other.state is CallState.DONE


@pytest.mark.parametrize("timeout, retries", [(1.0, 1), (2.0, 3)])
def test_client_timeout_is_per_attempt(timeout: float, retries: int) -> None:
    """A request fails after timeout × retries, never sooner, never later."""
    script = Script(autoConnect=True)
    client = Client(script.endpoint("broker"), reactor=script.clock, timeout=timeout,
                    retries=retries, extensions=False)
    result = outcome(client.request("echo", b"hi"))
    script.feed(Elapse(timeout * retries - 0.01))
    assert result == []
    script.feed(Elapse(0.01))
    assert result and result[0].check(RequestTimeout)


# --- the broker's machine alone: no reactor, no Clock, no transport --------------------

def test_broker_machine_is_a_function_of_events_and_their_times() -> None:
    from mdp.majordomo.broker import BrokerMachine, DropPeer
    from mdp.majordomo.broker import Send as BrokerSend
    from mdp.majordomo.broker_machine import Dropped, MarkUseful, Refused, WorkerChanged

    machine = BrokerMachine(heartbeat=HB, requestExpiry=5.0)
    route = "binding"  # the driver's: opaque to the machine
    worker, client = (route, b"W"), (route, b"C")
    assert machine.wakeEvery == 1.0
    assert machine.handleMessage(worker, [b"", *READY], now=0.0) == [
        WorkerChanged(b"W", b"echo", "ready", 0.0)]
    # the first request served marks its worker and client useful (kept by a full listener)
    assert machine.handleMessage(client, [C, codec.C_REQUEST, b"echo", b"hi"], now=0.5) == [
        MarkUseful(worker, True), MarkUseful(client, True),
        BrokerSend(worker, [b"", W, codec.W_REQUEST, envelope(b"C", 1), b"", b"hi"])]
    # silent past 3 s: at the tick after, the worker is gone; its request waits
    assert machine.handleTick(now=1.0) == [BrokerSend(worker, [b"", *HEARTBEAT])]
    assert machine.handleTick(now=4.0) == [WorkerChanged(b"W", b"echo", "silent", 4.0),
                                           MarkUseful(worker, False)]
    assert machine.workers == {} and machine.queued == 1
    # queued since 4.0 with no worker: a 503 at the first tick past 9.0
    assert machine.handleTick(now=8.0) == []
    [reply, refused] = machine.handleTick(now=9.0)
    assert reply.key == client and reply.frames[:4] == [C, codec.C_FINAL, b"echo",
                                                       codec.ERROR_MARKER]
    assert reply.frames[4] == codec.STATUS_UNAVAILABLE
    assert type(refused) is Refused and refused.kind == "expired"
    # garbage: the machine reports it and wants that peer's connection closed
    [dropped, drop] = machine.handleMessage((route, b"X"), [b"junk"], now=9.5)
    assert type(dropped) is Dropped and dropped.kind == "malformed"
    assert drop == DropPeer((route, b"X"))
    # a client on a worker-only endpoint is refused the same way
    [dropped, drop] = machine.handleMessage((route, b"C2"), [C, codec.C_REQUEST, b"echo", b"x"],
                                            now=10.0, clients=False)
    assert dropped.kind == "wrong-endpoint" and drop == DropPeer((route, b"C2"))
    # a snapshot reads at the time it is given and changes nothing
    assert machine.snapshot(now=20.0).at == 20.0 and machine.now == 10.0


def test_worker_machine_is_a_function_of_events_and_their_times() -> None:
    from mdp.majordomo.worker import (
        ClosePipe,
        OpenPipe,
        ReopenAfter,
        SendToBroker,
        Serve,
        WorkerMachine,
    )

    machine = WorkerMachine(["a", "b"], b"echo", heartbeat=HB, backoff=Backoff(1.0, 8.0),
                            extensions=False)
    assert machine.handleStart(now=0.0) == [OpenPipe("a")]
    assert machine.handlePipeUp(now=0.1) == [SendToBroker([*READY])]
    [serve] = machine.handleMessage([W, codec.W_REQUEST, b"C1", b"", b"hi"], now=0.2)
    assert isinstance(serve, Serve) and serve.body == [b"hi"] and machine.current == b"C1"
    sent, actions = machine.handleReply(serve.job, codec.WorkerFinal, [b"HI"], now=0.3)
    assert sent and actions == [SendToBroker([W, codec.W_FINAL, b"C1", b"", b"HI"])]
    # ¾ of an interval with nothing sent: a heartbeat at the tick
    assert machine.handleTick(now=1.1) == [SendToBroker([*HEARTBEAT])]
    # silent for more than 3 s since the REQUEST at 0.2: close, and on to the
    # next endpoint at once (the next time after backoff.delay(0) = 1 s)
    assert machine.handleTick(now=3.3) == [ClosePipe(), ReopenAfter(0.0, "a", pytest.approx(3.1))]
    assert machine.handleReopen(now=4.3) == [OpenPipe("b")]
    # a reply for the request of the old pipe is void
    assert machine.handleReply(serve.job, codec.WorkerFinal, [b"late"], now=4.4) == (False, [])
    # DISCONNECT on the new pipe: register again at once the first time
    machine.handlePipeUp(now=4.5)
    assert machine.handleMessage([*DISCONNECT], now=4.6) == [ClosePipe(), ReopenAfter(0.0, "b", None)]


def test_a_worker_takes_only_worker_messages_as_word_from_its_broker() -> None:
    from mdp.majordomo.worker import Dropped, OpenPipe, SendToBroker, WorkerMachine

    machine = WorkerMachine(["a"], b"echo", heartbeat=HB, backoff=Backoff(1.0, 8.0),
                            extensions=False)
    assert machine.handleStart(now=0.0) == [OpenPipe("a")]
    assert machine.handlePipeUp(now=0.1) == [SendToBroker([*READY])]
    client_final = [codec.CLIENT_HEADER, codec.C_FINAL, b"echo", b"hi"]
    assert machine.handleMessage(client_final, now=2.0) == [Dropped("invalid message: missing MDPW02 header")]
    assert not machine.answered and machine.liveness.silence(2.0) == pytest.approx(1.9)


def test_client_machine_is_a_function_of_events_and_their_times() -> None:
    from mdp.errors import ClientClosed
    from mdp.majordomo.client_machine import (
        ClientMachine,
        CloseChannel,
        Complete,
        Fail,
        OpenChannel,
        Retrying,
        SendOn,
        WakeAt,
        _Call,
    )

    machine = ClientMachine(["a", "b"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    request = [C, codec.C_REQUEST, b"echo", b"hi"]

    def call(now: float, timeout: float = 2.0, retries: int = 2) -> _Call:
        return _Call(b"echo", list(request), timeout, retries, None, None, now)

    first, second = call(0.0), call(0.0)
    opened = machine.handleRequest(first, now=0.0)
    assert [type(a) for a in opened] == [WakeAt, OpenChannel]
    channel = opened[1].channel
    assert opened[0].when == 2.0 and channel.endpoint == "a"
    assert machine.handleRequest(second, now=0.0) == []  # one connection: it waits
    assert machine.handlePipeUp(channel, now=0.1) == [SendOn(channel, request)]
    # the reply completes the first; the freed connection carries the second
    done = machine.handleMessage(channel, [C, codec.C_FINAL, b"echo", b"HI"], now=0.2)
    assert done == [SendOn(channel, request), Complete(first, [b"HI"])]
    # no reply for the second: its attempt runs out at 2.0; a fresh connection
    # to the next endpoint carries the retry, which runs out at 4.0
    retry = machine.handleWake(now=2.0)
    assert [type(a) for a in retry] == [CloseChannel, Retrying, WakeAt, OpenChannel]
    assert retry[1] == Retrying(second, 2)
    assert retry[2].when == 4.0 and retry[3].channel.endpoint == "b"
    closing, failed = machine.handleWake(now=4.0)
    assert closing == CloseChannel(retry[3].channel)
    assert isinstance(failed, Fail) and failed.call is second
    assert isinstance(failed.error, RequestTimeout) and failed.error.attempts == 2
    # closing fails what is left and needs no more wake-ups
    third = call(4.5)
    machine.handleRequest(third, now=4.5)
    closed = machine.handleClose(now=5.0)
    assert WakeAt(None) in closed and Fail(third, closed[-1].error) in closed
    assert isinstance(closed[-1].error, ClientClosed)


def test_client_machine_asks_for_its_next_wake_up_before_a_callback_runs() -> None:
    """A wake-up that restarts a stream (``onRestart``) asks first for the
    wake-up another request's deadline needs: the blocking driver waits inside
    a callback that makes a request of its own, with the wake-ups it was asked
    for until then, so the other request times out on time."""
    from mdp.majordomo.client_machine import ClientMachine, Restarted, WakeAt, _Call

    request = [C, codec.C_REQUEST, b"echo", b"hi"]
    machine = ClientMachine(["a"], maxConnections=2, dialect=codec.RFC,
                            extensions=False)
    streamed = _Call(b"echo", list(request), 10.0, 2, None, lambda: None, 0.0)
    other = _Call(b"echo", list(request), 10.0, 1, None, None, 5.0)
    channel = machine.handleRequest(streamed, now=0.0)[1].channel
    machine.handlePipeUp(channel, now=0.1)
    machine.handleMessage(channel, [C, codec.C_PARTIAL, b"echo", b"part"], now=0.2)
    machine.handlePipeUp(machine.handleRequest(other, now=5.0)[0].channel, now=5.1)
    actions = machine.handleWake(now=10.0)  # the stream's retry runs out at 20, the other at 15
    before = actions[:actions.index(Restarted(streamed))]
    assert min(a.when for a in before if isinstance(a, WakeAt)) == 15.0


def test_client_machine_gives_a_cancelled_requests_connection_to_one_waiting() -> None:
    """A request cancelled after it was sent keeps its connection for its
    reply (which can then go to nobody else), but not while another request
    waits for a connection with its clock running: that one gets a fresh
    connection in its place at once."""
    from mdp.majordomo.client_machine import ClientMachine, CloseChannel, OpenChannel, SendOn, _Call

    request = [C, codec.C_REQUEST, b"echo", b"hi"]

    def call(now: float) -> _Call:
        return _Call(b"echo", list(request), 2.0, 1, None, None, now)

    machine = ClientMachine(["a"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    first, second = call(0.0), call(0.3)
    channel = machine.handleRequest(first, now=0.0)[1].channel
    machine.handlePipeUp(channel, now=0.1)
    # kept for the reply while nobody needs it
    assert machine.handleCancel(first, now=0.2) == []
    assert channel in machine._channels
    # a request that would wait for it: the connection goes, a new one carries it
    closed, opened = machine.handleRequest(second, now=0.3)
    assert closed == CloseChannel(channel)
    assert isinstance(opened, OpenChannel) and opened.channel.call is second
    assert machine.handlePipeUp(opened.channel, now=0.4) == [SendOn(opened.channel, request)]
    assert machine._channels == {opened.channel}


def test_client_machine_sends_no_request_whose_attempt_ran_out_while_it_waited() -> None:
    """Attempts that end at the same wake-up all end before a freed
    connection is given out: a waiting request whose own clock ran out is
    failed, not sent and then failed."""
    from mdp.majordomo.client_machine import ClientMachine, CloseChannel, Fail, _Call

    request = [C, codec.C_REQUEST, b"echo", b"hi"]
    machine = ClientMachine(["a"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    first, second = (_Call(b"echo", list(request), 2.0, 1, None, None, 0.0)
                     for _ in range(2))
    channel = machine.handleRequest(first, now=0.0)[1].channel
    machine.handleRequest(second, now=0.0)
    machine.handlePipeUp(channel, now=0.1)
    actions = machine.handleWake(now=2.0)
    assert sorted(type(a).__name__ for a in actions) == ["CloseChannel", "Fail", "Fail"]
    assert CloseChannel(channel) in actions
    fails = [a for a in actions if isinstance(a, Fail)]
    assert {a.call for a in fails} == {first, second}
    assert all(isinstance(a.error, RequestTimeout) for a in fails)


def test_client_machine_moves_attempts_that_end_together_to_the_next_broker() -> None:
    """Requests in flight together time out together: their retries do not
    all go back to the broker that did not answer."""
    from mdp.majordomo.client_machine import ClientMachine, OpenChannel, _Call

    request = [C, codec.C_REQUEST, b"echo", b"hi"]
    machine = ClientMachine(["a", "b"], maxConnections=2, dialect=codec.RFC,
                            extensions=False)
    calls = [_Call(b"echo", list(request), 2.0, 2, None, None, 0.0)
             for _ in range(2)]
    for call in calls:
        opened = [a for a in machine.handleRequest(call, now=0.0) if isinstance(a, OpenChannel)]
        machine.handlePipeUp(opened[0].channel, now=0.1)
    assert {call.channel.endpoint for call in calls} == {"a"}
    retries = [a.channel.endpoint for a in machine.handleWake(now=2.0) if isinstance(a, OpenChannel)]
    assert len(retries) == 2 and "b" in retries


def test_client_machine_leaves_an_unreachable_broker_at_once_until_one_is_reached() -> None:
    """A refused connection (stream transports report it) is known at once:
    the next endpoint is tried; when every one refused and none was ever
    reached, the requests fail with BrokerUnreachable.  After a broker was
    reached, refusals are retried by the transport (a broker restarting),
    and a timeout then says why the connection failed."""
    from twisted.internet.error import ConnectionRefusedError, TimeoutError

    from mdp.errors import BrokerUnreachable
    from mdp.majordomo.client_machine import ClientMachine, CloseChannel, Fail, OpenChannel, _Call

    request = [C, codec.C_REQUEST, b"echo", b"hi"]

    def call(now: float) -> _Call:
        return _Call(b"echo", list(request), 2.0, 3, None, None, now)

    machine = ClientMachine(["a", "b"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    first, second = call(0.0), call(0.0)
    channel = machine.handleRequest(first, now=0.0)[1].channel
    machine.handleRequest(second, now=0.0)
    # a timeout of a connection attempt may pass: nothing is done
    assert machine.handleConnectFailed(channel, TimeoutError(), now=0.05) == []
    moved = machine.handleConnectFailed(channel, ConnectionRefusedError(), now=0.1)
    assert [type(a) for a in moved] == [CloseChannel, OpenChannel]
    assert moved[1].channel.endpoint == "b"
    failed = machine.handleConnectFailed(moved[1].channel, ConnectionRefusedError(), now=0.2)
    assert [type(a) for a in failed] == [CloseChannel, Fail, Fail]
    assert {a.call for a in failed[1:]} == {first, second}
    error = failed[1].error
    assert isinstance(error, BrokerUnreachable)
    assert str(error) == "cannot reach any broker at a: connection refused; b: connection refused"

    # reached once, a refusal is left to the transport's retries
    machine = ClientMachine(["a"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    third = call(0.0)
    channel = machine.handleRequest(third, now=0.0)[1].channel
    machine.handlePipeUp(channel, now=0.1)
    machine.handlePipeLost(channel, None, now=0.5)
    assert machine.handleConnectFailed(channel, ConnectionRefusedError(), now=1.0) == []
    actions = machine.handleWake(now=2.0) + machine.handleWake(now=4.0)
    assert machine.handleConnectFailed(actions[-1].channel, ConnectionRefusedError(), now=4.5) == []
    timedOut = [a for a in machine.handleWake(now=6.0) if isinstance(a, Fail)]
    assert str(timedOut[0].error) == ("no reply from broker at a (connection refused) after 3 "
                                      "attempts (6.0 s) to a request for service 'echo'")


def test_a_broker_just_made_active_gives_workers_time_to_find_it() -> None:
    """A Binary Star broker that becomes active has no workers yet: they
    are still with its peer until their heartbeats expire.  A service it
    does not know is given up no sooner than interval × (liveness + 1)
    after it became active (4 s here), even with a shorter
    unknownServiceExpiry."""

    class Admission:
        active = False

        def admitClient(self, now: float) -> bool:
            return self.active

        def admitWorker(self, now: float) -> bool:
            return self.active

        def status(self, now: float) -> dict[str, Any]:
            return {}

    admission = Admission()
    script, broker = broker_script(admission=admission, unknownServiceExpiry=2.0)
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"echo", b"0"])) == []  # passive: ignored
    admission.active = True
    assert script.feed(Elapse(1.0), Receive(b"C", [C, codec.C_REQUEST, b"echo", b"1"])) == []
    assert script.feed(Elapse(3.99)) == []
    assert script.feed(Elapse(0.01)) == [Send(b"C", [
        C, codec.C_FINAL, b"echo", codec.ERROR_MARKER, codec.STATUS_UNAVAILABLE,
        b"no worker for service 'echo': none registered within 4s"])]
    # once learnt, an unknown service waits unknownServiceExpiry
    assert script.feed(Receive(b"C", [C, codec.C_REQUEST, b"other", b"2"])) == []
    assert script.feed(Elapse(1.99)) == []
    assert len(script.feed(Elapse(0.01))) == 1


def test_a_late_reply_counts_only_from_its_worker_and_only_without_partials() -> None:
    """A late PARTIAL means the reply had begun: the request runs again, and
    the FINAL after it is no answer.  Another peer that knows the envelope
    answers nothing.  Assignments whose request left the queue are
    forgotten at the next tick."""
    script, broker = broker_script()
    script.feed(Receive(b"W", READY), Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"]))
    script.feed(Elapse(4.0))  # W given up; the request is queued again
    assert script.feed(Receive(b"X", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"forged"])) == [
        Send(b"X", DISCONNECT), Disconnect(b"X")]
    assert script.feed(Receive(b"W", [W, codec.W_PARTIAL, envelope(b"C", 1), b"", b"h"]),
                       Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"])) == [
        Send(b"W", DISCONNECT), Disconnect(b"W")]  # once: then no further commands
    assert broker.queued == 1
    # a new worker runs it again; the entry of the old assignment goes at the tick
    assert script.feed(Receive(b"W2", READY)) == [
        Send(b"W2", [W, codec.W_REQUEST, envelope(b"C", 2), b"", b"hi"])]
    script.feed(Elapse(4.0))  # W2 given up too: a new entry for its assignment
    assert list(broker._takenBack) == [envelope(b"C", 2)]
    script.feed(Receive(b"W3", READY))  # the request leaves the queue for W3
    script.feed(Elapse(1.0))
    assert broker._takenBack == {}


def test_client_machine_names_a_broker_unreachable_only_when_every_one_refused() -> None:
    """A connection attempt that timed out may pass: an endpoint that did so
    is no proof that nobody is there."""
    from twisted.internet.error import ConnectionRefusedError, TimeoutError

    from mdp.majordomo.client_machine import ClientMachine, CloseChannel, OpenChannel, _Call

    machine = ClientMachine(["a", "b"], maxConnections=1, dialect=codec.RFC,
                            extensions=False)
    call = _Call(b"echo", [C, codec.C_REQUEST, b"echo", b"hi"], 2.0, 3, None, None, 0.0)
    channel = machine.handleRequest(call, now=0.0)[1].channel
    assert machine.handleConnectFailed(channel, TimeoutError(), now=1.0) == []
    retry = machine.handleWake(now=2.0)  # the attempt runs out: the next goes to b
    second = [a for a in retry if isinstance(a, OpenChannel)][0].channel
    assert second.endpoint == "b"
    moved = machine.handleConnectFailed(second, ConnectionRefusedError(), now=2.1)
    assert [type(a) for a in moved] == [CloseChannel, OpenChannel]  # back to a, not failed
    assert moved[1].channel.endpoint == "a" and not call.done


def test_client_machine_common_paths_act_as_the_general_ones() -> None:
    """A request given a free connection, and a reply to the request in
    flight, take a short way (no FIFO; no command object): for any sequence
    of events, the machine acts exactly as one that takes the general path
    (_schedule, _enqueue, _pump; a decoded command) every time."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mdp.majordomo.client_machine import ClientMachine, OpenChannel, _Call, _Channel

    class GeneralPaths(ClientMachine):
        def handleRequest(self, call: _Call, now: float) -> list[Any]:
            self.now = now
            self._live += 1
            self._schedule(call)
            self._enqueue(call)
            self._pump()
            return self._drain()

        def handleMessage(self, channel: _Channel, frames: list[bytes], now: float) -> list[Any]:
            self.now = now
            self._decoded(channel, channel.call, frames)
            return self._drain()

    request = [C, codec.C_REQUEST, b"echo", b"hi"]
    replies = {
        "final": [C, codec.C_FINAL, b"echo", b"HI"],
        "error": [C, codec.C_FINAL, b"echo", *codec.error_body(codec.STATUS_WORKER_ERROR, "no")],
        "other": [C, codec.C_FINAL, b"other", b"HI"],
        "partial": [C, codec.C_PARTIAL, b"echo", b"h"],
        "short": [C, codec.C_FINAL, b"echo"],
    }
    event = st.one_of(
        st.tuples(st.just("request"), st.integers(0, 3)),
        st.tuples(st.just("up"), st.integers(0, 3)),
        st.tuples(st.just("lost"), st.integers(0, 3)),
        st.tuples(st.sampled_from(sorted(replies)), st.integers(0, 3)),
        st.tuples(st.just("wake"), st.integers(0, 3)),
        st.tuples(st.just("cancel"), st.integers(0, 5)),
    )

    def run(kind: type, events: list[tuple[str, int]]) -> list[Any]:
        machine = kind(["a", "b"], maxConnections=2, dialect=codec.RFC, extensions=False)
        channels: list[_Channel] = []
        calls: list[_Call] = []
        now = 0.0
        seen: list[Any] = []

        def norm(value: Any) -> Any:
            if isinstance(value, _Channel):
                return ("channel", channels.index(value))
            if isinstance(value, _Call):
                return ("call", calls.index(value))
            if isinstance(value, BaseException):
                return type(value).__name__
            if isinstance(value, list):
                return [norm(v) for v in value]
            return value

        def record(actions: list[Any]) -> None:
            for action in actions:
                if isinstance(action, OpenChannel):
                    channels.append(action.channel)
                fields = {k: norm(getattr(action, k)) for k in type(action).__slots__
                          if not k.startswith("__")}
                seen.append((type(action).__name__, fields))

        for name, n in events:
            now += 0.5
            if name == "request":
                call = _Call(b"echo", list(request), 1.0 + n, 2, None, None, now)
                calls.append(call)
                record(machine.handleRequest(call, now))
            elif name == "cancel":
                if n < len(calls):
                    record(machine.handleCancel(calls[n], now))
            elif name == "wake":
                record(machine.handleWake(now + n))
                now += n
            elif n < len(channels):
                channel = channels[n]
                if name == "up":
                    record(machine.handlePipeUp(channel, now))
                elif name == "lost":
                    record(machine.handlePipeLost(channel, None, now))
                else:
                    record(machine.handleMessage(channel, list(replies[name]), now))
            seen.append(("calls", [(c.state, list(c.tried), c.attempts, c.deadline, norm(c.channel))
                                   for c in calls]))
            seen.append(("channels", [(c.state, norm(c.call)) for c in channels]))
            seen.append(("deadlines held", len(machine._deadlines)))
        return seen

    @settings(max_examples=300, deadline=None)
    @given(st.lists(event, max_size=30))
    def check(events: list[tuple[str, int]]) -> None:
        assert run(ClientMachine, events) == run(GeneralPaths, events)

    check()


def test_no_command_goes_to_a_worker_after_a_disconnect_either_way() -> None:
    """MDP/0.2: after a worker's DISCONNECT, and after the broker's, the
    broker sends that worker no further commands (what it still sends, say
    heartbeats that crossed the DISCONNECT, is dropped); a READY starts a
    new conversation; a heartbeat expiry later the peer is unknown again."""
    script, broker = broker_script()
    script.feed(Receive(b"W", READY))
    assert script.feed(Receive(b"W", DISCONNECT)) == []
    assert script.feed(Receive(b"W", HEARTBEAT), Receive(b"W", HEARTBEAT)) == []
    assert script.feed(Receive(b"U", HEARTBEAT)) == [Send(b"U", DISCONNECT), Disconnect(b"U")]
    assert script.feed(Receive(b"U", HEARTBEAT), Receive(b"U", [W, codec.W_FINAL, b"C", b"",
                                                                 b"x"])) == []
    script.feed(Receive(b"U", READY))
    assert list(broker.workers) and broker.workers[next(iter(broker.workers))].key[1] == b"U"
    script.feed(Elapse(10.0))  # past the expiry: W is a stranger again
    assert script.feed(Receive(b"W", HEARTBEAT)) == [Send(b"W", DISCONNECT), Disconnect(b"W")]


def _reopened_after(backoff: Backoff) -> float:
    """Seconds from a worker's giving up on its silent (only) broker to its
    opening a new pipe to it, with *backoff*, in steps of 10 ms."""
    script = Script(autoConnect=True)
    broker = script.endpoint("broker")
    worker = Worker(broker, "echo", upper, reactor=script.clock, heartbeat=HB, backoff=backoff,
                    extensions=False)
    worker.start()
    script.feed()
    assert Close(broker + "#1") in script.feed(Elapse(3.5))
    for step in range(1, 3300):
        if Open(broker + "#2") in script.feed(Elapse(0.01)):
            return round(step * 0.01, 2)
    raise AssertionError("the worker never reconnected")


def test_workers_that_lost_the_same_broker_come_back_spread_over_a_quarter_of_the_delay() -> None:
    from mdp.policy import JITTER, PIRATE

    exact = _reopened_after(attrs.evolve(PIRATE, jitter=0))
    # the default (PIRATE): each delay up to JITTER shorter, never longer
    times = [_reopened_after(PIRATE) for _ in range(20)]
    assert all(exact * (1 - JITTER) - 0.01 <= t <= exact for t in times), (exact, times)
    assert len(set(times)) > 5, times  # not in step
    # and the chance is the one given
    assert _reopened_after(attrs.evolve(PIRATE, random=lambda: 0.5)) == \
        pytest.approx(exact * (1 - JITTER / 2), abs=0.011)


def test_a_worker_made_without_a_backoff_uses_the_jittered_pirate_schedule() -> None:
    from mdp.policy import PIRATE

    worker = Worker("zmq:inproc://nowhere", "echo", upper)
    assert worker.machine.backoff is PIRATE and PIRATE.jitter > 0


@pytest.mark.parametrize("options", [
    {"jitter": 1}, {"jitter": -0.1}, {"jitter": float("nan")}, {"initial": 0},
    {"maximum": -1}, {"factor": 0.5}, {"initial": float("inf")}, {"jitter": True}])
def test_a_backoff_out_of_range_is_refused(options: dict) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**options)


def test_a_backoff_with_no_cap_or_of_other_real_numbers_is_taken() -> None:
    from fractions import Fraction

    from mdp.policy import MAX_SECONDS

    assert Backoff(1.0, float("inf")).delay(20) == 2.0 ** 20
    assert Backoff(1.0, float("inf")).delay(70) == MAX_SECONDS  # (no later than timers can go)
    assert Backoff(Fraction(1, 2), 4).delay(1) == 1
    assert Backoff(1.0, 60.0, factor=1e6).delay(60) == 60.0  # 1e360 overflows a float


def test_a_jittered_delay_stays_within_its_step() -> None:
    for chance in (0.0, 0.5, 0.999999):
        backoff = Backoff(initial=1.0, maximum=8.0, jitter=0.25, random=lambda c=chance: c)
        for attempt in range(6):
            exact = min(2.0 ** attempt, 8.0)
            assert exact * 0.75 < backoff.delay(attempt) <= exact
    assert [Backoff(1.0, 8.0).delay(n) for n in range(5)] == [1, 2, 4, 8, 8]  # jitter 0: exact
    # a cap (a session's expiry) is spread as much as the schedule's own maximum
    capped = Backoff(1.0, 32.0, jitter=0.25, random=lambda: 0.999999)
    assert capped.delay(10, 15.0) == pytest.approx(15.0 * 0.75, rel=1e-5)
    assert Backoff(1.0, 32.0).delay(10, 15.0) == 15.0 and Backoff(1.0, 32.0).delay(0, 15.0) == 1.0


def test_the_broker_logs_and_counts_what_its_machine_reports() -> None:
    """The machine neither logs nor counts: it reports, and its driver logs
    (throttled), counts invalid input and feeds the metrics."""
    from mdp.metrics import BrokerMetrics
    from tests.conftest import warnings_logged

    metrics = BrokerMetrics()
    script, broker = broker_script(metrics=metrics, maxWorkers=1)
    count = metrics.registry.get_sample_value
    with warnings_logged() as warnings:
        script.feed(Receive(b"W", READY), Receive(b"W2", READY),
                    Receive(b"C", [C, codec.C_REQUEST, b"echo", b"hi"]),
                    Receive(b"W", [W, codec.W_FINAL, envelope(b"C", 1), b"", b"HI"]),
                    Receive(b"X", [b"junk"]), Receive(b"Y", [b"junk"]))
    lines = [event["log_format"] for event in warnings]
    assert any("refused {what}" in line for line in lines)  # W2: one worker at most
    assert sum("dropped invalid message" in line for line in lines) == 1  # throttled
    assert broker.invalid == 2
    assert count("mdp_broker_rejected_messages_total", {"reason": "malformed"}) == 2
    assert count("mdp_broker_requests_total", {"service": "echo"}) == 1
    assert count("mdp_broker_replies_total", {"service": "echo"}) == 1
