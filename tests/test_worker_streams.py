"""A streaming handler is paused while what it sends is not taken, over
ZeroMQ as over streams: the worker's DEALER counts the bytes libzmq still
holds (:class:`~mdp.transport.zeromq.InFlight`) and is not writable past
``limits.maxOutputBytes`` (it used to queue up to 100,000 messages in libzmq:
3+ GB for 64 KiB parts)."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest_twisted
from twisted.internet import task

from mdp.policy import Limits
from mdp.transport.zeromq import InFlight
from tests.procs import Cluster, Process, reactor, twist_worker, wait_until
from tests.test_hostile_processes import NonReader, mdp_request, rss

MiB = 1024 * 1024
PART = 64 * 1024
#: the worker's bound (its default limits.maxOutputBytes)
BOUND = Limits().maxOutputBytes
#: the worker's RSS stays under this while its client does not read (measured
#: 60-120 MB; without the bound it passes 1 GB within 2 s)
RSS_BOUND = 300 * MiB
#: what lies beyond the worker's count between the generator and a broker
#: that reads nothing: kernel socket buffers and libzmq's pipes (measured
#: under 8 MiB)
SLACK = 32 * MiB


class _Tracker:
    def __init__(self) -> None:
        self.done = False


def test_in_flight_counts_bytes_up_to_the_oldest_tracker_not_done() -> None:
    window = InFlight(1000)
    first, second = _Tracker(), _Tracker()
    window.marks.extend([(first, 300), (second, 600)])
    window.sent = 700  # untracked tail
    assert window.held() == 700
    first.done = True
    assert window.held() == 400
    second.done = True
    assert window.held() == 100 and not window.marks


def _count(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _stop_if_over(proc: Process, sampled: list[int], bound: int) -> bool:
    """Sample the RSS of *proc*; kill it past *bound* (no GBs on a failure)."""
    sampled.append(rss(proc.transport.pid))
    if sampled[-1] > bound:
        proc.signalProcess(9)
        return True
    return False


@pytest_twisted.ensureDeferred
async def test_worker_rss_bounded_while_zmq_client_does_not_read(tmp_path: Any) -> None:
    """Case: a client calls a streaming service over ZeroMQ and never reads.
    The broker cuts it off and discards; the worker streams at the broker's
    pace and its RSS stays under RSS_BOUND for 4 s."""
    cluster = Cluster("--max-output-bytes", str(16 * MiB))
    reader: Optional[NonReader] = None
    sampler: Optional[task.LoopingCall] = None
    counts = str(tmp_path / "count")
    try:
        await cluster.startBroker("zmq:tcp://127.0.0.1:*")
        [worker] = await cluster.startWorkers(1, "endless", "tests.stream_peers:endless")
        samples: list[int] = []
        reader = NonReader("zmq", cluster.endpoint,
                           mdp_request(b"endless", str(PART).encode(), counts.encode()))
        await wait_until(lambda: _count(counts) > 0, 30)
        sampler = task.LoopingCall(_stop_if_over, worker, samples, RSS_BOUND)
        sampler.start(0.05)
        started = reactor().seconds()
        await wait_until(lambda: reactor().seconds() - started > 4 or not worker.running, 10)
        print(f"\nworker RSS max {max(samples) / MiB:.0f} MiB, {_count(counts)} parts")
        assert worker.running and max(samples) < RSS_BOUND, max(samples)
    finally:
        if sampler is not None and sampler.running:
            sampler.stop()
        if reader is not None:
            reader.close()
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_streaming_handler_paused_while_broker_does_not_read(tmp_path: Any) -> None:
    """A broker (this test's ROUTER) that sends a REQUEST and then reads
    nothing: the handler stops being pulled once BOUND bytes (and the kernel's
    buffers) are out, and resumes once the broker reads."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 2)
    router.setsockopt(zmq.RCVBUF, 64 * 1024)
    router.bind("tcp://127.0.0.1:*")
    endpoint = "zmq:" + router.getsockopt(zmq.LAST_ENDPOINT).decode()
    counts = str(tmp_path / "count")
    worker = twist_worker(reactor(), endpoint, "endless", "tests.stream_peers:endless",
                          "--heartbeat", "0.5", "--liveness", "20")
    cap = (BOUND + SLACK) // PART
    try:
        await wait_until(lambda: router.poll(0), 30)
        ready = router.recv_multipart()
        assert ready[1:3] == [b"MDPW02", b"\x01"], ready
        peer = ready[0]
        router.send_multipart([peer, b"MDPW02", b"\x02", b"client", b"", str(PART).encode(),
                               counts.encode()])

        def beat() -> None:
            router.send_multipart([peer, b"MDPW02", b"\x05"])

        beats = task.LoopingCall(beat)
        beats.start(0.25)
        try:
            seen: list[int] = []

            def settled() -> bool:
                seen.append(_count(counts))
                if seen[-1] > cap:
                    worker.signalProcess(9)
                    raise AssertionError(f"the handler yielded {seen[-1]} parts of {PART} "
                                         f"bytes; at most {cap} may be out unread")
                return len(seen) > 10 and seen[-1] == seen[-11] > 0

            await wait_until(settled, 15, step=0.1)
            paused = seen[-1]
            assert rss(worker.transport.pid) < RSS_BOUND
            # the broker reads: the handler is pulled again
            taken = 0
            while taken < 2 * paused:
                if router.poll(1000):
                    router.recv_multipart()
                    taken += 1
                else:
                    break
            await wait_until(lambda: _count(counts) > paused, 10)
            print(f"\npaused at {paused} parts (cap {cap}); resumed after {taken} were read")
        finally:
            beats.stop()
    finally:
        router.close(linger=0)
        await worker.stop()
        if os.path.exists(counts):
            os.remove(counts)
