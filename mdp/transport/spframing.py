"""The scalability protocols' TCP mapping (nanomsg/nng) as a stream framing,
without I/O (``docs/sp.md``): each side sends an 8-byte header naming its
protocol, which must be the counterpart of ours, then messages of a 64-bit
length and a body, each delivered as one frame.  A bad header, or a message
over ``Limits.maxMessageBytes``, raises :class:`~mdp.errors.ProtocolError`."""

from __future__ import annotations

import struct
from typing import Optional

from zope.interface import implementer

from mdp.errors import ProtocolError, RecordTooLarge
from mdp.interfaces import IFraming, IStreamDecoder
from mdp.policy import Limits

#: Protocol numbers, as nng uses them on the wire.
REQ = 0x30
REP = 0x31
#: Who may talk to whom.
COUNTERPART = {REQ: REP, REP: REQ}
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
    """One message on the wire."""
    return _length.pack(len(body)) + body


@implementer(IStreamDecoder)
class SPDecoder:
    """The peer's header, then its messages, each as ``[body]``."""

    identity = None
    channels = False

    def __init__(self, expected: int, limits: Limits = Limits()) -> None:
        self.expected = expected
        self.limits = limits
        self.records = 0
        self._header = bytearray()
        self._headerDone = False
        self._length = bytearray()
        self._need = -1
        self._buf = bytearray()

    @property
    def inRecord(self) -> bool:
        return not self._headerDone or self._need >= 0 or bool(self._length)

    @property
    def handshaken(self) -> bool:  # the peer's header came, and is our counterpart's
        return self._headerDone

    @property
    def buffered(self) -> int:
        return len(self._buf) + len(self._length) + len(self._header)

    def feed(self, data: bytes) -> list[list[bytes]]:
        messages: list[list[bytes]] = []
        pos, end = 0, len(data)
        if not self._headerDone:
            take = min(HEADER_SIZE - len(self._header), end)
            self._header += data[:take]
            pos = take
            if len(self._header) < HEADER_SIZE:
                if self._header[:4] != MAGIC[:len(self._header[:4])]:
                    check_header(bytes(self._header) + b"\x00" * 8, self.expected)
                return messages
            check_header(bytes(self._header), self.expected)
            self._headerDone = True
        view = memoryview(data)
        while pos < end:
            if self._need < 0:
                take = min(8 - len(self._length), end - pos)
                self._length += data[pos:pos + take]
                pos += take
                if len(self._length) < 8:
                    break
                (length,) = _length.unpack(self._length)
                self._length = bytearray()
                if length > self.limits.maxMessageBytes:
                    raise RecordTooLarge(f"SP message of {length} bytes announced, over the "
                                         f"limit of {self.limits.maxMessageBytes}")
                self._need = length
            take = min(self._need - len(self._buf), end - pos)
            self._buf += view[pos:pos + take]
            pos += take
            if len(self._buf) == self._need:
                messages.append([bytes(self._buf)])
                self._buf = bytearray()
                self._need = -1
                self.records += 1
        return messages


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
