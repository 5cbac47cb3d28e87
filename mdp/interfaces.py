"""The contracts between the layers: transports, the protocols they drive, roles.

A *message* is a ``list`` of ``bytes`` frames.  A transport moves messages and
reports connection events; it knows nothing of MDP.  A state machine (broker,
worker, client, ...) implements one of the receiver interfaces and sends through
the matching transport interface; it never imports zmq, txzmq or socket.
"""

from __future__ import annotations

from typing import Optional

from zope.interface import Attribute, Interface


class IRouterReceiver(Interface):
    """The protocol side of a bound, ROUTER-like transport (e.g. a broker).

    A receiver that only passes some frames on may have ``keepFramesFrom``
    (an index into *frames*): a transport may then deliver the long frames
    from there on as buffers it need not copy (``len``, ``bytes(frame)`` and
    the buffer protocol only).  Without it every frame is ``bytes``."""

    def messageReceived(peer: bytes, frames: list[bytes]) -> None:
        """A message arrived from the peer identified by *peer*."""

    def peerDisconnected(peer: bytes) -> None:
        """*peer* went away, or the transport cut it off (over the message
        limits, or ``maxOutputBytes`` unread).  Stream transports report every
        loss, ZeroMQ only the peers it cuts off.  Never called from inside
        ``sendMessage``."""


class IRouterTransport(Interface):
    """A bound socket that addresses many peers by opaque id (ZeroMQ ROUTER)."""

    endpoint = Attribute(
        "An endpoint string a peer can connect to; with port 0 or ``*`` it "
        "names the port the OS picked."
    )

    def sendMessage(peer: bytes, frames: list[bytes]) -> None:
        """Send *frames* to *peer* (any buffer, where the transport has
        ``acceptsBuffers = True``); dropped for an unknown peer, as a ZeroMQ
        ROUTER does.  Unread output waits up to ``Limits.maxOutputBytes``;
        beyond, that peer is disconnected, and no other peer is held back."""

    def disconnectPeer(peer: bytes) -> None:
        """Close the connection to *peer* once what was sent to it is out (the
        broker says DISCONNECT and then this).  A no-op where the medium has
        no connection per peer (ZeroMQ)."""

    def close():
        """Stop listening and drop every peer.  Returns a Deferred."""


class IDealerReceiver(Interface):
    """The protocol side of a connecting, DEALER-like transport.

    A receiver may also have ``connectionFailed(reason)``: stream transports
    call it with each failed connection attempt's exception before they
    retry (ZeroMQ connects silently and never does)."""

    def connectionMade() -> None:
        """A (new) pipe to the far side is ready.  Called asynchronously after
        the transport was created, and again after each reconnection."""

    def messageReceived(frames: list[bytes]) -> None:
        """A message arrived from the far side."""

    def connectionLost(reason: object) -> None:
        """The pipe broke; stream transports reconnect and call
        connectionMade again.  ZeroMQ calls it only when it dropped the pipe
        itself (a message over the limits); a fresh socket follows at once."""


class IDealerTransport(Interface):
    """One outgoing pipe to a bound peer (ZeroMQ DEALER)."""

    endpoint = Attribute("The endpoint string this transport connects to.")
    connected = Attribute("True while the pipe is believed usable.")
    writable = Attribute(
        "False while the medium takes no more (its queue is full): what is sent "
        "meanwhile waits, in order, in a local backlog.  Senders of bursts "
        "(streaming handlers) wait on drained() instead of growing it."
    )

    def sendMessage(frames: list[bytes]) -> None:
        """Send *frames*; while disconnected they are queued (bounded; beyond,
        refused with a warning) and sent after the next connectionMade.
        Never dropped for a full queue while connected (see ``writable``).
        A receiver that resends after connectionLost must not rely on it too."""

    def drained():
        """A Deferred that fires once the transport is writable again (at
        once if it is), or when the pipe it waits on is dropped."""

    def discardReceived() -> int:
        """Drop the messages that have come but are not delivered yet, and
        return how many: a client calls it before a request, as MDP replies
        carry no request id and nothing that came before can be its reply."""

    def close():
        """Close for good.  Returns a Deferred."""


