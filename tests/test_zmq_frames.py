"""ZeroMQ messages read and sent in C (``mdp/transport/_zmqframes.pyx``):
whole messages and their limits as the pyzmq path reads them, long frames
kept as libzmq's messages and shared when sent on, pyzmq's errors, a signal
during a blocking read; and the pyzmq path itself, where the module is not
used (run from source)."""

from __future__ import annotations

import signal
import sys
from typing import Any, Iterator, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp import _compiled
from mdp.transport.zeromq import zmq_frames
from mdp.transport.zmqio import OVER, read_pyzmq, socket_calls
from tests.test_compiled import _run

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(60)

C = zmq_frames()
needs_c = pytest.mark.skipif(
    C is None, reason="mdp.transport._zmqframes is not built here (test_compiled: CI builds it)")

NOBLOCK = int(zmq.NOBLOCK)
NEVER = sys.maxsize


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any]]:
    """(receiver, sender): a PAIR of sockets over inproc."""
    context = zmq.Context()
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("inproc://frames")
    sender.connect("inproc://frames")
    yield receiver, sender
    receiver.close(0)
    sender.close(0)
    context.term()


def expected(message: list[bytes], keepAfter: int, keepBytes: int, maxFrames: int,
             maxBytes: int, envelope: bool) -> Union[list[Any], tuple[int, list[Any]]]:
    """What the pyzmq path (``zmqio.read_pyzmq``) makes of *message*;
    a kept frame as ``("kept", its bytes)``."""
    size = 0 if envelope else len(message[0])
    if size > maxBytes:
        return OVER, [b"", 1, size, len(message) > 1]
    frames: list[Any] = [message[0]]
    for count, frame in enumerate(message[1:], start=2):
        size += len(frame)
        if count > maxFrames or size > maxBytes:
            return OVER, [message[0], count, size, count < len(message)]
        frames.append(("kept", frame) if count > keepAfter and len(frame) >= keepBytes else frame)
    return frames


def seen(got: Any) -> Any:
    if isinstance(got, list):
        return [f if type(f) is bytes else ("kept", bytes(f)) for f in got]
    return got


def reader(kind: str) -> Any:
    """The read call of *kind*, taking the socket: the C module's, or the
    pyzmq path's (which both shells use where the module is not built)."""
    if kind == "c":
        return lambda socket, *args: C.read(socket.underlying, *args)
    socket_calls(native=False)  # binds the pyzmq calls read_pyzmq makes
    return read_pyzmq


@pytest.mark.parametrize("kind", [pytest.param("c", marks=needs_c), "pyzmq"])
@settings(max_examples=300, deadline=None)
@given(message=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
       keepAfter=st.integers(0, 9), keepBytes=st.integers(0, 300),
       maxFrames=st.integers(1, 9), maxBytes=st.integers(0, 1500), envelope=st.booleans())
def test_a_message_is_read_as_the_model_says(
        pair: tuple[Any, Any], kind: str, message: list[bytes], keepAfter: int, keepBytes: int,
        maxFrames: int, maxBytes: int, envelope: bool) -> None:
    receiver, sender = pair
    read = reader(kind)
    sender.send_multipart(message)
    sender.send(b"next")
    got = read(receiver, NOBLOCK, keepAfter, keepBytes, maxFrames, maxBytes, envelope)
    assert seen(got) == expected(message, keepAfter, keepBytes, maxFrames, maxBytes, envelope)
    if not isinstance(got, list):
        while receiver.get(zmq.RCVMORE):  # the caller reads the rest off
            receiver.recv()
    # nothing of it is left behind, and the next message is whole
    assert read(receiver, NOBLOCK, NEVER, 0, NEVER, NEVER, False) == [b"next"]


@needs_c
def test_a_kept_frame_is_a_read_only_buffer_and_is_sent_on_whole(pair: tuple[Any, Any]) -> None:
    receiver, sender = pair
    long = bytes(range(256)) * 200
    sender.send_multipart([b"head", long, b"tail"])
    head, kept, tail = C.read(receiver.underlying, NOBLOCK, 1, 1000, NEVER, NEVER, False)
    assert (head, tail) == (b"head", b"tail") and type(kept) is C.Held
    assert len(kept) == len(long) and bytes(kept) == long
    view = memoryview(kept)
    assert view.readonly and view.nbytes == len(long) and view[:3].tobytes() == long[:3]
    view.release()
    assert repr(kept) == f"<Held frame of {len(long)} bytes>"
    # sent on (shared, not copied), then dropped here: what went out stays whole
    C.send(sender.underlying, [b"a", kept, b"b"], 1 << 20, None, sender)
    del kept
    assert receiver.recv_multipart() == [b"a", long, b"b"]


