"""The ``mdp`` console script (docs/cli.md).

Exit status: 0 done; 1 for a timeout or an error; 2 for a usage mistake (before anything is sent)
or a closed stdout; 3 for ``mdp titanic result`` while pending; 130 on Ctrl-C; 141 when stdout's
reader has gone.  Errors are one line on stderr, never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections import Counter
from typing import Any, Callable, Optional, Sequence

from twisted.internet import defer, task
from twisted.internet.error import ReactorNotRunning
from twisted.python import usage

from mdp import errors, transport, uvreactor
from mdp.app import tap
from mdp.app.console import EXIT_INTERRUPTED, catch_interrupt, interrupted
from mdp.errors import MDPError, NoServerAvailable, RequestTimeout, ServiceOverloaded, ServiceUnavailable
from mdp.handlers import echo
from mdp.majordomo import mmi
from mdp.majordomo.broker import Broker
from mdp.majordomo.client import DEFAULT_RETRIES, DEFAULT_TIMEOUT, Client
from mdp.majordomo.codec import api_service_name, check_dialect
from mdp.majordomo.spread import SpreadClient
from mdp.majordomo.worker import Worker
from mdp.titanic.client import TRANSIENT, TitanicClient
from mdp.transport import curve
from mdp.transport.registry import bare_address, schemes

#: stdout's reader has gone (128 + SIGPIPE): ``mdp call ... | head -1``
EXIT_BROKEN_PIPE = 141


def show(frame: bytes) -> str:
    """*frame* as text if it is printable UTF-8, else as a bytes literal."""
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        return repr(frame)
    return text if text.isprintable() else repr(frame)


def printable(text: str) -> str:
    """*text* with unprintable characters (terminal escapes) escaped: for peers' text."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def error(line: str) -> None:
    """One line on stderr, its unprintable characters escaped."""
    print(printable(line), file=sys.stderr, flush=True)


class Output:
    """Whether standard output's reader has gone (a broken pipe)."""

    gone = False


def divert_output() -> None:
    """Point stdout at /dev/null once its reader has gone, so later writes do not fail."""
    Output.gone = True
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), sys.stdout.fileno())


def emit(*lines: str) -> bool:
    """Write *lines* to stdout and flush; False when its reader has gone."""
    if Output.gone:
        return False
    try:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    except BrokenPipeError:
        divert_output()
        return False
    return True


def table(headings: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int]) -> list[str]:
    """Lines of a plain text table; the columns numbered in *right* align right."""
    cells = [list(headings)] + [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(row[n]) for row in cells) for n in range(len(headings))]
    return ["  ".join(cell.rjust(widths[n]) if n in right else cell.ljust(widths[n])
                      for n, cell in enumerate(row)).rstrip() for row in cells]


EXIT_PENDING = 3


class _ClientOptions(tap.BrokerListOptions):
    """What every command that talks to a broker takes."""

    optParameters: list[Any] = [
        ["timeout", "t", DEFAULT_TIMEOUT, "Seconds to wait for each attempt.", tap.seconds_option("timeout")],
        ["retries", "r", DEFAULT_RETRIES, "Attempts in all before giving up.",
         tap.whole_option("retries", 1)],
    ]


class _RequestOptions(_ClientOptions):
    """A service and its request frames, as arguments."""

    def parseArgs(self, *args: str) -> None:
        if not args:
            raise usage.UsageError(f"give a SERVICE and at least one FRAME, e.g. "
                                   f"'{self.commandName()} echo hello'")
        service, *frames = args
        with tap.usage_errors(errors=(TypeError, ValueError)):
            self["service"] = api_service_name(service)
        if not frames and not self["service"].startswith(b"mmi."):
            raise usage.UsageError("give at least one request frame (only mmi.* queries may have none)")
        self["frames"] = [os.fsencode(f) for f in frames]


_BROKERS = "[--broker ENDPOINT [--broker ENDPOINT...]] [--timeout S] [--retries N]"


class CallOptions(_RequestOptions):
    synopsis = f"{_BROKERS} [--side-by-side] [--dialect rfc|majortomo] SERVICE [FRAME...]"
    longdesc = ("Send one request through a broker; print each reply frame on its own line.  "
                "At least one FRAME, except for mmi.* queries.")
    optParameters: list[Any] = [["dialect", None, "rfc", "Wire dialect: rfc (RFC 18) or majortomo.",
                                 check_dialect]]
    optFlags = [["side-by-side", None, "The brokers run side by side (not a failover list): send to "
                 "the one with the fewest requests out, another on a failed attempt; stamped."]]


#: seconds between refreshes of ``mdp status --watch`` given no number
DEFAULT_WATCH = 2.0


