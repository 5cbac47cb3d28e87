"""What a ZeroMQ DEALER decides without its socket or a loop (ZmqDealer, the blocking _ZmqPipe)."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import zmq

from mdp.errors import OversizedMessage
from mdp.policy import FRAME_OVERHEAD, Limits, held_bytes


class DealerCore:
    """A DEALER's backlog of refused messages, the bytes it handed libzmq that libzmq
    may still hold, its answer to an oversized message, and its reopen schedule.
    Every quarter ``maxOutputBytes`` one message goes tracked; once libzmq lets go
    of it, so it has of those before it."""

    __slots__ = ("limits", "bounded", "delay", "backlog", "backlogBytes", "failures",
                 "handed", "released", "marked", "marks")

    def __init__(self, limits: Limits, delay: Callable[[int], float], bounded: bool = True) -> None:
        self.limits = limits
        self.bounded = bounded
        self.delay = delay  # failures in a row -> seconds before the next try
        self.backlog: deque[list[bytes]] = deque()
        self.marks: deque[tuple[Any, int]] = deque()  # (tracker, ``handed`` after it)
        self.clear()

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
        """Start over, for a new socket or none: what libzmq held goes with the old one."""
        self.backlog.clear()
        self.marks.clear()
        self.backlogBytes = self.failures = self.handed = self.released = self.marked = 0

    def held(self) -> int:
        """The bytes libzmq may still hold."""
        marks = self.marks
        while marks and marks[0][0].done:
            self.released = marks.popleft()[1]
        return self.handed - self.released

    def track(self, frames: list[Any]) -> tuple[list[Any], int, Any]:
        """*frames* to send (the last tracked if due), their size, and the tracker."""
        size = FRAME_OVERHEAD * len(frames)
        for frame in frames:
            size += len(frame)
        if self.handed + size - self.marked < self.limits.maxOutputBytes >> 2:
            return frames, size, None
        last = frames[-1]
        last = zmq.Frame(last if type(last) is bytes else bytes(last), track=True, copy=False)
        return [*frames[:-1], last], size, last.tracker

    def went(self, size: int, tracker: Any) -> None:
        self.handed += size
        if tracker is not None:
            self.marked = self.handed
            self.marks.append((tracker, self.handed))

    def oversized(self, size: int, count: int) -> OversizedMessage:
        """A message is over the limits: the loss to report with a new socket."""
        self.clear()
        return OversizedMessage(f"a message of {size}+ bytes in {count} frames is over the limits")

    def openFailed(self) -> float:
        """No socket could be had: the seconds before the next try."""
        delay = self.delay(self.failures)
        self.failures += 1
        return delay
