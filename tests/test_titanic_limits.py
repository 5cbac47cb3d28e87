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
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer

from mdp.titanic import TitanicStoreFull, protocol
from mdp.titanic.integrity import wal_damage
from mdp.titanic.server import TitanicServer
from mdp.titanic.store import MemoryStore


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


# --- the WAL check ---------------------------------------------------------------------


@functools.cache
def three_commits() -> tuple[bytes, list[int]]:
    """A real WAL of three transactions, and the frame number of each commit."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "wal.db")
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("CREATE TABLE t (x BLOB)")
        for n in range(3):
            db.execute("INSERT INTO t VALUES (?)", (os.urandom(3000 + n),))
        with open(path + "-wal", "rb") as f:
            wal = f.read()
        db.close()
    size = struct.unpack(">I", wal[8:12])[0] + 24
    commits = [n for n in range((len(wal) - 32) // size)
               if struct.unpack(">I", wal[32 + n * size + 4:32 + n * size + 8])[0]]
    return wal, commits


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_changed_byte_before_the_last_commit_is_damage_a_torn_end_is_not(data: Any) -> None:
    wal, commits = three_commits()
    size = (len(wal) - 32) // (commits[-1] + 1)
    assert wal_damage(wal) is None
    # any byte of a frame (its header or its page) up to the second commit
    frame = data.draw(st.integers(0, commits[-2]))
    offset = data.draw(st.integers(0, size - 1))
    at = 32 + frame * size + offset
    changed = wal[:at] + bytes([wal[at] ^ data.draw(st.integers(1, 255))]) + wal[at + 1:]
    assert "committed transaction follows it" in (wal_damage(changed) or "")
    # the last transaction torn anywhere (never acknowledged): no damage
    end = data.draw(st.integers(32 + (commits[-2] + 1) * size, len(wal)))
    assert wal_damage(wal[:end]) is None
    assert "header checksum" in (wal_damage(wal[:20] + b"\xff" + wal[21:]) or "")
