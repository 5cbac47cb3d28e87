"""A streaming handler is paused while what it sends is not taken, over
ZeroMQ as over streams: the worker's DEALER counts the bytes libzmq still
holds (:class:`~mdp.transport.dealercore.DealerCore`) and is not writable past
``limits.maxOutputBytes`` (it used to queue up to 100,000 messages in libzmq:
3+ GB for 64 KiB parts)."""

from __future__ import annotations

import select
import socket
from typing import Any, Optional

import pytest
import pytest_twisted
from twisted.internet import task

from mdp.majordomo import extension
from mdp.policy import Limits
from mdp.transport.dealercore import DealerCore
from mdp.transport.framing import RecordDecoder, encode_record
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
    window = DealerCore(Limits(maxOutputBytes=1000), lambda failures: 1.0)
    first, second = _Tracker(), _Tracker()
    window.marks.extend([(first, 300), (second, 600)])
    window.handed = 700  # untracked tail
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


BINDS = {"zmq": "zmq:tcp://127.0.0.1:*", "tcp": "tcp:host=127.0.0.1:port=0"}


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_worker_rss_bounded_while_client_does_not_read(kind: str, tmp_path: Any) -> None:
    """Case: a client calls a streaming service and never reads.  The broker
    cuts it off and discards; the worker streams at the broker's pace and its
    RSS stays under RSS_BOUND for 4 s."""
    cluster = Cluster("--max-output-bytes", str(16 * MiB))
    reader: Optional[NonReader] = None
    sampler: Optional[task.LoopingCall] = None
    counts = str(tmp_path / "count")
    try:
        await cluster.startBroker(BINDS[kind])
        [worker] = await cluster.startWorkers(1, "endless", "tests.stream_peers:endless")
        samples: list[int] = []
        reader = NonReader(kind, cluster.endpoint,
                           mdp_request(b"endless", str(PART).encode(), counts.encode()))
        await wait_until(lambda: _count(counts) > 0, 30)
        sampler = task.LoopingCall(_stop_if_over, worker, samples, RSS_BOUND)
        sampler.start(0.05)
        started = reactor().seconds()
        await wait_until(lambda: reactor().seconds() - started > 4 or not worker.running, 10)
        print(f"\n{kind}: worker RSS max {max(samples) / MiB:.0f} MiB, {_count(counts)} parts")
        assert worker.running and max(samples) < RSS_BOUND, max(samples)
    finally:
        if sampler is not None and sampler.running:
            sampler.stop()
        if reader is not None:
            reader.close()
        await cluster.stop()


class FakeBroker:
    """A broker that reads a worker's READY, sends it a REQUEST and
    heartbeats, and reads nothing more until told to; small receive buffers."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.peer = b""
        if kind == "zmq":
            import zmq

            self.sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.RCVHWM, 2)
            self.sock.setsockopt(zmq.RCVBUF, 64 * 1024)
            self.sock.bind("tcp://127.0.0.1:*")
            self.endpoint = "zmq:" + self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self.listener = socket.socket()
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(1)
            self.listener.setblocking(False)
            self.endpoint = f"tcp:host=127.0.0.1:port={self.listener.getsockname()[1]}"
            self.sock = None
            self.decoder = RecordDecoder()

    def ready(self) -> Optional[list[bytes]]:
        """The worker's first message past its question for the broker's extensions (left
        unanswered, as an RFC 18 broker may), once it came (never blocks)."""
        if self.kind == "zmq":
            while self.sock.poll(0):
                self.peer, *frames = self.sock.recv_multipart()
                if frames != extension.ASK_EXTENSIONS:
                    return frames
            return None
        if self.sock is None:
            try:
                self.sock, _ = self.listener.accept()
            except BlockingIOError:
                return None
        messages = self.decoder.feed(self.sock.recv(65536)) if select.select(
            [self.sock], [], [], 0)[0] else []
        messages = [m for m in messages if m != extension.ASK_EXTENSIONS]
        return messages[0] if messages else None

    def send(self, *frames: bytes) -> None:
        if self.kind == "zmq":
            self.sock.send_multipart([self.peer, *frames])
        else:
            self.sock.setblocking(True)
            self.sock.sendall(encode_record(list(frames)))

    def read(self, count: int) -> int:
        """Read up to *count* messages' worth of what the worker sent; how many."""
        for taken in range(count):
            if self.kind == "zmq":
                if not self.sock.poll(1000):
                    return taken
                self.sock.recv_multipart()
            elif not select.select([self.sock], [], [], 1)[0] or not self.sock.recv(PART):
                return taken
        return count

    def close(self) -> None:
        if self.kind == "zmq":
            self.sock.close(linger=0)
            return
        self.listener.close()
        if self.sock is not None:
            self.sock.close()


async def pulled_until_paused(broker: FakeBroker, worker: Process, counts: str, cap: int,
                              beats: task.LoopingCall) -> int:
    """Wait for *worker*'s READY, hand it a REQUEST for PART-byte parts counted
    in the file *counts*, start *beats* (heartbeats) and wait until the handler
    stops being pulled: the parts it yielded (past *cap*, the worker is killed
    and this fails)."""
    ready: list[Optional[list[bytes]]] = [None]

    def came() -> bool:
        ready[0] = broker.ready()
        return ready[0] is not None or not worker.running

    await wait_until(came, 30)
    assert ready[0] is not None and ready[0][:2] == [b"MDPW02", b"\x01"], worker.output
    broker.send(b"MDPW02", b"\x02", b"client", b"", str(PART).encode(), counts.encode())
    beats.start(0.25)
    seen: list[int] = []

    def settled() -> bool:
        seen.append(_count(counts))
        if seen[-1] > cap:
            worker.signalProcess(9)
            raise AssertionError(f"the handler yielded {seen[-1]} parts of {PART} "
                                 f"bytes; at most {cap} may be out unread")
        return len(seen) > 10 and seen[-1] == seen[-11] > 0

    await wait_until(settled, 15, step=0.1)
    return seen[-1]


@pytest.mark.parametrize("kind", sorted(BINDS))
@pytest_twisted.ensureDeferred
async def test_streaming_handler_paused_while_broker_does_not_read(kind: str,
                                                                   tmp_path: Any) -> None:
    """A broker that sends a REQUEST and then reads nothing: the handler
    stops being pulled once BOUND bytes (and the kernel's buffers) are out,
    and resumes once the broker reads."""
    broker = FakeBroker(kind)
    counts = str(tmp_path / "count")
    worker = twist_worker(reactor(), broker.endpoint, "endless", "tests.stream_peers:endless",
                          "--heartbeat", "0.5", "--liveness", "20")
    cap = (BOUND + SLACK) // PART
    beats = task.LoopingCall(broker.send, b"MDPW02", b"\x05")
    try:
        paused = await pulled_until_paused(broker, worker, counts, cap, beats)
        assert rss(worker.transport.pid) < RSS_BOUND
        # the broker reads: the handler is pulled again
        taken = broker.read(2 * paused)
        await wait_until(lambda: _count(counts) > paused, 10)
        print(f"\n{kind}: paused at {paused} parts (cap {cap}); resumed after {taken} were read")
    finally:
        if beats.running:
            beats.stop()
        broker.close()
        await worker.stop()
