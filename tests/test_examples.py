"""The examples run as documented."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import pytest_twisted

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_embedded_broker_serves_through_a_factory_on_our_own_port() -> None:
    """examples/embedded_broker.py: a broker's streamFactory() behind a
    listener the test (not the broker) owns, on a port the OS picks."""
    from twisted.internet import reactor

    example = load("embedded_broker")
    reply = await example.main(reactor, "tcp:0:interface=127.0.0.1")
    assert reply == [b"HELLO FROM YOUR OWN SERVER"]


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_titanic_example_keeps_a_request_until_a_worker_comes(tmp_path) -> None:
    """examples/titanic.py: the request is stored in the given file, pending
    while no worker offers the service, and done once one does."""
    from twisted.internet import reactor

    example = load("titanic")
    database = tmp_path / "example.db"
    reply = await example.main(reactor, str(database))
    assert reply == [b"HELLO, WHENEVER YOU CAN"]
    assert database.exists()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_binarystar_example_fails_over_to_the_backup_freelance_server() -> None:
    """examples/binarystar_freelance.py: the primary answers while active;
    once it is gone, the backup takes over on the agent's votes."""
    from twisted.internet import reactor

    example = load("binarystar_freelance")
    replies = await example.main(reactor)
    assert replies == [[b"primary", b"hello"], [b"backup", b"still there?"]]


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_sessions_example_keeps_a_message_while_the_server_is_away() -> None:
    """examples/sessions.py: the message sent while the server was down is
    answered by the server that comes back; MDP runs over session+tcp."""
    from twisted.internet import reactor

    example = load("sessions")
    answers, reply = await example.main(reactor)
    assert answers == [[b"HELLO"], [b"SESSIONS"]]
    assert reply == [b"over a session"]


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_freelance_example_fails_over_from_server_to_server() -> None:
    """examples/freelance.py: the agent sends to alpha while it lives, then
    to beta once alpha is stopped, then to gamma once beta is; the same lines
    on every run."""
    from twisted.internet import reactor

    example = load("freelance")
    lines = await example.main(reactor)
    assert lines == [
        "alpha, beta and gamma are alive",
        "request 1 answered by alpha",
        "request 2 answered by alpha",
        "alpha stopped",
        "request 3 answered by beta",
        "request 4 answered by beta",
        "beta stopped",
        "request 5 answered by gamma",
    ]
    assert all(f"    {line}\n" in example.__doc__ for line in lines)  # as its docstring says