class StatusOptions(_ClientOptions):
    synopsis = f"{_BROKERS} [--watch [SECONDS]]"
    longdesc = ("The broker's services (workers idle and busy, requests queued) and workers (service, "
                "state, seconds since last heard from), from mmi.services and mmi.workers.  Given "
                "several brokers (side by side, or a Binary Star pair), each broker's tables, then "
                "the services of all of them summed.")
    optParameters: list[Any] = [["watch", "w", None, "Refresh every SECONDS until Ctrl-C [default: once; "
                                 "2 with --watch alone]", tap.seconds_option("watch")]]
    opt_broker = opt_b = tap.repeated("broker", "Broker endpoint; once per broker (or commas): each is "
                                      "asked on its own [default: zmq:tcp://127.0.0.1:5555]")

    def parseOptions(self, options: Optional[Sequence[str]] = None) -> None:
        # usage.Options has no optional values: give --watch alone its default
        args = list(sys.argv[1:] if options is None else options)
        for n in reversed(range(len(args))):
            if args[n] in ("--watch", "-w"):
                try:
                    float(args[n + 1])
                except (IndexError, ValueError):
                    args.insert(n + 1, str(DEFAULT_WATCH))
        super().parseOptions(args)


class FreelanceCallOptions(tap.VersionedOptions):
    synopsis = ("[--server ENDPOINT [--server ENDPOINT...]] [--model 1|2|3] [--timeout S] "
                "[--deadline S] FRAME [FRAME...]")
    longdesc = ("Send one request, its FRAMEs (no service name), to Freelance servers (twist "
                "mdp-freelance-server) with no broker; print each reply frame on its own line.")
    optParameters: list[Any] = [
        ["model", "m", 3, "The Guide's client model: 1 (one server after another), 2 (all at once) or "
         "3 (an agent: heartbeats, the first live server).", int],
        ["timeout", "t", None, "Seconds one attempt may take [default: the model's: 1 s; 3 s for "
         "model 2]", tap.seconds_option("timeout")],
        ["deadline", "d", None, "Seconds the whole request may take [default: the model's: 30 s for "
         "model 1, 3 s for model 3]", tap.seconds_option("deadline")],
    ] + tap.CURVE_CLIENT_OPTIONS

    repeatable = ("server",)
    opt_server = opt_s = tap.repeated("server", "Freelance server endpoint; once per server (or commas) "
                                      "[default: zmq:tcp://127.0.0.1:5556]")

    def parseArgs(self, *frames: str) -> None:
        if not frames:
            raise usage.UsageError(f"give at least one request FRAME, e.g. '{self.commandName()} hello'")
        self["frames"] = [os.fsencode(f) for f in frames]

    def postOptions(self) -> None:
        self["servers"] = tap.connect_endpoints(self["server"], "server", tap.DEFAULT_FREELANCE_ENDPOINT)
        if self["model"] not in (1, 2, 3):
            raise usage.UsageError(f"--model is 1, 2 or 3, not {self['model']}")
        tap.checked_curve_client(self, self["servers"])


class DemoOptions(tap.VersionedOptions):
    synopsis = "[--endpoint ENDPOINT] [--requests N]"
    optParameters: list[Any] = [
        ["endpoint", "e", "zmq:tcp://127.0.0.1:*", "Where the demo broker binds (default: a free port)."],
        ["requests", "n", 3, "Requests to send.", int],
    ]

    def postOptions(self) -> None:
        tap.checked_endpoints(self["endpoint"], transport.LISTEN, "endpoint")


class TitanicSubmitOptions(_RequestOptions):
    synopsis = f"{_BROKERS} [--stamp] SERVICE FRAME [FRAME...]"
    optFlags = [["stamp", None, "Stamp the request (the same stamp on every attempt): a submit "
                 "stored again after a lost acknowledgement is answered from the workers' reply store."]]


def _single_argument(args: Sequence[str], name: str, missing: str, beyond: str = "") -> str:
    """The one argument of *args*; a usage error (*missing*, or one too many)."""
    if not args:
        raise usage.UsageError(missing)
    if len(args) > 1:
        raise usage.UsageError(f"one {name} only; {args[1]!r} is one argument too many{beyond}")
    return args[0]


class TitanicCloseOptions(_ClientOptions):
    synopsis = f"{_BROKERS} ID"

    def parseArgs(self, *args: str) -> None:
        value = _single_argument(args, "request ID", "give the request ID that 'mdp titanic submit' "
                                 f"printed, e.g. '{self.commandName()} 0b9a3c4e-5d6f-4a1b-8c2d-3e4f5a6b7c8d'")
        try:
            self["id"] = str(uuid.UUID(value))
        except ValueError:
            raise usage.UsageError(f"{value!r} is not a request id (a UUID)") from None


