"""Stamped requests run once on a worker with a reply store."""

from __future__ import annotations

import pathlib
import sqlite3

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp.errors import RemoteError, StoreError
from mdp.majordomo.idempotence import (
    STAMP_MARKER,
    MemoryReplyStore,
    SQLiteReplyStore,
    stamp,
    unstamp,
)
from tests.conftest import LoopbackNet
from tests.test_mdp_behaviour import make_client, start_broker, start_worker


def test_stamp_round_trip() -> None:
    body = stamp(b"c" * 16, 7, [b"a", b"b"])
    assert body[:3] == [STAMP_MARKER, b"c" * 16, b"7"]
    assert unstamp(body) == ((b"c" * 16, b"7"), [b"a", b"b"])
    assert unstamp([b"plain", b"frames"]) == (None, [b"plain", b"frames"])


def test_memory_store_is_bounded_lru() -> None:
    store = MemoryReplyStore(maxEntries=2)
    store.put((b"c", b"1"), [b"one"])
    store.put((b"c", b"2"), [b"two"])
    assert store.get((b"c", b"1")) == [b"one"]  # now most recently used
    store.put((b"c", b"3"), [b"three"])
    assert len(store) == 2
    assert store.get((b"c", b"2")) is None
    assert store.get((b"c", b"1")) == [b"one"]
    with pytest.raises(ValueError):
        MemoryReplyStore(0)


def test_an_sqlite_store_is_shared_by_the_processes_that_open_it(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "replies.db")
    first, second = SQLiteReplyStore(path), SQLiteReplyStore(path)  # two workers of one host
    first.put((b"c" * 16, b"1"), [b"paid", b"", b"\x00" * 3])
    assert second.get((b"c" * 16, b"1")) == [b"paid", b"", b"\x00" * 3]  # frames kept, empty ones too
    assert second.get((b"c" * 16, b"2")) is None
    first.close()
    reopened = SQLiteReplyStore(path)  # a worker started after one was killed
    assert reopened.get((b"c" * 16, b"1")) == [b"paid", b"", b"\x00" * 3]
    reopened.close()
    second.close()


def test_an_sqlite_store_keeps_the_newest_max_entries(tmp_path: pathlib.Path) -> None:
    store = SQLiteReplyStore(str(tmp_path / "replies.db"), maxEntries=3)
    for n in range(10):
        store.put((b"c" * 16, str(n).encode()), [str(n).encode()])
    assert len(store) == 3
    assert store.get((b"c" * 16, b"9")) == [b"9"] and store.get((b"c" * 16, b"6")) is None
    store.close()


def test_an_sqlite_store_that_cannot_open_says_where(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreError, match="cannot open the reply store .*missing"):
        SQLiteReplyStore(str(tmp_path / "missing" / "replies.db"))
    with pytest.raises(ValueError):
        SQLiteReplyStore(str(tmp_path / "replies.db"), maxEntries=0)
    other = sqlite3.connect(str(tmp_path / "other.db"))
    other.execute("CREATE TABLE replies (id INTEGER)")  # a file of something else
    other.close()
    with pytest.raises(StoreError, match="other.db: no such column"):
        SQLiteReplyStore(str(tmp_path / "other.db"))


def test_an_sqlite_store_reopened_smaller_trims_a_bounded_number_a_put(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "replies.db")
    big = SQLiteReplyStore(path)
    big._db.executemany("INSERT INTO replies VALUES (?, ?, ?)",
                        ((b"c" * 16, str(n).encode(), b"") for n in range(5000)))
    big.close()
    small = SQLiteReplyStore(path, maxEntries=10)
    small.put((b"c" * 16, b"new"), [b"x"])
    assert len(small) == 5001 - 2 * SQLiteReplyStore.TRIM_EVERY  # not all 4,991 in one put
    small.put((b"c" * 16, b"newer"), [b"y"])
    small.put((b"c" * 16, b"newest"), [b"z"])
    assert len(small) == 10 and small.get((b"c" * 16, b"new")) == [b"x"]
    small.close()


def test_an_sqlite_store_locked_by_another_worker_fails_a_call_soon(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "replies.db")
    store = SQLiteReplyStore(path, busyTimeout=0.05)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another worker in the middle of a write
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            store.put((b"c" * 16, b"1"), [b"x"])
        assert store.get((b"c" * 16, b"1")) is None  # readers are not held up (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        store.close()


@pytest.mark.parametrize("body", [
    [STAMP_MARKER, b"c" * 15, b"1", b"x"],  # a short client id
    [STAMP_MARKER, b"", b"1", b"x"],
    [STAMP_MARKER, b"c" * 1024, b"1", b"x"],
    [STAMP_MARKER, b"c" * 16, b"1a", b"x"],  # not digits
    [STAMP_MARKER, b"c" * 16, b"", b"x"],
    [STAMP_MARKER, b"c" * 16, b"1" * 21, b"x"],  # longer than any 64-bit number
    [STAMP_MARKER, b"c" * 16, b"1"],  # no body frame
    [STAMP_MARKER],
])
def test_malformed_stamps_are_refused(body: list[bytes]) -> None:
    # a key is only ever made of a well-formed stamp: two clients cannot share
    # one by sending the same short id, nor make a store keep a key of any size
    with pytest.raises(ValueError):
        unstamp(body)


