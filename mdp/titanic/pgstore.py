"""Titanic's store in PostgreSQL (psycopg 3), shared by several Titanic processes (docs/titanic.md,
"Several Titanics on PostgreSQL").  :meth:`PostgresStore.pending` claims the rows it returns for
this store (``FOR UPDATE SKIP LOCKED``) with a lease it renews while open, and gives back those
its dispatcher no longer holds, so each request is dispatched by one Titanic at a time; a Titanic
that dies or stops leaves its claims to the others once their lease lapses.  Rows hold the same
records and checksums as :class:`~.store.SQLiteStore`'s.  While the database cannot be reached,
calls fail with :class:`~mdp.errors.StoreUnavailable` (logged once), trying it again once a
second at most."""

from __future__ import annotations

import threading
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

from mdp import transport
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
    report_failure,
)
from mdp.transport.framing import encode_record

log = Logger()

#: Connection settings used unless the URL gives its own: a database host that stops answering
#: fails a call within about half a minute instead of the kernel's many minutes, and the server
#: ends a session left in a transaction for 5 s (its Titanic cut off between two statements of a
#: claim), whose row locks the other Titanics would otherwise read past until it noticed.
CONNECT_DEFAULTS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "10",
                    "keepalives_interval": "5", "keepalives_count": "3", "tcp_user_timeout": "30000",
                    "options": "-c statement_timeout=30s -c lock_timeout=10s "
                               "-c idle_in_transaction_session_timeout=5s",
                    "application_name": "titanic"}
#: Seconds the size of the table is trusted before it is asked again.
SIZE_EVERY = 1.0
#: Seconds between two tries of a database out of reach (calls between fail at once).
RETRY_EVERY = 1.0
#: Seconds a stop waits for the call under way before it shuts the connection under it.
STOP_GRACE = 2.0
#: The part of a lease after the last renewal past which the claims are taken as lost (the
#: database out of reach that long: another Titanic may take them over before we know).
LAPSE_MARGIN = 0.8
TABLE = "titanic_requests"

_TABLE = f"""
CREATE TABLE {TABLE} (
    seq bigserial PRIMARY KEY, id text NOT NULL UNIQUE, service bytea NOT NULL,
    request bytea NOT NULL, created double precision NOT NULL, reply bytea,
    completed double precision, request_crc bigint, reply_crc bigint,
    owner text, lease_until timestamptz)"""
_INDEXES = {
    f"{TABLE}_pending": f"CREATE INDEX {TABLE}_pending ON {TABLE} (seq) WHERE reply IS NULL",
    f"{TABLE}_owner": f"CREATE INDEX {TABLE}_owner ON {TABLE} (owner) WHERE reply IS NULL",
    f"{TABLE}_completed": f"CREATE INDEX {TABLE}_completed ON {TABLE} (completed) WHERE reply IS NOT NULL",
}
_COLUMNS = {"seq", "id", "service", "request", "created", "reply", "completed", "request_crc",
            "reply_crc", "owner", "lease_until"}
#: one lock for all Titanics making the schema at once (an advisory lock's key)
_SCHEMA_LOCK = 0x7469_7461_6E69_63  # "titanic"

#: Give back this store's claims its dispatcher no longer holds (parked, set aside).
_RELEASE = f"""
UPDATE {TABLE} SET owner = NULL, lease_until = NULL
WHERE owner = %(me)s AND reply IS NULL AND id <> ALL(%(skipIds)s::text[])"""
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
_RENEW = f"""
UPDATE {TABLE} SET lease_until = now() + make_interval(secs => %s)
WHERE owner = %s AND reply IS NULL RETURNING id"""


