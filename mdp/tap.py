"""Command-line options and service makers behind ``twist mdp-broker`` and
``twist mdp-worker`` (the plugin module in ``twisted/plugins`` only exposes
them)."""

from __future__ import annotations

from typing import Any

from twisted.application.service import IServiceMaker
from twisted.plugin import IPlugin
from twisted.python import usage
from zope.interface import implementer

from mdp import broker
from mdp.policy import Backoff, HeartbeatPolicy

DEFAULT_ENDPOINT = "zmq:tcp://127.0.0.1:5555"


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError(f"must be positive, got {value}")
    return number


_positive.coerceDoc = "A positive number of seconds."  # type: ignore[attr-defined]


def _dialect(value: str) -> str:
    from mdp.codec import check_dialect

    return check_dialect(value)


class _HeartbeatOptions(usage.Options):
    optParameters: list[Any] = [
        ["heartbeat", None, 2.5, "Heartbeat interval in seconds.", _positive],
        ["liveness", None, 3, "Missed heartbeats before a peer is dead.", int],
    ]

    def heartbeatPolicy(self) -> HeartbeatPolicy:
        try:
            return HeartbeatPolicy(self["heartbeat"], self["liveness"])
        except ValueError as e:
            raise usage.UsageError(str(e)) from e


class BrokerOptions(_HeartbeatOptions):
    """Options of ``twist mdp-broker``."""

    synopsis = "[--endpoint ENDPOINT] [--backend ENDPOINT] [--heartbeat SECONDS]"
    longdesc = (
        "Run an MDP/0.2 broker.  Endpoints: zmq:tcp://HOST:PORT (port * lets the "
        "OS choose), tcp:host=HOST:port=PORT (any Twisted endpoint), loopback:NAME."
    )
    optParameters: list[Any] = _HeartbeatOptions.optParameters + [
        ["endpoint", "e", DEFAULT_ENDPOINT,
         "Endpoint for clients (and workers, unless --backend is given)."],
        ["backend", "b", None, "Separate endpoint for workers."],
        ["request-expiry", None, broker.DEFAULT_REQUEST_EXPIRY,
         "Seconds a request waits for a service that has no worker.", _positive],
        ["service-linger", None, broker.DEFAULT_SERVICE_LINGER,
         "Seconds a service stays known (mmi.service 200) after its last worker left.",
         _positive],
        ["max-queue", None, broker.DEFAULT_MAX_QUEUE, "Most requests queued in all.", int],
        ["max-service-queue", None, broker.DEFAULT_MAX_SERVICE_QUEUE,
         "Most requests queued for one service.", int],
        ["max-workers", None, broker.DEFAULT_MAX_WORKERS, "Most registered workers.", int],
    ]


class WorkerOptions(_HeartbeatOptions):
    """Options of ``twist mdp-worker``."""

    synopsis = "--broker ENDPOINT --service NAME --handler echo|module:callable"
    optParameters: list[Any] = _HeartbeatOptions.optParameters + [
        ["broker", "b", DEFAULT_ENDPOINT,
         "Broker endpoint; repeat with commas for failover."],
        ["service", "s", None, "Service name to register."],
        ["handler", None, "echo", "'echo' or 'module:callable' taking the request frames."],
        ["backoff-max", None, 32.0, "Longest reconnect delay in seconds.", _positive],
        ["dialect", None, "rfc", "Wire dialect: rfc (RFC 18) or majortomo.", _dialect],
        ["reply-store", None, 0,
         "Remember the replies to this many stamped requests and answer their retries "
         "from memory (0: off).", int],
    ]

    def postOptions(self) -> None:
        if not self["service"]:
            raise usage.UsageError("--service is required")


@implementer(IServiceMaker, IPlugin)
class BrokerServiceMaker:
    tapname = "mdp-broker"
    description = "MDP/0.2 (Majordomo) broker."
    options = BrokerOptions

    def makeService(self, options: BrokerOptions) -> Any:
        from mdp.service import BrokerService

        return BrokerService(
            options["endpoint"],
            backend=options["backend"],
            heartbeat=options.heartbeatPolicy(),
            requestExpiry=options["request-expiry"],
            serviceLinger=options["service-linger"],
            maxQueue=options["max-queue"],
            maxServiceQueue=options["max-service-queue"],
            maxWorkers=options["max-workers"],
            exitOnFailure=True,
        )


@implementer(IServiceMaker, IPlugin)
class WorkerServiceMaker:
    tapname = "mdp-worker"
    description = "MDP/0.2 (Majordomo) worker running a handler."
    options = WorkerOptions

    def makeService(self, options: WorkerOptions) -> Any:
        from mdp.handlers import load_handler
        from mdp.idempotence import MemoryReplyStore
        from mdp.service import WorkerService

        return WorkerService(
            options["broker"].split(","),
            options["service"],
            load_handler(options["handler"]),
            heartbeat=options.heartbeatPolicy(),
            backoff=Backoff(maximum=options["backoff-max"]),
            dialect=options["dialect"],
            replies=MemoryReplyStore(options["reply-store"]) if options["reply-store"] else None,
        )


class FreelanceServerOptions(usage.Options):
    """Options of ``twist mdp-freelance-server``."""

    synopsis = "--endpoint ENDPOINT --handler echo|module:callable"
    optParameters: list[Any] = [
        ["endpoint", "e", "zmq:tcp://127.0.0.1:5556", "Where the server binds."],
        ["handler", None, "echo", "'echo' or 'module:callable' taking the request frames."],
    ]


@implementer(IServiceMaker, IPlugin)
class FreelanceServerServiceMaker:
    tapname = "mdp-freelance-server"
    description = "Freelance (brokerless) request-reply server, answering PING with PONG."
    options = FreelanceServerOptions

    def makeService(self, options: FreelanceServerOptions) -> Any:
        from mdp.handlers import load_handler
        from mdp.service import FreelanceServerService

        return FreelanceServerService(options["endpoint"], load_handler(options["handler"]))