class TitanicResultOptions(TitanicCloseOptions):
    synopsis = f"{_BROKERS} [--wait] [--poll SECONDS] ID"
    longdesc = ("Print the reply frames of a stored request, one per line.  Exit status: 0 with the "
                "reply; 3 while the request is pending (without --wait); 1 for an unknown, closed or "
                "purged ID, an error reply, or Titanic not answering; 2 for a usage mistake.")
    optFlags = [["wait", "w", "Poll until the reply is there (instead of exit status 3)."]]
    optParameters: list[Any] = [["poll", "p", 1.0, "Seconds between polls with --wait.",
                                 tap.seconds_option("poll")]]


class TitanicOptions(tap.VersionedOptions):
    synopsis = "submit|result|close [options]"
    subCommands = [
        ["submit", None, TitanicSubmitOptions, "Store a request; print its id."],
        ["result", None, TitanicResultOptions, "Print a stored request's reply."],
        ["close", None, TitanicCloseOptions, "Forget a request and its reply."],
    ]


class SPRequestOptions(tap.VersionedOptions):
    synopsis = "[--endpoint URL] [--timeout S] [--resend S] PAYLOAD"
    optParameters: list[Any] = [
        ["endpoint", "e", "tcp://127.0.0.1:5555", "SP REP (or device) to ask: nng URL or endpoint."],
        ["timeout", "t", 10.0, "Seconds to wait for the reply in all.", tap.seconds_option("timeout")],
        ["resend", None, 60.0, "Seconds before the request is sent again.", tap.seconds_option("resend")],
    ]

    def parseArgs(self, *args: str) -> None:
        missing = f"give the PAYLOAD to send, e.g. '{self.commandName()} hello'"
        self["payload"] = os.fsencode(_single_argument(args, "PAYLOAD", missing,
                                                       ": quote a payload with spaces"))

    def postOptions(self) -> None:
        tap.checked_sp_endpoint(self["endpoint"], False, "endpoint")


class ChatOptions(tap.VersionedOptions):
    synopsis = ("--name NAME [--group GROUP] [--interface IF] [--port PORT] [--endpoint ENDPOINT] "
                "[--peer ENDPOINT]...")
    longdesc = ("A terminal chat on a Harmony (ZRE) node.  Lines you type go to the group; '/w NAME "
                "TEXT' whispers to one peer, '/peers' lists them.  Ctrl-D or Ctrl-C leaves.")
    optParameters: list[Any] = [
        ["name", "n", None, "Your name, as the others see it."],
        ["group", "g", "CHAT", "The group to talk in."],
        ["interface", "i", None, "Network interface (name or address) for beacons [default: the "
         "first that is not loopback]."],
        ["port", "p", 5670, "UDP port of the beacons.", int],
        ["endpoint", "e", None, "Where to bind [default: zmq:tcp://ADDRESS:* on the beacons' interface]."],
    ]

    repeatable = ("peer",)
    opt_peer = tap.repeated("peer", "A peer's endpoint (tcp://HOST:PORT), once per peer; no beacons then")

    def postOptions(self) -> None:
        from mdp.harmony import BeaconDiscovery, EndpointDiscovery
        from mdp.harmony.codec import check_string

        if not self["name"]:
            raise usage.UsageError("--name is required")
        with tap.usage_errors():
            check_string(self["name"], "name")
            check_string(self["group"], "group")
        for endpoint in self["peer"]:
            _check_peer(endpoint)
        tap.checked_endpoints(self["endpoint"], transport.LISTEN, "endpoint")  # None: chosen later
        with tap.usage_errors(errors=(MDPError,)):
            if self["peer"]:
                from mdp.transport.datagram import pick_interface

                host = str(pick_interface(self["interface"]).ip) if self["interface"] else "127.0.0.1"
                self["discovery"] = EndpointDiscovery(self["peer"], host=host)
            else:
                beacon = f"udp:{self['port']}"
                if self["interface"]:
                    beacon += ":interface=" + self["interface"].replace(":", "\\:")
                self["discovery"] = BeaconDiscovery(beacon)


_PEER_FORM = "--peer takes a peer's ZRE endpoint, tcp://HOST:PORT"


