"""Endpoint schemes (``zmq:``, ``tcp:``, ``loopback:``, ...), each a :class:`Scheme`, with hints."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Optional

import attrs

from mdp.errors import TransportError

LISTEN = "listen"
CONNECT = "connect"


@attrs.frozen
class Scheme:
    """One endpoint scheme: ``check(endpoint, role)`` raises :class:`TransportError` unless
    *endpoint* suits *role*; *listen*, *connect* and *channels* make its transports (or None)."""

    name: str
    check: Callable[[str, str], None]
    listen: Optional[Callable[..., Any]] = None
    connect: Optional[Callable[..., Any]] = None
    summary: str = ""  # one line: what it is, how its endpoints look
    identities: bool = False  # connect() can choose the identity the far side sees
    connections: bool = True  # a connection per peer, whose loss is reported
    secure: bool = False  # listen and connect take ``security=`` (CURVE)
    channels: Optional[Callable[..., Any]] = None


_schemes: dict[str, Scheme] = {}


def bad_endpoint(endpoint: object, why: str) -> TransportError:
    return TransportError(f"bad endpoint {endpoint!r}: {why}")


def register(scheme: Scheme, *, replace: bool = False) -> None:
    """Make *scheme* available for endpoint strings ``NAME:...``."""
    if scheme.name in _schemes and not replace:
        raise ValueError(f"endpoint scheme {scheme.name!r} is already registered")
    _schemes[scheme.name] = scheme


def unregister(name: str) -> None:
    _schemes.pop(name, None)


def schemes() -> Iterator[Scheme]:
    return iter(list(_schemes.values()))


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def _hint_for_url(endpoint: str, role: str) -> str:
    """What a pyzmq/nng-style URL was probably meant to be."""
    kind, _, rest = endpoint.partition("://")
    kind = kind.lower()
    if kind in ("ipc", "inproc"):
        return f"did you mean zmq:{kind}://{rest}?"
    if kind != "tcp":
        return "endpoints look like zmq:tcp://HOST:PORT, tcp:host=HOST:port=PORT or unix:path=PATH"
    if rest.startswith("["):  # the ZeroMQ and the framed TCP endpoint it may have meant
        host, _, port = rest[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, colon, port = rest.rpartition(":")
        if not colon:
            host, port = rest, ""
    port = port or "PORT"
    wildcard = host in ("*", "0.0.0.0", "")
    if role == CONNECT and wildcard:
        host = "127.0.0.1"
    zmqHost = f"[{host}]" if ":" in host else host
    zmqPort = "*" if role == LISTEN and port == "0" else port
    escaped = host.replace(":", "\\:")
    if role == CONNECT:
        stream = f"tcp:host={escaped}:port={port}"
    elif wildcard:
        stream = f"tcp:{port}"
    else:
        stream = f"tcp:{port}:interface={escaped}"
    return f"did you mean zmq:tcp://{zmqHost}:{zmqPort} (ZeroMQ) or {stream} (framed TCP)?"


_BARE_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|\*|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                           r":(?:\d+|\*)$")

_ZMQ_TRANSPORTS = frozenset({"tcp", "ipc", "inproc", "pgm", "epgm", "ws", "wss", "udp", "vmci"})


def bare_address(endpoint: str) -> Optional[str]:
    """*endpoint* if it is a bare ``HOST:PORT`` whose host is no scheme, else None."""
    if not _BARE_ADDRESS.match(endpoint):
        return None
    name = endpoint.partition(":")[0]
    return None if name in _schemes or name in _ZMQ_TRANSPORTS else endpoint


def lookup(endpoint: object, role: str = CONNECT) -> Scheme:
    """The :class:`Scheme` for *endpoint*, checked for *role*; raises :class:`TransportError`."""
    if not isinstance(endpoint, str):
        raise TransportError(f"an endpoint is a string, not {type(endpoint).__name__}: {endpoint!r}")
    if _URL.match(endpoint) and endpoint.partition(":")[0] not in ("zmq", "loopback"):
        raise bad_endpoint(endpoint, "this is a URL, not an endpoint; " + _hint_for_url(endpoint, role))
    name, colon, _ = endpoint.partition(":")
    if not colon or not name:
        raise bad_endpoint(endpoint, "no scheme (zmq:, tcp:, unix:, loopback:, ...)")
    scheme = _schemes.get(name) or _twisted_plugin_scheme(name)
    if scheme is None:
        if bare_address(endpoint) is not None:
            why = "an address with no scheme; " + _hint_for_url("tcp://" + endpoint, role)
        elif name in _ZMQ_TRANSPORTS:
            why = f"{name!r} is a ZeroMQ transport: name it after zmq:, as in zmq:{name}://..."
        else:
            why = f"unknown scheme {name!r} (known: {', '.join(sorted(_schemes))})"
        raise bad_endpoint(endpoint, why)
    if (scheme.listen if role == LISTEN else scheme.connect) is None:
        raise bad_endpoint(endpoint, f"{name}: endpoints cannot {role}")
    scheme.check(endpoint, role)
    return scheme


check = lookup  #: (by the name its callers use: they want only its errors)


def _twisted_plugin_scheme(name: str) -> Optional[Scheme]:
    """A stream scheme over an endpoint type a Twisted plugin provides (``tor:``)."""
    from twisted.internet import endpoints
    from twisted.plugin import getPlugins

    for interface in (endpoints.IStreamClientEndpointStringParserWithReactor,
                      endpoints.IStreamServerEndpointStringParser):
        if any(plugin.prefix == name for plugin in getPlugins(interface)):
            from mdp.transport import stream

            return stream.scheme(name)
    return None


def split_description(rest: str) -> tuple[list[str], dict[str, str]]:
    """Twisted's endpoint syntax: ``:``-separated (``\\:`` escapes), ``key=value`` or positional."""
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for part in re.split(r"(?<!\\):", rest) if rest else ():
        part = part.replace("\\:", ":")
        key, eq, value = part.partition("=")
        if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            kwargs[key] = value
        else:
            args.append(part)
    return args, kwargs


def check_port(endpoint: str, port: Optional[str], role: str, wildcard: bool = False) -> None:
    """A port is 1..65535; listening, also 0 (or ``*`` with *wildcard*): the OS picks."""
    if not port:
        pick = "" if role == CONNECT else " (0 lets the OS pick one)"
        raise bad_endpoint(endpoint, f"no port; add one, e.g. :port=5555{pick}")
    if wildcard and port == "*":
        if role == LISTEN:
            return
        raise bad_endpoint(endpoint, "'*' picks a port when binding; to connect, give the port "
                           "the server is bound to")
    if not (port.isascii() and port.isdigit()):
        raise bad_endpoint(endpoint, f"port {port!r} is not a number")
    low = 0 if role == LISTEN else 1
    if not low <= int(port) <= 65535:
        raise bad_endpoint(endpoint, f"port {int(port)} is out of range ({low}..65535)")
