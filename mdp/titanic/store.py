"""Where Titanic keeps requests and replies: the store interface and two stores (docs/titanic.md).
:class:`SQLiteStore` (the default) has a request on disk (WAL, ``synchronous=FULL``) before
:meth:`~ITitanicStore.add` fires; writes arriving during a commit share the next one.  :class:`MemoryStore`
is the Guide's "faster and less reliable" mode.  Frames are stored as one record blob with a CRC-32;
one that fails it reads back as damaged.  At open, the checks SQLite leaves out: a WAL it would silently
cut short, or one gone that held commits (:func:`check_wal`), and ``PRAGMA integrity_check``
(:func:`check_and_repair`: damage confined to Titanic's indexes is repaired by rebuilding them)."""

from __future__ import annotations

import contextlib
import enum
import fcntl
import itertools
import json
import mmap
import os
import re
import sqlite3
import struct
import sys
import uuid
import zlib
from typing import Any, Collection, Optional

import attrs
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import Interface, implementer, implementer_only

from mdp.errors import ProtocolError, StoreError, StoreUnavailable
from mdp.policy import Limits, default_reactor, whole_number
from mdp.titanic.protocol import MalformedTitanicRequest, TitanicStoreFull, parse_request
from mdp.transport.framing import decode_record, encode_record

#: Bytes a store may hold (its pages in use) before new requests are refused.
DEFAULT_MAX_STORE_BYTES = 1024**3
#: Seconds a shared store's claim on a request lasts unless renewed (every third of it, while
#: the store is open): how long the requests of a Titanic that died wait for another.
DEFAULT_LEASE = 30.0
POSTGRES_URL = ("postgresql://", "postgres://")  # (how a database that is not a SQLite file begins)


class ReplyStatus(enum.Enum):
    """What the store knows of a request's reply."""

    DONE = "done"
    PENDING = "pending"
    #: never stored, or closed
    UNKNOWN = "unknown"


@attrs.frozen
class StoredRequest:
    """A request waiting for its reply, as the dispatcher reads it back."""

    id: str
    service: bytes
    frames: list[bytes]
    created: float


class ITitanicStore(Interface):
    """Durable (or not) storage of requests and replies.  Every method returns a Deferred;
    each fires once the change is committed."""

    def open():
        """Open (and check) the storage; fails with StoreError if unusable."""

    def add(service: bytes, frames: list[bytes], now: float):
        """Store a request; fires with its id (RFC 4122 text) once committed."""

    def pending(limit: int, skipServices: Collection[bytes] = (),
                skipIds: Collection[str] = (), onlyServices: Optional[Collection[bytes]] = None):
        """Up to *limit* requests without a reply, oldest first, except those for *skipServices*
        and those in *skipIds*; if *onlyServices* is given, only requests for those services."""

    def complete(requestId: str, reply: list[bytes], now: float):
        """Store the reply of a request (ignored if it was closed meanwhile)."""

    def reply(requestId: str):
        """``(ReplyStatus, frames)``: the reply if DONE, else an empty list."""

    def forget(requestId: str):
        """Drop a request and its reply (idempotent)."""

    def purge(before: float):
        """Drop replies completed before *before*; fires with how many."""

    def close():
        """Release the storage."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, service BLOB NOT NULL,
    request BLOB NOT NULL, created REAL NOT NULL, reply BLOB, completed REAL,
    request_crc INTEGER, reply_crc INTEGER);
CREATE INDEX IF NOT EXISTS requests_pending ON requests (seq) WHERE reply IS NULL;
CREATE INDEX IF NOT EXISTS requests_pending_service ON requests (service, seq) WHERE reply IS NULL;
CREATE INDEX IF NOT EXISTS requests_completed ON requests (completed) WHERE reply IS NOT NULL;
"""

#: A pending row read back, and what makes a row one: no reply, an id that can be
#: answered, not among the ids left out (?2, JSON).
_ROW = "seq, id, service, request, created, request_crc"
_PENDING = "reply IS NULL AND typeof(id) = 'text' AND id NOT IN (SELECT value FROM json_each(?2))"
#: Pending requests, oldest first, except some services (?1, by hex: JSON holds text).
_PENDING_BY_AGE = (
    f"SELECT {_ROW} FROM requests WHERE {_PENDING} "
    "AND hex(service) NOT IN (SELECT value FROM json_each(?1)) ORDER BY seq LIMIT ?3")
