"""What a user meets in the first hour with ``mdp`` and the ``twist`` plugins:
usage errors short and saying what is missing, endpoints given as bare
addresses or empty, a Titanic result that is pending or waited for, Freelance
servers that are all dead, ``mdp status`` against a passive Binary Star broker."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import task
from twisted.python import usage

from mdp import transport
from mdp.app import cli, tap
from mdp.errors import TransportError
from tests.procs import ENV, Process, Proxy, bounded, finished, reactor, script, wait_until

pytestmark = pytest.mark.timeout(60)

REQUEST_ID = "0b9a3c4e-5d6f-4a1b-8c2d-3e4f5a6b7c8d"


async def _free_port() -> int:
    """A port the OS just gave out and nobody listens on now."""
    from twisted.internet import protocol

    port = reactor().listenTCP(0, protocol.Factory(), interface="127.0.0.1")
    number = port.getHost().port
    await port.stopListening()
    return number


async def _run(*argv: str, timeout: float = 30) -> Process:
    """Run ``mdp ...`` or ``twist ...`` to its end."""
    return await finished([script(argv[0]), *argv[1:]], timeout=timeout)


def _mdp_usage_error(*argv: str) -> str:
    """The message of the usage error ``mdp ARGV`` makes (parsed here)."""
    with pytest.raises(usage.UsageError) as raised:
        cli.Options().parseOptions(list(argv))
    return str(raised.value)


# --- (b) twist: a usage error is one short line ----------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["mdp-worker"], "twist mdp-worker: --service is required (see twist mdp-worker --help)"),
    (["mdp-broker", "extra"], "twist mdp-broker: unexpected argument 'extra': twist mdp-broker "
                              "takes options only (see twist mdp-broker --help)"),
    (["mdp-broker", "--heartbeat", "nan"], "twist mdp-broker: --heartbeat must be a number of "
                                           "seconds of at least 0.01, got nan (see twist "
                                           "mdp-broker --help)"),
])
@pytest_twisted.ensureDeferred
async def test_a_twist_usage_error_is_one_line_not_the_help(argv: list[str], says: str) -> None:
    """Twist would print ``Error: ...`` above the plugin's whole help."""
    proc = await _run("twist", "--log-format", "text", *argv)
    assert proc.exitCode == 2, proc.output
    assert proc.output.decode().splitlines() == [says], proc.output


def test_plugin_options_parsed_alone_still_raise_usage_error() -> None:
    """Only under a program of Twisted's (twist, twistd) does the parser
    print and exit; parsed directly, it raises as usage.Options does."""
    with pytest.raises(usage.UsageError, match="--service is required"):
        tap.WorkerOptions().parseOptions([])


def _commands() -> list[list[str]]:
    commands = [[]]
    for name, _, parser, _ in cli.Options.subCommands:
        commands.append([name])
        for sub, _, _, _ in getattr(parser, "subCommands", []):
            commands.append([name, sub])
    return commands


