"""ZRE v2 (ZeroMQ RFC 36), byte for byte: the peer messages and the 22-byte UDP
beacon (docs/harmony.md, "The wire").

Strings that are not valid UTF-8 are read with U+FFFD for the bad bytes:
zeromq-pyre cuts a non-ASCII string to its length in characters.
"""

from __future__ import annotations

import struct
from typing import Callable, Mapping, Sequence, Union
from uuid import UUID

import attrs

from mdp.errors import ProtocolError

SIGNATURE = 0xAAA1
VERSION = 2

HELLO = 1
WHISPER = 2
SHOUT = 3
JOIN = 4
LEAVE = 5
PING = 6
PING_OK = 7

COMMANDS = {HELLO: "HELLO", WHISPER: "WHISPER", SHOUT: "SHOUT", JOIN: "JOIN", LEAVE: "LEAVE",
            PING: "PING", PING_OK: "PING-OK"}

#: A sender counts 1, 2, ... 65534, then 0 again (as zeromq-pyre does).
SEQUENCE_MODULUS = 65535

#: The most groups a peer may be in, and headers it may send: each costs far more than its bytes.
DEFAULT_MAX_GROUPS = 1024
DEFAULT_MAX_HEADERS = 1024

BEACON_PREFIX = b"ZRE\x01"
BEACON_SIZE = 22
DISCOVERY_PORT = 5670


class MalformedZre(ProtocolError):
    """A ZRE message or beacon that cannot be read."""


class UnknownCommand(MalformedZre):
    """A well-formed header with a message id ZRE v2 does not have."""


@attrs.frozen
class Hello:
    """Greets a peer so it connects back to us: the Harmony pattern's OHAI."""

    sequence: int
    endpoint: str
    groups: tuple[str, ...]
    status: int
    name: str
    headers: Mapping[str, str] = attrs.field(factory=dict)
    id = HELLO


@attrs.frozen
class Whisper:
    sequence: int
    content: tuple[bytes, ...] = ()
    id = WHISPER


@attrs.frozen
class Shout:
    sequence: int
    group: str
    content: tuple[bytes, ...] = ()
    id = SHOUT


@attrs.frozen
class Join:
    sequence: int
    group: str
    status: int
    id = JOIN


@attrs.frozen
class Leave:
    sequence: int
    group: str
    status: int
    id = LEAVE


@attrs.frozen
class Ping:
    sequence: int
    id = PING


@attrs.frozen
class PingOk:
    sequence: int
    id = PING_OK


Message = Union[Hello, Whisper, Shout, Join, Leave, Ping, PingOk]

_HEADER = struct.Struct(">HBBH")


def with_sequence(message: Message, sequence: int) -> Message:
    return attrs.evolve(message, sequence=sequence)


def next_sequence(sent: int) -> int:
    return (sent + 1) % SEQUENCE_MODULUS


def next_sequence_ok(previous: int, sequence: int) -> bool:
    """Whether *sequence* follows *previous*, wrapping as pyre (65534 → 0) or Zyre (→ 65535 → 0)."""
    return sequence == (previous + 1) & 0xFFFF or (previous == 65534 and sequence == 0)


def _string(value: str, what: str) -> bytes:
    data = value.encode("utf-8")
    if len(data) > 255:
        raise ValueError(f"a ZRE {what} is at most 255 bytes of UTF-8, got {len(data)}: {value[:40]!r}...")
    return bytes((len(data),)) + data


