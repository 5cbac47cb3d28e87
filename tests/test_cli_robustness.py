"""The ``mdp`` script when what is around it misbehaves: a reader of its
output that has gone, output closed, arguments that are not UTF-8, numbers
that are not finite, Ctrl-C at any moment, a broker with odd MMI answers."""

from __future__ import annotations

import signal
from typing import Any, Iterator, Optional

import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.python import usage

from mdp.app import cli
from tests.conftest import RawRouter
from tests.procs import ENV, Process, python, reactor, script

pytestmark = pytest.mark.timeout(60)

#: runs ``mdp ARGV...`` with its standard output a pipe whose reader has gone
#: (``mdp ... | head -0``); exec keeps the process, so the exit status is mdp's
READER_GONE = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
               "os.execv(sys.argv[1], sys.argv[1:])")
#: runs ``mdp ARGV...`` with its standard output closed (``mdp ... >&-``)
OUTPUT_CLOSED = "import os, sys; os.close(1); os.execv(sys.argv[1], sys.argv[1:])"

#: an argument that is not UTF-8, as a shell passes ``$'caf\xe9'``
LATIN1 = "caf\udce9"


async def _mdp(*argv: str, wrapper: Optional[str] = None) -> Process:
    """``mdp ARGV...`` run to its end (exec'd by the Python code *wrapper*
    if given); its stderr, and its stdout unless the wrapper took it, are
    in ``output``."""
    args = [script("mdp"), *argv]
    proc = Process(reactor(), python("-c", wrapper, *args) if wrapper else args, env=ENV)
    try:
        await proc.ended(30)
    finally:
        await proc.stop()
    return proc


async def _all(*runs: Any) -> list[Process]:
    """Several :func:`_mdp` runs at once (each starts in about half a second)."""
    return list(await defer.gatherResults([defer.ensureDeferred(run) for run in runs],
                                          consumeErrors=True))