@pytest.mark.parametrize("words", _commands(), ids=lambda words: " ".join(["mdp", *words]))
def test_dash_h_is_help_on_every_mdp_command(words: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.Options().parseOptions([*words, "-h"])
    assert exited.value.code == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(" ".join(["Usage: mdp", *words])), first


def test_dash_h_is_help_on_the_twist_plugins(capsys: Any) -> None:
    for options in (tap.BrokerOptions, tap.WorkerOptions, tap.TitanicOptions,
                    tap.FreelanceServerOptions, tap.SPRepOptions, tap.SPDeviceOptions):
        with pytest.raises(SystemExit) as exited:
            options().parseOptions(["-h"])
        assert exited.value.code == 0
        assert "-h, --help" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["call"], "give a SERVICE and at least one FRAME, e.g. 'mdp call echo hello'"),
    (["titanic", "submit"], "give a SERVICE and at least one FRAME, e.g. "
                            "'mdp titanic submit echo hello'"),
    (["titanic", "result"], "give the request ID that 'mdp titanic submit' printed"),
    (["titanic", "close"], "give the request ID that 'mdp titanic submit' printed"),
    (["titanic", "close", REQUEST_ID, "x"], "one request ID only; 'x' is one argument too many"),
    (["sp-request"], "give the PAYLOAD to send, e.g. 'mdp sp-request hello'"),
    (["sp-request", "a", "b"], "one PAYLOAD only; 'b' is one argument too many"),
    (["keygen"], "give a NAME for the key files, e.g. 'mdp keygen broker'"),
    (["keygen", "a", "b"], "one NAME only; 'b' is one argument too many"),
    (["freelance-call"], "give at least one request FRAME, e.g. 'mdp freelance-call hello'"),
    (["demo", "x"], "unexpected argument 'x': mdp demo takes options only"),
    (["chat", "--name", "me", "x"], "unexpected argument 'x': mdp chat takes options only"),
])
def test_the_wrong_number_of_arguments_says_what_is_missing(argv: list[str], says: str) -> None:
    """usage.Options says only "Wrong number of arguments"."""
    assert _mdp_usage_error(*argv).startswith(says)


@pytest_twisted.ensureDeferred
async def test_mdp_call_with_no_arguments_is_one_line_saying_what_to_give() -> None:
    proc = await _run("mdp", "call")
    assert proc.exitCode == 2, proc.output
    assert proc.output.decode().splitlines() == [
        "mdp call: give a SERVICE and at least one FRAME, e.g. 'mdp call echo hello' "
        "(see mdp call --help)"]


# --- (c) bare addresses ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint, role, meant", [
    ("localhost:5555", transport.CONNECT,
     "did you mean zmq:tcp://localhost:5555 (ZeroMQ) or tcp:host=localhost:port=5555"),
    ("127.0.0.1:5555", transport.CONNECT,
     "did you mean zmq:tcp://127.0.0.1:5555 (ZeroMQ) or tcp:host=127.0.0.1:port=5555"),
    ("127.0.0.1:5555", transport.LISTEN,
     "did you mean zmq:tcp://127.0.0.1:5555 (ZeroMQ) or tcp:5555:interface=127.0.0.1"),
    ("[::1]:5555", transport.CONNECT, "did you mean zmq:tcp://[::1]:5555 (ZeroMQ)"),
    ("*:5555", transport.LISTEN, "did you mean zmq:tcp://*:5555 (ZeroMQ) or tcp:5555 "),
])
def test_a_bare_address_gets_a_suggestion(endpoint: str, role: str, meant: str) -> None:
    with pytest.raises(TransportError) as raised:
        transport.check(endpoint, role)
    assert f"bad endpoint {endpoint!r}: an address with no scheme; {meant}" in str(raised.value)
    assert "unknown scheme" not in str(raised.value)


def test_an_unknown_scheme_still_lists_the_known_ones() -> None:
    with pytest.raises(TransportError, match=r"unknown scheme 'carrier-pigeon' \(known: "):
        transport.check("carrier-pigeon:coop")


def test_mdp_call_suggests_an_endpoint_for_a_bare_address() -> None:
    assert _mdp_usage_error("call", "--broker", "127.0.0.1:5555", "echo", "x") == (
        "--broker: bad endpoint '127.0.0.1:5555': an address with no scheme; did you mean "
        "zmq:tcp://127.0.0.1:5555 (ZeroMQ) or tcp:host=127.0.0.1:port=5555 (framed TCP)?")


@pytest.mark.parametrize("peer, says", [
    ("127.0.0.1:7002", "--peer: bad peer endpoint '127.0.0.1:7002': --peer takes a peer's ZRE "
                       "endpoint, tcp://HOST:PORT; did you mean tcp://127.0.0.1:7002?"),
    ("nowhere", "--peer: bad peer endpoint 'nowhere': --peer takes a peer's ZRE endpoint, "
                "tcp://HOST:PORT"),
    ("tcp://127.0.0.1:99999", "--peer: bad endpoint 'tcp://127.0.0.1:99999': port 99999 is "
                              "out of range"),
])
def test_mdp_chat_peer_says_what_it_takes(peer: str, says: str) -> None:
    """Not the MDP endpoint schemes: --peer takes what ZRE peers give."""
    message = _mdp_usage_error("chat", "--name", "me", "--peer", peer)
    assert message.startswith(says), message
    assert "known:" not in message and "zmq:tcp" not in message


