"""Multi-frame messages over any Twisted stream endpoint (tcp, tls, unix).

This module is the connection handling, written once: listen, connect,
reconnect with backoff, peer ids, flow control, disconnect reporting and the
limits.  How a message becomes bytes is a separate, pluggable
:class:`~mdp.interfaces.IFraming`: by default the length-prefixed records of
:mod:`mdp.transport.framing` (documented in ``docs/transports.md``).  Input the
framing refuses (over the message limits, or malformed) ends the connection,
logged with the peer.

A connecting side may choose the identity the bound side knows it by (the
framing's greeting carries it); a newer connection with the same identity
takes it over from an older one.  Without one, the bound side makes up an id
per connection.

The bound side (:class:`StreamRouter`) gives each accepted connection an
opaque peer id and reports its loss at once.  It defends itself
(:class:`~mdp.policy.Limits`): a connection must send its first message within
``handshakeTimeout`` and complete every record it starts within
``recordTimeout``; at most ``maxConnections`` are open (at the cap, the oldest
connection that has not yet sent a message makes room, or the newcomer is
refused); and what a peer does not read is kept, beyond Twisted's own write
buffer, only up to ``maxOutputBytes``, after which that peer alone is
disconnected.  The process's descriptor limit caps the connections too: the
listeners of a process together keep at most what :func:`descriptor_budget`
leaves, so that a flood of connections meets that cap, not ``EMFILE``, and
the rest of the process keeps a reserve of descriptors.

The connecting side uses :class:`ClientService`, so it reconnects with
exponential backoff by itself.

Mutual TLS: an ``ssl:`` listening endpoint may name the authorities whose
client certificates it accepts, ``caCerts=CA.pem`` (one or more PEM
certificates; our addition to Twisted's ``ssl:`` server syntax).  Such a
listener refuses, at the handshake, a client with no certificate or one no
listed authority signed, and knows each peer by its certificate's subject
(RFC 4514, ``CN=worker-1,O=Example``: :meth:`StreamRouter.peerIdentity`).
Clients connect with Twisted's own ``ssl:`` (``certKey=``, ``privateKey=``,
``caCertsDir=``) or ``tls:`` (``certificate=``, ``privateKey=``,
``trustRoots=``) client syntax.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Optional

from twisted.application.internet import ClientService
from twisted.internet import defer, tcp
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHandshakeListener, IListeningPort, INegotiated, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from mdp.errors import ProtocolError, TransportError
from mdp.interfaces import (
    IAuthenticatedRouter,
    IDealerChannels,
    IDealerReceiver,
    IDealerTransport,
    IFraming,
    IRouterReceiver,
    IRouterTransport,
)
from mdp.policy import (
    RECONNECT,
    Limits,
    LogThrottle,
    call_soon,
    cancel_call,
    default_reactor,
    held_bytes,
)
from mdp.transport.flow import DrainWaiters, after
from mdp.transport.framing import CHANNELS_GREETING, RECORDS, RecordDecoder, encode_record
from mdp.transport.registry import LISTEN, Scheme, check_port, split_description

try:
    import resource
except ImportError:  # no resource module (Windows): no descriptor limit to read
    resource = None  # type: ignore[assignment]

log = Logger(namespace=__name__)  # (compiled, Logger() cannot find the module)

_ids = itertools.count(1)

#: descriptors kept back from accepted stream connections, at the least, for
#: everything else a process opens (ZeroMQ's sockets and its peers'
#: connections, connecting sockets, files, logs)
DESCRIPTOR_RESERVE = 64


#: select() watches descriptors below this only (FD_SETSIZE)
SELECT_LIMIT = 1024


def _select_based() -> bool:
    """Whether the installed reactor waits with select() (Twisted's default
    on macOS), which cannot watch a descriptor of SELECT_LIMIT or more."""
    installed = sys.modules.get("twisted.internet.reactor")
    module = sys.modules.get("twisted.internet.selectreactor")
    return module is not None and isinstance(installed, module.SelectReactor)


def descriptor_budget() -> Optional[int]:
    """How many accepted stream connections the process's descriptor limit
    (the soft ``RLIMIT_NOFILE``, and :data:`SELECT_LIMIT` under a select()
    reactor) leaves room for: all of it but an eighth (at least
    :data:`DESCRIPTOR_RESERVE`).  None where there is no limit."""
    limit: Optional[int] = None
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            limit = soft
    if _select_based():
        limit = SELECT_LIMIT if limit is None else min(limit, SELECT_LIMIT)
    if limit is None:
        return None
    return max(1, limit - max(DESCRIPTOR_RESERVE, limit // 8))


#: what the soft descriptor limit is raised to where the hard limit is
#: unlimited (macOS), in order: a kernel refuses an unlimited soft limit, and
#: macOS grants at least OPEN_MAX (10,240)
UNLIMITED_TARGETS = (65_536, 10_240)


def raise_descriptor_limit() -> int:
    """Raise the process's soft descriptor limit to its hard limit (as a
    server does at start: the soft limit is often 1,024; where the hard limit
    is unlimited, to the first of :data:`UNLIMITED_TARGETS` the kernel grants)
    and return the soft limit now in force (-1: none)."""
    if resource is None:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return -1
    if hard == resource.RLIM_INFINITY:
        targets = [target for target in UNLIMITED_TARGETS if target > soft]
    else:
        targets = [hard] if hard > soft else []
    for target in targets:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # more than the kernel grants (nr_open, OPEN_MAX)
            continue
        return target
    return soft


#: every listening side of the process, for the descriptor budget they share
_routers: weakref.WeakSet[StreamRouter] = weakref.WeakSet()

#: connections dropped to make room whose descriptors may be still open (they
#: close a reactor turn later) before newcomers are refused instead: an accept
#: burst at a cap spends at most these of the descriptor reserve
MAX_MAKING_ROOM = DESCRIPTOR_RESERVE // 2


#: Records of one batch are handed to the transport once they hold this many
#: bytes (Twisted's own write buffer size), so that a long burst still meets
#: the transport's flow control as it goes.
FLUSH_BYTES = 65536


def _direct_capable(transport: Any) -> bool:
    """*transport* is a plain TCP or UNIX socket connection of Twisted's: a
    batch may go straight to its socket while its own buffer is empty."""
    return (isinstance(transport, tcp.Connection) and not getattr(transport, "TLS", False)
            and hasattr(transport, "_tempDataBuffer") and hasattr(transport, "dataBuffer"))


def _no_delay(transport: Any) -> None:
    """Send each batch at once (``TCP_NODELAY``, as ZeroMQ does on its TCP
    sockets): with several replies in flight on one connection (channels),
    Nagle's algorithm held the last of them until the peer's delayed
    acknowledgment, up to 40 ms.  Transports that have no such option (a
    local socket) are left as they are."""
    setTcpNoDelay = getattr(transport, "setTcpNoDelay", None)
    if setTcpNoDelay is None:
        return
    try:
        setTcpNoDelay(True)
    except (OSError, AttributeError, NotImplementedError):
        pass


class FramedProtocol(Protocol):
    """One stream connection carrying framed multi-frame messages.

    What is sent is coalesced: the records of one batch (the messages sent
    while the input that caused them is being handled, or else within one
    reactor turn) go to the transport together, at most :data:`FLUSH_BYTES`
    at a time, and on a plain TCP or UNIX connection whose write buffer is
    empty, straight to its socket in one ``send``: one system call per batch
    instead of a write, a writability poll and two ``epoll_ctl`` calls."""

    limits: Limits = Limits()
    framing: IFraming = RECORDS
    #: the identity this side announces in its greeting (connecting side)
    identity: Optional[bytes] = None
    onMessage: Callable[[list[bytes]], None]
    throttle: Optional[LogThrottle] = None
    dropped = False  # drop() was called: deliver nothing more
    closedHere = False  # this side closed it (not the peer)
    #: why the stream was refused (reported with connectionLost), if it was
    refusal: Optional[ProtocolError] = None
    #: logs through twisted.logger only: mdp.uvreactor may read its
    #: transport without Twisted's legacy log context (2.6 µs a wake-up)
    needsLogContext = False

    #: records of the current batch, not yet handed to the transport
    _out: list[bytes]
    _outBytes = 0
    _direct = False

    def connectionMade(self) -> None:
        self.decoder = self.framing.decoder(self.limits)
        self.encode = self.framing.encode
        self._out = []
        self._direct = _direct_capable(self.transport)
        _no_delay(self.transport)
        greeting = self.framing.greeting(self.identity)
        if greeting:
            self.transport.write(greeting)

    def sendFrames(self, frames: list[bytes]) -> None:
        self._queue(self.encode(frames))

    def _queue(self, record: bytes) -> None:
        """Send *record* with the rest of this batch."""
        out = self._out
        out.append(record)
        self._outBytes += len(record)
        if self._outBytes >= FLUSH_BYTES:
            self.flushWrites()
        elif len(out) == 1:
            self._batchBegun()

    def _queueOn(self, channel: bytes, record: bytes) -> None:
        """Send *record* on *channel* (its four bytes go first; the record is
        not copied to join them) with the rest of this batch."""
        out = self._out
        out.append(channel)
        out.append(record)
        self._outBytes += 4 + len(record)
        if self._outBytes >= FLUSH_BYTES:
            self.flushWrites()
        elif len(out) == 2:
            self._batchBegun()

    def _batchBegun(self) -> None:
        """The first record of a batch is queued: see that it is flushed."""
        raise NotImplementedError

    def flushWrites(self) -> None:
        """Hand the records of this batch to the transport."""
        out = self._out
        if not out:
            return
        self._out = []
        self._outBytes = 0
        if self.dropped:
            return
        transport = self.transport
        if (self._direct and transport.connected and not transport.disconnecting
                and not transport._writeDisconnected and not transport.dataBuffer
                and not transport._tempDataBuffer):
            data = out[0] if len(out) == 1 else b"".join(out)
            sent = transport.writeSomeData(data)
            if not isinstance(sent, BaseException):
                if sent < len(data):
                    transport.write(data[sent:])  # the rest waits in Twisted's buffer
                return
            # the connection is broken: Twisted's own write finds that out and reports it
        transport.writeSequence(out)

    def dataReceived(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as e:
            before = getattr(e, "decoded", None)
            if before:  # whole messages that came before it: theirs, not lost with it
                self._deliverAll(before)
            self.refusal = e
            self.drop("{reason}", reason=e)
            return
        if messages:
            self._deliverAll(messages)

    def _deliverAll(self, messages: list[Any]) -> None:
        """Hand the messages of one read on, one by one, until the
        connection closes."""
        batch = self._batch = iter(messages)
        try:
            for frames in batch:
                self.onMessage(frames)
                if self.closing:
                    return
        finally:
            self._batch = None

    #: the messages of the read being delivered, those not delivered yet
    _batch: Any = None

    def discardBatch(self) -> int:
        """Drop the messages of this read not delivered yet; how many."""
        batch, self._batch = self._batch, None
        return 0 if batch is None else sum(1 for _ in batch)

    @property
    def closing(self) -> bool:
        return self.dropped or self.transport.disconnecting

    def drop(self, why: str, **fields: Any) -> None:
        """End the connection at once, logging *why* with the peer."""
        if self.dropped:
            return
        self.dropped = True
        self._warn("drop", "dropping stream peer {peer}: " + why, **fields)
        self.transport.abortConnection()

    def _warn(self, kind: str, why: str, **fields: Any) -> None:
        """Warn of *why* about the peer, throttled if the connection's owner
        throttles its warnings."""
        fields["peer"] = self.peerName()
        if self.throttle is not None:
            self.throttle.warn(log, kind, why, **fields)
        else:
            log.warn(why, **fields)

    def closeGracefully(self) -> None:
        """Close once what is written is sent.  A registered producer is
        unregistered first: Twisted keeps a connection whose paused producer
        is still registered open for good, waiting for more."""
        self.closedHere = True
        self.flushWrites()
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    def reportUnfinished(self) -> None:
        """At connectionLost: a peer that closed with a message begun lost
        that message; say so (a plain disconnect says nothing of it)."""
        decoder = getattr(self, "decoder", None)
        if self.dropped or self.closedHere or decoder is None or not decoder.inRecord:
            return
        self._warn("unfinished", "stream peer {peer} closed its connection in the middle of a "
                   "message ({held} bytes of it received): that message is lost",
                   held=decoder.buffered)

    def peerName(self) -> str:
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"


#: the listen queue of a stream listener unless the endpoint names one:
#: Twisted's default of 50 drops the SYNs of a client that opens a pool of
#: 100 connections at once, and each dropped one costs a second's retransmit
LISTEN_BACKLOG = 1024


def server_description(endpoint: str) -> str:
    """Accept the client forms ``tcp:host=H:port=P`` and ``unix:path=P`` for
    listening too, with a listen queue of :data:`LISTEN_BACKLOG` unless
    ``backlog=`` is given."""
    kind, _, rest = endpoint.partition(":")
    if kind in ("tcp", "tcp6", "ssl") and "host=" in rest:
        rest = ":".join(
            "interface=" + p[len("host="):] if p.startswith("host=") else p
            for p in rest.split(":")
        )
    elif kind == "unix" and rest.startswith("path="):
        rest = f"address={rest[len('path='):]}"
    if kind in ("tcp", "tcp6", "ssl", "unix") and "backlog=" not in rest:
        rest = f"{rest}:backlog={LISTEN_BACKLOG}"
    return f"{kind}:{rest}"


#: our addition to Twisted's ``ssl:`` server syntax: the PEM file of the
#: authorities whose client certificates a listener accepts (mutual TLS)
CA_CERTS = "caCerts"


def _without_ca(description: str) -> tuple[str, Optional[str]]:
    """*description* without its ``caCerts=FILE`` part, and FILE."""
    kind, _, rest = description.partition(":")
    if kind != "ssl" or f"{CA_CERTS}=" not in rest:
        return description, None
    parts, ca = [], None
    for part in rest.split(":"):
        if part.startswith(f"{CA_CERTS}="):
            ca = part[len(CA_CERTS) + 1:]
        else:
            parts.append(part)
    return f"{kind}:{':'.join(parts)}", ca


def _authorities(path: str) -> list[Any]:
    """The certificates in PEM file *path* (Twisted ``Certificate`` objects)."""
    from twisted.internet import ssl

    try:
        with open(path, "rb") as f:
            pem = f.read()
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


def server_endpoint(reactor: Any, description: str) -> Any:
    """The Twisted server endpoint for *description* (a
    :func:`server_description`): Twisted's own, or, for ``ssl:`` with
    ``caCerts=``, one that requires a client certificate those authorities
    signed."""
    plain, ca = _without_ca(description)
    if ca is None:
        return serverFromString(reactor, plain)
    from twisted.internet import ssl
    from twisted.internet.endpoints import SSL4ServerEndpoint

    authorities = _authorities(ca)
    args, kwargs = split_description(plain.partition(":")[2])
    _check_mutual(description, args, kwargs)
    try:
        with open(kwargs["privateKey"], "rb") as f:
            key = f.read()
        with open(kwargs.get("certKey", kwargs["privateKey"]), "rb") as f:
            cert = f.read()
        own = ssl.PrivateCertificate.loadPEM(cert + b"\n" + key)
    except KeyError:
        raise TransportError(f"{description}: an ssl: listener needs privateKey= (and "
                             "certKey=)") from None
    except Exception as e:
        raise TransportError(f"{description}: cannot load the server's certificate and key: "
                             f"{e}") from None
    # options with a trust root: OpenSSL requires a client certificate it signed
    return SSL4ServerEndpoint(reactor, int(kwargs.get("port", args[0] if args else 0)),
                              own.options(*authorities),
                              backlog=int(kwargs.get("backlog", LISTEN_BACKLOG)),
                              interface=kwargs.get("interface", ""))


#: what an ``ssl:`` listener with ``caCerts=`` takes (its options are ours)
_MUTUAL_KEYS = {"port", "interface", "backlog", "privateKey", "certKey"}


def _check_mutual(description: str, args: list[str], kwargs: dict[str, str]) -> None:
    """Refuse what an ``ssl:`` listener with ``caCerts=`` would not honour."""
    other = sorted(set(kwargs) - _MUTUAL_KEYS)
    if other or len(args) > 1:
        raise TransportError(f"bad endpoint {description!r}: with {CA_CERTS}= an ssl: listener "
                             f"takes only port, interface, backlog, privateKey and certKey "
                             f"(not {', '.join(other) or args[1]})")
    if "privateKey" not in kwargs:
        raise TransportError(f"bad endpoint {description!r}: an ssl: listener needs "
                             "privateKey=KEY.pem (and certKey=CERT.pem)")


def subject(certificate: Any) -> str:
    """A TLS certificate's subject as RFC 4514 text (``CN=worker-1,O=Example``)."""
    return certificate.to_cryptography().subject.rfc4514_string()