def _check_peer(endpoint: str) -> None:
    """A usage error unless ``--peer`` takes *endpoint*, saying what was meant."""
    from mdp.harmony.node import transport_endpoint

    if not endpoint.strip():
        raise usage.UsageError(f"--peer is empty; {_PEER_FORM}, e.g. tcp://127.0.0.1:7002")
    if bare_address(endpoint) is not None:
        raise usage.UsageError(f"--peer: bad peer endpoint {endpoint!r}: {_PEER_FORM}; "
                               f"did you mean tcp://{endpoint}?")
    converted = transport_endpoint(endpoint)
    try:
        transport.check(converted)
    except MDPError as e:
        if converted.partition(":")[0] in {scheme.name for scheme in schemes()}:
            raise usage.UsageError(f"--peer: {str(e).replace(repr(converted), repr(endpoint))}") from None
        raise usage.UsageError(f"--peer: bad peer endpoint {endpoint!r}: {_PEER_FORM} "
                               "(e.g. tcp://192.168.1.7:49152)") from None


class KeygenOptions(tap.VersionedOptions):
    synopsis = "[--dir DIRECTORY] NAME"
    longdesc = ("Write a new CURVE key pair in ZeroMQ's certificate format: NAME.key (public, for "
                "allow-lists and --curve-server-public) and NAME.key_secret (for --curve-secret).")
    optParameters: list[Any] = [["dir", "d", ".", "Directory to write the two files in."]]

    def parseArgs(self, *args: str) -> None:
        self["name"] = _single_argument(args, "NAME", "give a NAME for the key files, e.g. "
                                        f"'{self.commandName()} broker', which writes broker.key and "
                                        "broker.key_secret")


class Options(tap.VersionedOptions):
    programName = "mdp"
    synopsis = "call|status|freelance-call|titanic|sp-request|chat|demo|keygen [options]"
    subCommands = [
        ["call", None, CallOptions, "Send one request through a broker."],
        ["status", None, StatusOptions, "A broker's services and workers (MMI)."],
        ["freelance-call", None, FreelanceCallOptions, "Send one request to Freelance servers (no broker)."],
        ["titanic", None, TitanicOptions, "Disconnected requests through Titanic."],
        ["sp-request", None, SPRequestOptions, "Send one SP (nng) request; print the reply."],
        ["chat", None, ChatOptions, "A terminal chat with Harmony (ZRE) peers."],
        ["demo", None, DemoOptions, "Broker + echo worker + client, in one process."],
        ["keygen", None, KeygenOptions, "Write a CURVE key pair (NAME.key, NAME.key_secret)."],
    ]


def keygen(options: KeygenOptions) -> None:
    try:
        public, secret = curve.keygen(options["name"], options["dir"])
    except ValueError as e:
        error(f"mdp keygen: {e}")
        raise SystemExit(1) from None
    emit(f"public key: {public}", f"secret key: {secret}")


#: seconds to wait for ``mmi.binarystar``, which a broker may not answer
BSTAR_PROBE = 1.0
#: characters of a reply an error message shows at most
EXCERPT = 200
#: what reading a reply of the wrong shape raises (RecursionError: deep JSON)
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)
_CLEAR = "\x1b[H\x1b[2J"


def status_lines(services: list[bytes], workers: list[bytes]) -> list[str]:
    """The two tables of ``mdp status``; a ValueError if a reply is not the expected JSON."""
    return (_table(services, "mmi.services", ["SERVICE", "WORKERS", "IDLE", "BUSY", "QUEUED"],
                   (1, 2, 3, 4), _service_rows)
            + [""] + _table(workers, "mmi.workers", ["WORKER", "SERVICE", "STATE", "DIALECT", "SILENCE (s)"],
                            (4,), _worker_rows))


def _table(reply: list[bytes], query: str, headings: list[str], right: tuple[int, ...],
           rows: Callable[[Any], list[tuple[Any, ...]]]) -> list[str]:
    """The table of an MMI listing, with a note when the broker cut it short."""
    what = query.partition(".")[2]
    try:
        listed = json.loads(reply[0])
        lines = table(headings, rows(listed), right) if listed else [f"no {what}"]
        extra = json.loads(reply[1]) if len(reply) > 1 else {}
        if extra.get("truncated"):
            lines.append(f"(the first {len(listed)} of {extra['total']} {what})")
    except _MALFORMED:
        text, size = repr(reply), sum(len(frame) for frame in reply)
        if len(text) > EXCERPT:
            text = f"{text[:EXCERPT]}... ({size} bytes in {len(reply)} frame{'s' * (len(reply) != 1)})"
        raise ValueError(f"{query} answered {text}") from None
    return lines


def _service_rows(listed: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(name, entry["workers"], entry["idle"], entry["workers"] - entry["idle"],
             entry["queued"]) for name, entry in sorted(listed.items())]


def _worker_rows(listed: list[Any]) -> list[tuple[Any, ...]]:
    # a broker with an access policy leaves the peer ids out
    return [(w.get("id", "-"), w["service"], "busy" if w["busy"] else "idle", w["dialect"],
             f"{w['silence']:.1f}") for w in sorted(listed, key=lambda w: (w["service"], w.get("id", "")))]


