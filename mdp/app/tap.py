"""Options of the ``twist`` plugins (mdp-broker, mdp-worker, ...); each makes its plugin's service."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import attrs
from twisted.application.service import MultiService
from twisted.logger import LogLevel
from twisted.python import usage

from mdp import binarystar, policy, transport, uvreactor
from mdp.app import service
from mdp.errors import MDPError, TransportError
from mdp.handlers import load_handler
from mdp.majordomo import broker
from mdp.majordomo.codec import api_service_name, check_dialect
from mdp.majordomo.idempotence import MemoryReplyStore, SQLiteReplyStore
from mdp.majordomo.worker import check_attach
from mdp.titanic import dispatcher as titanic_dispatcher
from mdp.titanic import server as titanic_server
from mdp.titanic import store as titanic_store
from mdp.transport.curve import curve_server
from mdp.transport.endpoints import raise_descriptor_limit
from mdp.transport.registry import bare_address

DEFAULT_ENDPOINT = "zmq:tcp://127.0.0.1:5555"
#: where ``twist mdp-freelance-server`` binds, and ``mdp freelance-call`` asks
DEFAULT_FREELANCE_ENDPOINT = "zmq:tcp://127.0.0.1:5556"

_UNITS = {"": 1, "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gib": 1024 ** 3}
#: the largest byte size: a signed 64-bit size, as libzmq and the OS take
MAX_BYTE_SIZE = (1 << 63) - 1
#: the longest stream record payload (a uint32 length; 0xFFFFFFFF marks a greeting)
MAX_RECORD_PAYLOAD = 0xFFFFFFFE
#: the shortest --heartbeat, --bstar-heartbeat or --backoff-max
MIN_INTERVAL = 0.01


def _bytes(option: str, least: int) -> Callable[[str], int]:
    """The coercer of the byte size option *option* (``64k``, ``16MiB``): at least *least*, at most
    :data:`MAX_BYTE_SIZE`."""
    def coerce(value: str) -> int:
        match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"--{option}: not a byte size: {value!r} (try 65536, 64KiB, 16MiB or 1GiB)")
        size = int(match.group(1)) * _UNITS[match.group(2).lower()]
        if size > MAX_BYTE_SIZE:
            raise ValueError(f"--{option}: byte size too large: {value.strip()} "
                             f"(at most {MAX_BYTE_SIZE} bytes)")
        if size < least:
            plural = "s" * (least != 1)
            raise ValueError(f"--{option} must be at least {least} byte{plural}, got {value.strip()}")
        return size

    coerce.coerceDoc = f"Bytes, at least {least}; K/KiB, M/MiB and G/GiB suffixes allowed."  # type: ignore
    return coerce


def seconds_option(option: str, least: Optional[float] = None) -> Callable[[str], float]:
    """The coercer of the seconds option *option*: finite, positive or at least *least*."""
    def coerce(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--{option}: not a number of seconds: {value!r}") from None
        if least is None and not (math.isfinite(number) and number > 0):
            raise ValueError(f"--{option} must be a positive number of seconds, not {value}")
        if number > policy.MAX_SECONDS:  # finite, but no timer (nor 2 x heartbeat) takes it
            raise ValueError(f"--{option} must be at most {policy.MAX_SECONDS:g} seconds, got {value}")
        if least is not None and not (math.isfinite(number) and number >= least):
            raise ValueError(f"--{option} must be a number of seconds of at least {least:g}, got {value}")
        return number

    coerce.coerceDoc = f"Seconds, at least {least:g}." if least else "A positive number of seconds."  # type: ignore
    return coerce


def whole_option(option: str, least: int) -> Callable[[str], int]:
    """The coercer of the whole number option *option*: at least *least*."""
    def coerce(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--{option}: not a whole number: {value!r}") from None
        return policy.whole_number(f"--{option}", number, least)

    coerce.coerceDoc = f"A whole number, at least {least}."  # type: ignore[attr-defined]
    return coerce


def _option(name: str, default: Any, doc: str, coercer: Callable[..., Callable[[str], Any]],
            *bounds: Any) -> list[Any]:
    """The usage.Options row of the parameter *name*, coerced by ``coercer(name, *bounds)``."""
    return [name, None, default, doc, coercer(name, *bounds)]


def program_name() -> str:
    """The name the program was started by: ``twist``, ``python -m twisted``, ..."""
    name = os.path.basename(sys.argv[0])
    if name == "__main__.py":
        package = os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0])))
        return f"{os.path.basename(sys.executable)} -m {package}"
    return name


#: the exit status of a usage mistake, for ``mdp`` and the ``twist`` plugins alike
EXIT_USAGE = 2


def usage_line(options: VersionedOptions, error: usage.UsageError) -> str:
    """A usage mistake in one line: the command, what is wrong, where the help is."""
    command = options.commandName()
    text = re.sub(r"^Parameter type enforcement failed: (?=--)", "", str(error))  # a coercer names its option
    return f"{command}: {text} (see {command} --help)"


class VersionedOptions(usage.Options):
    """Our option parsers: ``--version``, ``-h``, a usage line naming the command; under
    ``twist`` a usage mistake is one line on stderr and exit status :data:`EXIT_USAGE`."""

    #: what the usage line of a parser with no parent starts with
    programName: Optional[str] = None
    #: options that may be given more than once (see :func:`repeated`)
    repeatable: tuple[str, ...] = ()

    opt_h = usage.Options.opt_help

    def __init__(self) -> None:
        super().__init__()
        for name in self.repeatable:
            self[name] = []

    def _chain(self) -> tuple[Optional[str], list[str]]:
        """The root parser's programName (None under twist, whose parser is not ours), and the
        sub-commands to this one."""
        if self.parent is None:
            return getattr(self, "programName", None), []
        program, words = VersionedOptions._chain(self.parent)  # type: ignore[arg-type]
        return program, [*words, self.parent.subCommand]

    def commandName(self) -> str:
        """The command as typed: ``mdp titanic result``, ``twist mdp-worker``."""
        program, words = self._chain()
        return " ".join([program or program_name(), *words])

    def getSynopsis(self) -> str:
        program, words = self._chain()
        if program is None:  # twist (or twistd): the program's own options come first
            program = program_name() + (" [options]" if words else "")
        synopsis = getattr(self, "synopsis", "[options]").rstrip()
        return " ".join(["Usage:", program, *words, synopsis])

    def parseOptions(self, options: Optional[Sequence[str]] = None) -> None:
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            if self.parent is None or self._chain()[0] is not None:
                e.parser = getattr(e, "parser", self)  # alone, or under mdp: the caller reports it
                raise
            print(usage_line(self, e), file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None

    def postOptions(self) -> None:
        if getattr(self, "subCommands", None) and self.subCommand is None:
            names = [command[0] for command in self.subCommands]
            raise usage.UsageError(f"choose a command: {', '.join(names[:-1])} or {names[-1]}")

    def parseArgs(self, *args: str) -> None:
        if args:
            raise usage.UsageError(f"unexpected argument {args[0]!r}: "
                                   f"{self.commandName()} takes options only")

    def opt_version(self) -> None:
        """Display txmajordomo's version and exit"""
        import twisted
        from mdp import __version__

        print(f"txmajordomo {__version__} (Twisted {twisted.__version__})")
        sys.exit(0)


