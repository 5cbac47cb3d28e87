"""Titanic with real processes over ZeroMQ: nothing it acknowledged is lost
when its client, its workers, the broker or Titanic itself are killed."""

from __future__ import annotations

import signal
import sqlite3
from typing import Any

import pytest
import pytest_twisted

from mdp.titanic import TitanicClient
from tests.procs import (
    ENV,
    Cluster,
    Process,
    bounded,
    python,
    reactor,
    script,
    wait_until,
)

SLOW_TAGGED = "tests.handlers_for_tests:slow_tagged"


def start_titanic(endpoint: str, db: str) -> Process:
    return Process(reactor(), [script("twist"), "--log-format", "text", "mdp-titanic",
                               "--broker", endpoint, "--db", db, "--concurrency", "4",
                               "--timeout", "2", "--backoff-max", "1",
                               "--heartbeat", "0.25", "--liveness", "4"], ENV)


async def titanic_up(cluster: Cluster, db: str) -> Process:
    titanic = start_titanic(cluster.endpoint, db)
    await bounded(titanic.waitFor("Titanic started", timeout=60), 60)
    broker = cluster.broker
    assert broker is not None
    ready = broker.output.count(b"ready for titanic.request")
    await wait_until(lambda: broker.output.count(b"ready for titanic.request") > ready, 30)
    return titanic


async def kill(proc: Process) -> None:
    proc.signalProcess(signal.SIGKILL)
    await proc.ended(30)


