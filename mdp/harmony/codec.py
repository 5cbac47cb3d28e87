"""ZRE v2 (ZeroMQ RFC 36), byte for byte: the peer messages and the 22-byte UDP beacon
(docs/harmony.md, "The wire").  Strings that are not valid UTF-8 are read with U+FFFD for
the bad bytes: zeromq-pyre cuts a non-ASCII string to its length in characters."""


from __future__ import annotations

import struct
from typing import Any, Callable, Mapping, Sequence, Union
from uuid import UUID

import attrs

from mdp.errors import ProtocolError
from mdp.machine import action_type

SIGNATURE = 0xAAA1
VERSION = 2

# the command ids ZRE puts on the wire
HELLO, WHISPER, SHOUT, JOIN, LEAVE, PING, PING_OK = 1, 2, 3, 4, 5, 6, 7
COMMANDS = {HELLO: "HELLO", WHISPER: "WHISPER", SHOUT: "SHOUT", JOIN: "JOIN", LEAVE: "LEAVE",
            PING: "PING", PING_OK: "PING-OK"}

SEQUENCE_MODULUS = 65535  # a sender counts 1, 2, ... 65534, then 0 again (as zeromq-pyre does)

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


def _message(id: int, name: str, *fields: str, **defaults: Any) -> Any:
    """A frozen message class: *sequence*, then *fields*; ``id`` is its message id."""
    kind = action_type(__name__, name, "sequence", *fields, frozen=True, **defaults)
    kind.id = id
    return kind


#: greets a peer so it connects back to us: the Harmony pattern's OHAI
Hello = _message(HELLO, "Hello", "endpoint", "groups", "status", "name", headers=attrs.Factory(dict))
Whisper = _message(WHISPER, "Whisper", content=())
Shout = _message(SHOUT, "Shout", "group", content=())
Join = _message(JOIN, "Join", "group", "status")
Leave = _message(LEAVE, "Leave", "group", "status")
Ping = _message(PING, "Ping")
PingOk = _message(PING_OK, "PingOk")

Message = Union[Hello, Whisper, Shout, Join, Leave, Ping, PingOk]

_HEADER = struct.Struct(">HBBH")


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


def _groups(groups: Sequence[str], what: str) -> bytes:
    return struct.pack(">I", len(groups)) + b"".join(_long_string(g) for g in groups)


def _headers(headers: Mapping[str, str], what: str) -> bytes:
    return struct.pack(">I", len(headers)) + b"".join(
        _string(key, "header name") + _long_string(value) for key, value in headers.items())


#: how each field is written and read; on the wire in the class's order (``content``: in later frames)
_FIELDS: dict[str, tuple[Callable[[Any, str], bytes], str]] = {
    "endpoint": (_string, "string"), "name": (_string, "string"), "group": (_string, "string"),
    "groups": (_groups, "groups"), "headers": (_headers, "headers"),
    "status": (lambda status, what: bytes((status & 0xFF,)), "u8")}
_MESSAGES = {kind.id: (kind, [f.name for f in attrs.fields(kind)[1:] if f.name != "content"])
             for kind in (Hello, Whisper, Shout, Join, Leave, Ping, PingOk)}


def encode(message: Message) -> list[bytes]:
    """The frames of *message*: the ZRE frame, then any content frames."""
    parts = [_FIELDS[name][0](getattr(message, name), name) for name in _MESSAGES[message.id][1]]
    header = _HEADER.pack(SIGNATURE, message.id, VERSION, message.sequence & 0xFFFF)
    return [b"".join([header, *parts]), *getattr(message, "content", ())]


class _Reader:
    """Reads the fields of one frame, in order."""

    def __init__(self, data: bytes, maxGroups: int, maxHeaders: int) -> None:
        self.data, self.at = data, 0
        self.maxGroups, self.maxHeaders = maxGroups, maxHeaders

    def take(self, size: int, what: str) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise MalformedZre(f"{what} runs past the end of the frame "
                               f"({size} bytes at offset {self.at} of {len(self.data)})")
        chunk, self.at = self.data[self.at:end], end
        return chunk

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def string(self, what: str, size: int = 1) -> str:
        """A string after its length in *size* bytes (4: a long string)."""
        return self.take(self.uint(size, what), what).decode("utf-8", "replace")

    def count(self, what: str, smallest: int, most: int) -> int:
        """A u32 count of items of at least *smallest* bytes, checked against what is left and *most*."""
        number = self.uint(4, what)
        if number * smallest > len(self.data) - self.at:
            raise MalformedZre(f"{what}: {number} items cannot fit in the "
                               f"{len(self.data) - self.at} bytes left")
        if number > most:
            raise MalformedZre(f"{what}: {number} items, more than the {most} allowed")
        return number

    def groups(self, what: str) -> tuple[str, ...]:
        return tuple(self.string("group", 4) for _ in range(self.count(what, 4, self.maxGroups)))

    def headers(self, what: str) -> dict[str, str]:
        return {self.string("header name"): self.string("header value", 4)
                for _ in range(self.count(what, 5, self.maxHeaders))}

    def done(self) -> None:
        if self.at != len(self.data):
            raise MalformedZre(f"{len(self.data) - self.at} bytes after the last field")


def decode(frames: Sequence[bytes], *, maxGroups: int = DEFAULT_MAX_GROUPS,
           maxHeaders: int = DEFAULT_MAX_HEADERS) -> Message:
    """The message in *frames* (after the identity); :class:`MalformedZre` for anything else,
    or a HELLO with more than *maxGroups* groups or *maxHeaders* headers."""
    if not frames:
        raise MalformedZre("no frames")
    reader = _Reader(bytes(frames[0]), maxGroups, maxHeaders)
    signature = reader.uint(2, "signature")
    if signature != SIGNATURE:
        raise MalformedZre(f"signature 0x{signature:04X} is not 0x{SIGNATURE:04X}")
    command = reader.u8("message id")
    version = reader.u8("version")
    if version != VERSION:
        raise MalformedZre(f"version {version} is not {VERSION}")
    if command not in _MESSAGES:
        raise UnknownCommand(f"message id {command} is not a ZRE v2 command")
    kind, names = _MESSAGES[command]
    fields: dict[str, Any] = {"sequence": reader.uint(2, "sequence")}
    fields.update((name, getattr(reader, _FIELDS[name][1])(name)) for name in names)
    reader.done()
    content = tuple(bytes(f) for f in frames[1:])
    if command in (WHISPER, SHOUT):
        fields["content"] = content
    elif content:
        raise MalformedZre(f"{COMMANDS[command]} carries {len(content)} content frames")
    return kind(**fields)


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
