"""Titanic's store in PostgreSQL (psycopg 3), shared by several Titanic processes (docs/titanic.md,
"Several Titanics on PostgreSQL").  :meth:`PostgresStore.pending` claims the rows it returns for
this store (``FOR UPDATE SKIP LOCKED``) with a lease it renews while open, so each request is
dispatched by one Titanic at a time; a Titanic that dies leaves its claims to the others once
their lease expires.  Rows hold the same records and checksums as :class:`~.store.SQLiteStore`'s.
While the database cannot be reached every call fails at once with
:class:`~mdp.errors.StoreUnavailable`, logged once; the next call tries again."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Collection, Optional

import psycopg
from psycopg.conninfo import conninfo_to_dict
from twisted.internet import defer, task, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from mdp.errors import StoreError, StoreUnavailable
from mdp.policy import default_reactor, positive_seconds, whole_number
from mdp.titanic.protocol import TitanicStoreFull
from mdp.titanic.store import (
    DEFAULT_LEASE,
    DEFAULT_MAX_STORE_BYTES,
    ITitanicStore,
    ReplyStatus,
    StoredRequest,
    _checksum,
    _reply_frames,
    _stored,
)
from mdp.transport.framing import encode_record

log = Logger()

#: Seconds to wait for the database to answer a connection.
CONNECT_TIMEOUT = 5
#: Seconds the size of the table is trusted before it is asked again.
SIZE_EVERY = 1.0
TABLE = "titanic_requests"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    seq bigserial PRIMARY KEY, id text NOT NULL UNIQUE, service bytea NOT NULL,
    request bytea NOT NULL, created double precision NOT NULL, reply bytea,
    completed double precision, request_crc bigint, reply_crc bigint,
    owner text, lease_until timestamptz)"""
_INDEXES = f"""
CREATE INDEX IF NOT EXISTS {TABLE}_pending ON {TABLE} (seq) WHERE reply IS NULL;
CREATE INDEX IF NOT EXISTS {TABLE}_completed ON {TABLE} (completed) WHERE reply IS NOT NULL;
"""
_COLUMNS = {"seq", "id", "service", "request", "created", "reply", "completed", "request_crc",
            "reply_crc", "owner", "lease_until"}
#: one lock for all Titanics making the schema at once (an advisory lock's key)
_SCHEMA_LOCK = 0x7469_7461_6E69_63  # "titanic"

#: Claim the oldest pending rows that are free, ours, or whose claim lapsed.
_CLAIM = f"""
WITH picked AS (
    SELECT seq FROM {TABLE}
    WHERE reply IS NULL AND id <> ALL(%(skipIds)s::text[]) AND service <> ALL(%(skip)s::bytea[])
      AND (%(only)s::bytea[] IS NULL OR service = ANY(%(only)s::bytea[]))
      AND (owner IS NULL OR owner = %(me)s OR lease_until < now())
    ORDER BY seq LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE {TABLE} r SET owner = %(me)s, lease_until = now() + make_interval(secs => %(lease)s)
FROM picked WHERE r.seq = picked.seq
RETURNING r.seq, r.id, r.service, r.request, r.created, r.request_crc"""


