"""The blocking worker's streaming handler is paused while what it sends is
not taken, over ZeroMQ as over streams: its ZeroMQ pipe counts the bytes
libzmq still holds (:class:`~mdp.transport.dealercore.DealerCore`) and the worker
waits, serving heartbeats, past ``limits.maxOutputBytes`` (it used to let
libzmq queue 1,000 messages whatever their size)."""

from __future__ import annotations

import select
import time
from typing import Any, Optional

import pytest
import pytest_twisted
from twisted.internet import task

from mdp.blocking import _Loop
from mdp.policy import Limits
from mdp.transport.framing import RecordDecoder
from tests.procs import ENV, Cluster, Process, python, reactor, wait_until
from tests.test_hostile_processes import NonReader, mdp_request, rss
from tests.test_worker_streams import (
    BINDS,
    PART,
    RSS_BOUND,
    FakeBroker,
    _count,
    _stop_if_over,
    pulled_until_paused,
)

MiB = 1024 * 1024
#: the worker's bound (its limits.maxOutputBytes), well under 1,000 parts
BOUND = 4 * MiB
#: what lies beyond the worker's count between the generator and a broker
#: that reads nothing: kernel socket buffers and libzmq's pipes
SLACK = 16 * MiB
#: 1,000 parts of PART bytes (libzmq's high-water mark) are far more
assert (BOUND + SLACK) // PART < 1000 // 2

WORKER = """
import sys
from mdp.blocking import Worker
from mdp.policy import HeartbeatPolicy, Limits
from tests.stream_peers import endless

Worker(sys.argv[1], "endless", endless, heartbeat=HeartbeatPolicy(0.5, 20),
       limits=Limits(maxOutputBytes=int(sys.argv[2]))).run()
"""


def test_zmq_pipe_backlogged_past_the_bound_until_half_has_drained() -> None:
    """A blocking node's ZeroMQ pipe to a ROUTER that reads nothing is
    ``backlogged`` once libzmq holds over the bound (not after its 1,000
    messages), and ``draining`` until the ROUTER has read enough."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 2)
    router.setsockopt(zmq.RCVBUF, 64 * 1024)
    router.bind("tcp://127.0.0.1:*")
    loop = _Loop(Limits(maxOutputBytes=MiB), None)
    pipe = loop.open("zmq:" + router.getsockopt(zmq.LAST_ENDPOINT).decode(), None, None)
    try:
        sent = 0
        while not pipe.backlogged and sent < 1000:
            pipe.send([b"x" * PART])
            sent += 1
        assert sent * PART <= MiB + SLACK and not pipe.backlog, sent
        assert pipe.draining and pipe.core.held() > MiB
        deadline = time.monotonic() + 10
        while pipe.draining:
            assert time.monotonic() < deadline, pipe.core.held()
            while router.poll(10):
                router.recv_multipart()
        assert pipe.core.held() <= MiB // 2 and not pipe.backlogged
    finally:
        loop.shutdown()
        router.close(0)


def _read_to_heartbeat(broker: FakeBroker) -> int:
    """Read what the worker sent up to its first heartbeat; how many
    PARTIALs came before it (fails if none comes within 10 s)."""
    decoder = RecordDecoder()
    parts = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if broker.kind == "zmq":
            messages = [broker.sock.recv_multipart()[1:]] if broker.sock.poll(100) else []
        else:
            ready = select.select([broker.sock], [], [], 0.1)[0]
            messages = decoder.feed(broker.sock.recv(1 << 20)) if ready else []
        for frames in messages:
            if frames[:2] == [b"MDPW02", b"\x05"]:
                return parts
            parts += frames[:2] == [b"MDPW02", b"\x03"]
    raise AssertionError(f"no heartbeat from the worker after {parts} parts")


#: a blocking worker of fresh parts (libzmq does not copy a part of 1 MiB:
#: the same one yielded again would cost nothing), fast heartbeats as the broker's
FRESH_WORKER = """
import sys
from mdp.blocking import Worker
from mdp.policy import HeartbeatPolicy
from tests.stream_peers import endless

Worker(sys.argv[1], "endless", lambda frames: (part[1:] + b"y" for part in endless(frames)),
       heartbeat=HeartbeatPolicy(0.25, 4)).run()
"""


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_blocking_worker_rss_bounded_while_client_does_not_read(kind: str,
                                                                      tmp_path: Any) -> None:
    """Case: a client calls a blocking worker's streaming service and never
    reads.  The worker's RSS stays under RSS_BOUND for 4 s of 1 MiB parts
    (it passed 1 GB: libzmq held 1,000 of them)."""
    cluster = Cluster("--max-output-bytes", str(16 * MiB))
    reader: Optional[NonReader] = None
    sampler: Optional[task.LoopingCall] = None
    counts = str(tmp_path / "count")
    try:
        broker = await cluster.startBroker(BINDS[kind])
        worker = Process(reactor(), python("-c", FRESH_WORKER, cluster.endpoint), ENV)
        cluster.workers.append(worker)
        await wait_until(lambda: b"ready for endless" in broker.output or not worker.running, 30)
        reader = NonReader(kind, cluster.endpoint,
                           mdp_request(b"endless", str(MiB).encode(), counts.encode()))
        await wait_until(lambda: _count(counts) > 0 or not worker.running, 30)
        samples: list[int] = []
        sampler = task.LoopingCall(_stop_if_over, worker, samples, RSS_BOUND)
        sampler.start(0.05)
        started = reactor().seconds()
        await wait_until(lambda: reactor().seconds() - started > 4 or not worker.running, 10)
        print(f"\n{kind}: blocking worker RSS max {max(samples) / MiB:.0f} MiB, "
              f"{_count(counts)} parts")
        assert worker.running and max(samples) < RSS_BOUND, (max(samples), worker.output)
    finally:
        if sampler is not None and sampler.running:
            sampler.stop()
        if reader is not None:
            reader.close()
        await cluster.stop()


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_blocking_streaming_handler_paused_while_broker_does_not_read(
        kind: str, tmp_path: Any) -> None:
    """A broker that sends a REQUEST and then reads nothing: the handler
    stops being pulled once BOUND bytes (and the kernel's buffers) are out;
    the worker's heartbeats go on meanwhile, and the handler resumes once
    the broker reads: the worker kept its broker."""
    broker = FakeBroker(kind)
    counts = str(tmp_path / "count")
    worker = Process(reactor(), python("-c", WORKER, broker.endpoint, str(BOUND)), ENV)
    cap = (BOUND + SLACK) // PART
    beats = task.LoopingCall(broker.send, b"MDPW02", b"\x05")
    try:
        paused = await pulled_until_paused(broker, worker, counts, cap, beats)
        held = rss(worker.transport.pid)
        # the broker reads: behind the parts, the heartbeats sent while paused
        taken = _read_to_heartbeat(broker)
        await wait_until(lambda: _count(counts) > paused, 10)  # and the handler goes on
        print(f"\n{kind}: paused at {paused} parts (cap {cap}), RSS {held / MiB:.0f} MiB; "
              f"a heartbeat after {taken} parts read")
    finally:
        if beats.running:
            beats.stop()
        broker.close()
        await worker.stop()
