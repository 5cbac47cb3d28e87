"""The fastest reactor is the default: ``twist`` servers, ``mdp`` and
``mdp.react`` run on Twisted's asyncio reactor over uvloop with no flag; a
``--reactor`` given, or a reactor a program installed first, wins; without
uvloop they run on Twisted's default, and work.  Each in a process of its own
(a reactor is installed once per process)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from typing import Any

import pytest
import pytest_twisted

from tests.procs import ENV, Process, bound_endpoint, finished, reactor, script

pytestmark = pytest.mark.timeout(60)

needs_uvloop = pytest.mark.skipif(importlib.util.find_spec("uvloop") is None,
                                  reason="uvloop is not installed here")

#: what mdp.uvreactor logs once it is installed
ON_UVLOOP = b"reactor: Twisted's asyncio reactor over uvloop"
#: what it logs when it falls back
FALLBACK = b"reactor: Twisted's default, as uvloop does not import"

#: a program run by mdp.react: prints its reactor and event loop, then ends as
#: its first argument says (ok, exit3, fail); "poll" installs that reactor first
PROGRAM = textwrap.dedent("""
    import sys

    if "poll" in sys.argv:
        from twisted.internet import pollreactor
        pollreactor.install()

    import mdp

    async def main(reactor, how, *rest):
        import asyncio

        from twisted.internet import task

        await task.deferLater(reactor, 0.01, lambda: None)
        loop = getattr(reactor, "_asyncioEventloop", None)
        print("REACTOR", type(reactor).__name__, "LOOP", type(loop).__module__, flush=True)
        if how == "exit3":
            raise SystemExit(3)
        if how == "fail":
            raise ValueError("main failed")

    mdp.react(main, sys.argv[1:])
""")

#: uvloop made unimportable, before anything imports mdp
NO_UVLOOP = "import sys; sys.modules['uvloop'] = None\n"


def twist(*args: str, env: dict[str, str] = ENV) -> Process:
    return Process(reactor(), [script("twist"), "--log-format", "text", *args], env)


async def serves(endpoint: str) -> None:
    """The broker at *endpoint* answers an MMI query (404: no such service)."""
    call = await finished([script("mdp"), "call", "--broker", endpoint, "--timeout", "10",
                           "--retries", "1", "mmi.service", "echo"])
    assert call.exitCode == 0 and call.output.decode().split() == ["404"], call.output


@needs_uvloop
@pytest_twisted.ensureDeferred
async def test_twist_servers_run_on_uvloop_with_no_reactor_flag() -> None:
    broker = twist("mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*", "--heartbeat", "0.5")
    endpoint = await bound_endpoint(broker, "MDP broker")
    worker = twist("mdp-worker", "--broker", endpoint, "--service", "upper",
                   "--handler", "tests.handlers_for_tests:upper", "--heartbeat", "0.5")
    try:
        await worker.waitFor("sent READY", timeout=60)
        call = await finished([script("mdp"), "call", "--broker", endpoint, "--timeout", "10",
                               "upper", "shout"])
        assert call.output.decode().splitlines() == ["SHOUT"], call.output
    finally:
        await worker.stop()
        await broker.stop()
    for proc in (broker, worker):
        assert ON_UVLOOP in proc.output, proc.output
        assert proc.output.count(b"reactor: ") == 1, proc.output


@pytest.mark.parametrize("choice", ["--reactor=epoll", "--reactor=default"])
@pytest_twisted.ensureDeferred
async def test_a_reactor_given_to_twist_wins(choice: str) -> None:
    """``--reactor=default`` too: twist installs Twisted's default while it
    reads its own options, before the plugin's."""
    broker = twist(choice, "mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*")
    try:
        await serves(await bound_endpoint(broker, "MDP broker"))
    finally:
        await broker.stop()
    assert b"uvloop" not in broker.output and b"reactor: " not in broker.output, broker.output


@pytest_twisted.ensureDeferred
async def test_twist_without_uvloop_runs_on_twisteds_default(tmp_path: Any) -> None:
    hidden = tmp_path / "uvloop"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('uvloop hidden by the test')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    broker = twist("mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*", env=env)
    try:
        await serves(await bound_endpoint(broker, "MDP broker"))
    finally:
        await broker.stop()
    assert FALLBACK + b" (uvloop hidden by the test)" in broker.output, broker.output
    assert ON_UVLOOP not in broker.output and b"Traceback" not in broker.output, broker.output


@needs_uvloop
@pytest.mark.parametrize("how, status", [("ok", 0), ("exit3", 3), ("fail", 1)])
@pytest_twisted.ensureDeferred
async def test_react_runs_a_coroutine_main_on_uvloop_and_exits_as_task_react(
        how: str, status: int) -> None:
    proc = await finished([sys.executable, "-c", PROGRAM, how])
    assert proc.exitCode == status, proc.output
    assert b"REACTOR UVLoopReactor LOOP uvloop\n" in proc.output, proc.output


@pytest.mark.parametrize("first, args, expected", [
    (NO_UVLOOP, ["ok"], b"REACTOR EPollReactor LOOP builtins"),
    ("", ["ok", "poll"], b"REACTOR PollReactor LOOP builtins"),
], ids=["without-uvloop", "reactor-installed-first"])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="epoll: Linux's default")
@pytest_twisted.ensureDeferred
async def test_react_otherwise_runs_on_the_reactor_there_is(first: str, args: list[str],
                                                            expected: bytes) -> None:
    """With uvloop unimportable, Twisted's default (and nothing said); after a
    program installed a reactor, that one."""
    proc = await finished([sys.executable, "-c", first + PROGRAM, *args])
    assert proc.exitCode == 0, proc.output
    assert proc.output.splitlines() == [expected], proc.output


@pytest.mark.parametrize("first, expected", [
    pytest.param("", "UVLoopReactor", id="uvloop", marks=needs_uvloop),
    pytest.param(NO_UVLOOP, "EPollReactor", id="without-uvloop"),
])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="epoll: Linux's default")
@pytest_twisted.ensureDeferred
async def test_the_mdp_command_runs_on_the_default_reactor(first: str, expected: str) -> None:
    """``mdp demo``, the README's first command: on uvloop, or without it on
    Twisted's default, the same replies."""
    code = first + textwrap.dedent("""
        from mdp.app import cli
        try:
            cli.main(["demo"])
        finally:
            from twisted.internet import reactor
            print("REACTOR", type(reactor).__name__, flush=True)
    """)
    proc = await finished([sys.executable, "-c", code])
    assert proc.exitCode == 0, proc.output
    lines = proc.output.decode().splitlines()
    assert "demo done" in lines and lines[-1] == f"REACTOR {expected}", lines
