"""The contracts between transports, the protocols they drive, and roles.  A *message* is
a ``list`` of ``bytes`` frames; a transport moves messages and knows nothing of MDP."""

from __future__ import annotations

from typing import Optional

from zope.interface import Attribute, Interface, implementer


class IClosable(Interface):
    """What is closed for good by :meth:`close`."""

    def close():
        """Close for good (what that stops: the interface says).  Returns a Deferred."""


class IRouterReceiver(Interface):
    """The protocol side of a bound, ROUTER-like transport (a broker); with ``keepFramesFrom``."""

    def messageReceived(peer: bytes, frames: list[bytes]) -> None:
        """A message arrived from the peer identified by *peer*."""

    def peerDisconnected(peer: bytes) -> None:
        """*peer* went away or was cut off (ZeroMQ: only that); never inside ``sendMessage``."""


class IRouterTransport(IClosable):
    """A bound socket addressing many peers by opaque id (ZeroMQ ROUTER); ``close`` unbinds and drops them."""

    endpoint = Attribute("An endpoint string a peer can connect to (with the port the OS picked).")

    def sendMessage(peer: bytes, frames: list[bytes]) -> None:
        """Send *frames* to *peer* (dropped if unknown; cut off beyond ``maxOutputBytes`` unread)."""

    def disconnectPeer(peer: bytes) -> None:
        """Close the connection to *peer* once its output is sent (a no-op on ZeroMQ)."""


class IDealerReceiver(Interface):
    """The protocol side of a connecting, DEALER-like transport (maybe ``connectionFailed(reason)``)."""

    def connectionMade() -> None:
        """A pipe to the far side is ready; called again after each reconnection."""

    def messageReceived(frames: list[bytes]) -> None:
        """A message arrived from the far side."""

    def connectionLost(reason: object) -> None:
        """The pipe broke; a reconnection and connectionMade follow."""


@implementer(IDealerReceiver)
class DealerReceiver:
    """An :class:`IDealerReceiver` that ignores every event: a base for those that hear some."""

    def connectionMade(self) -> None:
        pass

    def messageReceived(self, frames: list[bytes]) -> None:
        pass

    def connectionLost(self, reason: object) -> None:
        pass


class IDealerTransport(IClosable):
    """One outgoing pipe to a bound peer (ZeroMQ DEALER)."""

    endpoint = Attribute("The endpoint string this transport connects to.")
    connected = Attribute("True while the pipe is believed usable.")
    writable = Attribute("False while the medium's queue is full (a local backlog; wait on drained()).")

    def sendMessage(frames: list[bytes]) -> None:
        """Send *frames*; while disconnected they wait (bounded); never dropped for a full queue."""

    def drained():
        """A Deferred that fires once writable (at once if it is) or the pipe is dropped."""

    def discardReceived() -> int:
        """Drop the messages not delivered yet and return how many."""


class IDealerChannels(IClosable):
    """Many pipes, each its own peer, to one bound peer over one connection; ``close`` closes them all."""

    def open(receiver: object) -> IDealerTransport:
        """A new pipe whose events go to *receiver*, an :class:`IDealerReceiver`."""


class IStreamDecoder(Interface):
    """Turns a stream connection's bytes into messages (no I/O); with a greeting, ``handshaken``."""

    records = Attribute("Messages completed so far.")
    inRecord = Attribute("True while a message has begun and is not complete.")
    buffered = Attribute("Bytes held for the message in progress.")
    identity = Attribute("The identity the peer announced in its greeting, or None.")
    channels = Attribute("True once each message is a ``(channel, frames)`` pair (docs/transports.md).")

    def feed(data: bytes) -> list[list[bytes]]:
        """The messages completed by *data*; a ``ProtocolError``'s ``decoded`` holds those before it."""


class IFraming(Interface):
    """How messages become bytes on a stream, apart from connection handling."""

    name = Attribute("A short name for logs and docs.")

    def greeting(identity: object) -> bytes:
        """What a connection sends first (``b""``: nothing), announcing *identity* or None."""

    def encode(frames: list[bytes]) -> bytes:
        """One message as bytes (with ``acceptsBuffers``, frames may be any buffer)."""

    def decoder(limits: object) -> IStreamDecoder:
        """A fresh decoder for one connection, enforcing *limits*."""


