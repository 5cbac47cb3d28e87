"""One process-wide budget for the stream records that span reads
(:data:`mdp.transport.framing.BUFFERED`, ``Limits.maxBufferedBytes``): a
record that would pass it is refused (its connection closed, with the
reason), and what a record held is given back when it completes or goes
(a peer holding 60 unfinished 16 MiB records used to keep 1 GB)."""

from __future__ import annotations

import gc
from typing import Any, Optional

import pytest
import pytest_twisted
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mdp import Client
from mdp.policy import Limits
from mdp.transport import framing
from mdp.transport.framing import InputBudget, OverBudget, RecordDecoder, encode_record
from tests.procs import ENV, Process, bounded, python, reactor, wait_until
from tests.test_hostile_processes import rss

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def budget(monkeypatch: pytest.MonkeyPatch) -> InputBudget:
    """A budget of the test's own (other tests' connections may hold some)."""
    fresh = InputBudget()
    monkeypatch.setattr(framing, "BUFFERED", fresh)
    return fresh


def test_a_record_within_one_read_costs_nothing(budget: InputBudget) -> None:
    decoder = RecordDecoder(Limits(maxBufferedBytes=64))
    record = encode_record([b"x" * 1000, b"y"])
    assert decoder.feed(record * 3) == [[b"x" * 1000, b"y"]] * 3
    assert budget.held == 0


def test_a_record_across_reads_is_charged_until_complete(budget: InputBudget) -> None:
    decoder = RecordDecoder(Limits())
    record = encode_record([b"x" * 10_000])
    assert decoder.feed(record[:6000]) == []
    assert budget.held == 5996  # (not the record's length prefix)
    assert decoder.feed(record[6000:9000]) == []
    assert budget.held == 8996
    assert decoder.feed(record[9000:]) == [[b"x" * 10_000]]
    assert budget.held == 0


def test_past_the_budget_the_oldest_record_is_dropped_not_the_newcomer(
        budget: InputBudget) -> None:
    """A peer holding a record open cannot make the records that flow fail:
    the oldest unfinished record goes (its owner told at once, its buffers
    given back), and its decoder takes nothing more."""
    evicted: list[Exception] = []
    holder = RecordDecoder(Limits(maxBufferedBytes=10_000))
    holder.onEvicted = evicted.append
    holder.feed(encode_record([b"a" * 20_000])[:8000])
    other = RecordDecoder(Limits(maxBufferedBytes=10_000))
    other.feed(encode_record([b"b" * 5000])[:1000])
    assert budget.held == 7996 + 996 and not evicted
    assert other.feed(b"b" * 1009) == []  # past the budget: the holder goes
    assert [type(e) for e in evicted] == [OverBudget]
    assert "the oldest, of 7996 bytes, is dropped" in str(evicted[0])
    assert budget.held == 996 + 1009 and budget.refused == 1
    assert holder._pieces == [] and holder._frames == []  # its buffers went
    with pytest.raises(OverBudget):
        holder.feed(b"a" * 10)
    assert other.feed(b"b" * 3000) == [[b"b" * 5000]]  # it completes
    assert budget.held == 0
    holder.release()
    assert budget.held == 0


def test_a_record_is_refused_only_when_it_is_the_oldest(budget: InputBudget) -> None:
    first = RecordDecoder(Limits(maxBufferedBytes=10_000))
    first.feed(encode_record([b"a" * 20_000])[:6000])
    second = RecordDecoder(Limits(maxBufferedBytes=10_000))
    second.feed(encode_record([b"b" * 20_000])[:3000])
    with pytest.raises(OverBudget, match="pass the limit of 10000"):
        first.feed(b"a" * 2000)  # the oldest: it goes, the younger one stays
    assert budget.held == 2996 and budget.refused == 1
    second.release()
    assert budget.held == 0


def test_a_decoder_let_go_of_gives_back(budget: InputBudget) -> None:
    decoder: Optional[RecordDecoder] = RecordDecoder(Limits())
    assert decoder is not None
    decoder.feed(encode_record([b"x" * 5000])[:3000])
    assert budget.held == 2996
    decoder = None
    gc.collect()
    assert budget.held == 0


