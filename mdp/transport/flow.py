"""Flow control for connecting transports: who waits for a full queue to drain."""

from __future__ import annotations

from typing import Any, Optional

from twisted.internet import defer


def after(d: Optional[defer.Deferred[Any]]) -> defer.Deferred[None]:
    """A Deferred of the caller's own (cancelling it affects no other), fired once *d* has (or is None)."""
    if d is None or d.called:
        return defer.succeed(None)
    mine: defer.Deferred[None] = defer.Deferred()

    def done(result: Any) -> Any:
        if not mine.called:
            mine.callback(None)
        return result

    d.addBoth(done)
    return mine


class DrainWaiters:
    """Deferreds waiting for a transport's send backlog to empty (:meth:`fire` wakes them, or fails them)."""

    def __init__(self) -> None:
        self._waiting: list[defer.Deferred[None]] = []

    def wait(self) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        self._waiting.append(d)
        return d

    def fire(self, error: Optional[BaseException] = None) -> None:
        """Wake every waiter, or fail it with *error*; later ones wait afresh."""
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            if error is None:
                d.callback(None)
            else:
                d.errback(error)

    fail = fire