class IDealerChannels(Interface):
    """Many outgoing pipes to one bound peer that share what a transport can
    share (a stream connection: its writes, reads and reconnection), each
    still a pipe of its own: the far side's router knows each as a peer, and
    a pipe's loss, its stale messages and its close are its own."""

    def open(receiver: object) -> IDealerTransport:
        """A new pipe whose events go to *receiver* (an
        :class:`IDealerReceiver`); ``connectionMade`` comes once it is up."""

    def close():
        """Close every pipe, and what they share, for good.  Returns a
        Deferred."""


class IStreamDecoder(Interface):
    """Turns the bytes of one stream connection into messages (pure, no I/O).

    A decoder for a framing with a greeting both sides check (SP's header)
    also has ``handshaken``: whether the peer's has come, whole and right.
    Until then a connecting side holds what it would send, and a peer whose
    greeting does not come within ``handshakeTimeout`` is dropped."""

    records = Attribute("Messages completed so far.")
    inRecord = Attribute("True while a message has begun and is not complete.")
    buffered = Attribute("Bytes held for the message in progress.")
    identity = Attribute("The identity the peer announced in its greeting, or None.")
    channels = Attribute(
        "True once the stream carries channels: each message is then a "
        "``(channel, frames)`` pair (docs/transports.md); False for a framing "
        "that has none.")

    def feed(data: bytes) -> list[list[bytes]]:
        """The messages completed by *data*.  Raises
        :class:`~mdp.errors.ProtocolError` (``OversizedMessage`` for a limit,
        before anything is buffered) when the stream is unusable; its
        ``decoded`` (if set) holds the messages completed before it."""


class IFraming(Interface):
    """How messages become bytes on a stream: a part of the stream transport
    separate from its connection handling (connect, reconnect, limits, flow
    control, disconnects), so a new wire mapping is one small class."""

    name = Attribute("A short name for logs and docs.")

    def greeting(identity: object) -> bytes:
        """What a connection sends before any message (``b""`` for nothing).
        The connecting side passes the identity it wants the far side to see
        (or None); the accepting side passes None."""

    def encode(frames: list[bytes]) -> bytes:
        """One message as bytes.  A framing whose ``acceptsBuffers`` is true
        takes any buffer as a frame (a kept ZeroMQ frame a broker passes on)."""

    def decoder(limits: object) -> IStreamDecoder:
        """A fresh decoder for one connection, enforcing *limits*."""


class IAdmission(Interface):
    """Whether a server serves at all just now: what a broker asks before it
    takes a client request or registers a worker (Binary Star's active or
    passive, :class:`mdp.binarystar.BinaryStar`).  Each call is told the
    time; a refusal is silent to the peer, which retries elsewhere."""

    def admitClient(now: float) -> bool:
        """A client request arrived (it may change the state: the client's
        vote); serve it?"""

    def admitWorker(now: float) -> bool:
        """A worker wants to register; accept it?"""

    def status(now: float) -> dict:
        """What operators see (JSON-ready): the role, state, peer, ..."""


class IAccess(Interface):
    """Who may call and who may serve which services: what a broker asks,
    with the identity the peer's transport authenticated (``None`` for a
    link without authentication), before it takes a client request or
    registers a worker (:class:`mdp.policy.AccessPolicy`)."""

    def mayCall(identity: Optional[str], service: bytes) -> bool:
        """May this peer call *service* (and learn of it through MMI)?"""

    def mayServe(identity: Optional[str], service: bytes) -> bool:
        """May this peer register as a worker for *service*?"""


