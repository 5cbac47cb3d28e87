"""Opt-in duplicate filtering for non-idempotent services (Guide: "Idempotent
Services").

MDP re-sends requests: the client after a timeout, the broker when a worker
dies.  A service that must not run a request twice asks clients to **stamp**
requests (``Client(..., stamp=True)``) and gives its workers a **reply store**
(``Worker(..., replies=MemoryReplyStore())``).

Wire form of a stamped request body::

    [STAMP_MARKER, client id (16 bytes), sequence number (ASCII digits), body...]

The stamp is the same on every retry of one request.  A worker strips it before
calling the handler (whether or not it has a store).  With a store, a request
whose stamp already has a stored FINAL is answered from the store without
running the handler; otherwise the handler runs and its FINAL is stored.

Limits: the store only knows *finished* requests, so a retry that reaches a
second worker while the first is still running executes again; share one store
between workers (any object providing :class:`IReplyStore`, e.g. backed by a
database) to filter across workers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

from zope.interface import Interface, implementer

STAMP_MARKER = b"\x00MDP-ID"

StampKey = tuple[bytes, bytes]


def stamp(clientId: bytes, sequence: int, body: Sequence[bytes]) -> list[bytes]:
    """Prefix *body* with the stamp of request *sequence* of *clientId*."""
    return [STAMP_MARKER, clientId, str(sequence).encode("ascii"), *body]


def unstamp(body: Sequence[bytes]) -> tuple[Optional[StampKey], list[bytes]]:
    """Split a request body into ``(stamp key or None, handler frames)``."""
    if len(body) >= 4 and body[0] == STAMP_MARKER:
        return (bytes(body[1]), bytes(body[2])), list(body[3:])
    return None, list(body)


class IReplyStore(Interface):
    """Where a worker keeps the FINAL replies of stamped requests.  Either
    method may return a Deferred."""

    def get(key: StampKey) -> Any:
        """The stored FINAL body for *key*, or ``None``."""

    def put(key: StampKey, reply: list[bytes]) -> Any:
        """Remember the FINAL body sent for *key*."""


@implementer(IReplyStore)
class MemoryReplyStore:
    """In-memory store keeping the *maxEntries* most recently stored replies."""

    def __init__(self, maxEntries: int = 10_000) -> None:
        if maxEntries < 1:
            raise ValueError("maxEntries must be at least 1")
        self.maxEntries = maxEntries
        self._replies: OrderedDict[StampKey, list[bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, key: StampKey) -> Optional[list[bytes]]:
        reply = self._replies.get(key)
        if reply is not None:
            self._replies.move_to_end(key)
        return reply

    def put(self, key: StampKey, reply: list[bytes]) -> None:
        self._replies[key] = list(reply)
        self._replies.move_to_end(key)
        while len(self._replies) > self.maxEntries:
            self._replies.popitem(last=False)
