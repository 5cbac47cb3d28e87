"""Multi-frame messages over any Twisted stream endpoint (tcp, tls, unix): the
public names of the modules that make it, and the registry's schemes."""

from __future__ import annotations

from typing import Any, Callable, Optional

from mdp.interfaces import IDealerReceiver
from mdp.policy import Limits
from mdp.transport.channels import StreamChannels
from mdp.transport.dealer import StreamDealer
from mdp.transport.endpoints import check_endpoint, descriptor_budget
from mdp.transport.framed import FLUSH_BYTES, FramedProtocol
from mdp.transport.registry import Scheme
from mdp.transport.router import StreamRouter

__all__ = ["FLUSH_BYTES", "FramedProtocol", "StreamChannels", "StreamDealer", "StreamRouter",
           "descriptor_budget", "scheme"]


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
