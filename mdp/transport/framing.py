"""Multi-frame messages as length-prefixed records on a byte stream, without I/O (``docs/transports.md``):
an optional greeting (an identity, or channels follow), then records of a length, then each frame's length
and bytes.  Records that span reads share one process-wide budget (:data:`BUFFERED`)."""

from __future__ import annotations

import struct
import time
import weakref
from typing import Any, Callable, Optional, Union

from zope.interface import implementer

from mdp import _compiled
from mdp.errors import ProtocolError, RecordTooLarge
from mdp.interfaces import IFraming, IStreamDecoder
from mdp.policy import Limits

_length = struct.Struct(">I")
_pack = _length.pack
_unpack_from = _length.unpack_from

Buffer = Union[bytes, bytearray, memoryview]

#: mdp.transport._records (the two functions below in C), or None
_inC: Any = _compiled.accelerator("mdp.transport._records")

#: Pieces of a frame at least this long are kept as views, shorter ones gathered in one buffer.
_PIECE_BYTES = 4096


class OverBudget(ProtocolError):
    """Unfinished stream records would pass ``Limits.maxBufferedBytes``: the oldest's connection closes."""


class InputBudget:
    """The bytes of unfinished stream records the process holds, charged as they come against
    ``limits.maxBufferedBytes``; past it the oldest are dropped (held records cannot starve those that
    flow).  After a MiB dropped, at most once a second, free heap pages go back (``malloc_trim``)."""

    def __init__(self) -> None:
        self.held = self.refused = self.dropped = 0
        #: the decoders holding an unfinished record, oldest record first
        self.holders: Any = weakref.WeakKeyDictionary()
        self._trim: Any = None
        self._trimmed = 0.0

    def charge(self, decoder: Any, size: int, limit: int) -> None:
        """Charge *size* more bytes to *decoder*'s record; past *limit*, drop the oldest (raise if this)."""
        holders = self.holders
        if not decoder._charged:
            if not size:
                return  # (a holder holds something: it is dropped for room)
            holders[decoder] = None
        while self.held + size > limit:
            oldest = next(iter(holders))
            why = OverBudget(f"unfinished records already hold {self.held} bytes in this process; "
                             f"{size} more would pass the limit of {limit} (max buffered bytes): "
                             f"the oldest, of {oldest._charged} bytes, is dropped")
            self.refused += 1
            if oldest is decoder:
                raise why
            oldest.evict(why)
        self.held += size
        decoder._charged += size

    def give(self, decoder: Any, dropped: bool) -> None:
        """*decoder*'s record completed, or went (*dropped*)."""
        size, decoder._charged = decoder._charged, 0
        self.holders.pop(decoder, None)
        self.held -= size
        if not dropped:
            return
        self.dropped += size
        now = time.monotonic()
        if self.dropped >= 1 << 20 and (now >= self._trimmed + 1.0 or not self.held):
            self.dropped = 0
            self._trimmed = now
            if self._trim is None:
                try:
                    import ctypes

                    self._trim = ctypes.CDLL(None).malloc_trim
                except (ImportError, OSError, AttributeError, TypeError):  # no glibc
                    self._trim = int
            self._trim(0)


BUFFERED = InputBudget()  #: The process's budget for unfinished stream records.


def encode_record(frames: list[bytes]) -> bytes:
    """One whole record (length prefix included) holding *frames*."""
    if _inC is not None:
        record = _inC.encode_record(frames)
        if record is not None:
            return record
    parts = [b""]
    for frame in frames:
        parts += (_pack(len(frame)), frame)
    parts[0] = _pack(sum(map(len, parts)))
    return b"".join(parts)


def decode_payload(buffer: Buffer, start: int, end: int, limits: Limits) -> list[bytes]:
    """Split the payload ``buffer[start:end]`` into frames."""
    if _inC is not None:
        decoded = _inC.decode_payload(buffer, start, end, limits.maxFrames, limits.maxMessageBytes)
        if decoded is not None:
            return decoded
    frames = []
    view = memoryview(buffer)
    offset = start
    maxFrames = limits.maxFrames
    while offset < end:
        if len(frames) == maxFrames:
            raise RecordTooLarge(f"record holds more than {maxFrames} frames")
        if end - offset < 4:
            raise ProtocolError("truncated frame length in stream record")
        (size,) = _unpack_from(buffer, offset)
        offset += 4
        if size > end - offset:
            raise ProtocolError(f"frame of {size} bytes overruns its record ({end - offset} left)")
        frames.append(bytes(view[offset:offset + size]))
        offset += size
    content = (end - start) - 4 * len(frames)
    if content > limits.maxMessageBytes:
        raise RecordTooLarge(
            f"record holds {content} bytes of frames, over the limit of {limits.maxMessageBytes}")
    return frames


