"""txmajordomo: reliable service-oriented request-reply for Twisted.

The public API::

    from mdp import Broker, Worker, Client, BrokerService, WorkerService
"""

from mdp.broker import Broker
from mdp.client import Client, ReplyStream
from mdp.errors import (
    ClientClosed,
    MDPError,
    MessageTooLarge,
    NoServerAvailable,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    ServiceOverloaded,
    ServiceUnavailable,
    StreamRestarted,
    TransportError,
    WorkerError,
)
from mdp.policy import Backoff, HeartbeatPolicy, Limits
from mdp.service import BrokerService, WorkerService
from mdp.worker import Final, Worker

__version__ = "0.1.0"

__all__ = [
    "Backoff",
    "Broker",
    "BrokerService",
    "Client",
    "ClientClosed",
    "Final",
    "HeartbeatPolicy",
    "Limits",
    "MDPError",
    "MessageTooLarge",
    "NoServerAvailable",
    "ProtocolError",
    "RemoteError",
    "ReplyStream",
    "RequestTimeout",
    "ServiceOverloaded",
    "ServiceUnavailable",
    "StreamRestarted",
    "TransportError",
    "Worker",
    "WorkerError",
    "WorkerService",
]
