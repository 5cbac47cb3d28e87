"""Flow control for connecting transports: who waits for a full queue to drain."""

from __future__ import annotations

from typing import Any, Optional

from twisted.internet import defer


def after(d: Optional[defer.Deferred[Any]]) -> defer.Deferred[None]:
    """A Deferred of the caller's own, fired once *d* has (at once if there
    is none, or it has fired): what one caller does with it (cancel it, say)
    is not the others'."""
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
    """Deferreds waiting for a transport's send backlog to empty.

    A transport whose medium refuses more (ZeroMQ at its high-water mark, a
    Twisted transport asking its producer to pause) keeps what it was given
    and hands out :meth:`wait` Deferreds; :meth:`fire` wakes them all once it
    can take more, or when the connection goes away (the waiter then finds
    out for itself that its work is void)."""

    def __init__(self) -> None:
        self._waiting: list[defer.Deferred[None]] = []

    def wait(self) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        self._waiting.append(d)
        return d

    def fire(self) -> None:
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def fail(self, error: BaseException) -> None:
        """Fail every waiter with *error* (what they waited for will not come
        now); later ones wait afresh."""
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.errback(error)
