"""txmajordomo: reliable service-oriented request-reply for Twisted.  Names are imported
when first used (PEP 562), so ``import mdp.x`` costs only what ``mdp.x`` needs."""

from __future__ import annotations

import importlib

from mdp import _compiled

_compiled.install()  # before any module it lists is imported

TYPE_CHECKING = False  # not typing's, which is slow to import
if TYPE_CHECKING:
    from typing import Any

    from mdp.app.service import BrokerService, WorkerService
    from mdp.binarystar import BinaryStar
    from mdp.errors import (
        BrokerUnreachable,
        ClientClosed,
        DeadlineExceeded,
        MDPError,
        MessageTooLarge,
        NoServerAvailable,
        ProtocolError,
        RemoteError,
        ReplyTooLarge,
        RequestCancelled,
        RequestTimeout,
        RequestTooLarge,
        ServiceOverloaded,
        ServiceUnavailable,
        StreamRestarted,
        TransportError,
        WorkerError,
    )
    from mdp.handlers import cancelled, current_deadline
    from mdp.majordomo.broker import Broker
    from mdp.majordomo.client import Client, ReplyStream
    from mdp.majordomo.idempotence import MemoryReplyStore
    from mdp.majordomo.worker import Final, Worker
    from mdp.policy import Backoff, HeartbeatPolicy, Limits
    from mdp.uvreactor import react

__version__ = "0.1.0"

#: each public name's module
_HOMES = {name: home for home, names in {
    "mdp.app.service": ("BrokerService", "WorkerService"), "mdp.binarystar": ("BinaryStar",),
    "mdp.majordomo.broker": ("Broker",), "mdp.majordomo.client": ("Client", "ReplyStream"),
    "mdp.majordomo.idempotence": ("MemoryReplyStore",), "mdp.majordomo.worker": ("Final", "Worker"),
    "mdp.majordomo.spread": ("SpreadClient",),
    "mdp.policy": ("Backoff", "HeartbeatPolicy", "Limits"), "mdp.uvreactor": ("react",),
    "mdp.handlers": ("cancelled", "current_deadline"),
    "mdp.errors": ("BrokerUnreachable", "ClientClosed", "DeadlineExceeded", "MDPError", "MessageTooLarge",
                   "NoServerAvailable", "ProtocolError", "RemoteError", "ReplyTooLarge", "RequestCancelled",
                   "RequestTimeout", "RequestTooLarge", "ServiceOverloaded", "ServiceUnavailable",
                   "StreamRestarted", "TransportError", "WorkerError"),
}.items() for name in names}

__all__ = [
    "Backoff", "BinaryStar", "Broker", "BrokerService", "BrokerUnreachable", "Client", "ClientClosed",
    "DeadlineExceeded", "Final", "HeartbeatPolicy", "Limits", "MDPError", "MemoryReplyStore",
    "MessageTooLarge", "NoServerAvailable", "ProtocolError", "RemoteError", "ReplyStream", "ReplyTooLarge",
    "RequestCancelled", "RequestTimeout", "RequestTooLarge", "ServiceOverloaded", "ServiceUnavailable",
    "SpreadClient", "StreamRestarted", "TransportError", "Worker", "WorkerError", "WorkerService",
    "cancelled", "current_deadline", "react"]


#: submodules also loaded when first used as ``mdp.NAME``
_MODULES = ("app", "binarystar", "blocking", "errors", "freelance", "handlers", "handlerthreads",
            "harmony", "interfaces", "machine", "majordomo", "messages", "metrics", "policy",
            "session", "sp", "spark", "testing", "titanic", "tracing", "transport", "uvreactor")


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif name in _MODULES:
        value = importlib.import_module(f"mdp.{name}")
    else:
        raise AttributeError(f"module 'mdp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({"__version__", *__all__, *_MODULES})