async def status(reactor: Any, options: Any) -> None:
    """Print the tables once, or every ``--watch`` seconds until Ctrl-C."""
    clients = _status_clients(reactor, options)
    watch = options["watch"]
    try:
        while True:
            report = await _reports(clients, options)
            if watch is None:
                _report_once(report)
                return
            if report is not None:  # on a cleared screen, or after a blank line
                lines = report[0]
                shown = [_CLEAR + lines[0], *lines[1:]] if sys.stdout.isatty() else [*lines, ""]
                if not emit(*shown):
                    return
            await task.deferLater(reactor, watch)
    finally:
        for client in clients:
            await client.close()


def _report_once(report: Optional[tuple[list[str], bool]]) -> None:
    """Print a report; exit status 1 if there is none, or it is not whole (a broker of several
    did not answer or was not understood, or none serves)."""
    if report is None:
        raise SystemExit(1)
    lines, whole = report
    if emit(*lines) and not whole:
        raise SystemExit(1)


#: what a report of several brokers says of one that did not answer
NO_ANSWER = "no answer"
#: ... and of one whose MMI answers it could not read (stderr shows them)
UNREADABLE = "does not describe its services"


def _status_clients(reactor: Any, options: Any) -> list[Client]:
    """A client of each broker (CURVE keys for those on zmq:); MMI only, so without the
    extensions."""
    curve = tap.curve_client_of(options)
    return [Client([endpoint], reactor, timeout=options["timeout"], retries=options["retries"],
                   extensions=False, **(curve if endpoint.startswith("zmq:") else {}))
            for endpoint in options["brokers"]]


async def _reports(clients: list[Any], options: Any) -> Optional[tuple[list[str], bool]]:
    """The broker's report; of several, each broker's and then the services of those that
    serve, summed; and whether it is whole.  None if no broker answered (stderr says why)."""
    if len(clients) == 1:
        report = await _report(clients[0], options)
        return None if report is None else (report[0], True)
    lines: list[str] = []
    listings: list[dict[str, Any]] = []
    answered = 0
    reports = await defer.gatherResults(
        [defer.ensureDeferred(_report(client, options)) for client in clients], consumeErrors=True)
    for client, report in zip(clients, reports):
        if report is None:  # (stderr said why)
            lines += [f"broker {client.endpoint}: {NO_ANSWER}", ""]
            continue
        shown, listing = report
        answered += shown != [f"broker {client.endpoint}: {UNREADABLE}"]
        lines += [*shown, ""]
        if listing is not None:  # (None: a Binary Star broker that serves nothing)
            listings.append(listing)
    if not answered:
        return None
    heard = f"all {len(clients)} brokers" if answered == len(clients) else \
        f"the {answered} of {len(clients)} brokers that answered"
    if not listings:
        return [*lines, heard, "", "none of them serves requests"], False
    return [*lines, heard, "", *_summed(listings)], answered == len(clients)


def _summed(listings: list[dict[str, Any]]) -> list[str]:
    """The services table of several brokers' ``mmi.services`` listings, added up."""
    total: dict[str, Counter[str]] = {}
    for listing in listings:
        for name, entry in listing.items():
            total.setdefault(name, Counter()).update({k: entry[k] for k in ("workers", "idle", "queued")})
    rows = [(name, c["workers"], c["idle"], c["workers"] - c["idle"], c["queued"])
            for name, c in sorted(total.items())]
    return table(["SERVICE", "WORKERS", "IDLE", "BUSY", "QUEUED"], rows, (1, 2, 3, 4)) if rows \
        else ["no services"]


async def _report(client: Any, options: Any) -> Optional[tuple[list[str], Optional[dict[str, Any]]]]:
    """The lines of one broker's report, with its ``mmi.services`` listing (None from a Binary Star
    broker that serves nothing, one of several); None once stderr says why there are none."""
    idle = await _not_serving(client, min(options["timeout"], BSTAR_PROBE))
    if idle is not None:  # no tables would come
        if len(options["brokers"]) > 1:
            return [idle], None
        error(f"mdp status: {idle}")
        return None
    try:
        services = await client.request("mmi.services")
        workers = await client.request("mmi.workers")
    except (RequestTimeout, errors.BrokerUnreachable) as e:  # they name the broker
        error(f"mdp status: {e}")
        return None
    except MDPError as e:
        error(f"mdp status: broker {client.endpoint}: {e}")
        return None
    try:
        tables = status_lines(services, workers)
        listing = json.loads(services[0])
        if not isinstance(listing, dict):  # (an empty list reads as "no services")
            raise ValueError(f"mmi.services answered {services[0][:EXCERPT]!r}, not an object")
    except ValueError as e:
        error(f"mdp status: broker {client.endpoint} {UNREADABLE} ({e})")
        if len(options["brokers"]) == 1:
            raise SystemExit(1) from None
        return [f"broker {client.endpoint}: {UNREADABLE}"], None
    return [f"broker {client.endpoint}", ""] + tables, listing


