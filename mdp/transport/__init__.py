"""Message transports, chosen by the scheme of an endpoint string (``zmq:``,
``tcp:``, ``loopback:``, ...; ``docs/transports.md``).  A new transport registers
itself with :func:`register`; a malformed endpoint raises ``TransportError`` at once."""

from __future__ import annotations

import importlib
import ipaddress
import os
import re
import socket
import weakref
from typing import Any, Callable, Iterable, Optional

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from mdp.errors import TransportError
from mdp.interfaces import (
    DealerReceiver,
    IDealerChannels,
    IDealerReceiver,
    IDealerTransport,
    IPeerRouterReceiver,
    IPeerRouterTransport,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.policy import JITTER, Backoff, Limits, LogThrottle, default_reactor
from mdp.transport.loopback import LoopbackDealer, LoopbackRouter
from mdp.transport.registry import (
    CONNECT,
    LISTEN,
    Scheme,
    bad_endpoint,
    check,
    check_port,
    lookup,
    register,
    schemes,
    split_description,
    unregister,
)

_log = Logger()

__all__ = [
    "CONNECT", "LISTEN", "Scheme", "authenticated", "beyond_loopback", "check",
    "check_curve_client", "close_all", "connect", "connect_channels", "connect_peers",
    "curve_client_for", "curve_for", "curve_listen_for", "endpoint_list", "listen", "lookup",
    "register", "schemes", "shut_socket", "unregister", "warn_if_open",
]


def shut_socket(fd: int) -> None:
    """Shut the socket behind descriptor *fd* both ways, from any thread: a call blocked on
    it (a database driver's, say) fails at once; the descriptor stays its owner's to close."""
    copy = os.dup(fd)
    try:
        stuck = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        raise
    with stuck:
        stuck.shutdown(socket.SHUT_RDWR)


def endpoint_list(endpoints: object, role: str = CONNECT, empty: bool = False) -> list[str]:
    """One endpoint or a failover list of them, each checked for *role*:
    ``TypeError`` if not ``str`` (or a sequence of them), ``ValueError`` for
    none (unless *empty*), :class:`TransportError` for a malformed one."""
    if isinstance(endpoints, str):
        listed = [endpoints]
    elif isinstance(endpoints, (bytes, bytearray, memoryview)) or not isinstance(endpoints, Iterable):
        raise TypeError(f"endpoints are str (one, or a sequence of them), "
                        f"not {type(endpoints).__name__}: {endpoints!r}")
    else:
        listed = list(endpoints)
    if not listed and not empty:
        raise ValueError("give at least one broker or server endpoint")
    for endpoint in listed:
        check(endpoint, role)
    return listed


def curve_for(endpoint: str, curve: Any) -> Any:
    """A node's CURVE settings for *endpoint* (``zmq:`` only); ``TransportError`` for ``session+zmq:``."""
    if curve is None:
        return None
    if endpoint.startswith("session+zmq:"):
        raise TransportError(f"{endpoint!r}: CURVE is not available on session+zmq: endpoints; "
                             "use zmq: (or ssl: for TLS)")
    return curve if endpoint.startswith("zmq:") else None


def curve_client_for(endpoints: list[str], serverPublicFile: Optional[str], secretFile: Optional[str]) -> Any:
    """A connecting node's CURVE client (None without a server key), checked by :func:`check_curve_client`."""
    from mdp.transport.curve import curve_client

    curve = curve_client(serverPublicFile, secretFile)
    check_curve_client(endpoints, curve)
    return curve


def check_curve_client(endpoints: list[str], curve: Any) -> None:
    """``ValueError`` if *curve* would be used by none of *endpoints* (talking
    in the clear), :class:`TransportError` if one cannot use it."""
    if curve is not None and not any(e.startswith("zmq:") for e in endpoints):
        raise ValueError("CURVE keys are for zmq: endpoints; for a stream endpoint use ssl: (TLS) instead")
    for endpoint in endpoints:
        curve_for(endpoint, curve)


def _loopback_host(host: str) -> bool:
    host = host.strip("[]").partition("%")[0]
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or every interface


def beyond_loopback(endpoint: str) -> bool:
    """Does listening on *endpoint* accept peers from other machines?"""
    kind, _, rest = endpoint.partition(":")
    kind = kind[len("session+"):] if kind.startswith("session+") else kind  # (its inner endpoint's)
    if kind == "zmq":
        transport, _, address = rest.partition("://")
        return transport == "tcp" and not _loopback_host(address.rpartition(":")[0])
    if kind in ("tcp", "tcp6", "ssl", "mtls"):
        _, kwargs = split_description(rest)
        return not _loopback_host(kwargs.get("interface", kwargs.get("host", "")))
    return False


def authenticated(endpoint: str, security: Any = None) -> bool:
    """Does a listener on *endpoint* know who its peers are (CURVE with an
    allow-list, or ``ssl:`` with ``caCerts=``, or ``mtls:``)?"""
    kind, _, rest = endpoint.partition(":")
    if kind == "zmq":
        return security is not None and getattr(security, "allow", None) is not None
    if kind in ("ssl", "mtls"):
        return "caCerts" in split_description(rest)[1]
    return False


def curve_listen_for(endpoint: str, curve: Any) -> Any:
    """A listening node's CURVE settings for *endpoint*; :class:`TransportError`
    if it has them and *endpoint* takes unauthenticated peers from elsewhere."""
    security = curve_for(endpoint, curve)
    if curve is not None and security is None and beyond_loopback(endpoint) and not authenticated(endpoint):
        raise TransportError(f"{endpoint!r}: CURVE keys are for zmq: endpoints, and this one would take "
                             "peers from other machines without authenticating them; listen with zmq: "
                             "(or ssl: with caCerts=), or on a loopback address")
    return security


def warn_if_open(endpoint: str, security: Any, what: str,
                 risk: str = "anyone who can reach it may call any service or serve one. Use CURVE "
                             "(curveSecret and curveAllow) or mutual TLS (ssl: with caCerts=)") -> bool:
    """Warn if *endpoint* takes unauthenticated peers from other machines
    (*risk*: what they may do, and the remedy); whether it did."""
    if not beyond_loopback(endpoint) or authenticated(endpoint, security):
        return False
    _log.warn("{what} listens on {endpoint}, reachable from other machines, without authentication: "
              "{risk}; see docs/security.md", what=what, endpoint=endpoint, risk=risk)
    return True


def _scheme(endpoint: str, role: str, security: Any) -> tuple[Scheme, dict[str, Any]]:
    """The scheme of *endpoint* for *role*, and the keywords that give it *security*."""
    scheme = lookup(endpoint, role)
    if security is None:
        return scheme, {}
    if not scheme.secure:
        raise TransportError(f"{endpoint!r}: {scheme.name}: endpoints take no {type(security).__name__} "
                             "(CURVE is for zmq: endpoints; TLS is an ssl: endpoint)")
    from mdp.transport import curve

    side, kind = ("server", "CurveServer") if role == LISTEN else ("peer", "CurveClient")
    if not isinstance(security, getattr(curve, kind)):
        raise TransportError(f"{endpoint!r}: a ZeroMQ {side}'s security is a {kind}, "
                             f"not {type(security).__name__}")
    return scheme, {"security": security}


def listen(endpoint: str, receiver: IRouterReceiver, reactor: Optional[Any] = None, *,
           limits: Limits = Limits(), security: Any = None) -> defer.Deferred[IRouterTransport]:
    """Bind *endpoint*; fires with an :class:`IRouterTransport` enforcing *limits*
    (*security*: a :class:`~mdp.transport.curve.CurveServer`).  A malformed
    endpoint raises :class:`TransportError`; a failure to bind fails with one."""
    scheme, extra = _scheme(endpoint, LISTEN, security)
    return defer.maybeDeferred(_opening, "listen on", endpoint, scheme.listen, receiver,
                               default_reactor(reactor), limits, **extra)


def connect(endpoint: str, receiver: IDealerReceiver, reactor: Optional[Any] = None, *,
            retryPolicy: Optional[Callable[[int], float]] = None, limits: Limits = Limits(),
            identity: Optional[bytes] = None, security: Any = None) -> IDealerTransport:
    """Open a DEALER-like pipe to *endpoint* (``receiver.connectionMade`` once
    usable); *retryPolicy* (attempt -> seconds) paces reconnection, *identity*
    is the peer id the far side sees, *security* a ``CurveClient``."""
    scheme, extra = _scheme(endpoint, CONNECT, security)
    if identity is not None:
        if not isinstance(identity, bytes) or not 0 < len(identity) < 256 or identity[0] == 0:
            raise ValueError("an identity is 1 to 255 bytes and does not start with a zero byte, "
                             f"got {identity!r}")
        if not scheme.identities:
            raise TransportError(f"{scheme.name}: endpoints cannot choose their identity")
    return _opening("connect to", endpoint, scheme.connect, receiver, default_reactor(reactor),
                    limits, retryPolicy, identity, **extra)


def _opening(doing: str, endpoint: str, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``make(endpoint, ...)``, any failure but a :class:`TransportError` as one."""
    try:
        return make(endpoint, *args, **kwargs)
    except TransportError:
        raise
    except Exception as e:
        raise TransportError(f"cannot {doing} {endpoint!r}: {e}") from e


@implementer(IDealerChannels)
class _Separately:
    """Pipes over a scheme without channels: each connects alone."""

    def __init__(self, endpoint: str, **options: Any) -> None:
        self.endpoint = endpoint
        self.options = options  # connect()'s
        self.pipes: weakref.WeakSet[IDealerTransport] = weakref.WeakSet()

    def open(self, receiver: IDealerReceiver) -> IDealerTransport:
        pipe = connect(self.endpoint, receiver, **self.options)
        self.pipes.add(pipe)
        return pipe

    def close(self) -> defer.Deferred[None]:
        """Close every pipe opened; fires once all are closed."""
        pipes, self.pipes = list(self.pipes), weakref.WeakSet()
        return close_all(pipes, "a pipe to " + self.endpoint)


def close_all(closables: Iterable[Any], what: str) -> defer.Deferred[None]:
    """Close each of *closables*; fires once all are closed (a failure logged as *what*)."""
    closing = [defer.maybeDeferred(each.close) for each in closables]

    def closed(results: list[tuple[bool, Any]]) -> None:
        for ok, result in results:
            if not ok:
                _log.failure("closing {what} failed", result, what=what)

    return defer.DeferredList(closing, consumeErrors=True).addCallback(closed)


def connect_channels(endpoint: str, reactor: Optional[Any] = None, *,
                     retryPolicy: Optional[Callable[[int], float]] = None, limits: Limits = Limits(),
                     security: Any = None, relayProbe: Optional[list[bytes]] = None) -> IDealerChannels:
    """Many DEALER-like pipes to *endpoint* (:class:`IDealerChannels`), over one connection where the scheme
    has channels, or on ``zmq:`` given *relayProbe*, as relay hops on one DEALER if the server answers it
    (:mod:`.zmqchannels`); the other arguments are :func:`connect`'s."""
    scheme, _ = _scheme(endpoint, CONNECT, security)
    reactor = default_reactor(reactor)
    if scheme.name == "zmq" and relayProbe is not None:
        from mdp.transport.zmqchannels import ZmqChannels

        return ZmqChannels(endpoint, reactor, relayProbe, limits, retryPolicy, security)
    if scheme.channels is None:
        return _Separately(endpoint, reactor=reactor, retryPolicy=retryPolicy, limits=limits,
                           security=security)
    return _opening("connect to", endpoint, scheme.channels, reactor, limits, retryPolicy)


def connect_peers(receiver: IPeerRouterReceiver, reactor: Optional[Any] = None, *,
                  limits: Limits = Limits(), security: Any = None) -> IPeerRouterTransport:
    """A connecting ROUTER (:class:`IPeerRouterTransport`); add servers with
    its ``connect(endpoint)``.  *security* applies to ``zmq:`` servers."""
    return PeerRouter(receiver, default_reactor(reactor), limits=limits, curve=security)


class _PeerPipe(DealerReceiver):
    """Receives for one endpoint's DEALER and forwards with the endpoint name."""

    def __init__(self, owner: PeerRouter, endpoint: str) -> None:
        self.owner = owner
        self.endpoint = endpoint

    def messageReceived(self, frames: list[bytes]) -> None:
        self.owner.receiver.messageReceived(self.endpoint, frames)


#: Reconnection to a server that went away: quick, as the agent PINGs every second.
_PEER_RECONNECT = Backoff(initial=0.25, maximum=2.0, jitter=JITTER)


@implementer(IPeerRouterTransport)
class PeerRouter:
    """Routes by endpoint: ZeroMQ through one native ROUTER, the rest through one pipe each."""

    def __init__(self, receiver: IPeerRouterReceiver, reactor: Any = None, *,
                 limits: Limits = Limits(), curve: Any = None) -> None:
        self.receiver = receiver
        self.curve = curve
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.pipes: dict[str, IDealerTransport] = {}
        self.zmq: Optional[Any] = None
        #: servers whose connection could not be opened, tried at their next message
        self.unconnected: set[str] = set()
        self.throttle = LogThrottle(self.reactor)

    def connect(self, endpoint: str) -> None:
        """Connect to the server at *endpoint*; if no socket can be had, try
        again at the next message for it."""
        if endpoint in self.pipes or (self.zmq is not None and endpoint in self.zmq.endpoints):
            return
        zmq = lookup(endpoint, CONNECT).name == "zmq"  # (bad ones raise)
        try:
            if zmq:
                if self.zmq is None:
                    from mdp.transport.zeromq import ZmqPeerRouter

                    self.zmq = ZmqPeerRouter(self.receiver, self.reactor, limits=self.limits,
                                             curve=self.curve)
                self.zmq.connect(endpoint)
            else:
                self.pipes[endpoint] = connect(endpoint, _PeerPipe(self, endpoint), self.reactor,
                                               retryPolicy=_PEER_RECONNECT.retryPolicy(), limits=self.limits)
        except Exception as e:
            self.unconnected.add(endpoint)
            self.throttle.warn(_log, f"connect {endpoint}", "connecting router: cannot connect "
                               "to {endpoint}: {error}; tries again at its next message",
                               endpoint=endpoint, error=e)
        else:
            self.unconnected.discard(endpoint)

    def sendMessage(self, endpoint: str, frames: list[bytes]) -> None:
        if endpoint in self.unconnected:
            self.connect(endpoint)
            if endpoint in self.unconnected:
                return
        dealer = self.pipes.get(endpoint)
        if dealer is not None:
            if dealer.connected:  # like a ROUTER: nothing is queued for an absent peer
                dealer.sendMessage(frames)
        elif self.zmq is not None:
            self.zmq.sendMessage(endpoint, frames)

    def close(self) -> defer.Deferred[None]:
        closing = list(self.pipes.values())
        self.pipes.clear()
        self.unconnected.clear()
        if self.zmq is not None:
            closing.append(self.zmq)
            self.zmq = None
        return close_all(closing, "a Freelance connection")


_ZMQ_HOST = re.compile(r"^(\*|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9]+)?\]|[A-Za-z0-9_][A-Za-z0-9._-]*)$")


def _check_zmq(endpoint: str, role: str) -> None:
    kind, sep, rest = endpoint.partition(":")[2].partition("://")
    if not sep or kind not in ("tcp", "ipc", "inproc"):
        raise bad_endpoint(endpoint, "ZeroMQ endpoints are zmq:tcp://HOST:PORT, zmq:ipc://PATH "
                           "or zmq:inproc://NAME")
    if kind != "tcp":
        if not rest:
            raise bad_endpoint(endpoint, f"no {kind} name")
        return
    if ":" not in rest or (rest.startswith("[") and rest.endswith("]")):
        raise bad_endpoint(endpoint, f"no port; did you mean zmq:tcp://{rest or '127.0.0.1'}:5555"
                                     f"{' (or :* to let the OS pick)' if role == LISTEN else ''}?")
    host, _, port = rest.rpartition(":")
    if not host:
        raise bad_endpoint(endpoint, f"no host; e.g. zmq:tcp://127.0.0.1:{port}")
    if not _ZMQ_HOST.match(host):
        raise bad_endpoint(endpoint, f"{host!r} is not a host name, an address, [an IPv6 address] or *")
    if host == "*" and role == CONNECT:
        raise bad_endpoint(endpoint, f"cannot connect to host '*'; did you mean zmq:tcp://127.0.0.1:{port}?")
    check_port(endpoint, port, role, wildcard=True)


def _listen_zmq(endpoint: str, receiver: Any, reactor: Any, limits: Limits, security: Any = None) -> Any:
    from mdp.transport.zeromq import ZmqRouter

    return defer.succeed(ZmqRouter(endpoint, receiver, reactor, limits=limits, curve=security))


def _connect_zmq(endpoint: str, receiver: Any, reactor: Any, limits: Limits,
                 retryPolicy: Any, identity: Optional[bytes], security: Any = None) -> Any:
    from mdp.transport.zeromq import ZmqDealer

    return ZmqDealer(endpoint, receiver, reactor, limits=limits, identity=identity,
                     curve=security, retryPolicy=retryPolicy)


def _check_loopback(endpoint: str, role: str) -> None:
    if not endpoint.partition(":")[2]:
        raise bad_endpoint(endpoint, "no name; e.g. loopback:broker")


def _listen_loopback(endpoint: str, receiver: Any, reactor: Any, limits: Limits) -> Any:
    return defer.succeed(LoopbackRouter(endpoint.partition(":")[2], receiver, reactor, limits=limits))


def _connect_loopback(endpoint: str, receiver: Any, reactor: Any, limits: Limits,
                      retryPolicy: Any, identity: Optional[bytes]) -> Any:
    return LoopbackDealer(endpoint.partition(":")[2], receiver, reactor, limits=limits, identity=identity)


register(Scheme("zmq", _check_zmq, _listen_zmq, _connect_zmq,
                "ZeroMQ ROUTER/DEALER: zmq:tcp://HOST:PORT, zmq:ipc://PATH, zmq:inproc://NAME",
                identities=True, connections=False, secure=True))
register(Scheme("loopback", _check_loopback, _listen_loopback, _connect_loopback,
                "in memory, for deterministic tests: loopback:NAME", identities=True))


def _register_more() -> None:
    """The stream schemes, and ``session+`` over ``zmq:``, ``tcp:``, ``loopback:`` (imported at first use)."""
    from mdp.transport import stream

    for name in ("tcp", "tcp6", "ssl", "tls", "unix"):  # Twisted's stream endpoint types
        register(stream.scheme(name))

    def session(name: str) -> Callable[..., Any]:
        return lambda *args: getattr(importlib.import_module("mdp.session.transport"), name)(*args)

    for inner in ("zmq", "tcp", "loopback"):
        register(Scheme(f"session+{inner}", session("check"), session("listen"), session("connect"),
                        f"sessions over {inner}: heartbeats and invisible reconnects, "
                        f"session+{inner}:<a {inner}: endpoint without the scheme>",
                        connections=False))


_register_more()