def display(url: str) -> str:
    """*url* without its password, to name the store in logs and errors."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.Error:  # not a connection string
        return "postgresql://?"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = str(parts.get("host") or "")
    port = f":{parts['port']}" if parts.get("port") and "," not in str(parts["port"]) else ""
    database = parts.get("dbname") or ""
    if host.startswith("/"):  # a socket directory
        return f"postgresql://{user}{port}/{database}?host={host}"
    if ":" in host and "," not in host:  # IPv6
        host = f"[{host}]"
    return f"postgresql://{user}{host}{port}/{database}"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@implementer(ITitanicStore)
class PostgresStore:
    """Requests and replies in the table ``titanic_requests`` of the PostgreSQL database at *url*
    (a libpq URL or connection string), made at :meth:`open` if missing.  :attr:`onLost` (if set)
    is called with the id of each request this store had claimed and another took over (its
    lease lapsed while the database was out of reach): Titanic's dispatcher does not send it."""

    def __init__(self, url: str, reactor: Optional[Any] = None, *,
                 maxBytes: int = DEFAULT_MAX_STORE_BYTES, lease: float = DEFAULT_LEASE) -> None:
        self.url = url
        #: the database, as logs and errors name it (no password)
        self.path = display(url)
        #: a request that would take the table beyond this is refused (TitanicStoreFull)
        self.maxBytes = whole_number("maxBytes", maxBytes)
        self.lease = positive_seconds("lease", lease)
        self.reactor = reactor
        self.onLost: Optional[Callable[[str], Any]] = None
        #: the owner of this store's claims: one per open
        self.owner = ""
        self._settings: dict[str, Any] = {}
        self._password = ""
        self._pool: Optional[ThreadPool] = None
        self._db: Any = None
        self._renewal: Optional[task.LoopingCall] = None
        self._trigger: Any = None
        self._opening = self._closing = False
        self._down = False  # the database was found out of reach (said once, and once back)
        self._used = (0, -SIZE_EVERY)  # (bytes, when asked) of the table
        #: the ids of the requests claimed and held, as of the last read
        self._claimed: set[str] = set()
        self._renewedAt = 0.0  # when the last renewal (or read) that succeeded was asked
        #: on the store's thread: when the database was found out of reach (None: it was not)
        self._lostAt: Optional[float] = None
        self._lock = threading.Lock()  # the connection, between the store's thread and a stop

    def _said(self, error: Exception) -> str:
        """What the database driver said, on one line naming the store, with neither the URL
        nor the password in it."""
        text = f"Titanic store {self.path}: {_first_line(error)}".replace(self.url, self.path)
        return text.replace(self._password, "***") if self._password else text

    # --- on the store's thread ------------------------------------------------------

    def _connection(self) -> Any:
        if self._db is None or self._db.closed:
            if self._closing:  # (what was queued before close: no new connection for it)
                raise StoreError(f"Titanic store {self.path} is closed")
            if self._lostAt is not None and time.monotonic() < self._lostAt + RETRY_EVERY:
                # (calls queued behind the one that found it out of reach fail at once too)
                raise psycopg.OperationalError("out of reach a moment ago; tried again shortly")
            try:
                db = psycopg.connect(self.url, autocommit=True, **self._settings)
            except psycopg.OperationalError:
                self._lostAt = time.monotonic()
                raise
            with self._lock:
                self._db, self._lostAt = db, None
        return self._db

    def _disconnect(self) -> None:
        with self._lock:
            db, self._db = self._db, None
        if db is not None:
            db.close()

    def _call(self, work: Callable[..., Any], *args: Any) -> Any:
        """*work(db, *args)*.  A connection lost or refused is :class:`StoreUnavailable`; one
        found lost on its first use since the last call (a restarted server) is made again."""
        reused = self._db is not None and not self._db.closed
        try:
            return work(self._connection(), *args)
        except psycopg.OperationalError as e:
            if self._db is not None and not (self._db.broken or self._db.closed):
                raise StoreError(self._said(e)) from None
            self._disconnect()
            if reused and not self._closing:
                return self._call(work, *args)
            raise StoreUnavailable(self._said(e)) from None
        except psycopg.Error as e:
            raise StoreError(self._said(e)) from None

    def _prepare(self, db: Any) -> None:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            if db.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None:
                db.execute(_TABLE)
            found = {name for (name,) in db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                "AND table_schema = current_schema()", (TABLE,))}
            if not _COLUMNS <= found:
                raise StoreError(f"Titanic store {self.path}: the table {TABLE} is not Titanic's "
                                 f"(it lacks {', '.join(sorted(_COLUMNS - found))}); left as it is")
            indexes = {name for (name,) in db.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s "
                "AND schemaname = current_schema()", (TABLE,))}
            for name, create in _INDEXES.items():
                if name not in indexes:
                    db.execute(create)

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
        # (a conflict: this insert committed on a connection lost before it said so)
        db.execute(f"INSERT INTO {TABLE} (id, service, request, created, request_crc) "
                   "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING", row)
        self._used = (used + size, asked)

    def _claim(self, db: Any, arguments: dict[str, Any]) -> list[tuple[Any, ...]]:
        with db.transaction():
            db.execute(_RELEASE, arguments)
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

    @staticmethod
    def _renewed(db: Any, lease: float, owner: str) -> set[str]:
        return {requestId for (requestId,) in db.execute(_RENEW, (lease, owner))}

    # --- on the reactor thread ------------------------------------------------------

    def _run(self, work: Callable[..., Any], *args: Any) -> defer.Deferred[Any]:
        if self._pool is None or self._closing:
            return defer.fail(StoreError(f"Titanic store {self.path} is closed"))
        return threads.deferToThreadPool(self.reactor, self._pool, self._call, work, *args
                                         ).addBoth(self._reached)

    def _reached(self, result: Any) -> Any:
        """Log once when the database goes out of reach, and once when it is back."""
        if isinstance(result, Failure) and result.check(StoreUnavailable):
            if not self._down and not self._opening:
                log.error("{reason}: out of reach; submits are refused until it is back",
                          reason=result.getErrorMessage())
            self._down = True
        elif self._down and not isinstance(result, Failure):
            self._down = False
            log.info("Titanic store {path} is reachable again", path=self.path)
        return result

    def _renew(self) -> defer.Deferred[Any]:
        claimed, asked = set(self._claimed), self.reactor.seconds()

        def renewed(kept: set[str]) -> None:
            self._renewedAt = asked
            self._lose(claimed - kept)

        def failed(failure: Failure) -> None:
            report_failure(log, failure, "Titanic store {path}: its claims were not renewed",
                           path=self.path)
            if self.reactor.seconds() >= self._renewedAt + self.lease * LAPSE_MARGIN:
                self._lose(set(self._claimed))  # (another may take them over any moment now)

        return self._run(self._renewed, self.lease, self.owner).addCallbacks(renewed, failed)

    def _lose(self, lost: set[str]) -> None:
        """Tell :attr:`onLost` of the claims in *lost* still held: they may be another's now."""
        for requestId in sorted(lost & self._claimed):  # (not completed or forgotten meanwhile)
            self._claimed.discard(requestId)
            if self.onLost is not None:
                try:
                    self.onLost(requestId)
                except Exception:
                    log.failure("Titanic store {path}: onLost failed for {id}", path=self.path,
                                id=requestId)

    def _stopPool(self) -> None:
        self._closing = True
        if self._renewal is not None and self._renewal.running:
            self._renewal.stop()
        self._renewal = None
        if self._trigger is not None:
            self.reactor.removeSystemEventTrigger(self._trigger)
            self._trigger = None
        if self._pool is not None:
            self._pool.callInThread(self._disconnect)
            # a call stuck on a dead network path would hold the stop (and the process's
            # exit) for the TCP timeout: after a grace, its socket is shut under it
            interrupt = threading.Timer(STOP_GRACE, self._interrupt)
            interrupt.start()
            try:
                self._pool.stop()
            finally:
                interrupt.cancel()
            self._pool = None

    def _interrupt(self) -> None:
        """Shut the connection's socket (from any thread): a call blocked on it fails at once."""
        with self._lock:  # (not closed meanwhile: its descriptor is still its own)
            db = self._db
            try:
                fd = db.pgconn.socket if db is not None and not db.closed else -1
                if fd >= 0:
                    transport.shut_socket(fd)
            except (OSError, psycopg.Error):
                pass

    # --- ITitanicStore ----------------------------------------------------------------

    def open(self) -> defer.Deferred[None]:
        if self._pool is not None:
            return defer.fail(StoreError(f"Titanic store {self.path} is already open"))
        try:
            parts = conninfo_to_dict(self.url)
        except psycopg.Error:  # (its message quotes the URL)
            return defer.fail(StoreError(
                "cannot open Titanic store postgresql://?: the URL cannot be read as a PostgreSQL "
                "connection string (a password with % or @ in it must be percent-encoded)"))
        self._password = str(parts.get("password") or "")
        self._settings = {k: v for k, v in CONNECT_DEFAULTS.items() if k not in parts}
        self.reactor = default_reactor(self.reactor)
        self.owner = str(uuid.uuid4())
        self._closing, self._opening, self._down = False, True, False
        self._claimed = set()
        self._renewedAt, self._lostAt = self.reactor.seconds(), None
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name=f"titanic-store {self.path}")
        self._pool.start()
        self._trigger = self.reactor.addSystemEventTrigger("during", "shutdown", self._stopPool)

        def opened(_: None) -> None:
            self._opening = False
            self._renewal = task.LoopingCall(self._renew)
            self._renewal.clock = self.reactor
            self._renewal.start(self.lease / 3, now=False)

        def refused(failure: Failure) -> Failure:
            self._opening = False
            self._down = False
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
        """The oldest pending requests not claimed by another open store, claimed for this one;
        this store's claims on requests neither in *skipIds* (held) nor read now are given back."""
        held = list(skipIds)
        arguments = {"skipIds": held, "skip": [bytes(s) for s in skipServices],
                     "only": None if onlyServices is None else [bytes(s) for s in onlyServices],
                     "me": self.owner, "limit": limit, "lease": self.lease}

        asked = self.reactor.seconds()

        def read(rows: list[tuple[Any, ...]]) -> list[StoredRequest]:
            self._renewedAt = asked  # (what it holds is claimed again)
            self._claimed = {*held, *(row[1] for row in rows)}
            return [_stored(row[1:]) for row in rows]

        return self._run(self._claim, arguments).addCallback(read)

    def complete(self, requestId: str, reply: list[bytes], now: float) -> defer.Deferred[None]:
        record = encode_record(reply)
        self._claimed.discard(requestId)
        # (the owner stays: which Titanic's dispatch the reply answered)
        return self._run(self._count, f"UPDATE {TABLE} SET reply = %s, completed = %s, reply_crc = %s, "
                         "lease_until = NULL WHERE id = %s AND reply IS NULL",
                         (record, now, _checksum(record), requestId)).addCallback(lambda _: None)

    def reply(self, requestId: str) -> defer.Deferred[tuple[ReplyStatus, list[bytes]]]:
        return self._run(self._reply, requestId)

    def forget(self, requestId: str) -> defer.Deferred[None]:
        self._claimed.discard(requestId)
        return self._run(self._count, f"DELETE FROM {TABLE} WHERE id = %s", (requestId,)
                         ).addCallback(lambda _: None)

    def purge(self, before: float) -> defer.Deferred[int]:
        return self._run(self._count, f"DELETE FROM {TABLE} WHERE reply IS NOT NULL AND completed < %s",
                         (before,))

    def close(self) -> defer.Deferred[None]:
        """Disconnect.  Claims are not given back: a request this Titanic sent may still be
        running; another Titanic takes them over once their lease lapses."""
        if self._pool is None:
            return defer.succeed(None)
        self._closing = True
        self._stopPool()
        return defer.succeed(None)