def test_dropped_records_trim_the_heap_at_most_once_a_second(
        budget: InputBudget, monkeypatch: Any) -> None:
    """``malloc_trim`` (0.5 ms on a large heap) is looked up once, and runs
    after a MiB dropped at most once a second, or once nothing is held."""
    trims: list[None] = []
    lookups: list[None] = []
    import ctypes

    def cdll(name: Any) -> Any:
        lookups.append(None)
        return type("C", (), {"malloc_trim": staticmethod(lambda pad: trims.append(None))})

    now = [100.0]
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(framing.time, "monotonic", lambda: now[0])
    decoders = [RecordDecoder(Limits()) for _ in range(7)]
    for decoder in decoders:
        decoder.feed(encode_record([b"x" * MiB])[:MiB // 2 + 8])
    decoders[0].release()
    assert trims == []
    decoders[1].release()
    assert len(trims) == 1
    decoders[2].release()
    decoders[3].release()
    assert len(trims) == 1  # within the second
    now[0] += 1
    decoders[4].release()
    assert len(trims) == 2
    budget.give(decoders[4], True)  # nothing dropped since
    assert len(trims) == 2
    decoders[5].release()
    decoders[6].release()  # the last: nothing held (within the second)
    assert len(trims) == 3 and len(lookups) == 1


def test_an_sp_message_across_reads_is_charged_too(budget: InputBudget) -> None:
    """The SP framing's messages share the budget: charged as they come,
    given back whole, and the oldest dropped past it."""
    from mdp.transport.spframing import REP, REQ, SPDecoder, encode_message, header

    evicted: list[Exception] = []
    decoder = SPDecoder(REQ, Limits(maxBufferedBytes=10_000))
    decoder.onEvicted = evicted.append
    stream = header(REQ) + encode_message(b"a" * 6000) + encode_message(b"b" * 100)
    assert decoder.feed(stream[:4000]) == []
    assert budget.held == 3992
    assert decoder.feed(stream[4000:6018]) == [[b"a" * 6000]]
    assert budget.held == 2  # the next one's first bytes
    assert decoder.feed(stream[6018:]) == [[b"b" * 100]]
    assert budget.held == 0
    assert decoder.feed(encode_message(b"c" * 9000)[:8000]) == []
    newer = RecordDecoder(Limits(maxBufferedBytes=10_000))
    newer.feed(encode_record([b"d" * 5000])[:3000])  # past the budget: the SP message goes
    assert [type(e) for e in evicted] == [OverBudget] and budget.held == 2996
    with pytest.raises(OverBudget):
        decoder.feed(b"c")
    assert SPDecoder(REP).feed(header(REP) + encode_message(b"x")) == [[b"x"]]
    newer.release()
    assert budget.held == 0


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
       cuts=st.lists(st.integers(1, 4000), max_size=10))
@example(sizes=[0], cuts=[5, 1])  # a frame's length prefix split over three reads
def test_any_split_gives_everything_back(sizes: list[int], cuts: list[int]) -> None:
    """However the stream is cut into reads, the messages are the same, and
    once they are all out nothing is held."""
    budget = framing.BUFFERED
    before = budget.held
    messages = [[bytes([i % 251]) * size, b"t"] for i, size in enumerate(sizes)]
    stream = b"".join(encode_record(m) for m in messages)
    decoder = RecordDecoder(Limits())
    out: list[list[bytes]] = []
    pos = 0
    for cut in [*cuts, len(stream)]:
        out += decoder.feed(stream[pos:pos + cut])
        # at most what it holds (a length prefix split across reads is free)
        assert 0 <= budget.held - before <= (decoder.buffered if decoder.inRecord else 0)
        pos += cut
    out += decoder.feed(stream[pos:])
    assert out == messages
    assert budget.held == before


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3000)), max_size=40))
def test_the_budget_holds_and_only_the_oldest_goes(steps: list[tuple[int, int]]) -> None:
    """Four connections feed records of 6,000 bytes in any order against a
    10,000-byte budget: what is held never passes it and is what the live
    decoders hold; a record that is dropped or refused was the oldest."""
    budget = framing.BUFFERED
    before = budget.held
    limits = Limits(maxBufferedBytes=10_000)
    stream = encode_record([b"r" * 6000]) * 4
    decoders = [RecordDecoder(limits) for _ in range(4)]
    gone: list[RecordDecoder] = []
    for decoder in decoders:
        decoder.onEvicted = lambda why, decoder=decoder: gone.append(decoder)
    sent = [0] * 4
    for index, size in steps:
        decoder = decoders[index]
        if decoder in gone:
            continue
        order, already = list(budget.holders), len(gone)
        try:
            decoder.feed(stream[sent[index]:sent[index] + size])
        except OverBudget:
            assert decoder in order  # (a record's first bytes always fit)
            assert gone[already:] == order[:order.index(decoder)]  # then it was the oldest
            gone.append(decoder)
        else:
            assert gone[already:] == order[:len(gone) - already]  # the oldest went
        sent[index] += size
        assert budget.held - before == sum(d._charged for d in decoders) <= 10_000
        assert set(budget.holders) == {d for d in decoders if d._charged}
    for decoder in decoders:
        decoder.release()
    assert budget.held == before


def test_a_connection_lost_gives_back_its_unfinished_record_at_once() -> None:
    """``FramedProtocol.connectionLost`` releases the decoder: no wait for
    the garbage collector to free a protocol in a reference cycle."""
    from mdp.transport.framed import FramedProtocol

    connection = FramedProtocol()
    connection.decoder = RecordDecoder(Limits())
    connection.decoder.feed(encode_record([b"x" * 100])[:50])
    before = framing.BUFFERED.held
    connection.dropped = True  # (no warning: no transport to name)
    connection.connectionLost()
    assert framing.BUFFERED.held == before - 46


