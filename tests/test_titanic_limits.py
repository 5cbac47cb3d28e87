"""Titanic's store limits, its reads by service and its start-up checks, without
a broker: the store's size limit and the per-request limit refuse a submit
whole, and a WAL SQLite would cut short is told from one a crash tore."""

from __future__ import annotations

import functools
import os
import sqlite3
import struct
import tempfile
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from twisted.internet import defer

from mdp.titanic import TitanicStoreFull, protocol
from mdp.titanic.server import TitanicServer
from mdp.titanic.store import MemoryStore, wal_damage


@pytest_twisted.ensureDeferred
async def test_a_full_store_refuses_each_request_that_would_pass_its_limit() -> None:
    """Submits committed together are refused one by one once the pages in
    use would pass the limit; a refused one leaves nothing; a forgotten
    request's room is used again."""
    store = MemoryStore(maxBytes=400_000)
    outcomes = await defer.DeferredList(
        [store.add(b"echo", [b"x" * 50_000], 1.0) for _ in range(12)], consumeErrors=True)
    stored = [value for ok, value in outcomes if ok]
    refused = [value for ok, value in outcomes if not ok]
    assert 4 <= len(stored) < 12 and len(refused) == 12 - len(stored)
    assert all(f.check(TitanicStoreFull) and "limit of 400000" in str(f.value) for f in refused)
    assert len(await store.pending(100)) == len(stored)
    with pytest.raises(TitanicStoreFull, match="store is full"):
        await store.add(b"echo", [b"x" * 50_000], 2.0)
    await store.add(b"echo", [b"small"], 2.0)  # what fits still goes in
    await store.forget(stored[0])
    await store.forget(stored[1])
    await store.add(b"echo", [b"x" * 50_000], 3.0)


def test_store_and_request_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="maxBytes"):
        MemoryStore(maxBytes=0)
    with pytest.raises(ValueError, match="maxRequestBytes"):
        TitanicServer("zmq:tcp://127.0.0.1:1", MemoryStore(), maxRequestBytes=0)


@pytest_twisted.ensureDeferred
async def test_a_request_over_the_request_limit_is_answered_400_413_and_not_stored() -> None:
    store = MemoryStore()
    server = TitanicServer("zmq:tcp://127.0.0.1:1", store, maxRequestBytes=100)
    status, message, code = server.request([b"echo", b"x" * 60, b"y" * 41])
    assert (status, code) == (protocol.UNKNOWN, protocol.TOO_LARGE)
    assert b"101 bytes is over Titanic's limit of 100" in message
    assert await store.pending(10) == []
    reply = await server.request([b"echo", b"x" * 60, b"y" * 40])
    assert reply[0] == protocol.OK


@pytest_twisted.ensureDeferred
async def test_a_read_by_service_finds_those_services_and_damaged_rows_of_any() -> None:
    store = MemoryStore()
    ids = [await store.add(service, [b"%d" % n], float(n))
           for n, service in enumerate([b"down", b"echo", b"other", b"echo"])]
    damaged = await store.add(b"gone", [], 9.0)  # no frames: read back as damaged
    found = await store.pending(10, onlyServices=[b"echo", b"other"])
    assert [p.id for p in found] == [ids[1], ids[2], ids[3], damaged]
    assert [p.id for p in await store.pending(2, onlyServices=[b"echo"])] == [ids[1], ids[3]]
    assert [p.id for p in await store.pending(10, skipIds=[ids[1]], skipServices=[b"other"],
                                              onlyServices=[b"echo", b"other"])] == [
        ids[3], damaged]


@pytest_twisted.ensureDeferred
async def test_a_request_larger_than_the_store_may_hold_is_answered_400_413() -> None:
    """Not 507 "try again later": it would never fit."""
    server = TitanicServer("zmq:tcp://127.0.0.1:1", MemoryStore(maxBytes=50_000))
    status, message, code = server.request([b"echo", b"x" * 60_000])
    assert (status, code) == (protocol.UNKNOWN, protocol.TOO_LARGE)
    assert b"over Titanic's limit of 50000" in message


@pytest_twisted.ensureDeferred
async def test_only_a_new_request_costs_the_store_size_check() -> None:
    """Replies, closes and purges are never refused: no size is read for them."""
    store = MemoryStore()
    requestId = await store.add(b"echo", [b"x"], 1.0)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    await store.complete(requestId, [b"y"], 2.0)
    await store.forget(requestId)
    assert statements and not [s for s in statements if "PRAGMA" in s]


# --- the WAL check ---------------------------------------------------------------------