class IAdmission(Interface):
    """Whether a broker serves just now (:class:`mdp.binarystar.BinaryStar`); a refusal is silent."""

    def admitClient(now: float) -> bool:
        """A client request arrived (a failover vote); serve it?"""

    def admitWorker(now: float) -> bool:
        """A worker wants to register; accept it?"""

    def status(now: float) -> dict:
        """What operators see (JSON-ready): the role, state, peer, ..."""


class IAccess(Interface):
    """Who may call and serve which services, by authenticated identity (None: unauthenticated)."""

    def mayCall(identity: Optional[str], service: bytes) -> bool:
        """May this peer call *service* (and learn of it through MMI)?"""

    def mayServe(identity: Optional[str], service: bytes) -> bool:
        """May this peer register as a worker for *service*?"""


class IAuthenticatedRouter(Interface):
    """A router transport that knows who its peers are (CURVE, mutual TLS)."""

    def peerIdentity(peer: bytes) -> Optional[str]:
        """*peer*'s authenticated identity (a CURVE key in Z85, a TLS subject) or ``None``."""


class IBroker(IClosable):
    """An MDP/0.2 broker; ``close`` unbinds everything."""

    def listen(endpoint: str, clients: bool = True, workers: bool = True):
        """Bind an endpoint; returns a Deferred firing with its IRouterTransport."""

    def streamFactory(clients: bool = True, workers: bool = True):
        """An ``IProtocolFactory`` to listen with on an endpoint of one's own."""

    def snapshot():
        """A read-only view of services, queues and workers."""


class IWorker(Interface):
    """An MDP/0.2 worker serving one service."""

    service = Attribute("The service name, bytes.")

    def start() -> None:
        """Connect to the broker and register."""

    def stop():
        """Send DISCONNECT and close; returns a Deferred."""


class IClient(IClosable):
    """An MDP/0.2 client; ``close`` fails pending requests and closes connections."""

    def request(service, *frames, timeout=None, retries=None, onPartial=None, onRestart=None):
        """A Deferred of the FINAL body; *onPartial* gets each PARTIAL body."""

    def stream(service, *frames, timeout=None):
        """An async iterator over every PARTIAL body and then the FINAL body."""


class IPeerRouterReceiver(Interface):
    """The protocol side of a connecting ROUTER (a Freelance agent)."""

    def messageReceived(endpoint: str, frames: list[bytes]) -> None:
        """A message arrived from the server at *endpoint*."""


class IPeerRouterTransport(IClosable):
    """One ROUTER-like connection to many servers, each addressed by its endpoint."""

    def connect(endpoint: str) -> None:
        """Add a server.  Messages to it may be lost until its pipe is up."""

    def sendMessage(endpoint: str, frames: list[bytes]) -> None:
        """Send *frames* to the server at *endpoint*; dropped if not connected."""


class IDatagramReceiver(Interface):
    """What hears datagrams (ZRE beacons)."""

    def datagramReceived(data: bytes, host: str) -> None:
        """*data* came from the address *host*."""


class IDatagramTransport(IClosable):
    """A datagram socket sending to a broadcast address or group, hearing its port; ``close`` stops it."""

    host = Attribute("Our address, as the receivers of what we send see it.")

    def send(data: bytes) -> None:
        """Send *data* to the destination; errors are logged, not raised."""


class IDiscoveryListener(Interface):
    """The node side of a discovery mechanism."""

    def beaconReceived(uuid: object, host: str, port: int) -> None:
        """The node *uuid* has its ROUTER on *port* at *host* (0: it is leaving)."""

    def dialPeer(endpoint: str) -> None:
        """Reach the node at the ZRE *endpoint*, whose UUID is not known yet."""


class IDiscovery(Interface):
    """How a Harmony node finds its peers (beacons, a list of endpoints)."""

    host = Attribute("The address our ROUTER binds to and announces.")

    def start(listener: IDiscoveryListener, uuid: object, port: int):
        """Announce our ROUTER on *port*, tell *listener* what is found; a Deferred."""

    def stop():
        """Say we are leaving (where possible), then stop.  Returns a Deferred."""
