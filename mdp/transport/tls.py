"""Mutual TLS listeners: Twisted's ``ssl:`` server syntax plus ``caCerts=CA.pem``
(the authorities of the client certificates accepted), and ``mtls:``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from mdp.errors import TransportError
from mdp.transport.registry import bad_endpoint, split_description

CA_CERTS = "caCerts"  #: the authorities' option, our addition to Twisted's ``ssl:`` server syntax

#: what an ``ssl:`` listener with ``caCerts=`` takes
MUTUAL_KEYS = {"port", "interface", "backlog", "privateKey", "certKey", CA_CERTS}

#: the listen queue unless the endpoint names one (Twisted's 50 drops a burst's SYNs)
LISTEN_BACKLOG = 1024


def check_mutual(description: str, args: list[str], kwargs: dict[str, str]) -> None:
    """Refuse what an ``ssl:`` listener with ``caCerts=`` would not honour."""
    other = sorted(set(kwargs) - MUTUAL_KEYS)
    if other or len(args) > 1:
        raise bad_endpoint(description, f"with {CA_CERTS}= an ssl: listener takes only port, "
                                        f"interface, backlog, privateKey and certKey "
                                        f"(not {', '.join(other) or args[1]})")
    if "privateKey" not in kwargs:
        raise bad_endpoint(description, "an ssl: listener needs privateKey=KEY.pem (and certKey=CERT.pem)")


def authorities(path: str) -> list[Any]:
    """The certificates in PEM file *path* (Twisted ``Certificate`` objects)."""
    from twisted.internet import ssl

    try:
        pem = Path(path).read_bytes()
    except OSError as e:
        raise TransportError(f"{CA_CERTS}={path}: cannot read the authorities' certificates: "
                             f"{e.strerror}") from None
    marker = b"-----END CERTIFICATE-----"
    blocks = [block + marker for block in pem.split(marker) if b"-----BEGIN" in block]
    if not blocks:
        raise TransportError(f"{CA_CERTS}={path}: no PEM certificate in it")
    try:
        return [ssl.Certificate.loadPEM(block) for block in blocks]
    except Exception as e:
        raise TransportError(f"{CA_CERTS}={path}: not a PEM certificate: {e}") from None


def server_endpoint(reactor: Any, *args: str, **kwargs: str) -> Any:
    """The SSL server endpoint of ``mtls:PORT:privateKey=KEY:certKey=CERT:caCerts=CA``
    (``interface=``, ``backlog=``): only client certificates ``caCerts`` signed."""
    from twisted.internet import ssl
    from twisted.internet.endpoints import SSL4ServerEndpoint

    description = f"ssl:{':'.join([*args, *(f'{k}={v}' for k, v in kwargs.items())])}"
    check_mutual(description, list(args), kwargs)
    if CA_CERTS not in kwargs:
        raise bad_endpoint(description, f"a mutual TLS listener needs {CA_CERTS}=CA.pem")
    trusted = authorities(kwargs[CA_CERTS])
    try:
        key = Path(kwargs["privateKey"]).read_bytes()
        cert = Path(kwargs.get("certKey", kwargs["privateKey"])).read_bytes()
        own = ssl.PrivateCertificate.loadPEM(cert + b"\n" + key)
    except Exception as e:
        raise TransportError(f"{description}: cannot load the server's certificate and key: {e}") from None
    # options with a trust root: OpenSSL requires a client certificate it signed
    return SSL4ServerEndpoint(reactor, int(kwargs.get("port", args[0] if args else 0)),
                              own.options(*trusted),
                              backlog=int(kwargs.get("backlog", LISTEN_BACKLOG)),
                              interface=kwargs.get("interface", ""))


def parse_mutual(description: str) -> Optional[tuple[list[str], dict[str, str]]]:
    """The arguments of ``ssl:`` server *description* with ``caCerts=``, or None."""
    kind, _, rest = description.partition(":")
    args, kwargs = split_description(rest)
    return (args, kwargs) if kind == "ssl" and CA_CERTS in kwargs else None
