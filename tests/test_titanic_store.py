"""Titanic's stores: the same contract in memory, in SQLite and in PostgreSQL; SQLite keeps
what it acknowledged across a restart and refuses a damaged file."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import pytest
import pytest_twisted

from mdp.errors import StoreError
from mdp.titanic.store import MemoryStore, ReplyStatus, SQLiteStore
from tests.postgres_server import postgres  # noqa: F401  (a fixture)


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


@contextlib.asynccontextmanager
async def opened(path: str) -> Any:
    """A SQLite store on *path*, open for the block."""
    store = SQLiteStore(path, reactor())
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@pytest_twisted.async_yield_fixture(params=["memory", "sqlite", "postgresql"])
async def store(request: Any, tmp_path: Any) -> Any:
    if request.param == "postgresql":
        from mdp.titanic.pgstore import PostgresStore

        server = request.getfixturevalue("postgres")
        s = PostgresStore(server.url(), reactor())
    else:
        s = MemoryStore() if request.param == "memory" else SQLiteStore(str(tmp_path / "t.db"), reactor())
    await s.open()
    yield s
    await s.close()
    if request.param == "postgresql":
        import psycopg

        with psycopg.connect(server.url(), autocommit=True) as db:
            db.execute("DROP TABLE titanic_requests")


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_request_is_pending_until_its_reply_then_done(store: Any) -> None:
    first = await store.add(b"echo", [b"a", b""], 1.0)
    second = await store.add(b"upper", [b"b"], 2.0)
    assert str(uuid.UUID(first)) == first and first != second
    pending = await store.pending(10)
    assert [(p.id, p.service, p.frames) for p in pending] == [
        (first, b"echo", [b"a", b""]), (second, b"upper", [b"b"])]  # oldest first
    assert await store.reply(first) == (ReplyStatus.PENDING, [])
    await store.complete(first, [b"A", b""], 3.0)
    assert await store.reply(first) == (ReplyStatus.DONE, [b"A", b""])
    assert [p.id for p in await store.pending(10)] == [second]
    assert [p.id for p in await store.pending(0)] == []
    await store.complete(first, [b"again"], 4.0)  # a second reply changes nothing
    assert await store.reply(first) == (ReplyStatus.DONE, [b"A", b""])


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_forget_is_idempotent_and_unknown_ids_are_unknown(store: Any) -> None:
    requestId = await store.add(b"echo", [b"x"], 1.0)
    await store.forget(requestId)
    await store.forget(requestId)
    assert await store.reply(requestId) == (ReplyStatus.UNKNOWN, [])
    assert await store.reply(str(uuid.uuid4())) == (ReplyStatus.UNKNOWN, [])
    await store.complete(requestId, [b"late"], 2.0)  # closed meanwhile: ignored
    assert await store.reply(requestId) == (ReplyStatus.UNKNOWN, [])


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_purge_drops_replies_completed_before_a_time_only(store: Any) -> None:
    old = await store.add(b"s", [b"1"], 0.0)
    recent = await store.add(b"s", [b"2"], 0.0)
    waiting = await store.add(b"s", [b"3"], 0.0)
    await store.complete(old, [b"r"], 10.0)
    await store.complete(recent, [b"r"], 20.0)
    assert await store.purge(15.0) == 1
    assert (await store.reply(old))[0] is ReplyStatus.UNKNOWN
    assert (await store.reply(recent))[0] is ReplyStatus.DONE
    assert (await store.reply(waiting))[0] is ReplyStatus.PENDING


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_sqlite_keeps_what_it_acknowledged_across_a_restart(tmp_path: Any) -> None:
    path = str(tmp_path / "titanic.db")
    first = SQLiteStore(path, reactor())
    await first.open()
    requestId = await first.add(b"echo", [b"kept"], 1.0)
    done = await first.add(b"echo", [b"answered"], 2.0)
    await first.complete(done, [b"ANSWERED"], 3.0)
    await first.close()
    again = SQLiteStore(path, reactor())
    await again.open()
    try:
        assert [(p.id, p.frames) for p in await again.pending(10)] == [(requestId, [b"kept"])]
        assert await again.reply(done) == (ReplyStatus.DONE, [b"ANSWERED"])
    finally:
        await again.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path: Any) -> None:
    path = tmp_path / "titanic.db"
    path.write_bytes(b"this is not a database, and never was " * 200)
    broken = SQLiteStore(str(path), reactor())
    with pytest.raises(StoreError, match=str(path)):
        await broken.open()
    await broken.close()
    assert path.read_bytes().startswith(b"this is not a database")  # left as it was


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_pending_leaves_out_parked_services_and_held_requests(store: Any) -> None:
    a = await store.add(b"echo", [b"a"], 1.0)
    b = await store.add(b"down", [b"b"], 2.0)
    c = await store.add(b"echo", [b"c"], 3.0)
    d = await store.add(b"upper", [b"d"], 4.0)
    assert [p.id for p in await store.pending(10, skipServices=[b"down"])] == [a, c, d]
    assert [p.id for p in await store.pending(10, skipIds=[a, d])] == [b, c]
    assert [p.id for p in await store.pending(1, skipServices=[b"echo"], skipIds=[b])] == [d]


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_sqlite_commits_concurrent_writes_together_and_close_waits_for_them(
        tmp_path: Any) -> None:
    path = str(tmp_path / "titanic.db")
    store = SQLiteStore(path, reactor())
    await store.open()
    commits: list[int] = []
    commit = store._commit
    store._commit = lambda statements: (commits.append(len(statements)), commit(statements))[1]
    adds = [store.add(b"echo", [b"%d" % n], float(n)) for n in range(20)]
    closed = store.close()  # asked before any of the adds is committed
    ids = [await d for d in adds]
    await closed
    assert len(commits) < 20 and sum(commits) == 20  # fewer transactions than writes
    again = SQLiteStore(path, reactor())
    await again.open()
    try:
        pending = await again.pending(100)
        assert [p.id for p in pending] == ids and pending[19].frames == [b"19"]
    finally:
        await again.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_one_sqlite_file_has_one_store_at_a_time(tmp_path: Any) -> None:
    path = str(tmp_path / "titanic.db")
    first = SQLiteStore(path, reactor())
    await first.open()
    second = SQLiteStore(path, reactor())
    with pytest.raises(StoreError, match="in use by another Titanic"):
        await second.open()
    # nor under another name: through a symbolic link; and a file with a
    # second name (a hard link) is refused whoever holds it
    (tmp_path / "alias.db").symlink_to(path)
    with pytest.raises(StoreError, match="in use by another Titanic"):
        await SQLiteStore(str(tmp_path / "alias.db"), reactor()).open()
    os.link(path, tmp_path / "linked.db")
    with pytest.raises(StoreError, match="2 hard links"):
        await SQLiteStore(str(tmp_path / "linked.db"), reactor()).open()
    os.unlink(tmp_path / "linked.db")
    await first.close()
    with pytest.raises(StoreError, match="is closed"):
        await first.add(b"echo", [b"x"], 1.0)
    with pytest.raises(StoreError, match="is closed"):
        await first.pending(1)
    await second.open()  # free again
    try:
        assert await second.pending(1) == []
    finally:
        await second.close()
    await first.open()  # and a closed store opens again
    await first.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_write_that_fails_fails_alone_in_its_group(tmp_path: Any) -> None:
    store = SQLiteStore(str(tmp_path / "titanic.db"), reactor())
    await store.open()
    try:
        first = store.add(b"echo", [b"0"], 0.0)  # committed alone; the rest wait for it
        grouped = [store.add(b"echo", [b"1"], 1.0),
                   store._write("INSERT INTO nowhere VALUES (1)", ()),
                   store.add(b"echo", [b"2"], 2.0)]
        ids = [await first, await grouped[0], await grouped[2]]
        with pytest.raises(Exception, match="no such table"):
            await grouped[1]
        assert [p.id for p in await store.pending(10)] == ids
    finally:
        await store.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_damaged_row_is_read_back_without_frames_and_holds_up_no_other(
        tmp_path: Any) -> None:
    """A value of the wrong type passes SQLite's own checks (a flipped bit
    in a record's type byte): that request comes back without frames (the
    dispatcher answers it with an error), the others as they were, and a
    damaged reply fails its fetch with StoreError."""
    import sqlite3

    path = str(tmp_path / "titanic.db")
    store = SQLiteStore(path, reactor())
    await store.open()
    before = await store.add(b"echo", [b"before"], 1.0)
    damaged = await store.add(b"echo", [b"damaged"], 2.0)
    noId = await store.add(b"echo", [b"no id"], 2.5)
    wrongService = await store.add(b"echo", [b"service"], 3.0)
    after = await store.add(b"echo", [b"after"], 4.0)
    answered = await store.add(b"echo", [b"answered"], 5.0)
    # services titanic.request would have refused: asked about for ever, or
    # calling Titanic itself
    badNames = [await store.add(name, [b"x"], 7.0)
                for name in (b"", b"\xff\xfe", b"titanic.request")]
    await store.complete(answered, [b"REPLY"], 6.0)
    await store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE requests SET request = CAST(request AS TEXT) WHERE id = ?", (damaged,))
    db.execute("UPDATE requests SET id = CAST(id AS BLOB) WHERE id = ?", (noId,))
    db.execute("UPDATE requests SET service = 'echo' WHERE id = ?", (wrongService,))
    db.execute("UPDATE requests SET reply = 'garbage' WHERE id = ?", (answered,))
    db.commit()
    db.close()
    await store.open()
    try:
        pending = [(p.id, p.service, p.frames) for p in await store.pending(10)]
        assert pending == [(before, b"echo", [b"before"]), (damaged, b"echo", []),
                           (wrongService, b"", []), (after, b"echo", [b"after"]),
                           (badNames[0], b"", []), (badNames[1], b"\xff\xfe", []),
                           (badNames[2], b"titanic.request", [])]
        # a row that cannot even be answered (its id is damaged) takes no one's place
        assert [p.id for p in await store.pending(3)] == [before, damaged, wrongService]
        with pytest.raises(StoreError, match=f"reply to {answered} is damaged"):
            await store.reply(answered)
    finally:
        await store.close()


def flip_byte(path: str, marker: bytes, offset: int = 0) -> None:
    """Change one byte of *path* where *marker* is (once, and only there),
    as a failing disk would: SQLite's own checks do not see it."""
    with open(path, "r+b") as f:
        data = f.read()
        assert data.count(marker) == 1, marker
        at = data.index(marker) + offset
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_byte_changed_on_the_disk_is_caught_by_the_checksum(tmp_path: Any) -> None:
    """A flipped bit inside a stored request (or its service's name, or a
    reply) passes SQLite's checks and would still decode: the checksum
    stored beside it catches it; that request is answered with an error,
    that reply's fetch fails, the rest are as they were."""
    path = str(tmp_path / "titanic.db")
    async with opened(path) as store:
        intact = await store.add(b"echo", [b"intact"], 1.0)
        body = await store.add(b"echo", [b"transfer 100 EUR"], 2.0)
        service = await store.add(b"billing-service", [b"x"], 3.0)
        answered = await store.add(b"echo", [b"y"], 4.0)
        await store.complete(answered, [b"REPLY-0123456789"], 5.0)
    flip_byte(path, b"transfer 100 EUR", 9)     # 100 -> 101: it still decodes
    flip_byte(path, service.encode() + b"billing-service", 36)  # its row's service name
    flip_byte(path, b"REPLY-0123456789", 8)
    async with opened(path) as store:
        pending = [(p.id, p.service, p.frames) for p in await store.pending(10)]
        assert pending[0] == (intact, b"echo", [b"intact"])
        assert [(i, frames) for i, _, frames in pending[1:]] == [(body, []), (service, [])]
        with pytest.raises(StoreError, match=f"reply to {answered} is damaged: its checksum"):
            await store.reply(answered)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_store_from_before_the_checksums_opens_and_gets_them(tmp_path: Any) -> None:
    """A database written before there were checksums opens: its rows are
    read as they are, and what is stored from then on is checked."""
    import sqlite3

    from mdp.transport.framing import encode_record

    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE requests (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
            service BLOB NOT NULL, request BLOB NOT NULL, created REAL NOT NULL, reply BLOB,
            completed REAL);
        CREATE INDEX requests_pending ON requests (seq) WHERE reply IS NULL;
        CREATE INDEX requests_completed ON requests (completed) WHERE reply IS NOT NULL;
    """)
    old = str(uuid.uuid4())
    db.execute("INSERT INTO requests (id, service, request, created) VALUES (?, ?, ?, ?)",
               (old, b"echo", encode_record([b"old"]), 1.0))
    db.commit()
    db.close()
    async with opened(path) as store:
        new = await store.add(b"echo", [b"new-request-body"], 2.0)
        assert [(p.id, p.frames) for p in await store.pending(10)] == [
            (old, [b"old"]), (new, [b"new-request-body"])]
        await store.complete(old, [b"old reply"], 3.0)
        assert await store.reply(old) == (ReplyStatus.DONE, [b"old reply"])
    flip_byte(path, b"new-request-body", 3)
    async with opened(path) as store:
        assert [(p.id, p.frames) for p in await store.pending(10)] == [(new, [])]


def test_a_store_error_is_logged_in_one_line_and_a_bug_with_its_traceback() -> None:
    from twisted.logger import Logger, formatEvent
    from twisted.python.failure import Failure

    from mdp.titanic.store import report_failure

    events: list[dict] = []
    logger = Logger(observer=events.append)
    report_failure(logger, Failure(StoreError("disk I/O error")), "could not store {id}", id="x")
    report_failure(logger, Failure(RuntimeError("a bug")), "could not store {id}", id="y")
    assert formatEvent(events[0]) == "could not store x: disk I/O error"
    assert "log_failure" not in events[0] and events[1]["log_failure"].check(RuntimeError)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_another_applications_database_is_refused_and_left_as_it_is(tmp_path: Any) -> None:
    import sqlite3

    for name, schema in (("theirs.db", "CREATE TABLE requests (a, b)"),
                         ("other.db", "CREATE TABLE accounts (id, balance)")):
        path = str(tmp_path / name)
        db = sqlite3.connect(path)
        db.execute(schema)
        db.commit()
        db.close()
        with pytest.raises(StoreError, match="is not a Titanic store: .*left as it is"):
            await SQLiteStore(path, reactor()).open()
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not made WAL
        assert [n for (n,) in db.execute("SELECT name FROM sqlite_master")] == [
            schema.split()[2]]
        db.close()
        assert not os.path.exists(path + "-wal")
    # a directory is not a file, whatever its link count
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError, match="not a file"):
        await SQLiteStore(str(tmp_path / "dir.db"), reactor()).open()
    # a store of its own opens again, as before
    own = str(tmp_path / "own.db")
    store = SQLiteStore(own, reactor())
    await store.open()
    await store.add(b"echo", [b"x"], 1.0)
    await store.close()
    await store.open()
    try:
        assert len(await store.pending(10)) == 1
    finally:
        await store.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_database_that_can_only_be_read_is_refused_at_open(
        tmp_path: Any, monkeypatch: Any) -> None:
    """SQLite opens a file it may not write (a read-only mount, another
    owner) read-only without a word: the store refuses to open it, naming
    it (it opened, and then refused every request)."""
    import sqlite3

    path = str(tmp_path / "t.db")
    async with opened(path) as store:
        await store.add(b"echo", [b"x"], 1.0)
    connect = sqlite3.connect

    def read_only(database: str, **options: Any) -> Any:  # as the OS would make it
        return connect(f"file:{database}?mode=ro", uri=True, **options)

    monkeypatch.setattr(sqlite3, "connect", read_only)
    with pytest.raises(StoreError, match=f"{path} cannot be opened: .*readonly"):
        await SQLiteStore(path, reactor()).open()
    monkeypatch.setattr(sqlite3, "connect", connect)
    async with opened(path) as store:  # the lock was let go, the file left as it was
        assert [p.frames for p in await store.pending(10)] == [[b"x"]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("gone", ["t.db", "t.db-wal"])
@pytest_twisted.ensureDeferred
async def test_a_store_whose_files_are_deleted_while_it_runs_writes_no_more(
        tmp_path: Any, gone: str) -> None:
    """The database or its WAL deleted while the store runs: a write fails
    with StoreError saying so (it was acknowledged, written to a file no
    restart finds)."""
    async with opened(str(tmp_path / "t.db")) as store:
        await store.add(b"echo", [b"before"], 1.0)
        os.unlink(str(tmp_path / gone))
        with pytest.raises(StoreError, match="was deleted while in use.*restart Titanic"):
            await store.add(b"echo", [b"after"], 2.0)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_lock_file_deleted_while_the_store_runs_is_taken_again(tmp_path: Any) -> None:
    """A cleaner of old files deletes the lock: the store takes the lock
    again on a new file and goes on (a second Titanic could otherwise open
    the same database and run every request twice); if another Titanic got
    the new lock first, writes fail instead."""
    import fcntl

    path = str(tmp_path / "t.db")
    async with opened(path) as store:
        await store.add(b"echo", [b"before"], 1.0)
        os.unlink(path + ".lock")
        await store.add(b"echo", [b"after"], 2.0)
        assert os.path.exists(path + ".lock")
        with pytest.raises(StoreError, match="in use by another Titanic"):
            await SQLiteStore(path, reactor()).open()
        assert sorted(p.frames[0] for p in await store.pending(10)) == [b"after", b"before"]
        os.unlink(path + ".lock")
        other = os.open(path + ".lock", os.O_RDWR | os.O_CREAT)  # another takes it first
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(StoreError, match="its lock was replaced while in use"):
                await store.add(b"echo", [b"late"], 3.0)
        finally:
            os.close(other)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_store_whose_database_is_replaced_while_it_runs_writes_no_more(
        tmp_path: Any) -> None:
    path = str(tmp_path / "t.db")
    async with opened(path) as store:
        await store.add(b"echo", [b"before"], 1.0)
        os.replace(path, str(tmp_path / "moved.db"))
        (tmp_path / "t.db").write_bytes(b"")
        with pytest.raises(StoreError, match=f"{path}: the database was replaced while in use"):
            await store.add(b"echo", [b"after"], 2.0)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_byte_changed_in_a_request_id_is_caught_and_its_row_answered_and_purged(
        tmp_path: Any) -> None:
    """The id in a request's row changes (its index entry does not): the
    checksum covers the id, so the request is answered with an error, not
    run; the answer is stored in that row, and the request is pending no
    more (else it would run again and again under an id nobody asks for).
    The id index is rebuilt: SQLite could not delete the row otherwise."""
    path = str(tmp_path / "titanic.db")
    async with opened(path) as store:
        requestId = await store.add(b"charge", [b"$10"], 1.0)
    flip_byte(path, requestId.encode() + b"charge", 35)
    async with opened(path) as store:
        (damaged,) = await store.pending(10)
        assert damaged.id != requestId and damaged.frames == []
        await store.complete(damaged.id, [b"error"], 2.0)
        assert await store.pending(10) == []
        assert await store.reply(damaged.id) == (ReplyStatus.DONE, [b"error"])
        assert await store.purge(3.0) == 1


def unindex(path: str, seq: int) -> None:
    """Make the pending-by-service index miss row *seq* (as a changed index page
    would), and change a byte of that row's request: both sides damaged."""
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    name = "requests_pending_service"
    (sql,) = db.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()
    for narrowed in (sql.replace("WHERE reply IS NULL", f"WHERE reply IS NULL AND seq <> {seq}"),
                     sql):
        db.execute("PRAGMA writable_schema = ON")
        db.execute("UPDATE sqlite_master SET sql = ? WHERE name = ?", (narrowed, name))
        db.close()
        db = sqlite3.connect(path, isolation_level=None)
        if narrowed != sql:
            db.execute(f"REINDEX {name}")
    db.execute("UPDATE requests SET request = request || x'00' WHERE seq = ?", (seq,))
    db.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_damaged_row_its_index_misses_is_answered_as_damaged(tmp_path: Any) -> None:
    """The index is rebuilt at start even though the row failing its checksum
    may be the side that changed: else the answer could not be stored (SQLite
    cannot update a row its index misses) and the request would wait for ever."""
    path = str(tmp_path / "titanic.db")
    async with opened(path) as store:
        ids = [await store.add(b"echo", [b"%d" % n], float(n)) for n in range(3)]
    unindex(path, 2)
    async with opened(path) as store:
        read = await store.pending(10, onlyServices=[b"echo"])
        assert [(p.id, bool(p.frames)) for p in read] == [(ids[0], True), (ids[1], False),
                                                          (ids[2], True)]
        await store.complete(ids[1], [b"500", b"damaged"], 9.0)
        assert await store.reply(ids[1]) == (ReplyStatus.DONE, [b"500", b"damaged"])


