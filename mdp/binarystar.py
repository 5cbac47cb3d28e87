"""Binary Star: a primary/backup pair of servers, one active at a time (the Guide's
pattern; docs/binarystar.md).  :class:`BinaryStarMachine` is its table (:data:`TABLE`),
pure; :class:`BinaryStar` drives it over a state channel and is a broker's ``admission``.
"""

from __future__ import annotations

import collections
import enum
import os
import re
from typing import Any, Callable, Optional, Sequence, Union

from twisted.internet import defer, task
from twisted.logger import Logger
from zope.interface import implementer

from mdp import transport
from mdp.errors import ProtocolError
from mdp.interfaces import DealerReceiver, IAdmission, IRouterReceiver
from mdp.machine import Machine, action_type, machine_view
from mdp.policy import Backoff, Limits, LogThrottle, default_reactor, positive_seconds

log = Logger()

DEFAULT_HEARTBEAT = 1.0


#: where a server is, numbered 1-4 as in the Guide (the numbers travel on the wire): PRIMARY
#: and BACKUP wait for the peer; ACTIVE serves clients, PASSIVE does not
State = enum.IntEnum("State", {"PRIMARY": 1, "BACKUP": 2, "ACTIVE": 3, "PASSIVE": 4})
#: what happens to a server: its peer's state (as State's numbers), or a client's request
Event = enum.IntEnum("Event", {"PEER_PRIMARY": 1, "PEER_BACKUP": 2, "PEER_ACTIVE": 3, "PEER_PASSIVE": 4,
                               "CLIENT_REQUEST": 5})
Role = enum.Enum("Role", {"PRIMARY": "primary", "BACKUP": "backup"})


# outcomes in the table; VOTE: ACTIVE if the peer is silent beyond the failover timeout, else refuse
IGNORE, REFUSE, FATAL, VOTE = "ignore", "refuse", "fatal", "vote"

#: (state, event) -> (outcome, why: what the log line says on a change)
TABLE: dict[tuple[State, Event], tuple[Union[State, str], str]] = {
    (State.PRIMARY, Event.PEER_BACKUP): (State.ACTIVE, "connected to the backup (passive)"),
    (State.PRIMARY, Event.PEER_ACTIVE): (State.PASSIVE, "connected to the backup (active)"),
    (State.PRIMARY, Event.CLIENT_REQUEST): (VOTE, "a vote, the backup silent"),
    (State.BACKUP, Event.PEER_ACTIVE): (State.PASSIVE, "connected to the primary (active)"),
    (State.BACKUP, Event.CLIENT_REQUEST): (REFUSE, "a backup waiting for its primary"),
    (State.ACTIVE, Event.PEER_ACTIVE): (FATAL, "dual actives: the peer is active too (split brain)"),
    (State.PASSIVE, Event.PEER_PRIMARY): (State.ACTIVE, "the primary (passive) restarts"),
    (State.PASSIVE, Event.PEER_BACKUP): (State.ACTIVE, "the backup (passive) restarts"),
    (State.PASSIVE, Event.PEER_PASSIVE): (
        FATAL, "dual passives: the peer is passive too, no one would serve"),
    (State.PASSIVE, Event.CLIENT_REQUEST): (VOTE, "failover: a vote, the peer silent"),
}


#: the state changed (log it; on ACTIVE start serving, on PASSIVE stop)
Changed = action_type(__name__, "Changed", "old", "new", "reason")
#: stop: carrying on would break the pair
Fatal = action_type(__name__, "Fatal", "reason")
#: the peer is configured as we are; it started later and will stop
Conflict = action_type(__name__, "Conflict", "reason")
#: no tick for *seconds* (a stall): open state channel *channel*, the old one is stale;
#: *serving*: it was active (and now waits to hear the peer)
Stalled = action_type(__name__, "Stalled", "seconds", "channel", "serving")
#: active after a stall, and the peer did not take over: serve again
Resumed = action_type(__name__, "Resumed", "reason")


#: a STATE message: what a server publishes (the machine's action) and what the peer's says
PeerState = PublishState = collections.namedtuple(
    "PeerState", "state role uptime instance heartbeat", defaults=("", DEFAULT_HEARTBEAT))


Action = Union[Changed, Fatal, Conflict, PublishState, Stalled, Resumed]


