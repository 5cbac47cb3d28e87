"""A Harmony (ZRE) peer as a pure state machine (see :mod:`mdp.machine`).

A *link* is one outgoing DEALER (identity ``0x01`` + our UUID) to one peer's
ROUTER; everything a peer says arrives on our one ROUTER, tagged with its identity.
A beacon from an unknown UUID makes a *stranger* (our HELLO sent, its HELLO awaited
for *helloWait*); a HELLO makes a peer (ENTER); a sequence gap, an unknown or a
malformed message, or silence past *expired* drops it (EXIT); silence past *evasive*
PINGs it.  docs/harmony.md says in full what drops a peer and how dials back off.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Union
from uuid import UUID

import attrs

from mdp.harmony import codec
from mdp.harmony.codec import MalformedZre, UnknownCommand
from mdp.machine import Machine, action_type

DEFAULT_EVASIVE = 5.0  # seconds of silence: the peer is PINGed and reported EVASIVE
DEFAULT_EXPIRED = 30.0  # seconds of silence: the peer is dropped (EXIT)
DEFAULT_MAX_PEERS = 1000  # peers that said HELLO; HELLOs beyond are ignored
DEFAULT_MAX_STRANGERS = 64  # peers heard only by their beacons (our HELLO sent); beyond, the oldest goes
DEFAULT_HELLO_WAIT = 3.0  # seconds a stranger has, after its last beacon, to say HELLO
#: Redials back off up to this many times *expired*: each new HELLO looks like our restart.
DIAL_BACKOFF_LIMIT = 8

IDENTITY_PREFIX = b"\x01"

EVENTS = ("ENTER", "EXIT", "JOIN", "LEAVE", "WHISPER", "SHOUT", "EVASIVE")
ENTER, EXIT, JOIN, LEAVE, WHISPER, SHOUT, EVASIVE = EVENTS


@attrs.frozen
class Event:
    """What the application hears of a peer: *kind* is one of :data:`EVENTS`; *group* is set
    for JOIN, LEAVE, SHOUT, *frames* for WHISPER, SHOUT, *headers* and *endpoint* for ENTER."""

    kind: str
    peer: UUID
    name: str
    group: Optional[str] = None
    frames: tuple[bytes, ...] = ()
    headers: Mapping[str, str] = attrs.field(factory=dict)
    endpoint: str = ""


_action = functools.partial(action_type, __name__)
OpenLink = _action("OpenLink", "link", "endpoint")  # a new link to the ZRE *endpoint*, with our identity
CloseLink = _action("CloseLink", "link")
SendOn = _action("SendOn", "link", "frames")
Emit = _action("Emit", "event")
Notice = _action("Notice", "topic", "text", level="warn")  # for the log, throttled by *topic* (or None)


class UnknownPeer(KeyError):
    """No peer has this UUID (it never came, or it has gone)."""


def identity_of(uuid: UUID) -> bytes:
    return IDENTITY_PREFIX + uuid.bytes


_LOCAL_HOSTS = {"localhost", "127.0.0.1", "0.0.0.0", "*"}
_TCP = re.compile(r"^tcp://(?P<host>\[[^]]*\]|[^:]*):(?P<port>\d+)$")


def same_endpoint(one: str, other: str) -> bool:
    """Whether two ZRE endpoints are equal, or the same port on two names of this machine."""
    return one == other or endpoint_key(one) == endpoint_key(other)


def endpoint_key(endpoint: str) -> str:
    """*endpoint*, the same for any two that are :func:`same_endpoint`."""
    match = _TCP.match(endpoint)
    return f"tcp://*:{match['port']}" if match and match["host"] in _LOCAL_HOSTS else endpoint


def endpoint_port(endpoint: str) -> Optional[str]:
    match = _TCP.match(endpoint)
    return match["port"] if match else None


@attrs.define
class Peer:
    """A peer (it said HELLO), a stranger (heard by beacons) or a dial (a link to a listed endpoint)."""

    uuid: Optional[UUID]  # (None: a dial)
    endpoint: str
    link: int
    name: str = ""
    headers: Mapping[str, str] = attrs.field(factory=dict)
    groups: set[str] = attrs.field(factory=set)
    status: int = 0
    sent: int = 0
    received: int = 0
    evasiveAt: float = 0.0
    expiredAt: float = 0.0
    evasive: bool = False
    helloAt: float = 0.0  # when it said HELLO; for a stranger or a dial, when ours went (or it failed)
    answeredAt: float = float("-inf")
    failed: bool = False  # a dial whose link failed
    tries: int = 0  # a dial: the unanswered dials before this one


class HarmonyMachine(Machine):
    """One ZRE node: its peers, their groups, ours, and the sequence numbers; *reachable(endpoint)*
    says why a peer's endpoint cannot be dialled (None if it can): such a peer is ignored."""

    def __init__(self, uuid: UUID, name: str, *, headers: Optional[Mapping[str, str]] = None,
                 evasive: float = DEFAULT_EVASIVE, expired: float = DEFAULT_EXPIRED,
                 maxPeers: int = DEFAULT_MAX_PEERS, maxGroups: int = codec.DEFAULT_MAX_GROUPS,
                 maxHeaders: int = codec.DEFAULT_MAX_HEADERS, maxStrangers: int = DEFAULT_MAX_STRANGERS,
                 helloWait: float = DEFAULT_HELLO_WAIT,
                 reachable: Callable[[str], Optional[str]] = lambda endpoint: None, now: float = 0.0) -> None:
        super().__init__(now)
        if not (0 < evasive < expired and maxStrangers >= 1 and helloWait > 0):
            raise ValueError(f"need 0 < evasive < expired, maxStrangers >= 1 and helloWait > 0, got evasive="
                             f"{evasive} expired={expired} maxStrangers={maxStrangers} helloWait={helloWait}")
        self.uuid = uuid
        self.name = codec.check_string(name, "node name")
        self.headers = dict(headers or {})
        for key, value in self.headers.items():
            codec.check_string(key, "header name")
            if not isinstance(value, str):
                raise TypeError(f"header {key!r}: a value is a str, not {type(value).__name__}")
        self.evasive, self.expired, self.helloWait = evasive, expired, helloWait
        self.maxPeers, self.maxStrangers = maxPeers, maxStrangers
        self.maxGroups, self.maxHeaders = maxGroups, maxHeaders
        if len(self.headers) > maxHeaders:
            raise ValueError(f"{len(self.headers)} headers, more than peers take (maxHeaders {maxHeaders})")
        self.reachable, self.endpoint, self.running = reachable, "", False
        self.status = self._links = 0
        self.ownGroups: dict[str, None] = {}
        #: the peers that said HELLO, those heard only by beacons (oldest first), each by endpoint key
        self.peers: dict[UUID, Peer] = {}
        self._peerAt: dict[str, UUID] = {}
        self.strangers: dict[UUID, Peer] = {}
        self._strangerAt: dict[str, UUID] = {}
        self.dials: dict[str, Peer] = {}  # links to listed endpoints not yet known as a peer
        self.listed: list[str] = []  # endpoints dialled again when the peer there goes

    def handleStart(self, endpoint: str, now: float) -> list[Any]:
        self.now, self.endpoint, self.running = now, endpoint, True
        return self._drain()

    def handleStop(self, now: float) -> list[Any]:
        """Close every link and forget every peer, with no events."""
        self.now, self.running = now, False
        for end in [*self.peers.values(), *self.strangers.values(), *self.dials.values()]:
            self._emit(CloseLink(end.link))
        for table in (self.peers, self._peerAt, self.strangers, self._strangerAt, self.dials):
            table.clear()
        return self._drain()

    def join(self, group: str, now: float) -> list[Any]:
        """Join *group*; ``ValueError`` beyond *maxGroups* (peers with that bound drop us)."""
        self.now = now
        codec.check_string(group, "group")
        if group not in self.ownGroups:
            if len(self.ownGroups) >= self.maxGroups:
                raise ValueError(f"cannot join {group!r}: in {len(self.ownGroups)} groups "
                                 f"already, the most peers take (maxGroups)")
            self.ownGroups[group] = None
            self._broadcastStatus(codec.Join, group)
        return self._drain()

    def leave(self, group: str, now: float) -> list[Any]:
        """Leave *group* (if in it)."""
        self.now = now
        codec.check_string(group, "group")
        if group in self.ownGroups:
            del self.ownGroups[group]
            self._broadcastStatus(codec.Leave, group)
        return self._drain()

    def peer(self, uuid: UUID) -> Peer:
        """The peer *uuid*; :class:`UnknownPeer` if there is none."""
        if (found := self.peers.get(uuid)) is None:
            raise UnknownPeer(uuid)
        return found

    def whisper(self, peer: UUID, frames: Iterable[bytes], now: float) -> list[Any]:
        """Send *frames* to *peer*; :class:`UnknownPeer` if there is none."""
        self.now = now
        self._send(self.peer(peer), codec.Whisper(0, tuple(frames)))
        return self._drain()

    def shout(self, group: str, frames: Iterable[bytes], now: float) -> list[Any]:
        self.now = now
        codec.check_string(group, "group")
        message = codec.Shout(0, group, tuple(frames))
        for peer in self.peers.values():
            if group in peer.groups:
                self._send(peer, message)
        return self._drain()

    def handleBeacon(self, uuid: UUID, endpoint: Optional[str], now: float) -> list[Any]:
        """A beacon from *uuid* whose ROUTER is at *endpoint* (None: port 0, it is leaving)."""
        self.now = now
        if uuid == self.uuid or not self.running:
            return self._drain()
        peer = self.peers.get(uuid)
        if endpoint is None:
            self._remove(peer, "it is leaving (beacon with port 0)")
            self._forget(self.strangers.get(uuid))
        elif peer is not None:
            self._refresh(peer)
        elif (known := self.strangers.get(uuid)) and same_endpoint(known.endpoint, endpoint):
            known.expiredAt = now + self.helloWait  # a stranger: refreshed
        else:
            self._stranger(uuid, endpoint)
        return self._drain()

    def _stranger(self, uuid: UUID, endpoint: str) -> None:
        """Our HELLO to *uuid* unless a link goes to *endpoint* (a new UUID there hears us)."""
        key = endpoint_key(endpoint)
        self._forget(self.strangers.get(uuid))  # its beacons name two endpoints: one is forged
        if (old := self.peers.get(self._peerAt.get(key))) is not None and old.evasive:
            self._remove(old, f"it is silent and {uuid} beacons from its endpoint")
        if (key in self._peerAt or key in self._strangerAt or len(self.peers) >= self.maxPeers
                or any(same_endpoint(endpoint, e) for e in self.dials)
                or not self._reachable(uuid, endpoint)):
            return
        if len(self.strangers) >= self.maxStrangers:
            oldest = next(iter(self.strangers.values()))
            self._emit(Notice("strangers", f"{len(self.strangers)} peers heard only by beacons "
                                           f"(maxStrangers): forgetting {oldest.uuid} at {oldest.endpoint}"))
            self._forget(oldest)
        self.strangers[uuid] = stranger = Peer(uuid, endpoint, self._newLink(endpoint), helloAt=self.now,
                                               expiredAt=self.now + self.helloWait)
        self._strangerAt[key] = uuid
        self._send(stranger, self._hello(0))

    def _forget(self, stranger: Optional[Peer], close: bool = True) -> None:
        if stranger is not None and self.strangers.pop(stranger.uuid, None) is not None:
            self._strangerAt.pop(endpoint_key(stranger.endpoint), None)
            if close:
                self._emit(CloseLink(stranger.link))

    def handleDial(self, endpoint: str, now: float) -> list[Any]:
        """Reach the node at *endpoint* without a beacon, and again whenever it goes."""
        self.now = now
        if endpoint not in self.listed:
            self.listed.append(endpoint)
        self._dial(endpoint)
        return self._drain()

    def _dial(self, endpoint: str, tries: int = 0) -> None:
        taken = [self.endpoint, *self.dials, *(p.endpoint for p in self.peers.values())]
        if not self.running or any(same_endpoint(endpoint, e) for e in taken):
            return
        self._forget(self.strangers.get(self._strangerAt.get(endpoint_key(endpoint))))
        link = self._newLink(endpoint)
        dial = self.dials[endpoint] = Peer(None, endpoint, link, helloAt=self.now, tries=tries)
        self._send(dial, self._hello(0))

    def handleLinkFailed(self, link: int, now: float) -> list[Any]:
        """The link could not be opened: forget its peer; a dial stays for the tick to redo."""
        self.now = now
        self._remove(next((p for p in self.peers.values() if p.link == link), None),
                     "its endpoint cannot be reached")
        self._forget(next((s for s in self.strangers.values() if s.link == link), None))
        for dial in self.dials.values():
            if dial.link == link:
                dial.helloAt = now
                dial.failed = True
        return self._drain()

    def handleMessage(self, identity: bytes, frames: list[bytes], now: float) -> list[Any]:
        self.now = now
        uuid = self._sender(identity)
        if uuid is None:
            return self._drain()
        peer = self.peers.get(uuid)
        message = self._read(uuid, peer, frames)
        if message is None:
            return self._drain()
        if isinstance(message, codec.Hello):
            peer = self._greeted(uuid, peer, message)
            if peer is None:
                return self._drain()
        elif peer is None:
            self._emit(Notice("unready", f"dropped {codec.COMMANDS[message.id]} from "
                                         f"{self._who(uuid, peer)}, which has not said HELLO", "info"))
            return self._drain()
        if self._inSequence(peer, message):
            self._handlers[type(message)](self, peer, message)
            self._refresh(peer)
        return self._drain()

    def _sender(self, identity: bytes) -> Optional[UUID]:
        """The UUID behind *identity*; None for a message to drop."""
        if not self.running:
            return None
        if len(identity) != 17 or not identity.startswith(IDENTITY_PREFIX):
            self._emit(Notice("identity", f"dropped a message from a peer whose identity "
                                          f"{identity!r} is not 0x01 and a UUID"))
            return None
        uuid = UUID(bytes=identity[1:])
        return None if uuid == self.uuid else uuid

    def _read(self, uuid: UUID, peer: Optional[Peer], frames: list[bytes]) -> Optional[codec.Message]:
        """The message in *frames*; None if unknown or malformed (its peer is dropped)."""
        try:
            return codec.decode(frames, maxGroups=self.maxGroups, maxHeaders=self.maxHeaders)
        except MalformedZre as e:
            what = "unknown" if isinstance(e, UnknownCommand) else "malformed"
            self._emit(Notice("malformed", f"{what} message from {self._who(uuid, peer)}: {e}"))
            self._remove(peer, f"it sent a {what} message")
            return None

    def _greeted(self, uuid: UUID, peer: Optional[Peer], hello: codec.Hello) -> Optional[Peer]:
        """The peer that said *hello*, ready for ENTER; None if dropped or said again."""
        if hello.sequence != 1:
            self._emit(Notice("hello", f"dropped a HELLO numbered {hello.sequence}, not 1, "
                                       f"from {self._who(uuid, peer)}"))
            self._remove(peer, "its HELLO was out of sequence")
            return None
        if peer is not None and self.now - peer.helloAt < self.evasive and same_endpoint(
                hello.endpoint, peer.endpoint):  # its new link to us, in the same run
            self._helloAgain(peer, hello)
            return None
        self._remove(peer, "it said HELLO again (restarted)")
        return self._admit(uuid, hello.endpoint)

    def _helloAgain(self, peer: Peer, hello: codec.Hello) -> None:
        """Its sequence and groups start again; our HELLO goes back, once an *evasive*."""
        peer.received = 1
        peer.helloAt = self.now
        self._takeHello(peer, hello)
        if self.now - peer.answeredAt >= self.evasive:
            peer.answeredAt = self.now
            peer.sent = 0
            self._send(peer, self._hello(0))
        self._refresh(peer)

    def _inSequence(self, peer: Peer, message: codec.Message) -> bool:
        """A HELLO is numbered 1 (:meth:`_greeted` checked it); the rest follow on."""
        if not (isinstance(message, codec.Hello) or codec.next_sequence_ok(peer.received, message.sequence)):
            self._emit(Notice(None, f"messages lost from {self._who(peer.uuid, peer)}: "
                                    f"{codec.COMMANDS[message.id]} numbered {message.sequence} "
                                    f"after {peer.received}; dropping the peer"))
            self._remove(peer, "messages were lost")
            return False
        peer.received = message.sequence
        return True

    def _onHello(self, peer: Peer, message: codec.Hello) -> None:
        self._emit(Emit(Event(ENTER, peer.uuid, message.name, headers=dict(message.headers),
                              endpoint=peer.endpoint)))
        self._emit(Notice(None, f"{message.name} ({peer.uuid}) entered from {peer.endpoint}", "info"))
        self._takeHello(peer, message)

    def _takeHello(self, peer: Peer, hello: codec.Hello) -> None:
        """The name, headers, groups and status *hello* says."""
        peer.name, peer.headers = hello.name, dict(hello.headers)
        for group in sorted(peer.groups - set(hello.groups)):
            self._peerIn(peer, group, False)
        for group in hello.groups:
            self._peerIn(peer, group, True)
        peer.status = hello.status

    def _onWhisper(self, peer: Peer, message: codec.Whisper) -> None:
        self._emit(Emit(Event(WHISPER, peer.uuid, peer.name, frames=message.content)))

    def _onShout(self, peer: Peer, message: codec.Shout) -> None:
        self._emit(Emit(Event(SHOUT, peer.uuid, peer.name, group=message.group, frames=message.content)))

    def _onPing(self, peer: Peer, message: codec.Ping) -> None:
        self._send(peer, codec.PingOk(0))

    def _onGroup(self, peer: Peer, message: Union[codec.Join, codec.Leave]) -> None:
        """A JOIN or LEAVE adds one to the status; a peer that counts otherwise is believed."""
        joins = isinstance(message, codec.Join)
        if joins and len(peer.groups) >= self.maxGroups and message.group not in peer.groups:
            self._emit(Notice("groups", f"{self._who(peer.uuid, peer)} joined more than "
                                        f"{self.maxGroups} groups (maxGroups); dropping the peer"))
            self._remove(peer, "it joined too many groups")
            return
        self._peerIn(peer, message.group, joins)
        peer.status = (peer.status + 1) & 0xFF
        if message.status != peer.status:
            self._emit(Notice("status", f"{self._who(peer.uuid, peer)} sent {codec.COMMANDS[message.id]} "
                                        f"with status {message.status}, expected {peer.status}; "
                                        "taking its count"))
            peer.status = message.status

    _handlers = {codec.Hello: _onHello, codec.Whisper: _onWhisper, codec.Shout: _onShout, codec.Ping: _onPing,
                 codec.PingOk: lambda self, peer, message: None, codec.Join: _onGroup, codec.Leave: _onGroup}

    def _peerIn(self, peer: Peer, group: str, joined: bool) -> None:
        """*peer* joined *group* (not *joined*: left it): a JOIN or LEAVE event, if that is news."""
        if (group in peer.groups) != joined:
            (peer.groups.add if joined else peer.groups.discard)(group)
            self._emit(Emit(Event(JOIN if joined else LEAVE, peer.uuid, peer.name, group=group)))

    def handleTick(self, now: float) -> list[Any]:
        self.now = now
        for dial in list(self.dials.values()):
            if now - dial.helloAt >= self._dialWait(dial.tries):
                self._emit(Notice(None, f"{'no link to' if dial.failed else 'no HELLO from'} "
                                        f"{dial.endpoint} in {now - dial.helloAt:.0f} s; dialling it again, "
                                        f"then again after {self._dialWait(dial.tries + 1):.0f} s", "info"))
                del self.dials[dial.endpoint]
                self._emit(CloseLink(dial.link))
                self._dial(dial.endpoint, dial.tries + 1)
        for peer in list(self.peers.values()):
            if now >= peer.expiredAt:
                self._remove(peer, f"it expired after {self.expired:.1f} s of silence")
            elif now >= peer.evasiveAt:
                self._send(peer, codec.Ping(0))
                if not peer.evasive:
                    peer.evasive = True
                    self._emit(Emit(Event(EVASIVE, peer.uuid, peer.name)))
        for stranger in list(self.strangers.values()):
            if now >= stranger.expiredAt:
                self._emit(Notice("unanswered", f"no HELLO from {stranger.uuid} at {stranger.endpoint} "
                                                f"within {self.helloWait:g} s of its beacon", "info"))
                self._forget(stranger)
        return self._drain()

    def _dialWait(self, tries: int) -> float:
        return self.expired * min(2 ** tries, DIAL_BACKOFF_LIMIT)

    def _hello(self, sequence: int) -> codec.Hello:
        return codec.Hello(sequence, self.endpoint, tuple(self.ownGroups), self.status,
                           self.name, dict(self.headers))

    def _newLink(self, endpoint: str) -> int:
        self._links += 1
        self._emit(OpenLink(self._links, endpoint))
        return self._links

    def _reachable(self, uuid: UUID, endpoint: str) -> bool:
        why = self.reachable(endpoint)
        if why is None and self.endpoint and same_endpoint(endpoint, self.endpoint):
            why = "is this node's own (another peer cannot answer there)"
        if why is not None:
            self._emit(Notice("unreachable", f"ignoring {uuid}: its endpoint {endpoint!r} {why}"))
        return why is None

    def _admit(self, uuid: UUID, endpoint: str) -> Optional[Peer]:
        """*uuid*, which said HELLO, as a peer on the link of its dial or of its stranger at
        *endpoint*, else a new one; None if *endpoint* cannot be reached or the table is full."""
        if not self._reachable(uuid, endpoint):
            return None
        if len(self.peers) >= self.maxPeers:
            self._emit(Notice("full", f"ignoring {uuid} at {endpoint}: {len(self.peers)} peers "
                                      "already (maxPeers)"))
            self._forget(self.strangers.get(uuid))  # once there is room, its beacon brings our HELLO
            return None
        key = endpoint_key(endpoint)
        if (other := self._peerAt.get(key)) is not None:
            self._remove(self.peers[other], f"{uuid} now answers at its endpoint", redial=False)
        stranger = self.strangers.get(uuid)
        if (stranger is None or endpoint_key(stranger.endpoint) != key
                or self.now - stranger.helloAt >= self.helloWait):
            # ours went elsewhere, to another UUID's node, or long ago (refused by a full table?)
            self._forget(stranger)
            self._forget(self.strangers.get(self._strangerAt.get(key)))
            stranger = None
        via = self._answeredDial(endpoint)
        self._forget(stranger, close=via is not None)
        if (via := via or stranger) is not None:
            peer = Peer(uuid, via.endpoint, via.link, sent=via.sent)
        else:
            peer = Peer(uuid, endpoint, self._newLink(endpoint))
            self._send(peer, self._hello(0))
        peer.helloAt = self.now
        self.peers[uuid] = peer
        self._peerAt[endpoint_key(peer.endpoint)] = uuid
        self._refresh(peer)
        return peer

    def _answeredDial(self, endpoint: str) -> Optional[Peer]:
        """The dial a peer at *endpoint* answers, removed: the one to it, else the only
        one to its port (a listed name); None if none, or its link failed."""
        dial = next((d for e, d in self.dials.items() if same_endpoint(e, endpoint)), None)
        port = endpoint_port(endpoint)
        if dial is None and port is not None:
            same_port = [d for d in self.dials.values() if endpoint_port(d.endpoint) == port]
            dial = same_port[0] if len(same_port) == 1 else None
        if dial is None:
            return None
        del self.dials[dial.endpoint]
        return None if dial.failed else dial

    def _refresh(self, peer: Peer) -> None:
        peer.evasiveAt = self.now + self.evasive
        peer.expiredAt = self.now + self.expired
        peer.evasive = False

    def _remove(self, peer: Optional[Peer], reason: str, redial: bool = True) -> None:
        if peer is None or self.peers.get(peer.uuid) is not peer:
            return
        del self.peers[peer.uuid]
        if self._peerAt.get(key := endpoint_key(peer.endpoint)) == peer.uuid:
            del self._peerAt[key]
        self._emit(CloseLink(peer.link))
        self._emit(Notice(None, f"{self._who(peer.uuid, peer)} left: {reason}", "info"))
        self._emit(Emit(Event(EXIT, peer.uuid, peer.name, endpoint=peer.endpoint)))
        if redial:
            listed = next((e for e in self.listed if same_endpoint(e, peer.endpoint)), None)
            if listed is not None:
                self._dial(listed)

    def _send(self, to: Peer, message: codec.Message) -> None:
        to.sent = codec.next_sequence(to.sent)
        self._emit(SendOn(to.link, codec.encode(attrs.evolve(message, sequence=to.sent))))

    def _broadcastStatus(self, kind: type, group: str) -> None:
        """Our status goes up by one on each JOIN or LEAVE we send, to peers and dials."""
        self.status = (self.status + 1) & 0xFF
        message = kind(0, group, self.status)
        for to in [*self.peers.values(), *self.strangers.values(),
                   *(d for d in self.dials.values() if not d.failed)]:
            self._send(to, message)

    @staticmethod
    def _who(uuid: UUID, peer: Optional[Peer]) -> str:
        return (f"unknown peer {uuid}" if peer is None
                else f"{peer.name or 'peer'} ({uuid}) at {peer.endpoint}")