def connect_description(kind: str, port: IListeningPort) -> str:
    """The client endpoint string that reaches *port*."""
    address = port.getHost()
    if kind == "unix":
        return f"unix:path={address.name.decode() if isinstance(address.name, bytes) else address.name}"
    host = address.host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:  # IPv6: Twisted's tcp: client endpoint connects to it
        host = host.replace(":", r"\:")
        kind = "tcp" if kind == "tcp6" else kind
    return f"{kind}:host={host}:port={address.port}"


#: channels a connection may have ended here without the peer saying it
#: knows; beyond, the connection is dropped
MAX_UNACKNOWLEDGED = 64


@implementer(IPushProducer)
class _RouterConnection(FramedProtocol):
    """An accepted connection.  It is the push producer of its transport:
    while Twisted's write buffer is full it keeps what is sent in a backlog of
    its own, counted in bytes.

    A connection whose greeting asks for channels carries many peers: each
    channel is one, known to the router as the connection's id and the
    channel's, opened by its first message and ended by an empty record from
    either side (a channel this side ended is ignored until the peer's own
    empty record says it knows)."""

    router: StreamRouter
    peer: bytes
    greeted = False  # a first complete message arrived
    paused = False
    #: dropped to make room for a newer connection
    makingRoom = False
    #: its TLS client certificate's subject (None: none), once asked
    tlsSubject: Any = False

    def connectionMade(self) -> None:
        StreamRouter.accepted += 1  # first: connectionLost takes it off whatever happens
        router = self.router
        self.limits = router.limits
        self.framing = router.framing
        self.throttle = router.throttle
        super().connectionMade()
        self.peer = b"\x00" + next(_ids).to_bytes(4, "big")
        self.onMessage = self._deliver
        self.backlog: deque[bytes] = deque()
        self.backlogBytes = 0
        self._recordsAtArm = -1
        #: its open channels (channel -> the peer id it is known by)
        self.channels: dict[bytes, bytes] = {}
        #: channels this side ended, until the peer says it knows
        self.unacknowledged: set[bytes] = set()
        router.connections[self.peer] = self
        router.ungreeted[self.peer] = self
        self.transport.registerProducer(self, True)
        self._timer: Any = router.reactor.callLater(
            self.limits.handshakeTimeout, self._timedOut,
            "sent no message within {seconds:g}s of connecting", self.limits.handshakeTimeout)

    def subject(self) -> Optional[str]:
        """Its TLS client certificate's subject (None: no TLS, or no
        certificate), asked once."""
        identity = self.tlsSubject
        if identity is False:
            getPeerCertificate = getattr(self.transport, "getPeerCertificate", None)
            certificate = getPeerCertificate() if getPeerCertificate is not None else None
            identity = self.tlsSubject = (
                subject(certificate) if certificate is not None else None)
        return identity  # type: ignore[no-any-return]

    def _rename(self, identity: bytes) -> None:
        """The peer announced *identity*: know it by that from now on.  An
        older connection with the same identity is dropped (handover)."""
        router = self.router
        old = router.connections.get(identity)
        if old is not None and old is not self:
            if old.subject() != self.subject():
                # another certificate: another peer, which may not take it over
                self.drop("it announced identity {identity}, held by a connection with another "
                          "TLS certificate", identity=identity.hex())
                return
            # the identity lives on in this connection: the old one's loss is
            # not the peer's (its connectionLost finds it no longer registered)
            if router.ungreeted.get(identity) is old:
                del router.ungreeted[identity]
            old.drop("a newer connection took over its identity {identity}", identity=identity.hex())
        router.connections.pop(self.peer, None)
        ungreeted = router.ungreeted.pop(self.peer, None) is not None
        self.peer = identity
        router.connections[identity] = self
        if ungreeted:
            router.ungreeted[identity] = self

    def _deliver(self, frames: list[bytes]) -> None:
        if type(frames) is tuple:  # a (channel, frames) pair: it carries channels
            self._deliverOn(frames)  # type: ignore[arg-type]
            return
        if self.decoder.identity is not None and self.decoder.identity != self.peer:
            self._rename(self.decoder.identity)
            if self.closing:
                return  # refused the identity
        if not self.greeted:
            self._greet()
        self.router.receiver.messageReceived(self.peer, frames)

    def _greet(self) -> None:
        """It has shown itself a peer (a first message, or its framing's
        handshake): no more handshake deadline, and never crowded out."""
        self.greeted = True
        self.router.ungreeted.pop(self.peer, None)
        self._cancelTimer()

    def _deliverOn(self, item: tuple[bytes, list[bytes]]) -> None:
        """A record on one of its channels (see the class's docstring)."""
        channel, frames = item
        router = self.router
        peer = self.channels.get(channel)
        if not frames:  # the peer ended the channel, or knows that this side did
            if peer is not None:
                self._forgetChannel(channel)
                router.receiver.peerDisconnected(peer)
            else:
                self.unacknowledged.discard(channel)
            return
        if peer is None:
            if channel in self.unacknowledged:
                return  # sent before the peer knew the channel was ended
            full = router._fullOfChannels() if self.channels else None
            if full is not None:
                router.refused += 1
                self._warn("channel", "stream peer {peer} opened a channel over the cap ({full}): "
                           "ended it", full=full)
                self._end(channel)
                return
            if not self.channels:
                router.carriers += 1
            peer = self.channels[channel] = self.peer + channel
            router.channels[peer] = (self, channel)
        if not self.greeted:  # (a message, not an end, greets)
            self._greet()
        router.receiver.messageReceived(peer, frames)

    def _forgetChannel(self, channel: bytes) -> Optional[bytes]:
        """*channel* is no longer open: its peer id (None: it was not)."""
        peer = self.channels.pop(channel, None)
        if peer is not None:
            self.router.channels.pop(peer, None)
            if not self.channels:
                self.router.carriers -= 1
        return peer

    def _end(self, channel: bytes) -> None:
        """Tell the peer *channel* is ended; ignore it until the peer says it
        knows (a peer that never does, past a cap, is dropped)."""
        self.sendOn(channel, [])
        self.unacknowledged.add(channel)
        if len(self.unacknowledged) > MAX_UNACKNOWLEDGED:
            self.drop("it did not acknowledge the end of {count} channels",
                      count=len(self.unacknowledged))

    def endChannel(self, channel: bytes) -> None:
        """End *channel* (the router's ``disconnectPeer``): its peer is
        reported disconnected at the next reactor turn, as a connection's
        would be once closed."""
        peer = self._forgetChannel(channel)
        if peer is None:
            return
        router = self.router
        if not self.closing:
            self._end(channel)
        router.reactor.callLater(0, router._channelEnded, peer)

    #: (a connection that carries channels) its flush at the end of the turn
    _turnCall: Any = None

    def _batchBegun(self) -> None:
        if getattr(self.decoder, "channels", False):
            # it carries many peers, whose replies come from many reads in
            # one turn (one a worker): they go out together at its end
            if self._turnCall is None:
                self._turnCall = call_soon(self.router.reactor, self._flushTurn)
            return
        router = self.router
        router.dirty.append(self)
        if not router.reading and router.flushCall is None:
            router.flushCall = router.reactor.callLater(0, router.flushWrites)

    def _flushTurn(self) -> None:
        self._turnCall = None
        self.flushWrites()

    def _cancelTurn(self) -> None:
        call, self._turnCall = self._turnCall, None
        if call is not None:  # (pending: it clears this when it runs)
            call.cancel()

    def dataReceived(self, data: bytes) -> None:
        router = self.router
        router.reading += 1
        try:
            self._received(data)
        finally:
            router.reading -= 1
            if not router.reading and router.dirty:
                router.flushWrites()

    def _received(self, data: bytes) -> None:
        super().dataReceived(data)
        if not self.greeted and not self.closing and getattr(self.decoder, "handshaken", False):
            # its framing's handshake is done (SP's header): a peer, however
            # long it stays quiet now, as nng's are
            self._greet()
        if not self.greeted or self.closing:
            return  # the handshake deadline covers a first record
        decoder = self.decoder
        if decoder.inRecord:
            if self._timer is None or self._recordsAtArm != decoder.records:
                # a record has begun since the timer was armed (or none is armed)
                self._cancelTimer()
                self._recordsAtArm = decoder.records
                self._timer = self.router.reactor.callLater(
                    self.limits.recordTimeout, self._timedOut,
                    "a record of theirs stayed incomplete for {seconds:g}s ({held} bytes held)",
                    self.limits.recordTimeout)
        elif self._timer is not None:
            self._cancelTimer()

    def _timedOut(self, why: str, seconds: float) -> None:
        self._timer = None
        self.drop(why, seconds=seconds, held=self.decoder.buffered)

    def _cancelTimer(self) -> None:
        self._timer = cancel_call(self._timer)

    def send(self, frames: list[bytes]) -> None:
        if self.closing:
            return
        record = self.encode(frames)
        if not self.paused and not self.backlog:
            self._queue(record)
            return
        self._hold(record)

    def sendOn(self, channel: bytes, frames: list[bytes]) -> None:
        """Send *frames* on *channel* (empty: end it)."""
        if self.closing:
            return
        record = self.encode(frames)
        if not self.paused and not self.backlog:
            self._queueOn(channel, record)
            return
        self._hold(channel + record)

    def _hold(self, record: bytes) -> None:
        """Keep *record* while the transport's buffer is full, within
        ``maxOutputBytes``."""
        self.backlog.append(record)
        self.backlogBytes += len(record)
        if self.backlogBytes > self.limits.maxOutputBytes:
            self.router.overflows += 1
            self.drop("it reads slower than it is sent to ({held} bytes unsent, over the limit "
                      "of {limit})", held=self.backlogBytes, limit=self.limits.maxOutputBytes)
            self.backlog.clear()
            self.backlogBytes = 0

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        backlog = self.backlog
        while backlog and not self.paused:
            record = backlog.popleft()
            self.backlogBytes -= len(record)
            self.transport.write(record)

    def stopProducing(self) -> None:
        self.backlog.clear()
        self.backlogBytes = 0

    def closeGracefully(self) -> None:
        """Close once what is written is sent, or at the latest after
        ``recordTimeout``: a peer that does not read would otherwise keep
        its slot and what was written to it for good (and its loss would
        never be reported), as Twisted's HTTP server's ``abortTimeout`` has
        it."""
        if self.dropped or self.closedHere:
            return  # closing already (its deadline set)
        self.flushWrites()
        self.transport.writeSequence(list(self.backlog))
        self.stopProducing()
        super().closeGracefully()
        if not self.dropped:
            self._cancelTimer()
            self._timer = self.router.reactor.callLater(
                self.limits.recordTimeout, self._timedOut,
                "it did not take what was sent to it within {seconds:g}s of being disconnected",
                self.limits.recordTimeout)

    def connectionLost(self, reason: object = None) -> None:
        StreamRouter.accepted -= 1
        if self.makingRoom:
            StreamRouter.makingRoom -= 1
        self.reportUnfinished()
        self._cancelTimer()
        self._cancelTurn()
        self._out = []
        self._outBytes = 0
        self.backlog.clear()
        router = self.router
        if router.ungreeted.get(self.peer) is self:
            del router.ungreeted[self.peer]
        channels, self.channels = self.channels, {}
        if channels and not router.closed:
            router.carriers -= 1
        for peer in channels.values():
            if router.channels.pop(peer, None) is not None:
                router.receiver.peerDisconnected(peer)
        if router.connections.get(self.peer) is self:
            del router.connections[self.peer]
            if not getattr(self.decoder, "channels", False):  # (its channels were the peers)
                router.receiver.peerDisconnected(self.peer)


