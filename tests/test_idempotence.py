"""Stamped requests run once on a worker with a reply store."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer

from mdp.majordomo.idempotence import STAMP_MARKER, MemoryReplyStore, stamp, unstamp
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
