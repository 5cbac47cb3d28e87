"""txmajordomo: reliable service-oriented request-reply for Twisted.

The public API::

    from mdp import Broker, Worker, Client, BrokerService, WorkerService
"""

from mdp.app.service import BrokerService, WorkerService
from mdp.binarystar import BinaryStar
from mdp.errors import (
    BrokerUnreachable,
    ClientClosed,
    MDPError,
    MessageTooLarge,
    NoServerAvailable,
    ProtocolError,
    RemoteError,
    ReplyTooLarge,
    RequestTimeout,
    RequestTooLarge,
    ServiceOverloaded,
    ServiceUnavailable,
    StreamRestarted,
    TransportError,
    WorkerError,
)
from mdp.majordomo.broker import Broker
from mdp.majordomo.client import Client, ReplyStream
from mdp.majordomo.idempotence import MemoryReplyStore
from mdp.majordomo.worker import Final, Worker
from mdp.policy import Backoff, HeartbeatPolicy, Limits

__version__ = "0.1.0"

__all__ = [
    "Backoff",
    "BinaryStar",
    "Broker",
    "BrokerService",
    "BrokerUnreachable",
    "Client",
    "ClientClosed",
    "Final",
    "HeartbeatPolicy",
    "Limits",
    "MDPError",
    "MemoryReplyStore",
    "MessageTooLarge",
    "NoServerAvailable",
    "ProtocolError",
    "RemoteError",
    "ReplyStream",
    "ReplyTooLarge",
    "RequestTimeout",
    "RequestTooLarge",
    "ServiceOverloaded",
    "ServiceUnavailable",
    "StreamRestarted",
    "TransportError",
    "Worker",
    "WorkerError",
    "WorkerService",
]
