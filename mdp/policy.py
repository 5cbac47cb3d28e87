"""Timing policies shared by every pattern: heartbeating and reconnect backoff."""

from __future__ import annotations

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