def decode_record(payload: Buffer, limits: Limits = Limits()) -> list[bytes]:
    """Split one record's payload (without its length prefix) into frames."""
    return decode_payload(payload, 0, len(payload), limits)


GREETING_MARK = b"\xff\xff\xff\xff"
#: the greeting of a connection that carries channels (an empty identity)
CHANNELS_GREETING = GREETING_MARK + b"\x00"


def encode_greeting(identity: bytes) -> bytes:
    """The greeting that announces *identity*."""
    return GREETING_MARK + bytes([len(identity)]) + identity


class ChargedDecoder:
    """A stream decoder whose unfinished record is charged to :data:`BUFFERED`."""

    _charged = 0  # bytes of the record in progress charged to BUFFERED
    #: called with the :class:`OverBudget` when the budget drops this record
    onEvicted: Optional[Callable[[ProtocolError], None]] = None
    _clear: Callable[[], None]  # (the subclass's: let go of the record's buffers)

    def evict(self, why: OverBudget) -> None:
        """The budget drops the record in progress: the stream is unusable."""
        self.release()

        def refused(data: bytes) -> list[list[bytes]]:
            raise why

        self.feed = refused  # type: ignore[attr-defined]
        if self.onEvicted is not None:
            self.onEvicted(why)

    def release(self) -> None:
        """The connection is gone: give back the record in progress, its budget and its buffers."""
        if self._charged:
            BUFFERED.give(self, True)
        self._clear()

    def __del__(self) -> None:
        if self._charged:
            self.release()