async def backlogged(path: str, backlog: int) -> str:
    """A store at *path* with *backlog* requests for ``down``, then one for
    ``up`` (its id returned)."""
    import sqlite3

    from mdp.titanic.store import _checksum
    from mdp.transport.framing import encode_record

    async with opened(path):
        pass
    db = sqlite3.connect(path)
    record = encode_record([b"x"])
    with db:
        db.executemany("INSERT INTO requests (id, service, request, created, request_crc) "
                       "VALUES (?, ?, ?, ?, ?)",
                       ((i, b"down", record, float(n), _checksum(i.encode(), b"down", record))
                        for n, i in ((n, str(uuid.uuid4())) for n in range(backlog))))
    db.close()
    async with opened(path) as store:
        return await store.add(b"up", [b"y"], 1e9)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_parked_service_backlog_is_not_read_to_find_the_others(tmp_path: Any) -> None:
    """The dispatcher reads pending requests leaving out parked services
    (one read after every submission): a read in age order that would pass
    more than a few thousand of their rows gives way to one service by
    service, which never reads them."""
    for backlog, byService in ((10, False), (50_000, True)):
        path = str(tmp_path / f"backlog-{backlog}.db")
        fresh = await backlogged(path, backlog)
        async with opened(path) as store:
            statements: list[str] = []
            store._db.set_trace_callback(statements.append)
            assert [p.id for p in await store.pending(16, [b"down"])] == [fresh]
            store._db.set_trace_callback(None)
            assert any("WITH RECURSIVE" in s for s in statements) is byService
            assert len(await store.pending(16)) == min(16, backlog + 1)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_both_ways_of_reading_pending_requests_find_the_same(
        tmp_path: Any, monkeypatch: Any) -> None:
    import mdp.titanic.store as module

    path = str(tmp_path / "mixed.db")
    async with opened(path) as store:
        for n in range(60):
            await store.add(b"svc-%d" % (n % 7), [b"%d" % n], float(n))
    async with opened(path) as store:
        ids = [p.id for p in await store.pending(100)]
        cases = [(16, [b"svc-1", b"svc-4"], ids[:5]), (100, [b"svc-0"], []),
                 (3, [b"svc-%d" % n for n in range(7)], []), (8, [b"svc-6"], ids[10:40]),
                 (9, [b"svc-2"], ids[:20], [b"svc-2", b"svc-3", b"svc-5"]), (4, [], [], [b"svc-6"])]
        found = [[p.id for p in await store.pending(*case)] for case in cases]
        monkeypatch.setattr(module, "SCAN_BUDGET", 0)  # always service by service
        assert [[p.id for p in await store.pending(*case)] for case in cases] == found
    assert found[2] == [] and len(found[1]) == 60 - 9 and found[0][0] not in ids[:5]


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_the_memory_store_reads_pending_requests_as_the_sqlite_store_does(
        tmp_path: Any) -> None:
    """Oldest first across services, leaving out services and ids (the
    memory store keeps them by service, so a parked backlog is not passed)."""
    memory = MemoryStore()
    async with opened(str(tmp_path / "same.db")) as sqlite:
        ids: dict[Any, list[str]] = {memory: [], sqlite: []}
        for n in range(60):
            for store in (memory, sqlite):
                ids[store].append(await store.add(b"svc-%d" % (n % 7), [b"%d" % n], float(n)))
        for store in (memory, sqlite):  # some answered, some closed
            for n in (3, 10, 11):
                await store.complete(ids[store][n], [b"done"], 100.0)
            await store.forget(ids[store][12])
        cases = [(16, [b"svc-1", b"svc-4"], range(5)), (100, [b"svc-0"], ()),
                 (3, [b"svc-%d" % n for n in range(7)], ()), (8, [b"svc-6"], range(10, 40))]
        found = {}
        for store in (memory, sqlite):
            found[store] = [[p.frames[0] for p in await store.pending(
                limit, skip, [ids[store][n] for n in skipIds])]
                for limit, skip, skipIds in cases]
        assert found[memory] == found[sqlite]
        assert found[memory][0][:3] == [b"5", b"6", b"7"]