async def _not_serving(client: Any, timeout: float) -> Optional[str]:
    """Why a Binary Star broker serves nothing (passive, or a backup yet to hear its primary), else
    None; ``mmi.binarystar``, unlike ``mmi.services``, is answered in any state and no failover vote."""
    try:
        reply = await client.request("mmi.binarystar", timeout=timeout, retries=1)
        state = json.loads(reply[0])
        if not isinstance(state, dict) or state.get("serving") is not False:
            return None
    except (MDPError, *_MALFORMED):  # not in a pair (501), no answer, not JSON
        return None
    pair = f"broker {client.endpoint} is the {{}} of a Binary Star pair"
    if state.get("state") == "backup":
        return (pair.format("backup") + " and has not heard its primary yet: it serves nothing until then; "
                "ask the primary (and check that this broker's --bstar-remote is the primary's "
                "--bstar-local)")
    if state.get("state") != "passive":
        return None
    passive = pair.format("passive broker") + ": it answers no requests"
    peer, silence, failover = state.get("peer"), state.get("peerSilence"), state.get("failoverTimeout")
    if all(isinstance(n, (int, float)) for n in (silence, failover)) and silence > failover:
        return (f"{passive}, and its peer has been silent for {silence:g} s: the next client request "
                "here makes it take over")
    if peer == "active":
        return f"{passive} while its peer (active) serves them; ask the other broker of the pair"
    return f"{passive} (its peer is {peer or 'not heard yet'}); ask the other broker of the pair"


async def call(reactor: Any, options: CallOptions) -> None:
    kind = SpreadClient if options["side-by-side"] else Client
    # (one request: asking for the extensions would come after it)
    client = kind(options["brokers"], reactor, timeout=options["timeout"], retries=options["retries"],
                  dialect=options["dialect"], extensions=False, **tap.curve_client_of(options))

    def partial(frames: list[bytes]) -> None:
        if not emit(*map(show, frames)) and request is not None:
            request.cancel()  # nobody reads the rest

    request: Optional[defer.Deferred[list[bytes]]] = None
    try:
        request = client.request(options["service"], *options["frames"], onPartial=partial)
        reply = await request
    except defer.CancelledError:
        return
    finally:
        await client.close()
    emit(*map(show, reply))


async def freelance_call(reactor: Any, options: FreelanceCallOptions) -> None:
    from mdp.freelance import freelance_client

    timing = {name: options[name] for name in ("timeout", "deadline") if options[name] is not None}
    client = freelance_client(options["servers"], options["model"], reactor, **timing,
                              **tap.curve_client_of(options))
    started = reactor.seconds()
    try:
        reply = await client.request(*options["frames"])
    except MDPError as e:  # said by _main, in words true of the model
        raise MDPError(_freelance_failure(e, options, reactor.seconds() - started)) from None
    finally:
        await client.close()
    emit(*map(show, reply))


def _freelance_failure(failure: MDPError, options: FreelanceCallOptions, elapsed: float) -> str:
    """Why ``mdp freelance-call`` got no reply, in words true of the model used."""
    servers = options["servers"]
    named = ", ".join(servers)
    these = (f"the Freelance server at {named}" if len(servers) == 1
             else f"any of the {len(servers)} Freelance servers ({named})")
    running = "; is twist mdp-freelance-server running there?"
    if isinstance(failure, NoServerAvailable) or (isinstance(failure, RequestTimeout)
                                                  and failure.attempts == 0):
        # model 3: the agent sends only to a server that answered its PING
        seconds = failure.elapsed if isinstance(failure, RequestTimeout) else elapsed
        nobody = "it did not answer a PING" if len(servers) == 1 else "none answered a PING"
        return f"no reply from {these} within {seconds:.1f} s: {nobody}" + running
    if isinstance(failure, RequestTimeout):
        how = _how_tried(options["model"], servers, failure.attempts)
        return f"no reply from {these} within {failure.elapsed:.1f} s{how}" + running
    return f"{failure} (server{'s' * (len(servers) != 1)}: {named})"