# --- (e) empty endpoints ---------------------------------------------------------------


@pytest.mark.parametrize("argv, option", [
    (["call", "--broker", "", "echo", "x"], "broker"),
    (["call", "-b", " ", "echo", "x"], "broker"),
    (["status", "--broker", ""], "broker"),
    (["titanic", "result", "--broker", "", REQUEST_ID], "broker"),
    (["freelance-call", "--server", "", "x"], "server"),
    (["demo", "--endpoint", ""], "endpoint"),
    (["sp-request", "--endpoint", "", "x"], "endpoint"),
    (["chat", "--name", "me", "--endpoint", ""], "endpoint"),
    (["chat", "--name", "me", "--peer", ""], "peer"),
])
def test_mdp_refuses_an_empty_endpoint(argv: list[str], option: str) -> None:
    """``--broker ''`` was the default broker, silently."""
    assert _mdp_usage_error(*argv).startswith(f"--{option} is empty")


def test_an_empty_endpoint_in_a_list_is_refused() -> None:
    assert "an empty endpoint in 'zmq:tcp://127.0.0.1:5555,'" in _mdp_usage_error(
        "call", "--broker", "zmq:tcp://127.0.0.1:5555,", "echo", "x")


@pytest.mark.parametrize("options, argv, option", [
    (tap.WorkerOptions, ["--service", "echo", "--broker", ""], "broker"),
    (tap.TitanicOptions, ["--broker", ""], "broker"),
    (tap.BrokerOptions, ["--endpoint", ""], "endpoint"),
    (tap.BrokerOptions, ["--backend", ""], "backend"),
    (tap.BrokerOptions, ["--bstar", "primary", "--bstar-local", "", "--bstar-remote",
                         "zmq:tcp://127.0.0.1:5004"], "bstar-local"),
    (tap.BrokerOptions, ["--metrics", ""], "metrics"),
    (tap.FreelanceServerOptions, ["--endpoint", ""], "endpoint"),
    (tap.SPRepOptions, ["--endpoint", ""], "endpoint"),
    (tap.SPDeviceOptions, ["--front", "", "--back", "tcp://127.0.0.1:5999"], "front"),
    (tap.SPDeviceOptions, ["--back", ""], "back"),
])
def test_the_twist_plugins_refuse_an_empty_endpoint(options: type, argv: list[str],
                                                    option: str) -> None:
    with pytest.raises(usage.UsageError, match=f"^--{option} is empty"):
        options().parseOptions(argv)


def test_an_empty_bstar_role_is_not_a_broker_outside_a_pair() -> None:
    with pytest.raises(usage.UsageError, match="go together"):
        tap.BrokerOptions().parseOptions(["--bstar", ""])


@pytest.mark.parametrize("argv, says", [
    (["mdp", "call", "--broker", "", "echo", "x"],
     "mdp call: --broker is empty: give an endpoint, e.g. zmq:tcp://127.0.0.1:5555 "
     "(see mdp call --help)"),
    (["twist", "mdp-worker", "--service", "echo", "--broker", ""],
     "twist mdp-worker: --broker is empty: give an endpoint, e.g. zmq:tcp://127.0.0.1:5555 "
     "(see twist mdp-worker --help)"),
])
@pytest_twisted.ensureDeferred
async def test_an_empty_endpoint_is_a_usage_error_exit_2(argv: list[str], says: str) -> None:
    proc = await _run(*argv)
    assert proc.exitCode == 2, proc.output
    assert proc.output.decode().splitlines() == [says]


# --- (d) Freelance servers all dead --------------------------------------------------------


