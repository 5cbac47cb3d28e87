"""The stream framing (:mod:`mdp.transport.framing`): pure, no I/O."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.errors import ProtocolError, RecordTooLarge
from mdp.policy import Limits
from mdp.transport.framing import RecordDecoder, decode_record, encode_record

messages = st.lists(st.lists(st.binary(max_size=40), max_size=6), min_size=1, max_size=8)


@given(messages, st.lists(st.integers(1, 50), max_size=30))
@settings(max_examples=300, deadline=None)
def test_any_split_of_the_stream_gives_back_the_messages(msgs: list[list[bytes]],
                                                         cuts: list[int]) -> None:
    stream = b"".join(encode_record(m) for m in msgs)
    decoder = RecordDecoder()
    out: list[list[bytes]] = []
    pos = 0
    for cut in cuts:
        out += decoder.feed(stream[pos:pos + cut])
        pos += cut
    out += decoder.feed(stream[pos:])
    assert out == msgs
    assert not decoder.inRecord and decoder.buffered == 0


def test_wire_form() -> None:
    assert encode_record([b"MDPC02", b"\x01"]) == bytes.fromhex("0000000f 00000006") + b"MDPC02" + \
        bytes.fromhex("00000001 01")
    assert decode_record(encode_record([b"", b"x"])[4:]) == [b"", b"x"]


def test_a_record_over_the_limit_is_refused_from_its_header() -> None:
    limits = Limits(maxMessageBytes=1000, maxFrames=10)
    decoder = RecordDecoder(limits)
    with pytest.raises(RecordTooLarge):
        decoder.feed(struct.pack(">I", 1000 + 4 * 10 + 1))  # nothing of the payload yet
    assert decoder.buffered == 0
    # exactly at the limit is fine
    ok = RecordDecoder(limits)
    assert ok.feed(encode_record([b"x" * 1000])) == [[b"x" * 1000]]


def test_the_messages_before_a_refused_record_go_with_the_error() -> None:
    """One read holds whole messages, then one over the limits: the error
    carries them, to be delivered before the connection ends (they were
    lost with it)."""
    limits = Limits(maxMessageBytes=1000, maxFrames=10)
    data = encode_record([b"a"]) + encode_record([b"b", b"c"]) + encode_record([b"x" * 2000])
    with pytest.raises(RecordTooLarge) as refused:
        RecordDecoder(limits).feed(data)
    assert refused.value.decoded == [[b"a"], [b"b", b"c"]]
    with pytest.raises(ProtocolError) as malformed:  # the same for a malformed one
        RecordDecoder(limits).feed(encode_record([b"a"]) + struct.pack(">II", 8, 9) + b"12345678")
    assert malformed.value.decoded == [[b"a"]]


def test_frames_beyond_the_limit_stop_decoding() -> None:
    limits = Limits(maxMessageBytes=1 << 20, maxFrames=100)
    assert RecordDecoder(limits).feed(encode_record([b""] * 100)) == [[b""] * 100]
    # a record that fits in bytes but holds many empty frames
    payload = struct.pack(">I", 0) * 200
    with pytest.raises(RecordTooLarge, match="more than 100 frames"):
        RecordDecoder(limits).feed(struct.pack(">I", len(payload)) + payload)


def test_frame_bytes_beyond_the_limit_are_refused() -> None:
    limits = Limits(maxMessageBytes=100, maxFrames=100)
    record = encode_record([b"x" * 60, b"y" * 60])  # 128 bytes of payload: within the record bound
    with pytest.raises(RecordTooLarge, match="120 bytes of frames"):
        RecordDecoder(limits).feed(record)


def test_inconsistent_frame_lengths_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="overruns"):
        RecordDecoder().feed(struct.pack(">II", 8, 100) + b"abcd")


def test_a_trickled_record_costs_memory_in_proportion_to_its_bytes() -> None:
    """A record arriving a byte at a time is held in one buffer of about its
    size (not a piece per read, nor a re-joined copy per read; the benchmark
    in benchmarks/framing.py shows the time it takes stays linear)."""
    import sys

    record = encode_record([b"z" * 20_000])
    decoder = RecordDecoder()
    for i in range(len(record) - 1):
        assert decoder.feed(record[i:i + 1]) == []
    assert decoder.inRecord and decoder.buffered == len(record) - 4 - 1
    assert sys.getsizeof(decoder._buf) < 2 * decoder.buffered + 1024
    assert decoder.feed(record[-1:]) == [[b"z" * 20_000]]
    assert decoder.buffered == 0 and decoder.records == 1


@given(st.binary(max_size=300), st.lists(st.integers(1, 40), max_size=20))
@settings(max_examples=500, deadline=None)
def test_garbage_gives_messages_or_a_protocol_error_and_nothing_else(data: bytes,
                                                                      cuts: list[int]) -> None:
    decoder = RecordDecoder(Limits(maxMessageBytes=256, maxFrames=8))
    pos = 0
    try:
        for cut in [*cuts, len(data)]:
            for message in decoder.feed(data[pos:pos + cut]):
                assert len(message) <= 8 and sum(map(len, message)) <= 256
            pos += cut
    except ProtocolError:
        pass
    assert decoder.buffered <= 256 + 4 * 8 + 4


# --- the identity greeting ------------------------------------------------------

def test_greeting_announces_an_identity_in_any_pieces() -> None:
    from mdp.transport.framing import RECORDS

    wire = RECORDS.greeting(b"session-7") + encode_record([b"a", b""]) + encode_record([b"b"])
    for cut in range(1, len(wire)):
        decoder = RecordDecoder()
        out = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert out == [[b"a", b""], [b"b"]]
        assert decoder.identity == b"session-7"


def test_no_greeting_without_an_identity() -> None:
    from mdp.transport.framing import RECORDS

    assert RECORDS.greeting(None) == b""
    decoder = RecordDecoder()
    assert decoder.feed(encode_record([b"x"])) == [[b"x"]]
    assert decoder.identity is None


def test_a_greeting_with_a_reserved_identity_is_refused() -> None:
    from mdp.errors import ProtocolError

    identity = b"\x00router-made"
    with pytest.raises(ProtocolError, match="identity"):
        RecordDecoder().feed(b"\xff\xff\xff\xff" + bytes([len(identity)]) + identity)


def _on(channel: int, frames: list[bytes]) -> bytes:
    return channel.to_bytes(4, "big") + encode_record(frames)


@given(st.lists(st.tuples(st.integers(1, 2**32 - 1),
                          st.lists(st.binary(max_size=40), max_size=4)), max_size=8),
       st.lists(st.integers(1, 30), max_size=20))
def test_a_greeting_with_no_identity_starts_channels_whatever_the_pieces(
        records: list[tuple[int, list[bytes]]], cuts: list[int]) -> None:
    """After the channels greeting every record names its channel before its
    length; an empty record (a channel ended) is a message of no frames."""
    from mdp.transport.framing import CHANNELS_GREETING

    stream = CHANNELS_GREETING + b"".join(_on(c, frames) for c, frames in records)
    decoder = RecordDecoder()
    got: list[object] = []
    pos = 0
    for cut in [*cuts, len(stream)]:
        got += decoder.feed(stream[pos:pos + cut])
        pos += cut
    got += decoder.feed(stream[pos:])
    assert decoder.channels and decoder.identity is None
    assert got == [(c.to_bytes(4, "big"), frames) for c, frames in records]
    assert not decoder.inRecord


@pytest.mark.parametrize("split", [False, True])
def test_an_oversized_record_on_a_channel_says_which_channel(split: bool) -> None:
    decoder = RecordDecoder(Limits(maxMessageBytes=64))
    decoder.channels = True
    ok, big = _on(1, [b"a"]), _on(7, [b"x" * 65])
    with pytest.raises(RecordTooLarge) as caught:
        if split:  # the header of the oversized record in two pieces
            decoder.feed(ok + big[:6])
            decoder.feed(big[6:])
        else:
            decoder.feed(ok + big)
    assert caught.value.channel == (7).to_bytes(4, "big")


def test_a_decoder_expecting_channels_takes_no_greeting() -> None:
    """The connecting side's decoder expects channels from the first byte:
    a record announcing 0xFFFFFFFF bytes is oversized, not a greeting."""
    decoder = RecordDecoder()
    decoder.channels = True
    with pytest.raises(RecordTooLarge):
        decoder.feed(b"\x00\x00\x00\x01\xff\xff\xff\xff\x00")


def test_a_greeting_after_the_first_record_is_an_oversized_record() -> None:
    decoder = RecordDecoder()
    decoder.feed(encode_record([b"first"]))
    with pytest.raises(RecordTooLarge):
        decoder.feed(b"\xff\xff\xff\xff\x02me")