def test_memory_store_is_bounded_in_bytes() -> None:
    store = MemoryReplyStore(maxEntries=1000, maxBytes=20_000)
    for n in range(100):
        store.put((b"c" * 16, str(n).encode()), [b"x" * 1024])
        assert store.heldBytes <= 20_000
    assert 10 <= len(store) < 20
    assert store.get((b"c" * 16, b"99")) == [b"x" * 1024]  # the newest stay
    assert store.get((b"c" * 16, b"0")) is None
    held = store.heldBytes
    store.put((b"c" * 16, b"99"), [b"x" * 1024])  # stored again: counted once
    assert store.heldBytes == held
    store.put((b"c" * 16, b"big"), [b"x" * 30_000])  # over the bound alone: not kept
    assert store.get((b"c" * 16, b"big")) is None
    assert store.heldBytes == held
    with pytest.raises(ValueError):
        MemoryReplyStore(maxBytes=0)


@pytest_twisted.ensureDeferred
async def test_a_malformed_stamp_is_answered_400_without_running_the_handler(
        clocknet: LoopbackNet) -> None:
    _, endpoint = await start_broker(clocknet)
    runs: list[list[bytes]] = []
    start_worker(clocknet, endpoint, "svc", lambda f: runs.append(f) or f,
                 replies=MemoryReplyStore())
    client = make_client(clocknet, endpoint)
    reply = client.request("svc", STAMP_MARKER, b"short", b"1", b"x")
    with pytest.raises(RemoteError) as caught:
        await clocknet.wait(reply)
    assert caught.value.code == b"400" and b"stamp" in str(caught.value).encode()
    assert runs == []
    # the worker serves the next request
    assert await clocknet.wait(client.request("svc", b"y")) == [b"y"]
    assert runs == [[b"y"]]


@pytest_twisted.ensureDeferred
async def test_a_retried_request_runs_once_and_gets_the_stored_reply(clocknet: LoopbackNet) -> None:
    _, endpoint = await start_broker(clocknet)
    runs: list[list[bytes]] = []
    slow: list[defer.Deferred] = []

    def transfer(frames: list[bytes]) -> defer.Deferred:
        runs.append(frames)
        d: defer.Deferred = defer.Deferred()
        slow.append(d)
        return d

    store = MemoryReplyStore()
    start_worker(clocknet, endpoint, "transfer", transfer, replies=store)
    client = make_client(clocknet, endpoint, timeout=1.0, retries=3, stamp=True)
    reply = client.request("transfer", b"100 EUR")
    await clocknet.until(lambda: len(runs) == 1)
    clocknet.advance(1.5)  # the first attempt times out; the retry waits in the broker
    slow[0].callback([b"done once"])  # the late reply goes to the abandoned attempt
    assert await clocknet.wait(reply) == [b"done once"]  # the retry is answered from the store
    assert runs == [[b"100 EUR"]]  # the handler never saw the stamp, and ran once
    assert len(store) == 1


@pytest_twisted.ensureDeferred
async def test_distinct_requests_are_not_confused(clocknet: LoopbackNet) -> None:
    _, endpoint = await start_broker(clocknet)
    runs: list[bytes] = []
    start_worker(clocknet, endpoint, "svc", lambda f: runs.append(f[0]) or f,
                 replies=MemoryReplyStore())
    client = make_client(clocknet, endpoint, stamp=True)
    for word in (b"a", b"a", b"b"):
        assert await clocknet.wait(client.request("svc", word)) == [word]
    assert runs == [b"a", b"a", b"b"]  # same body, new request: runs again


@pytest_twisted.ensureDeferred
async def test_worker_without_store_still_strips_the_stamp(clocknet: LoopbackNet) -> None:
    _, endpoint = await start_broker(clocknet)
    start_worker(clocknet, endpoint, "svc", lambda f: f)
    client = make_client(clocknet, endpoint, stamp=True)
    assert await clocknet.wait(client.request("svc", b"x", b"y")) == [b"x", b"y"]


@pytest_twisted.ensureDeferred
async def test_a_stamping_client_asks_mmi_as_any_other(clocknet: LoopbackNet) -> None:
    """MMI reads its body as the service name: a client that stamps its
    requests does not stamp its MMI queries."""
    import json

    from tests.test_mdp_behaviour import echo

    broker, endpoint = await start_broker(clocknet)
    start_worker(clocknet, endpoint, "echo", echo)
    await clocknet.until(lambda: len(broker.workers) == 1)
    stamped = make_client(clocknet, endpoint, stamp=True)
    assert await clocknet.wait(stamped.request("mmi.service", b"echo")) == [b"200"]
    (workers,) = await clocknet.wait(stamped.request("mmi.workers", b"echo"))
    assert len(json.loads(workers)) == 1
    assert await clocknet.wait(stamped.request("echo", b"hi")) == [b"hi"]


@pytest_twisted.ensureDeferred
async def test_a_request_stamped_by_its_caller_runs_once_across_workers_sharing_a_store(
        clocknet: LoopbackNet, tmp_path: pathlib.Path) -> None:
    # a caller that derives the stamp itself (the Spark bridge: from a key column and the
    # batch), sent by a client that stamps nothing, replayed after its first worker stopped
    _, endpoint = await start_broker(clocknet)
    runs: list[list[bytes]] = []
    path = str(tmp_path / "replies.db")
    first = start_worker(clocknet, endpoint, "pay", lambda f: runs.append(f) or [b"paid", *f],
                         replies=SQLiteReplyStore(path))
    client = make_client(clocknet, endpoint)
    request = stamp(b"k" * 16, 3, [b"42"])
    assert await clocknet.wait(client.request("pay", *request)) == [b"paid", b"42"]
    await clocknet.wait(first.stop())
    start_worker(clocknet, endpoint, "pay", lambda f: runs.append(f) or [b"again", *f],
                 replies=SQLiteReplyStore(path))
    assert await clocknet.wait(client.request("pay", *request)) == [b"paid", b"42"]  # from the store
    assert runs == [[b"42"]]
    assert await clocknet.wait(client.request("pay", *stamp(b"k" * 16, 4, [b"42"]))) == [b"again", b"42"]
