"""SP REQ/REP's pure parts: the TCP mapping's framing (header checks, 64-bit
lengths, the size limit before buffering), backtraces, ids, nng URLs; and
the framing on a real TCP stream against pynng."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import threads
from zope.interface.verify import verifyObject

from mdp.errors import ProtocolError, RecordTooLarge, TransportError
from mdp.interfaces import IFraming, IStreamDecoder
from mdp.policy import Limits
from mdp.sp.codec import (
    BOTTOM,
    DEFAULT_MAX_HOPS,
    endpoint_of,
    id_sequence,
    pop_word,
    split_backtrace,
    word,
)
from mdp.transport.spframing import REP, REQ, SPFraming, encode_message, header

# --- the TCP mapping -------------------------------------------------------------------


def test_headers_are_nng_s() -> None:
    assert header(REQ) == b"\x00SP\x00\x00\x30\x00\x00"
    assert header(REP) == b"\x00SP\x00\x00\x31\x00\x00"
    assert encode_message(b"abc") == b"\x00" * 7 + b"\x03abc"
    framing = SPFraming(REP)
    verifyObject(IFraming, framing)
    verifyObject(IStreamDecoder, framing.decoder(Limits()))
    assert framing.greeting(None) == header(REP)
    with pytest.raises(ValueError):
        SPFraming(0x10)
    with pytest.raises(ValueError):
        framing.encode([b"a", b"b"])


@given(st.lists(st.binary(max_size=300), max_size=5), st.integers(1, 40))
def test_messages_come_out_whatever_the_pieces(bodies: list[bytes], piece: int) -> None:
    stream = header(REQ) + b"".join(encode_message(b) for b in bodies)
    decoder = SPFraming(REP).decoder(Limits())
    got = []
    for i in range(0, len(stream), piece):
        got += decoder.feed(stream[i:i + piece])
    assert got == [[b] for b in bodies] and not decoder.inRecord


@pytest.mark.parametrize("peer, says", [
    (b"\x00SQ\x00\x00\x30\x00\x00", "lacks the magic"),
    (b"HTTP/1.1", "lacks the magic"),
    (b"\x00SP\x00\x00\x31\x00\x00", "speaks REP, not REQ"),  # REP to REP
    (b"\x00SP\x00\x00\x10\x00\x00", "speaks 0x0010, not REQ"),  # PAIR
    (b"\x00SP\x00\x00\x30\x00\x01", "non-zero reserved"),
])
def test_a_wrong_header_is_refused(peer: bytes, says: str) -> None:
    decoder = SPFraming(REP).decoder(Limits())
    with pytest.raises(ProtocolError, match=says):
        decoder.feed(peer + encode_message(b"x"))


def test_a_wrong_magic_is_refused_from_its_first_bytes() -> None:
    decoder = SPFraming(REP).decoder(Limits())
    with pytest.raises(ProtocolError, match="magic"):
        decoder.feed(b"GE")


def test_an_oversized_message_is_refused_from_its_length() -> None:
    decoder = SPFraming(REP).decoder(Limits(maxMessageBytes=1024))
    decoder.feed(header(REQ) + encode_message(b"x" * 1024))
    with pytest.raises(RecordTooLarge, match="2\\^?|over the limit"):
        decoder.feed(struct.pack(">Q", 2 ** 40))
    assert decoder.buffered <= 8


def test_messages_before_an_oversized_one_in_the_same_piece_are_handed_over() -> None:
    decoder = SPFraming(REP).decoder(Limits(maxMessageBytes=1024))
    with pytest.raises(RecordTooLarge) as refused:
        decoder.feed(header(REQ) + encode_message(b"first") + struct.pack(">Q", 2 ** 40))
    assert refused.value.decoded == [[b"first"]]


# --- backtraces and ids -------------------------------------------------------------------


def test_a_backtrace_is_the_hops_and_the_request_id() -> None:
    request = word(7) + word(3) + word(BOTTOM | 42) + b"payload"
    assert split_backtrace(request) == (request[:12], b"payload")
    assert pop_word(word(BOTTOM | 42) + b"reply") == (BOTTOM | 42, b"reply")


def test_backtraces_without_a_bottom_or_over_the_hops_are_refused() -> None:
    with pytest.raises(ProtocolError, match="no bottom"):
        split_backtrace(word(1) + word(2))
    with pytest.raises(ProtocolError, match="no bottom"):
        split_backtrace(b"\x80\x00")
    # as nng: 7 hop words (8 hops with the last) pass, 8 do not
    hops = b"".join(word(n) for n in range(DEFAULT_MAX_HOPS - 1))
    assert split_backtrace(hops + word(BOTTOM) + b"x")[1] == b"x"
    with pytest.raises(ProtocolError, match="over 8 hops"):
        split_backtrace(hops + word(99) + word(BOTTOM) + b"x")
    with pytest.raises(ProtocolError):
        pop_word(b"abc")


def test_ids_count_up_and_wrap_in_31_bits() -> None:
    ids = id_sequence(0x7FFFFFFE)
    assert [next(ids) for _ in range(3)] == [0x7FFFFFFE, 0x7FFFFFFF, 0]
    assert next(id_sequence(0xFFFFFFFF)) == 0x7FFFFFFF


@pytest.mark.parametrize("url, listen, endpoint", [
    ("tcp://127.0.0.1:5555", False, "tcp:host=127.0.0.1:port=5555"),
    ("tcp://localhost:5555", False, "tcp:host=localhost:port=5555"),
    ("tcp://[::1]:5555", False, "tcp6:host=\\:\\:1:port=5555"),
    ("tcp://*:0", True, "tcp:0"),
    ("tcp://127.0.0.1:0", True, "tcp:0:interface=127.0.0.1"),
    ("tcp://[::1]:5555", True, "tcp6:5555:interface=\\:\\:1"),
    ("tcp:host=127.0.0.1:port=5555", False, "tcp:host=127.0.0.1:port=5555"),
])
def test_nng_urls_become_twisted_endpoints(url: str, listen: bool, endpoint: str) -> None:
    assert endpoint_of(url, listen) == endpoint


@pytest.mark.parametrize("url", ["ipc:///tmp/x", "tcp://127.0.0.1", "tcp://*:5555",
                                 "tcp://127.0.0.1:70000"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(TransportError):
        endpoint_of(url, listen=False)


# --- the framing against pynng ------------------------------------------------------------


class _Echo:
    """A bound receiver answering each SP request with its own bytes."""

    transport: Any = None

    def messageReceived(self, peer: bytes, frames: list[bytes]) -> None:
        backtrace, payload = split_backtrace(frames[0])
        self.transport.sendMessage(peer, [backtrace + payload.upper()])

    def peerDisconnected(self, peer: bytes) -> None:
        pass


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_pynng_req0_talks_to_the_framing_on_a_stream_router() -> None:
    import pynng
    from twisted.internet import endpoints, reactor

    from mdp.transport.stream import StreamRouter

    echo = _Echo()
    router = StreamRouter(echo, reactor, framing=SPFraming(REP))
    echo.transport = router
    port = await endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
        router.factory())
    address = f"tcp://127.0.0.1:{port.getHost().port}"

    def talk() -> list[bytes]:
        with pynng.Req0(dial=address, recv_timeout=10_000, send_timeout=10_000) as req:
            replies = []
            for text in (b"hello", b"sp"):
                req.send(text)
                replies.append(req.recv())
            return replies

    def wrong() -> bytes:
        with pynng.Rep0(recv_timeout=1500) as rep:  # REP to REP: refused
            rep.dial(address, block=False)
            try:
                return rep.recv()
            except pynng.Timeout:
                return b"nothing"

    try:
        assert await threads.deferToThread(talk) == [b"HELLO", b"SP"]
        assert await threads.deferToThread(wrong) == b"nothing"
    finally:
        await router.close()
        await port.stopListening()