@implementer(IStreamDecoder)
class RecordDecoder(ChargedDecoder):
    """Turns a byte stream into messages: :meth:`feed` returns those a piece completes, or raises
    :class:`~mdp.errors.ProtocolError` and the stream is unusable.  With :attr:`channels`, each message is a
    ``(channel, frames)`` pair (``frames`` empty: closed), and a ``RecordTooLarge`` has its ``channel``."""

    def __init__(self, limits: Limits = Limits(), channels: bool = False) -> None:
        self.limits = limits
        self.maxRecord = limits.maxMessageBytes + 4 * limits.maxFrames
        self.records = 0
        #: the first bytes of a length prefix (or a greeting) split across pieces
        self._header = b""
        self._length = 0  # the payload bytes of the record in progress
        self._need = -1  # those still to come; -1 between records
        self._frames: list[bytes] = []  # its complete frames
        self._fneed = -1  # bytes of the frame in progress still to come; -1 while its length is read
        #: the frame in progress: large pieces as views, small ones in ``_buf``
        self._pieces: list[Buffer] = []
        self._buf = bytearray()
        self.identity: Optional[bytes] = None  #: the identity the peer's greeting announced, if any
        self.channels = channels
        self._channel = b""  # the channel of the record in progress

    @property
    def inRecord(self) -> bool:
        """A record has begun and is not complete."""
        return self._need >= 0 or bool(self._header)

    @property
    def buffered(self) -> int:
        """Bytes held for the record in progress."""
        return (self._length - self._need if self._need >= 0 else 0) + len(self._header)

    def feed(self, data: bytes) -> list[list[bytes]]:
        messages: list[list[bytes]] = []
        if self._header:  # the last piece ended in a length prefix or a greeting
            data = self._header + data
            self._header = b""
        pos = 0
        end = len(data)
        try:
            while pos < end:
                if self._need < 0:
                    channels = self.channels
                    if end - pos < (8 if channels else 4):
                        self._header = bytes(data[pos:])
                        break
                    if channels:
                        self._channel = data[pos:pos + 4]
                        pos += 4
                    (length,) = _unpack_from(data, pos)
                    pos += 4
                    if (length == 0xFFFFFFFF and self.records == 0 and self.identity is None
                            and not channels):
                        # the greeting: the identity's length, then the identity (none: channels follow)
                        if pos >= end or pos + 1 + data[pos] > end:
                            self._header = bytes(data[pos - 4:])
                            break
                        identity = bytes(data[pos + 1:pos + 1 + data[pos]])
                        if identity[:1] == b"\x00":
                            raise ProtocolError("greeting announces an identity starting with a "
                                                "zero byte (those are the router's own)")
                        self.identity = identity or None
                        self.channels = self.identity is None
                        pos += 1 + len(identity)
                        continue
                    if length > self.maxRecord:
                        limits = self.limits
                        raise RecordTooLarge(
                            f"record of {length} bytes announced, over the limit of {self.maxRecord} "
                            f"({limits.maxMessageBytes} bytes in at most {limits.maxFrames} frames)")
                    if end - pos >= length:  # all here: decode in place
                        frames = decode_payload(data, pos, pos + length, self.limits)
                        messages.append((self._channel, frames) if channels else frames)
                        pos += length
                        self.records += 1
                        continue
                    self._need = self._length = length
                # a record that spans pieces: frame by frame, each copied once
                pos = self._feedRecord(data, pos, end)
                if self._need == 0:
                    frames = self._completed()
                    messages.append((self._channel, frames) if self.channels else frames)
        except ProtocolError as e:
            self.release()  # the stream is unusable
            if self.channels and isinstance(e, RecordTooLarge):
                e.channel = self._channel
            # the whole messages before it, to deliver before the connection ends
            e.decoded = messages
            raise
        return messages

    def _clear(self) -> None:
        self._frames = []
        self._pieces = []
        self._buf = bytearray()

    def _feedRecord(self, data: bytes, pos: int, end: int) -> int:
        """Take the record in progress from *pos*; where it ends.  What it keeps
        for a later read is charged to :data:`BUFFERED`."""
        start = pos
        frames = self._frames
        while pos < end and self._need > 0:
            if self._fneed < 0:  # a frame's length
                if len(frames) == self.limits.maxFrames:
                    raise RecordTooLarge(f"record holds more than {self.limits.maxFrames} frames")
                if self._need < 4:
                    raise ProtocolError("truncated frame length in stream record")
                if end - pos < 4:  # read again in front of the next piece (not charged: it
                    self._header = bytes(data[pos:end])  # comes back in that piece's bytes)
                    start += end - pos
                    pos = end
                    break
                (size,) = _unpack_from(data, pos)
                pos += 4
                self._need -= 4
                if size > self._need:
                    raise ProtocolError(f"frame of {size} bytes overruns its record ({self._need} left)")
                if size == 0:
                    frames.append(b"")
                else:
                    self._fneed = size
                continue
            take = min(self._fneed, end - pos)
            if take == self._fneed and not self._pieces and not self._buf:
                # the whole frame is in this piece: one copy, or none (all of a bytes piece)
                frames.append(bytes(data[pos:pos + take]))
            elif take >= _PIECE_BYTES:
                if self._buf:
                    self._pieces.append(self._buf)
                    self._buf = bytearray()
                self._pieces.append(memoryview(data)[pos:pos + take])
            else:
                self._buf += memoryview(data)[pos:pos + take]
            pos += take
            self._need -= take
            self._fneed -= take
            if not self._fneed:
                if self._pieces or self._buf:
                    self._pieces.append(self._buf)
                    frames.append(b"".join(self._pieces))
                    self._pieces = []
                    self._buf = bytearray()
                self._fneed = -1
        if self._need:
            BUFFERED.charge(self, pos - start, self.limits.maxBufferedBytes)
        return pos

    def _completed(self) -> list[bytes]:
        BUFFERED.give(self, False)
        frames, self._frames = self._frames, []
        content = self._length - 4 * len(frames)
        self._need = -1
        if content > self.limits.maxMessageBytes:
            raise RecordTooLarge(
                f"record holds {content} bytes of frames, over the limit of "
                f"{self.limits.maxMessageBytes}")
        self.records += 1
        return frames


@implementer(IFraming)
class LengthPrefixedFraming:
    """32-bit length-prefixed multipart records, with the optional greeting; with *channels*, of a
    connection that carries channels (which its greeting announces)."""

    acceptsBuffers = True
    encode = staticmethod(encode_record)

    def __init__(self, channels: bool = False) -> None:
        self.channels = channels
        self.name = "records32-channels" if channels else "records32"

    def greeting(self, identity: Optional[bytes]) -> bytes:
        if self.channels:
            return CHANNELS_GREETING
        return encode_greeting(identity) if identity else b""

    def decoder(self, limits: Limits) -> RecordDecoder:
        return RecordDecoder(limits, self.channels)


RECORDS = LengthPrefixedFraming()  #: The framing stream endpoints (``tcp:``, ``unix:``, ...) use.