def repeated(name: str, doc: str) -> Callable[[VersionedOptions, str], None]:
    """The ``opt_`` handler of *name* (in ``repeatable``): each value goes on ``self[name]``."""
    def add(self: VersionedOptions, value: str) -> None:
        self[name].append(value)

    add.__doc__ = doc
    return add


@contextlib.contextmanager
def usage_errors(option: str = "", errors: tuple[type[Exception], ...] = (TransportError, ValueError)
                 ) -> Iterator[None]:
    """Raise the *errors* raised inside as a usage error, after ``--option:`` if given."""
    try:
        yield
    except errors as e:
        raise usage.UsageError(f"--{option}: {e}" if option else str(e)) from None


def checked_endpoints(value: Optional[str], role: str, option: str,
                      example: str = DEFAULT_ENDPOINT) -> list[str]:
    """The comma-separated endpoints of *option*, checked for *role* (None: none)."""
    if value is None:
        return []
    endpoints = [e.strip() for e in value.split(",")]
    if not value.strip():
        raise usage.UsageError(f"--{option} is empty: give an endpoint, e.g. {example}")
    if not all(endpoints):
        raise usage.UsageError(f"--{option}: an empty endpoint in {value!r} (a comma too many, "
                               "or a variable that was not set?)")
    with usage_errors(option):
        return transport.endpoint_list(endpoints, role)


