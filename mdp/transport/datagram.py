"""Datagram transports for discovery beacons: ``udp:PORT`` (``interface=``, ``group=``, ``broadcast=``), its
port shared by every node on the machine, and ``loopback:NAME:host=ADDRESS`` (``docs/transports.md``)."""

from __future__ import annotations

import ipaddress
from typing import Any, Optional

import attrs
from twisted.internet import defer
from twisted.internet.protocol import DatagramProtocol
from twisted.logger import Logger
from zope.interface import implementer

from mdp.errors import TransportError
from mdp.interfaces import IDatagramReceiver, IDatagramTransport
from mdp.policy import LogThrottle, default_reactor
from mdp.transport.loopback import LoopbackNetwork, network
from mdp.transport.registry import check_port, split_description

log = Logger()

DEFAULT_GROUP = "225.25.25.25"  #: The multicast group beacons go to on loopback, as Zyre's do.


@attrs.frozen
class DatagramSpec:
    """A checked datagram endpoint: where we listen and where we send."""

    endpoint: str
    scheme: str
    port: int
    host: str
    #: a broadcast address or a multicast group
    destination: str
    multicast: bool
    network: str = ""


def _adapters() -> list[tuple[str, ipaddress.IPv4Interface]]:
    """(interface name, IPv4 address/prefix) of this machine, in the OS's order."""
    import ifaddr

    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                found.append((adapter.nice_name or adapter.name,
                              ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}")))
    return found


def pick_interface(interface: Optional[str] = None) -> ipaddress.IPv4Interface:
    """The IPv4 address/prefix beacons use: *interface* (a name or address), or
    the first neither loopback nor link-local, else 127.0.0.1/8."""
    adapters = _adapters()
    if interface is None:
        return next((address for _, address in adapters
                     if not (address.is_loopback or address.is_link_local)),
                    ipaddress.IPv4Interface("127.0.0.1/8"))
    for name, address in adapters:
        if interface in (name, str(address.ip)):
            return address
    if getattr(_ipv4(interface), "is_loopback", False):
        return ipaddress.IPv4Interface(f"{interface}/8")
    names = ", ".join(f"{name} ({address.ip})" for name, address in adapters)
    raise TransportError(f"no IPv4 interface {interface!r} on this machine (there are: {names})")


def resolve(endpoint: str) -> DatagramSpec:
    """Check a datagram *endpoint* and work out its addresses, or raise :class:`TransportError`."""
    if not isinstance(endpoint, str):
        raise TransportError(f"a datagram endpoint is a string, not {type(endpoint).__name__}")
    scheme, _, rest = endpoint.partition(":")
    args, kwargs = split_description(rest)
    if scheme == "loopback":
        if len(args) != 1 or not args[0] or set(kwargs) - {"host"}:
            raise TransportError(f"bad datagram endpoint {endpoint!r}: loopback:NAME[:host=ADDRESS]")
        host = kwargs.get("host", "127.0.0.1")
        return DatagramSpec(endpoint, scheme, 0, host, "*", True, network=args[0])
    if scheme != "udp":
        raise TransportError(f"bad datagram endpoint {endpoint!r}: udp:PORT[:interface=IF]"
                             "[:group=ADDRESS|:broadcast=ADDRESS] or loopback:NAME")
    unknown = set(kwargs) - {"interface", "group", "broadcast", "port"}
    if unknown or len(args) > 1:
        raise TransportError(f"bad datagram endpoint {endpoint!r}: unknown "
                             f"{', '.join(sorted(unknown)) or 'arguments'}; "
                             "udp:PORT[:interface=IF][:group=ADDRESS|:broadcast=ADDRESS]")
    port = kwargs.get("port", args[0] if args else "")
    check_port(endpoint, port, "connect")
    if "group" in kwargs and "broadcast" in kwargs:
        raise TransportError(f"bad datagram endpoint {endpoint!r}: a group or a broadcast address, not both")
    address = pick_interface(kwargs.get("interface"))
    if "group" in kwargs:
        destination = kwargs["group"]
        if not getattr(_ipv4(destination), "is_multicast", False):
            raise TransportError(f"bad datagram endpoint {endpoint!r}: {destination!r} "
                                 "is not an IPv4 multicast group (224.0.0.0/4)")
        return DatagramSpec(endpoint, "udp", int(port), str(address.ip), destination, True)
    destination = kwargs.get("broadcast", str(address.network.broadcast_address))
    if _ipv4(destination) is None:
        raise TransportError(f"bad datagram endpoint {endpoint!r}: {destination!r} is not an IPv4 address")
    multicast = address.is_loopback and "broadcast" not in kwargs
    return DatagramSpec(endpoint, "udp", int(port), str(address.ip),
                        DEFAULT_GROUP if multicast else destination, multicast)


def _ipv4(text: str) -> Optional[ipaddress.IPv4Address]:
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        return None


def open_datagrams(endpoint: str, receiver: IDatagramReceiver,
                   reactor: Optional[Any] = None) -> defer.Deferred[IDatagramTransport]:
    """Listen on the datagram *endpoint*; a Deferred of an :class:`IDatagramTransport`.
    Raises :class:`TransportError` for a malformed endpoint, fails with one later."""
    spec = resolve(endpoint)
    reactor = default_reactor(reactor)
    if spec.scheme == "loopback":
        return defer.succeed(LoopbackDatagrams(spec, receiver, reactor))
    return defer.ensureDeferred(UDPDatagrams(spec, receiver, reactor).open())


@implementer(IDatagramTransport)
class UDPDatagrams(DatagramProtocol):
    """A shared UDP socket sending to a broadcast address or a group (the protocol of its own port)."""

    noisy = False

    def __init__(self, spec: DatagramSpec, receiver: IDatagramReceiver, reactor: Any) -> None:
        self.spec, self.host, self.receiver, self.reactor = spec, spec.host, receiver, reactor
        self.throttle = LogThrottle(reactor, interval=10.0)
        self.port: Any = None

    def datagramReceived(self, data: bytes, addr: Any) -> None:
        self.receiver.datagramReceived(data, addr[0])

    async def open(self) -> UDPDatagrams:
        spec = self.spec
        try:
            self.port = self.reactor.listenMulticast(spec.port, self, listenMultiple=True)
        except Exception as e:
            raise TransportError(f"cannot listen on {spec.endpoint}: {e}") from e
        transport = self.transport
        if not spec.multicast:
            transport.setBroadcastAllowed(True)
            return self
        transport.setTTL(1)
        transport.setLoopbackMode(1)
        try:
            await transport.setOutgoingInterface(spec.host)
            await transport.joinGroup(spec.destination, spec.host)
        except Exception as e:
            self.port.stopListening()
            raise TransportError(f"cannot join multicast group {spec.destination} on "
                                 f"{spec.host} ({spec.endpoint}): {e}") from e
        return self

    def send(self, data: bytes) -> None:
        if self.port is None:
            return
        if self.transport is None:
            self.throttle.warn(log, "send", "cannot send a datagram to {to}:{port}: the reactor "
                               "closed the socket (stop the node before the reactor stops)",
                               to=self.spec.destination, port=self.spec.port)
            return
        try:
            self.transport.write(data, (self.spec.destination, self.spec.port))
        except Exception as e:  # the network is down: try again next time
            self.throttle.warn(log, "send", "cannot send a datagram to {to}:{port} from {host}: "
                               "{error}", to=self.spec.destination, port=self.spec.port,
                               host=self.host, error=e)

    def close(self) -> defer.Deferred[None]:
        port, self.port = self.port, None
        return defer.maybeDeferred(port.stopListening) if port is not None else defer.succeed(None)


@implementer(IDatagramTransport)
class LoopbackDatagrams:
    """In-memory: every member of the network hears what any sends (itself too) a reactor turn later."""

    def __init__(self, spec: DatagramSpec, receiver: IDatagramReceiver, reactor: Any, *,
                 net: LoopbackNetwork = network) -> None:
        self.spec, self.host, self.receiver, self.reactor = spec, spec.host, receiver, reactor
        self.net, self.closed = net, False
        net.members[spec.network].append(self)

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        for member in list(self.net.members[self.spec.network]):
            member.reactor.callLater(0, member._deliver, bytes(data), self.host)

    def _deliver(self, data: bytes, host: str) -> None:
        if not self.closed:
            self.receiver.datagramReceived(data, host)

    def close(self) -> defer.Deferred[None]:
        if not self.closed:
            self.closed = True
            self.net.members[self.spec.network].remove(self)
        return defer.succeed(None)
