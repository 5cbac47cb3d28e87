"""The Twisted driver of a Harmony (ZRE) node: :class:`Node` owns one bound ROUTER, one
DEALER per peer, a tick and a discovery (UDP beacons, or a list of endpoints)."""

from __future__ import annotations

import functools
import itertools
import uuid as uuidlib
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Optional, Union
from uuid import UUID

from twisted.internet import defer, task
from twisted.logger import Logger
from zope.interface import implementer

from mdp import interfaces
from mdp.errors import TransportError
from mdp.harmony import codec
from mdp.harmony import machine as zre
from mdp.harmony.machine import Event, HarmonyMachine, UnknownPeer
from mdp.messages import bytes_frames
from mdp.policy import Limits, LogThrottle, default_reactor
from mdp.transport import check, connect, datagram, listen

log = Logger()
DEFAULT_INTERVAL = 1.0  # seconds between beacons, and between checks of the peers' silence


def wire_endpoint(endpoint: str) -> str:
    """Our transport endpoint as ZRE writes it: ``zmq:tcp://h:p`` → ``tcp://h:p``."""
    return endpoint[4:] if endpoint.startswith("zmq:") else endpoint


def transport_endpoint(endpoint: str) -> str:
    """A ZRE endpoint as one of our transport endpoints: ``tcp://h:p`` → ``zmq:tcp://h:p``."""
    return "zmq:" + endpoint if endpoint.startswith(("tcp://", "ipc://", "inproc://")) else endpoint


@implementer(interfaces.IDiscovery, interfaces.IDatagramReceiver)
class BeaconDiscovery:
    """ZRE's UDP beacons, every *interval* seconds, to the datagram *endpoint* (mdp.transport.datagram)."""

    def __init__(self, endpoint: str = f"udp:{codec.DISCOVERY_PORT}", *,
                 interval: float = DEFAULT_INTERVAL, reactor: Optional[Any] = None) -> None:
        self.spec = datagram.resolve(endpoint)
        self.endpoint, self.host, self.interval = endpoint, self.spec.host, interval
        self.reactor = default_reactor(reactor)
        self.throttle = LogThrottle(self.reactor, interval=10.0)
        self.socket: Optional[interfaces.IDatagramTransport] = None
        self.listener: Optional[interfaces.IDiscoveryListener] = None
        self.uuid: Optional[UUID] = None
        self.loop: Optional[task.LoopingCall] = None

    @defer.inlineCallbacks
    def start(self, listener: interfaces.IDiscoveryListener, uuid: UUID, port: int) -> Any:
        self.listener, self.uuid = listener, uuid
        self.socket = socket = yield datagram.open_datagrams(self.endpoint, self, self.reactor)
        log.info("ZRE beacons every {interval:g} s from {host} to {to} ({endpoint})", interval=self.interval,
                 host=self.host, endpoint=self.endpoint,
                 to=f"{self.spec.destination}:{self.spec.port}" if self.spec.port else self.spec.network)
        self.loop = task.LoopingCall(socket.send, codec.encode_beacon(uuid, port))
        self.loop.clock = self.reactor
        self.loop.start(self.interval, now=True)

    def datagramReceived(self, data: bytes, host: str) -> None:
        if not data.startswith(codec.BEACON_PREFIX[:3]) or self.listener is None:
            return
        try:
            uuid, port = codec.decode_beacon(data)
        except codec.MalformedZre as e:
            self.throttle.warn(log, "beacon", "ignoring a beacon from {host}: {reason}", host=host, reason=e)
            return
        if uuid != self.uuid:
            self.listener.beaconReceived(uuid, host, port)

    @defer.inlineCallbacks
    def stop(self) -> Any:
        if self.loop is not None and self.loop.running:
            self.loop.stop()
        socket, self.socket = self.socket, None
        if socket is not None:  # (open since start, which set the uuid)
            socket.send(codec.encode_beacon(self.uuid, 0))  # type: ignore[arg-type]
            yield socket.close()
        self.listener = None


