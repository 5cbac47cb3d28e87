"""What a ZeroMQ DEALER decides without its socket or a loop (ZmqDealer, the blocking _ZmqPipe)."""

from __future__ import annotations

from collections import deque
from typing import Callable

from mdp.errors import OversizedMessage
from mdp.policy import Limits, held_bytes


class DealerCore:
    """A DEALER's backlog of refused messages, its answer to an oversized one, and its reopen schedule."""

    __slots__ = ("limits", "bounded", "delay", "backlog", "backlogBytes", "failures")

    def __init__(self, limits: Limits, delay: Callable[[int], float], bounded: bool = True) -> None:
        self.limits = limits
        self.bounded = bounded
        self.delay = delay  # failures in a row -> seconds before the next try
        self.backlog: deque[list[bytes]] = deque()
        self.backlogBytes = 0
        self.failures = 0

    def hold(self, frames: list[bytes]) -> bool:
        """Keep *frames*, in order; False if over the bound (refused)."""
        size = held_bytes(frames)
        if self.bounded and self.backlogBytes + size > self.limits.maxOutputBytes:
            return False
        self.backlog.append(frames)
        self.backlogBytes += size
        return True

    def sent(self) -> None:
        self.backlogBytes -= held_bytes(self.backlog.popleft())

    def clear(self) -> None:
        self.backlog.clear()
        self.backlogBytes = 0

    def oversized(self, size: int, count: int) -> OversizedMessage:
        """A message is over the limits: the loss to report with a new socket."""
        self.clear()
        self.failures = 0
        return OversizedMessage(f"a message of {size}+ bytes in {count} frames is over the limits")

    def openFailed(self) -> float:
        """No socket could be had: the seconds before the next try."""
        delay = self.delay(self.failures)
        self.failures += 1
        return delay

    def opened(self) -> None:
        self.failures = 0
