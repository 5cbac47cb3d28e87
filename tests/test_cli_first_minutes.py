"""The command line as a newcomer meets it: versions, Ctrl-C, status, Freelance calls,
handlers, errors and logs."""

from __future__ import annotations

import signal
from typing import Optional

import pytest
import pytest_twisted

import mdp
from tests.procs import ENV, Process, bound_endpoint, reactor, script, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv", [
    ["mdp", "--version"], ["mdp", "call", "--version"],
    ["twist", "mdp-broker", "--version"], ["twist", "mdp-worker", "--version"],
    ["twist", "mdp-titanic", "--version"], ["twist", "sp-rep", "--version"],
])
@pytest_twisted.ensureDeferred
async def test_version_is_txmajordomos(argv: list[str]) -> None:
    proc = Process(reactor(), [script(argv[0]), *argv[1:]], env=ENV)
    await proc.ended(60)
    assert proc.exitCode == 0, proc.output
    assert f"txmajordomo {mdp.__version__}".encode() in proc.output


@pytest_twisted.ensureDeferred
async def test_ctrl_c_on_mdp_call_exits_130_without_a_traceback() -> None:
    """The request reaches a broker that never answers; Ctrl-C then."""
    from mdp import transport
    from tests.conftest import RawRouter

    silent = RawRouter()
    silent.clock = reactor()
    silent.transport = await transport.listen("zmq:tcp://127.0.0.1:*", silent, reactor())
    proc = Process(reactor(), [script("mdp"), "call", "--broker", silent.transport.endpoint,
                               "--timeout", "30", "echo", "hi"], env=ENV)
    try:
        await wait_until(lambda: silent.received, 30)  # the client is up and waiting
        proc.signalProcess(signal.SIGINT)
        await proc.ended(30)
        assert proc.exitCode == 130, proc.output
        assert b"Traceback" not in proc.output and b"timed out" not in proc.output
    finally:
        await proc.stop()
        await silent.transport.close()


@pytest_twisted.ensureDeferred
async def test_mmi_queries_need_no_body_from_the_api_and_the_shell() -> None:
    """``mmi.services`` and ``mmi.workers`` with an empty body, as docs/mdp.md
    shows them; other services still need a frame."""
    import json

    from mdp import Broker, Client, Worker
    from mdp.handlers import echo

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", echo, reactor())
    worker.start()
    client = Client(bound.endpoint, reactor())
    try:
        assert await client.request("mmi.service", b"echo") in ([b"200"], [b"404"])
        services = json.loads((await client.request("mmi.services"))[0])
        while not services.get("echo", {}).get("workers"):  # the worker's READY is on its way
            services = json.loads((await client.request("mmi.services"))[0])
        assert services["echo"]["workers"] == 1
        workers = json.loads((await client.request("mmi.workers"))[0])
        assert [w["service"] for w in workers] == ["echo"]
        with pytest.raises(ValueError, match="at least one body frame"):
            client.request("echo")
        proc = Process(reactor(), [script("mdp"), "call", "--broker", bound.endpoint,
                                   "mmi.services"], env=ENV)
        await proc.ended(30)
        assert proc.exitCode == 0, proc.output
        assert json.loads(proc.output.strip().splitlines()[-1])["echo"]["workers"] == 1
        refused = Process(reactor(), [script("mdp"), "call", "--broker", bound.endpoint,
                                      "echo"], env=ENV)
        await refused.ended(30)
        assert refused.exitCode == 2 and b"at least one request frame" in refused.output
    finally:
        await client.close()
        await worker.stop()
        await broker.close()