class BinaryStarMachine(Machine):
    """One server of a pair.  Feed it the peer's state messages, client requests
    (it answers whether to serve) and a tick every *heartbeat* seconds."""

    def __init__(self, role: Role, *, heartbeat: float = DEFAULT_HEARTBEAT,
                 instance: str = "", now: float = 0.0) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role is a Role (PRIMARY or BACKUP), not {role!r}")
        super().__init__(now)
        self.role = role
        self.heartbeat = positive_seconds("heartbeat", heartbeat)
        #: this run's id: hearing it back means a loop; it also breaks start-time ties
        self.instance = instance
        self.state = State.PRIMARY if role is Role.PRIMARY else State.BACKUP
        self.started = now
        self.peerExpiry = now + self.failoverTimeout
        #: since when a peer configured alike talks, which run, last heard when
        self.conflictSince: Optional[float] = None
        self.conflictWith, self.conflictHeard = "", 0.0
        self.stopped: Optional[str] = None
        #: the state channel's number (+1 per stall); a resuming server waits until resumeBy
        self.lastTick: Optional[float] = None
        self.channel, self.resuming, self.resumeBy = 0, False, 0.0

    @property
    def failoverTimeout(self) -> float:
        """Seconds of silence after which the peer counts as gone."""
        return 2 * self.heartbeat

    @property
    def serving(self) -> bool:
        """Whether clients are served now."""
        return self.state is State.ACTIVE and self.publishing

    @property
    def publishing(self) -> bool:
        """Whether this server tells its state (not while resuming from a stall)."""
        return self.stopped is None and not self.resuming

    def handlePeerState(self, peerState: int, peerRole: Optional[Role], peerUptime: float, now: float, *,
                        peerInstance: str = "", peerHeartbeat: Optional[float] = None,
                        channel: Optional[int] = None) -> list[Action]:
        """A state message from the peer, on state channel *channel* (default: the current)."""
        channel = self.channel if channel is None else channel  # before a stall it may reveal
        self._wake(now)
        event = self._peerEvent(peerState, channel, peerInstance, peerHeartbeat)
        if event is not None:
            self.peerExpiry = now + self.failoverTimeout
            if peerRole is self.role:
                self._sameRole(peerUptime, peerInstance)
            else:
                self.conflictSince = None
                (self._resumeOnPeer if self.resuming else self._apply)(event)
        return self._drain()

    def _peerEvent(self, peerState: int, channel: int, peerInstance: str,
                   peerHeartbeat: Optional[float]) -> Optional[Event]:
        """The event a peer's state stands for; None if stale, not a state, or fatal."""
        if self.stopped is not None or channel < self.channel:
            return None
        if peerState not in list(State):  # not a state (CLIENT_REQUEST is no state either)
            return None
        if self.instance and peerInstance == self.instance:
            self._stop("this server hears its own state: its remote state endpoint leads "
                       "back to its local one")
            return None
        if peerHeartbeat is not None and peerHeartbeat != self.heartbeat:
            self._stop(f"the peer's state heartbeat is {peerHeartbeat:g} s, this one's "
                       f"{self.heartbeat:g} s: both must be the same")
            return None
        return Event(peerState)

    def _resumeOnPeer(self, event: Event) -> None:
        """Heard from the peer after a stall: PASSIVE if it took over, else serve again."""
        self.resuming = False
        if event is Event.PEER_ACTIVE:
            old, self.state = self.state, State.PASSIVE
            self._emit(Changed(old, State.PASSIVE, "the peer took over while this server was stalled"))
        else:
            self._emit(Resumed(f"the peer is {State(event).name.lower()}"))
        self._emit(self.publication())

    def _sameRole(self, peerUptime: float, peerInstance: str) -> None:
        """Both configured alike: the one started later stops (within a heartbeat, the run id
        decides; docs/binarystar.md says how a deadlock ends)."""
        reason = f"both servers are configured {self.role.value}"
        now = self.now
        peerStarted = now - peerUptime
        later = (self.instance > peerInstance if abs(self.started - peerStarted) < self.heartbeat
                 else self.started > peerStarted)
        if later:
            self._stop(f"{reason}; this one started later and stops")
            return
        if (self.conflictSince is None or peerInstance != self.conflictWith
                or now - self.conflictHeard > self.failoverTimeout):
            self.conflictSince, self.conflictWith = now, peerInstance
        self.conflictHeard = now
        lasted = now - self.conflictSince
        if lasted > 2 * self.failoverTimeout or (
                lasted > self.failoverTimeout and self.instance > peerInstance):
            self._stop(f"{reason}; the peer, which started later, did not stop")
            return
        self._emit(Conflict(f"{reason}; the peer started later and must stop"))

    def handleClientRequest(self, now: float) -> tuple[bool, list[Action]]:
        """A client request: whether to serve it, and the actions."""
        self._wake(now)
        if self.stopped is None:
            if self._resumeIfSilent():
                self._emit(self.publication())
            self._apply(Event.CLIENT_REQUEST)
        return self.serving, self._drain()

    def handleSubscriber(self, now: float) -> tuple[bool, list[Action]]:
        """A new subscriber asks for our state: whether to send it now."""
        self._wake(now)
        return self.publishing, self._drain()

    def handleTick(self, now: float) -> list[Action]:
        self._wake(now)
        self.lastTick = now
        if self.stopped is None:
            self._resumeIfSilent()
            if not self.resuming:
                self._emit(self.publication())
        return self._drain()

    def publication(self) -> PublishState:
        """What this server publishes now."""
        return PublishState(self.state, self.role, self.now - self.started, self.instance, self.heartbeat)

    def _wake(self, now: float) -> None:
        """A gap since the last tick beyond the failover timeout is a stall."""
        self.now = now
        last = self.lastTick
        if last is None or self.stopped is not None or now - last <= self.failoverTimeout:
            return
        self.lastTick = now
        self.channel += 1
        self.peerExpiry = now + self.failoverTimeout
        self.resuming = self.resuming or self.state is State.ACTIVE
        waits = 1 if self.role is Role.PRIMARY else 2
        self.resumeBy = now + waits * self.failoverTimeout
        self._emit(Stalled(now - last, self.channel, self.resuming))

    def _resumeIfSilent(self) -> bool:
        """A resuming server whose peer stayed silent serves again: True if so."""
        if self.resuming and self.now >= self.resumeBy:
            self.resuming = False
            self._emit(Resumed("the peer stayed silent"))
            return True
        return False

    def _apply(self, event: Event) -> None:
        outcome, why = TABLE.get((self.state, event), (IGNORE, ""))
        if outcome == VOTE:
            outcome = State.ACTIVE if self.now >= self.peerExpiry else REFUSE
        if outcome == FATAL:
            self._stop(why)
        elif isinstance(outcome, State):
            old, self.state = self.state, outcome
            self._emit(Changed(old, outcome, why))

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        self._emit(Fatal(reason))