@needs_c
def test_frames_that_are_not_bytes_or_long_go_through_pyzmq(pair: tuple[Any, Any]) -> None:
    receiver, sender = pair
    calls: list[tuple[Any, int, bool]] = []

    def fallback(socket: Any, frame: Any, flags: int, copy: bool) -> None:
        calls.append((frame, flags, copy))
        zmq.backend.Socket.send(socket, frame, flags, copy)

    view, frame, big = memoryview(b"view"), zmq.Frame(b"frame"), b"B" * 64
    C.send(sender.underlying, [b"small", view, frame, big], 64, fallback, sender)
    assert receiver.recv_multipart() == [b"small", b"view", b"frame", big]
    more = int(zmq.NOBLOCK | zmq.SNDMORE)
    assert calls == [(view, more, True), (frame, more, True), (big, NOBLOCK, False)]


@needs_c
def test_a_message_over_large_above_is_not_sent_but_measured(pair: tuple[Any, Any]) -> None:
    """With *largeAbove*, a larger message comes back as its size, unsent
    (a ROUTER lowers its mark first), and one no larger goes as before."""
    receiver, sender = pair
    long = b"L" * 300
    sender.send_multipart([b"x", long])
    kept = C.read(receiver.underlying, NOBLOCK, 0, 100, NEVER, NEVER, False)[1]
    message = [b"ab", kept, memoryview(b"cde")]
    assert C.send(sender.underlying, message, 1 << 20, zmq.backend.Socket.send, sender,
                  304) == 305
    assert not receiver.poll(0)
    assert C.send(sender.underlying, message, 1 << 20, zmq.backend.Socket.send, sender,
                  305) is None
    assert receiver.recv_multipart() == [b"ab", long, b"cde"]


@needs_c
def test_events_answers_as_pyzmq_does() -> None:
    """``events`` is ``get(EVENTS)``: output only on a socket with nothing
    come, input too once a message is there, output gone once its pipe is
    full, and no input again once the message is read."""
    context = zmq.Context()
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        sender.setsockopt(zmq.SNDHWM, 1)
        receiver.setsockopt(zmq.RCVHWM, 1)
        receiver.bind("inproc://events")
        sender.connect("inproc://events")

        def both(socket: Any) -> tuple[int, int]:
            return C.events(socket.underlying), int(socket.get(zmq.EVENTS))

        assert both(receiver) == (zmq.POLLOUT, zmq.POLLOUT)
        sender.send(b"one")
        assert both(receiver) == (zmq.POLLIN | zmq.POLLOUT,) * 2
        for _ in range(100):  # fill the pipe (it takes a few messages)
            if not C.events(sender.underlying) & zmq.POLLOUT:
                break
            sender.send(b"more", zmq.NOBLOCK)
        assert both(sender) == (0, 0)
        for _ in range(100):
            if not receiver.poll(0):
                break
            receiver.recv()
        assert both(receiver) == (zmq.POLLOUT, zmq.POLLOUT)
    finally:
        receiver.close(0)
        sender.close(0)
        context.term()


@needs_c
def test_nothing_to_read_or_nowhere_to_send_raises_as_pyzmq_does(pair: tuple[Any, Any]) -> None:
    receiver, _ = pair
    with pytest.raises(zmq.Again):
        C.read(receiver.underlying, NOBLOCK, NEVER, 0, NEVER, NEVER, False)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)  # connected to nobody: a send cannot go
    router = context.socket(zmq.ROUTER)
    peer = context.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        with pytest.raises(zmq.Again):
            C.send(dealer.underlying, [b"lost", b"too"], 1 << 20, None, dealer)
        with pytest.raises(zmq.ZMQError) as refused:
            C.send(router.underlying, [b"no such peer", b"body"], 1 << 20, None, router)
        assert refused.value.errno == zmq.EHOSTUNREACH and not isinstance(refused.value, zmq.Again)
        # the refused message left nothing half-sent behind it
        peer.bind("inproc://somewhere")
        dealer.connect("inproc://somewhere")  # (its pipe is there at once)
        C.send(dealer.underlying, [b"this", b"one"], 1 << 20, None, dealer)
        assert peer.poll(10_000) and peer.recv_multipart() == [b"this", b"one"]
    finally:
        for socket in (dealer, router, peer):
            socket.close(0)
        context.term()


