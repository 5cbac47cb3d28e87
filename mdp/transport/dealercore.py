"""What a connecting ZeroMQ DEALER decides, without its socket or a loop:
the Twisted :class:`~mdp.transport.zeromq.ZmqDealer` and the blocking
nodes' :class:`~mdp.transport.pipes._ZmqPipe` are its shells.

A message the socket refuses (a full pipe) waits, in order, with what
follows it, in a backlog bounded in bytes.  A message over the limits is
dropped with the socket that carried it: a fresh socket, so a fresh routing
id, replaces it, and the owner hears of the loss.  A socket that cannot be
had (out of descriptors) is tried again after the reconnection delay.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from mdp.errors import OversizedMessage
from mdp.policy import Limits, held_bytes


class DealerCore:
    """A DEALER's backlog, its reaction to a message over the limits, and
    its schedule for opening a socket again."""

    __slots__ = ("limits", "bounded", "delay", "backlog", "backlogBytes", "failures")

    def __init__(self, limits: Limits, delay: Callable[[int], float], bounded: bool = True) -> None:
        self.limits = limits
        #: whether the backlog is bounded by ``limits.maxOutputBytes``
        self.bounded = bounded
        #: failures in a row -> seconds before the next try for a socket
        self.delay = delay
        self.backlog: deque[list[bytes]] = deque()
        self.backlogBytes = 0
        self.failures = 0

    def hold(self, frames: list[bytes]) -> bool:
        """The socket refused *frames* (or others wait before them): keep
        them, in order; False if that is over the bound (refused)."""
        size = held_bytes(frames)
        if self.bounded and self.backlogBytes + size > self.limits.maxOutputBytes:
            return False
        self.backlog.append(frames)
        self.backlogBytes += size
        return True

    def sent(self) -> None:
        """The first message of the backlog went."""
        self.backlogBytes -= held_bytes(self.backlog.popleft())

    def clear(self) -> None:
        """The socket is gone: what waited for it goes with it."""
        self.backlog.clear()
        self.backlogBytes = 0

    def oversized(self, size: int, count: int) -> OversizedMessage:
        """A message of *size*+ bytes in *count* frames is over the limits:
        the socket is to be replaced (what waited goes with it), and the
        owner told it lost the pipe for this."""
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