def _long_string(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack(">I", len(data)) + data


def check_string(value: object, what: str) -> str:
    """*value* if it is a ``str`` of at most 255 UTF-8 bytes; else ``TypeError``/``ValueError``."""
    if not isinstance(value, str):
        raise TypeError(f"a {what} is a str, not {type(value).__name__}: {value!r}")
    _string(value, what)
    return value


def encode(message: Message) -> list[bytes]:
    """The frames of *message*: the ZRE frame, then any content frames."""
    head = _HEADER.pack(SIGNATURE, message.id, VERSION, message.sequence & 0xFFFF)
    content: Sequence[bytes] = ()
    if isinstance(message, Hello):
        parts = [head, _string(message.endpoint, "endpoint"), struct.pack(">I", len(message.groups))]
        parts += [_long_string(g) for g in message.groups]
        parts.append(bytes((message.status & 0xFF,)))
        parts.append(_string(message.name, "name"))
        parts.append(struct.pack(">I", len(message.headers)))
        for key, value in message.headers.items():
            parts += [_string(key, "header name"), _long_string(value)]
        body = b"".join(parts)
    elif isinstance(message, Whisper):
        body, content = head, message.content
    elif isinstance(message, Shout):
        body, content = head + _string(message.group, "group"), message.content
    elif isinstance(message, (Join, Leave)):
        body = head + _string(message.group, "group") + bytes((message.status & 0xFF,))
    else:
        body = head
    return [body, *content]


class _Reader:
    """Reads the fields of one frame, in order."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int, what: str) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise MalformedZre(f"{what} runs past the end of the frame "
                               f"({size} bytes at offset {self.at} of {len(self.data)})")
        chunk = self.data[self.at:end]
        self.at = end
        return chunk

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return int.from_bytes(self.take(2, what), "big")

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "big")

    def string(self, what: str) -> str:
        return self.take(self.u8(what), what).decode("utf-8", "replace")

    def long_string(self, what: str) -> str:
        return self.take(self.u32(what), what).decode("utf-8", "replace")

    def count(self, what: str, smallest: int, most: int) -> int:
        """A u32 count of items of at least *smallest* bytes, checked against what
        is left and against *most*."""
        number = self.u32(what)
        if number * smallest > len(self.data) - self.at:
            raise MalformedZre(f"{what}: {number} items cannot fit in the "
                               f"{len(self.data) - self.at} bytes left")
        if number > most:
            raise MalformedZre(f"{what}: {number} items, more than the {most} allowed")
        return number

    def done(self) -> None:
        if self.at != len(self.data):
            raise MalformedZre(f"{len(self.data) - self.at} bytes after the last field")


def decode(frames: Sequence[bytes], *, maxGroups: int = DEFAULT_MAX_GROUPS,
           maxHeaders: int = DEFAULT_MAX_HEADERS) -> Message:
    """The message in *frames* (after the identity); :class:`MalformedZre` for anything
    else, or a HELLO with more than *maxGroups* groups or *maxHeaders* headers."""
    if not frames:
        raise MalformedZre("no frames")
    reader = _Reader(bytes(frames[0]))
    signature = reader.u16("signature")
    if signature != SIGNATURE:
        raise MalformedZre(f"signature 0x{signature:04X} is not 0x{SIGNATURE:04X}")
    command = reader.u8("message id")
    version = reader.u8("version")
    if version != VERSION:
        raise MalformedZre(f"version {version} is not {VERSION}")
    read = _READERS.get(command)
    if read is None:
        raise UnknownCommand(f"message id {command} is not a ZRE v2 command")
    sequence = reader.u16("sequence")
    content = tuple(bytes(f) for f in frames[1:])
    message = read(reader, sequence, content, maxGroups, maxHeaders)
    reader.done()
    if content and command not in (WHISPER, SHOUT):
        raise MalformedZre(f"{COMMANDS[command]} carries {len(content)} content frames")
    return message


def _read_hello(reader: _Reader, sequence: int, content: tuple[bytes, ...], maxGroups: int,
                maxHeaders: int) -> Hello:
    endpoint = reader.string("endpoint")
    groups = tuple(reader.long_string("group")
                   for _ in range(reader.count("groups", 4, maxGroups)))
    status = reader.u8("status")
    name = reader.string("name")
    headers = {reader.string("header name"): reader.long_string("header value")
               for _ in range(reader.count("headers", 5, maxHeaders))}
    return Hello(sequence, endpoint, groups, status, name, headers)


#: each command's reader: (reader, sequence, content, maxGroups, maxHeaders) → message
_READERS: dict[int, Callable[..., Message]] = {
    HELLO: _read_hello,
    WHISPER: lambda reader, sequence, content, *_: Whisper(sequence, content),
    SHOUT: lambda reader, sequence, content, *_: Shout(sequence, reader.string("group"), content),
    JOIN: lambda reader, sequence, *_: Join(sequence, reader.string("group"), reader.u8("status")),
    LEAVE: lambda reader, sequence, *_: Leave(sequence, reader.string("group"), reader.u8("status")),
    PING: lambda reader, sequence, *_: Ping(sequence),
    PING_OK: lambda reader, sequence, *_: PingOk(sequence),
}


def encode_beacon(uuid: UUID, port: int) -> bytes:
    """The 22-byte beacon announcing *uuid*'s ROUTER on *port* (0: leaving)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return BEACON_PREFIX + uuid.bytes + port.to_bytes(2, "big")


def decode_beacon(data: bytes) -> tuple[UUID, int]:
    """``(uuid, port)`` from a beacon; :class:`MalformedZre` for anything else."""
    if len(data) != BEACON_SIZE:
        raise MalformedZre(f"a beacon is {BEACON_SIZE} bytes, not {len(data)}")
    if not data.startswith(BEACON_PREFIX):
        raise MalformedZre(f"a beacon starts with {BEACON_PREFIX!r}, not {bytes(data[:4])!r}")
    return UUID(bytes=bytes(data[4:20])), int.from_bytes(data[20:22], "big")
