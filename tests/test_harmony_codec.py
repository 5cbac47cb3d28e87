"""ZRE v2 byte for byte: hand-built frames from RFC 36's layout, and the real
zeromq-pyre's encoder and decoder on the other side."""

from __future__ import annotations

import socket
import struct
import uuid
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from pyre.zre_msg import ZreMsg

from mdp.harmony import codec
from mdp.harmony.codec import MalformedZre, UnknownCommand


class FakeSocket:
    """Enough of a zmq socket for pyre's ZreMsg.send / ZreMsg.recv."""

    type = zmq.DEALER

    def __init__(self, frames: Any = ()) -> None:
        self.frames: list[bytes] = list(frames)

    def send(self, data: bytes, flags: int = 0) -> None:
        self.frames.append(data)

    def send_multipart(self, frames: list[bytes]) -> None:
        self.frames.extend(frames)

    def recv_multipart(self) -> list[bytes]:
        return list(self.frames)


def pyre_encode(message: ZreMsg) -> list[bytes]:
    out = FakeSocket()
    message.send(out)
    return out.frames


def pyre_decode(frames: list[bytes]) -> ZreMsg:
    message = ZreMsg()
    message.recv(FakeSocket(frames))
    return message


def test_hello_layout_from_the_rfc() -> None:
    hello = codec.Hello(1, "tcp://127.0.0.1:49152", ("chat", "ops"), 2, "alice", {"X-A": "1"})
    expected = (b"\xaa\xa1\x01\x02\x00\x01"
                + b"\x15tcp://127.0.0.1:49152"
                + b"\x00\x00\x00\x02" + b"\x00\x00\x00\x04chat" + b"\x00\x00\x00\x03ops"
                + b"\x02"
                + b"\x05alice"
                + b"\x00\x00\x00\x01" + b"\x03X-A" + b"\x00\x00\x00\x011")
    assert codec.encode(hello) == [expected]
    assert codec.decode([expected]) == hello


@pytest.mark.parametrize("message, frames", [
    (codec.Whisper(4, (b"a", b"")), [b"\xaa\xa1\x02\x02\x00\x04", b"a", b""]),
    (codec.Shout(0xFFFE, "chat", (b"hi",)), [b"\xaa\xa1\x03\x02\xff\xfe\x04chat", b"hi"]),
    (codec.Join(2, "chat", 1), [b"\xaa\xa1\x04\x02\x00\x02\x04chat\x01"]),
    (codec.Leave(3, "chat", 2), [b"\xaa\xa1\x05\x02\x00\x03\x04chat\x02"]),
    (codec.Ping(5), [b"\xaa\xa1\x06\x02\x00\x05"]),
    (codec.PingOk(0), [b"\xaa\xa1\x07\x02\x00\x00"]),
])
def test_each_command_byte_for_byte(message: codec.Message, frames: list[bytes]) -> None:
    assert codec.encode(message) == frames
    assert codec.decode(frames) == message


def _pyre_message(message: codec.Message) -> ZreMsg:
    """The same message built with pyre's own class."""
    theirs = ZreMsg(message.id)
    theirs.set_sequence(message.sequence)
    if isinstance(message, codec.Hello):
        theirs.set_endpoint(message.endpoint)
        theirs.set_groups(list(message.groups))
        theirs.set_status(message.status)
        theirs.set_name(message.name)
        theirs.set_headers(dict(message.headers))
    if isinstance(message, (codec.Shout, codec.Join, codec.Leave)):
        theirs.set_group(message.group)
    if isinstance(message, (codec.Join, codec.Leave)):
        theirs.set_status(message.status)
    if isinstance(message, (codec.Whisper, codec.Shout)):
        theirs.content = list(message.content)
    return theirs


ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
frames = st.tuples() | st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=3).map(tuple)
sequences = st.integers(0, 65535)
messages = st.one_of(
    st.builds(codec.Hello, sequences, ascii_text, st.lists(ascii_text, max_size=3).map(tuple),
              st.integers(0, 255), ascii_text, st.dictionaries(ascii_text, ascii_text, max_size=3)),
    st.builds(codec.Whisper, sequences, frames),
    st.builds(codec.Shout, sequences, ascii_text, frames),
    st.builds(codec.Join, sequences, ascii_text, st.integers(0, 255)),
    st.builds(codec.Leave, sequences, ascii_text, st.integers(0, 255)),
    st.builds(codec.Ping, sequences),
    st.builds(codec.PingOk, sequences),
)


@given(messages)
def test_pyre_writes_what_we_write_and_reads_it_back(message: codec.Message) -> None:
    ours = codec.encode(message)
    assert pyre_encode(_pyre_message(message)) == ours
    theirs = pyre_decode(ours)
    assert theirs.id == message.id and theirs.sequence == message.sequence
    assert codec.decode(ours) == message
    if isinstance(message, codec.Hello):
        assert (theirs.endpoint, list(theirs.groups), theirs.status, theirs.name, theirs.headers) \
            == (message.endpoint, list(message.groups), message.status, message.name,
                dict(message.headers))


