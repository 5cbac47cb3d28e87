"""Choose a transport from an endpoint string.

==============================  ===============================================
``zmq:tcp://127.0.0.1:5555``    ZeroMQ ROUTER/DEALER (also ``ipc://``,
                                ``inproc://``; bind ``tcp://127.0.0.1:*`` for a
                                port picked by the OS)
``tcp:host=127.0.0.1:port=5555``  length-prefixed frames over any Twisted
                                endpoint string (``tcp``, ``ssl``, ``unix``, ...)
``loopback:NAME``               in memory, for deterministic tests
==============================  ===============================================
"""

from __future__ import annotations

from typing import Any, Optional

from twisted.internet import defer

from mdp.errors import TransportError
from mdp.interfaces import (
    IDealerReceiver,
    IDealerTransport,
    IPeerRouterReceiver,
    IPeerRouterTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.policy import Limits


def _reactor(reactor: Optional[Any]) -> Any:
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        return global_reactor
    return reactor


def scheme(endpoint: str) -> str:
    """``"zmq"``, ``"loopback"`` or ``"stream"`` for an endpoint string."""
    if not isinstance(endpoint, str) or ":" not in endpoint:
        raise TransportError(f"not an endpoint string: {endpoint!r}")
    prefix = endpoint.partition(":")[0]
    if prefix in ("zmq", "loopback"):
        return prefix
    return "stream"


def listen(
    endpoint: str, receiver: IRouterReceiver, reactor: Optional[Any] = None,
    limits: Limits = Limits(),
) -> defer.Deferred[IRouterTransport]:
    """Bind *endpoint*; the Deferred fires with an :class:`IRouterTransport`
    that enforces *limits* on what it receives and on what each peer leaves
    unread."""
    kind = scheme(endpoint)
    reactor = _reactor(reactor)
    try:
        if kind == "loopback":
            from mdp.transport.loopback import LoopbackRouter

            return defer.succeed(LoopbackRouter(endpoint.partition(":")[2], receiver, reactor,
                                                limits=limits))
        if kind == "zmq":
            from mdp.transport.zeromq import ZmqRouter

            return defer.succeed(ZmqRouter(endpoint, receiver, reactor, limits))
        from mdp.transport.stream import StreamRouter

        return StreamRouter.listen(reactor, endpoint, receiver, limits)  # type: ignore[return-value]
    except (ValueError, KeyError, TypeError) as e:
        return defer.fail(TransportError(f"bad endpoint {endpoint!r}: {e}"))
    except TransportError as e:
        return defer.fail(e)


def connect(
    endpoint: str,
    receiver: IDealerReceiver,
    reactor: Optional[Any] = None,
    retryPolicy: Optional[Any] = None,
    limits: Limits = Limits(),
) -> IDealerTransport:
    """Open a DEALER-like pipe to *endpoint*.  ``receiver.connectionMade`` is
    called later, once the pipe is usable.  *retryPolicy* (attempt → seconds)
    paces reconnection on stream transports; *limits* bound what is received."""
    kind = scheme(endpoint)
    reactor = _reactor(reactor)
    try:
        if kind == "loopback":
            from mdp.transport.loopback import LoopbackDealer

            return LoopbackDealer(endpoint.partition(":")[2], receiver, reactor, limits=limits)
        if kind == "zmq":
            from mdp.transport.zeromq import ZmqDealer

            return ZmqDealer(reactor, endpoint, receiver, limits)
        from mdp.transport.stream import StreamDealer

        return StreamDealer(reactor, endpoint, receiver, retryPolicy=retryPolicy, limits=limits)
    except (ValueError, KeyError, TypeError) as e:
        raise TransportError(f"bad endpoint {endpoint!r}: {e}") from e


def connect_peers(receiver: IPeerRouterReceiver, reactor: Optional[Any] = None,
                  limits: Limits = Limits()) -> IPeerRouterTransport:
    """A connecting ROUTER (:class:`IPeerRouterTransport`) for *receiver*;
    add servers with its ``connect(endpoint)``."""
    from mdp.transport.peers import PeerRouter

    return PeerRouter(receiver, _reactor(reactor), limits)