def connect_endpoints(values: list[str], option: str, default: str) -> list[str]:
    """The endpoints to connect to of the repeated *option* (*default* if not given), checked."""
    return [endpoint for value in values or [default]
            for endpoint in checked_endpoints(value, transport.CONNECT, option, example=default)]


def checked_endpoint(value: Optional[str], role: str, option: str) -> Optional[str]:
    """The one endpoint of *option*, checked for *role*; a list is a usage error."""
    endpoints = checked_endpoints(value, role, option)
    if len(endpoints) > 1:
        raise usage.UsageError(f"--{option} takes one endpoint, not {len(endpoints)}")
    return endpoints[0] if endpoints else None


def keywords(options: usage.Options, *names: str) -> dict[str, Any]:
    """The options *names* as keyword arguments: ``max-queue`` as ``maxQueue``."""
    return {re.sub(r"-(\w)", lambda m: m.group(1).upper(), name): options[name] for name in names}


def dashed(name: str) -> str:
    """The option of the keyword argument *name*: ``maxQueue`` as ``max-queue``."""
    return re.sub(r"[A-Z]", lambda m: "-" + m.group().lower(), name)


#: the option of each :class:`~mdp.policy.Limits` field: its coercer, least value and help
LIMIT_OPTIONS: dict[str, tuple[Callable[..., Any], float, str]] = {
    "maxMessageBytes": (_bytes, 64, "Largest message sent or received, in bytes of frames (the same "
                        "on every node); with 4 bytes a frame it fits a stream record: 4 GiB less 2 bytes."),
    "maxFrames": (whole_option, 8, "Most frames in one message."),
    "maxOutputBytes": (_bytes, 64, "Unsent bytes kept for a peer that does not read; beyond, a listening "
                       "side disconnects it and a streaming worker waits."),
    "maxConnections": (whole_option, 1, "Most open connections per stream endpoint (tcp, tls, unix)."),
    "handshakeTimeout": (seconds_option, 0.001, "Seconds a new stream connection has to send its first "
                         "message."),
    "recordTimeout": (seconds_option, 0.001, "Seconds a stream peer has to complete a message it started."),
    "maxConnectionsPerAddress": (whole_option, 0, "Most open connections from one IP address per stream "
                                 "endpoint (0: as --max-connections); at it, that address's connection "
                                 "that has done least is closed to admit a new one."),
    "maxBufferedBytes": (_bytes, 64, "Bytes of unfinished stream records the whole process holds; a "
                         "record that would pass it closes its connection."),
}
#: the limits every plugin takes; the others bind a listening side
_MESSAGE_LIMITS = ("maxMessageBytes", "maxFrames", "maxOutputBytes", "maxBufferedBytes")


def _limit_options(listening: bool) -> list[Any]:
    """The options of the message limits, or (*listening*) of the other limits."""
    defaults = policy.Limits()
    return [_option(dashed(field), getattr(defaults, field), doc, coercer, least)
            for field, (coercer, least, doc) in LIMIT_OPTIONS.items()
            if (field not in _MESSAGE_LIMITS) == listening]


def limits_of(options: usage.Options) -> policy.Limits:
    """The :class:`~mdp.policy.Limits` of *options*; a usage error if invalid or over a stream record."""
    with usage_errors():
        limits = policy.Limits(**{field: options[dashed(field)] for field in LIMIT_OPTIONS
                           if dashed(field) in options})
    prefixes = 4 * limits.maxFrames
    if prefixes >= MAX_RECORD_PAYLOAD:
        raise usage.UsageError(f"--max-frames {limits.maxFrames} is too large: with 4 bytes of length each, "
                               f"the frames must fit a stream record of at most {MAX_RECORD_PAYLOAD} bytes")
    if limits.maxMessageBytes + prefixes > MAX_RECORD_PAYLOAD:
        raise usage.UsageError(
            f"--max-message-bytes {limits.maxMessageBytes} is too large with --max-frames "
            f"{limits.maxFrames}: a stream record holds at most {MAX_RECORD_PAYLOAD} bytes, "
            f"4 a frame for its length, so --max-message-bytes is at most "
            f"{MAX_RECORD_PAYLOAD - prefixes}")
    return limits