@functools.cache
def four_commits() -> tuple[bytes, int, list[int]]:
    """A real WAL of four transactions, each commit frame repeated to fill a
    sector (``psow=0``), its frame size, and the first frame of each transaction."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "wal.db")
        db = sqlite3.connect(f"file:{path}?psow=0", uri=True, isolation_level=None)
        for pragma in ("page_size=512", "journal_mode=WAL", "synchronous=FULL",
                       "wal_autocheckpoint=0"):
            db.execute(f"PRAGMA {pragma}")
        db.execute("CREATE TABLE t (x BLOB)")
        for size in (300, 301, 3000):
            db.execute("INSERT INTO t VALUES (?)", (os.urandom(size),))
        with open(path + "-wal", "rb") as f:
            wal = f.read()
        db.close()
    size = struct.unpack(">I", wal[8:12])[0] + 24
    heads = [struct.unpack(">II", wal[32 + n * size:40 + n * size])
             for n in range((len(wal) - 32) // size)]
    starts = [n for n in range(len(heads)) if n == 0 or heads[n - 1][1] and heads[n] != heads[n - 1]]
    assert len(starts) == 4 and heads[starts[1] - 1] == heads[starts[1] - 2]  # padded
    return wal, size, starts


def zeroed(wal: bytes, size: int, frames: Any) -> bytes:
    for n in frames:
        wal = wal[:32 + n * size] + bytes(size) + wal[32 + (n + 1) * size:]
    return wal


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_changed_byte_before_the_last_transaction_is_damage_a_torn_last_one_is_not(
        data: Any) -> None:
    wal, size, starts = four_commits()
    last, frames = starts[-1], (len(wal) - 32) // size
    assert wal_damage(wal) is None
    # any byte of a frame (its header or its page) before the last transaction, but
    # the commit marker and salts of the one before (it would look torn itself)
    frame = data.draw(st.integers(0, last - 1))
    offset = data.draw(st.integers(0, size - 1))
    at = 32 + frame * size + offset
    assume(not (frame >= starts[-2] and wal[at - offset + 7] and 4 <= offset < 16))
    changed = wal[:at] + bytes([wal[at] ^ data.draw(st.integers(1, 255))]) + wal[at + 1:]
    assert "a later committed transaction" in (wal_damage(changed) or "")
    # the last transaction torn (never acknowledged): some of its frames never written,
    # its commit frame perhaps among those that were, or the file cut short
    lost = data.draw(st.sets(st.integers(last, frames - 1), min_size=1))
    assert wal_damage(zeroed(wal, size, lost)) is None
    assert wal_damage(wal[:data.draw(st.integers(32 + last * size, len(wal)))]) is None
    assert "header checksum" in (wal_damage(wal[:20] + b"\xff" + wal[21:]) or "")


def test_a_wal_with_no_wal_header_holds_nothing() -> None:
    """SQLite takes such a file as empty: nothing of it is lost."""
    assert wal_damage(b"\x37\x7f") is None
    assert wal_damage(bytes(4096)) is None
    assert wal_damage(b"") is None


@pytest.mark.timeout(60)
def test_a_middle_frame_of_the_last_transaction_lost_keeps_every_earlier_commit(
        tmp_path: Any) -> None:
    """Power lost while the last commit was written: its commit frame reached
    the disk, an earlier frame of it did not.  SQLite drops that transaction
    alone; the store opens with every earlier one."""
    path = str(tmp_path / "t.db")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE t (x BLOB)")
    db.execute("INSERT INTO t VALUES (?)", (b"kept",))
    db.execute("INSERT INTO t VALUES (?)", (os.urandom(20000),))  # several pages
    with open(path + "-wal", "rb") as f:
        wal = f.read()
    size = struct.unpack(">I", wal[8:12])[0] + 24
    commits = [n for n in range((len(wal) - 32) // size)
               if struct.unpack(">I", wal[36 + n * size:40 + n * size])[0]]
    assert commits[-1] - commits[-2] > 2
    torn = zeroed(wal, size, [commits[-2] + 1])
    assert wal_damage(torn) is None
    copy = str(tmp_path / "copy.db")
    with open(path, "rb") as f, open(copy, "wb") as g:
        g.write(f.read())
    with open(copy + "-wal", "wb") as g:
        g.write(torn)
    db.close()
    db = sqlite3.connect(copy)
    assert db.execute("SELECT x FROM t").fetchall() == [(b"kept",)]
    db.close()


# --- the cost of reads by service -----------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_reads_by_service_look_for_damaged_rows_a_chunk_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read after a start does not check every pending row (a parked flood
    of them would hold up acknowledgements): each read checks the next chunk."""
    from mdp.titanic import store as module

    monkeypatch.setattr(module, "DAMAGE_CHUNK", 2)
    store = MemoryStore()
    for n in range(4):
        await store.add(b"down", [b"%d" % n], float(n))
    damaged = await store.add(b"gone", [], 9.0)  # no frames: read back as damaged
    reads = [[p.id for p in await store.pending(10, onlyServices=[b"echo"])] for _ in range(3)]
    assert reads == [[], [], [damaged]]


@pytest_twisted.ensureDeferred
async def test_a_read_of_many_listed_services_is_one_scan_by_age() -> None:
    store = MemoryStore()
    names = [b"svc%04d" % n for n in range(500)]
    ids = [await store.add(names[n * 7], [b"x"], float(n)) for n in range(20)]
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    assert [p.id for p in await store.pending(10, onlyServices=names)] == ids[:10]
    assert len(statements) < 10