class Interrupted(Exception):
    pass


@needs_c
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timers here")
def test_a_signal_handler_ends_a_blocking_read_or_lets_it_go_on(pair: tuple[Any, Any]) -> None:
    """A read that waits (no NOBLOCK) gives way to a handler's exception, as
    Ctrl-C's KeyboardInterrupt; a handler that returns lets it wait on."""
    receiver, _ = pair
    handled: list[int] = []

    def raising(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, raising)
    receiver.setsockopt(zmq.RCVTIMEO, 20_000)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            C.read(receiver.underlying, 0, NEVER, 0, NEVER, NEVER, False)
        signal.signal(signal.SIGALRM, lambda signum, frame: handled.append(signum))
        receiver.setsockopt(zmq.RCVTIMEO, 300)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(zmq.Again):  # the receive timeout, after the handler ran
            C.read(receiver.underlying, 0, NEVER, 0, NEVER, NEVER, False)
        assert handled == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        receiver.setsockopt(zmq.RCVTIMEO, -1)


def test_the_module_is_used_only_where_it_is_built_and_current() -> None:
    """``zmq_frames`` gives the module exactly where ``mdp._compiled`` says it
    runs compiled; from source (``MDP_PURE_PYTHON``) it is not used."""
    status = _compiled.status()["mdp.transport._zmqframes"]
    assert (C is not None) == (status == "compiled")
    probe = "from mdp.transport import zeromq; print(zeromq.zmq_frames() is None)"
    assert _run(probe, **{_compiled.PURE_ENV: "1"}).strip() == "True"


#: tests of the ZeroMQ transport and the blocking nodes' ZeroMQ pipe that
#: touch reading, limits and kept frames, for the pyzmq path
PYZMQ_PATH_TESTS = [
    "tests/test_limits.py::test_zmq_drops_messages_over_the_limits_without_keeping_them",
    "tests/test_limits.py::test_zmq_reads_off_a_huge_message_over_many_reactor_turns",
    "tests/test_perf_copies.py",
    "tests/test_perf_zmq_reads.py",
    "tests/test_transport_conformance.py",
    "tests/test_zmq_marks.py",
    "tests/test_blocking.py::test_a_request_over_the_limits_is_refused_and_a_reply_over_them_dropped",
    "tests/test_blocking.py::test_partials_reach_on_partial_before_the_final",
]


@pytest.mark.timeout(60)
def test_the_pyzmq_path_holds_too() -> None:
    """Where the module is used, the same tests again from source, where it
    is not (pyzmq's ``zmq.Frame`` and ``send``)."""
    if C is None:
        pytest.skip("the pyzmq path is the one these tests ran already")
    out = _run("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
               f"'-p', 'no:randomly', *{PYZMQ_PATH_TESTS!r}]))",
               timeout=280, **{_compiled.PURE_ENV: "1"})
    assert " passed" in out and " failed" not in out, out


@pytest.mark.parametrize("kind", [pytest.param("c", marks=needs_c), "pyzmq"])
@settings(max_examples=100, deadline=None)
@given(message=st.lists(st.binary(max_size=20), min_size=2, max_size=40),
       budget=st.integers(1, 12))
def test_a_message_over_the_limits_is_read_off_a_budget_at_a_time(
        pair: tuple[Any, Any], kind: str, message: list[bytes], budget: int) -> None:
    """What is left of a message after its first frame is read off in slices
    of at most *budget* frames, counted in frames and bytes; the next message
    is whole."""
    from mdp.transport.zmqio import skip_pyzmq

    receiver, sender = pair
    socket_calls(native=False)
    skip = (lambda: C.skip(receiver.underlying, budget)) if kind == "c" else (
        lambda: skip_pyzmq(receiver, budget))
    sender.send_multipart(message)
    sender.send(b"next")
    assert receiver.recv() == message[0]
    frames = size = 0
    more = True
    while more:
        count, length, more = skip()
        assert 1 <= count <= budget and (more is False or count == budget)
        frames, size = frames + count, size + length
    assert (frames, size) == (len(message) - 1, sum(map(len, message[1:])))
    assert receiver.recv_multipart() == [b"next"]
