"""The numbers ``twist`` plugins take are checked while the options are read:
nan, inf, negative, zero, too small and too large values are usage errors
naming the option (one line, ``twist PLUGIN: ...``, and exit status 2), never a
traceback from makeService nor a node that starts and misbehaves."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import pytest
import pytest_twisted
from twisted.python import usage

from mdp.app import tap
from mdp.app.tap import (
    BrokerOptions,
    FreelanceServerOptions,
    SPDeviceOptions,
    SPRepOptions,
    TitanicOptions,
    WorkerOptions,
)
from mdp.policy import HeartbeatPolicy, Limits
from tests.procs import ENV, Process, reactor, script

pytestmark = pytest.mark.timeout(60)

#: what each parser needs besides the option under test
REQUIRED: dict[type, list[str]] = {
    BrokerOptions: [],
    WorkerOptions: ["--service", "echo"],
    TitanicOptions: ["--db", ":memory:"],
    FreelanceServerOptions: [],
    SPRepOptions: [],
    SPDeviceOptions: ["--back", "tcp://127.0.0.1:5999"],
}
ALL = list(REQUIRED)
HEARTBEATS = [BrokerOptions, WorkerOptions, TitanicOptions]
PEERS = [BrokerOptions, FreelanceServerOptions]
PENDING = [FreelanceServerOptions, SPRepOptions]


def parse(options: type, *argv: str) -> Any:
    parsed = options()
    parsed.parseOptions([*REQUIRED[options], *argv])
    return parsed


def cases(classes: list[type], option: str, values: list[str]) -> list[Any]:
    return [pytest.param(cls, option, value, id=f"{cls.__name__}-{option}-{value}")
            for cls in classes for value in values]


NOT_SECONDS = ["nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "x"]
#: heartbeat-like intervals: also too short to be anything but a busy loop
NOT_INTERVALS = NOT_SECONDS + ["1e-6", "0.009"]
NOT_COUNTS = ["-1", "0", "nan", "1.5", "x"]
NOT_SIZES = ["-1", "0", "nan", "1.5MiB", "63", "99999999999999999999GiB", "1TB"]

BAD = (
    cases([BrokerOptions], "request-expiry", NOT_SECONDS)
    + cases([BrokerOptions], "unknown-service-expiry", NOT_SECONDS)
    + cases([BrokerOptions], "service-linger", NOT_SECONDS)
    + cases(PEERS, "handshake-timeout", NOT_SECONDS + ["0.0001"])
    + cases(PEERS, "record-timeout", NOT_SECONDS + ["0.0001"])
    + cases([TitanicOptions], "timeout", NOT_SECONDS)
    + cases([TitanicOptions], "keep", NOT_SECONDS)
    + cases(HEARTBEATS, "heartbeat", NOT_INTERVALS)
    + cases([BrokerOptions], "bstar-heartbeat", NOT_INTERVALS)
    + cases([WorkerOptions, TitanicOptions], "backoff-max", NOT_INTERVALS)
    + cases(HEARTBEATS, "liveness", NOT_COUNTS)
    + cases([BrokerOptions], "max-queue", NOT_COUNTS)
    + cases([BrokerOptions], "max-service-queue", NOT_COUNTS)
    + cases([BrokerOptions], "max-workers", NOT_COUNTS)
    + cases([BrokerOptions], "max-service-workers", NOT_COUNTS)
    + cases([BrokerOptions], "max-deliveries", NOT_COUNTS)
    + cases(PEERS, "max-connections", NOT_COUNTS)
    + cases(PENDING, "max-pending", NOT_COUNTS)
    + cases([TitanicOptions], "concurrency", NOT_COUNTS)
    + cases([TitanicOptions], "service-workers", NOT_COUNTS)
    + cases([WorkerOptions], "reply-store", ["-1", "nan", "x"])
    + cases([WorkerOptions], "concurrency", NOT_COUNTS)
    + cases(ALL, "max-frames", NOT_COUNTS + ["7"])
    + cases(ALL, "max-message-bytes", NOT_SIZES + ["4GiB"])
    + cases(PEERS, "max-output-bytes", NOT_SIZES)
    + cases([BrokerOptions], "max-queue-bytes", NOT_SIZES)
    + cases([BrokerOptions], "max-service-queue-bytes", NOT_SIZES)
    + cases(PENDING, "max-pending-bytes", ["-1", "0", "nan", "99999999999999999999GiB"])
)


@pytest.mark.parametrize("options, option, value", BAD)
def test_a_bad_value_is_a_usage_error_naming_the_option(options: type, option: str,
                                                        value: str) -> None:
    with pytest.raises(usage.UsageError, match=f"--{option}"):
        parse(options, f"--{option}", value)


@pytest.mark.parametrize("options, argv", [
    (BrokerOptions, ["--heartbeat", "0.01", "--bstar-heartbeat", "0.01", "--liveness", "1",
                     "--request-expiry", "1e-9", "--max-queue", "1", "--max-service-queue", "1",
                     "--max-workers", "1", "--max-service-workers", "1", "--max-deliveries", "1",
                     "--max-queue-bytes", "64", "--max-service-queue-bytes", "64",
                     "--max-connections", "1", "--handshake-timeout", "0.001",
                     "--record-timeout", "0.001", "--max-message-bytes", "64",
                     "--max-frames", "8", "--max-output-bytes", "64"]),
    (WorkerOptions, ["--heartbeat", "0.25", "--liveness", "4", "--backoff-max", "0.01",
                     "--reply-store", "0", "--concurrency", "1"]),
    (TitanicOptions, ["--timeout", "0.5", "--keep", "1e9", "--backoff-max", "0.01",
                      "--concurrency", "1", "--service-workers", "1"]),
    (FreelanceServerOptions, ["--max-pending", "1", "--max-pending-bytes", "1"]),
    (SPRepOptions, ["--max-pending", "1", "--max-pending-bytes", "1k"]),
    # the largest message a stream record carries with 10,000 frames
    (SPDeviceOptions, ["--max-message-bytes", str(0xFFFFFFFE - 4 * 10_000)]),
])
def test_the_bounds_themselves_are_accepted(options: type, argv: list[str]) -> None:
    parsed = parse(options, *argv)
    tap.limits_of(parsed)


def test_the_defaults_are_accepted() -> None:
    for options in ALL:
        parse(options)


def test_every_limit_is_an_option_with_the_limits_default() -> None:
    import attrs

    assert set(tap.LIMIT_OPTIONS) == {field.name for field in attrs.fields(Limits)}
    assert tap.limits_of(parse(BrokerOptions)) == Limits()


def test_a_message_and_its_frame_lengths_must_fit_a_stream_record() -> None:
    most = 0xFFFFFFFE - 4 * 10_000
    assert tap.limits_of(parse(BrokerOptions, "--max-message-bytes", str(most))).maxMessageBytes \
        == most
    with pytest.raises(usage.UsageError, match=f"--max-message-bytes is at most {most}"):
        parse(BrokerOptions, "--max-message-bytes", str(most + 1))
    with pytest.raises(usage.UsageError, match="--max-frames 1073741824 is too large"):
        parse(WorkerOptions, "--max-frames", str(1 << 30))
    with pytest.raises(usage.UsageError, match="too large with --max-frames 100000"):
        parse(WorkerOptions, "--max-frames", "100000", "--max-message-bytes", "4294900000")


def test_an_infinite_heartbeat_expiry_is_a_usage_error_while_parsing() -> None:
    """Both values fine on their own, their product is not: postOptions says so
    (a huge but finite number of seconds is refused on its own)."""
    with pytest.raises(usage.UsageError, match="--heartbeat must be at most 1e\\+09 seconds"):
        parse(BrokerOptions, "--heartbeat", "1e308", "--liveness", "10")
    for option in ("--bstar-heartbeat", "--request-expiry", "--handshake-timeout"):
        with pytest.raises(usage.UsageError, match=f"{option} must be at most"):
            parse(BrokerOptions, option, "1e308")
    with pytest.raises(usage.UsageError, match="must be finite"):
        parse(WorkerOptions, "--heartbeat", "2.5", "--liveness", "1" + "0" * 400)


def test_the_help_says_the_bounds() -> None:
    text = " ".join(BrokerOptions().getUsage().split())
    assert "Heartbeat interval in seconds. [default: 2.5]. Seconds, at least 0.01." in text
    assert "Most registered workers. [default: 10000]. A whole number, at least 1." in text
    assert "A positive number of seconds." in text
    worker = " ".join(WorkerOptions().getUsage().split())
    assert "(0: off). [default: 0]. A whole number, at least 0." in worker


def test_services_are_made_from_the_bounds() -> None:
    broker = parse(BrokerOptions, "--heartbeat", "0.01", "--liveness", "1", "--max-deliveries", "1",
                   "--unknown-service-expiry", "0.001", "--handshake-timeout", "0.001").makeService()
    assert broker.broker.heartbeat == HeartbeatPolicy(0.01, 1)
    worker = parse(WorkerOptions, "--reply-store", "1", "--backoff-max", "0.01", "--heartbeat", "0.01",
                   "--concurrency", "8").makeService()
    assert worker.worker.concurrency == 8 and len(worker.worker.sessions) == 8
    titanic = TitanicOptions()
    titanic.parseOptions(["--db", ":memory:", "--max-store-bytes", "1MiB",
                          "--max-request-bytes", "64KiB", "--list-every", "0.5"])
    made = titanic.newService(None).titanic
    assert made.store.maxBytes == 1 << 20 and made.server.maxRequestBytes == 64 << 10
    assert made.dispatcher.machine.listEvery == 0.5


# --- twist itself -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["mdp-broker", "--heartbeat", "nan"],
    ["mdp-broker", "--liveness", "0"],  # was a traceback from makeService
    ["mdp-broker", "--heartbeat", "1e308", "--liveness", "10"],
    ["mdp-broker", "--max-message-bytes", "99999999999999999999GiB"],
    ["mdp-worker", "--service", "echo", "--backoff-max", "1e-6"],
    ["mdp-titanic", "--db", ":memory:", "--timeout", "inf"],
])
@pytest_twisted.ensureDeferred
async def test_twist_says_error_and_exits_2(argv: list[str]) -> None:
    proc = Process(reactor(), [script("twist"), "--log-format", "text", *argv], env=ENV)
    try:
        await proc.ended(60)
    finally:
        await proc.stop()
    assert proc.exitCode == 2, proc.output
    assert proc.output.startswith(f"twist {argv[0]}: --".encode()), proc.output
    assert b"Traceback" not in proc.output, proc.output
    assert b"Starting reactor" not in proc.output


@pytest_twisted.ensureDeferred
async def test_python_m_twisted_broker_heartbeat_nan() -> None:
    proc = Process(reactor(), [sys.executable, "-m", "twisted", "mdp-broker", "--heartbeat", "nan"],
                   env=ENV)
    try:
        await proc.ended(60)
    finally:
        await proc.stop()
    assert proc.exitCode == 2, proc.output
    program = os.path.basename(sys.executable)
    assert proc.output.startswith(f"{program} -m twisted mdp-broker: --heartbeat".encode()), \
        proc.output
    assert b"Traceback" not in proc.output


# --- the policies themselves ------------------------------------------------------------


@pytest.mark.parametrize("interval, liveness", [
    (math.nan, 3), (math.inf, 3), (-math.inf, 3), (0, 3), (-1, 3),
    (2.5, math.nan), (2.5, 0), (2.5, -1), (1e308, 10), (2.5, 10 ** 400),
])
def test_heartbeat_policy_refuses_what_never_or_always_expires(interval: float,
                                                               liveness: int) -> None:
    with pytest.raises(ValueError, match="heartbeat"):
        HeartbeatPolicy(interval, liveness)


@pytest.mark.parametrize("field", ["maxMessageBytes", "maxFrames", "maxOutputBytes",
                                   "maxConnections", "handshakeTimeout", "recordTimeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1])
def test_limits_refuse_nan_and_infinity(field: str, value: float) -> None:
    """A stream transport would otherwise arm its timers with them (Twisted's
    callLater asserts on nan) or compare against them forever."""
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


def test_limits_still_take_any_whole_number() -> None:
    unbounded = Limits(maxMessageBytes=sys.maxsize, maxFrames=sys.maxsize)
    assert unbounded.oversize(10 ** 12, 10 ** 6) is None
    assert Limits(handshakeTimeout=0.001, recordTimeout=1e9).recordTimeout == 1e9


def test_a_metrics_endpoint_whose_files_cannot_be_read_is_a_usage_error(tmp_path: Any) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(usage.UsageError, match="--metrics: .*missing.pem"):
        parse(BrokerOptions, "--metrics", f"ssl:0:privateKey={missing}")


def test_two_services_failing_stop_the_reactor_once() -> None:
    from mdp.app.service import _stop_and_exit

    class Reactor:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def addSystemEventTrigger(self, *args: Any) -> None:
            self.calls.append("trigger")

        def callWhenRunning(self, f: Any) -> None:
            self.calls.append("stop")

        def stop(self) -> None:
            pass

    reactor = Reactor()
    _stop_and_exit(reactor, 1)
    _stop_and_exit(reactor, 1)  # the metrics endpoint failed too
    assert reactor.calls == ["trigger", "stop"]


@pytest.mark.parametrize("options, argv, says", [
    (WorkerOptions, ["--service", "caf\u00e9"], "--service: service name 'caf\u00e9' is not ASCII"),
    (WorkerOptions, ["--service", "x" * 300], "--service: "),
    (BrokerOptions, ["--endpoint", "zmq:tcp://127.0.0.1:*,tcp:port=0:interface=127.0.0.1"],
     "--endpoint takes one endpoint, not 2"),
    (BrokerOptions, ["--backend", "tcp:port=0:interface=127.0.0.1,unix:/tmp/x"],
     "--backend takes one endpoint"),
    (FreelanceServerOptions, ["--endpoint", "zmq:tcp://127.0.0.1:*,zmq:tcp://127.0.0.1:*"],
     "--endpoint takes one endpoint"),
])
def test_what_makeService_would_raise_on_is_a_usage_error(options: type, argv: list[str],
                                                            says: str) -> None:
    """Each raised out of makeService, a traceback (the comma-separated list
    passed the check piece by piece, then made one bad endpoint)."""
    with pytest.raises(usage.UsageError, match="^" + says.replace("*", r"\*")):
        parse(options, *argv)


def test_curve_keys_and_endpoints_that_cannot_use_them_are_usage_errors(tmp_path: Any) -> None:
    """Keys for a peer of stream brokers only (a traceback from makeService),
    or a listener beyond loopback that would take peers unauthenticated
    beside CURVE (it listened in the clear)."""
    from mdp.transport.curve import keygen

    public, secret = keygen("node", str(tmp_path))
    (tmp_path / "allowed").mkdir()
    client = ["--curve-server-public", public]
    server = ["--curve-secret", secret, "--curve-allow", str(tmp_path / "allowed")]
    for cls in (WorkerOptions, TitanicOptions):
        with pytest.raises(usage.UsageError, match="CURVE keys are for zmq: endpoints"):
            parse(cls, "--broker", "tcp:host=127.0.0.1:port=5555", *client)
        parse(cls, "--broker", "zmq:tcp://127.0.0.1:5555", *client)
    for argv in (["--endpoint", "tcp:port=5555"],
                 ["--endpoint", "zmq:tcp://*:5555", "--backend", "tcp:port=5556"]):
        with pytest.raises(usage.UsageError, match="without authenticating them"):
            parse(BrokerOptions, *argv, *server)
    with pytest.raises(usage.UsageError, match="^--endpoint: .*without authenticating them"):
        parse(FreelanceServerOptions, "--endpoint", "tcp:port=5555", *server)
    parse(BrokerOptions, "--endpoint", "zmq:tcp://*:5555", "--backend",
          "tcp:port=5556:interface=127.0.0.1", *server)


def test_the_plugin_dropin_lists_the_plugins_and_imports_their_options_on_use() -> None:
    """``twist`` imports every dropin inside ``getPlugins``, which logs and
    goes on past what an import raises (Ctrl-C too): ours imports no part of
    the package; each entry's options are a parser of :mod:`mdp.app.tap`,
    and parsed, they make the entry's service."""
    import subprocess

    from twisted.application.service import IServiceMaker, ServiceMaker
    from twisted.plugin import IPlugin

    program = ("import sys, twisted.plugins.mdp_plugins\n"
               "print(sorted(m for m in sys.modules if m == 'mdp' or m.startswith('mdp.')))\n")
    imported = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=60, env=ENV)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"
    from twisted.plugins import mdp_plugins

    entries = {v.options: v for v in vars(mdp_plugins).values() if isinstance(v, ServiceMaker)}
    assert set(entries) == set(REQUIRED)
    for entry in entries.values():
        assert IServiceMaker.providedBy(entry) and IPlugin.providedBy(entry)
    broker = entries[BrokerOptions]
    options = broker.options()
    options.parseOptions(["--endpoint", "loopback:dropin"])
    assert broker.makeService(options).endpoint == "loopback:dropin"


@pytest.mark.parametrize("argv, message", [
    ([], "--service is required"),
    (["--service", ""], "--service is empty"),
])
def test_a_worker_without_a_service_name_is_told_which_mistake(argv: list[str],
                                                               message: str) -> None:
    with pytest.raises(usage.UsageError, match=message):
        WorkerOptions().parseOptions(argv)