#: The same, by a skip scan of the index: at most ?3 of each service not left out.
_PENDING_BY_SERVICE = (
    "WITH RECURSIVE pending(name) AS ("
    " SELECT (SELECT service FROM requests INDEXED BY requests_pending_service"
    "         WHERE reply IS NULL ORDER BY service LIMIT 1) UNION ALL"
    " SELECT (SELECT service FROM requests INDEXED BY requests_pending_service"
    "         WHERE reply IS NULL AND service > pending.name ORDER BY service LIMIT 1)"
    " FROM pending WHERE pending.name IS NOT NULL) "
    f"SELECT {_ROW} FROM pending JOIN requests ON seq IN ("
    " SELECT seq FROM requests INDEXED BY requests_pending_service"
    f" WHERE {_PENDING} AND service = pending.name ORDER BY seq LIMIT ?3) "
    "WHERE pending.name IS NOT NULL AND hex(pending.name) NOT IN (SELECT value FROM json_each(?1)) "
    "ORDER BY seq LIMIT ?3")
#: The same, of one service (?1), through its index.
_PENDING_OF = ("SELECT seq FROM requests INDEXED BY requests_pending_service "
               f"WHERE {_PENDING} AND service = ?1 ORDER BY seq LIMIT ?3")
#: The same, of some services (?1, by hex), by age.
_PENDING_LISTED = (f"SELECT seq FROM requests WHERE {_PENDING} "
                   "AND hex(service) IN (SELECT value FROM json_each(?1)) ORDER BY seq LIMIT ?3")
#: Pending rows after ?1 in age order, to check for damage; ?2 at a time.
_UNSCANNED = (f"SELECT {_ROW} FROM requests WHERE reply IS NULL AND typeof(id) = 'text' "
              "AND seq > ?1 ORDER BY seq LIMIT ?2")
DAMAGE_CHUNK = 5000
#: The same, of some rows (?1, JSON).
_PENDING_ROWS = (f"SELECT {_ROW} FROM requests WHERE {_PENDING} "
                 "AND seq IN (SELECT value FROM json_each(?1)) ORDER BY seq LIMIT ?3")
#: Steps (of 1000 SQLite instructions) an age-order read may take before going by service.
SCAN_BUDGET = 200

#: the columns of Titanic's requests table (another table is left as it is)
_COLUMNS = ("seq", "id", "service", "request", "created", "reply", "completed", "request_crc", "reply_crc")
#: before the checksums: such a table gets them at open
_UNCHECKED_COLUMNS = _COLUMNS[:7]
_OURS = ("requests", "requests_pending", "requests_completed", "requests_pending_service")


def _columns(db: sqlite3.Connection) -> tuple[str, ...]:
    return tuple(row[1] for row in db.execute("PRAGMA table_info(requests)"))


#: Stored frames are read back whatever the current limits.
_UNBOUNDED = Limits(maxMessageBytes=sys.maxsize, maxFrames=sys.maxsize)

log = Logger()


def report_failure(logger: Logger, failure: Failure, format: str, **fields: Any) -> None:
    """Log a store's own error in one line, anything else (a bug) with its traceback."""
    if failure.check(StoreUnavailable):
        return  # the store logs once that its database is out of reach, and once that it is back
    if failure.check(StoreError, sqlite3.Error):
        logger.error(format + ": {reason}", reason=failure.getErrorMessage(), **fields)
    else:
        logger.failure(format, failure, **fields)


def _identity(file: Any) -> Optional[tuple[int, int]]:
    """A file (a path or a descriptor) as (device, inode), or None if it is gone."""
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _checksum(*blobs: bytes) -> int:
    """The CRC-32 stored beside a request (its id, service and record) or a reply."""
    return zlib.crc32(b"".join(blobs))


def _intact(crc: Any, *values: Any) -> bool:
    return all(isinstance(v, bytes) for v in values) and _checksum(*values) == crc


def _request_frames(requestId: Any, service: Any, blob: Any, crc: Any) -> tuple[list[bytes], Optional[str]]:
    """The frames of a stored request, or ``[]`` and (if known) why not.  A row without
    a checksum is taken as it is; older rows' checksums leave out the id."""
    if crc is not None and not (isinstance(requestId, str) and requestId.isascii() and (
            _intact(crc, requestId.encode("ascii"), service, blob) or _intact(crc, service, blob))):
        return [], "its checksum does not match"
    try:
        frames = decode_record(memoryview(blob)[4:], _UNBOUNDED)
        if frames and isinstance(service, bytes):
            parse_request([service, *frames])  # a file can hold anything
    except MalformedTitanicRequest as e:
        return [], str(e)
    except (ProtocolError, ValueError, TypeError):  # TypeError: not a blob
        return [], None
    return frames, None


