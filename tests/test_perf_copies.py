"""Large frames are not copied between the socket and the handler: the
stream decoder copies each frame's bytes once, and the broker's and the
worker's machines pass body frames on by reference."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import pytest_twisted

from mdp.majordomo import codec
from mdp.majordomo.broker import Binding, BrokerMachine, Send
from mdp.majordomo.worker import SendToBroker, Serve, WorkerMachine
from mdp.transport.framing import RecordDecoder, encode_record
from tests.procs import reactor

BIG = 1 << 20


def _allocated_while(feed, pieces):  # type: ignore[no-untyped-def]
    """Peak bytes allocated while *feed* takes *pieces* (made beforehand)."""
    out = []
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for piece in pieces:
            messages = feed(piece)
            if messages:
                out.append(messages)
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_large_frame_spanning_reads_is_copied_once() -> None:
    body = b"x" * BIG
    record = encode_record([b"MDPW02", b"\x02", b"client", b"", body])
    pieces = [record[i:i + 65536] for i in range(0, len(record), 65536)]
    decoder = RecordDecoder()
    out, peak = _allocated_while(decoder.feed, pieces)
    messages = [m for batch in out for m in batch]
    assert messages == [[b"MDPW02", b"\x02", b"client", b"", body]]
    # one copy of the frame (a buffer of the whole record and a copy of each
    # frame out of it would be twice that)
    assert peak < 1.25 * BIG


def test_a_trickled_large_frame_is_still_linear_in_memory() -> None:
    body = b"y" * (BIG // 4)
    record = encode_record([body])
    pieces = [record[i:i + 64] for i in range(0, len(record), 64)]
    decoder = RecordDecoder()
    out, peak = _allocated_while(decoder.feed, pieces)
    assert [m for batch in out for m in batch] == [[body]]
    # small pieces are gathered in one buffer, then copied into the frame
    assert peak < 2.5 * len(body)


def test_a_frame_within_one_read_is_taken_as_it_is() -> None:
    record = encode_record([b"a", b"z" * 70_000])
    decoder = RecordDecoder()
    head, rest = record[:13], record[13:]  # the second frame's bytes are exactly `rest`
    assert decoder.feed(head) == []
    [[first, second]] = decoder.feed(rest)
    assert first == b"a" and second is rest


def test_the_worker_machine_hands_body_frames_on_by_reference() -> None:
    machine = WorkerMachine(["loopback:x"], b"echo")
    machine.handleStart(0.0)
    machine.handlePipeUp(0.0)
    body = b"b" * BIG
    [serve] = machine.handleMessage([codec.WORKER_HEADER, codec.W_REQUEST, b"c1", b"", body], 1.0)
    assert type(serve) is Serve and serve.body[0] is body
    sent, [reply] = machine.handleReply(serve.job, codec.WorkerFinal, serve.body, 1.0)
    assert sent and type(reply) is SendToBroker and reply.frames[-1] is body


def sends(actions: list[Any]) -> list[Send]:
    """The messages among a broker machine's *actions*."""
    return [a for a in actions if type(a) is Send]