_METRICS_OPTIONS: list[Any] = [["metrics", None, None, "Serve Prometheus metrics at /metrics on this Twisted "
                                 "endpoint (e.g. tcp:9464:interface=127.0.0.1)."]]


def checked_metrics(endpoint: str) -> None:
    """--metrics is a Twisted server endpoint string."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString

    if not endpoint.strip():
        raise usage.UsageError("--metrics is empty: give a Twisted server endpoint, e.g. "
                               "tcp:9464:interface=127.0.0.1")
    try:
        serverFromString(reactor, endpoint)
    except (ValueError, KeyError, TypeError) as e:
        raise usage.UsageError(f"--metrics: not a Twisted server endpoint: {endpoint!r} ({e})") from None
    except OSError as e:  # ssl: a key or certificate file it cannot read
        raise usage.UsageError(f"--metrics: {endpoint!r}: {e}") from None


_CURVE_SERVER_OPTIONS: list[Any] = [
    ["curve-secret", None, None, "CURVE: this server's secret key file (NAME.key_secret, from "
     "'mdp keygen NAME'); zmq: endpoints become encrypted."],
    ["curve-allow", None, None, "CURVE: a directory of the public keys (*.key) of the peers let in; "
     "without it any peer with a key is."],
]
CURVE_CLIENT_OPTIONS: list[Any] = [
    ["curve-server-public", None, None, "CURVE: the broker's public key file (NAME.key)."],
    ["curve-secret", None, None, "CURVE: this peer's secret key file (NAME.key_secret); without it a "
     "key made up for this process (only a server without --curve-allow lets it in)."],
]


def checked_curve_server(options: usage.Options, listeners: dict[str, Optional[str]]) -> None:
    """Check --curve-secret, --curve-allow and *listeners* (option: endpoint) against them."""
    with usage_errors():
        curve = curve_server(options["curve-secret"], options["curve-allow"])
    for option, endpoint in listeners.items():
        if endpoint is not None:
            with usage_errors(option):
                transport.curve_listen_for(endpoint, curve)


def curve_client_of(options: usage.Options) -> dict[str, Any]:
    """--curve-server-public and --curve-secret, as a peer's keyword arguments."""
    return keywords(options, "curve-server-public", "curve-secret")


def checked_curve_client(options: usage.Options, endpoints: list[str]) -> None:
    """Check the client CURVE keys for *endpoints* (:func:`mdp.transport.curve_client_for`)."""
    with usage_errors():
        transport.curve_client_for(endpoints, options["curve-server-public"], options["curve-secret"])


class BrokerListOptions(VersionedOptions):
    """``--broker``/``-b``, repeatable for failover, into ``self["brokers"]``; CURVE keys for them."""

    repeatable = ("broker",)
    optParameters: list[Any] = CURVE_CLIENT_OPTIONS
    opt_broker = opt_b = repeated("broker", "Broker endpoint; once per broker (or commas) for "
                                  "failover [default: zmq:tcp://127.0.0.1:5555]")

    def postOptions(self) -> None:
        self["brokers"] = connect_endpoints(self["broker"], "broker", DEFAULT_ENDPOINT)
        checked_curve_client(self, self["brokers"])


def _pending_options(beyond: str) -> list[Any]:
    """``--max-pending`` and ``--max-pending-bytes``; *beyond*: what happens over them."""
    return [_option("max-pending", policy.DEFAULT_MAX_PENDING,
                    f"Most requests being handled at once; beyond, requests are {beyond}.", whole_option, 1),
            _option("max-pending-bytes", policy.DEFAULT_MAX_PENDING_BYTES,
                    f"Most bytes of requests being handled at once; beyond, {beyond}.", _bytes, 1)]