def _how_tried(model: int, servers: list[str], attempts: int) -> str:
    """How a Freelance client of *model* tried *servers* in *attempts*."""
    if model == 3:
        return f" (the request sent {attempts} time{'s' * (attempts != 1)} to servers that answered a PING)"
    if len(servers) == 1:
        return ""
    if model == 2:
        return " (all asked at once)"
    tried = servers[:attempts]
    if len(tried) < len(servers):
        return f" (tried {len(tried)} of {len(servers)}, one after another: {', '.join(tried)})"
    return " (each tried in turn)"


async def sp_request(reactor: Any, options: SPRequestOptions) -> None:
    from mdp.sp.peers import SPClient

    client = SPClient(options["endpoint"], reactor, resend=options["resend"])
    try:
        reply = await client.request(options["payload"]).addTimeout(options["timeout"], reactor)
    except defer.TimeoutError:
        raise MDPError(f"no reply from {options['endpoint']} within {options['timeout']:g} s") from None
    finally:
        await client.close()
    emit(show(reply))


async def titanic(reactor: Any, options: TitanicOptions) -> None:
    command, sub = options.subCommand, options.subOptions
    client = TitanicClient(sub["brokers"], reactor, timeout=sub["timeout"], retries=sub["retries"],
                           stamp=bool(sub.get("stamp")), **tap.curve_client_of(sub))
    try:
        if command == "submit":
            emit(await client.submit(sub["service"], *sub["frames"]))
        elif command == "close":
            await client.close(sub["id"])
        else:
            reply = await (_wait_for_reply(reactor, client, sub) if sub["wait"] else client.poll(sub["id"]))
            if reply is None:
                error(f"mdp titanic result: request {sub['id']} is pending (no reply yet); "
                      "ask again later, or wait for it with --wait")
                raise SystemExit(EXIT_PENDING)
            emit(*map(show, reply))
    except MDPError as e:
        hint = (await _missing_titanic(client, command, min(2.0, sub["timeout"]))
                if isinstance(e, RequestTimeout) else "")
        error(f"mdp titanic {command}: {e}{hint}")
        raise SystemExit(1) from None
    finally:
        await client.disconnect()


async def _wait_for_reply(reactor: Any, client: Any, options: TitanicResultOptions) -> list[bytes]:
    """Poll Titanic until the reply is there (``--wait``), saying on stderr what it waits for: each
    reason once while it holds; a poll slower than --timeout once, not as a new reason."""
    brokers, every = options["brokers"], options["poll"]
    where = f"the broker{'s' * (len(brokers) > 1)} at {', '.join(brokers)}"
    said = {"reason": "", "slow": False}

    def note(why: str) -> None:
        error(f"mdp titanic result: waiting for request {options['id']}: {why}")

    def say(reason: str, why: str) -> None:
        if said["reason"] != reason:
            said.update(reason=reason, slow=said["slow"] and reason == "pending")
            note(why)

    def slowPoll() -> None:
        if said["reason"] in ("", "pending") and not said["slow"]:
            said["slow"] = True
            note(f"no answer yet from Titanic through {where}, still trying")

    while True:
        slow = reactor.callLater(options["timeout"], slowPoll)
        try:
            reply = await client.poll(options["id"])
        except ServiceUnavailable as e:
            say("unavailable", f"Titanic is not answering ({e}); is twist mdp-titanic running? "
                               f"Still trying, every {every:g} s")
        except ServiceOverloaded as e:
            say("overloaded", f"Titanic is too busy to answer ({e}); still trying")
        except RequestTimeout:
            say("silent", f"no reply from {where} yet, still trying")
        except TRANSIENT as e:
            say("transport", f"{e}; still trying")
        else:
            if reply is not None:
                return reply
            say("pending", f"it is pending (no reply yet); asking every {every:g} s")
        finally:
            if slow.active():
                slow.cancel()
        await task.deferLater(reactor, every)


async def _missing_titanic(client: Any, command: str, timeout: float) -> str:
    """Why a Titanic request timed out, if MMI shows no Titanic worker; else ""."""
    service = {"submit": "titanic.request", "result": "titanic.reply"}.get(command, "titanic.close")
    try:
        listing = await client.client.request("mmi.workers", service, timeout=timeout, retries=1)
    except MDPError:
        return ""
    if mmi.workers_listed(listing) != 0:
        return ""
    return f"; the broker answers, but no Titanic serves {service} there (start one: twist mdp-titanic)"


async def demo(reactor: Any, options: DemoOptions) -> None:
    broker = Broker(reactor)
    try:
        bound = await broker.listen(options["endpoint"])
    except MDPError:  # cannot bind (the port is taken, ...)
        await broker.close()
        raise
    worker = Worker(bound.endpoint, "echo", echo, reactor)
    client = Client(bound.endpoint, reactor)
    try:
        if not emit(f"broker listening on {bound.endpoint}"):
            return
        worker.start()
        if not emit("echo worker started"):
            return
        for n in range(options["requests"]):
            reply = await client.request("echo", f"hello {n}")
            if not emit(f"echo replied: {' | '.join(show(f) for f in reply)}"):
                return
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
    emit("demo done")


