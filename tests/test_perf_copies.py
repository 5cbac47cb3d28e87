"""Large frames are not copied between the socket and the handler: the
stream decoder copies each frame's bytes once, and the broker's and the
worker's machines pass body frames on by reference."""

from __future__ import annotations

import tracemalloc

from mdp.majordomo import codec
from mdp.majordomo.broker import Binding, BrokerMachine, Send
from mdp.majordomo.worker import SendToBroker, Serve, WorkerMachine
from mdp.transport.framing import RecordDecoder, encode_record

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


def test_the_broker_machine_hands_body_frames_on_by_reference() -> None:
    broker = BrokerMachine()
    binding = Binding(None, clients=True, workers=True)  # type: ignore[arg-type]
    worker, client = (binding, b"w"), (binding, b"c")
    assert broker.handleMessage(worker, [codec.WORKER_HEADER, codec.W_READY, b"echo"], 0.0) == []
    body = b"q" * BIG
    [toWorker] = broker.handleMessage(client, [codec.CLIENT_HEADER, codec.C_REQUEST, b"echo", body], 1.0)
    assert type(toWorker) is Send and toWorker.key == worker and toWorker.frames[-1] is body
    envelope = toWorker.frames[2]
    answer = b"r" * BIG
    [toClient] = broker.handleMessage(
        worker, [codec.WORKER_HEADER, codec.W_FINAL, envelope, b"", answer], 2.0)
    assert toClient.key == client and toClient.frames[-1] is answer