class IAuthenticatedRouter(Interface):
    """A router transport that knows who its peers are (CURVE, mutual TLS)."""

    def peerIdentity(peer: bytes) -> Optional[str]:
        """The identity the transport authenticated for *peer* (a CURVE
        public key in Z85, a TLS certificate subject), or ``None``.  Valid at
        least while a message from *peer* is being delivered."""


class IBroker(Interface):
    """An MDP/0.2 broker."""

    def listen(endpoint: str, clients: bool = True, workers: bool = True):
        """Bind an endpoint; returns a Deferred firing with its IRouterTransport."""

    def streamFactory(clients: bool = True, workers: bool = True):
        """An ``IProtocolFactory`` to listen with on an endpoint of one's own."""

    def snapshot():
        """A read-only view of services, queues and workers (what MMI and
        operators read)."""

    def close():
        """Unbind everything; returns a Deferred."""


class IWorker(Interface):
    """An MDP/0.2 worker serving one service."""

    service = Attribute("The service name, bytes.")

    def start() -> None:
        """Connect to the broker and register."""

    def stop():
        """Send DISCONNECT and close; returns a Deferred."""


class IClient(Interface):
    """An MDP/0.2 client."""

    def request(service, *frames, timeout=None, retries=None, onPartial=None, onRestart=None):
        """Send a request; returns a Deferred firing with the FINAL body frames.
        *onPartial* gets each PARTIAL body, *onRestart* is called when the
        reply starts over (see :mod:`mdp.majordomo.client`)."""

    def stream(service, *frames, timeout=None):
        """An async iterator over every PARTIAL body and then the FINAL body."""

    def close():
        """Fail pending requests and close connections; returns a Deferred."""


class IPeerRouterReceiver(Interface):
    """The protocol side of a connecting ROUTER (a Freelance agent)."""

    def messageReceived(endpoint: str, frames: list[bytes]) -> None:
        """A message arrived from the server at *endpoint*."""


class IPeerRouterTransport(Interface):
    """One ROUTER-like connection to many servers, each addressed by the
    endpoint string it was connected with (ZeroMQ: a ROUTER socket that
    connects, naming each peer with ZMQ_CONNECT_ROUTING_ID)."""

    def connect(endpoint: str) -> None:
        """Add a server.  Messages to it may be lost until its pipe is up."""

    def sendMessage(endpoint: str, frames: list[bytes]) -> None:
        """Send *frames* to the server at *endpoint*; dropped if unknown or
        not connected, as a ZeroMQ ROUTER does."""

    def close():
        """Close every connection.  Returns a Deferred."""


class IDatagramReceiver(Interface):
    """What hears datagrams (ZRE beacons)."""

    def datagramReceived(data: bytes, host: str) -> None:
        """*data* came from the address *host*."""


class IDatagramTransport(Interface):
    """A datagram socket that sends to one fixed destination (a broadcast
    address or a multicast group) and hears whatever comes to its port."""

    host = Attribute("Our address, as the receivers of what we send see it.")

    def send(data: bytes) -> None:
        """Send *data* to the destination; errors are logged, not raised."""

    def close():
        """Stop listening.  Returns a Deferred."""


class IDiscoveryListener(Interface):
    """The node side of a discovery mechanism."""

    def beaconReceived(uuid: object, host: str, port: int) -> None:
        """The node *uuid* has its ROUTER on *port* at *host* (port 0: it is
        leaving)."""

    def dialPeer(endpoint: str) -> None:
        """Reach the node at the ZRE *endpoint*, whose UUID is not known yet."""


class IDiscovery(Interface):
    """How a Harmony node finds its peers (beacons, a list of endpoints)."""

    host = Attribute("The address our ROUTER binds to and announces.")

    def start(listener: IDiscoveryListener, uuid: object, port: int):
        """Begin announcing ourselves (ROUTER on *port*) and telling
        *listener* what is found.  Returns a Deferred."""

    def stop():
        """Say we are leaving (where the mechanism can), then stop.  Returns
        a Deferred."""