# --- every command's --help ---------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["mdp"], ["call|status|freelance-call|titanic|sp-request|chat|demo"]),
    (["mdp", "call"], ["--broker ENDPOINT", "--dialect rfc|majortomo", "SERVICE [FRAME...]"]),
    (["mdp", "status"], ["--broker ENDPOINT", "--timeout S", "--watch [SECONDS]"]),
    (["mdp", "freelance-call"], ["--server ENDPOINT", "--model 1|2|3", "--deadline S",
                                 "FRAME [FRAME...]"]),
    (["mdp", "titanic"], ["submit|result|close"]),
    (["mdp", "titanic", "submit"], ["--broker ENDPOINT", "SERVICE FRAME [FRAME...]"]),
    (["mdp", "titanic", "result"], ["--broker ENDPOINT", "--wait", "ID"]),
    (["mdp", "titanic", "close"], ["--broker ENDPOINT", "ID"]),
    (["mdp", "sp-request"], ["--endpoint URL", "PAYLOAD"]),
    (["mdp", "chat"], ["--name NAME", "--group GROUP", "--peer ENDPOINT"]),
    (["mdp", "demo"], ["--endpoint ENDPOINT", "--requests N"]),
    (["twist", "mdp-broker"], ["--endpoint ENDPOINT", "--backend ENDPOINT", "--bstar primary|backup",
                               "[options]"]),
    (["twist", "mdp-worker"], ["--service NAME", "--broker ENDPOINT",
                               "--handler echo|module:callable", "[options]"]),
    (["twist", "mdp-freelance-server"], ["--endpoint ENDPOINT", "--handler echo|module:callable"]),
    (["twist", "mdp-titanic"], ["--broker ENDPOINT", "--db PATH|:memory:", "[options]"]),
    (["twist", "sp-rep"], ["--endpoint URL", "--handler echo|module:callable"]),
    (["twist", "sp-device"], ["--front URL", "--back URL"]),
])
@pytest_twisted.ensureDeferred
async def test_help_starts_with_a_complete_usage_line(argv: list[str], says: list[str]) -> None:
    """``--help`` exits 0; its first line is ``Usage:``, the command, then its
    arguments and main options."""
    proc = Process(reactor(), [script(argv[0]), *argv[1:], "--help"], env=ENV)
    await proc.ended(60)
    assert proc.exitCode == 0, proc.output
    first = proc.output.decode().splitlines()[0]
    program = "twist [options]" if argv[0] == "twist" else "mdp"
    assert first.startswith(" ".join(["Usage:", program, *argv[1:]])), first
    for words in says:
        assert words in first, (words, first)


# --- mdp status -----------------------------------------------------------------------

async def _free_port() -> int:
    """A port the OS just gave out and nobody listens on now."""
    from twisted.internet import protocol

    port = reactor().listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    number = port.getHost().port
    await port.stopListening()
    return number


@pytest_twisted.ensureDeferred
async def test_mdp_status_shows_services_and_workers() -> None:
    """An idle worker (echo), a busy one (slow), a request queued for a
    service nobody offers: the two tables say so, row by row."""
    import re

    from twisted.internet import defer

    from mdp import Broker, Client, Worker
    from mdp.handlers import echo

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    held: defer.Deferred[list[bytes]] = defer.Deferred()
    idle = Worker(bound.endpoint, "echo", echo, reactor())
    busy = Worker(bound.endpoint, "slow", lambda frames: held, reactor())
    idle.start()
    busy.start()
    client = Client(bound.endpoint, reactor())
    pending = []
    try:
        def services() -> dict[bytes, tuple[int, int, int]]:
            return {s.name: (s.idle, s.busy, s.queued) for s in broker.snapshot().services}

        await wait_until(lambda: {b"echo", b"slow"} <= set(services()), 30)
        pending = [client.request("slow", b"x"), client.request("nobody", b"y")]
        await wait_until(lambda: services().get(b"slow") == (0, 1, 0)
                         and services().get(b"nobody") == (0, 0, 1), 30)
        proc = Process(reactor(), [script("mdp"), "status", "--broker", bound.endpoint], env=ENV)
        await proc.ended(30)
        assert proc.exitCode == 0, proc.output
        lines = proc.output.decode().splitlines()
        assert lines[0] == f"broker {bound.endpoint}"
        rows = [line.split() for line in lines]
        assert ["SERVICE", "WORKERS", "IDLE", "BUSY", "QUEUED"] in rows
        assert ["echo", "1", "1", "0", "0"] in rows
        assert ["slow", "1", "0", "1", "0"] in rows
        assert ["nobody", "0", "0", "0", "1"] in rows
        assert ["WORKER", "SERVICE", "STATE", "DIALECT", "SILENCE", "(s)"] in rows
        workers = {row[1]: row for row in rows if len(row) == 5 and row[3] == "rfc"}
        assert set(workers) == {"echo", "slow"}
        assert workers["echo"][2] == "idle" and workers["slow"][2] == "busy"
        for row in workers.values():
            assert re.fullmatch(r"[0-9a-f]+", row[0]) and re.fullmatch(r"\d+\.\d", row[4]), row
    finally:
        held.callback([b"done"])
        await client.close()
        for d in pending:
            d.addErrback(lambda failure: None)
        await idle.stop()
        await busy.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