def _reply_frames(path: str, requestId: str, record: Any, crc: Any) -> list[bytes]:
    """The frames of a stored reply; :class:`StoreError` if it fails its checksum or
    cannot be decoded."""
    why = "its checksum does not match"
    if crc is None or _intact(crc, record):
        try:
            return decode_record(memoryview(record)[4:], _UNBOUNDED)
        except (ProtocolError, ValueError, TypeError) as e:
            why = str(e)
    raise StoreError(f"Titanic store {path}: the stored reply to {requestId} is damaged: {why}")


def _stored(row: tuple[Any, ...]) -> StoredRequest:
    """A pending row for the dispatcher; a damaged one has no frames, so it gets an error reply."""
    requestId, service, blob, created, crc = row
    frames, why = _request_frames(requestId, service, blob, crc)
    if isinstance(service, bytes) and isinstance(created, (int, float)) and frames:
        return StoredRequest(requestId, service, frames, created)
    log.error("Titanic store: the stored request {id} is damaged and cannot be read back{why}: "
              "it is answered with an error", id=requestId, why=f" ({why})" if why else "")
    return StoredRequest(requestId, service if isinstance(service, bytes) else b"", [],
                         created if isinstance(created, (int, float)) else 0.0)


_WAL_MAGIC = {0x377F0682: "<", 0x377F0683: ">"}  # checksums little- or big-endian words
_WAL_HEADER = 32
_FRAME_HEADER = 24
#: What the lock file says while a store is open (a run that did not close it leaves it).
OPEN_MARK = b"open\n"


def _wal_checksum(data: bytes, order: str, s1: int = 0, s2: int = 0) -> tuple[int, int]:
    """SQLite's WAL checksum of *data* (a multiple of 8 bytes), continuing (s1, s2)."""
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for i in range(0, len(words), 2):
        s1 = (s1 + words[i] + s2) & mask
        s2 = (s2 + words[i + 1] + s1) & mask
    return s1, s2


def wal_damage(wal: bytes) -> Optional[str]:
    """Why SQLite would drop committed transactions of the WAL content *wal*, or None.  SQLite reads frames
    up to the first that fails its cumulative checksum.  The last transaction torn by a crash (its frames
    reach the disk in any order, its commit frame perhaps first) was never acknowledged: damage is a broken
    frame followed by the commit of a later transaction of the same WAL generation."""
    if len(wal) < _WAL_HEADER:
        return None  # SQLite takes it as empty
    magic, _, pageSize, _, salt1, salt2, c1, c2 = struct.unpack(">8I", wal[:_WAL_HEADER])
    order = _WAL_MAGIC.get(magic)
    if order is None or pageSize < 512 or pageSize & (pageSize - 1):
        return None  # not a WAL header: SQLite takes it as empty
    size = _FRAME_HEADER + pageSize
    heads = [struct.unpack_from(">6I", wal, at) for at in range(_WAL_HEADER, len(wal) - size + 1, size)]
    sums = _wal_checksum(wal[:24], order)
    if sums != (c1, c2):
        return f"its header checksum is wrong ({len(heads)} frames would be ignored)" if heads else None
    broken = _first_broken(wal, order, size, heads, (salt1, salt2), sums)
    if broken is None or not _later_commit(heads[broken:], (salt1, salt2)):
        return None
    return (f"frame {broken} (byte {_WAL_HEADER + broken * size}) is damaged and a later "
            "committed transaction follows it")


def _later_commit(heads: list[tuple[int, ...]], salts: tuple[int, int]) -> bool:
    """Whether the frame *heads* from a broken one hold a commit of this generation
    after the one ending its transaction (and the copies of it that pad a sector)."""
    ours = [(page, commit) for page, commit, s1, s2, _, _ in heads if (s1, s2) == salts]
    ends = [n for n, (_, commit) in enumerate(ours) if commit]
    later = itertools.dropwhile(ours[ends[0]].__eq__, ours[ends[0] + 1:]) if ends else ()
    return any(commit for _, commit in later)


