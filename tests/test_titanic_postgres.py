"""Titanic on PostgreSQL (a real server from Debian's package, tests/postgres_server.py):
several stores share one database, each request claimed by one at a time; a dead store's
claims are taken over once their lease lapses; a database out of reach refuses submits
with a TSP error, is logged once, and is used again when it is back, losing nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_twisted
from twisted.internet import task
from twisted.logger import globalLogPublisher

from mdp.errors import StoreError, StoreUnavailable
from mdp.titanic import protocol
from mdp.titanic.pgstore import TABLE, PostgresStore
from mdp.titanic.server import TitanicServer
from mdp.titanic.store import ReplyStatus
from tests.postgres_server import PASSWORD, postgres  # noqa: F401  (a fixture)
from tests.procs import ENV, Cluster, Process, bounded, python, reactor, script, wait_until


@pytest.fixture
def database(postgres: Any) -> Any:  # noqa: F811
    """The server, its Titanic table dropped after the test."""
    yield postgres
    with psycopg.connect(postgres.url(), autocommit=True) as db:
        db.execute(f"DROP TABLE IF EXISTS {TABLE}")


async def opened(url: str, lease: float = 30.0) -> PostgresStore:
    store = PostgresStore(url, reactor(), lease=lease)
    await store.open()
    return store


def sql(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as db:
        cursor = db.execute(query)
        return cursor.fetchall() if cursor.description else []


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_two_stores_on_one_database_never_hand_out_the_same_request(database: Any) -> None:
    first, second = await opened(database.url()), await opened(database.url())
    try:
        ids = [await first.add(b"echo", [b"%d" % n], float(n)) for n in range(10)]
        mine = [r.id for r in await first.pending(4)]
        theirs = [r.id for r in await second.pending(10)]
        assert mine == ids[:4] and theirs == ids[4:]  # oldest first, each claimed once
        assert [r.id for r in await first.pending(10)] == mine  # its own, read again
        await second.complete(theirs[0], [b"done"], 20.0)
        assert await first.reply(theirs[0]) == (ReplyStatus.DONE, [b"done"])
        assert await first.pending(0) == []  # holding none of them now: they are given back
        assert [r.id for r in await second.pending(10)] == [*mine, *theirs[1:]]
    finally:
        await first.close()
        await second.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_dead_stores_claims_are_taken_over_once_its_lease_lapses(database: Any) -> None:
    """A living store renews its claims (for three leases here); one that stops renewing,
    as a killed Titanic does, loses them one lease later."""
    living, dead, other = [await opened(database.url(), lease=1.0) for _ in range(3)]
    try:
        kept = [await living.add(b"echo", [b"kept"], 1.0)]
        lost = [await dead.add(b"echo", [b"lost"], 2.0)]
        assert [r.id for r in await living.pending(1)] == kept
        assert [r.id for r in await dead.pending(1)] == lost
        dead._renewal.stop()  # (and gives nothing back: as if killed)
        started = reactor().seconds()
        found: list[str] = []
        while not found:
            found = [r.id for r in await other.pending(10)]
            await task.deferLater(reactor(), 0.05, lambda: None)
        assert found == lost and 0.9 <= reactor().seconds() - started < 10
        await task.deferLater(reactor(), 2.0, lambda: None)  # two leases
        assert [r.id for r in await other.pending(10, skipIds=lost)] == []  # the living one's is its
        told: list[str] = []
        dead.onLost = told.append
        await dead._renew()  # (as when the database is back): what it held is another's now
        assert told == lost
    finally:
        for store in (living, dead, other):
            await store.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_claim_cut_off_before_its_commit_holds_its_rows_only_5_s(database: Any) -> None:
    """A Titanic cut off between the statements of a claim leaves its session in a
    transaction, its rows locked (read past by the others): the server ends it after 5 s."""
    store = await opened(database.url())
    cut = psycopg.connect(database.url(), **store._settings)  # (the store's own settings)
    try:
        requestId = await store.add(b"echo", [b"x"], 1.0)
        cut.execute(f"SELECT id FROM {TABLE} FOR UPDATE")  # (and never a commit)
        assert await store.pending(10) == []  # locked: read past
        started = reactor().seconds()
        found: list[str] = []
        while not found:
            found = [r.id for r in await store.pending(10)]
            await task.deferLater(reactor(), 0.1, lambda: None)
        assert found == [requestId] and 4.5 <= reactor().seconds() - started < 8
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # ended under it
            cut.execute("SELECT 1")
    finally:
        cut.close()
        await store.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_stores_reading_at_once_claim_each_request_once(database: Any) -> None:
    stores = [await opened(database.url()) for _ in range(4)]
    try:
        ids = [await stores[0].add(b"echo", [b"%d" % n], float(n)) for n in range(40)]
        from twisted.internet import defer

        for _ in range(3):  # each reads 8 at once, with what it holds left out
            reads = await defer.gatherResults([s.pending(8, skipIds=s._claimed) for s in stores])
        claimed = [r.id for read in reads for r in read]
        got = [sorted(s._claimed) for s in stores]
        assert len(claimed) == len(set(claimed))
        every = [i for held in got for i in held]
        assert len(every) == len(set(every)) and set(every) == set(ids)
    finally:
        for store in stores:
            await store.close()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_restarted_database_is_used_again_at_the_first_call(database: Any) -> None:
    store = await opened(database.url())
    said: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(said.append)
    try:
        first = await store.add(b"echo", [b"1"], 1.0)
        database.stop()
        database.start()
        second = await store.add(b"echo", [b"2"], 2.0)  # no error: the connection is made again
        assert [r.id for r in await store.pending(10)] == [first, second]
        assert not [e for e in said if "out of reach" in e_text(e)]
    finally:
        globalLogPublisher.removeObserver(said.append)
        await store.close()
        if not database.running:
            database.start()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_url_that_cannot_be_read_is_refused_without_its_password(database: Any) -> None:
    store = PostgresStore("postgresql://titanic:p%zzSECRET@localhost/titanic", reactor())
    with pytest.raises(StoreError, match="percent-encoded") as caught:
        await store.open()
    assert "SECRET" not in str(caught.value)


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_database_out_of_reach_refuses_submits_says_so_once_and_comes_back(
        database: Any) -> None:
    store = await opened(database.url())
    server = TitanicServer("tcp:127.0.0.1:1", store, reactor())  # (its services never start)
    said: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(said.append)
    try:
        [ok, kept] = await server.request([b"echo", b"kept"])
        assert ok == protocol.OK
        database.stop()
        for n in range(3):
            answer = await server.request([b"echo", b"%d" % n])
            assert answer[0] == protocol.FAILED and b"password" not in b"".join(answer)
            assert b"the store failed to store" in answer[1], answer
        with pytest.raises(StoreUnavailable, match="postgresql://titanic@"):
            await store.reply(kept.decode())
        out = [e for e in said if "out of reach" in str(e.get("log_format", "")) + str(e.get("reason"))]
        assert len(out) == 1 and e_text(out[0]).startswith("Titanic store postgresql://titanic@/postgres")
        database.start()
        for _ in range(50):  # tried again once a second at most
            [ok, *_] = answer = await server.request([b"echo", b"again"])
            if ok == protocol.OK:
                break
            await task.deferLater(reactor(), 0.1, lambda: None)
        assert ok == protocol.OK, answer
        assert sum("reachable again" in e_text(e) for e in said) == 1
        assert [r.frames for r in await store.pending(10)] == [[b"kept"], [b"again"]]  # nothing lost
        assert PASSWORD not in "".join(e_text(e) for e in said)
    finally:
        globalLogPublisher.removeObserver(said.append)
        await store.close()
        if not database.running:
            database.start()


def e_text(event: dict[str, Any]) -> str:
    from twisted.logger import formatEvent

    return formatEvent(event)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_wrong_credentials_stop_titanic_at_start_with_one_clear_line(database: Any) -> None:
    titanic = Process(reactor(), [script("twist"), "--log-format", "text", "mdp-titanic",
                                  "--broker", "zmq:tcp://127.0.0.1:5",
                                  "--db", database.url(password="not-the-password")], ENV)
    try:
        await bounded(titanic.ended(30), 30)
        assert titanic.exitCode == 1
        lines = [line for line in titanic.output.decode().splitlines() if "Titanic cannot start" in line]
        assert len(lines) == 1 and b"out of reach" not in titanic.output, titanic.output
        assert "password authentication failed" in lines[0] and "postgresql://titanic@" in lines[0]
        assert b"not-the-password" not in titanic.output
    finally:
        await titanic.stop()


def start_titanic(endpoint: str, url: str) -> Process:
    return Process(reactor(), [script("twist"), "--log-format", "text", "mdp-titanic",
                               "--broker", endpoint, "--db", url, "--stamp", "--lease", "2",
                               "--concurrency", "4", "--timeout", "2", "--backoff-max", "1",
                               "--heartbeat", "0.25", "--liveness", "4"], ENV)


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_two_titanics_share_2000_requests_and_one_killed_loses_none(
        database: Any, tmp_path: Path) -> None:
    """Two Titanics on one PostgreSQL store, workers with a shared reply store: each takes
    40-60% of the dispatches; one is SIGKILLed mid-way; every request is answered, and run
    once (the workers count)."""
    url, runs, ids = database.url(), tmp_path / "runs", str(tmp_path / "ids")
    runs.mkdir()
    cluster = Cluster()
    procs: list[Process] = []
    try:
        await cluster.startBroker("zmq:tcp://127.0.0.1:*")
        titanics = [start_titanic(cluster.endpoint, url) for _ in range(2)]
        procs += titanics
        for titanic in titanics:
            await bounded(titanic.waitFor("Titanic started", timeout=60), 60)
        submitter = Process(reactor(), python("-m", "tests.titanic_clients", "submit",
                                              cluster.endpoint, "work", "2000", ids), ENV)
        procs.append(submitter)
        await bounded(submitter.waitFor("submitted 2000", timeout=50), 50)
        env = {**ENV, "MDP_TEST_RUNS": str(runs)}
        for _ in range(3):
            procs.append(Process(reactor(), [
                script("twist"), "--log-format", "text", "mdp-worker", "--broker", cluster.endpoint,
                "--service", "work", "--handler", "tests.handlers_for_tests:counted_tagged",
                "--reply-db", str(tmp_path / "replies.db"),
                "--heartbeat", "0.25", "--liveness", "4", "--backoff-max", "2"], env))

        def done() -> int:
            return sql(url, f"SELECT count(*) FROM {TABLE} WHERE reply IS NOT NULL")[0][0]

        await wait_until(lambda: done() >= 800, 40, step=0.05)
        shares = sorted(n for _, n in sql(url, f"SELECT owner, count(*) FROM {TABLE} "
                                               "WHERE reply IS NOT NULL GROUP BY owner"))
        titanics[0].signalProcess(signal.SIGKILL)
        assert len(shares) == 2 and 0.4 <= shares[0] / sum(shares) <= 0.6, shares
        await wait_until(lambda: done() == 2000, 40, step=0.05)
        collector = Process(reactor(), python("-m", "tests.titanic_clients", "collect",
                                              cluster.endpoint, ids), ENV)
        procs.append(collector)
        await bounded(collector.ended(40), 40)
        assert b"collected 2000 ok" in collector.output, collector.output
        ran = [line for name in os.listdir(runs) for line in (runs / name).read_bytes().splitlines()]
        assert len(ran) == 2000 and len(set(ran)) == 2000  # each run once
    finally:
        for proc in procs:
            await proc.stop()
        await cluster.stop()


@pytest.mark.timeout(30)
@pytest_twisted.ensureDeferred
async def test_a_table_of_the_same_name_that_is_not_titanics_is_refused(database: Any) -> None:
    sql(database.url(), f"CREATE TABLE {TABLE} (id text, note text)")
    store = PostgresStore(database.url(), reactor())
    with pytest.raises(StoreError, match="is not Titanic's"):
        await store.open()
    assert sql(database.url(), f"SELECT count(*) FROM {TABLE}") == [(0,)]  # left as it was
