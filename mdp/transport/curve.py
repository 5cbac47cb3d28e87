"""CURVE on the ZeroMQ transport: encryption, and a ZAP-checked allow-list of ``mdp keygen`` keys."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import types
from typing import Any, Optional

import attrs
from twisted.logger import Logger

from mdp.errors import TransportError
from mdp.policy import LogThrottle

log = Logger()

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def _load(path: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    import zmq.auth

    what = "secret key" if secret else "public key"
    if not os.path.isfile(path):
        raise TransportError(f"CURVE {what} file {path!r} does not exist "
                             f"(make a key pair with: mdp keygen NAME)")
    try:
        public, secretKey = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise TransportError(f"CURVE {what} file {path!r} is not a ZeroMQ certificate: {e}") from e
    if secret and secretKey is None:
        raise TransportError(f"CURVE file {path!r} holds no secret key: give the "
                             f"{SECRET_SUFFIX} file of the pair, not the {PUBLIC_SUFFIX}")
    return public, secretKey


@attrs.frozen
class CurveServer:
    """A server's key pair and whom it accepts: the keys in *allow*, or (None) any key."""

    publicKey: bytes
    secretKey: bytes = attrs.field(repr=False)
    allow: Optional[frozenset[bytes]]

    def apply(self, socket: Any, domain: str) -> None:
        """Make *socket* (before it binds) a CURVE server checked by ZAP under *domain*."""
        import zmq

        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.publicKey)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secretKey)
        socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # (no ZAP handler: refused)


@attrs.frozen
class CurveClient:
    """The server's public key and the peer's own pair (made up if none is given)."""

    serverKey: bytes
    publicKey: bytes
    secretKey: bytes = attrs.field(repr=False)

    def apply(self, socket: Any) -> None:
        """Make *socket* (before it connects) a CURVE client."""
        import zmq

        socket.setsockopt(zmq.CURVE_SERVERKEY, self.serverKey)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.publicKey)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.secretKey)


def curve_server(secretFile: Optional[str], allowDir: Optional[str] = None) -> Optional[CurveServer]:
    """``curveSecret`` (``NAME.key_secret``) and ``curveAllow`` (a directory of ``*.key``
    files) as a :class:`CurveServer` (None without a secret)."""
    if secretFile is None:
        if allowDir is not None:
            raise ValueError("curveAllow (--curve-allow) needs curveSecret (--curve-secret): "
                             "the server's own key pair")
        return None
    public, secret = _load(secretFile, secret=True)
    allow = None
    if allowDir is not None:
        if not os.path.isdir(allowDir):
            raise TransportError(f"CURVE allow-list {allowDir!r} is not a directory of "
                                 f"public-key certificates ({PUBLIC_SUFFIX} files)")
        import zmq.auth

        allow = frozenset(zmq.auth.load_certificates(allowDir))
        if not allow:
            log.warn("the CURVE allow-list {dir} holds no certificate: no peer will get "
                     "through", dir=allowDir)
    return CurveServer(public, secret, allow)  # type: ignore[arg-type]


def curve_client(serverPublicFile: Optional[str], secretFile: Optional[str] = None) -> Optional[CurveClient]:
    """``curveServerPublic`` and ``curveSecret`` as a :class:`CurveClient`, or None."""
    if serverPublicFile is None:
        if secretFile is not None:
            raise ValueError("curveSecret needs curveServerPublic: the server's public key")
        return None
    import zmq

    serverKey, _ = _load(serverPublicFile, secret=False)
    public, secret = zmq.curve_keypair() if secretFile is None else _load(secretFile, True)
    return CurveClient(serverKey, public, secret)  # type: ignore[arg-type]


def _gate(server: CurveServer, endpoint: str, reactor: Any, refused: Optional[Any]) -> Any:
    """One server's allow-list, asked by the ZAP thread for each handshake."""
    throttle = LogThrottle(reactor)

    def warn(key: str) -> None:
        throttle.warn(log, "refused", "CURVE handshake on {endpoint} refused: public key "
                      "{key} is not in the allow-list", endpoint=endpoint, key=key)
        if refused is not None:
            refused()

    def callback(domain: str, key: bytes) -> bool:
        if server.allow is None or key in server.allow:
            return True
        reactor.callFromThread(warn, key.decode("ascii", "replace"))
        return False

    return types.SimpleNamespace(callback=callback)


_DENY_ALL = types.SimpleNamespace(callback=lambda domain, key: False)
_zaps: dict[int, Any] = {}
_domains = itertools.count(1)
_lock = threading.Lock()


def zap_domain(context: Any, server: CurveServer, endpoint: str, reactor: Any,
               beforeTerm: Optional[set[Any]] = None, refused: Optional[Any] = None) -> str:
    """Register *server*'s allow-list as a new domain of *context*'s ZAP handler
    (started the first time, stopped by *beforeTerm*); *refused()* counts refusals."""
    with _lock:
        zap = _zaps.get(id(context))
        if zap is None:
            from zmq.auth.thread import ThreadAuthenticator

            zap = ThreadAuthenticator(context)
            try:
                zap.start()
            except BaseException:  # never cache one that is not running
                zap.stop()
                raise
            _zaps[id(context)] = zap

            def stop() -> None:
                with _lock:
                    if _zaps.get(id(context)) is zap:
                        del _zaps[id(context)]
                zap.stop()

            if beforeTerm is not None:
                beforeTerm.add(stop)
        domain = f"mdp-{next(_domains)}"
        zap.configure_curve_callback(domain, _gate(server, endpoint, reactor, refused))
        return domain


def forget_domain(context: Any, domain: str) -> None:
    zap = _zaps.get(id(context))
    if zap is not None:
        # replaced, not removed: the ZAP thread may be using the lookup
        zap.credentials_providers[domain] = _DENY_ALL


def keygen(name: str, directory: str = ".") -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` in *directory*; return their paths.
    ``ValueError`` (and no file left) if they exist or cannot be written."""
    import zmq.auth

    if not name or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"a key name is a plain file name, not {name!r}")
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory")
    paths = [os.path.join(directory, name + suffix) for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)]
    for path in paths:
        if os.path.exists(path):
            raise ValueError(f"{path} exists already; not overwritten")
    mask = os.umask(0o077)  # the secret file is never readable by others
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(public, 0o644)
    except OSError as e:  # no half pair left behind
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise ValueError(f"cannot write the key pair {name} in {directory!r}: "
                         f"{e.strerror or e}") from None
    finally:
        os.umask(mask)
    return public, secret