class _ServiceOptions(VersionedOptions):
    """Options of a ``twist`` plugin: :meth:`postOptions` checks each group of them, so a
    mistake is a usage error before anything starts."""

    optParameters: list[Any] = _limit_options(listening=False)
    #: the :mod:`mdp.metrics` class that --metrics counts with
    metrics = ""

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        """Check the options of this role; a server returns its listeners (option: endpoint)."""

    def newService(self, metrics: Any) -> Any:
        """The service these options ask for, counting with *metrics* (None: no --metrics)."""
        raise NotImplementedError

    def makeService(self) -> Any:
        """The plugin's service: a listening role (all but a broker's client) raises the open file
        limit first; --metrics adds a metrics server beside it."""
        if not isinstance(self, BrokerListOptions):
            raise_descriptor_limit()
        if not self.get("metrics"):
            return self.newService(None)
        import mdp.metrics

        metrics = getattr(mdp.metrics, self.metrics)()
        parent = MultiService()
        self.newService(metrics).setServiceParent(parent)
        service.MetricsService(self["metrics"], metrics.registry, exitOnFailure=True).setServiceParent(parent)
        return parent

    def postOptions(self) -> None:
        # ours unless twist installed --reactor's; before a check or handler imports one
        uvreactor.install_default()
        if "heartbeat" in self:
            self.heartbeatPolicy()
        limits_of(self)
        listeners = self.checkRole()
        super().postOptions()  # a broker's client: its --broker endpoints
        if self.get("metrics") is not None:
            checked_metrics(self["metrics"])
        if "curve-allow" in self:
            checked_curve_server(self, listeners or {})
        if "handler" in self:  # loaded now: a failure is one line on stderr and exit status 2
            try:
                self["handler-callable"] = self.loadHandler(self["handler"])
            except MDPError as e:
                print(f"{self.commandName()}: --handler: {e}", file=sys.stderr)
                raise SystemExit(2) from None

    def heartbeatPolicy(self) -> policy.HeartbeatPolicy:
        """The :class:`~mdp.policy.HeartbeatPolicy` of --heartbeat and --liveness, or a usage error."""
        with usage_errors(f"heartbeat {self['heartbeat']} --liveness {self['liveness']}"):
            return policy.HeartbeatPolicy(self["heartbeat"], self["liveness"])

    loadHandler = staticmethod(load_handler)


class _HeartbeatOptions(_ServiceOptions):
    optParameters: list[Any] = [
        _option("heartbeat", 2.5, "Heartbeat interval in seconds.", seconds_option, MIN_INTERVAL),
        _option("liveness", 3, "Missed heartbeats before a peer is dead.", whole_option, 1),
    ]


_HANDLER = ["handler", None, "echo", "'echo' or 'module:callable' taking the request frames."]

#: the broker's bounds (defaults: its ``DEFAULT_`` constants), passed on to it as keyword arguments
_BROKER_BOUNDS: list[Any] = [
    _option(name, getattr(broker, "DEFAULT_" + name.upper().replace("-", "_")), doc, coercer, *least)
    for name, doc, coercer, *least in [
        ("request-expiry", "Seconds a request waits for a worker of its service to be free.", seconds_option),
        ("unknown-service-expiry", "Seconds the requests for a service no worker has registered wait "
         "(from its first request), then 503.", seconds_option),
        ("service-linger", "Seconds a service stays known (mmi.service 200) after its last worker left.",
         seconds_option),
        ("max-queue", "Most requests queued in all.", whole_option, 1),
        ("max-service-queue", "Most requests queued for one service.", whole_option, 1),
        ("max-queue-bytes", f"Most bytes of request bodies queued in all ({policy.FRAME_OVERHEAD} more a "
         "frame).", _bytes, policy.FRAME_OVERHEAD),
        ("max-service-queue-bytes", "Most bytes of request bodies queued for one service "
         f"({policy.FRAME_OVERHEAD} more a frame).", _bytes, policy.FRAME_OVERHEAD),
        ("max-workers", "Most registered workers.", whole_option, 1),
        ("max-service-workers", "Most registered workers for one service.", whole_option, 1),
        ("max-deliveries", "Times a request is given to a worker that is then lost, before it fails.",
         whole_option, 1),
    ]
]


