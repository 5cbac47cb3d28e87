"""Key and certificate files for the benchmark's secure transports, made
once per run in a temporary directory: CURVE keys (``mdp keygen``'s format)
and a TLS authority with certificates for the broker and its peers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Optional

_directory: Optional[str] = None


def directory() -> str:
    """The run's directory of keys and certificates (made on first use,
    removed at exit)."""
    global _directory
    if _directory is None:
        from mdp.testing import CertificateAuthority
        from mdp.transport.curve import keygen

        path = tempfile.mkdtemp(prefix="mdp-bench-keys-")
        atexit.register(shutil.rmtree, path, True)
        for name in ("broker", "peer"):
            keygen(name, path)
        os.mkdir(os.path.join(path, "allowed"))
        shutil.copy(os.path.join(path, "peer.key"), os.path.join(path, "allowed"))
        authority = CertificateAuthority(path)
        authority.issue("broker", "broker")
        authority.issue("peer", "peer", "Benchmarks")
        os.mkdir(os.path.join(path, "trusted"))
        shutil.copy(authority.pem, os.path.join(path, "trusted"))
        _directory = path
    return _directory


def tls_bind() -> str:
    """A mutual-TLS listening endpoint on 127.0.0.1, port picked by the OS."""
    d = directory()
    return (f"ssl:0:interface=127.0.0.1:privateKey={d}/broker-key.pem:certKey={d}/broker.pem"
            f":caCerts={d}/ca.pem")


def tls_peer(endpoint: str) -> str:
    """*endpoint* (``ssl:host=…:port=…``) as a peer with a certificate reaches it."""
    d = directory()
    return f"{endpoint}:caCertsDir={d}/trusted:certKey={d}/peer.pem:privateKey={d}/peer-key.pem"
