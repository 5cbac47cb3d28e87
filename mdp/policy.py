"""Policies shared by every pattern, so none grows its own: heartbeating and liveness, reconnect backoff,
endpoint rotation, limits, access control, throttled warnings, and reactor and duration helpers."""

from __future__ import annotations

import fnmatch
import functools
import math
import numbers
import random as _random
import re
from typing import Any, Callable, Optional, Sequence

import attrs


def _number(least: float, *, above: bool = False, below: Optional[float] = None,
            infinite: bool = False, what: str = "") -> Any:
    """An attrs validator: a real number (not a bool) at least (*above*: above) *least* and
    below *below*, finite unless *infinite*; *what* comes before the name in the error."""
    def check(instance: object, attribute: attrs.Attribute, value: Any) -> None:
        name = what + attribute.name
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not (value > least if above else value >= least) or not (below is None or value < below):
            raise ValueError(f"{name} must be {'above' if above else 'at least'} {least}"
                             f"{'' if below is None else f' and below {below}'}, got {value!r}")
        if not (infinite or isinstance(value, int) or math.isfinite(value)):
            raise ValueError(f"{name} must be finite, got {value!r}")

    return check


@attrs.frozen
class HeartbeatPolicy:
    """Send a heartbeat every *interval* seconds; a peer silent for ``interval * liveness`` seconds is
    dead.  Defaults follow MDP/0.2 and the Guide's Paranoid Pirate: 2.5 s × 3."""

    interval: float = attrs.field(default=2.5, validator=_number(0, above=True, what="heartbeat "))
    liveness: int = attrs.field(default=3, validator=_number(1, what="heartbeat "))

    def __attrs_post_init__(self) -> None:
        try:
            expiry = self.interval * self.liveness
        except OverflowError:
            expiry = math.inf
        if not math.isfinite(expiry):
            raise ValueError(f"heartbeat interval * liveness must be finite, got "
                             f"{self.interval} * {self.liveness}")

    @property
    def expiry(self) -> float:
        """Seconds of silence after which the peer is dead."""
        return self.interval * self.liveness


class Liveness:
    """When a peer was last heard from and last sent to, judged by a
    :class:`HeartbeatPolicy`: dead after ``policy.expiry`` of silence."""

    __slots__ = ("policy", "lastHeard", "lastSent")

    def __init__(self, policy: HeartbeatPolicy, now: float) -> None:
        self.policy, self.lastHeard, self.lastSent = policy, now, now

    def heard(self, now: float) -> None:
        self.lastHeard = now

    def sent(self, now: float) -> None:
        self.lastSent = now

    def silence(self, now: float) -> float:
        return now - self.lastHeard

    def dead(self, now: float) -> bool:
        """Silent for longer than ``interval × liveness``."""
        return now - self.lastHeard > self.policy.expiry

    def due(self, now: float, fraction: float = 1.0) -> bool:
        """True if nothing was sent for ``fraction × interval`` seconds."""
        return now - self.lastSent >= self.policy.interval * fraction


class EndpointRotation:
    """The endpoints of a failover list and which one is in use (:meth:`advance`: round-robin)."""

    __slots__ = ("endpoints", "index")

    def __init__(self, endpoints: Sequence[str]) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("at least one endpoint is required")
        self.index = 0

    @property
    def current(self) -> str:
        return self.endpoints[self.index]

    def advance(self) -> str:
        """Rotate to the next endpoint and return it."""
        self.index = (self.index + 1) % len(self.endpoints)
        return self.endpoints[self.index]


@attrs.frozen
class Backoff:
    """Exponential backoff: *initial* seconds, times *factor* up to *maximum*.  Each delay is shortened
    at random (*random*, in ``[0, 1)``) by up to *jitter* of itself, so peers that lost the same server
    come back spread out; ``jitter=0`` gives the exact schedule."""

    initial: float = attrs.field(default=1.0, validator=_number(0, above=True, what="backoff "))
    maximum: float = attrs.field(default=32.0, validator=_number(0, above=True, infinite=True,
                                                                 what="backoff "))
    factor: float = attrs.field(default=2.0, validator=_number(1, what="backoff "))
    jitter: float = attrs.field(default=0.0, validator=_number(0, below=1, what="backoff "))
    random: Callable[[], float] = attrs.field(default=_random.random, eq=False, repr=False)

    def delay(self, attempt: int, most: Optional[float] = None) -> float:
        """Delay before reconnection *attempt* (0 for the first); *most* caps it before the jitter."""
        try:
            delay = min(self.initial * self.factor ** min(attempt, 64), self.maximum, MAX_SECONDS)
        except OverflowError:
            delay = min(self.maximum, MAX_SECONDS)
        if most is not None and most < delay:
            delay = most
        if self.jitter:
            delay *= 1.0 - self.jitter * self.random()
        return delay

    def retryPolicy(self):  # type: ignore[no-untyped-def]
        """The schedule as a :class:`ClientService` retry policy (from 1)."""
        return lambda attempt: self.delay(max(attempt - 1, 0))


