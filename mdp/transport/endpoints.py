"""Stream endpoint strings (Twisted's, plus the client forms for listening
and ``ssl:`` with ``caCerts=``) and the process's descriptor budget."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.interfaces import IListeningPort

from mdp.errors import TransportError
from mdp.transport import tls
from mdp.transport.registry import LISTEN, bad_endpoint, check_port, split_description

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

DESCRIPTOR_RESERVE = 64  #: descriptors kept back, at the least, for all else a process opens
SELECT_LIMIT = 1024  #: select() watches descriptors below this only (FD_SETSIZE)


def descriptor_budget() -> Optional[int]:
    """How many accepted stream connections the descriptor limit leaves room
    for: all but an eighth (at least :data:`DESCRIPTOR_RESERVE`); None: no limit."""
    limit: Optional[int] = None
    if resource is not None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = None if soft == resource.RLIM_INFINITY else soft
    select = sys.modules.get("twisted.internet.selectreactor")
    if select is not None and isinstance(sys.modules.get("twisted.internet.reactor"),
                                         select.SelectReactor):  # it waits with select()
        limit = SELECT_LIMIT if limit is None else min(limit, SELECT_LIMIT)
    if limit is None:
        return None
    return max(1, limit - max(DESCRIPTOR_RESERVE, limit // 8))


#: soft limits to try, in order, where the hard limit is unlimited (macOS)
UNLIMITED_TARGETS = (65_536, 10_240)


def raise_descriptor_limit() -> int:
    """Raise the soft descriptor limit to the hard one (or the first of
    :data:`UNLIMITED_TARGETS` granted); the soft limit in force (-1: none)."""
    if resource is None:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return -1
    unlimited = hard == resource.RLIM_INFINITY
    for target in [t for t in (UNLIMITED_TARGETS if unlimited else (hard,)) if t > soft]:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # more than the kernel grants
            continue
        return target
    return soft


def server_description(endpoint: str) -> str:
    """A server description (client forms too), with ``tls.LISTEN_BACKLOG`` unless it gives ``backlog=``."""
    kind, _, rest = endpoint.partition(":")
    if kind in ("tcp", "tcp6", "ssl") and "host=" in rest:
        rest = ":".join("interface=" + p[len("host="):] if p.startswith("host=") else p
                        for p in rest.split(":"))
    elif kind == "unix" and rest.startswith("path="):
        rest = f"address={rest[len('path='):]}"
    if kind in ("tcp", "tcp6", "ssl", "unix") and "backlog=" not in rest:
        rest = f"{rest}:backlog={tls.LISTEN_BACKLOG}"
    return f"{kind}:{rest}"


def subject(certificate: Any) -> str:
    """A TLS certificate's subject as RFC 4514 text."""
    return certificate.to_cryptography().subject.rfc4514_string()


def connect_description(kind: str, port: IListeningPort) -> str:
    """The client endpoint string that reaches *port* (of an ``mtls:``
    listener: Twisted's ``ssl:`` client, given a certificate)."""
    if kind == "mtls":
        kind = "ssl"
    address = port.getHost()
    if kind == "unix":
        return f"unix:path={os.fsdecode(address.name)}"
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address.host, address.host)
    if ":" in host:  # IPv6
        host = host.replace(":", r"\:")
        kind = "tcp" if kind == "tcp6" else kind
    return f"{kind}:host={host}:port={address.port}"


def server_endpoint(reactor: Any, description: str) -> Any:
    """The Twisted server endpoint for a :func:`server_description`."""
    mutual = tls.parse_mutual(description)
    if mutual is None:
        return serverFromString(reactor, description)
    return tls.server_endpoint(reactor, *mutual[0], **mutual[1])


#: The longest path a local socket can have (``sun_path``).
UNIX_PATH_MAX = 104 if sys.platform == "darwin" or "bsd" in sys.platform else 108


def check_endpoint(endpoint: str, role: str) -> None:
    """Check a stream endpoint string for *role* without starting anything."""
    name, _, rest = endpoint.partition(":")
    args, kwargs = split_description(rest)
    if name in ("tcp", "tcp6", "ssl", "tls"):
        host = kwargs.get("host", args[0] if args else None)
        if role == LISTEN:
            if name == "tls":
                raise bad_endpoint(endpoint, "tls: endpoints only connect; listen with "
                                   "ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem")
            port = kwargs.get("port", args[0] if args else None)
            if port is not None and not port.isdigit() and "host" not in kwargs and len(args) > 1:
                port = args[1]  # the client form tcp:HOST:PORT
        elif not host:
            if "::" in rest or "=[" in rest:
                raise bad_endpoint(endpoint, f"escape the colons of an IPv6 address, e.g. "
                                             f"{name}:host=\\:\\:1:port=5555")
            raise bad_endpoint(endpoint, f"no host; e.g. {name}:host=127.0.0.1:port=5555")
        else:
            try:
                host.encode("idna")
            except UnicodeError as e:
                raise bad_endpoint(endpoint, f"not a host name: {host!r} ({e})") from None
            port = kwargs.get("port", args[1] if len(args) > 1 else None)
        check_port(endpoint, port, role)
    elif name == "unix":
        path = kwargs.get("path", kwargs.get("address", args[0] if args else None))
        if not path:
            raise bad_endpoint(endpoint, "no path; e.g. unix:path=/tmp/mdp.sock")
        length = len(os.fsencode(path))
        if length > UNIX_PATH_MAX:
            raise bad_endpoint(endpoint, f"a socket's path is at most {UNIX_PATH_MAX} bytes here, "
                                         f"not {length}")
    _check_with_twisted(endpoint, role)


def _check_with_twisted(endpoint: str, role: str) -> None:
    """Have Twisted's parsers (or the mutual TLS one, which loads its files) build the endpoint."""
    from twisted.internet.task import Clock

    try:
        if role == LISTEN:
            description = server_description(endpoint)
            mutual = tls.parse_mutual(description)
            if mutual is not None:  # its errors name the endpoint as written
                tls.check_mutual(endpoint, *mutual)
                ca = mutual[1][tls.CA_CERTS]
                if not os.path.isfile(ca):
                    raise bad_endpoint(endpoint, f"{tls.CA_CERTS}={ca}: no such file")
            server_endpoint(Clock(), description)
        else:
            clientFromString(Clock(), endpoint)
    except TransportError:
        raise
    except (NameError, ImportError) as e:
        raise bad_endpoint(endpoint, f"{endpoint.partition(':')[0]}: needs pyOpenSSL and "
                                     f"service_identity (pip install 'twisted[tls]'): {e}") from None
    except Exception as e:
        raise bad_endpoint(endpoint, str(e)) from None