#: warn of a peer silent this many failover timeouts, again every SILENT_PEER_REPEAT s
SILENT_PEER_WARNING = 5
SILENT_PEER_REPEAT = 60.0

HEADER, SUBSCRIBE, STATE = b"BSTAR01", b"SUB", b"STATE"
#: the peer and a few monitors
MAX_SUBSCRIBERS = 16

_INSTANCE = re.compile(rb"^[0-9a-f]{16}$")


def new_instance() -> str:
    """A fresh run id: 16 hex digits."""
    return os.urandom(8).hex()


def encode_state(state: State, role: Role, uptime: float, instance: str, heartbeat: float) -> list[bytes]:
    return [HEADER, STATE, b"%d" % state, role.value.encode(), b"%.6f" % uptime,
            instance.encode("ascii"), repr(float(heartbeat)).encode("ascii")]


def decode_state(frames: Sequence[bytes]) -> PeerState:
    """What a STATE message says; :class:`ProtocolError` for anything else."""
    if len(frames) != 7 or frames[0] != HEADER or frames[1] != STATE:
        raise ProtocolError(f"not a Binary Star state message: {list(frames)[:3]!r}")
    try:
        state = State(int(frames[2]))
        role = Role(bytes(frames[3]).decode("ascii"))
        uptime, heartbeat = float(frames[4]), float(frames[6])
    except ValueError:
        raise ProtocolError(f"bad Binary Star state message {list(frames)!r}") from None
    if not uptime >= 0:  # NaN is out of every range
        raise ProtocolError(f"bad uptime in Binary Star state message: {frames[4]!r}")
    if not 0 < heartbeat < float("inf"):
        raise ProtocolError(f"bad heartbeat in Binary Star state message: {frames[6]!r}")
    if not _INSTANCE.match(bytes(frames[5])):
        raise ProtocolError(f"bad run id in Binary Star state message: {frames[5]!r}")
    return PeerState(state, role, uptime, bytes(frames[5]).decode("ascii"), heartbeat)


