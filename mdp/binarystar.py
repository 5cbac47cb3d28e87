"""Binary Star: a primary/backup pair of servers, one active at a time (the
Guide's "High-availability Pair (Binary Star Pattern)" and "Binary Star
Reactor").

:class:`BinaryStarMachine` is the Guide's finite state machine, written as
its table (:data:`TABLE`), pure: events with their time in, actions out.

=============  ==============  ==================================================
state          event           outcome
=============  ==============  ==================================================
PRIMARY        PEER_BACKUP     ACTIVE (connected to the backup)
PRIMARY        PEER_ACTIVE     PASSIVE (the backup took over meanwhile)
PRIMARY        CLIENT_REQUEST  ACTIVE once the peer has been silent for the
                               failover timeout, else refused
BACKUP         PEER_ACTIVE     PASSIVE
BACKUP         CLIENT_REQUEST  refused
ACTIVE         PEER_ACTIVE     fatal: dual actives (split brain)
PASSIVE        PEER_PRIMARY    ACTIVE (the peer restarts; it will go passive)
PASSIVE        PEER_BACKUP     ACTIVE (likewise)
PASSIVE        PEER_PASSIVE    fatal: dual passives (no one would serve)
PASSIVE        CLIENT_REQUEST  ACTIVE if the peer has been silent for the
                               failover timeout (the client's vote), else
                               refused
=============  ==============  ==================================================

Every other pair is ignored (the state stays, a client request is served only
when ACTIVE).  A peer's state message also says how it is configured; both
configured primary, or both backup, is a configuration error: the server that
started later stops with a fatal error (:class:`Fatal`), the other logs it.

The failover timeout is ``2 × heartbeat`` (1 s by default), counted from the
last state message of the peer, or from the start.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

from mdp.machine import Machine, action_class
from mdp.policy import positive_seconds

#: Seconds between two state messages to the peer.
DEFAULT_HEARTBEAT = 1.0


class State(enum.IntEnum):
    """Where a server is (the Guide's numbers, which travel on the wire)."""

    PRIMARY = 1  # primary, waiting for the peer
    BACKUP = 2  # backup, waiting for the peer
    ACTIVE = 3  # serving clients
    PASSIVE = 4  # not serving clients


class Event(enum.IntEnum):
    """What happens to a server: its peer's state, or a client's request."""

    PEER_PRIMARY = 1
    PEER_BACKUP = 2
    PEER_ACTIVE = 3
    PEER_PASSIVE = 4
    CLIENT_REQUEST = 5


class Role(enum.Enum):
    """How a server is configured."""

    PRIMARY = "primary"
    BACKUP = "backup"


# outcomes in the table
IGNORE = "ignore"
REFUSE = "refuse"
FATAL = "fatal"
VOTE = "vote"  # ACTIVE if the peer is silent beyond the failover timeout, else refuse

#: (state, event) -> (outcome, why: what the log line says on a change)
TABLE: dict[tuple[State, Event], tuple[Union[State, str], str]] = {
    (State.PRIMARY, Event.PEER_BACKUP): (State.ACTIVE, "connected to the backup (passive)"),
    (State.PRIMARY, Event.PEER_ACTIVE): (State.PASSIVE, "connected to the backup (active)"),
    (State.PRIMARY, Event.CLIENT_REQUEST): (VOTE, "a client request, the backup silent"),
    (State.BACKUP, Event.PEER_ACTIVE): (State.PASSIVE, "connected to the primary (active)"),
    (State.BACKUP, Event.CLIENT_REQUEST): (REFUSE, "a backup waiting for its primary"),
    (State.ACTIVE, Event.PEER_ACTIVE): (
        FATAL, "dual actives: the peer is active too (split brain)"),
    (State.PASSIVE, Event.PEER_PRIMARY): (State.ACTIVE, "the primary (passive) restarts"),
    (State.PASSIVE, Event.PEER_BACKUP): (State.ACTIVE, "the backup (passive) restarts"),
    (State.PASSIVE, Event.PEER_PASSIVE): (
        FATAL, "dual passives: the peer is passive too, no one would serve"),
    (State.PASSIVE, Event.CLIENT_REQUEST): (VOTE, "failover: a client request, the peer silent"),
}


# --- actions ----------------------------------------------------------------------


@action_class
class Changed:
    """The state changed (log it; on ACTIVE start serving, on PASSIVE stop)."""

    old: State
    new: State
    reason: str


@action_class
class Fatal:
    """Stop: carrying on would break the pair."""

    reason: str


@action_class
class Conflict:
    """The peer is configured as we are; it started later and will stop."""

    reason: str


@action_class
class PublishState:
    """Send our state (and role and uptime) to the peer."""

    state: State
    role: Role
    uptime: float


Action = Union[Changed, Fatal, Conflict, PublishState]


class BinaryStarMachine(Machine):
    """One server of a pair.  Feed :meth:`handlePeerState` with each state
    message from the peer, :meth:`handleClientRequest` with each client
    request (it answers whether to serve it) and :meth:`handleTick` every
    *heartbeat* seconds (it publishes the state)."""

    def __init__(self, role: Role, *, heartbeat: float = DEFAULT_HEARTBEAT,
                 now: float = 0.0) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role is a Role (PRIMARY or BACKUP), not {role!r}")
        super().__init__(now)
        self.role = role
        self.heartbeat = positive_seconds("heartbeat", heartbeat)
        self.state = State.PRIMARY if role is Role.PRIMARY else State.BACKUP
        self.started = now
        #: when the peer counts as gone, unless it is heard from before
        self.peerExpiry = now + self.failoverTimeout
        self.stopped: Optional[str] = None

    @property
    def failoverTimeout(self) -> float:
        """Seconds of silence after which the peer counts as gone."""
        return 2 * self.heartbeat

    @property
    def serving(self) -> bool:
        """Whether clients are served now."""
        return self.state is State.ACTIVE and self.stopped is None

    # --- events ---------------------------------------------------------------------

    def handlePeerState(self, peerState: int, peerRole: Optional[Role], peerUptime: float,
                        now: float) -> list[Action]:
        """A state message from the peer (its state number, its configured
        role if it says, and how long it has been running)."""
        self.now = now
        if self.stopped is not None:
            return self._drain()
        try:
            event = Event(peerState)
        except ValueError:
            return self._drain()  # not a state: the driver logs what it got
        if event is Event.CLIENT_REQUEST:
            return self._drain()
        self.peerExpiry = now + self.failoverTimeout
        if peerRole is self.role:
            uptime = now - self.started
            reason = f"both servers are configured {self.role.value}"
            if uptime < peerUptime or (uptime == peerUptime and self.role is Role.BACKUP):
                self._stop(f"{reason}; this one started later and stops")
            else:
                self._emit(Conflict(f"{reason}; the peer started later and must stop"))
            return self._drain()
        self._apply(event)
        return self._drain()

    def handleClientRequest(self, now: float) -> tuple[bool, list[Action]]:
        """A client request: whether to serve it, and the actions."""
        self.now = now
        if self.stopped is None:
            self._apply(Event.CLIENT_REQUEST)
        return self.serving, self._drain()

    def handleTick(self, now: float) -> list[Action]:
        """Time to publish our state."""
        self.now = now
        if self.stopped is None:
            self._emit(PublishState(self.state, self.role, now - self.started))
        return self._drain()

    # --- the table ------------------------------------------------------------------

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