class BrokerOptions(_HeartbeatOptions):
    synopsis = ("[--endpoint ENDPOINT] [--backend ENDPOINT] [--heartbeat SECONDS] [--bstar primary|backup "
                "--bstar-local ENDPOINT --bstar-remote ENDPOINT] [options]")
    longdesc = ("Run an MDP/0.2 broker.  Endpoints: zmq:tcp://HOST:PORT (port * lets the OS choose), "
                "tcp:host=HOST:port=PORT (any Twisted endpoint), loopback:NAME.")
    optParameters: list[Any] = [
        ["endpoint", "e", DEFAULT_ENDPOINT, "Endpoint for clients (and workers, unless --backend is given)."],
        ["backend", "b", None, "Separate endpoint for workers."],
        ["bstar", None, None, "Run as one of a Binary Star pair: primary or backup (needs --bstar-local "
         "and --bstar-remote)."],
        ["bstar-local", None, None, "Binary Star: where this broker publishes its state."],
        ["bstar-remote", None, None, "Binary Star: the peer broker's --bstar-local."],
        _option("bstar-heartbeat", binarystar.DEFAULT_HEARTBEAT, "Binary Star: seconds between state "
                "messages; the peer is gone after twice this.", seconds_option, MIN_INTERVAL),
        ["access", None, None, "Access policy file (TOML): which peers may call and serve which "
         "services (docs/security.md)."],
    ] + _BROKER_BOUNDS + _CURVE_SERVER_OPTIONS + _METRICS_OPTIONS + _limit_options(listening=True)
    metrics = "BrokerMetrics"

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        listeners = {name: checked_endpoint(self[name], transport.LISTEN, name)
                     for name in ("endpoint", "backend")}
        self["access-policy"] = None
        if self["access"] is not None:
            try:
                with usage_errors("access", (ValueError,)):
                    self["access-policy"] = policy.AccessPolicy.load(self["access"])
            except OSError as e:
                raise usage.UsageError(f"--access: cannot read {self['access']}: {e.strerror}") from None
        given = [self[name] is not None for name in ("bstar", "bstar-local", "bstar-remote")]
        if any(given) and not all(given):
            raise usage.UsageError("--bstar, --bstar-local and --bstar-remote go together")
        if all(given):
            if self["bstar"] not in ("primary", "backup"):
                raise usage.UsageError(f"--bstar is primary or backup, not {self['bstar']!r}")
            checked_endpoint(self["bstar-local"], transport.LISTEN, "bstar-local")
            checked_endpoint(self["bstar-remote"], transport.CONNECT, "bstar-remote")
        return listeners

    def newService(self, metrics: Any) -> Any:
        binaryStar = None if self["bstar"] is None else binarystar.BinaryStar(
            self["bstar"], self["bstar-local"], self["bstar-remote"], heartbeat=self["bstar-heartbeat"],
            limits=limits_of(self))
        debug = self.parent is not None and self.parent.get("logLevel") == LogLevel.debug
        return service.BrokerService(
            self["endpoint"], self["backend"], metrics=metrics, binaryStar=binaryStar,
            logRequests=debug, heartbeat=self.heartbeatPolicy(),
            limits=limits_of(self), access=self["access-policy"], exitOnFailure=True,
            **keywords(self, "curve-secret", "curve-allow", *(row[0] for row in _BROKER_BOUNDS)))


class WorkerOptions(_HeartbeatOptions, BrokerListOptions):
    synopsis = ("--service NAME [--broker ENDPOINT [--broker ENDPOINT...]] [--handler echo|module:callable] "
                "[--attach one|all] [--dialect rfc|majortomo] [--concurrency N] [options]")
    longdesc = ("Run an MDP/0.2 worker offering --service through the broker(s).  --handler "
                "module:callable (imported at start; the current directory is searched too) takes the "
                "request frames and returns the reply, or a Deferred, coroutine or generator: "
                "--concurrency N serves N requests at once.")
    optParameters: list[Any] = [
        ["service", "s", None, "Service name to register."],
        _HANDLER,
        _option("backoff-max", 32.0, "Longest reconnect delay in seconds.", seconds_option, MIN_INTERVAL),
        ["dialect", None, "rfc", "Wire dialect: rfc (RFC 18) or majortomo.", check_dialect],
        _option("reply-store", 0, "Remember the replies to this many stamped requests (in the "
                "--reply-db file if given) and answer their retries from them (0: off).", whole_option, 0),
        ["reply-db", None, None, "Keep the replies to stamped requests in this SQLite file, shared by "
         "the workers of this host (with --reply-store N: the last N; else a million)."],
        _option("concurrency", 1, "Requests served at once (worker sessions of this process).",
                whole_option, 1),
        ["attach", None, "one", "With several --broker: one (the others a failover list) or all "
         "(side by side: the --concurrency sessions spread over them; at least one each)."],
    ] + _METRICS_OPTIONS
    metrics = "WorkerMetrics"

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        if self["service"] is None:
            raise usage.UsageError("--service is required")
        if not self["service"]:
            raise usage.UsageError("--service is empty: a worker serves a service by its name")
        with usage_errors("service"):
            api_service_name(self["service"])
        with usage_errors("attach"):
            check_attach(self["attach"], self["concurrency"],
                         len(connect_endpoints(self["broker"], "broker", DEFAULT_ENDPOINT)))
        with usage_errors("reply-db", (MDPError,)):
            self["replies"] = (SQLiteReplyStore(self["reply-db"], self["reply-store"] or 1_000_000)
                               if self["reply-db"] else
                               MemoryReplyStore(self["reply-store"]) if self["reply-store"] else None)

    def newService(self, metrics: Any) -> Any:
        return service.WorkerService(
            self["brokers"], self["service"], self["handler-callable"], heartbeat=self.heartbeatPolicy(),
            backoff=attrs.evolve(policy.PIRATE, maximum=self["backoff-max"]), dialect=self["dialect"],
            replies=self["replies"],
            limits=limits_of(self), metrics=metrics, concurrency=self["concurrency"],
            attach=self["attach"], **curve_client_of(self))