class _Subscriber(DealerReceiver):
    """The pipe to the peer's endpoint, for the machine's current state channel (its loss
    counts for nothing: the transport reconnects, and silence is what counts)."""

    def __init__(self, star: BinaryStar) -> None:
        self.star = star
        self.transport: Any = None

    def connectionMade(self) -> None:
        if self.star._subscriber is self:
            self.star._subscribe()

    def messageReceived(self, frames: list[bytes]) -> None:
        if self.star._subscriber is self:
            self.star._stateFrom(frames)


Observer = Callable[[str], Any]


@implementer(IAdmission, IRouterReceiver)
class BinaryStar:
    """One server of a Binary Star pair: publishes its state on *local*, reads the
    peer's from *remote* (the peer's *local*).  :meth:`admitClient` and
    :meth:`admitWorker` are the votes; after a fatal error (:meth:`onFatal`)
    nothing more is admitted and the server should close."""

    def __init__(self, role: Union[Role, str], local: str, remote: str, reactor: Optional[Any] = None, *,
                 heartbeat: float = DEFAULT_HEARTBEAT, limits: Limits = Limits()) -> None:
        if isinstance(role, str):
            try:
                role = Role(role)
            except ValueError:
                raise ValueError(f"role is 'primary' or 'backup', not {role!r}") from None
        transport.check(local, transport.LISTEN)
        transport.check(remote, transport.CONNECT)
        self.reactor = default_reactor(reactor)
        self.local, self.remote, self.limits = local, remote, limits
        self.machine = BinaryStarMachine(role, heartbeat=heartbeat, instance=new_instance(),
                                         now=self.reactor.seconds())
        self.throttle = LogThrottle(self.reactor)
        #: the peer's last state and when it was heard
        self.peerState: Optional[State] = None
        self.peerHeard: Optional[float] = None
        self._observers: dict[str, list[Observer]] = {"active": [], "passive": [], "fatal": []}
        #: the local endpoint, and who subscribed there: when each stops counting unless heard again
        self._router: Any = None
        self._subscribers: dict[bytes, float] = {}
        self._subscriber = _Subscriber(self)
        self._ticker = task.LoopingCall(self._tick)
        self._ticker.clock = self.reactor
        self._performers: dict[type, Callable[[Any], None]] = {
            PublishState: self._publish, Changed: self._changed, Stalled: self._stalled, Fatal: self._fatal,
            Resumed: lambda a: self._say("info", "active again after the stall ({reason})", reason=a.reason),
            Conflict: lambda a: self._say("warn", "{reason}", "conflict", reason=a.reason)}
        self._running = False
        #: when the peer's silence was last warned about (None: not silent)
        self._silenceWarned: Optional[float] = None

    role = machine_view("role", "PRIMARY or BACKUP.")
    state = machine_view("state", "Where this server is (:class:`State`).")

    @property
    def serving(self) -> bool:
        """Whether this server serves clients now."""
        return self._running and self.machine.serving

    @property
    def endpoint(self) -> Optional[str]:
        """The bound state endpoint (with the port the OS picked), once started."""
        return self._router.endpoint if self._router is not None else None

    def admitClient(self, now: Optional[float] = None) -> bool:
        """The client's vote: True if it is to be served (this server is, or just became, active)."""
        if not self._running:
            return False
        served, actions = self.machine.handleClientRequest(self._now(now))
        self._perform(actions)
        if not self._running:  # an observer stopped it
            return False
        if not served:
            self.throttle.info(log, "refused", "Binary Star {role} is {state}: not serving",
                               role=self.role.value, state=self.state.name.lower())
        return served

    #: a worker's READY votes as a client's request does (the Guide says so)
    admitWorker = admitClient

    def status(self, now: Optional[float] = None) -> dict[str, Any]:
        """Role, state and what is known of the peer (``mmi.binarystar``)."""
        now = self._now(now)
        return dict(role=self.role.value, state=self.state.name.lower(), serving=self.serving,
                    peer=self.peerState.name.lower() if self.peerState is not None else None,
                    peerSilence=round(now - self.peerHeard, 3) if self.peerHeard is not None else None,
                    failoverTimeout=self.machine.failoverTimeout, stopped=self.machine.stopped)

    def onActive(self, observer: Observer) -> None:
        """Call *observer(reason)* when this server becomes active."""
        self._observers["active"].append(observer)

    def onPassive(self, observer: Observer) -> None:
        """Call *observer(reason)* when this server becomes passive."""
        self._observers["passive"].append(observer)

    def onFatal(self, observer: Observer) -> None:
        """Call *observer(reason)* when the pair is broken and this server must stop."""
        self._observers["fatal"].append(observer)

    def start(self) -> defer.Deferred[None]:
        """Bind, subscribe, publish.  Each start is a fresh run: the role's first
        state, the peer unknown, the failover timeout counted from now."""
        if self._running:
            raise RuntimeError("this BinaryStar is running already")
        run = self.machine = BinaryStarMachine(self.role, heartbeat=self.machine.heartbeat,
                                               instance=new_instance(), now=self.reactor.seconds())
        self.peerState = self.peerHeard = self._silenceWarned = None
        self._running = True

        def bound(router: Any) -> None:
            if not self._running or self.machine is not run:  # stopped, or started again
                router.close()
                return
            self._router = router
            self._say("info", "state published on {endpoint}, the peer's read from {remote}; starts "
                      "{state}", state=self.state.name.lower(), endpoint=router.endpoint, remote=self.remote)
            transport.warn_if_open(self.local, None, f"Binary Star {self.role.value}'s state channel",
                                   "anyone who can reach it may read this broker's state, and the "
                                   "peer's endpoint is trusted alike: what answers there decides which "
                                   "broker is active. Keep both on loopback or a private network")
            self._subscriber = _Subscriber(self)
            self._connectSubscriber()
            self._ticker.start(self.machine.heartbeat, now=True)

        return transport.listen(self.local, self, self.reactor, limits=self.limits).addCallback(
            bound).addErrback(lambda failure: (self.stop(), failure)[1])

    def stop(self) -> defer.Deferred[None]:
        """Stop publishing and close both endpoints."""
        self._halt()
        closing = [end for end in (self._subscriber.transport, self._router) if end is not None]
        self._subscriber.transport = self._router = None
        self._subscribers.clear()
        return transport.close_all(closing, "a Binary Star state connection")

    def _halt(self) -> None:
        self._running = False
        if self._ticker.running:
            self._ticker.stop()

    def _now(self, now: Optional[float]) -> float:
        return self.reactor.seconds() if now is None else now

    def _tick(self) -> None:
        now = self.reactor.seconds()
        for peer in [p for p, expiry in self._subscribers.items() if expiry <= now]:
            del self._subscribers[peer]
        self._perform(self.machine.handleTick(now))
        self._warnIfPeerSilent(now)
        if self._running and self._subscriber.transport is None:
            self._connectSubscriber()
        self._subscribe()

    def _warnIfPeerSilent(self, now: float) -> None:
        """Warn now and then of a silent peer: there is no failover without it."""
        machine = self.machine
        if not self._running or machine.stopped is not None:
            return
        since = self.peerHeard if self.peerHeard is not None else machine.started
        silence = now - since
        if silence < SILENT_PEER_WARNING * machine.failoverTimeout:
            self._silenceWarned = None
            return
        if self._silenceWarned is not None and now - self._silenceWarned < SILENT_PEER_REPEAT:
            return
        self._silenceWarned = now
        if self.peerHeard is None:
            self._say("warn", "no state heard from the peer at {remote} for {seconds:.0f} s (never, "
                      "since this start): it is down, or that is not its state endpoint (remote must "
                      "be the peer's local, --bstar-remote its --bstar-local); no failover until it "
                      "is heard", remote=self.remote, seconds=silence)
            return
        serving = machine.state is State.ACTIVE
        self._say("warn", "the peer at {remote} has been silent for {seconds:.0f} s (it was heard before): "
                  "it is down or cut off; this server is {state}{what}", remote=self.remote, seconds=silence,
                  state=machine.state.name.lower(), what=" and serves alone until the peer is back"
                  if serving else " and becomes active at the next client's request")

    def _subscribe(self) -> None:
        pipe = self._subscriber.transport
        if self._running and pipe is not None and pipe.connected:
            pipe.sendMessage([HEADER, SUBSCRIBE])

    def peerDisconnected(self, peer: bytes) -> None:
        self._subscribers.pop(peer, None)

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        """A subscription to the local endpoint (the peer's, or a monitor's)."""
        if len(frames) != 2 or frames[0] != HEADER or frames[1] != SUBSCRIBE:
            self._say("warn", "dropped a message that is not a subscription from {peer}: "
                      "{frames!r}", "bad-subscribe", peer=peer.hex(), frames=frames[:3])
            return
        # a subscriber counts for a failover timeout; sent the state at once if new
        now, subscribers = self.reactor.seconds(), self._subscribers
        known = peer in subscribers
        if not known and len(subscribers) >= MAX_SUBSCRIBERS:
            # the least recently heard goes: the peer asks every heartbeat
            oldest = min(subscribers, key=subscribers.__getitem__)
            del subscribers[oldest]
            self._say("warn", "{count} subscribers; dropped {oldest}, the least recently heard, for "
                      "{peer}", "subscribers", count=MAX_SUBSCRIBERS, oldest=oldest.hex(), peer=peer.hex())
        subscribers[peer] = now + self.machine.failoverTimeout
        if known or not self._running:
            return
        publishing, actions = self.machine.handleSubscriber(now)
        self._perform(actions)
        if publishing and self._running:
            self._publish(self.machine.publication(), [peer])

    def _stateFrom(self, frames: list[bytes]) -> None:
        if not self._running:
            return
        try:
            peer = decode_state(frames)
        except ProtocolError as e:
            self._say("warn", "dropped a bad message from {remote}: {error}", "bad-state",
                      remote=self.remote, error=str(e))
            return
        now, channel = self.reactor.seconds(), self.machine.channel
        actions = self.machine.handlePeerState(peer.state, peer.role, peer.uptime, now,
                                               peerInstance=peer.instance, peerHeartbeat=peer.heartbeat)
        if channel == self.machine.channel:  # not made stale by a stall it revealed
            if self.peerHeard is None or now - self.peerHeard > self.machine.failoverTimeout:
                self._say("info", "the peer ({peerRole}, state {peerState}) heard at {remote}",
                          peerRole=peer.role.value, peerState=peer.state.name.lower(), remote=self.remote)
            self.peerState, self.peerHeard = peer.state, now
        self._perform(actions)

    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            self._performers[type(action)](action)

    def _publish(self, action: PublishState, peers: Optional[list[bytes]] = None) -> None:
        """Send *action*'s state to *peers* (default: every subscriber)."""
        router = self._router
        if router is not None:
            message = encode_state(*action)
            for peer in list(self._subscribers) if peers is None else peers:
                router.sendMessage(peer, message)

    def _changed(self, action: Changed) -> None:
        self._say("info", "{old} -> {new} ({reason})", old=action.old.name.lower(),
                  new=action.new.name.lower(), reason=action.reason)
        if action.new in (State.ACTIVE, State.PASSIVE):
            self._notify(action.new.name.lower(), action.reason)

    def _stalled(self, action: Stalled) -> None:
        self._say("warn", "heard nothing for {seconds:.3f} s (this process was stopped or its reactor "
                  "blocked); states received meanwhile are stale, the state channel to {remote} is "
                  "opened again{serving}", seconds=action.seconds, remote=self.remote,
                  serving="; serving nothing until the peer is heard, in case it took over"
                  if action.serving else "")
        old = self._subscriber  # replaced: what waits on it is stale
        self._subscriber = _Subscriber(self)
        if old.transport is not None:
            transport.close_all([old.transport], "Binary Star's stale state pipe")
            old.transport = None
            self._connectSubscriber()
            self._subscribe()

    def _fatal(self, action: Fatal) -> None:
        self._say("critical", "fatal: {reason}; this server stops", reason=action.reason)
        # close the channel outside the transport callback that brought the news (stop logs a failure)
        self._halt()
        self.reactor.callLater(0, self.stop)
        self._notify("fatal", action.reason)

    def _connectSubscriber(self) -> None:
        """Open the pipe to the peer; on failure the next tick tries again."""
        retry = Backoff(initial=min(0.1, self.machine.heartbeat),
                        maximum=self.machine.heartbeat).retryPolicy()
        try:
            self._subscriber.transport = transport.connect(
                self.remote, self._subscriber, self.reactor, retryPolicy=retry, limits=self.limits)
        except Exception as e:
            self._say("warn", "cannot open its state pipe to {remote}: {error}", "connect",
                      remote=self.remote, error=repr(e))

    def _say(self, level: str, format: str, kind: str = "", **fields: Any) -> None:
        """Log "Binary Star ROLE: *format*" at *level*; with *kind*, throttled by it."""
        format, fields["role"] = "Binary Star {role}: " + format, self.role.value
        if kind:
            self.throttle.log(level, log, kind, format, **fields)
        else:
            getattr(log, level)(format, **fields)

    def _notify(self, kind: str, reason: str) -> None:
        for observer in list(self._observers[kind]):
            try:
                observer(reason)
            except Exception:
                log.failure("Binary Star {kind} observer failed", kind=kind)

