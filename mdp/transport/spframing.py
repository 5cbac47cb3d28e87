"""The scalability protocols' TCP mapping (nng) as a stream framing (``docs/sp.md``):
an 8-byte header naming the protocol, then messages of a 64-bit length and a body."""

from __future__ import annotations

import struct
from typing import Optional

from zope.interface import implementer

from mdp.errors import ProtocolError, RecordTooLarge
from mdp.interfaces import IFraming, IStreamDecoder
from mdp.policy import Limits
from mdp.transport import framing

#: Protocol numbers, as nng uses them on the wire.
REQ = 0x30
REP = 0x31
COUNTERPART = {REQ: REP, REP: REQ}  #: Who may talk to whom.
NAMES = {REQ: "REQ", REP: "REP"}

MAGIC = b"\x00SP\x00"
HEADER_SIZE = 8

_length = struct.Struct(">Q")


def header(protocol: int) -> bytes:
    """The 8 bytes a side of *protocol* sends first."""
    return MAGIC + struct.pack(">H", protocol) + b"\x00\x00"


def check_header(data: bytes, expected: int) -> None:
    """Refuse a peer header that is not ``expected``'s."""
    if data[:4] != MAGIC:
        raise ProtocolError(f"not an SP peer: header {bytes(data)!r} lacks the magic {MAGIC!r}")
    (protocol,) = struct.unpack(">H", data[4:6])
    if data[6:8] != b"\x00\x00":
        raise ProtocolError(f"SP header with non-zero reserved bytes {bytes(data[6:8])!r}")
    if protocol != expected:
        name = NAMES.get(protocol, f"0x{protocol:04x}")
        raise ProtocolError(f"SP peer speaks {name}, not {NAMES.get(expected, expected)}")


def encode_message(body: bytes) -> bytes:
    return _length.pack(len(body)) + body


@implementer(IStreamDecoder)
class SPDecoder(framing.ChargedDecoder):
    """The peer's header, then its messages, each as ``[body]``; one that
    spans reads is charged to ``Limits.maxBufferedBytes`` (``framing.BUFFERED``)."""

    identity = None
    channels = False

    def __init__(self, expected: int, limits: Limits = Limits()) -> None:
        self.expected = expected
        self.limits = limits
        self.records = 0
        self.handshaken = False  #: the peer's header came, and is our counterpart's
        self._buf = bytearray()

    @property
    def inRecord(self) -> bool:
        return not self.handshaken or bool(self._buf)

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[list[bytes]]:
        buf = self._buf
        buf += data
        if not self.handshaken:
            head = bytes(buf[:HEADER_SIZE])
            if len(head) < HEADER_SIZE:
                if not MAGIC.startswith(head[:4]):
                    check_header(head + bytes(HEADER_SIZE), self.expected)
                return []
            check_header(head, self.expected)
            self.handshaken = True
            del buf[:HEADER_SIZE]
        messages: list[list[bytes]] = []
        pos = 0
        with memoryview(buf) as view:
            while len(buf) - pos >= 8:
                (length,) = _length.unpack_from(buf, pos)
                if length > self.limits.maxMessageBytes:
                    error = RecordTooLarge(f"SP message of {length} bytes announced, over the "
                                           f"limit of {self.limits.maxMessageBytes}")
                    error.decoded = messages  # (delivered before the stream is refused)
                    raise error
                if len(buf) - pos - 8 < length:
                    break
                messages.append([bytes(view[pos + 8:pos + 8 + length])])
                pos += 8 + length
        del buf[:pos]
        self.records += len(messages)
        if len(buf) != self._charged:  # a message in progress, or one completed
            budget = framing.BUFFERED
            if len(buf) < self._charged:
                budget.give(self, False)
            try:  # (nothing, if nothing is left)
                budget.charge(self, len(buf) - self._charged, self.limits.maxBufferedBytes)
            except ProtocolError as e:
                self.release()
                e.decoded = messages  # type: ignore[attr-defined]
                raise
        return messages

    def _clear(self) -> None:
        self._buf = bytearray()


@implementer(IFraming)
class SPFraming:
    """The SP TCP mapping for a side speaking *protocol* (:data:`REQ`, :data:`REP`)."""

    def __init__(self, protocol: int) -> None:
        if protocol not in COUNTERPART:
            raise ValueError(f"protocol is REQ (0x30) or REP (0x31), not {protocol!r}")
        self.protocol = protocol
        self.name = f"sp-{NAMES[protocol].lower()}"

    def greeting(self, identity: Optional[bytes]) -> bytes:
        return header(self.protocol)

    def encode(self, frames: list[bytes]) -> bytes:
        if len(frames) != 1:
            raise ValueError(f"an SP message is one frame, not {len(frames)}")
        return encode_message(frames[0])

    def decoder(self, limits: Limits) -> SPDecoder:
        return SPDecoder(COUNTERPART[self.protocol], limits)