def display(url: str) -> str:
    """*url* without its password, to name the store in logs and errors."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.Error:  # not a connection string
        return "postgresql://?"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = parts.get("host") or ""
    port = f":{parts['port']}" if parts.get("port") else ""
    database = parts.get("dbname") or ""
    if host.startswith("/"):  # a socket directory
        return f"postgresql://{user}{port}/{database}?host={host}"
    return f"postgresql://{user}{host}{port}/{database}"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@implementer(ITitanicStore)
class PostgresStore:
    """Requests and replies in the table ``titanic_requests`` of the PostgreSQL database at *url*
    (a libpq URL or connection string), made at :meth:`open` if missing."""

    def __init__(self, url: str, reactor: Optional[Any] = None, *,
                 maxBytes: int = DEFAULT_MAX_STORE_BYTES, lease: float = DEFAULT_LEASE) -> None:
        self.url = url
        #: the database, as logs and errors name it (no password)
        self.path = display(url)
        #: a request that would take the table beyond this is refused (TitanicStoreFull)
        self.maxBytes = whole_number("maxBytes", maxBytes)
        self.lease = positive_seconds("lease", lease)
        self.reactor = reactor
        #: the owner of this store's claims: one per open
        self.owner = ""
        self._pool: Optional[ThreadPool] = None
        self._db: Any = None
        self._renewal: Optional[task.LoopingCall] = None
        self._trigger: Any = None
        self._down = False  # the last call found the database out of reach
        self._used = (0, -SIZE_EVERY)  # (bytes, when asked) of the table

    # --- on the store's thread ------------------------------------------------------

    def _connection(self) -> Any:
        if self._db is None or self._db.closed:
            self._db = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                                       application_name="titanic")
        return self._db

    def _call(self, work: Callable[..., Any], *args: Any) -> Any:
        """*work(db, *args)*; a lost or refused connection becomes :class:`StoreUnavailable`."""
        try:
            return work(self._connection(), *args)
        except psycopg.OperationalError as e:
            if self._db is not None:
                self._db.close()
            self._db = None
            raise StoreUnavailable(f"Titanic store {self.path}: {_first_line(e)}") from None
        except psycopg.Error as e:
            raise StoreError(f"Titanic store {self.path}: {_first_line(e)}") from None

    def _prepare(self, db: Any) -> None:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            db.execute(_SCHEMA)
            found = {name for (name,) in db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                "AND table_schema = current_schema()", (TABLE,))}
            if not _COLUMNS <= found:
                raise StoreError(f"Titanic store {self.path}: the table {TABLE} is not Titanic's "
                                 f"(it lacks {', '.join(sorted(_COLUMNS - found))}); left as it is")
            db.execute(_INDEXES)

    def _add(self, db: Any, row: tuple[Any, ...], size: int) -> None:
        used, asked = self._used
        if time.monotonic() - asked >= SIZE_EVERY:
            (used,) = db.execute("SELECT pg_total_relation_size(%s)", (TABLE,)).fetchone()
            asked = time.monotonic()
        if used + size > self.maxBytes:
            self._used = (used, asked)
            raise TitanicStoreFull(
                f"Titanic's store is full: {used} bytes in use, a request of {size} "
                f"bytes would pass its limit of {self.maxBytes}; try again later")
        db.execute(f"INSERT INTO {TABLE} (id, service, request, created, request_crc) "
                   "VALUES (%s, %s, %s, %s, %s)", row)
        self._used = (used + size, asked)

    def _claim(self, db: Any, arguments: dict[str, Any]) -> list[tuple[Any, ...]]:
        return sorted(db.execute(_CLAIM, arguments).fetchall())

    def _reply(self, db: Any, requestId: str) -> tuple[ReplyStatus, list[bytes]]:
        row = db.execute(f"SELECT reply, reply_crc FROM {TABLE} WHERE id = %s", (requestId,)).fetchone()
        if row is None:
            return ReplyStatus.UNKNOWN, []
        if row[0] is None:
            return ReplyStatus.PENDING, []
        return ReplyStatus.DONE, _reply_frames(self.path, requestId, *row)

    @staticmethod
    def _count(db: Any, sql: str, args: tuple[Any, ...]) -> int:
        return db.execute(sql, args).rowcount

    def _shut(self, db: Any) -> None:
        """Give back what this store claimed (the others need not wait out its lease), and
        disconnect."""
        try:
            db.execute(f"UPDATE {TABLE} SET owner = NULL, lease_until = NULL "
                       "WHERE owner = %s AND reply IS NULL", (self.owner,))
        finally:
            db.close()
            self._db = None

    # --- on the reactor thread ------------------------------------------------------

    def _run(self, work: Callable[..., Any], *args: Any) -> defer.Deferred[Any]:
        if self._pool is None:
            return defer.fail(StoreError(f"Titanic store {self.path} is closed"))
        return threads.deferToThreadPool(self.reactor, self._pool, self._call, work, *args
                                         ).addBoth(self._reached)

    def _reached(self, result: Any) -> Any:
        """Log once when the database goes out of reach, and once when it is back."""
        if isinstance(result, Failure) and result.check(StoreUnavailable):
            if not self._down:
                log.error("{reason}: out of reach; submits are refused until it is back",
                          reason=result.getErrorMessage())
            self._down = True
        elif self._down and not isinstance(result, Failure):
            self._down = False
            log.info("Titanic store {path} is reachable again", path=self.path)
        return result

    def _renew(self) -> defer.Deferred[Any]:
        return self._run(self._count, f"UPDATE {TABLE} SET lease_until = now() + make_interval(secs => %s) "
                         "WHERE owner = %s AND reply IS NULL", (self.lease, self.owner)
                         ).addErrback(lambda _: None)  # (logged by _reached; renewed next time)

    def _stopPool(self) -> None:
        if self._renewal is not None and self._renewal.running:
            self._renewal.stop()
        self._renewal = None
        if self._trigger is not None:
            self.reactor.removeSystemEventTrigger(self._trigger)
            self._trigger = None
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    # --- ITitanicStore ----------------------------------------------------------------

    def open(self) -> defer.Deferred[None]:
        if self._pool is not None:
            return defer.fail(StoreError(f"Titanic store {self.path} is already open"))
        self.reactor = default_reactor(self.reactor)
        self.owner = str(uuid.uuid4())
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name=f"titanic-store {self.path}")
        self._pool.start()
        self._trigger = self.reactor.addSystemEventTrigger("during", "shutdown", self._stopPool)

        def opened(_: None) -> None:
            self._renewal = task.LoopingCall(self._renew)
            self._renewal.clock = self.reactor
            self._renewal.start(self.lease / 3, now=False)

        def refused(failure: Failure) -> Failure:
            self._stopPool()
            failure.trap(StoreError)
            return Failure(StoreError(f"cannot open {failure.getErrorMessage()}"))

        return self._run(self._prepare).addCallbacks(opened, refused)

    def add(self, service: bytes, frames: list[bytes], now: float) -> defer.Deferred[str]:
        requestId = str(uuid.uuid4())
        service = bytes(service)
        record = encode_record(frames)
        row = (requestId, service, record, now, _checksum(requestId.encode("ascii"), service, record))
        return self._run(self._add, row, len(record) + len(service) + 128).addCallback(lambda _: requestId)

    def pending(self, limit: int, skipServices: Collection[bytes] = (),
                skipIds: Collection[str] = (), onlyServices: Optional[Collection[bytes]] = None
                ) -> defer.Deferred[list[StoredRequest]]:
        """The oldest pending requests not claimed by another open store, claimed for this one."""
        arguments = {"skipIds": list(skipIds), "skip": [bytes(s) for s in skipServices],
                     "only": None if onlyServices is None else [bytes(s) for s in onlyServices],
                     "me": self.owner, "limit": limit, "lease": self.lease}
        return self._run(self._claim, arguments).addCallback(
            lambda rows: [_stored(row[1:]) for row in rows])

    def complete(self, requestId: str, reply: list[bytes], now: float) -> defer.Deferred[None]:
        record = encode_record(reply)
        # (the owner stays: which Titanic's dispatch the reply answered)
        return self._run(self._count, f"UPDATE {TABLE} SET reply = %s, completed = %s, reply_crc = %s, "
                         "lease_until = NULL WHERE id = %s AND reply IS NULL",
                         (record, now, _checksum(record), requestId)).addCallback(lambda _: None)

    def reply(self, requestId: str) -> defer.Deferred[tuple[ReplyStatus, list[bytes]]]:
        return self._run(self._reply, requestId)

    def forget(self, requestId: str) -> defer.Deferred[None]:
        return self._run(self._count, f"DELETE FROM {TABLE} WHERE id = %s", (requestId,)
                         ).addCallback(lambda _: None)

    def purge(self, before: float) -> defer.Deferred[int]:
        return self._run(self._count, f"DELETE FROM {TABLE} WHERE reply IS NOT NULL AND completed < %s",
                         (before,))

    def close(self) -> defer.Deferred[None]:
        if self._pool is None:
            return defer.succeed(None)
        if self._renewal is not None and self._renewal.running:
            self._renewal.stop()
        # (out of reach: its claims lapse with their lease)
        return self._run(self._shut).addErrback(lambda failure: failure.trap(StoreError)).addBoth(
            lambda _: self._stopPool())