@given(st.text(max_size=60))
def test_unicode_strings_round_trip_with_lengths_in_bytes(text: str) -> None:
    if len(text.encode()) > 255:
        with pytest.raises(ValueError, match="255 bytes"):
            codec.encode(codec.Join(1, text, 1))
        return
    assert codec.decode(codec.encode(codec.Shout(1, text, (b"x",)))).group == text
    hello = codec.Hello(1, "tcp://h:1", (text * 5,), 0, text, {"k": text * 9})
    assert codec.decode(codec.encode(hello)) == hello


def test_pyres_cut_non_ascii_strings_are_read_not_refused() -> None:
    """pyre writes a string's length in characters and cuts its UTF-8 bytes to
    that: "aé" goes out as 2 bytes, the second half a character."""
    cut = pyre_encode(_pyre_message(codec.Join(3, "aé", 4)))
    assert cut == [b"\xaa\xa1\x04\x02\x00\x03\x02a\xc3\x04"]
    assert codec.decode(cut) == codec.Join(3, "a\ufffd", 4)
    hello = pyre_encode(_pyre_message(codec.Hello(1, "tcp://h:1", ("ça va",), 0, "José", {})))
    decoded = codec.decode(hello)
    assert isinstance(decoded, codec.Hello) and decoded.name == "Jos\ufffd"


@pytest.mark.parametrize("frames, reason", [
    ([], "no frames"),
    ([b""], "signature runs past"),
    ([b"\xaa\xa0\x01\x02\x00\x01"], "signature 0xAAA0"),
    ([b"\xaa\xa1\x06\x03\x00\x01"], "version 3"),
    ([b"\xaa\xa1\x06\x02\x00"], "sequence runs past"),
    ([b"\xaa\xa1\x06\x02\x00\x01\x00"], "1 bytes after"),
    ([b"\xaa\xa1\x04\x02\x00\x01\x09chat\x01"], "group runs past"),
    ([b"\xaa\xa1\x06\x02\x00\x01", b"extra"], "PING carries 1 content"),
    ([b"\xaa\xa1\x01\x02\x00\x01\x00\xff\xff\xff\xff"], "cannot fit"),
])
def test_malformed_messages_are_refused_with_the_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(MalformedZre, match=reason):
        codec.decode(frames)


def test_an_unknown_command_is_its_own_error() -> None:
    with pytest.raises(UnknownCommand, match="message id 8"):
        codec.decode([b"\xaa\xa1\x08\x02\x00\x01"])


@given(st.lists(st.binary(max_size=40), max_size=3))
def test_any_bytes_decode_or_raise_malformed_only(data: list[bytes]) -> None:
    try:
        codec.decode(data)
    except MalformedZre:
        pass


@given(st.binary(max_size=30).map(lambda b: b"\xaa\xa1" + b))
def test_bytes_after_a_good_signature_decode_or_raise_malformed_only(data: bytes) -> None:
    try:
        codec.decode([data, b"x"])
    except MalformedZre:
        pass


def test_beacon_is_22_bytes_as_pyre_packs_it() -> None:
    node = uuid.uuid4()
    beacon = codec.encode_beacon(node, 49152)
    assert len(beacon) == 22
    assert beacon == struct.pack("cccb16sH", b"Z", b"R", b"E", 1, node.bytes, socket.htons(49152))
    assert codec.decode_beacon(beacon) == (node, 49152)
    assert codec.decode_beacon(codec.encode_beacon(node, 0)) == (node, 0)


@pytest.mark.parametrize("data, reason", [
    (b"ZRE\x01" + bytes(17), "22 bytes, not 21"),
    (b"ZRE\x01" + bytes(19), "22 bytes, not 23"),
    (b"ZRE\x02" + bytes(18), "starts with"),
    (b"XRE\x01" + bytes(18), "starts with"),
])
def test_bad_beacons_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedZre, match=reason):
        codec.decode_beacon(data)


def test_sequence_numbers_wrap_as_pyre_counts_and_either_wrap_is_accepted() -> None:
    assert [codec.next_sequence(n) for n in (0, 1, 65533, 65534)] == [1, 2, 65534, 0]
    assert codec.next_sequence_ok(1, 2)
    assert not codec.next_sequence_ok(1, 3) and not codec.next_sequence_ok(2, 2)
    assert codec.next_sequence_ok(65534, 0)  # pyre
    assert codec.next_sequence_ok(65534, 65535) and codec.next_sequence_ok(65535, 0)  # 16 bits
