"""Policies shared by every pattern: heartbeating, reconnect backoff, the limits
that bound what a peer may cost, and throttled warnings."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import attrs


@attrs.frozen
class HeartbeatPolicy:
    """Send a heartbeat every *interval* seconds; a peer silent for
    ``interval * liveness`` seconds is dead.  Defaults follow MDP/0.2 and the
    Guide's Paranoid Pirate: 2.5 s × 3."""

    interval: float = attrs.field(default=2.5)
    liveness: int = attrs.field(default=3)

    @interval.validator
    def _check_interval(self, attribute: object, value: float) -> None:
        if value <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {value}")

    @liveness.validator
    def _check_liveness(self, attribute: object, value: int) -> None:
        if value < 1:
            raise ValueError(f"heartbeat liveness must be at least 1, got {value}")

    @property
    def expiry(self) -> float:
        """Seconds of silence after which the peer is considered dead."""
        return self.interval * self.liveness


@attrs.frozen
class Backoff:
    """Exponential backoff: *initial* seconds, doubling up to *maximum*
    (Paranoid Pirate: 1 s to 32 s)."""

    initial: float = 1.0
    maximum: float = 32.0
    factor: float = 2.0

    def delay(self, attempt: int) -> float:
        """Delay before reconnection *attempt* (0 for the first)."""
        return min(self.initial * self.factor ** min(attempt, 64), self.maximum)

    def retryPolicy(self):  # type: ignore[no-untyped-def]
        """The same schedule as a :class:`ClientService` retry policy
        (attempt counts from 1)."""
        return lambda attempt: self.delay(max(attempt - 1, 0))


KiB = 1024
MiB = 1024 * KiB

#: What one message may weigh, in bytes of frame content and in frames.  16 MiB is
#: RabbitMQ's default ``max_message_size``; the frame bound keeps a record of
#: millions of empty frames from costing seconds of CPU.
DEFAULT_MAX_MESSAGE_BYTES = 16 * MiB
DEFAULT_MAX_FRAMES = 10_000
#: What a bound transport keeps for one peer that does not read (Redis's
#: ``client-output-buffer-limit``); beyond, that peer is disconnected.
DEFAULT_MAX_OUTPUT_BYTES = 64 * MiB
DEFAULT_MAX_CONNECTIONS = 10_000
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_RECORD_TIMEOUT = 30.0


#: What a frame costs held in memory beyond its bytes: a Python bytes object and
#: its slot in a list (libzmq's zmq_msg_t is about as much).  Byte bounds on
#: what is held count it, so that a message of many empty frames is not free.
FRAME_OVERHEAD = 64


def held_bytes(frames: Sequence[bytes]) -> int:
    """What holding *frames* costs, as the byte bounds on queues, backlogs and
    requests in hand count it: their bytes plus FRAME_OVERHEAD each."""
    return sum(map(len, frames)) + FRAME_OVERHEAD * len(frames)


def _at_least(minimum: float) -> object:
    def check(instance: object, attribute: attrs.Attribute, value: float) -> None:
        if value < minimum:
            raise ValueError(f"{attribute.name} must be at least {minimum}, got {value}")

    return check


@attrs.frozen
class Limits:
    """What one peer may cost a node, whatever the transport.

    *maxMessageBytes* and *maxFrames* bound every message received (checked
    before it is buffered: ``ZMQ_MAXMSGSIZE`` on ZeroMQ, the record length on
    streams) and every message a role sends (a role refuses to send what its
    peer would refuse, with a 413 error instead).  The rest bind the listening
    side of a transport: *maxOutputBytes* of unsent messages per peer (beyond,
    the peer is disconnected), and on stream transports *maxConnections*, the
    seconds a new connection has to send its first message
    (*handshakeTimeout*) and a started record to complete (*recordTimeout*).
    Size message limits the same on every node, as heartbeats are."""

    maxMessageBytes: int = attrs.field(default=DEFAULT_MAX_MESSAGE_BYTES, validator=_at_least(64))
    maxFrames: int = attrs.field(default=DEFAULT_MAX_FRAMES, validator=_at_least(8))
    maxOutputBytes: int = attrs.field(default=DEFAULT_MAX_OUTPUT_BYTES, validator=_at_least(64))
    maxConnections: int = attrs.field(default=DEFAULT_MAX_CONNECTIONS, validator=_at_least(1))
    handshakeTimeout: float = attrs.field(default=DEFAULT_HANDSHAKE_TIMEOUT, validator=_at_least(0.001))
    recordTimeout: float = attrs.field(default=DEFAULT_RECORD_TIMEOUT, validator=_at_least(0.001))

    def oversize(self, size: int, frames: int) -> Optional[str]:
        """Why a message of *size* bytes of frames in *frames* frames is
        refused, or ``None`` (fast when it is not)."""
        if size > self.maxMessageBytes:
            return f"message of {size} bytes exceeds the limit of {self.maxMessageBytes}"
        if frames > self.maxFrames:
            return f"message of {frames} frames exceeds the limit of {self.maxFrames}"
        return None

    def refuse(self, frames: Sequence[bytes]) -> Optional[str]:
        """:meth:`oversize` for a message about to be sent."""
        return self.oversize(sum(map(len, frames)), len(frames))


class LogThrottle:
    """At most one log line per *interval* seconds for each kind of event, so
    a flood of bad input cannot flood the log; the next line that does get out
    says how many were held back.  Time comes from *clock* (an IReactorTime)."""

    def __init__(self, clock: Any, interval: float = 1.0) -> None:
        self.clock = clock
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, logger: Any, kind: str, format: str, **fields: Any) -> bool:
        """Log *format* (a twisted.logger format) at warn level unless a line
        of *kind* went out less than *interval* seconds ago; True if logged."""
        return self._emit(logger.warn, kind, format, fields)

    def info(self, logger: Any, kind: str, format: str, **fields: Any) -> bool:
        """As :meth:`warn`, at info level."""
        return self._emit(logger.info, kind, format, fields)

    def _emit(self, emit: Any, kind: str, format: str, fields: dict[str, Any]) -> bool:
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
        emit(format, **fields)
        return True