async def test_mdp_status_of_several_brokers_shows_each_and_sums_them() -> None:
    """Side by side: one echo worker at A, two at B, a third broker down: each
    broker's tables, "no answer" for the third, the services summed over the two
    that answered, and exit status 1."""
    from mdp import Broker, Worker
    from mdp.handlers import echo

    brokers = [Broker(reactor()), Broker(reactor())]
    bound = [await broker.listen("zmq:tcp://127.0.0.1:*") for broker in brokers]
    down = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    workers = [Worker(bound[n].endpoint, "echo", echo, reactor()) for n in (0, 1, 1)]
    for worker in workers:
        worker.start()
    try:
        await wait_until(lambda: [len(b.snapshot().services) and b.snapshot().services[0].idle
                                  for b in brokers] == [1, 2], 30)
        proc = Process(reactor(), [script("mdp"), "status", "--broker", bound[0].endpoint,
                                   "--broker", bound[1].endpoint, "--broker", down,
                                   "--timeout", "0.5", "--retries", "1"], env=ENV)
        await proc.ended(30)
        assert proc.exitCode == 1, proc.output
        lines = proc.output.decode().splitlines()
        assert f"broker {bound[0].endpoint}" in lines and f"broker {bound[1].endpoint}" in lines
        assert f"broker {down}: no answer" in lines
        total = lines.index("the 2 of 3 brokers that answered")
        rows = [line.split() for line in lines]
        assert rows[:total].count(["echo", "1", "1", "0", "0"]) == 1
        assert rows[:total].count(["echo", "2", "2", "0", "0"]) == 1
        assert ["echo", "3", "3", "0", "0"] in rows[total:]
    finally:
        for worker in workers:
            await worker.stop()
        for broker in brokers:
            await broker.close()


@pytest_twisted.ensureDeferred
async def test_mdp_status_watch_refreshes_until_ctrl_c() -> None:
    from mdp import Broker

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    proc = Process(reactor(), [script("mdp"), "status", "--broker", bound.endpoint,
                               "--watch", "0.2"], env=ENV)
    try:
        await proc.waitFor(r"(?s)no workers.*no workers", timeout=30)  # printed twice
        proc.signalProcess(signal.SIGINT)
        await proc.ended(30)
        assert proc.exitCode == 130, proc.output
        assert b"Traceback" not in proc.output
        assert proc.output.count(f"broker {bound.endpoint}".encode()) >= 2
    finally:
        await proc.stop()
        await broker.close()


async def _failure_line(*argv: str) -> str:
    """Run ``mdp ARGV...``; it must exit 1 with exactly one line of output."""
    proc = Process(reactor(), [script("mdp"), *argv], env=ENV)
    try:
        await proc.ended(30)
    finally:
        await proc.stop()
    assert proc.exitCode == 1, proc.output
    lines = proc.output.decode().strip().splitlines()
    assert len(lines) == 1, proc.output
    return lines[0]


@pytest_twisted.ensureDeferred
async def test_mdp_status_of_an_unreachable_broker_is_one_line_and_exit_1() -> None:
    endpoint = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    line = await _failure_line("status", "--broker", endpoint, "--timeout", "0.5", "--retries", "1")
    assert line.startswith(f"mdp status: no reply from broker at {endpoint} after 1 attempt")


@pytest.mark.parametrize("command", [["call", "echo", "hi"], ["status"]])
@pytest_twisted.ensureDeferred
async def test_a_refused_tcp_connection_is_reported_at_once(command: list[str]) -> None:
    """Nobody listens: with attempts of 60 s, only a failure seen at once
    ends the command within the test's bound."""
    endpoint = f"tcp:host=127.0.0.1:port={await _free_port()}"
    line = await _failure_line(command[0], "--broker", endpoint, "--timeout", "60", *command[1:])
    assert line == f"mdp {command[0]}: cannot reach broker at {endpoint}: connection refused"


# --- mdp freelance-call ------------------------------------------------------------------