# --- a process holding unfinished records against a broker process ----------

BUDGET = 12 * MiB
RECORD = 2 * MiB
ATTACKERS = 20


@pytest_twisted.ensureDeferred
async def test_unfinished_records_over_the_budget_are_refused_and_memory_comes_back() -> None:
    """20 connections each start a 2 MiB record and stop a byte short; the
    broker's budget is 12 MiB: at most 6 stay open, the rest are closed with
    the reason logged, a client still gets replies, and once the attacker
    closes its connections the broker's RSS comes back to where it was."""
    broker = Process(reactor(), python("-m", "tests.stream_peers", "broker", str(BUDGET)), ENV)
    attacker: Optional[Process] = None
    client: Optional[Client] = None
    try:
        port = int((await broker.waitFor(r"listening on (\d+)", timeout=30)).group(1))
        pid = broker.transport.pid
        client = Client(f"tcp:host=127.0.0.1:port={port}", reactor(), timeout=10, retries=1)
        assert await bounded(client.request("echo", "warm"), 15) == [b"warm"]
        base = rss(pid)
        attacker = Process(reactor(), python("-m", "tests.stream_peers", "127.0.0.1", str(port),
                                             str(ATTACKERS), str(RECORD)), ENV)
        await attacker.waitFor(r"sent \d+", timeout=30)
        held: list[int] = []

        async def count() -> int:
            attacker.transport.write(b"count\n")
            seen = attacker.output.count(b"held ")
            await wait_until(lambda: attacker.output.count(b"held ") > seen, 10)
            return int(attacker.output.rsplit(b"held ", 1)[1].split()[0])

        # (the broker may still be reading the last ones)
        deadline = reactor().seconds() + 10
        while not held or held[-1] > BUDGET // RECORD and reactor().seconds() < deadline:
            held.append(await count())
        assert held[-1] <= BUDGET // RECORD, held
        assert b"unfinished records already hold" in broker.output
        during = rss(pid)
        assert await bounded(client.request("echo", "still", "here"), 15) == [b"still", b"here"]
        assert during > base + BUDGET // 2, (base, during)  # it did hold them
        attacker.transport.write(b"close\n")
        await attacker.waitFor("closed", timeout=10)
        # the broker lets go of what they held (RSS back within 4 MiB)
        await wait_until(lambda: rss(pid) < base + 4 * MiB, 10, step=0.05)
        print(f"\nbroker RSS base {base / MiB:.0f} MiB, under attack {during / MiB:.0f} MiB, "
              f"after {rss(pid) / MiB:.0f} MiB; {held[-1]} of {ATTACKERS} records held")
        assert await bounded(client.request("echo", "after"), 15) == [b"after"]
    finally:
        if client is not None:
            await client.close()
        if attacker is not None:
            await attacker.stop()
        await broker.stop()


def _all_read(port: int) -> bool:
    """Nothing is in flight to the listener on *port* of 127.0.0.1, nor
    waits to be read by it (``/proc/net/tcp``: tx and rx queues)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in list(table)[1:]]
    mine = f":{port:04X}"
    return all(int(row[4].split(":")[row[1].endswith(mine)], 16) == 0
               for row in rows if row[1].endswith(mine) or row[2].endswith(mine))


@pytest_twisted.ensureDeferred
async def test_a_record_held_open_does_not_make_a_large_request_fail() -> None:
    """A peer keeps a record of nearly the whole budget (2 MiB) unfinished: a
    client's 300 KB request (it spans reads, in and out through the broker)
    is still answered, and the holder's connection is the one closed."""
    broker = Process(reactor(), python("-m", "tests.stream_peers", "broker", str(2 * MiB)), ENV)
    attacker: Optional[Process] = None
    client: Optional[Client] = None
    try:
        port = int((await broker.waitFor(r"listening on (\d+)", timeout=30)).group(1))
        client = Client(f"tcp:host=127.0.0.1:port={port}", reactor(), timeout=10, retries=1)
        assert await bounded(client.request("echo", "warm"), 15) == [b"warm"]
        size = 2 * MiB - 50_000
        attacker = Process(reactor(), python("-m", "tests.stream_peers", "127.0.0.1", str(port),
                                             "1", str(size)), ENV)
        await attacker.waitFor(r"sent 1", timeout=30)
        await wait_until(lambda: _all_read(port), 10)  # the broker holds all of it
        body = b"b" * 300_000
        assert await bounded(client.request("echo", body), 15) == [body]
        assert b"the oldest, of" in broker.output
        attacker.transport.write(b"count\n")
        await attacker.waitFor(r"held 0", timeout=10)
    finally:
        if client is not None:
            await client.close()
        if attacker is not None:
            await attacker.stop()
        await broker.stop()
