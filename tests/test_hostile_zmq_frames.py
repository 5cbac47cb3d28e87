"""A message of a million empty frames, from a separate process, against a
``twist mdp-broker`` process on ZeroMQ: the broker reads it off in C a slice
at a time and a client on the same socket keeps being answered."""

from __future__ import annotations

import time
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import threads

from mdp.majordomo import codec
from mdp.transport.zmqio import zmq_frames
from tests.procs import ENV, Process, python, reactor, twist_broker

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(zmq_frames() is None, reason="mdp.transport._zmqframes is not built "
                                 "here (test_compiled: CI builds it); through pyzmq a million frames "
                                 "take seconds to read off")]

FRAMES = 1_000_000
MESSAGES = 3

#: sends MESSAGES requests of FRAMES empty frames each to argv[1], then waits
ATTACKER = f"""
import sys, time, zmq
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.connect(sys.argv[1])
for _ in range({MESSAGES}):
    socket.send_multipart([{codec.CLIENT_HEADER!r}, {codec.C_REQUEST!r}, b"mmi.service"]
                          + [b""] * {FRAMES})
    print("sent", flush=True)
    time.sleep(0.3)
print("done", flush=True)
time.sleep(60)
"""


def round_trips(address: str, until: Any) -> list[float]:
    """Ask the broker ``mmi.service`` one request after another until
    *until*() is true; the time each took (blocking, in a thread)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    took: list[float] = []
    try:
        while not until() and len(took) < 100_000:
            started = time.monotonic()
            socket.send_multipart([codec.CLIENT_HEADER, codec.C_REQUEST, b"mmi.service", b"echo"])
            if not socket.poll(10_000):
                took.append(float("inf"))
                break
            socket.recv_multipart()
            took.append(time.monotonic() - started)
    finally:
        socket.close()
    return took


def ended(done: Any) -> bool:
    """*done* (a Deferred) fired over a second ago (called from a thread)."""
    if done.called and not hasattr(done, "firedAt"):
        done.firedAt = time.monotonic()
    return done.called and time.monotonic() - done.firedAt > 1.0


@pytest_twisted.ensureDeferred
async def test_a_million_frame_message_holds_up_the_broker_for_a_slice_only() -> None:
    r = reactor()
    broker, endpoint = await twist_broker(r, "zmq:tcp://127.0.0.1:*")
    address = endpoint.removeprefix("zmq:")
    attacker = None
    try:
        attacker = Process(r, python("-c", ATTACKER, address), ENV)
        await attacker.waitFor("sent", timeout=30)
        done = attacker.waitFor("done", timeout=30)
        # until a second after the last message went: the broker has read it off
        took = await threads.deferToThread(round_trips, address, lambda: ended(done))
        await done
        await broker.waitFor("dropped a message from", timeout=10)
    finally:
        if attacker is not None:
            await attacker.stop()
        await broker.stop()
    took.sort()
    assert len(took) > 10 and took[-1] < 0.75, f"slowest answers: {took[-5:]}"