async def _freelance_server(handler: str) -> tuple[Process, str]:
    server = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-freelance-server",
                                 "--endpoint", "zmq:tcp://127.0.0.1:*", "--handler", handler],
                     env=ENV)
    return server, await bound_endpoint(server, "Freelance server")


@pytest_twisted.ensureDeferred
async def test_mdp_freelance_call_asks_a_twist_freelance_server() -> None:
    server, endpoint = await _freelance_server("tests.handlers_for_tests:upper")
    try:
        call = Process(reactor(), [script("mdp"), "freelance-call", "--server", endpoint,
                                   "hello", "world"], env=ENV)
        await call.ended(30)
        assert call.exitCode == 0, call.output
        assert call.output.decode().splitlines() == ["HELLO", "WORLD"]
    finally:
        await server.stop()


@pytest.mark.parametrize("model", ["1", "3"])
@pytest_twisted.ensureDeferred
async def test_mdp_freelance_call_gets_past_a_dead_server(model: str) -> None:
    """The first server listed is dead: the request is answered by the
    second; with only the dead one, exit status 1 and one line."""
    server, endpoint = await _freelance_server("tests.handlers_for_tests:upper")
    # (after the server's bind: the OS may otherwise give the server this very port)
    dead = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    try:
        call = Process(reactor(), [script("mdp"), "freelance-call", "--model", model,
                                   "--server", dead, "--server", endpoint, "--timeout", "0.5",
                                   "still", "there"], env=ENV)
        await call.ended(30)
        assert call.exitCode == 0, call.output
        assert call.output.decode().splitlines() == ["STILL", "THERE"]
        alone = Process(reactor(), [script("mdp"), "freelance-call", "--model", model,
                                    "--server", dead, "--timeout", "0.5", "--deadline", "1",
                                    "anyone?"], env=ENV)
        await alone.ended(30)
        assert alone.exitCode == 1, alone.output
        lines = alone.output.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mdp freelance-call: "), alone.output
        assert dead in lines[0]
    finally:
        await server.stop()


# --- --handler module:callable from the current directory --------------------------

def _in_directory(directory: str, *argv: str) -> list[str]:
    """*argv* run in *directory* (tests.procs.Process takes no working directory)."""
    return ["/bin/sh", "-c", 'cd "$0" && exec "$@"', directory, *argv]


@pytest_twisted.ensureDeferred
async def test_worker_handler_module_is_found_in_the_current_directory(tmp_path) -> None:
    from mdp import Broker, Client

    (tmp_path / "mymod.py").write_text(
        "def shout(frames):\n    return [frame.upper() + b'!' for frame in frames]\n")
    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Process(reactor(), _in_directory(
        str(tmp_path), script("twist"), "--log-format", "text", "mdp-worker", "--broker",
        bound.endpoint, "--service", "shout", "--handler", "mymod:shout"), env=ENV)
    client = Client(bound.endpoint, reactor())
    try:
        await worker.waitFor("sent READY", timeout=60)
        assert await client.request("shout", b"hi").addTimeout(30, reactor()) == [b"HI!"]
    finally:
        await client.close()
        await worker.stop()
        await broker.close()


@pytest.mark.parametrize("plugin, handler, says", [
    ("mdp-worker", "nosuchmodule:handle", "No module named 'nosuchmodule'"),
    ("mdp-worker", "mymod:missing", "has no attribute 'missing'"),
    ("mdp-freelance-server", "mymod:NOT_CALLABLE", "is not callable"),
    ("sp-rep", "broken:handle", "RuntimeError: broken on import"),
])
@pytest_twisted.ensureDeferred
async def test_a_handler_that_cannot_be_loaded_is_one_line_and_exit_2(
        tmp_path, plugin: str, handler: str, says: str) -> None:
    (tmp_path / "mymod.py").write_text("NOT_CALLABLE = 42\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on import')\n")
    options = ["--service", "x"] if plugin == "mdp-worker" else []
    proc = Process(reactor(), _in_directory(
        str(tmp_path), script("twist"), "--log-format", "text", plugin, *options,
        "--handler", handler), env=ENV)
    try:
        await proc.ended(60)
    finally:
        await proc.stop()
    assert proc.exitCode == 2, proc.output
    lines = proc.output.decode().splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.output
    assert lines[0].startswith(f"twist {plugin}: --handler") and says in lines[0], lines[0]
    assert b"Traceback" not in proc.output


# --- logs --------------------------------------------------------------------------------