@pytest.mark.parametrize("model, how", [
    ("1", "(each tried in turn)"),
    ("2", "(all asked at once)"),
    ("3", ": none answered a PING"),
])
@pytest_twisted.ensureDeferred
async def test_freelance_call_to_dead_servers_says_which_and_for_how_long(model: str,
                                                                         how: str) -> None:
    """It said "no reply after 0 attempts ... for service 'freelance'"."""
    servers = [f"zmq:tcp://127.0.0.1:{await _free_port()}" for _ in range(2)]
    proc = await _run("mdp", "freelance-call", "--model", model, "--server", servers[0],
                      "--server", servers[1], "--timeout", "0.3", "--deadline", "1", "hello")
    assert proc.exitCode == 1, proc.output
    [line] = proc.output.decode().splitlines()
    assert line.startswith(f"mdp freelance-call: no reply from any of the 2 Freelance servers "
                           f"({servers[0]}, {servers[1]}) within "), line
    assert how in line and line.endswith("is twist mdp-freelance-server running there?"), line
    assert "'freelance'" not in line and "0 attempts" not in line


@pytest_twisted.ensureDeferred
async def test_freelance_call_to_one_dead_server_names_it() -> None:
    server = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    proc = await _run("mdp", "freelance-call", "--server", server, "--deadline", "0.5", "hello")
    assert proc.exitCode == 1, proc.output
    assert re.fullmatch(
        rf"mdp freelance-call: no reply from the Freelance server at {re.escape(server)} within "
        r"0\.\d s: it did not answer a PING; is twist mdp-freelance-server running there\?\n",
        proc.output.decode()), proc.output


# --- (a) mdp titanic result ------------------------------------------------------------------


class _Titanic:
    """A broker and a Titanic in this process, with a request stored for a
    service no worker offers: it stays pending."""

    async def start(self, titanic: bool = True) -> None:
        from mdp import Broker
        from mdp.titanic import MemoryStore, Titanic, TitanicClient

        class Store(MemoryStore):
            """Counts the polls (titanic.reply) it answers."""

            polls = 0

            def reply(self, requestId: str) -> Any:
                Store.polls += 1
                return super().reply(requestId)

        self.store = Store()
        self.broker = Broker(reactor(), unknownServiceExpiry=0.2)
        self.endpoint = (await self.broker.listen("zmq:tcp://127.0.0.1:*")).endpoint
        self.titanic = Titanic(self.endpoint, self.store, reactor()) if titanic else None
        self.client = TitanicClient(self.endpoint, reactor())
        self.procs: list[Process] = []
        if self.titanic is not None:
            await self.titanic.start()
            self.requestId = await bounded(self.client.submit("nobody", b"x"), 30)

    def mdp(self, *argv: str) -> Process:
        proc = Process(reactor(), [script("mdp"), "titanic", *argv], env=ENV)
        self.procs.append(proc)
        return proc

    async def stop(self) -> None:
        for proc in self.procs:
            await proc.stop()
        await self.client.disconnect()
        if self.titanic is not None:
            await self.titanic.stop()
        await self.broker.close()


@pytest_twisted.ensureDeferred
async def test_a_pending_result_says_so_and_exits_3() -> None:
    """It printed nothing at all."""
    titanic = _Titanic()
    await titanic.start()
    try:
        proc = titanic.mdp("result", "--broker", titanic.endpoint, titanic.requestId)
        await proc.ended(30)
        assert proc.exitCode == cli.EXIT_PENDING, proc.output
        assert proc.output.decode().splitlines() == [
            f"mdp titanic result: request {titanic.requestId} is pending (no reply yet); "
            "ask again later, or wait for it with --wait"]
    finally:
        await titanic.stop()


