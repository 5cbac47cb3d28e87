"""Titanic against a hostile or careless peer, each a separate process over
real sockets on 127.0.0.1: requests for services nobody serves cost the
served ones nothing, the store has a size limit, and a store damaged while
stopped is repaired or refused at start."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import task

from mdp import Client
from mdp.errors import StoreError
from mdp.titanic import Titanic, TitanicClient, protocol
from mdp.titanic.store import ReplyStatus, SQLiteStore
from tests.procs import (
    ENV,
    TAGGED,
    Process,
    bounded,
    finished,
    python,
    reactor,
    script,
    twist_broker,
    twist_worker,
    wait_until,
)


def start_titanic(endpoint: str, db: str) -> Process:
    return Process(reactor(), [script("twist"), "--log-format", "text", "mdp-titanic",
                               "--broker", endpoint, "--db", db], ENV)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process *pid* so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def flood(endpoint: str, count: int, size: int) -> dict[str, int]:
    """An attacker process submits *count* requests of *size* bytes, each for a
    service nobody serves; what became of them."""
    attacker = await finished(python("-m", "tests.titanic_clients", "flood", endpoint,
                                     str(count), str(size)), timeout=120)
    match = re.search(rb"flooded (\{.*\})", attacker.output)
    assert match, attacker.output.decode(errors="replace")
    return json.loads(match.group(1))


async def timed_call(client: TitanicClient, body: bytes) -> float:
    """Seconds from a request's acknowledgement to its reply (polled every 20 ms)."""
    requestId = await bounded(client.submit("echo", body), 30)
    start = reactor().seconds()
    reply = await bounded(client.result(requestId, pollInterval=0.02), 30)
    assert reply[1:] == [body]
    return reactor().seconds() - start


async def titanic_up(broker: Process, titanic: Process) -> None:
    ready = broker.output.count(b"ready for titanic.request")
    await bounded(titanic.waitFor("Titanic started", timeout=60), 60)
    await wait_until(lambda: broker.output.count(b"ready for titanic.request") > ready, 30)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_requests_for_services_nobody_serves_cost_a_served_service_nothing(
        tmp_path: Any) -> None:
    """1,000 requests parked for services nobody serves: a served service's
    request is done within a second, at once and right after a restart, and
    Titanic idles under 1% CPU (nothing polls the parked requests)."""
    db = str(tmp_path / "titanic.db")
    broker, endpoint = await twist_broker(reactor(), "zmq:tcp://127.0.0.1:*")
    procs = [broker, twist_worker(reactor(), endpoint, "echo", TAGGED)]
    client = TitanicClient(endpoint, reactor(), timeout=10.0)
    try:
        procs.append(start_titanic(endpoint, db))
        await titanic_up(broker, procs[-1])
        await bounded(procs[1].waitFor("sent READY", timeout=60), 60)
        assert await flood(endpoint, 1000, 16) == {"stored": 1000}
        assert await timed_call(client, b"now") < 1.0

        pid = procs[-1].transport.pid
        await task.deferLater(reactor(), 1.0)  # what the flood left settles
        before, start = cpu_seconds(pid), reactor().seconds()
        await task.deferLater(reactor(), 4.0)
        busy = (cpu_seconds(pid) - before) / (reactor().seconds() - start)
        assert busy < 0.01, f"Titanic used {busy:.1%} CPU while idle"

        await procs[-1].stop()  # SIGTERM: its workers leave the broker at once
        procs.append(start_titanic(endpoint, db))
        await titanic_up(broker, procs[-1])
        assert await timed_call(client, b"after a restart") < 1.0
    finally:
        await client.disconnect()
        for proc in reversed(procs):
            await proc.stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_submits_beyond_the_store_limits_are_refused_typed_and_not_stored(
        tmp_path: Any) -> None:
    """Requests over the per-request limit are refused (``400`` + ``413``:
    TitanicRequestTooLarge), and once the store holds its limit the next are
    refused (``500`` + ``507``: TitanicStoreFull); nothing of them is stored,
    and what was acknowledged stays."""
    db = str(tmp_path / "titanic.db")
    broker, endpoint = await twist_broker(reactor(), "zmq:tcp://127.0.0.1:*")
    limit = 2 * 1024**2
    titanic = Titanic(endpoint, db, reactor(), maxStoreBytes=limit,
                      maxRequestBytes=128 * 1024)
    client = Client(endpoint, reactor(), timeout=10.0)
    try:
        await titanic.start()
        await wait_until(lambda: broker.output.count(b"ready for titanic.request") >= 4, 30)
        assert await flood(endpoint, 5, 200_000) == {"TitanicRequestTooLarge": 5}
        outcomes = await flood(endpoint, 40, 100_000)
        assert set(outcomes) == {"stored", "TitanicStoreFull"}, outcomes
        big = await bounded(client.request(protocol.REQUEST, b"x", b"y" * 200_000), 30)
        assert (big[0], big[2]) == (b"400", b"413") and b"limit of 131072" in big[1]
        full = await bounded(client.request(protocol.REQUEST, b"x", b"y" * 100_000), 30)
        assert (full[0], full[2]) == (b"500", b"507") and b"store is full" in full[1]

        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
            pages, free, size = (conn.execute(f"PRAGMA {name}").fetchone()[0]
                                 for name in ("page_count", "freelist_count", "page_size"))
        assert rows == outcomes["stored"]  # nothing half-stored
        assert (pages - free) * size <= limit
    finally:
        await client.close()
        await titanic.stop()
        await broker.stop()