class _Refused(Protocol):
    """A connection refused at a cap: closed at once (Twisted closes the
    socket of a plain TCP or UNIX listener whose factory returns None, but a
    TLS wrapper keeps it open), counted until its descriptor is closed."""

    def connectionMade(self) -> None:
        StreamRouter.accepted += 1
        self.transport.abortConnection()

    def connectionLost(self, reason: object = None) -> None:
        StreamRouter.accepted -= 1


@implementer(IRouterTransport, IAuthenticatedRouter)
class StreamRouter:
    """The bound side over a Twisted server endpoint.

    :meth:`listen` binds an endpoint string; :meth:`factory` is the same thing
    as a plain :class:`~twisted.internet.interfaces.IProtocolFactory`, for
    listening with an endpoint, a TLS wrapper or an ``Application`` of one's
    own."""

    #: accepted connections open in the process (their descriptors), and of
    #: those, the ones dropped to make room that have not closed yet
    accepted = 0
    makingRoom = 0

    def __init__(self, receiver: IRouterReceiver, reactor: Any = None, *,
                 limits: Limits = Limits(), framing: IFraming = RECORDS) -> None:
        self.receiver = receiver
        self.reactor = default_reactor(reactor)
        self.limits = limits
        self.framing = framing
        #: sendMessage takes any buffer as a frame where the framing does
        self.acceptsBuffers = getattr(framing, "acceptsBuffers", False)
        self.throttle = LogThrottle(self.reactor)
        self.connections: dict[bytes, _RouterConnection] = {}
        #: the channels of connections that carry them (peer id ->
        #: connection, channel)
        self.channels: dict[bytes, tuple[_RouterConnection, bytes]] = {}
        #: connections that carry at least one open channel
        self.carriers = 0
        #: close() was called
        self.closed = False
        #: connections that have not yet sent a message, oldest first
        self.ungreeted: OrderedDict[bytes, _RouterConnection] = OrderedDict()
        self.port: Optional[IListeningPort] = None
        self.endpoint = ""
        #: peers disconnected for not reading their messages
        self.overflows = 0
        #: connections refused at maxConnections
        self.refused = 0
        #: input being handled (nesting depth): what is sent meanwhile is
        #: flushed once it has been
        self.reading = 0
        #: connections with records waiting to be flushed
        self.dirty: list[_RouterConnection] = []
        self.flushCall: Any = None
        #: how many connections the process's descriptors leave room for
        #: (None: no cap), asked at each new connection
        self.descriptorBudget: Callable[[], Optional[int]] = descriptor_budget
        #: its factory may be wrapped (TLS): a refused connection then needs
        #: a protocol that closes it (a wrapper keeps a None protocol's socket
        #: open); a plain TCP or UNIX port closes it at once
        self.wrapped = True
        #: :meth:`listen` opens its port (it says what the budget is itself)
        self._listening = False
        _routers.add(self)

    def flushWrites(self) -> None:
        """Hand every connection's batch of records to its transport."""
        self.flushCall = cancel_call(self.flushCall)
        while self.dirty:
            dirty, self.dirty = self.dirty, []
            for connection in dirty:
                connection.flushWrites()

    def buildProtocol(self, addr: object) -> Optional[Protocol]:
        full = self._full()
        if full is not None:
            # make room: the oldest connection that has said nothing, here
            # (at its own cap: never another listener's) or, at the
            # process's cap, on any listener
            routers = [self] if self._peers() >= self.limits.maxConnections else [
                self, *(router for router in _routers if router is not self)]
            idle = next((router for router in routers if router.ungreeted), None)
            if idle is not None and StreamRouter.makingRoom < MAX_MAKING_ROOM:
                _, connection = idle.ungreeted.popitem(last=False)
                connection.makingRoom = True
                StreamRouter.makingRoom += 1
                connection.drop("making room for a new connection ({full}) before it sent a message",
                                full=full)
                idle._forget(connection)
            else:
                self.refused += 1
                self.throttle.warn(log, "refused", "stream listener {endpoint} refused a connection "
                                   "from {address}: {full}",
                                   endpoint=self.endpoint, address=str(addr), full=full)
                return _Refused() if self.wrapped else None
        proto = _RouterConnection()
        proto.router = self
        return proto

    def _peers(self) -> int:
        """The peers that count against ``maxConnections``: its connections
        and the channels they carry (a connection's first channel takes the
        connection's place)."""
        return len(self.connections) + len(self.channels) - self.carriers

    def _full(self) -> Optional[str]:
        """Why no connection may be added now (a cap is reached), or None."""
        if self._peers() >= self.limits.maxConnections:
            return f"{self.limits.maxConnections} connections and channels open (maxConnections)"
        budget = self.descriptorBudget()
        if budget is not None and StreamRouter.accepted >= budget:
            return (f"{StreamRouter.accepted} connections open in the process, all that its "
                    f"descriptor limit leaves room for (raise it: ulimit -n)")
        return None

    def _fullOfChannels(self) -> Optional[str]:
        """Why a connection may not open one more channel now, or None:
        every channel but a connection's first counts as a connection
        against ``maxConnections`` (its first takes the connection's place)."""
        if self._peers() >= self.limits.maxConnections:
            return f"{self.limits.maxConnections} connections and channels open (maxConnections)"
        return None

    def _channelEnded(self, peer: bytes) -> None:
        if not self.closed:
            self.receiver.peerDisconnected(peer)

    def _checkBudget(self) -> None:
        """Say at start when the descriptor limit, not maxConnections, is
        the cap: the operator may want to raise it."""
        budget = self.descriptorBudget()
        if budget is not None and budget < self.limits.maxConnections:
            log.warn("stream listener {endpoint}: the process's descriptor limit leaves room for "
                     "{budget} connections, fewer than maxConnections ({limit}); raise it "
                     "(ulimit -n) to let more in", endpoint=self.endpoint or "(embedded)",
                     budget=budget, limit=self.limits.maxConnections)

    def _factoryStarted(self) -> None:
        # on a port of the application's; :meth:`listen` warns once it
        # knows its own port's address
        if self.port is None and not self._listening:
            self._checkBudget()

    def _forget(self, connection: _RouterConnection) -> None:
        """Stop counting an aborted connection at once (its connectionLost
        comes a reactor turn later)."""
        if self.connections.get(connection.peer) is connection:
            del self.connections[connection.peer]
            self.receiver.peerDisconnected(connection.peer)

    def factory(self) -> Factory:
        """An :class:`IProtocolFactory` whose connections this router serves
        (for a port of the application's own; it warns, as :meth:`listen`
        does, when it starts and the descriptor limit is the cap)."""
        factory = Factory.forProtocol(lambda: None)
        factory.buildProtocol = self.buildProtocol  # type: ignore[method-assign]
        factory.startFactory = self._factoryStarted  # type: ignore[method-assign]
        factory.noisy = False
        return factory

    @classmethod
    def listen(
        cls, endpoint: str, receiver: IRouterReceiver, reactor: Any, *, limits: Limits = Limits(),
        framing: IFraming = RECORDS,
    ) -> defer.Deferred[StreamRouter]:
        router = cls(receiver, reactor, limits=limits, framing=framing)
        description = server_description(endpoint)
        try:
            server = server_endpoint(reactor, description)
        except TransportError as e:
            return defer.fail(e)
        factory = router.factory()
        router.wrapped = description.partition(":")[0].lower() not in ("tcp", "tcp6", "unix")
        router._listening = True

        def listening(port: IListeningPort) -> StreamRouter:
            router.port = port
            router.endpoint = connect_description(description.partition(":")[0], port)
            router._checkBudget()
            return router

        def failed(failure: Failure) -> Failure:
            if failure.check(TransportError):
                return failure
            return Failure(TransportError(f"cannot listen on {endpoint}: "
                                          f"{failure.getErrorMessage()}"))

        return server.listen(factory).addCallbacks(listening, failed)

    def peerAddress(self, peer: bytes) -> Optional[str]:
        """Where *peer*'s connection comes from (Twisted's address of it:
        ``IPv4Address(TCP, '127.0.0.1', 50312)``), or None once it is gone."""
        connection = self._connectionOf(peer)
        return None if connection is None else connection.peerName()

    def peerIdentity(self, peer: bytes) -> Optional[str]:
        """The subject of *peer*'s TLS client certificate (mutual TLS), or
        None (no TLS, or no certificate)."""
        connection = self._connectionOf(peer)
        return None if connection is None else connection.subject()

    def _connectionOf(self, peer: bytes) -> Optional[_RouterConnection]:
        """The connection *peer* is, or carries it as a channel (None: gone)."""
        connection = self.connections.get(peer)
        if connection is None:
            connection, _ = self.channels.get(peer, (None, None))
        return connection

    def sendMessage(self, peer: bytes, frames: list[bytes]) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.send(frames)
            return
        channel = self.channels.get(peer)
        if channel is not None:
            channel[0].sendOn(channel[1], frames)

    def disconnectPeer(self, peer: bytes) -> None:
        connection = self.connections.get(peer)
        if connection is not None:
            connection.closeGracefully()
            return
        channel = self.channels.get(peer)
        if channel is not None:
            channel[0].endChannel(channel[1])

    def close(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        self.closed = True
        self.channels.clear()
        self.carriers = 0
        self.flushCall = cancel_call(self.flushCall)
        self.dirty = []
        for connection in list(self.connections.values()):
            connection.closedHere = True
            connection.dropped = True  # nothing more of a read under way is delivered
            connection._cancelTurn()
            connection.transport.abortConnection()
        self.connections.clear()
        self.ungreeted.clear()
        if port is None:
            return defer.succeed(None)
        return defer.maybeDeferred(port.stopListening)


def _forwarders() -> dict[type, str]:
    """Twisted's protocol wrappers that only pass ``dataReceived`` on to the
    protocol they wrap, with the attribute that holds it: the endpoint's
    (which fires the connection's Deferred) and ClientService's proxy
    (which reports the connection's loss).  Private classes: a Twisted
    without them has none to skip."""
    found = {}
    for module, name, inner in (("twisted.internet.endpoints", "_WrappingProtocol",
                                 "_wrappedProtocol"),
                                ("twisted.application._client_service",
                                 "_ReconnectingProtocolProxy", "_protocol")):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        found[cls] = inner
    return found


_FORWARDERS = _forwarders()


def _shortcut_reads(protocol: Protocol) -> None:
    """Hand *protocol*'s ``dataReceived`` to the outermost wrapper its
    transport calls, where every wrapper between only passes reads on: a
    read otherwise went through the endpoint's wrapper (a Python call) and
    ClientService's proxy, which forwards through ``__getattr__`` (each
    lookup failing first, an AttributeError made and dropped)."""
    outer = inner = getattr(protocol.transport, "protocol", None)
    for _ in range(len(_FORWARDERS)):
        attribute = _FORWARDERS.get(type(inner))
        if attribute is None:
            break
        inner = getattr(inner, attribute, None)
    if inner is protocol and outer is not protocol:
        outer.dataReceived = protocol.dataReceived  # type: ignore[union-attr]


#: seconds a connection must stay up, if nothing comes from the far side, to
#: count as made: one lost sooner (a listener at its cap accepts and closes
#: at once) is a failed attempt, so the backoff grows.  Our far sides never
#: speak first (a broker waits for its client's request and its worker's
#: READY), so silence alone proves nothing against a connection.
PROVEN_AFTER = 1.0


@implementer(IPushProducer, IHandshakeListener)
class _DealerConnection(FramedProtocol):
    """The connecting side's protocol; it registers itself as the producer of
    its transport, which pauses it while its write buffer is full."""

    dealer: StreamDealer
    paused = False
    #: when it was made (connected, and over TLS, the handshake done); None:
    #: not yet
    madeAt: Optional[float] = None
    #: the far side took it: made, and then something came from it or it
    #: stayed up :data:`PROVEN_AFTER` seconds
    proven = False

    #: (a framing with a handshake, SP's) waiting for the peer's greeting:
    #: the timer that drops it if none comes, and what came meanwhile
    _awaiting: Any = None
    _early: Optional[list[Any]] = None

    def connectionMade(self) -> None:
        self.limits = self.dealer.limits
        self.framing = self.dealer.framing
        self.identity = self.dealer.identity
        super().connectionMade()
        awaits = getattr(self.decoder, "handshaken", None) is False
        if not awaits and not INegotiated.providedBy(self.transport):
            self.handshakeCompleted()
        _shortcut_reads(self)
        self.transport.registerProducer(self, True)
        if awaits:
            # not the dealer's connection until the peer's greeting says it
            # speaks the counterpart (a hung process, another service on the
            # port, would take requests and answer none)
            self._early = []
            self.onMessage = self._early.append
            self._awaiting = self.dealer.reactor.callLater(
                self.limits.handshakeTimeout, self._noGreeting)
            return
        self.dealer._made(self)

    def _noGreeting(self) -> None:
        self._awaiting = None
        self.refusal = ProtocolError(f"no {self.framing.name} greeting within "
                                     f"{self.limits.handshakeTimeout:g}s of connecting")
        self.drop("it sent no {framing} greeting within {seconds:g}s of connecting",
                  framing=self.framing.name, seconds=self.limits.handshakeTimeout)

    def _greeted(self) -> None:
        self._awaiting = cancel_call(self._awaiting)
        early, self._early = self._early or [], None
        if not INegotiated.providedBy(self.transport):
            self.handshakeCompleted()
        self.dealer._made(self)
        for frames in early:  # (a peer that spoke first: in order)
            if self.closing or self.dealer.protocol is not self:
                break
            self.onMessage(frames)

    reading = False
    _flushCall: Any = None

    def _batchBegun(self) -> None:
        if not self.reading and self._flushCall is None:
            self._flushCall = self.dealer.reactor.callLater(0, self.flushWrites)

    def flushWrites(self) -> None:
        self._flushCall = cancel_call(self._flushCall)
        super().flushWrites()

    def dataReceived(self, data: bytes) -> None:
        self.reading = True
        try:
            super().dataReceived(data)
            if self._awaiting is not None and not self.closing and self.decoder.handshaken:
                self._greeted()
            if not self.proven and self.madeAt is not None and not self.closing:
                self._prove()
        finally:
            self.reading = False
            if self._out:
                self.flushWrites()

    def connectionLost(self, reason: object = None) -> None:
        self._awaiting = cancel_call(self._awaiting)
        self.paused = False
        self.reportUnfinished()
        self._flushCall = cancel_call(self._flushCall)
        self._out = []
        self._outBytes = 0
        if (not self.proven and self.madeAt is not None
                and self.dealer.reactor.seconds() - self.madeAt >= PROVEN_AFTER):
            self._prove()
        if not self.proven and not self.closedHere:  # (closed here: no one turned it away)
            self.dealer._unproven += 1
        self.dealer._lost(self, Failure(self.refusal) if self.refusal is not None else reason)

    def handshakeCompleted(self) -> None:
        self.madeAt = self.dealer.reactor.seconds()

    def _prove(self) -> None:
        """The far side took it: the backoff starts again."""
        self.proven = True
        self.dealer._unproven = 0

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self.dealer._resumed(self)

    def beforeStop(self) -> None:
        """Its ClientService is about to close it (with loseConnection()):
        what was sent goes first, and no producer keeps it open (see
        closeGracefully)."""
        self.closedHere = True
        self.flushWrites()
        self.transport.unregisterProducer()

    def stopProducing(self) -> None:
        self.paused = False


class _ReportingEndpoint:
    """A client endpoint that tells its dealer of each failed connection
    attempt, and names itself by its endpoint string in ClientService's
    retry lines (not ``<...Endpoint object at 0x...>``)."""

    def __init__(self, endpoint: Any, description: str, failed: Callable[[Any], None]) -> None:
        self.endpoint = endpoint
        self.description = description
        self.failed = failed

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        def failed(failure: Any) -> Any:
            self.failed(failure.value)
            return failure

        return self.endpoint.connect(factory).addErrback(failed)

    def __str__(self) -> str:
        return self.description

    __repr__ = __str__


def _connection(owner: Any, endpoint: str,
                retryPolicy: Optional[Callable[[int], float]]) -> ClientService:
    """A started :class:`ClientService` keeping one connection to *endpoint*
    for *owner* (its ``reactor``, ``_buildProtocol``, ``_failed`` and
    ``_unproven``).

    ClientService starts its backoff again at each connection it makes; a
    connection whose TLS handshake then fails, or that is lost within
    :data:`PROVEN_AFTER` seconds with nothing received (a listener at its
    cap closes newcomers at once), counts here as a failed attempt too
    (``owner._unproven`` counts them in a row), so it is retried with the
    backoff, not every half second."""
    factory = Factory.forProtocol(lambda: None)
    factory.buildProtocol = owner._buildProtocol  # type: ignore[method-assign]
    factory.noisy = False
    policy = retryPolicy or RECONNECT.retryPolicy()
    service = ClientService(
        _ReportingEndpoint(clientFromString(owner.reactor, endpoint), endpoint, owner._failed),
        factory,
        retryPolicy=lambda attempt: policy(attempt + max(0, owner._unproven - 1)),
        clock=owner.reactor,
    )
    service.startService()
    return service


class _OneConnection:
    """Flow control of a connecting side's one connection (``protocol``,
    None while down): writable while its transport takes more; and what is
    sent while it is down, kept for the next one within ``maxQueued``
    messages and ``limits.maxOutputBytes``."""

    maxQueued = 1000
    #: who refuses a message over those bounds, in the warning
    kind = "stream dealer"
    #: connections in a row lost before they were proven (their TLS
    #: handshake failed, or they were closed at once, nothing received)
    _unproven = 0
    protocol: Optional[_DealerConnection]
    _waiters: DrainWaiters
    endpoint: str
    limits: Limits
    queuedBytes: int
    _throttle: LogThrottle
    framing: Any

    def _admit(self, frames: list[bytes], count: int) -> Optional[int]:
        """What *frames* cost held (:func:`held_bytes`) if they may wait, with
        *count* messages and ``queuedBytes`` waiting already, or None, with a
        warning, past the bounds.  A message the connection could not send
        (a frame that is not bytes: ``TypeError``) raises here, as it does
        while connected: held, it would fail the next connection's start and
        lose what waits behind it."""
        size = held_bytes(frames)
        if count >= self.maxQueued or self.queuedBytes + size > self.limits.maxOutputBytes:
            self._throttle.warn(log, "full", "{kind} to {endpoint} refused a message: "
                                "{count} messages ({bytes} bytes) already wait for the connection",
                                kind=self.kind, endpoint=self.endpoint, count=count,
                                bytes=self.queuedBytes)
            return None
        self.framing.encode(frames)
        return size

    @property
    def writable(self) -> bool:
        return self.protocol is None or not self.protocol.paused

    def drained(self) -> defer.Deferred[None]:
        if self.writable:
            return defer.succeed(None)
        return self._waiters.wait()

    def _resumed(self, proto: _DealerConnection) -> None:
        if proto is self.protocol:
            self._waiters.fire()


@implementer(IDealerTransport)
class StreamDealer(_OneConnection):
    """The connecting side: one :class:`ClientService`-managed connection.

    Messages sent while no connection is up wait (at most ``maxQueued`` of
    them and ``limits.maxOutputBytes`` in all; beyond, they are refused with a
    warning) and go out after the next ``connectionMade``."""

    def __init__(
        self,
        endpoint: str,
        receiver: IDealerReceiver,
        reactor: Any,
        *,
        retryPolicy: Optional[Callable[[int], float]] = None,
        limits: Limits = Limits(),
        framing: IFraming = RECORDS,
        identity: Optional[bytes] = None,
    ) -> None:
        self.endpoint = endpoint
        self.receiver = receiver
        self.reactor = reactor
        self.limits = limits
        self.framing = framing
        self.identity = identity
        self.protocol: Optional[_DealerConnection] = None
        self.queue: deque[list[bytes]] = deque()
        self.queuedBytes = 0
        self._throttle = LogThrottle(reactor)
        self._waiters = DrainWaiters()
        self.service = _connection(self, endpoint, retryPolicy)

    def _buildProtocol(self, addr: object) -> _DealerConnection:
        proto = _DealerConnection()
        proto.dealer = self
        return proto

    @property
    def connected(self) -> bool:
        return self.protocol is not None

    def discardReceived(self) -> int:
        """The records of the read being delivered that are not delivered
        yet (what has come is handed on as it is read)."""
        return 0 if self.protocol is None else self.protocol.discardBatch()

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto
        proto.onMessage = self.receiver.messageReceived
        try:
            self.receiver.connectionMade()
        except Exception:
            # logged, and the connection stands: raised, it would be left
            # half made, and never made again once lost
            log.failure("stream dealer to {endpoint}: its receiver's connectionMade failed",
                        endpoint=self.endpoint)
        while self.queue and self.protocol is proto:
            proto.sendFrames(self.queue.popleft())
        if not self.queue:
            self.queuedBytes = 0

    def _failed(self, reason: Any) -> None:
        """A connection attempt failed: a receiver with a ``connectionFailed``
        method hears why (a refused connection, say, is then known at once)."""
        report = getattr(self.receiver, "connectionFailed", None)
        if report is not None and self.service.running:
            report(reason)

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is proto:
            self.protocol = None
            self._waiters.fire()
        if not self.service.running:
            return
        if proto._early is not None:
            # never the receiver's connection (its peer's greeting did not
            # come): a failed attempt, as a refused connection is
            self._failed(reason.value if isinstance(reason, Failure) else reason)
            return
        self.receiver.connectionLost(reason)

    def sendMessage(self, frames: list[bytes]) -> None:
        if self.protocol is not None:
            self.protocol.sendFrames(frames)
            return
        if not self.service.running:
            return
        size = self._admit(frames, len(self.queue))
        if size is not None:  # (else refused, with a warning)
            self.queue.append(list(frames))
            self.queuedBytes += size

    _closing: Optional[defer.Deferred[None]] = None

    def close(self) -> defer.Deferred[None]:
        self.queue.clear()
        self.queuedBytes = 0
        self._waiters.fire()
        if self._closing is None:
            if self.protocol is not None:
                self.protocol.beforeStop()
            self._closing = self.service.stopService()
        closed: defer.Deferred[None] = defer.Deferred()
        self._closing.addBoth(lambda result: (closed.callback(None), result)[1])
        return closed


# --- many pipes over one connection ------------------------------------------


@implementer(IFraming)
class _ChannelsFraming:
    """The record framing of a connection that carries channels, as its
    connecting side speaks it: the channels greeting, and a decoder that
    expects a channel in every record."""

    name = "records32-channels"
    acceptsBuffers = True

    def greeting(self, identity: Optional[bytes]) -> bytes:
        return CHANNELS_GREETING

    def encode(self, frames: list[bytes]) -> bytes:
        return encode_record(frames)

    def decoder(self, limits: Limits) -> RecordDecoder:
        decoder = RecordDecoder(limits)
        decoder.channels = True
        return decoder


_CHANNELS = _ChannelsFraming()

#: what ends a channel: a record of no frames
_END = encode_record([])


class _ChannelsConnection(_DealerConnection):
    """The connection of a :class:`StreamChannels`: each read's messages go
    to it, which hands each to its channel."""

    dealer: StreamChannels  # type: ignore[assignment]

    def _deliverAll(self, messages: list[Any]) -> None:
        self.dealer._dispatch(self, messages)


@implementer(IDealerTransport)
class _StreamChannel:
    """One pipe of a :class:`StreamChannels`: what a connection of its own
    would be, with its own peer id at the far end."""

    #: the four bytes that name it on the connection
    id = b""
    up = False
    closed = False
    #: times the far side ended it in a row (paces opening it again)
    ends = 0
    _call: Any = None
    #: what it sent while not up, in order (None: nothing), and its cost
    #: (:func:`held_bytes`): sent once it is up
    held: Optional[deque[list[bytes]]] = None
    heldBytes = 0

    def __init__(self, link: StreamChannels, receiver: IDealerReceiver) -> None:
        self.link = link
        self.receiver = receiver
        self.endpoint = link.endpoint

    @property
    def connected(self) -> bool:
        return self.up

    @property
    def writable(self) -> bool:
        return self.link.writable

    def drained(self) -> defer.Deferred[None]:
        return self.link.drained()

    def discardReceived(self) -> int:
        """The messages for it in the read being delivered that are not
        delivered yet (the other channels' stay)."""
        return self.link._discard(self.id)

    def sendMessage(self, frames: list[bytes]) -> None:
        proto = self.link.protocol
        if self.up and proto is not None:
            proto._queueOn(self.id, proto.encode(frames))
        elif not self.closed:
            self.link._hold(self, frames)

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed = True
            self.up = False
            self._call = cancel_call(self._call)
            self.link._forget(self)
        return defer.succeed(None)

    def _up(self) -> None:
        self._call = cancel_call(self._call)
        proto = self.link.protocol
        # (not on a connection closing: what it held would go with it; the
        # next connection brings it up)
        if (not self.closed and not self.up and proto is not None and not proto.closing
                and not proto.closedHere):
            self.up = True
            try:
                self.receiver.connectionMade()
            except Exception:  # logged: the connection and its other channels stand
                log.failure("stream channel to {endpoint}: its receiver's connectionMade failed",
                            endpoint=self.link.endpoint)
            # then what it sent before (as a StreamDealer's queue goes after
            # its receiver's connectionMade); held again if it went down
            for frames in self.link._release(self):
                self.sendMessage(frames)

    def _down(self, reason: object) -> None:
        self._call = cancel_call(self._call)
        if self.up:
            self.up = False
            self.receiver.connectionLost(reason)


@implementer(IDealerChannels)
class StreamChannels(_OneConnection):
    """The connecting side of one connection (:class:`ClientService`-managed,
    so it reconnects with backoff) that carries many pipes, its *channels*
    (``framing``'s docstring has the wire form).  Each pipe
    (:meth:`open`) behaves as a connection of its own: it is up while the
    connection is, the far side's router knows it as a peer of its own, and
    the far side may end it alone (it is then lost, and made again after the
    reconnection delay, under a new channel).  What the pipes send in one
    reactor turn goes out in one write, and their replies come in one read.

    The connection is opened with the first pipe and closed with the last."""

    kind = "stream channels"

    def __init__(self, endpoint: str, reactor: Any, *,
                 retryPolicy: Optional[Callable[[int], float]] = None,
                 limits: Limits = Limits()) -> None:
        self.endpoint = endpoint
        self.reactor = reactor
        self.limits = limits
        self.framing = _CHANNELS
        self.identity = None
        self.retryPolicy = retryPolicy or RECONNECT.retryPolicy()
        #: the open pipes, by channel
        self.channels: dict[bytes, _StreamChannel] = {}
        self.protocol: Optional[_ChannelsConnection] = None
        self.service: Optional[ClientService] = None
        #: messages its pipes hold (sent while not up: each pipe keeps its
        #: own until it is up, none is sent twice), and their bytes: bounded
        #: together by ``maxQueued`` and ``limits.maxOutputBytes``
        self.queued = 0
        self.queuedBytes = 0
        self._next = 0
        #: fires once the connection being closed is (None: none is)
        self._closing: Optional[defer.Deferred[None]] = None
        self._throttle = LogThrottle(reactor)
        self._waiters = DrainWaiters()
        #: the messages of the read being delivered, and the next one's index
        self._pending: Optional[list[Any]] = None
        self._at = 0
        self._waiting: dict[bytes, int] = {}

    def open(self, receiver: IDealerReceiver) -> _StreamChannel:
        """A new pipe: ``receiver.connectionMade`` is called once it is up."""
        channel = _StreamChannel(self, receiver)
        self._name(channel)
        if self.service is None:
            self.service = _connection(self, self.endpoint, self.retryPolicy)
        elif self.protocol is not None:  # up already: it is too, at the next turn
            channel._call = self.reactor.callLater(0, channel._up)
        return channel

    def _name(self, channel: _StreamChannel) -> None:
        """Give *channel* a channel not in use (none is used twice while the
        far side may still send on it)."""
        while True:
            self._next = self._next % 0xFFFFFFFF + 1
            name = self._next.to_bytes(4, "big")
            if name not in self.channels:
                break
        channel.id = name
        self.channels[name] = channel

    def _buildProtocol(self, addr: object) -> _ChannelsConnection:
        proto = _ChannelsConnection()
        proto.dealer = self  # type: ignore[assignment]
        return proto

    def _made(self, proto: _DealerConnection) -> None:
        self.protocol = proto  # type: ignore[assignment]
        for channel in list(self.channels.values()):
            if self.protocol is not proto:
                return
            channel._up()  # (and sends what it held)

    def _failed(self, reason: Any) -> None:
        """A connection attempt failed: the pipes' receivers that have a
        ``connectionFailed`` hear why."""
        if self.service is None or not self.service.running or isinstance(
                reason, defer.CancelledError):  # (a stopped service's attempt)
            return
        for channel in list(self.channels.values()):
            report = getattr(channel.receiver, "connectionFailed", None)
            if report is not None and not channel.closed:
                report(reason)

    def _lost(self, proto: _DealerConnection, reason: object) -> None:
        if self.protocol is not proto:
            return
        self.protocol = None
        self._waiters.fire()
        # a record refused for its size was one pipe's: the others only lost
        # the connection (what they had in flight goes again)
        too_large = getattr(proto.refusal, "channel", None)
        others = reason
        if too_large is not None:
            others = Failure(ConnectionLost(f"the connection was dropped for another channel's "
                                            f"record: {proto.refusal}"))
        # every pipe is down before any receiver hears it (one may send on another)
        lost = [channel for channel in self.channels.values() if channel.up]
        for channel in lost:
            channel.up = False
        for channel in lost:
            if not channel.closed:
                channel._call = cancel_call(channel._call)
                channel.receiver.connectionLost(
                    reason if channel.id == too_large or too_large is None else others)

    def _dispatch(self, proto: _ChannelsConnection, messages: list[Any]) -> None:
        """Hand each message of a read to its channel, in order."""
        self._pending = messages
        channels = self.channels
        #: the messages still to come in this read, by channel (so that a
        #: pipe with none there is answered without a scan)
        waiting = self._waiting = {}
        for item in messages:
            waiting[item[0]] = waiting.get(item[0], 0) + 1
        try:
            for i in range(len(messages)):
                item = messages[i]
                if item is None:  # discarded
                    continue
                self._at = i + 1
                waiting[item[0]] -= 1
                channel = channels.get(item[0])
                if channel is None:
                    continue  # ended here: what came before the far side knew
                frames = item[1]
                if not frames:
                    self._endedThere(channel)
                elif channel.up:
                    if channel.ends:
                        channel.ends = 0
                    channel.receiver.messageReceived(frames)
                if proto.closing or self.protocol is not proto:
                    return
        finally:
            self._pending = None

    def _discard(self, name: bytes) -> int:
        pending = self._pending
        if pending is None or not self._waiting.get(name):
            return 0
        self._waiting[name] = 0
        count = 0
        for i in range(self._at, len(pending)):
            item = pending[i]
            if item is not None and item[0] == name:
                pending[i] = None
                count += 1
        return count

    def _endedThere(self, channel: _StreamChannel) -> None:
        """The far side ended *channel*: say it is known, and make the pipe
        again under a new channel after the reconnection delay."""
        if self.protocol is not None:
            self.protocol._queueOn(channel.id, _END)
        del self.channels[channel.id]
        self._name(channel)
        channel._down(Failure(ConnectionDone("the far side ended this channel")))
        channel.ends += 1
        if not channel.closed:  # (its receiver may have closed it)
            channel._call = self.reactor.callLater(self.retryPolicy(channel.ends), channel._up)

    def _hold(self, channel: _StreamChannel, frames: list[bytes]) -> None:
        """*channel* sent *frames* while not up (the connection is down, or
        the pipe is not up on it yet): it keeps them until it is up (its
        pipes within ``maxQueued`` and ``maxOutputBytes`` together)."""
        size = self._admit(frames, self.queued)
        if size is None:
            return
        if channel.held is None:
            channel.held = deque()
        channel.held.append(list(frames))
        channel.heldBytes += size
        self.queued += 1
        self.queuedBytes += size

    def _release(self, channel: _StreamChannel) -> deque[list[bytes]]:
        """What *channel* held, no longer counted here."""
        held, channel.held = channel.held, None
        if held is None:
            return deque()
        self.queued -= len(held)
        self.queuedBytes -= channel.heldBytes
        channel.heldBytes = 0
        return held

    @property
    def queue(self) -> deque[tuple[_StreamChannel, list[bytes]]]:
        """What its pipes hold, as (pipe, frames), each pipe's in the order
        it sent them (a copy)."""
        return deque((channel, frames) for channel in self.channels.values()
                     for frames in channel.held or ())

    def _forget(self, channel: _StreamChannel) -> None:
        """*channel* was closed: drop what it held, tell the far side; close
        the connection with the last one."""
        self._release(channel)
        if self.channels.get(channel.id) is channel:
            del self.channels[channel.id]
            if self.protocol is not None:
                self.protocol._queueOn(channel.id, _END)
        if not self.channels:
            self._stop()

    def _stop(self) -> defer.Deferred[None]:
        service, self.service = self.service, None
        proto, self.protocol = self.protocol, None
        self.queued = 0
        self.queuedBytes = 0
        self._waiters.fire()
        if service is None:
            # (the connection of the last pipe closed may still be closing)
            return after(self._closing)
        if proto is not None:
            proto.beforeStop()
        stopped: defer.Deferred[None] = defer.Deferred()
        self._closing = stopped

        def done(result: object) -> None:
            if self._closing is stopped:
                self._closing = None
            stopped.callback(None)

        service.stopService().addBoth(done)
        return after(stopped)

    def close(self) -> defer.Deferred[None]:
        """Close every pipe and the connection."""
        for channel in list(self.channels.values()):
            channel.closed = True
            channel.up = False
            channel._call = cancel_call(channel._call)
            self._release(channel)
        self.channels.clear()
        return self._stop()


# --- endpoint schemes ---------------------------------------------------------

#: The longest path a local socket can have (``sun_path``: 108 bytes on
#: Linux, 104 on the BSDs and macOS).
UNIX_PATH_MAX = 104 if sys.platform == "darwin" or "bsd" in sys.platform else 108

#: The Twisted stream endpoint types registered at import (``tls:`` only
#: connects, ``tcp6:`` only listens: ``tcp:`` connects to IPv6 hosts too).
STREAM_SCHEMES = ("tcp", "tcp6", "ssl", "tls", "unix")


def check_endpoint(endpoint: str, role: str) -> None:
    """Check a Twisted stream endpoint string for *role* without starting
    anything: the address parts we can judge (host, port, path) ourselves,
    the rest by having Twisted build (not start) the endpoint."""
    name, _, rest = endpoint.partition(":")
    args, kwargs = split_description(rest)
    if name in ("tcp", "tcp6", "ssl", "tls"):
        if role == LISTEN:
            if name == "tls":
                raise TransportError(f"bad endpoint {endpoint!r}: tls: endpoints only connect; "
                                     "listen with ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem")
            port = kwargs.get("port", args[0] if args else None)
            if port is not None and not port.isdigit() and "host" not in kwargs and len(args) > 1:
                port = args[1]  # the client form tcp:HOST:PORT
        else:
            host = kwargs.get("host", args[0] if args else None)
            if not host:
                if "::" in rest or "=[" in rest:
                    raise TransportError(f"bad endpoint {endpoint!r}: escape the colons of an "
                                         f"IPv6 address, e.g. {name}:host=\\:\\:1:port=5555")
                raise TransportError(f"bad endpoint {endpoint!r}: no host; e.g. "
                                     f"{name}:host=127.0.0.1:port=5555")
            port = kwargs.get("port", args[1] if len(args) > 1 else None)
            try:  # what the resolver does with it (labels of 1-63 characters, ...)
                host.encode("idna")
            except UnicodeError as e:
                raise TransportError(f"bad endpoint {endpoint!r}: not a host name: {host!r} "
                                     f"({e})") from None
        check_port(endpoint, port, role)
    elif name == "unix":
        path = kwargs.get("path", kwargs.get("address", args[0] if args else None))
        if not path:
            raise TransportError(f"bad endpoint {endpoint!r}: no path; e.g. unix:path=/tmp/mdp.sock")
        length = len(os.fsencode(path))
        if length > UNIX_PATH_MAX:
            raise TransportError(f"bad endpoint {endpoint!r}: a socket's path is at most "
                                 f"{UNIX_PATH_MAX} bytes here, not {length}")
    from twisted.internet.task import Clock

    if role == LISTEN and name == "ssl":
        description, ca = _without_ca(server_description(endpoint))
        if ca is not None:
            if not os.path.isfile(ca):
                raise TransportError(f"bad endpoint {endpoint!r}: {CA_CERTS}={ca}: no such file")
            _check_mutual(endpoint, *split_description(description.partition(":")[2]))
        endpoint = description
    try:
        if role == LISTEN:
            serverFromString(Clock(), server_description(endpoint))
        else:
            clientFromString(Clock(), endpoint)
    except (NameError, ImportError) as e:
        raise TransportError(f"bad endpoint {endpoint!r}: {name}: needs pyOpenSSL and "
                             f"service_identity (pip install 'twisted[tls]'): {e}") from None
    except Exception as e:  # Twisted's parsers raise ValueError, TypeError, KeyError, ...
        raise TransportError(f"bad endpoint {endpoint!r}: {e}") from None


def _listen(endpoint: str, receiver: IRouterReceiver, reactor: Any, limits: Limits) -> Any:
    return StreamRouter.listen(endpoint, receiver, reactor, limits=limits)


def _connect(endpoint: str, receiver: IDealerReceiver, reactor: Any, limits: Limits,
             retryPolicy: Optional[Callable[[int], float]], identity: Optional[bytes]) -> Any:
    return StreamDealer(endpoint, receiver, reactor, retryPolicy=retryPolicy, limits=limits,
                        identity=identity)


def _channels(endpoint: str, reactor: Any, limits: Limits,
              retryPolicy: Optional[Callable[[int], float]]) -> StreamChannels:
    return StreamChannels(endpoint, reactor, retryPolicy=retryPolicy, limits=limits)


def scheme(name: str) -> Scheme:
    """The registry entry for the Twisted stream endpoint type *name*, with
    the length-prefixed record framing."""
    return Scheme(name, check_endpoint, _listen if name != "tls" else None,
                  _connect if name != "tcp6" else None,
                  f"length-prefixed records over Twisted's {name}: endpoints", identities=True,
                  channels=_channels if name != "tcp6" else None)