def _first_broken(wal: bytes, order: str, size: int, heads: list[tuple[int, ...]],
                  salts: tuple[int, int], sums: tuple[int, int]) -> Optional[int]:
    """The first frame SQLite does not read: of an earlier generation, or failing its checksum."""
    for n, (_, _, s1, s2, f1, f2) in enumerate(heads):
        at = _WAL_HEADER + n * size  # the checksum covers the page number, commit mark and page
        if (s1, s2) != salts or (sums := _wal_checksum(
                wal[at:at + 8] + wal[at + _FRAME_HEADER:at + size], order, *sums)) != (f1, f2):
            return n
    return None


def check_wal(path: str, mark: bytes) -> None:
    """Refuse to open *path* if its WAL is damaged, or gone although the lock file's
    *mark* says the last run did not close the store (StoreError saying what to do)."""
    wal = path + "-wal"
    lock = path + ".lock"
    try:
        file = open(wal, "rb")
    except FileNotFoundError:
        if mark == OPEN_MARK and os.path.exists(path):
            raise StoreError(
                f"Titanic store {path}: its WAL {wal} is missing, but the last run did not "
                f"close the store: requests it acknowledged may be lost. Restore {wal} if "
                f"it was moved. If a SQLite program opened {path} since, it moved them into "
                f"{path} (nothing lost); either way, to start with what {path} holds, delete "
                f"{lock}") from None
        return
    except OSError as e:
        raise StoreError(f"Titanic store {path}: cannot read its WAL {wal}: {e}") from e
    with file, (mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # a WAL may be large
                if os.fstat(file.fileno()).st_size else contextlib.nullcontext(b"")) as content:
        why = wal_damage(content)
    if why is not None:
        raise StoreError(
            f"Titanic store {path}: its WAL {wal} is damaged ({why}); SQLite would drop "
            f"acknowledged requests without a word. Restore {wal} from a backup; to keep "
            f"what SQLite reads of it, open {path} once with sqlite3 and run "
            f"`PRAGMA wal_checkpoint`, then delete {lock}")


_INDEX_PROBLEM = re.compile(r"(missing from index|wrong # of entries in index|"
                            r"non-unique entry in index) (\S+)")