@implementer(interfaces.IDiscovery)
class EndpointDiscovery:
    """No beacons: dial each of *endpoints* (``tcp://HOST:PORT``), again whenever the peer
    there goes.  *host* is the address our ROUTER binds to and announces."""

    def __init__(self, endpoints: Union[str, Iterable[str]] = (), *, host: str = "127.0.0.1") -> None:
        listed = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        for endpoint in listed:
            if not isinstance(endpoint, str):
                raise TypeError(f"an endpoint is a str, not {type(endpoint).__name__}: {endpoint!r}")
            check(transport_endpoint(endpoint))
        self.endpoints = [wire_endpoint(e) for e in listed]
        self.host = host

    def start(self, listener: interfaces.IDiscoveryListener, uuid: UUID, port: int) -> defer.Deferred[None]:
        for endpoint in self.endpoints:
            listener.dialPeer(endpoint)
        return defer.succeed(None)

    def stop(self) -> defer.Deferred[None]:
        return defer.succeed(None)


class EventStream(defer.DeferredQueue):
    """The node's events, for ``async for``: at most *size* unread (beyond, the oldest go)."""

    def __init__(self, node: Node, size: int = 10_000) -> None:
        super().__init__()
        self.node, self.size = node, size
        self.ended, self.dropped = False, 0

    def _put(self, event: Event) -> None:
        if len(self.pending) == self.size:
            del self.pending[0]
            self.dropped += 1
            self.node.throttle.warn(log, "stream", "ZRE node {name}: an event stream is {size} events "
                                    "behind; dropping the oldest ({dropped} so far)",
                                    name=self.node.name, size=self.size, dropped=self.dropped)
        self.put(event)

    def _end(self) -> None:
        self.ended = True
        waiting, self.waiting = self.waiting, []
        for reader in waiting:
            reader.errback(StopAsyncIteration())

    def __aiter__(self) -> EventStream:
        return self

    def __anext__(self) -> defer.Deferred[Event]:
        if self.ended and not self.pending:
            return defer.fail(StopAsyncIteration())
        if self.waiting:
            raise RuntimeError("one reader at a time: this stream is already awaited")
        return self.get()

    def close(self) -> None:
        self.node._streams.discard(self)
        self._end()

    def aclose(self) -> defer.Deferred[None]:
        self.close()
        return defer.succeed(None)


_loopbackPorts = itertools.count(49152)