FLIP = """
import sqlite3, sys
path, key = sys.argv[1], sys.argv[2].encode()
with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
    roots = dict(db.execute("SELECT name, rootpage FROM sqlite_master"))
    size = db.execute("PRAGMA page_size").fetchone()[0]
db.close()
data = bytearray(open(path, "rb").read())
page = (roots["sqlite_autoindex_requests_1"] - 1) * size
at = data.index(key, page, page + size) + 10
data[at:at + 8] = bytes(b ^ 0x5A for b in data[at:at + 8])
page = (roots["requests_pending"] - 1) * size
cell = page + int.from_bytes(data[page + 8:page + 10], "big")  # its first cell: (seq, row)
data[cell + 4:cell + 6] = bytes(b ^ 4 for b in data[cell + 4:cell + 6])  # the key, not its size
open(path, "wb").write(data)
print("flipped")
"""


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_bytes_flipped_in_index_pages_while_stopped_are_repaired_at_start(
        tmp_path: Any) -> None:
    """8 bytes of the id index and 2 of the pending index changed by another
    process while Titanic is stopped (``quick_check`` passes): at start the
    indexes are rebuilt from their table, with a warning, and every request
    answers as it should."""
    path = str(tmp_path / "titanic.db")
    store = SQLiteStore(path, reactor())
    await store.open()
    answered = await store.add(b"echo", [b"one"], 1.0)
    waiting = await store.add(b"echo", [b"two"], 2.0)
    await store.complete(answered, [b"ONE"], 3.0)
    await store.close()
    flipper = await finished([sys.executable, "-c", FLIP, path, answered])
    assert b"flipped" in flipper.output, flipper.output
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA quick_check").fetchone() == ("ok",)
    db.close()

    again = SQLiteStore(path, reactor())
    await again.open()
    try:
        assert await again.reply(answered) == (ReplyStatus.DONE, [b"ONE"])
        assert [p.id for p in await again.pending(10)] == [waiting]
        assert [p.id for p in await again.pending(10, onlyServices=[b"echo"])] == [waiting]
    finally:
        await again.close()


#: stores three requests in the store argv[1], printing their ids, then with
#: argv[2] "kill" dies as if killed (the WAL left, not checkpointed), with
#: "end" ends (its reactor stops) without closing the store
LEAVE_OPEN = """
import os, sys
from twisted.internet import defer, task
from mdp.titanic.store import SQLiteStore

async def main(reactor):
    store = SQLiteStore(sys.argv[1], reactor)
    await store.open()
    for n in range(3):
        print(await store.add(b"echo", [b"%d" % n], float(n)), flush=True)
    if sys.argv[2] == "kill":
        os._exit(0)

task.react(lambda reactor: defer.ensureDeferred(main(reactor)))
"""


async def left_open(path: str) -> list[str]:
    """A process that stores three requests and dies without closing the store."""
    proc = await finished(python("-c", LEAVE_OPEN, path, "kill"))
    ids = proc.output.decode().split()
    assert len(ids) == 3 and os.path.getsize(path + "-wal") > 0, proc.output
    return ids


async def pending_ids(path: str) -> list[str]:
    """The ids of the requests pending in the store at *path*, opened and closed again."""
    store = SQLiteStore(path, reactor())
    await store.open()
    try:
        return [p.id for p in await store.pending(10)]
    finally:
        await store.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_wal_gone_from_a_store_left_open_is_refused_saying_what_to_do(
        tmp_path: Any) -> None:
    path = str(tmp_path / "titanic.db")
    await left_open(path)
    os.remove(path + "-wal")
    with pytest.raises(StoreError, match=f"its WAL {path}-wal is missing, but the last run "
                                         f"did not close the store.*If a SQLite program opened "
                                         f".*delete {path}.lock"):
        await SQLiteStore(path, reactor()).open()
    os.remove(path + ".lock")  # the operator accepts what the database holds
    store = SQLiteStore(path, reactor())
    await store.open()
    await store.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_store_its_program_did_not_close_opens_again_with_everything(
        tmp_path: Any) -> None:
    path = str(tmp_path / "titanic.db")
    proc = await finished(python("-c", LEAVE_OPEN, path, "end"))
    ids = proc.output.decode().split()
    assert len(ids) == 3, proc.output
    assert await pending_ids(path) == ids


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_start_failing_after_a_crash_leaves_the_store_to_open_next_time(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start after a crash fails once connected (a full disk, say);
    closing the connection moved the WAL into the database: the next start
    opens it with every request."""
    path = str(tmp_path / "titanic.db")
    ids = await left_open(path)

    def full(self: SQLiteStore, db: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as patched:
        patched.setattr(SQLiteStore, "_prepare", full)
        with pytest.raises(StoreError, match="disk is full"):
            await SQLiteStore(path, reactor()).open()
    assert await pending_ids(path) == ids


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_damaged_wal_is_refused_saying_what_to_do(tmp_path: Any) -> None:
    """8 bytes changed in the WAL's first frame: SQLite would drop that commit
    and the two after it without a word; Titanic refuses to start.  Left as
    it was, the WAL is replayed and every request is there."""
    path = str(tmp_path / "titanic.db")
    ids = await left_open(path)
    with open(path + "-wal", "r+b") as wal:
        wal.seek(32 + 24 + 100)
        original = wal.read(8)
        wal.seek(32 + 24 + 100)
        wal.write(bytes(b ^ 0xFF for b in original))
    with pytest.raises(StoreError, match=f"its WAL {path}-wal is damaged .*a later committed "
                                         f"transaction .*follows it.*Restore"):
        await SQLiteStore(path, reactor()).open()
    with open(path + "-wal", "r+b") as wal:
        wal.seek(32 + 24 + 100)
        wal.write(original)
    assert await pending_ids(path) == ids