@pytest_twisted.ensureDeferred
async def test_logs_name_services_and_endpoints_as_text() -> None:
    """At debug level the broker logs one line per request; service names
    are text; a worker waiting for a broker names the endpoint it retries,
    not ``<...Endpoint object at 0x...>``."""
    import re

    from mdp import Client

    port = await _free_port()
    endpoint = f"tcp:host=127.0.0.1:port={port}"
    worker = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-worker",
                                 "--broker", endpoint, "--service", "echo"], env=ENV)
    broker: Optional[Process] = None
    client: Optional[Client] = None
    try:
        await worker.waitFor(f"Scheduling retry 1 to connect {endpoint} in", timeout=60)
        broker = Process(reactor(), [script("twist"), "--log-format", "text", "--log-level", "debug",
                                     "mdp-broker", "--endpoint", f"tcp:{port}:interface=127.0.0.1"],
                         env=ENV)
        await broker.waitFor("ready for echo", timeout=60)
        client = Client(endpoint, reactor())
        assert await client.request("echo", b"hi") == [b"hi"]
        line = await broker.waitFor(r"echo: request from client \w+ served by worker \w+ in "
                                    r"[0-9.]+s after [0-9.]+s queued", timeout=30)
        assert line is not None
        await worker.waitFor("sent READY", timeout=30)
        output = worker.output + broker.output
        assert b"object at 0x" not in output and b"b'echo'" not in output
        assert re.search(rb"worker for echo sent READY to " + endpoint.encode(), worker.output)
    finally:
        if client is not None:
            await client.close()
        await worker.stop()
        if broker is not None:
            await broker.stop()


@pytest_twisted.ensureDeferred
async def test_a_broker_that_cannot_bind_says_so_once_and_exits_1() -> None:
    from twisted.internet import protocol

    taken = reactor().listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    try:
        proc = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-broker",
                                   "--endpoint", f"tcp:{taken.getHost().port}:interface=127.0.0.1"],
                       env=ENV)
        await proc.ended(60)
    finally:
        await taken.stopListening()
    assert proc.exitCode == 1, proc.output
    assert proc.output.count(b"MDP broker cannot listen") == 1, proc.output
    assert b"Address already in use" in proc.output


@pytest_twisted.ensureDeferred
async def test_mdp_call_fails_over_along_repeated_broker_options() -> None:
    """The first --broker refuses connections: the call goes on to the
    second at once and is answered there."""
    from mdp import Broker, Worker
    from mdp.handlers import echo

    broker = Broker(reactor())
    bound = await broker.listen("zmq:tcp://127.0.0.1:*")
    worker = Worker(bound.endpoint, "echo", echo, reactor())
    worker.start()
    dead = f"tcp:host=127.0.0.1:port={await _free_port()}"
    try:
        proc = Process(reactor(), [script("mdp"), "call", "--broker", dead, "--broker", bound.endpoint,
                                   "--timeout", "60", "echo", "hi"], env=ENV)
        await proc.ended(30)
        assert proc.exitCode == 0, proc.output
        assert proc.output.decode().split() == ["hi"]
    finally:
        await worker.stop()
        await broker.close()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("args, says", [
    (["mdp-freelance-server", "--endpoint", "tcp:{port}:interface=127.0.0.1"],
     b"Freelance server cannot listen"),
    (["sp-rep", "--endpoint", "tcp://127.0.0.1:{port}"], b"SP REP server cannot listen"),
    (["sp-device", "--front", "tcp://127.0.0.1:{port}", "--back", "tcp://127.0.0.1:1"],
     b"SP device cannot listen"),
])
async def test_other_servers_that_cannot_bind_exit_1_with_the_reason(args: list[str],
                                                                     says: bytes) -> None:
    """Not a process that runs on serving nothing: the reason, once, and exit 1."""
    from twisted.internet import protocol

    taken = reactor().listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    port = taken.getHost().port
    try:
        proc = Process(reactor(), [script("twist"), "--log-format", "text",
                                   *[a.format(port=port) for a in args]], env=ENV)
        await proc.ended(60)
    finally:
        await taken.stopListening()
    assert proc.exitCode == 1, proc.output
    assert proc.output.count(says) == 1, proc.output
    assert b"Address already in use" in proc.output
    assert b"Unhandled error" not in proc.output