class FreelanceServerOptions(_ServiceOptions):
    synopsis = "[--endpoint ENDPOINT] [--handler echo|module:callable] [--max-pending N] [options]"
    longdesc = ("Run a Freelance server: PING is answered PONG, [sequence, body...] with [sequence, "
                "reply...].  Try it with mdp freelance-call.")
    optParameters: list[Any] = [
        ["endpoint", "e", DEFAULT_FREELANCE_ENDPOINT, "Where the server binds."], _HANDLER,
    ] + (_pending_options("refused (429)") + _CURVE_SERVER_OPTIONS + _METRICS_OPTIONS
         + _limit_options(listening=True))
    metrics = "FreelanceMetrics"

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        return {"endpoint": checked_endpoint(self["endpoint"], transport.LISTEN, "endpoint")}

    def newService(self, metrics: Any) -> Any:
        from mdp.freelance import FreelanceServer

        server = FreelanceServer(self["handler-callable"], limits=limits_of(self), metrics=metrics,
                                 **keywords(self, "max-pending", "max-pending-bytes", "curve-secret",
                                            "curve-allow"))
        return service.ServerService(self["endpoint"], server, exitOnFailure=True, what="Freelance server")


def checked_sp_endpoint(value: str, listen: bool, option: str) -> None:
    """Check *value* as an SP endpoint (nng URL or ours) to listen on or connect to."""
    from mdp.sp.codec import endpoint_of

    if not value.strip():
        raise usage.UsageError(f"--{option} is empty: give an nng URL, e.g. tcp://127.0.0.1:5555")
    if bare_address(value) is not None:
        raise usage.UsageError(f"--{option}: bad endpoint {value!r}: no scheme; did you mean tcp://{value}?")
    with usage_errors(option):
        transport.check(endpoint_of(value, listen), transport.LISTEN if listen else transport.CONNECT)


class SPRepOptions(_ServiceOptions):
    synopsis = "[--endpoint URL] [--handler echo|module:callable] [--max-pending N] [options]"
    longdesc = "Answer SP (nng) REQ requests: the handler takes the payload bytes and returns bytes."
    optParameters: list[Any] = [
        ["endpoint", "e", "tcp://127.0.0.1:5555", "nng URL or Twisted endpoint to listen on."],
        ["handler", None, "echo", "'echo' or 'module:callable' taking the payload bytes."],
    ] + _pending_options("dropped (the requester resends)")

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        checked_sp_endpoint(self["endpoint"], True, "endpoint")

    def newService(self, metrics: Any) -> Any:
        from mdp.sp.peers import SPServer

        server = SPServer(self["handler-callable"], limits=limits_of(self),
                          **keywords(self, "max-pending", "max-pending-bytes"))
        return service.ServerService(self["endpoint"], server, exitOnFailure=True, what="SP REP server")

    @staticmethod
    def loadHandler(spec: str) -> Any:
        """``echo`` (the payload back) or ``module:callable`` taking the payload bytes."""
        return (lambda payload: payload) if spec == "echo" else load_handler(spec)