#: The share of a reconnection delay taken off at random (:class:`Backoff`).
JITTER = 0.25

#: A worker's (and a session client's) reconnection: the Paranoid Pirate's.
PIRATE = Backoff(initial=1.0, maximum=32.0, jitter=JITTER)

#: A connecting transport's reconnection, without a policy of its own.
RECONNECT = Backoff(initial=0.5, maximum=32.0, jitter=JITTER)


def default_reactor(reactor: Optional[Any] = None) -> Any:
    """*reactor*, or the global one (imported only when needed)."""
    if reactor is None:
        from twisted.internet import reactor as globalReactor

        return globalReactor
    return reactor


#: the longest time any option takes, in seconds: beyond, timers overflow
MAX_SECONDS = 1e9


def positive_seconds(name: str, value: Any) -> float:
    """*value* as seconds: ``TypeError`` if no number, ``ValueError`` (naming
    *name*) unless positive and at most :data:`MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is a number of seconds, not {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not value <= MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS:g} seconds, got {value!r}")
    return float(value)


def whole_number(name: str, value: Any, least: int = 1, rule: str = "") -> int:
    """*value* as a count: ``TypeError`` if no int, ``ValueError`` (naming *name*, *rule*) below *least*."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is a whole number, not {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} {rule or 'must be'} at least {least}, got {value!r}")
    return value


def call_at(call: Any, reactor: Any, when: Optional[float], fn: Any) -> Any:
    """Replace the delayed call *call* with one of *fn* at *when* (None:
    none): a machine's ``WakeAt``.  Store the result back."""
    cancel_call(call)
    return None if when is None else reactor.callLater(max(0.0, when - reactor.seconds()), fn)


def cancel_call(call: Any) -> None:
    """Cancel a pending delayed call (or None); returns None to store back."""
    if call is not None and call.active():
        call.cancel()
    return None


KiB = 1024
MiB = 1024 * KiB

#: What a server that runs handlers holds at most: requests, and their bytes.
DEFAULT_MAX_PENDING = 10_000
DEFAULT_MAX_PENDING_BYTES = 256 * MiB

#: What one message may weigh, in bytes of frame content and in frames.
DEFAULT_MAX_MESSAGE_BYTES = 16 * MiB
DEFAULT_MAX_FRAMES = 10_000


#: What a frame costs held in memory beyond its bytes (empty frames are not free).
FRAME_OVERHEAD = 64


def held_bytes(frames: Sequence[bytes]) -> int:
    """What holding *frames* costs: their bytes plus FRAME_OVERHEAD each."""
    return sum(map(len, frames)) + FRAME_OVERHEAD * len(frames)


@attrs.frozen
class Limits:
    """What one peer may cost a node.  *maxMessageBytes* and *maxFrames* bound every message received
    (before it is buffered) and sent (a 413 instead).  The rest bind a listening side: *maxOutputBytes*
    unsent per peer, and on streams *maxConnections*, *handshakeTimeout* (seconds to a first message) and
    *recordTimeout* (to complete a record), and *maxConnectionsPerAddress* from one IP address (0:
    ``maxConnections``).  Use the same message limits on every node."""

    maxMessageBytes: int = attrs.field(default=DEFAULT_MAX_MESSAGE_BYTES, validator=_number(64))
    maxFrames: int = attrs.field(default=DEFAULT_MAX_FRAMES, validator=_number(8))
    maxOutputBytes: int = attrs.field(default=64 * MiB, validator=_number(64))
    maxConnections: int = attrs.field(default=10_000, validator=_number(1))
    handshakeTimeout: float = attrs.field(default=10.0, validator=_number(0.001))
    recordTimeout: float = attrs.field(default=30.0, validator=_number(0.001))
    #: bytes of unfinished stream records the whole process holds (``framing.BUFFERED``)
    maxBufferedBytes: int = attrs.field(default=256 * MiB, validator=_number(64))
    maxConnectionsPerAddress: int = attrs.field(default=0, validator=_number(0))

    def oversize(self, size: int, frames: int) -> Optional[str]:
        """Why a message of *size* bytes in *frames* frames is refused, or None."""
        if size > self.maxMessageBytes:
            return f"message of {size} bytes exceeds the limit of {self.maxMessageBytes}"
        if frames > self.maxFrames:
            return f"message of {frames} frames exceeds the limit of {self.maxFrames}"
        return None

    def refuse(self, frames: Sequence[bytes]) -> Optional[str]:
        """:meth:`oversize` for a message about to be sent."""
        return self.oversize(sum(map(len, frames)), len(frames))