@implementer(interfaces.IDiscoveryListener, interfaces.IRouterReceiver)
class Node:
    """A Harmony peer, wire-compatible with ZRE (Zyre, zeromq-pyre).  *endpoint* is where our
    ROUTER binds (default ``zmq:tcp://HOST:*``, HOST the discovery's); the other *options*
    (*headers*, *evasive*, *expired*, *maxPeers*, ...) are :class:`HarmonyMachine`'s.  Events
    go to :meth:`subscribe` callbacks and ``async for event in node``."""

    def __init__(self, name: str, reactor: Optional[Any] = None, *,
                 discovery: Optional[interfaces.IDiscovery] = None, endpoint: Optional[str] = None,
                 interval: float = DEFAULT_INTERVAL, limits: Limits = Limits(), **options: Any) -> None:
        self.reactor = default_reactor(reactor)
        self.uuid: UUID = uuidlib.uuid4()
        self.machine = HarmonyMachine(self.uuid, name, reachable=self._unreachable, now=self._now(),
                                      **options)
        self.name = name
        self.discovery: interfaces.IDiscovery = (discovery if discovery is not None
                                      else BeaconDiscovery(interval=interval, reactor=self.reactor))
        self.bindEndpoint = endpoint or f"zmq:tcp://{self.discovery.host}:*"
        if not self.bindEndpoint.startswith(("zmq:tcp://", "loopback:")):
            raise TransportError(f"bad endpoint {self.bindEndpoint!r}: a Harmony node binds "
                                 "zmq:tcp://HOST:PORT (or *) or loopback:HOST:PORT (or *)")
        if not self.bindEndpoint.endswith(":*"):
            check(self.bindEndpoint, "listen")
        self.interval, self.limits = interval, limits
        self.throttle = LogThrottle(self.reactor)
        self.router: Any = None
        self.links: dict[int, Any] = {}
        self.endpoint, self.port = "", 0
        self._subscribers: list[Callable[[Event], Any]] = []
        self._streams: weakref.WeakSet[EventStream] = weakref.WeakSet()  # a reader may break out
        self._transition = defer.DeferredLock()  # start() and stop() one at a time
        #: batches of actions, and events, each with its run (a stop ends a run)
        self._batches: deque[tuple[int, list[Any]]] = deque()
        self._pending: deque[tuple[int, Event]] = deque()
        self._performing = self._delivering = self._stopped = self.running = False
        self._generation = 0
        self._tick = task.LoopingCall(lambda: self._perform(self.machine.handleTick(self._now())))
        self._tick.clock = self.reactor

    def _now(self) -> float:
        return self.reactor.seconds()

    def start(self) -> defer.Deferred[None]:
        """Bind the ROUTER, start discovery and the tick; fires once announcing."""
        return self._transition.run(self._start)

    def stop(self) -> defer.Deferred[None]:
        """Say we are leaving, close everything, end the event streams; no event or message after."""
        return self._transition.run(self._stop)

    @defer.inlineCallbacks
    def _start(self) -> Any:
        if self.running:
            return
        self._stopped = False
        bind = self.bindEndpoint
        if bind.startswith("loopback:") and bind.endswith(":*"):
            bind = f"{bind[:-2]}:{next(_loopbackPorts)}"
        self.router = yield listen(bind, self, self.reactor, limits=self.limits)
        self.endpoint = wire_endpoint(self.router.endpoint)
        self.port = int(self.endpoint.rpartition(":")[2])
        if bind.startswith(("zmq:tcp://*:", "zmq:tcp://0.0.0.0:")):
            self.endpoint = f"tcp://{self.discovery.host}:{self.port}"
        self.running = True
        self._perform(self.machine.handleStart(self.endpoint, self._now()))
        try:
            yield self.discovery.start(self, self.uuid, self.port)
        except Exception:
            self.running = False
            self._perform(self.machine.handleStop(self._now()))
            router, self.router = self.router, None
            yield router.close()
            raise
        self._tick.start(self.interval, now=False)
        log.info("ZRE node {name} ({uuid}) at {endpoint}", name=self.name, uuid=self.uuid,
                 endpoint=self.endpoint)

    @defer.inlineCallbacks
    def _stop(self) -> Any:
        streams, self._streams = list(self._streams), weakref.WeakSet()
        self._stopped = True
        self._generation += 1  # what the machine decided before is void
        try:
            if not self.running:
                return
            self.running = False
            if self._tick.running:
                self._tick.stop()
            try:
                yield self.discovery.stop()
            finally:
                self._perform(self.machine.handleStop(self._now()))
                router, self.router = self.router, None
                if router is not None:
                    yield router.close()
        finally:
            for stream in streams:
                stream._end()

    def beaconReceived(self, uuid: UUID, host: str, port: int) -> None:
        scheme = "loopback:" if self.endpoint.startswith("loopback:") else "tcp://"
        endpoint = f"{scheme}{host}:{port}" if port else None
        self._perform(self.machine.handleBeacon(uuid, endpoint, self._now()))

    def dialPeer(self, endpoint: str) -> None:
        self._perform(self.machine.handleDial(wire_endpoint(endpoint), self._now()))

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        self._perform(self.machine.handleMessage(peer, frames, self._now()))

    def peerDisconnected(self, peer: bytes) -> None:
        """ZRE knows peers by their messages."""

    def subscribe(self, callback: Callable[[Event], Any]) -> Callable[[], None]:
        """Call *callback(event)* for every event; returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def events(self, size: int = 10_000) -> EventStream:
        """A new async iterator over the events from now on, until the node stops."""
        stream = EventStream(self, size)
        if self._stopped:
            stream._end()
        else:
            self._streams.add(stream)
        return stream

    def __aiter__(self) -> EventStream:
        return self.events()

    def whisper(self, peer: UUID, *frames: bytes) -> None:
        """Send *frames* to *peer*; :class:`UnknownPeer` if unknown."""
        self._perform(self.machine.whisper(peer, bytes_frames(frames), self._now()))

    def shout(self, group: str, *frames: bytes) -> None:
        self._perform(self.machine.shout(group, bytes_frames(frames), self._now()))

    def join(self, group: str) -> None:
        """Join *group* (before or after :meth:`start`)."""
        self._perform(self.machine.join(group, self._now()))

    def leave(self, group: str) -> None:
        self._perform(self.machine.leave(group, self._now()))

    def peers(self) -> list[UUID]:
        """The peers that have said HELLO."""
        return list(self.machine.peers)

    def peerName(self, peer: UUID) -> str:
        return self.machine.peer(peer).name

    def peerEndpoint(self, peer: UUID) -> str:
        return self.machine.peer(peer).endpoint

    def peerHeaders(self, peer: UUID) -> dict[str, str]:
        return dict(self.machine.peer(peer).headers)

    def peerGroups(self) -> list[str]:
        """The groups our peers are in (sorted)."""
        return sorted({g for p in self.machine.peers.values() for g in p.groups})

    def peersByGroup(self, group: str) -> list[UUID]:
        return [p.uuid for p in self.machine.peers.values() if group in p.groups]

    def ownGroups(self) -> list[str]:
        """The groups we are in, in the order we joined them."""
        return list(self.machine.ownGroups)

    def _perform(self, actions: list[Any]) -> None:
        """Perform *actions*, then deliver their events; batches meanwhile wait (ZRE's order)."""
        self._batches.append((self._generation, actions))
        if self._performing:
            return
        self._performing = True
        try:
            while self._batches:
                generation, batch = self._batches.popleft()
                live = self._live(generation)
                for action in batch:  # of a run that has ended, only closes and notices
                    self._performers[type(action)](self, action, generation, live)
        finally:
            self._performing = False
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._pending:
                generation, event = self._pending.popleft()
                if self._live(generation):
                    self._deliver(event)
        finally:
            self._delivering = False

    def _live(self, generation: int) -> bool:
        return self.running and generation == self._generation

    def _unreachable(self, endpoint: str) -> Optional[str]:
        """Why a peer's ZRE *endpoint* is not one we dial (None if it is)."""
        onLoopback = self.bindEndpoint.startswith("loopback:")
        if onLoopback != endpoint.startswith("loopback:") or not (
                onLoopback or endpoint.startswith("tcp://")):
            return "is not " + ("loopback:HOST:PORT" if onLoopback else "tcp://HOST:PORT")
        try:
            check(transport_endpoint(endpoint))
        except TransportError as e:
            return f"is not usable: {e}"
        return None

    def _sendOn(self, action: zre.SendOn, generation: int, live: bool) -> None:
        link = self.links.get(action.link) if live else None
        if link is not None:
            link.sendMessage(action.frames)

    def _emitEvent(self, action: zre.Emit, generation: int, live: bool) -> None:
        if live:
            self._pending.append((generation, action.event))

    def _openLink(self, action: zre.OpenLink, generation: int, live: bool) -> None:
        if not live:
            return
        try:
            self.links[action.link] = connect(
                transport_endpoint(action.endpoint), interfaces.DealerReceiver(), self.reactor,
                limits=self.limits, identity=zre.identity_of(self.uuid))
        except (TransportError, ValueError) as e:
            self.throttle.warn(log, "link", "ZRE node {name}: cannot reach a peer at {endpoint}: {error}",
                               name=self.name, endpoint=action.endpoint, error=e)
            self._batches.append((generation, self.machine.handleLinkFailed(action.link, self._now())))

    def _closeLink(self, action: zre.CloseLink, generation: int, live: bool) -> None:
        link = self.links.pop(action.link, None)
        if link is not None:
            link.close()

    def _notice(self, action: zre.Notice, generation: int, live: bool) -> None:
        emit = (getattr(log, action.level) if action.topic is None
                else functools.partial(self.throttle.log, action.level, log, action.topic))
        emit("ZRE node {name}: {text}", name=self.name, text=action.text)

    _performers = {zre.SendOn: _sendOn, zre.Emit: _emitEvent, zre.OpenLink: _openLink,
                   zre.CloseLink: _closeLink, zre.Notice: _notice}

    def _deliver(self, event: Event) -> None:
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:
                log.failure("ZRE node {name}: an event callback failed on {kind}",
                            name=self.name, kind=event.kind)
        for stream in list(self._streams):
            stream._put(event)


__all__ = ["BeaconDiscovery", "EndpointDiscovery", "EventStream", "Node", "UnknownPeer",
           "transport_endpoint", "wire_endpoint"]
