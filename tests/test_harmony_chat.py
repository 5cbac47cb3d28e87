"""``mdp chat`` and examples/harmony_chat.py as processes, talking over
ZeroMQ on 127.0.0.1 with peers given by endpoint (no UDP leaves the test;
the beacon variant runs in a network namespace, tests/test_harmony_netns.py)."""

from __future__ import annotations

import os
import socket

import pytest
import pytest_twisted

from tests.procs import ENV, ROOT, Process, python, reactor, script

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_command(kind: str, name: str, *options: str) -> list[str]:
    if kind == "cli":
        return [script("mdp"), "chat", "--name", name, *options]
    return python(os.path.join(ROOT, "examples", "harmony_chat.py"), name, *options)


@pytest.mark.parametrize("kind", ["cli", "example"])
@pytest_twisted.ensureDeferred
async def test_two_chats_find_each_other_and_talk(kind: str) -> None:
    port = free_port()
    alice = Process(reactor(), chat_command(kind, "alice", "--endpoint", "zmq:tcp://127.0.0.1:*",
                                            "--peer", f"tcp://127.0.0.1:{port}"), env=ENV)
    bob = None
    try:
        match = await alice.waitFor(r"at (tcp://127\.0\.0\.1:\d+)")
        bob = Process(reactor(), chat_command(kind, "bob", "--endpoint",
                                              f"zmq:tcp://127.0.0.1:{port}", "--peer",
                                              match.group(1).decode()), env=ENV)
        await alice.waitFor(r"\* bob (is here|joined)")
        await bob.waitFor(r"\* alice (is here|joined)")
        alice.transport.write("hello, bob — ça va?\n".encode())
        await bob.waitFor("alice: hello, bob — ça va\\?")
        bob.transport.write(b"fine\n")
        await alice.waitFor("bob: fine")
        if kind == "cli":
            bob.transport.write(b"/w alice just for you\n/peers\n/w nobody x\n")
            await alice.waitFor(r"bob \(to you\): just for you")
            await bob.waitFor(r"\* peers: alice")
            await bob.waitFor(r"\* no peer called 'nobody'")
        alice.transport.closeStdin()  # Ctrl-D: leaves cleanly
        await alice.ended(15)
        assert alice.exitCode == 0, alice.output
    finally:
        await alice.stop()
        if bob is not None:
            await bob.stop()


@pytest.mark.parametrize("argv, message", [
    (["chat"], "mdp chat: --name is required"),
    (["chat", "--name", "x", "--interface", "nope0"], "no IPv4 interface 'nope0'"),
    (["chat", "--name", "x", "--peer", "tcp://127.0.0.1"], "no port"),
    (["chat", "--name", "x" * 300], "at most 255 bytes"),
])
@pytest_twisted.ensureDeferred
async def test_chat_usage_mistakes_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = Process(reactor(), [script("mdp"), *argv], env=ENV)
    await proc.ended(30)
    assert proc.exitCode == 2
    assert message.encode() in proc.output and b"Traceback" not in proc.output


@pytest.mark.parametrize("kind", ["cli", "example"])
@pytest_twisted.ensureDeferred
async def test_ctrl_c_leaves_a_chat_quietly(kind: str) -> None:
    """As Ctrl-D does, without a traceback (``mdp chat`` exits 130, as
    every ``mdp`` command on Ctrl-C)."""
    import signal

    alice = Process(reactor(), chat_command(kind, "alice", "--endpoint", "zmq:tcp://127.0.0.1:*",
                                            "--peer", f"tcp://127.0.0.1:{free_port()}"), env=ENV)
    try:
        await alice.waitFor(r"at (tcp://127\.0\.0\.1:\d+)")
        alice.signalProcess(signal.SIGINT)
        await alice.ended(15)
    finally:
        await alice.stop()
    assert b"Traceback" not in alice.output, alice.output
    assert alice.exitCode == (130 if kind == "cli" else 0), alice.output