async def chat(reactor: Any, options: ChatOptions) -> None:
    from twisted.internet import stdio
    from twisted.protocols.basic import LineReceiver

    from mdp.harmony import Event, Node

    group = options["group"]
    node = Node(options["name"], reactor, discovery=options["discovery"], endpoint=options["endpoint"])
    done: defer.Deferred[None] = defer.Deferred()

    def say(line: str) -> None:
        if not emit(printable(line)) and not done.called:
            done.callback(None)  # nobody reads: leave

    def heard(event: Event) -> None:
        if event.kind == "ENTER":
            say(f"* {event.name} is here ({event.endpoint})")
        elif event.kind == "EXIT":
            say(f"* {event.name} left")
        elif event.kind == "SHOUT" and event.group == group:
            say(f"{event.name}: {' '.join(show(f) for f in event.frames)}")
        elif event.kind == "WHISPER":
            say(f"{event.name} (to you): {' '.join(show(f) for f in event.frames)}")

    class Typed(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            text = line.decode("utf-8", "replace").rstrip("\r")
            if text == "/peers":
                names = sorted(node.peerName(p) for p in node.peers())
                say(f"* peers: {', '.join(names) or 'none yet'}")
            elif text.startswith("/w "):
                _, name, message = (text.split(" ", 2) + [""])[:3]
                found = [p for p in node.peers() if node.peerName(p) == name]
                if not found:
                    say(f"* no peer called {name!r}")
                for peer in found:
                    node.whisper(peer, message.encode())
            elif text:
                node.shout(group, text.encode())

        def connectionLost(self, reason: object) -> None:
            if not done.called:
                done.callback(None)

    node.subscribe(heard)
    node.join(group)
    await node.start()
    say(f"* {options['name']} in {group} at {node.endpoint}; Ctrl-D leaves")
    trigger = reactor.addSystemEventTrigger("before", "shutdown", node.stop)
    stdio.StandardIO(Typed(), reactor=reactor)
    await done
    with contextlib.suppress(ValueError):  # Ctrl-C: the shutdown ran it already (and ended the input)
        reactor.removeSystemEventTrigger(trigger)
    await node.stop()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``mdp`` console script."""
    catch_interrupt(interrupted)  # until the command starts
    Output.gone = False
    try:
        try:
            _main(argv)
        finally:
            if sys.stdout is not None and not Output.gone:
                sys.stdout.flush()  # where a broken pipe shows at the latest
    except KeyboardInterrupt:  # before the handler above was in place
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        divert_output()
    except SystemExit as e:
        if e.code == EXIT_INTERRUPTED or not Output.gone:
            raise
    if Output.gone:
        raise SystemExit(EXIT_BROKEN_PIPE)


def _main(argv: Optional[Sequence[str]]) -> None:
    """Read the options and run the command they name in the reactor."""
    if sys.stdout is None:  # started with it closed (>&-): nowhere to print a reply
        error("mdp: standard output is closed; nothing was sent")
        raise SystemExit(2)
    options = Options()
    try:
        options.parseOptions(list(sys.argv[1:] if argv is None else argv))
    except usage.UsageError as e:
        error(tap.usage_line(e.parser, e))  # type: ignore[attr-defined]
        raise SystemExit(tap.EXIT_USAGE) from None
    if options.subCommand == "keygen":  # no reactor: two files and done
        keygen(options.subOptions)
        return
    command = {"call": call, "status": status, "freelance-call": freelance_call, "titanic": titanic,
               "sp-request": sp_request, "chat": chat, "demo": demo}[options.subCommand]
    signals: list[int] = []

    async def run(reactor: Any) -> None:
        def stop() -> None:
            with contextlib.suppress(ReactorNotRunning):  # a second Ctrl-C, or the command ended
                reactor.stop()

        def onInterrupt(number: int, frame: Any) -> None:
            signals.append(number)
            reactor.callFromThread(stop)

        # from now on, as the command's first steps run before the reactor does
        catch_interrupt(onInterrupt)
        try:
            await command(reactor, options.subOptions)
        except MDPError as e:  # a failure the command does not explain further
            error(f"mdp {options.subCommand}: {e}")
            raise SystemExit(1) from None
        except BrokenPipeError:  # written to outside emit
            divert_output()

    try:
        uvreactor.react(run)
    except SystemExit:
        if signals:
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise


if __name__ == "__main__":
    main()
