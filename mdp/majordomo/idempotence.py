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


#: A stamp's client id: 16 bytes (a UUID).
CLIENT_ID_BYTES = 16
#: Most digits in a stamp's sequence number (a 64-bit number has 20).
MAX_SEQUENCE_DIGITS = 20


def unstamp(body: Sequence[bytes]) -> tuple[Optional[StampKey], list[bytes]]:
    """Split a request body into ``(stamp key or None, handler frames)``.

    A body that begins with the marker must carry a well-formed stamp (a
    16-byte client id, 1 to 20 ASCII digits, at least one body frame):
    ``ValueError`` otherwise.  Keys are only ever made of well-formed
    stamps, so a malformed one can neither collide with another client's
    nor make the store keep a key of any size."""
    if not body or body[0] != STAMP_MARKER:
        return None, list(body)
    if len(body) < 4:
        raise ValueError("a stamped request needs a client id, a sequence number and "
                         "at least one body frame")
    clientId, sequence = bytes(body[1]), bytes(body[2])
    if len(clientId) != CLIENT_ID_BYTES:
        raise ValueError(f"a stamp's client id is {CLIENT_ID_BYTES} bytes, not {len(clientId)}")
    if not (0 < len(sequence) <= MAX_SEQUENCE_DIGITS and sequence.isdigit()):
        raise ValueError(f"a stamp's sequence number is 1 to {MAX_SEQUENCE_DIGITS} ASCII digits")
    return (clientId, sequence), list(body[3:])


class IReplyStore(Interface):
    """Where a worker keeps the FINAL replies of stamped requests.  Either
    method may return a Deferred."""

    def get(key: StampKey) -> Any:
        """The stored FINAL body for *key*, or ``None``."""

    def put(key: StampKey, reply: list[bytes]) -> Any:
        """Remember the FINAL body sent for *key*."""


#: Bytes a stored reply is counted for beyond its frames and key: the
#: entry, its list and its frames' headers.
ENTRY_OVERHEAD = 256


def _held(key: StampKey, reply: Sequence[bytes]) -> int:
    return ENTRY_OVERHEAD + len(key[0]) + len(key[1]) + sum(len(f) + 64 for f in reply)


@implementer(IReplyStore)
class MemoryReplyStore:
    """In-memory store keeping the most recently used replies: at most
    *maxEntries* of them and *maxBytes* in all (their frames, keys and a
    fixed overhead an entry), the least recently used going first.  A reply
    larger than *maxBytes* on its own is not kept."""

    def __init__(self, maxEntries: int = 10_000, maxBytes: int = 256 * 1024 * 1024) -> None:
        if maxEntries < 1:
            raise ValueError("maxEntries must be at least 1")
        if maxBytes < 1:
            raise ValueError("maxBytes must be at least 1")
        self.maxEntries = maxEntries
        self.maxBytes = maxBytes
        #: bytes the kept replies are counted for
        self.heldBytes = 0
        self._replies: OrderedDict[StampKey, tuple[list[bytes], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, key: StampKey) -> Optional[list[bytes]]:
        entry = self._replies.get(key)
        if entry is None:
            return None
        self._replies.move_to_end(key)
        return entry[0]

    def put(self, key: StampKey, reply: list[bytes]) -> None:
        replies = self._replies
        old = replies.pop(key, None)
        if old is not None:
            self.heldBytes -= old[1]
        size = _held(key, reply)
        if size > self.maxBytes:
            return
        replies[key] = (list(reply), size)
        self.heldBytes += size
        while len(replies) > self.maxEntries or self.heldBytes > self.maxBytes:
            self.heldBytes -= replies.popitem(last=False)[1][1]
