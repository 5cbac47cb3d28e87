"""Drive a node by events (a message, a peer gone, a pipe up, time passing) and read back its
actions; its transports are recorders on ``script:`` endpoints, its clock a ``task.Clock``::

    script = Script()
    broker = Broker(reactor=script.clock)
    broker.listen(script.endpoint("b"))
    actions = script.feed(Receive(b"C", [b"MDPC02", b"\\x01", b"echo", b"hi"]))

A connecting node's pipes are named ``ENDPOINT#N`` (the Nth pipe to that endpoint)."""

from __future__ import annotations

import datetime
import itertools
import weakref
from pathlib import Path
from typing import Any, Optional, Union

import attrs
from twisted.internet import defer, task
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp import interfaces, transport
from mdp.policy import Limits
from mdp.transport.registry import bad_endpoint

Frames = tuple[bytes, ...]


def _record(name: str, doc: str, /, **fields: Any) -> Any:
    """A frozen attrs class of *fields* (name: type); ``frames`` is kept as a tuple."""
    made = attrs.make_class(name, {
        field: attrs.field(type=kind, converter=tuple if field == "frames" else None)
        for field, kind in fields.items()}, frozen=True)
    made.__doc__, made.__module__ = doc, __name__
    return made


Receive = _record("Receive", "A message arrives: from router peer *source* (bytes) or on pipe *source* (a "
                  "pipe name, or an endpoint for its latest pipe).", source=Union[bytes, str], frames=Frames)
Connected = _record("Connected", "The pipe *pipe* (or the latest pipe to an endpoint) is up.", pipe=str)
Lost = _record("Lost", "Router peer *source* went away, or pipe *source* broke.", source=Union[bytes, str])
Elapse = _record("Elapse", "*seconds* of time pass; timers fire in order as they come due.", seconds=float)
Event = Union[Receive, Connected, Lost, Elapse]

Send = _record("Send", "The node sends *frames* to router peer *to* (bytes) or on pipe *to*.",
               to=Union[bytes, str], frames=Frames)
Disconnect = _record("Disconnect", "The node drops router peer *peer*.", peer=bytes)
Open = _record("Open", "The node opened pipe *pipe* (a connecting transport).", pipe=str)
Close = _record("Close", "The node closed pipe or listening endpoint *name*.", name=str)
Action = Union[Send, Disconnect, Open, Close]

_scripts: weakref.WeakValueDictionary[str, Script] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@implementer(interfaces.IRouterTransport, interfaces.IAuthenticatedRouter)
class _Router:
    def __init__(self, script: Script, endpoint: str, receiver: interfaces.IRouterReceiver) -> None:
        self.script, self.endpoint, self.receiver = script, endpoint, receiver

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        self.script.actions.append(Send(peer, frames))

    def disconnectPeer(self, peer: bytes) -> None:
        self.script.actions.append(Disconnect(peer))

    def peerIdentity(self, peer: bytes) -> Optional[str]:
        return self.script.identities.get(peer)

    def close(self) -> defer.Deferred[None]:
        self.script.routers.pop(self.endpoint, None)
        self.script.actions.append(Close(self.endpoint))
        return defer.succeed(None)


@implementer(interfaces.IDealerTransport)
class _Pipe:
    writable = True

    def __init__(self, script: Script, endpoint: str, name: str,
                 receiver: interfaces.IDealerReceiver) -> None:
        self.script, self.endpoint, self.name, self.receiver = script, endpoint, name, receiver
        self.connected = self.closed = False

    def sendMessage(self, frames: list[bytes]) -> None:
        if not self.closed:
            self.script.actions.append(Send(self.name, frames))

    def drained(self) -> defer.Deferred[None]:
        return defer.succeed(None)

    def discardReceived(self) -> int:
        return 0

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed, self.connected = True, False
            self.script.actions.append(Close(self.name))
        return defer.succeed(None)