class LogThrottle:
    """At most one log line per *interval* seconds of *clock* for each kind of
    event; the next line out says how many were held back."""

    def __init__(self, clock: Any, interval: float = 1.0) -> None:
        self.clock, self.interval = clock, interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: str, logger: Any, kind: str, format: str, **fields: Any) -> bool:
        """Log *format* at *level* (``"warn"``, ``"info"``) unless throttled; True if logged."""
        now = self.clock.seconds()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            format += " ({held} similar held back in the last {interval:g}s)"
            fields.update(held=held, interval=self.interval)
        getattr(logger, level)(format, **fields)
        return True

    warn = functools.partialmethod(log, "warn")
    info = functools.partialmethod(log, "info")


@attrs.frozen
class AccessRule:
    """The services one kind of peer may call and serve: shell-style patterns
    (``billing.*``) matched against the whole name."""

    call: tuple[str, ...] = ()
    serve: tuple[str, ...] = ()
    # each list as one compiled expression: a check is one match
    _call: Any = attrs.field(init=False, repr=False, eq=False,
                             default=attrs.Factory(lambda rule: _matcher(rule.call), takes_self=True))
    _serve: Any = attrs.field(init=False, repr=False, eq=False,
                              default=attrs.Factory(lambda rule: _matcher(rule.serve), takes_self=True))

    def mayCall(self, service: str) -> bool:
        return self._call(service) is not None

    def mayServe(self, service: str) -> bool:
        return self._serve(service) is not None


def _matcher(patterns: tuple[str, ...]) -> Any:
    """A match function for any of *patterns* (None: no match)."""
    return re.compile("|".join(map(fnmatch.translate, patterns))).match if patterns else lambda name: None


class AccessPolicy:
    """Who may call and serve which services (docs/security.md).  *peers* maps authenticated identities
    (a CURVE key in Z85, a TLS subject in RFC 4514) to an :class:`AccessRule`; other authenticated peers
    get *default*, unauthenticated ones *anonymous* (both allow nothing unless given).  ``mmi.*`` is
    always answered, about the services the asker may call."""

    def __init__(self, peers: Optional[dict[str, AccessRule]] = None, *,
                 default: AccessRule = AccessRule(), anonymous: AccessRule = AccessRule()) -> None:
        self.peers = dict(peers or {})
        self.default, self.anonymous = default, anonymous

    def rule(self, identity: Optional[str]) -> AccessRule:
        return self.anonymous if identity is None else self.peers.get(identity, self.default)

    def mayCall(self, identity: Optional[str], service: bytes) -> bool:
        return self.rule(identity).mayCall(service.decode("utf-8", "replace"))

    def mayServe(self, identity: Optional[str], service: bytes) -> bool:
        return self.rule(identity).mayServe(service.decode("utf-8", "replace"))

    @classmethod
    def load(cls, path: str) -> AccessPolicy:
        """Read a policy file (TOML: ``[[peer]]`` tables with an ``identity``, ``[default]``,
        ``[anonymous]``, each with ``call`` and ``serve`` lists; docs/security.md).  Raises
        ``ValueError`` naming the file and the mistake; ``OSError`` if it cannot be read."""
        import tomllib

        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"access policy {path}: not TOML: {e}") from None
        return cls.fromDict(data, source=path)

    @classmethod
    def fromDict(cls, data: dict[str, Any], source: str = "access policy") -> AccessPolicy:
        """A policy from a parsed policy file (see :meth:`load`)."""
        unknown = set(data) - {"peer", "default", "anonymous"}
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; "
                             "expected [[peer]], [default], [anonymous]")
        peers: dict[str, AccessRule] = {}
        entries = data.get("peer", [])
        if not isinstance(entries, list):
            raise ValueError(f"{source}: peers are [[peer]] tables")
        for n, entry in enumerate(entries, 1):
            where = f"{source}: peer {n}"
            rule = _rule(entry, where, {"identity", "name"})
            identity = entry.get("identity")
            if not isinstance(identity, str) or not identity:
                raise ValueError(f"{where}: no identity (a CURVE public key or a TLS subject)")
            if identity in peers:
                raise ValueError(f"{where}: identity {identity!r} is listed twice")
            peers[identity] = rule
        return cls(peers, **{kind: _rule(data.get(kind, {}), f"{source}: [{kind}]")
                             for kind in ("default", "anonymous")})


def _rule(entry: Any, where: str, extra: frozenset[str] | set[str] = frozenset()) -> AccessRule:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: not a table")
    unknown = set(entry) - {"call", "serve"} - set(extra)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected call, serve")
    lists = []
    for key in ("call", "serve"):
        value = entry.get(key, [])
        if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
            raise ValueError(f"{where}: {key} is a list of service names or patterns")
        lists.append(tuple(value))
    return AccessRule(*lists)