def test_the_broker_machine_hands_body_frames_on_by_reference() -> None:
    broker = BrokerMachine()
    binding = Binding(None, clients=True, workers=True)  # type: ignore[arg-type]
    worker, client = (binding, b"w"), (binding, b"c")
    assert [a for a in broker.handleMessage(worker, [codec.WORKER_HEADER, codec.W_READY, b"echo"],
                                            0.0) if type(a) is Send] == []
    body = b"q" * BIG
    [toWorker] = sends(broker.handleMessage(client, [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", body],
                                            1.0))
    assert type(toWorker) is Send and toWorker.key == worker and toWorker.frames[-1] is body
    envelope = toWorker.frames[2]
    answer = b"r" * BIG
    [toClient] = broker.handleMessage(
        worker, [codec.WORKER_HEADER, codec.W_FINAL, envelope, b"", answer], 2.0)
    assert toClient.key == client and toClient.frames[-1] is answer


# --- over ZeroMQ, the broker passes long body frames on uncopied --------------

LONG = 64 * 1024


def _frame(data: bytes) -> Any:
    import zmq

    return zmq.Frame(data)


def test_the_broker_machine_passes_uncopied_frames_on_and_reads_none() -> None:
    """A body frame a transport did not copy (a ``zmq.Frame``) goes to the
    worker and back to the client as it came; an MMI question carrying one
    is answered as the same question in bytes."""
    broker = BrokerMachine()
    binding = Binding(None, clients=True, workers=True)  # type: ignore[arg-type]
    worker, client = (binding, b"w"), (binding, b"c")
    broker.handleMessage(worker, [codec.WORKER_HEADER, codec.W_READY, b"echo"], 0.0)
    body = _frame(b"q" * LONG)
    [toWorker] = sends(broker.handleMessage(client, [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo",
                                                     b"head", body], 1.0))
    assert toWorker.frames[-1] is body and toWorker.frames[-2] == b"head"
    answer = _frame(b"r" * LONG)
    [toClient] = broker.handleMessage(
        worker, [codec.WORKER_HEADER, codec.W_FINAL, toWorker.frames[2], b"", answer], 2.0)
    assert toClient.key == client and toClient.frames[-1] is answer
    # mmi.service reads its body: a long name is no service, answered as such
    [reply] = broker.handleMessage(client, [codec.CLIENT_HEADER, codec.C_REQUEST,
                                            b"mmi.service", _frame(b"e" * LONG)], 3.0)
    assert reply.frames[-1] == b"404"


def test_an_uncopied_frame_where_the_broker_reads_is_read_as_bytes() -> None:
    """The machine's general path (a malformed message, another dialect)
    reads every frame: it gets them as bytes, so a long frame where the
    delimiter belongs is refused as malformed, and a majortomo-dialect
    request reaches its worker in bytes."""
    broker = BrokerMachine()
    binding = Binding(None, clients=True, workers=True)  # type: ignore[arg-type]
    worker, client, other = (binding, b"w"), (binding, b"c"), (binding, b"m")
    broker.handleMessage(worker, [codec.WORKER_HEADER, codec.W_READY, b"echo"], 0.0)
    [toWorker] = sends(broker.handleMessage(client, [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo",
                                                     b"x"], 1.0))
    actions = broker.handleMessage(
        worker, [codec.WORKER_HEADER, codec.W_FINAL, toWorker.frames[2], _frame(b"d" * LONG),
                 b"reply"], 2.0)
    # refused as the same message in bytes would be: the worker is told to go
    assert [a.frames for a in actions if type(a) is Send] == [
        [codec.WORKER_HEADER, codec.W_DISCONNECT]]
    assert broker.workers.get(worker) is None
    broker.handleMessage(worker, [codec.WORKER_HEADER, codec.W_READY, b"echo2"], 3.0)
    [queued] = [a for a in broker.handleMessage(
        other, [b"", codec.CLIENT_HEADER, b"\x02", b"echo2", _frame(b"m" * LONG)], 4.0)
        if type(a) is Send]
    assert type(queued.frames[-1]) is bytes and queued.frames[-1] == b"m" * LONG


def test_a_bytes_only_transport_gets_bytes_from_a_broker_that_has_both() -> None:
    """A broker bound on a transport that delivers uncopied frames (ZeroMQ)
    and one that takes only bytes (loopback) copies what goes to the second,
    and only that."""
    from twisted.internet import task

    from mdp.majordomo.broker import Broker

    class Sink:
        def __init__(self, buffers: bool) -> None:
            self.acceptsBuffers = self.deliversBuffers = buffers
            self.sent: list[tuple[bytes, list[Any]]] = []
            self.endpoint = "sink"

        def sendMessage(self, peer: bytes, frames: list[Any]) -> None:
            self.sent.append((peer, frames))

        def close(self) -> Any:
            from twisted.internet import defer

            return defer.succeed(None)

    broker = Broker(task.Clock())
    zmqLike, bytesOnly = Sink(True), Sink(False)
    clients = Binding(broker, clients=True, workers=False)
    workers = Binding(broker, clients=False, workers=True)
    broker._bind(workers, bytesOnly)  # type: ignore[arg-type]
    assert not workers.copyOut  # nothing delivers buffers yet
    broker._bind(clients, zmqLike)  # type: ignore[arg-type]
    assert workers.copyOut and not clients.copyOut
    try:
        broker.received((workers, b"w"), [codec.WORKER_HEADER, codec.W_READY, b"echo"])
        body = _frame(b"z" * LONG)
        broker.received((clients, b"c"), [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", body])
        [(peer, frames)] = bytesOnly.sent
        assert peer == b"w" and type(frames[-1]) is bytes and frames[-1] == b"z" * LONG
        [held] = [w.current for w in broker.workers.values()]  # sent again as bytes on a requeue
        assert [bytes(f) for f in held.body] == [frames[-1]]
        answer = _frame(b"y" * LONG)
        broker.received((workers, b"w"), [codec.WORKER_HEADER, codec.W_FINAL, frames[2], b"",
                                          answer])
        [(peer, frames)] = zmqLike.sent
        assert peer == b"c" and frames[-1] is answer
    finally:
        broker.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_zmq_router_keeps_long_frames_only_for_a_receiver_that_asks() -> None:
    """Frames from the receiver's ``keepFramesFrom`` on, and at least
    KEEP_FRAME_BYTES long, arrive as the ``zmq.Frame`` they came in; the
    others as bytes; a receiver that does not ask gets bytes only.  A kept
    frame sent on arrives whole."""
    from mdp import transport
    from mdp.transport.zmqio import KEEP_FRAME_BYTES, kept_frame_type
    from tests.test_transport_conformance import Dealer, Router, until

    class Keeper(Router):
        keepFramesFrom = 2

    long = b"L" * KEEP_FRAME_BYTES
    message = [long, b"h", long, b"s", b"S" * (KEEP_FRAME_BYTES - 1)]
    r = reactor()
    for receiver, kept in ((Keeper(), [2]), (Router(), [])):
        bound = await transport.listen("zmq:tcp://127.0.0.1:*", receiver, r)
        dealer = Dealer()
        pipe = transport.connect(bound.endpoint, dealer, r)
        try:
            pipe.sendMessage(message)
            await until(lambda receiver=receiver: len(receiver.received) == 1, 20)
            peer, frames = receiver.received[0]
            assert [i for i, f in enumerate(frames) if type(f) is not bytes] == kept
            assert all(type(f) is kept_frame_type() for i, f in enumerate(frames) if i in kept)
            assert [bytes(f) for f in frames] == message
            bound.sendMessage(peer, frames)  # a kept frame goes out as it came
            await until(lambda dealer=dealer: len(dealer.received) == 1, 20)
            assert dealer.received == [message]
        finally:
            await pipe.close()
            await bound.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_long_bodies_cross_a_broker_on_zeromq_and_tcp_uncopied_and_whole() -> None:
    """A broker bound on ZeroMQ (clients) and TCP (workers) hands a ZeroMQ
    client's long body to its machine uncopied, and both directions arrive
    whole: the TCP side writes the ZeroMQ frame into its records."""
    from mdp import Client, Worker
    from mdp.majordomo.broker import Broker
    from mdp.transport.zeromq import kept_frame_type

    r = reactor()
    broker = Broker(r)
    bodies: list[type] = []

    zmqBound = await broker.listen("zmq:tcp://127.0.0.1:*", workers=False)
    [binding] = broker.bindings
    received = binding.messageReceived

    def spy(peer: bytes, frames: list[Any]) -> None:
        if frames[:2] == [codec.CLIENT_HEADER, codec.C_REQUEST]:
            bodies.extend(type(f) for f in frames[3:])
        received(peer, frames)

    binding.messageReceived = spy  # type: ignore[method-assign]
    tcpBound = await broker.listen("tcp:host=127.0.0.1:port=0", clients=False)
    worker = Worker(tcpBound.endpoint, "echo", lambda frames: [f[::-1] for f in frames], r)
    worker.start()
    client = Client(zmqBound.endpoint, r, timeout=20, retries=1)
    try:
        body = bytes(range(256)) * 256  # 64 KiB
        reply = await client.request("echo", b"short", body).addTimeout(30, r)
        assert reply == [b"trohs", body[::-1]]
        assert bodies == [bytes, kept_frame_type()]
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