class Script:
    """A fake world for one node: a clock, recorded actions, scripted events; with *autoConnect*
    pipes come up by themselves; ``identities`` maps peer ids to authenticated identities."""

    def __init__(self, autoConnect: bool = False, start: float = 0.0) -> None:
        self.clock = task.Clock()
        self.clock.advance(start)
        self.autoConnect = autoConnect
        self.actions: list[Action] = []
        self.routers: dict[str, _Router] = {}
        self.identities: dict[bytes, str] = {}
        self.pipes: dict[str, _Pipe] = {}
        self.id = str(next(_ids))
        _scripts[self.id] = self

    def endpoint(self, name: str) -> str:
        """An endpoint string of this script (``script:ID/NAME``)."""
        return f"script:{self.id}/{name}"

    def _connect(self, endpoint: str, receiver: interfaces.IDealerReceiver) -> _Pipe:
        name = f"{endpoint}#{sum(pipe.endpoint == endpoint for pipe in self.pipes.values()) + 1}"
        pipe = self.pipes[name] = _Pipe(self, endpoint, name, receiver)
        self.actions.append(Open(pipe.name))
        if self.autoConnect:
            self.clock.callLater(0, self._up, pipe)
        return pipe

    def _up(self, pipe: _Pipe) -> None:
        if not pipe.closed and not pipe.connected:
            pipe.connected = True
            pipe.receiver.connectionMade()

    def pipe(self, name: str) -> _Pipe:
        """The pipe called *name*, or the latest pipe to endpoint *name*."""
        latest = [pipe for pipe in self.pipes.values() if pipe.endpoint == name]
        pipe = self.pipes.get(name) or (latest[-1] if latest else None)
        if pipe is None:
            raise KeyError(f"no pipe {name!r}; open ones: {sorted(self.pipes)}")
        return pipe

    def _router(self, via: Optional[str]) -> _Router:
        if via is not None:
            return self.routers[via]
        if len(self.routers) != 1:
            raise KeyError(f"say which endpoint: {sorted(self.routers)}")
        return next(iter(self.routers.values()))

    def feed(self, *events: Event, via: Optional[str] = None) -> list[Action]:
        """Apply *events*; the actions they caused.  *via*: the listening endpoint of router events."""
        mark = len(self.actions)
        self.clock.advance(0)
        for event in events:
            if isinstance(event, Elapse):
                self.elapse(event.seconds)
            elif isinstance(event, Connected):
                self._up(self.pipe(event.pipe))
            elif isinstance(event, Receive) and isinstance(event.source, bytes):
                self._router(via).receiver.messageReceived(event.source, list(event.frames))
            elif isinstance(event, Receive):
                self.pipe(event.source).receiver.messageReceived(list(event.frames))
            elif isinstance(event, Lost) and isinstance(event.source, bytes):
                self._router(via).receiver.peerDisconnected(event.source)
            elif isinstance(event, Lost):
                pipe = self.pipe(event.source)
                pipe.connected = False
                pipe.receiver.connectionLost(Failure(ConnectionError("pipe broke")))
            else:
                raise TypeError(f"not an event: {event!r}")
            self.clock.advance(0)
        return self.actions[mark:]

    def elapse(self, seconds: float) -> None:
        """Let *seconds* pass, firing each timer at its own time."""
        end = self.clock.seconds() + seconds
        while (wake := self.nextWake()) is not None and wake <= end:
            self.clock.advance(max(wake - self.clock.seconds(), 0))
        self.clock.advance(max(end - self.clock.seconds(), 0))

    def nextWake(self) -> Optional[float]:
        """When the node next needs the clock (an absolute time), if ever."""
        return min((call.getTime() for call in self.clock.getDelayedCalls()), default=None)

    def sent(self, actions: Optional[list[Action]] = None) -> list[Send]:
        """Only the :class:`Send` actions (of *actions*, or of all so far)."""
        return [a for a in (self.actions if actions is None else actions) if isinstance(a, Send)]

    def forget(self) -> None:
        """Unregister this script's endpoints."""
        _scripts.pop(self.id, None)


def _owner(endpoint: str, role: str = "") -> Script:
    """The script of *endpoint* (also the scheme's check, whatever the *role*)."""
    script = _scripts.get(endpoint.partition(":")[2].partition("/")[0])
    if script is None:
        raise bad_endpoint(endpoint, "no such script")
    return script


def _listen(endpoint: str, receiver: Any, reactor: Any, limits: Limits) -> Any:
    script = _owner(endpoint)
    script.routers[endpoint] = _Router(script, endpoint, receiver)
    return defer.succeed(script.routers[endpoint])


def _connect(endpoint: str, receiver: Any, reactor: Any, limits: Limits, retryPolicy: Any,
             identity: Optional[bytes]) -> Any:
    return _owner(endpoint)._connect(endpoint, receiver)


transport.register(transport.Scheme(
    "script", _owner, _listen, _connect,
    "recording stand-ins for driving a node by events (mdp.testing)", identities=True))


def _key_and_certificate(common: str, organization: Optional[str] = None,
                         issuer: Optional[CertificateAuthority] = None) -> tuple[Any, Any]:
    """A new key and its certificate for *common*, valid 30 days, signed by *issuer* or itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if organization is not None:
        parts.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    subject = x509.Name(parts)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(subject if issuer is None else issuer.name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1))
               .not_valid_after(now + datetime.timedelta(days=30)))
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    return key, builder.sign(key if issuer is None else issuer.key, hashes.SHA256())


class CertificateAuthority:
    """A TLS certificate authority for tests, writing PEM files into *directory* (``cryptography``)."""

    def __init__(self, directory: Union[str, Path], name: str = "Test CA") -> None:
        from cryptography.hazmat.primitives.serialization import Encoding

        self.directory = Path(directory)
        self.key, self.certificate = _key_and_certificate(name)
        self.name = self.certificate.subject
        self.pem = self.write("ca.pem" if name == "Test CA" else f"{name}.pem",
                              self.certificate.public_bytes(Encoding.PEM))

    def write(self, name: str, data: bytes) -> Path:
        path = self.directory / name
        path.write_bytes(data)
        return path

    def issue(self, file: str, common: str, organization: Optional[str] = None) -> tuple[Path, Path]:
        """Issue a certificate for *common*: the paths of ``FILE.pem`` and ``FILE-key.pem``."""
        from cryptography.hazmat.primitives import serialization

        key, certificate = _key_and_certificate(common, organization, self)
        cert = self.write(f"{file}.pem", certificate.public_bytes(serialization.Encoding.PEM))
        private = self.write(f"{file}-key.pem", key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
        return cert, private