@pytest.fixture
def sigint() -> Iterator[None]:
    """:func:`cli.main` takes SIGINT over; give it back to pytest after."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def _echo_broker() -> tuple[Any, Any, str]:
    from mdp import Broker, Worker
    from mdp.handlers import echo

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", echo, reactor())
    worker.start()
    return broker, worker, bound.endpoint


# --- output nobody reads, output closed -------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_a_reader_that_has_gone_is_exit_141_and_no_traceback() -> None:
    """As a command killed by SIGPIPE: status 128 + 13, nothing on stderr."""
    broker, worker, endpoint = await _echo_broker()
    try:
        procs = await _all(
            _mdp("call", "--broker", endpoint, "echo", "hello", "world", wrapper=READER_GONE),
            _mdp("status", "--broker", endpoint, wrapper=READER_GONE),
            _mdp("demo", "--requests", "1", wrapper=READER_GONE))
    finally:
        await worker.stop()
        await broker.close()
    for proc in procs:
        assert (proc.exitCode, proc.output) == (141, b""), (proc.args, proc.exitCode, proc.output)


@pytest_twisted.ensureDeferred
async def test_output_closed_is_one_line_and_exit_2() -> None:
    proc = await _mdp("demo", "--requests", "1", wrapper=OUTPUT_CLOSED)
    assert proc.exitCode == 2, proc.output
    assert proc.output == b"mdp: standard output is closed; nothing was sent\n"


# --- arguments that are not UTF-8 ---------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_a_frame_that_is_not_utf8_is_sent_as_the_bytes_given() -> None:
    broker, worker, endpoint = await _echo_broker()
    try:
        proc = await _mdp("call", "--broker", endpoint, "echo", LATIN1, "ok")
    finally:
        await worker.stop()
        await broker.close()
    assert proc.exitCode == 0, proc.output
    assert proc.output.decode().splitlines() == ["b'caf\\xe9'", "ok"]


@pytest.mark.parametrize("options, argv, key, value", [
    (cli.TitanicSubmitOptions, ["echo", LATIN1], "frames", [b"caf\xe9"]),
    (cli.FreelanceCallOptions, [LATIN1, "x"], "frames", [b"caf\xe9", b"x"]),
    (cli.SPRequestOptions, [LATIN1], "payload", b"caf\xe9"),
])
def test_arguments_that_are_not_utf8_are_their_bytes(options: Any, argv: list[str], key: str,
                                                     value: object) -> None:
    parsed = options()
    parsed.parseOptions(argv)
    assert parsed[key] == value


def test_a_service_name_that_is_not_utf8_is_a_usage_error() -> None:
    with pytest.raises(usage.UsageError, match="is not ASCII"):
        cli.CallOptions().parseOptions([LATIN1, "x"])


@pytest.mark.parametrize("host", [LATIN1, "a" * 64, "a..b"])
def test_a_broker_host_the_resolver_cannot_take_is_a_usage_error(host: str) -> None:
    """Not a traceback when connecting: the endpoint is refused while parsed."""
    with pytest.raises(usage.UsageError, match="not a host name"):
        cli.CallOptions().parseOptions(["--broker", f"tcp:host={host}:port=1", "echo", "x"])


# --- numbers of seconds -------------------------------------------------------------------

REQUEST_ID = "5f0c6f6e-3a4b-4c4d-9e8f-0123456789ab"


@pytest.mark.parametrize("options, argv", [
    (cli.CallOptions, ["--timeout", "nan", "echo", "x"]),
    (cli.CallOptions, ["--timeout", "inf", "echo", "x"]),
    (cli.CallOptions, ["--timeout", "-inf", "echo", "x"]),
    (cli.CallOptions, ["--timeout", "0", "echo", "x"]),
    (cli.StatusOptions, ["--timeout", "nan"]),
    (cli.StatusOptions, ["--watch", "inf"]),
    (cli.StatusOptions, ["--watch", "nan"]),
    (cli.FreelanceCallOptions, ["--timeout", "nan", "x"]),
    (cli.FreelanceCallOptions, ["--deadline", "inf", "x"]),
    (cli.TitanicSubmitOptions, ["--timeout", "inf", "echo", "x"]),
    (cli.TitanicResultOptions, ["--poll", "nan", REQUEST_ID]),
    (cli.SPRequestOptions, ["--timeout", "nan", "x"]),
    (cli.SPRequestOptions, ["--resend", "inf", "x"]),
])
def test_seconds_must_be_finite_and_positive(options: Any, argv: list[str]) -> None:
    with pytest.raises(usage.UsageError, match="must be a positive number of seconds"):
        options().parseOptions(argv)


def test_a_nan_is_one_line_and_exit_2(capsys: Any, sigint: None) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["sp-request", "--resend", "nan", "x"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == ("mdp sp-request: --resend must be a positive number of seconds, not nan "
                   "(see mdp sp-request --help)\n")


# --- Ctrl-C ---------------------------------------------------------------------------------

#: the ``mdp`` script, held while it imports the command line (Twisted, ZeroMQ)
#: until its standard input has a line: Ctrl-C can come in that instant
HELD_IN_IMPORT = """
import importlib.abc, signal, sys
if sys.argv[1] == "ignored":  # as a program started in the background inherits it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
class Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mdp.app.cli":
            sys.stdout.write("importing\\n")  # one write: print's text and end are two
            sys.stdout.flush()
            sys.stdin.readline()
        return None
