"""Multi-frame messages over any Twisted stream endpoint (tcp, tls, unix): the
public names of the modules that make it, and the registry's schemes."""

from __future__ import annotations

from typing import Any, Callable, Optional

from mdp.interfaces import IDealerReceiver
from mdp.policy import RECONNECT, Limits
from mdp.transport.channels import StreamChannels
from mdp.transport.dealer import PROVEN_AFTER, StreamDealer
from mdp.transport.endpoints import (
    DESCRIPTOR_RESERVE,
    SELECT_LIMIT,
    STREAM_SCHEMES,
    UNIX_PATH_MAX,
    check_endpoint,
    connect_description,
    descriptor_budget,
    raise_descriptor_limit,
    server_description,
    server_endpoint,
    subject,
)
from mdp.transport.framed import FLUSH_BYTES, FramedProtocol
from mdp.transport.registry import Scheme
from mdp.transport.router import MAX_UNACKNOWLEDGED, StreamRouter
from mdp.transport.tls import CA_CERTS, LISTEN_BACKLOG

__all__ = [
    "CA_CERTS", "DESCRIPTOR_RESERVE", "FLUSH_BYTES", "LISTEN_BACKLOG", "MAX_UNACKNOWLEDGED",
    "PROVEN_AFTER", "RECONNECT", "SELECT_LIMIT", "STREAM_SCHEMES", "UNIX_PATH_MAX",
    "FramedProtocol", "StreamChannels", "StreamDealer", "StreamRouter", "check_endpoint",
    "connect_description", "descriptor_budget", "raise_descriptor_limit", "scheme",
    "server_description", "server_endpoint", "subject",
]


def _connect(endpoint: str, receiver: IDealerReceiver, reactor: Any, limits: Limits,
             retryPolicy: Optional[Callable[[int], float]], identity: Optional[bytes]) -> Any:
    return StreamDealer(endpoint, receiver, reactor, retryPolicy=retryPolicy, limits=limits,
                        identity=identity)


def scheme(name: str) -> Scheme:
    """The registry entry for the Twisted stream endpoint type *name*."""
    return Scheme(name, check_endpoint, StreamRouter.listen if name != "tls" else None,
                  _connect if name != "tcp6" else None,
                  f"length-prefixed records over Twisted's {name}: endpoints", identities=True,
                  channels=StreamChannels if name != "tcp6" else None)