class SPDeviceOptions(_ServiceOptions):
    synopsis = "[--front URL] --back URL [--back URL...] [options]"
    longdesc = "Forward SP (nng) requests from --front to the REP peers at --back, replies back."
    optParameters: list[Any] = [["front", "f", "tcp://127.0.0.1:5555", "Where requesters connect."]]
    repeatable = ("back",)
    opt_back = repeated("back", "Where to forward requests (once per REP peer or device).")

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        checked_sp_endpoint(self["front"], True, "front")
        if not self["back"]:
            raise usage.UsageError("--back is required")
        for back in self["back"]:
            checked_sp_endpoint(back, False, "back")

    def newService(self, metrics: Any) -> Any:
        return service.SPDeviceService(self["front"], self["back"], exitOnFailure=True,
                                       limits=limits_of(self))


class TitanicOptions(_HeartbeatOptions, BrokerListOptions):
    synopsis = ("[--broker ENDPOINT [--broker ENDPOINT...]] [--db PATH|:memory:|postgresql://...] "
                "[--concurrency N] [--stamp] "
                "[--timeout SECONDS] [--keep SECONDS] [options]")
    longdesc = ("Run Titanic: the titanic.request, titanic.reply and titanic.close services and the "
                "dispatcher that sends stored requests to their services.")
    optParameters: list[Any] = [
        ["db", "d", "titanic.db", "SQLite database file (made if missing), :memory: (lost with the "
         "process), or a postgresql:// URL (a store several Titanics share)."],
        ["concurrency", "c", titanic_dispatcher.DEFAULT_CONCURRENCY,
         "Stored requests out to their services at once.", whole_option("concurrency", 1)],
        ["timeout", "t", titanic_dispatcher.DEFAULT_TIMEOUT,
         "Seconds one attempt of a stored request may take before it is tried again.",
         seconds_option("timeout")],
        _option("backoff-max", titanic_dispatcher.DEFAULT_BACKOFF.maximum,
                "Longest wait before asking again about a service with no worker.",
                seconds_option, MIN_INTERVAL),
        _option("keep", titanic_dispatcher.DEFAULT_KEEP,
                "Seconds a reply is kept after it is stored, then purged.", seconds_option),
        _option("service-workers", titanic_server.DEFAULT_SERVICE_WORKERS,
                "MDP workers per Titanic service (requests stored at once).", whole_option, 1),
        _option("max-store-bytes", titanic_server.DEFAULT_MAX_STORE_BYTES,
                "Bytes of database pages the store may hold; a submit beyond is refused (500, 507).",
                _bytes, 1),
        _option("max-request-bytes", titanic_server.DEFAULT_MAX_REQUEST_BYTES,
                "Most bytes of request frames one submit may store; beyond, refused (400, 413).", _bytes, 1),
        _option("lease", titanic_server.DEFAULT_LEASE, "Seconds a request this Titanic claimed in a "
                "PostgreSQL store stays its own unless renewed: how long a dead Titanic's requests "
                "wait for another.", seconds_option, 1.0),
        _option("list-every", titanic_dispatcher.DEFAULT_LIST_EVERY, "Seconds between two mmi.services "
                "listings: how soon a service that appears is served.", seconds_option, MIN_INTERVAL),
    ]
    optFlags = [["stamp", None, "Send each stored request with an idempotence stamp made of its id: "
                 "workers with a reply store run it once, whichever Titanic sends it how often "
                 "(for workers that take stamps: ours)."]]

    def checkRole(self) -> Optional[dict[str, Optional[str]]]:
        if not self["db"]:
            raise usage.UsageError("--db: give a database file, :memory: or a postgresql:// URL")
        if self["db"].startswith(titanic_store.POSTGRES_URL):
            with usage_errors("db"):
                titanic_store.postgres_store_class()  # (psycopg is there: checked before any start)

    def newService(self, metrics: Any) -> Any:
        initial = titanic_dispatcher.DEFAULT_BACKOFF.initial
        return service.TitanicService(
            self["brokers"], self["db"], workers=self["service-workers"],
            backoff=policy.Backoff(initial, max(self["backoff-max"], initial)),
            heartbeat=self.heartbeatPolicy(), limits=limits_of(self), exitOnFailure=True,
            storeLease=self["lease"], stamp=bool(self["stamp"]),
            **keywords(self, "concurrency", "timeout", "keep", "max-store-bytes", "max-request-bytes",
                       "list-every"), **curve_client_of(self))