sys.meta_path.insert(0, Gate())
from mdp.app.console import main
main(sys.argv[2:])
"""


@pytest_twisted.ensureDeferred
async def test_ctrl_c_while_the_library_loads_is_exit_130_and_quiet() -> None:
    proc = Process(reactor(), python("-c", HELD_IN_IMPORT, "caught", "call", "echo", "x"),
                   env=ENV)
    try:
        await proc.waitFor("importing\n", 60)
        assert "twisted.internet.reactor" not in proc.output.decode()
        proc.signalProcess(signal.SIGINT)
        await proc.ended(30)
    finally:
        await proc.stop()
    assert proc.exitCode == cli.EXIT_INTERRUPTED, proc.output
    assert proc.output == b"importing\n"


@pytest_twisted.ensureDeferred
async def test_ctrl_c_ignored_by_the_parent_stays_ignored() -> None:
    proc = Process(reactor(), python("-c", HELD_IN_IMPORT, "ignored", "--version"), env=ENV)
    try:
        await proc.waitFor("importing\n", 60)
        proc.signalProcess(signal.SIGINT)  # ignored: nothing happens
        proc.transport.write(b"go on\n")
        await proc.ended(30)
    finally:
        await proc.stop()
    assert proc.exitCode == 0, proc.output
    assert b"txmajordomo" in proc.output


def test_the_package_loads_its_names_when_first_used() -> None:
    """``import mdp`` alone loads neither Twisted's reactor nor ZeroMQ (the
    script's first instant is cheap); every public name is still there."""
    code = ("import sys, mdp\n"
            "assert 'zmq' not in sys.modules and 'twisted.internet.reactor' not in sys.modules\n"
            "assert 'mdp.majordomo.broker' not in sys.modules and 'typing' not in sys.modules\n"
            "import pkgutil\n"
            "found = {m.name for m in pkgutil.iter_modules(mdp.__path__) if m.name[0] != '_'}\n"
            "assert found == set(mdp._MODULES), found ^ set(mdp._MODULES)\n"
            "assert mdp.transport.register and mdp.policy.HeartbeatPolicy\n"
            "assert 'TYPE_CHECKING' not in dir(mdp) and 'transport' in dir(mdp)\n"
            "assert sorted(mdp.__all__) == sorted(mdp._HOMES)\n"
            "from mdp import *\n"
            "names = [getattr(mdp, n) for n in mdp.__all__]\n"
            "assert mdp.Broker.__module__ == 'mdp.majordomo.broker', mdp.Broker\n"
            "print(len(names))\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 33


def test_ctrl_c_before_the_reactor_runs_is_exit_130(monkeypatch: Any, capsys: Any,
                                                    sigint: None) -> None:
    """While the options are read (a handler's module imported, say), before
    SIGINT is the script's own."""
    def interrupted(self: Any, options: Any = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.Options, "parseOptions", interrupted)
    try:
        cli.main(["call", "echo", "x"])
    except SystemExit as e:
        code: object = e.code
    except KeyboardInterrupt:
        code = "KeyboardInterrupt"
    assert code == cli.EXIT_INTERRUPTED
    assert capsys.readouterr() == ("", "")


# --- what peers say, shown ----------------------------------------------------------------

def test_control_characters_are_shown_escaped() -> None:
    assert cli.printable("\x1b[2J\x1b]0;title\x07 tab\there\n") == \
        "\\x1b[2J\\x1b]0;title\\x07 tab\\there\\n"
    assert cli.printable("café ok") == "café ok"
    assert cli.printable("caf\udce9") == "caf\\udce9"


class _MMIBroker(RawRouter):
    """Answers every request with the FINAL *answers* gives its service;
    another service (``mdp status`` asks ``mmi.binarystar`` first), 501 as
    a broker that is not in a pair."""

    def __init__(self, answers: dict[bytes, list[bytes]]) -> None:
        super().__init__()
        self.answers = answers

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        header, command, service = frames[:3]
        self.send(peer, header, b"\x03", service, *self.answers.get(service, [b"501"]))


async def _mmi_broker(services: list[bytes], workers: list[bytes]) -> _MMIBroker:
    from mdp import transport

    broker = _MMIBroker({b"mmi.services": services, b"mmi.workers": workers})
    broker.clock = reactor()
    broker.transport = await transport.listen("zmq:tcp://127.0.0.1:*", broker, reactor())
    return broker


SERVICES = b'{"echo": {"workers": 1, "idle": 1, "queued": 0}}'
WORKERS = b'[{"id": "ab", "service": "echo", "busy": false, "dialect": "rfc", "silence": 0.1}]'


@pytest_twisted.ensureDeferred
async def test_mdp_status_and_call_show_odd_mmi_answers_safely() -> None:
    """JSON nested too deep, megabytes that are not JSON, a malformed
    ``mmi.workers``: one line on stderr naming the query, cut short; escape
    codes in names and error texts: shown escaped."""
    import json

    from mdp.messages import error_body

    escapes = [json.dumps({"\x1b[2J\x1b[31mevil": {"workers": 1, "idle": 1,
                                                     "queued": 0}}).encode(),
               json.dumps([{"id": "\x1b]0;pwned\x07", "service": "\x1b[2J", "busy": False,
                            "dialect": "rfc", "silence": 0.1}]).encode()]
    brokers = [await _mmi_broker(*answers) for answers in [
        ([b"[" * 100_000 + b"]" * 100_000], [WORKERS]),
        ([b"x" * 1_000_000], [WORKERS]),
        ([SERVICES], [b"[1, 2, 3]"]),
        (escapes[:1], escapes[1:]),
        (error_body(b"503", "\x1b[2Jnope"), [WORKERS]),
    ]]
    try:
        *statuses, call = await _all(
            *[_mdp("status", "--broker", broker.transport.endpoint, "--retries", "1")
              for broker in brokers],
            _mdp("call", "--broker", brokers[-1].transport.endpoint, "--retries", "1",
                 "mmi.services"))
    finally:
        for broker in brokers:
            await broker.transport.close()
    for proc in statuses + [call]:
        assert b"Traceback" not in proc.output and b"\x1b" not in proc.output, proc.output
    deep, huge, badWorkers, escaped, error = statuses
    for proc, query, size in [(deep, "mmi.services", 200_000), (huge, "mmi.services", 1_000_000),
                              (badWorkers, "mmi.workers", 9)]:
        assert proc.exitCode == 1, proc.output
        [line] = proc.output.decode().splitlines()
        assert f"does not describe its services ({query} answered [b'" in line, line
        assert len(line) < 400 and (size < 200 or f"({size} bytes in 1 frame)" in line), line
    assert escaped.exitCode == 0, escaped.output
    assert b"\\x1b[2J\\x1b[31mevil" in escaped.output
    assert b"\\x1b]0;pwned\\x07  \\x1b[2J" in escaped.output
    for proc in error, call:
        assert proc.exitCode == 1, proc.output
        assert proc.output.endswith(b"answered 503: \\x1b[2Jnope\n"), proc.output


@pytest_twisted.ensureDeferred
async def test_mdp_status_of_several_brokers_reads_each_on_its_own() -> None:
    """One good broker among two that answer MMI with what it cannot read (a list for
    mmi.services, JSON nested too deep): each bad one is a line of its own, the good one's
    tables and sum stay, no traceback, exit status 1."""
    brokers = [await _mmi_broker(*answers) for answers in [
        ([SERVICES], [WORKERS]), ([b"[]"], [WORKERS]),
        ([b"[" * 100_000 + b"]" * 100_000], [WORKERS])]]
    endpoints = [broker.transport.endpoint for broker in brokers]
    try:
        [proc] = await _all(_mdp("status", *(o for e in endpoints for o in ("--broker", e)),
                                 "--retries", "1"))
    finally:
        for broker in brokers:
            await broker.transport.close()
    assert proc.exitCode == 1, proc.output
    assert b"Traceback" not in proc.output, proc.output
    lines = proc.output.decode().splitlines()
    for endpoint in endpoints[1:]:
        assert f"broker {endpoint}: does not describe its services" in lines, lines
    total = lines.index("the 1 of 3 brokers that answered")
    assert [line.split() for line in lines[total:] if line.startswith("echo")] == [
        ["echo", "1", "1", "0", "0"]], lines


@pytest_twisted.ensureDeferred
async def test_mdp_status_gives_curve_keys_to_its_zmq_brokers_only(tmp_path: Any) -> None:
    """CURVE keys with a zmq: and a tcp: broker: a client of each, keys for the zmq: one
    (a failover list took them so; one client each must not refuse the tcp: one)."""
    from mdp.transport.curve import keygen

    public, secret = keygen("node", str(tmp_path))
    options = cli.StatusOptions()
    options.parseOptions(["--broker", "zmq:tcp://127.0.0.1:5555", "--broker", "tcp:127.0.0.1:5556",
                          "--curve-server-public", public, "--curve-secret", secret])
    clients = cli._status_clients(reactor(), options)
    try:
        assert [client.endpoint for client in clients] == options["brokers"]
    finally:
        for client in clients:
            await client.close()