def test_titanic_result_help_gives_the_exit_statuses(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        cli.Options().parseOptions(["titanic", "result", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 with the reply; 3 while the request is pending" in text
    assert "2 for a usage mistake" in text


@pytest_twisted.ensureDeferred
async def test_waiting_for_a_pending_result_says_what_it_waits_for() -> None:
    titanic = _Titanic()
    await titanic.start()
    try:
        proc = titanic.mdp("result", "--broker", titanic.endpoint, "--wait", "--poll", "0.05",
                           titanic.requestId)
        await proc.waitFor(f"mdp titanic result: waiting for request {titanic.requestId}: "
                           r"it is pending \(no reply yet\); asking every 0.05 s\n", 30)
        # said once, not at every poll
        await wait_until(lambda: titanic.store.polls >= 5, 30)
        assert proc.running and proc.output.count(b"waiting for request") == 1, proc.output
    finally:
        await titanic.stop()


@pytest_twisted.ensureDeferred
async def test_waiting_without_titanic_says_titanic_is_not_answering() -> None:
    """A broker that answers 503 for titanic.reply: it polled on silently."""
    titanic = _Titanic()
    await titanic.start(titanic=False)
    try:
        proc = titanic.mdp("result", "--broker", titanic.endpoint, "--wait", "--poll", "0.05",
                           "--timeout", "5", REQUEST_ID)
        line = await proc.waitFor(r"waiting for request \S+: (.*)\n", 30)
        assert line.group(1).decode().startswith(
            "Titanic is not answering (service 'titanic.reply' answered 503: "), proc.output
        assert b"is twist mdp-titanic running? Still trying, every 0.05 s" in line.group(1)
        assert proc.running
    finally:
        await titanic.stop()


@pytest_twisted.ensureDeferred
async def test_waiting_without_a_broker_says_the_broker_does_not_reply() -> None:
    endpoint = f"zmq:tcp://127.0.0.1:{await _free_port()}"
    proc = Process(reactor(), [script("mdp"), "titanic", "result", "--broker", endpoint,
                               "--wait", "--timeout", "0.2", "--retries", "1", REQUEST_ID],
                   env=ENV)
    try:
        await proc.waitFor(f"waiting for request {REQUEST_ID}: no answer yet from Titanic "
                           f"through the broker at {re.escape(endpoint)}, still trying\n", 30)
        await proc.waitFor(f"waiting for request {REQUEST_ID}: no reply from the broker at "
                           f"{re.escape(endpoint)} yet, still trying\n", 30)
        assert proc.running
    finally:
        await proc.stop()


# --- (f) mdp status against a passive Binary Star broker ----------------------------------


class _Pair:
    """Two ``twist mdp-broker --bstar`` processes; their state channels run
    through proxies, so that each can be given its peer's before that one
    has bound (both bind ports the OS picks)."""

    def __init__(self) -> None:
        self.proxies = {"primary": Proxy(), "backup": Proxy()}
        self.brokers: dict[str, Process] = {}
        self.endpoints: dict[str, str] = {}

    async def start(self, role: str) -> None:
        other = "backup" if role == "primary" else "primary"
        broker = Process(reactor(), [
            script("twist"), "--log-format", "text", "mdp-broker",
            "--endpoint", "zmq:tcp://127.0.0.1:*", "--bstar", role,
            "--bstar-local", "zmq:tcp://127.0.0.1:*", "--bstar-heartbeat", "0.25",
            "--bstar-remote", f"zmq:tcp://127.0.0.1:{self.proxies[other].address}"], ENV)
        self.brokers[role] = broker
        state = await broker.waitFor(r"state published on zmq:tcp://127.0.0.1:(\d+),", 30)
        self.proxies[role].port = int(state.group(1))
        bound = await broker.waitFor(r"MDP broker listening on (\S+)", 30)
        self.endpoints[role] = bound.group(1).decode()

    async def state(self, role: str) -> dict[str, Any]:
        from mdp import Client

        client = Client(self.endpoints[role], reactor(), timeout=2, retries=3)
        try:
            return dict(json.loads((await bounded(client.request("mmi.binarystar"), 10))[0]))
        finally:
            await client.close()

    async def stop(self) -> None:
        for broker in self.brokers.values():
            await broker.stop()
        for proxy in self.proxies.values():
            await proxy.close()


@pytest_twisted.ensureDeferred
async def test_mdp_status_of_a_passive_binary_star_broker_says_to_ask_the_other() -> None:
    """A passive broker answers mmi.binarystar only: mdp status said "no
    reply" after all its attempts."""
    pair = _Pair()
    try:
        await pair.start("primary")
        await pair.start("backup")
        deadline = reactor().seconds() + 30
        # until a state of the active primary has reached the backup
        while (state := await pair.state("backup"))["state"] != "passive":
            assert reactor().seconds() < deadline, state
            await task.deferLater(reactor(), 0.05)
        assert state["peer"] == "active"
        backup = pair.endpoints["backup"]
        proc = Process(reactor(), [script("mdp"), "status", "--broker", backup,
                                   "--timeout", "10", "--retries", "3"], env=ENV)
        try:
            await proc.ended(20)  # well within the 30 s its attempts would take
        finally:
            await proc.stop()
        assert proc.exitCode == 1, proc.output
        assert proc.output.decode().splitlines() == [
            f"mdp status: broker {backup} is the passive broker of a Binary Star pair: it "
            "answers no requests while its peer (active) serves them; ask the other broker "
            "of the pair"]
        assert (await pair.state("backup"))["state"] == "passive"  # asking was no vote
        primary = Process(reactor(), [script("mdp"), "status", "--broker",
                                      pair.endpoints["primary"]], env=ENV)
        try:
            await primary.ended(30)
        finally:
            await primary.stop()
        assert primary.exitCode == 0, primary.output
        assert primary.output.startswith(f"broker {pair.endpoints['primary']}\n".encode())
        # both: the active broker's tables, the passive one's state, and the sum
        both = Process(reactor(), [script("mdp"), "status", "--broker", pair.endpoints["primary"],
                                   "--broker", backup], env=ENV)
        try:
            await both.ended(30)
        finally:
            await both.stop()
        assert both.exitCode == 0, both.output
        lines = both.output.decode().splitlines()
        assert lines[0] == f"broker {pair.endpoints['primary']}", lines
        assert lines[lines.index("all 2 brokers") - 2] == (
            f"broker {backup} is the passive broker of a Binary Star pair: it answers no "
            "requests while its peer (active) serves them; ask the other broker of the pair"), lines
    finally:
        await pair.stop()


def test_waiting_for_a_slow_titanic_says_each_reason_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every poll slower than --timeout, then pending, four times over, then
    the reply: 'pending' and 'no answer yet' each said once, not in turn at
    every poll."""
    from twisted.internet import defer

    clock = task.Clock()
    said: list[str] = []
    monkeypatch.setattr(cli, "error", said.append)

    class SlowTitanic:
        polls = 0

        def poll(self, requestId: str) -> defer.Deferred:
            self.polls += 1
            answer = None if self.polls < 5 else [b"done"]
            return task.deferLater(clock, 3.0, lambda: answer)

    options = cli.TitanicResultOptions()
    options.parseOptions(["--wait", "--timeout", "2", "--poll", "1", "0" * 32])
    waiting = defer.ensureDeferred(cli._wait_for_reply(clock, SlowTitanic(), options))
    clock.pump([0.5] * 40)
    assert waiting.result == [b"done"]
    assert len(said) == 2, said
    assert "no answer yet from Titanic" in said[0] and "it is pending" in said[1]


def test_titanic_on_postgresql_without_psycopg_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Was a traceback from inside the service, after the options were taken."""
    import sys

    monkeypatch.setitem(sys.modules, "mdp.titanic.pgstore", None)  # (importing it fails)
    options = tap.TitanicOptions()
    with pytest.raises(usage.UsageError) as raised:
        options.parseOptions(["--db", "postgresql://titanic@db-host/titanic"])
    assert str(raised.value).startswith("--db: a PostgreSQL store needs psycopg 3, the postgres "
                                        "extra: pip install 'txmajordomo[postgres]'"), raised.value