def done(db: str) -> int:
    """Replies committed so far (read as another process would: read-only)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return conn.execute("SELECT count(*) FROM requests WHERE reply IS NOT NULL").fetchone()[0]


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_500_requests_survive_killed_clients_workers_titanic_and_broker(
        tmp_path: Any) -> None:
    db, ids = str(tmp_path / "titanic.db"), str(tmp_path / "ids")
    cluster = Cluster()
    titanics: list[Process] = []
    helpers: list[Process] = []
    try:
        await cluster.startBroker("zmq:tcp://127.0.0.1:*")
        titanics.append(await titanic_up(cluster, db))
        # a client submits 500 requests to a service with no worker, and goes away
        submitter = Process(reactor(), python("-m", "tests.titanic_clients", "submit",
                                              cluster.endpoint, "work", "500", ids), ENV)
        helpers.append(submitter)
        await bounded(submitter.waitFor("submitted 500", timeout=120), 120)
        await bounded(submitter.ended(30), 30)
        assert submitter.exitCode == 0 and done(db) == 0

        # workers start later; everything gets killed while Titanic dispatches
        for _ in range(2):
            cluster.startWorker("work", SLOW_TAGGED)
        await wait_until(lambda: done(db) >= 40, 60)
        await kill(cluster.workers[0])
        cluster.startWorker("work", SLOW_TAGGED)

        await wait_until(lambda: done(db) >= 100, 60)
        await kill(titanics[-1])
        titanics.append(await titanic_up(cluster, db))

        await wait_until(lambda: done(db) >= 200, 60)
        first = cluster.broker
        assert first is not None
        await kill(first)
        await cluster.startBroker(cluster.endpoint)  # the same endpoint

        await wait_until(lambda: done(db) >= 300, 60)
        await kill(cluster.workers[1])
        cluster.startWorker("work", SLOW_TAGGED)
        await kill(titanics[-1])
        titanics.append(await titanic_up(cluster, db))

        # a new client process collects all 500 replies by id
        collector = Process(reactor(), python("-m", "tests.titanic_clients", "collect",
                                              cluster.endpoint, ids), ENV)
        helpers.append(collector)
        await bounded(collector.ended(180), 180)
        assert collector.exitCode == 0, collector.output.decode(errors="replace")
        assert b"collected 500 ok" in collector.output
        assert done(db) == 500
        assert len(titanics) == 3 and not titanics[0].running and not titanics[1].running
    finally:
        for proc in helpers + titanics:
            await proc.stop()
        await cluster.stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_request_acknowledged_just_before_titanic_is_killed_is_done(
        tmp_path: Any) -> None:
    db = str(tmp_path / "titanic.db")
    cluster = Cluster()
    titanics: list[Process] = []
    client = None
    try:
        await cluster.startBroker("zmq:tcp://127.0.0.1:*")
        titanics.append(await titanic_up(cluster, db))
        client = TitanicClient(cluster.endpoint, reactor(), pollInterval=0.1)
        requestId = await bounded(client.submit("work", b"keep me"), 30)
        titanics[0].signalProcess(signal.SIGKILL)  # the moment the 200 arrived
        await titanics[0].ended(30)

        titanics.append(await titanic_up(cluster, db))
        cluster.startWorker("work", SLOW_TAGGED)
        reply = await bounded(client.result(requestId), 60)
        assert reply[1] == b"keep me"
    finally:
        if client is not None:
            await client.disconnect()
        for proc in titanics:
            await proc.stop()
        await cluster.stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_damaged_database_stops_titanic_with_a_clear_error(tmp_path: Any) -> None:
    db = tmp_path / "titanic.db"
    db.write_bytes(b"this is not a database, it is a shopping list\n" * 100)
    titanic = start_titanic("zmq:tcp://127.0.0.1:5", str(db))
    try:
        await bounded(titanic.ended(30), 30)
        assert titanic.exitCode == 1
        assert str(db).encode() in titanic.output
        assert titanic.output.count(b"Titanic cannot start") == 1
        assert db.read_bytes().startswith(b"this is not a database")  # left as it was
    finally:
        await titanic.stop()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_a_store_that_is_a_directory_is_said_once(tmp_path: Any) -> None:
    """Found at once (before the reactor runs): one line, as for any other
    store error, not one on stderr and the same again in the log."""
    titanic = start_titanic("zmq:tcp://127.0.0.1:5", str(tmp_path))
    try:
        await bounded(titanic.ended(30), 30)
        assert titanic.exitCode == 1
        assert titanic.output.count(b"Titanic cannot start") == 1, titanic.output
        assert b"not a file" in titanic.output
    finally:
        await titanic.stop()


async def mdp(*args: str) -> Process:
    proc = Process(reactor(), [script("mdp"), *args], ENV)
    await bounded(proc.ended(60), 60)
    return proc


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_the_mdp_titanic_commands(tmp_path: Any) -> None:
    cluster = Cluster()
    titanic = None
    try:
        await cluster.startBroker("zmq:tcp://127.0.0.1:*")
        titanic = await titanic_up(cluster, ":memory:")
        broker = ("--broker", cluster.endpoint)
        submitted = await mdp("titanic", "submit", *broker, "work", "one", "two")
        assert submitted.exitCode == 0, submitted.output
        requestId = submitted.output.decode().strip()
        assert len(requestId) == 36, submitted.output
        pending = await mdp("titanic", "result", *broker, requestId)
        assert pending.exitCode == 3, pending.output
        assert pending.output.decode() == (f"mdp titanic result: request {requestId} is pending "
                                           "(no reply yet); ask again later, or wait for it with "
                                           "--wait\n"), pending.output
        cluster.startWorker("work", SLOW_TAGGED)
        result = await mdp("titanic", "result", *broker, "--wait", "--poll", "0.1", requestId)
        lines = result.output.decode().splitlines()
        # what it waited for (on stderr), if it did wait, then the reply
        notes = [line for line in lines if line.startswith("mdp titanic result: ")]
        assert all(f"waiting for request {requestId}" in note for note in notes), notes
        assert result.exitCode == 0 and lines[len(notes) + 1:] == ["one", "two"], lines
        closed = await mdp("titanic", "close", *broker, requestId)
        assert closed.exitCode == 0 and closed.output == b""
        unknown = await mdp("titanic", "result", *broker, requestId)
        assert unknown.exitCode == 1 and b"knows no request" in unknown.output
        bad = await mdp("titanic", "result", *broker, "12345")
        assert bad.exitCode == 2 and b"not a request id" in bad.output
        await titanic.stop()  # the broker still lists its services a while
        titanic = None
        away = await mdp("titanic", "result", *broker, "--timeout", "0.5", "--retries", "1",
                         requestId)
        assert away.exitCode == 1 and b"no Titanic serves titanic.reply" in away.output, away.output
    finally:
        if titanic is not None:
            await titanic.stop()
        await cluster.stop()