def check_and_repair(db: sqlite3.Connection, path: str) -> list[str]:
    """``PRAGMA integrity_check``: rebuilds the indexes of the requests table that disagree with it (returns
    their names), raises StoreError for any other damage.  An index that misses a row must be rebuilt even
    where the row is the side that changed: SQLite cannot update or delete a row its index misses."""
    problems = [row[0] for row in db.execute("PRAGMA integrity_check")]
    if problems == ["ok"]:
        return []
    indexes = {name for (name,) in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'requests'")}
    found = [match.group(2) for match in map(_INDEX_PROBLEM.search, problems) if match]
    if len(found) < len(problems) or not indexes.issuperset(found):
        raise StoreError(f"Titanic store {path} is damaged: {problems[0]} (of {len(problems)} "
                         "problems); restore it from a backup")
    rebuilt = sorted(set(found))
    for index in rebuilt:
        db.execute(f'REINDEX "{index}"')
    return rebuilt


@implementer(ITitanicStore)
class SQLiteStore:
    """Requests and replies in one SQLite file (``":memory:"``: for tests).  :meth:`open` takes
    an exclusive lock (``PATH.lock``) and refuses a file with several hard links
    (:class:`~mdp.errors.StoreError`); after :meth:`close` every call fails until :meth:`open`."""

    def __init__(self, path: str, reactor: Optional[Any] = None, *,
                 maxBytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        self.path = path
        #: a request that would take the pages in use beyond this is refused (TitanicStoreFull)
        self.maxBytes = whole_number("maxBytes", maxBytes)
        self.reactor = reactor
        self._pool: Optional[ThreadPool] = None
        self._trigger: Any = None
        self._lock: Optional[int] = None
        self._lockPath: Optional[str] = None
        #: what the lock file said when taken (OPEN_MARK: not closed last time)
        self._mark = b""
        #: the files in use, as opened (see _moved)
        self._files: dict[str, Optional[tuple[int, int]]] = {}
        self._db: Optional[sqlite3.Connection] = None
        #: writes for the next transaction, with the bytes each adds against maxBytes (0: none)
        self._writes: list[tuple[str, tuple[Any, ...], int, defer.Deferred[int]]] = []
        self._lastCommit: defer.Deferred[None] = defer.succeed(None)
        #: the row of each request read by pending() and not yet completed or forgotten
        self._rows: dict[str, int] = {}
        #: pending rows found damaged by reads by service; the row to look on after (None: done)
        self._damaged: list[int] = []
        self._unscanned: Optional[int] = 0

    def _run(self, work: Any, *args: Any) -> defer.Deferred[Any]:
        if self._pool is None:
            return defer.fail(StoreError(f"Titanic store {self.path} is closed"))
        return threads.deferToThreadPool(self.reactor, self._pool, work, *args)

    # --- on the store's thread ------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"Titanic store {self.path} is closed")
        return self._db

    def _connect(self) -> None:
        if self._lockPath is not None:
            check_wal(os.path.realpath(self.path), self._mark)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._refuseOthers(self._db)
            self._prepare(self._db)
        except (sqlite3.Error, StoreError) as e:
            self._shut()
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"Titanic store {self.path} cannot be opened: {e}") from e
        self._files = self._identities()
        self._setMark(OPEN_MARK)

    def _refuseOthers(self, db: sqlite3.Connection) -> None:
        """Refuse a damaged file, or another application's, before writing to it;
        rebuild Titanic's indexes if only they are damaged."""
        others = sorted({name for (name,) in db.execute("SELECT name FROM sqlite_master")
                         if not name.startswith("sqlite_")} - set(_OURS))
        columns = _columns(db)  # none: no requests table yet
        why = (f"it holds tables that are not Titanic's ({', '.join(others[:5])})" if others
               else f"its requests table is not Titanic's (columns {', '.join(columns)})"
               if columns not in ((), _COLUMNS, _UNCHECKED_COLUMNS) else None)
        if why is not None:
            raise StoreError(f"Titanic store {self.path} is not a Titanic store: {why}; "
                             "left as it is")
        rebuilt = check_and_repair(db, self.path)
        if rebuilt:
            log.warn("Titanic store {path}: damaged indexes rebuilt from their table: {indexes}",
                     path=self.path, indexes=", ".join(rebuilt))

    def _prepare(self, db: sqlite3.Connection) -> None:
        """WAL, full sync, the schema (adding checksum columns to an older table),
        and one real write: SQLite silently opens an unwritable file read-only."""
        if self.path != ":memory:":
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StoreError(f"Titanic store {self.path}: cannot use WAL (got {mode})")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        if _columns(db) == _UNCHECKED_COLUMNS:
            db.executescript("BEGIN IMMEDIATE; ALTER TABLE requests ADD COLUMN request_crc INTEGER;"
                             " ALTER TABLE requests ADD COLUMN reply_crc INTEGER; COMMIT")
        db.execute(f"PRAGMA user_version = {int(db.execute('PRAGMA user_version').fetchone()[0])}")

    def _identities(self) -> dict[str, Optional[tuple[int, int]]]:
        """The database, its WAL and the lock as (device, inode) now (None: gone)."""
        if self._lockPath is None:  # in memory
            return {}
        real = os.path.realpath(self.path)  # SQLite names the WAL after the file a link leads to
        names = {self.path: real, "its WAL": real + "-wal", "its lock": self._lockPath}
        return {what: _identity(name) for what, name in names.items()}

    def _moved(self) -> Optional[str]:
        """Why the store's files are no longer those its names lead to (deleted or
        replaced while running): writes would be lost at restart."""
        now = self._identities()
        for what, was in self._files.items():
            if was is not None and now.get(what) != was:
                if what == "its lock" and self._relock():
                    continue
                name = "the database" if what == self.path else what
                return (f"Titanic store {self.path}: {name} was "
                        f"{'deleted' if now.get(what) is None else 'replaced'} while in use; "
                        "nothing more is written to it: restart Titanic")
        return None

    def _relock(self) -> bool:
        """The lock file went: take the lock on a new one, unless another Titanic has it."""
        try:
            fd = self._flock(self._lockPath)
        except StoreError:
            return False
        os.close(self._lock)  # open while the store is: this runs in a commit
        self._lock = fd
        self._setMark(OPEN_MARK)
        self._files["its lock"] = _identity(fd)
        log.warn("Titanic store {path}: its lock file {lock} was deleted while in use; taken "
                 "again", path=self.path, lock=self._lockPath)
        return True

    def _fitting(self, db: sqlite3.Connection, sized: list[tuple[str, tuple[Any, ...], int]]
                 ) -> tuple[list[tuple[str, tuple[Any, ...]]], dict[int, Exception]]:
        """The statements that fit :attr:`maxBytes`, and the refusal of each other by index."""
        used = 0
        if any(size for _, _, size in sized):  # bytes of the pages in use (free ones are reused)
            (used,) = db.execute("SELECT (p.page_count - f.freelist_count) * s.page_size FROM "
                                 "pragma_page_count p, pragma_freelist_count f, pragma_page_size s"
                                 ).fetchone()
        fitting, refused = [], {}
        for index, (sql, args, size) in enumerate(sized):
            if size and used + size > self.maxBytes:
                refused[index] = TitanicStoreFull(
                    f"Titanic's store is full: {used} bytes in use, a request of {size} "
                    f"bytes would pass its limit of {self.maxBytes}; try again later")
            else:
                used += size
                fitting.append((sql, args))
        return fitting, refused

    def _commit(self, sized: list[tuple[str, tuple[Any, ...], int]]) -> list[Any]:
        """Commit the statements that fit :attr:`maxBytes` in one transaction, or if that
        fails each alone; returns each row count or exception (TitanicStoreFull for one
        that does not fit).  Nothing is written once the files moved."""
        db = self._connection()
        moved = self._moved()
        if moved is not None:
            raise StoreError(moved)
        statements, refused = self._fitting(db, sized)

        def transaction(group: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
            try:
                with db:  # BEGIN ... COMMIT (or ROLLBACK on an error)
                    db.execute("BEGIN IMMEDIATE")
                    return [db.execute(sql, args).rowcount for sql, args in group]
            except sqlite3.Error as e:
                return [e] * len(group)

        results = transaction(statements)  # if that fails, each alone
        if len(statements) > 1 and isinstance(results[0], sqlite3.Error):
            results = [result for statement in statements for result in transaction([statement])]
        done = iter(results)
        return [refused[i] if i in refused else next(done) for i in range(len(sized))]

    def _pending(self, limit: int, skipServices: set[bytes], skipIds: str,
                 services: Optional[list[bytes]]) -> list[tuple[Any, ...]]:
        """The *limit* oldest pending rows of services not skipped (or of *services*): by age
        within :data:`SCAN_BUDGET` steps, else service by service through the service index
        (a backlog of others may lie in the way)."""
        db = self._connection()
        if services is not None:
            return self._pendingOf(db, limit, [s for s in services if s not in skipServices], skipIds)
        args = (json.dumps([bytes(s).hex().upper() for s in skipServices]), skipIds, limit)
        found = self._budgeted(db, _PENDING_BY_AGE, args)
        return found if found is not None else db.execute(_PENDING_BY_SERVICE, args).fetchall()

    def _pendingOf(self, db: sqlite3.Connection, limit: int, services: list[bytes],
                   skipIds: str) -> list[tuple[Any, ...]]:
        """:meth:`_pending` of *services*, and of those found damaged whatever their service now
        says (looked for :data:`DAMAGE_CHUNK` rows a read, from the first such read)."""
        self._lookForDamage(db)
        listed = json.dumps([bytes(s).hex().upper() for s in services])
        found = self._budgeted(db, _PENDING_LISTED, (listed, skipIds, limit))
        if found is None:
            found = [row for service in services
                     for row in db.execute(_PENDING_OF, (bytes(service), skipIds, limit))]
        chosen = sorted({seq for (seq,) in found}.union(self._damaged))[:limit]
        return db.execute(_PENDING_ROWS, (json.dumps(chosen), skipIds, limit)).fetchall()

    def _lookForDamage(self, db: sqlite3.Connection) -> None:
        """Check the next :data:`DAMAGE_CHUNK` pending rows; keep those damaged still pending."""
        if self._unscanned is not None:
            rows = db.execute(_UNSCANNED, (self._unscanned, DAMAGE_CHUNK)).fetchall()
            self._damaged += [seq for seq, requestId, service, blob, _, crc in rows
                              if not _request_frames(requestId, service, blob, crc)[0]]
            self._unscanned = rows[-1][0] if len(rows) == DAMAGE_CHUNK else None
        if self._damaged:
            self._damaged = [seq for (seq, *_) in db.execute(
                _PENDING_ROWS, (json.dumps(self._damaged), "[]", len(self._damaged)))]

    def _budgeted(self, db: sqlite3.Connection, sql: str,
                  args: tuple[Any, ...]) -> Optional[list[tuple[Any, ...]]]:
        """The rows of *sql*, or None past :data:`SCAN_BUDGET` steps."""
        steps = itertools.count()
        db.set_progress_handler(lambda: next(steps) >= SCAN_BUDGET, 1000)  # true: interrupt
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:
            if next(steps) <= SCAN_BUDGET:  # not interrupted for the budget
                raise
            return None
        finally:
            db.set_progress_handler(None, 0)

    # --- on the reactor thread ------------------------------------------------------

    def _write(self, sql: str, args: tuple[Any, ...], size: int = 0) -> defer.Deferred[int]:
        """Run one statement in the next transaction (refused if it adds *size* bytes
        beyond :attr:`maxBytes`); fires with its row count."""
        d: defer.Deferred[int] = defer.Deferred()
        self._writes.append((sql, args, size, d))
        if len(self._writes) == 1:
            self._lastCommit.addBoth(self._commitWrites)
        return d

    def _commitWrites(self, _: object) -> defer.Deferred[None]:
        batch, self._writes = self._writes, []

        def committed(results: Any) -> None:
            outcomes = [results] * len(batch) if isinstance(results, Failure) else results
            for (*_, d), outcome in zip(batch, outcomes):
                (d.errback if isinstance(outcome, (Failure, BaseException)) else d.callback)(outcome)

        return self._run(self._commit, [(sql, args, size) for sql, args, size, _ in batch]).addBoth(committed)

    def _takeLock(self) -> None:
        """Lock ``PATH.lock``: two Titanics on one file would run every request twice;
        a file with a second name is refused, as SQLite names its WAL after the name opened."""
        if self.path == ":memory:":
            return
        real = os.path.realpath(self.path)
        if os.path.exists(real) and not os.path.isfile(real):
            raise StoreError(f"Titanic store {self.path}: not a file")
        links = os.stat(real).st_nlink if os.path.exists(real) else 1  # none yet: SQLite makes it
        if links > 1:
            raise StoreError(f"Titanic store {self.path}: the file has {links} hard links; "
                             "SQLite keeps a database under one name only (its WAL is named "
                             "after it): give it one")
        self._lockPath = real + ".lock"
        self._lock = self._flock(self._lockPath)
        self._mark = os.pread(self._lock, 16, 0)

    def _setMark(self, mark: bytes) -> None:
        """Say in the lock file whether the store is open (read back by the next open)."""
        if self._lock is not None:
            os.pwrite(self._lock, mark, 0)
            os.ftruncate(self._lock, len(mark))

    def _shut(self) -> None:
        """Close the database; the last connection closed checkpoints and removes the
        WAL, and then the lock file says the store is closed."""
        if self._db is not None:
            self._db.close()
            self._db = None
            if not os.path.exists(os.path.realpath(self.path) + "-wal"):
                self._setMark(b"")

    def _flock(self, lockPath: str) -> int:
        """Lock *lockPath* (made if need be): its descriptor, or :class:`StoreError`."""
        try:
            fd = os.open(lockPath, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"Titanic store {self.path}: cannot open {lockPath}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"Titanic store {self.path} is in use by another Titanic "
                             f"(lock {lockPath} is held)") from None
        return fd

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
        self._shut()  # if not closed yet (the reactor stopped first)
        if self._trigger is not None:
            with contextlib.suppress(ValueError, KeyError):
                self.reactor.removeSystemEventTrigger(self._trigger)
            self._trigger = None
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    # --- ITitanicStore ----------------------------------------------------------------

    def open(self) -> defer.Deferred[None]:
        if self._pool is not None:
            return defer.fail(StoreError(f"Titanic store {self.path} is already open"))
        try:
            self._takeLock()
        except StoreError:
            return defer.fail()
        self.reactor = default_reactor(self.reactor)
        self._damaged, self._unscanned = [], 0
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name=f"titanic-store {self.path}")
        self._pool.start()
        self._trigger = self.reactor.addSystemEventTrigger("during", "shutdown", self._release)
        return self._run(self._connect).addErrback(lambda failure: (self._release(), failure)[1])

    def add(self, service: bytes, frames: list[bytes], now: float) -> defer.Deferred[str]:
        requestId = str(uuid.uuid4())  # an RFC 4122 UUID (version 4) as text
        service = bytes(service)
        record = encode_record(frames)
        crc = _checksum(requestId.encode("ascii"), service, record)
        return self._write("INSERT INTO requests (id, service, request, created, request_crc) "
                           "VALUES (?, ?, ?, ?, ?)", (requestId, service, record, now, crc),
                           len(record) + len(service) + 128).addCallback(lambda _: requestId)

    def pending(self, limit: int, skipServices: Collection[bytes] = (),
                skipIds: Collection[str] = (), onlyServices: Optional[Collection[bytes]] = None
                ) -> defer.Deferred[list[StoredRequest]]:
        def read(rows: list[tuple[Any, ...]]) -> list[StoredRequest]:
            self._rows.update((requestId, seq) for seq, requestId, *_ in rows)
            return [_stored(row[1:]) for row in rows]

        return self._run(self._pending, limit, set(skipServices), json.dumps(list(skipIds)),
                         None if onlyServices is None else list(onlyServices)).addCallback(read)

    def complete(self, requestId: str, reply: list[bytes], now: float) -> defer.Deferred[None]:
        record = encode_record(reply)
        seq = self._rows.pop(requestId, None)  # by the row it was read from: its id there may be damaged
        where, key = ("seq", seq) if seq is not None else ("id", requestId)
        return self._write(f"UPDATE requests SET reply = ?, completed = ?, reply_crc = ? WHERE {where} = ? "
                           "AND reply IS NULL", (record, now, _checksum(record), key)
                           ).addCallback(lambda _: None)

    def reply(self, requestId: str) -> defer.Deferred[tuple[ReplyStatus, list[bytes]]]:
        return self._run(self._reply, requestId)

    def _reply(self, requestId: str) -> tuple[ReplyStatus, list[bytes]]:
        row = self._connection().execute(
            "SELECT reply, reply_crc FROM requests WHERE id = ?", (requestId,)).fetchone()
        if row is None:
            return ReplyStatus.UNKNOWN, []
        record, crc = row
        if record is None:
            return ReplyStatus.PENDING, []
        return ReplyStatus.DONE, _reply_frames(self.path, requestId, record, crc)

    def forget(self, requestId: str) -> defer.Deferred[None]:
        self._rows.pop(requestId, None)
        return self._write("DELETE FROM requests WHERE id = ?", (requestId,)).addCallback(lambda _: None)

    def purge(self, before: float) -> defer.Deferred[int]:
        return self._write("DELETE FROM requests WHERE reply IS NOT NULL AND completed < ?", (before,))

    def close(self) -> defer.Deferred[None]:
        self._rows.clear()
        if self._pool is None:
            return defer.succeed(None)
        written: defer.Deferred[None] = defer.Deferred()
        self._lastCommit.chainDeferred(written)  # the writes asked for are committed first
        return written.addCallback(lambda _: self._run(self._shut)).addBoth(
            lambda result: (self._release(), result)[1])


@implementer_only(ITitanicStore)
class MemoryStore(SQLiteStore):
    """Everything in a SQLite database in memory, used on the reactor thread: fast, and lost with the
    process (not with :meth:`close`: started again, Titanic finds its requests, as in a file)."""

    def __init__(self, *, maxBytes: int = DEFAULT_MAX_STORE_BYTES) -> None:
        super().__init__(":memory:", maxBytes=maxBytes)
        self._connect()

    def _run(self, work: Any, *args: Any) -> defer.Deferred[Any]:
        return defer.maybeDeferred(work, *args)

    def open(self) -> defer.Deferred[None]:
        return defer.succeed(None)

    def close(self) -> defer.Deferred[None]:
        return defer.succeed(None)


def postgres_store_class() -> Any:
    """:class:`~mdp.titanic.pgstore.PostgresStore`; a ValueError saying what to install if
    psycopg 3 is missing."""
    try:
        from mdp.titanic.pgstore import PostgresStore
    except ImportError as e:
        raise ValueError(f"a PostgreSQL store needs psycopg 3, the postgres extra: pip install "
                         f"'txmajordomo[postgres]' (from a checkout: '.[postgres]') ({e})") from None
    return PostgresStore


def open_store(db: str, reactor: Optional[Any] = None, *,
               maxBytes: int = DEFAULT_MAX_STORE_BYTES, lease: float = DEFAULT_LEASE) -> ITitanicStore:
    """The store for *db*: ``":memory:"`` is the memory store, a ``postgresql://`` URL a
    PostgreSQL database (whose claims last *lease* seconds), anything else a SQLite file
    path (made if missing); each holds at most *maxBytes*."""
    if db.startswith(POSTGRES_URL):
        return postgres_store_class()(db, reactor, maxBytes=maxBytes, lease=lease)
    if db == ":memory:":
        return MemoryStore(maxBytes=maxBytes)
    if not db:
        raise ValueError("the Titanic database path is empty (give a file, or :memory:)")
    return SQLiteStore(db, reactor, maxBytes=maxBytes)
