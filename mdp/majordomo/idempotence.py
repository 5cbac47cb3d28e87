"""Opt-in duplicate filtering for non-idempotent services (docs/mdp.md): clients **stamp** requests
(``Client(..., stamp=True)``, :func:`stamp`: the same stamp on every retry) and workers keep the FINALs
of stamped requests in a **reply store** (``Worker(..., replies=MemoryReplyStore())``) to answer a retry
from it.  The store knows only *finished* requests: share one between workers (:class:`SQLiteReplyStore`)
to filter across them."""

from __future__ import annotations

import sqlite3
import sys
from collections import OrderedDict
from typing import Any, Optional, Sequence

from zope.interface import Interface, implementer

from mdp.errors import StoreError
from mdp.policy import Limits, whole_number
from mdp.transport.framing import decode_record, encode_record

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
    """Split a request body into ``(stamp key or None, handler frames)``;
    ``ValueError`` for a malformed stamp."""
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


#: Bytes a stored reply is counted for beyond its frames and key.
ENTRY_OVERHEAD = 256


@implementer(IReplyStore)
class MemoryReplyStore:
    """In-memory LRU store of at most *maxEntries* replies and *maxBytes* in
    all; a reply larger than *maxBytes* alone is not kept."""

    def __init__(self, maxEntries: int = 10_000, maxBytes: int = 256 * 1024 * 1024) -> None:
        self.maxEntries = whole_number("maxEntries", maxEntries)
        self.maxBytes = whole_number("maxBytes", maxBytes)
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
        self.heldBytes -= replies.pop(key, ((), 0))[1]  # (a reply replaced)
        size = ENTRY_OVERHEAD + len(key[0]) + len(key[1]) + sum(len(f) + 64 for f in reply)
        if size > self.maxBytes:
            return
        replies[key] = (list(reply), size)
        self.heldBytes += size
        while len(replies) > self.maxEntries or self.heldBytes > self.maxBytes:
            self.heldBytes -= replies.popitem(last=False)[1][1]


#: a stored reply was sent: no bound applies to reading it back
_UNBOUNDED = Limits(maxMessageBytes=sys.maxsize, maxFrames=sys.maxsize)


@implementer(IReplyStore)
class SQLiteReplyStore:
    """Replies in an SQLite file that the workers of one host share (WAL mode), so a retry that
    reaches another worker, or a worker started after one was killed, is answered from it.  The
    entries put before the last *maxEntries* puts go, a bounded number at a time.  A lock held
    by another worker is waited for *busyTimeout* seconds at most (below a heartbeat), then the
    call fails: a lookup that fails runs the request.  :class:`~mdp.errors.StoreError` if the
    file cannot be opened in WAL mode or holds another ``replies`` table."""

    #: puts between two trims of the entries beyond maxEntries (every put if maxEntries is smaller)
    TRIM_EVERY = 1000

    def __init__(self, path: str, maxEntries: int = 1_000_000, busyTimeout: float = 0.5) -> None:
        self.path = path
        self.maxEntries = whole_number("maxEntries", maxEntries)
        self._puts = 0
        try:
            self._db = sqlite3.connect(path, timeout=busyTimeout, isolation_level=None,
                                       check_same_thread=False)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode not in ("wal", "memory"):  # (memory: a ":memory:" store, of one process)
                raise sqlite3.DatabaseError(f"it cannot be shared in WAL mode here (journal mode {mode})")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS replies (client BLOB NOT NULL, "
                             "sequence BLOB NOT NULL, reply BLOB NOT NULL, PRIMARY KEY (client, sequence))")
            self._db.execute("SELECT client, sequence, reply FROM replies LIMIT 0")
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the reply store {path}: {e}") from None

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM replies").fetchone()[0]

    def get(self, key: StampKey) -> Optional[list[bytes]]:
        row = self._db.execute("SELECT reply FROM replies WHERE client = ? AND sequence = ?",
                               key).fetchone()
        return None if row is None else decode_record(row[0], _UNBOUNDED)

    def put(self, key: StampKey, reply: list[bytes]) -> None:
        self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?)", (*key, encode_record(reply)[4:]))
        self._puts += 1
        if self.maxEntries <= self.TRIM_EVERY or self._puts % self.TRIM_EVERY == 0:
            self._db.execute("DELETE FROM replies WHERE rowid IN (SELECT rowid FROM replies WHERE rowid"
                             " <= (SELECT max(rowid) FROM replies) - ? LIMIT ?)",
                             (self.maxEntries, 2 * self.TRIM_EVERY))

    def close(self) -> None:
        self._db.close()
