"""The session protocol's messages: frames in, typed commands out.

Every message starts with the protocol frame ``SESS01`` and a command frame;
numbers are 8-byte big-endian unsigned integers::

    HELLO      session id (16 bytes), ack, since  client → server: attach (again); *since*:
                                                 the last of its DATA it no longer holds
    WELCOME    ack, new                          server → client: attached; *new* 1 if the
                                                 server did not know the session (it
                                                 restarted): numbering starts afresh
    DATA       seq, ack, payload frames...       either way
    ACK        ack                               either way
    PING       ack                               client → server, when idle
    PING-OK    ack, sent                         server → client (*sent*: the last DATA
                                                 it numbered; the client should have it)
    UNKNOWN                                      server → client: no such session here,
                                                 or messages were lost (say HELLO)

*ack* is the sequence number of the last DATA received in order, so the
other side can forget what it holds for resending up to it; every message
carries it.  A session's DATA is numbered from 1 in each direction, and
numbers never go back, across any number of connections.
"""

from __future__ import annotations

from typing import Sequence, Union

import attrs

from mdp.errors import ProtocolError

PROTOCOL = b"SESS01"
SESSION_ID_BYTES = 16

HELLO = b"HELLO"
WELCOME = b"WELCOME"
DATA = b"DATA"
ACK = b"ACK"
PING = b"PING"
PING_OK = b"PING-OK"
UNKNOWN = b"UNKNOWN"


class MalformedSession(ProtocolError):
    """A message that is not of the session protocol (the reason says why)."""


@attrs.frozen
class Hello:
    session: bytes
    ack: int
    #: the client's DATA up to this number were acknowledged (it holds the rest)
    since: int = 0


@attrs.frozen
class Welcome:
    ack: int
    #: a session the server did not know: the client's received count restarts
    new: bool = False


@attrs.frozen
class Data:
    seq: int
    ack: int
    payload: tuple[bytes, ...]


@attrs.frozen
class Ack:
    ack: int


@attrs.frozen
class Ping:
    ack: int


@attrs.frozen
class PingOk:
    ack: int
    #: the last DATA the server numbered (all sent before this PING-OK)
    sent: int = 0


@attrs.frozen
class Unknown:
    pass


Message = Union[Hello, Welcome, Data, Ack, Ping, PingOk, Unknown]

_ACK_ONLY = {ACK: Ack, PING: Ping}
_NAMES = {Ack: ACK, Ping: PING}


def _number(value: int) -> bytes:
    return value.to_bytes(8, "big")


def encode(message: Message) -> list[bytes]:
    """The frames of *message*."""
    if isinstance(message, Data):
        return [PROTOCOL, DATA, _number(message.seq), _number(message.ack), *message.payload]
    if isinstance(message, Hello):
        return [PROTOCOL, HELLO, message.session, _number(message.ack), _number(message.since)]
    if isinstance(message, Welcome):
        return [PROTOCOL, WELCOME, _number(message.ack), _number(int(message.new))]
    if isinstance(message, Unknown):
        return [PROTOCOL, UNKNOWN]
    if isinstance(message, PingOk):
        return [PROTOCOL, PING_OK, _number(message.ack), _number(message.sent)]
    return [PROTOCOL, _NAMES[type(message)], _number(message.ack)]


def _read_number(frame: bytes, what: str) -> int:
    if len(frame) != 8:
        raise MalformedSession(f"{what} is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def decode(frames: Sequence[bytes]) -> Message:
    """The message in *frames*; :class:`MalformedSession` for anything else."""
    if len(frames) < 2 or frames[0] != PROTOCOL:
        raise MalformedSession(f"not a session message (first frame "
                               f"{bytes(frames[0][:16]) if frames else b''!r}, not {PROTOCOL!r})")
    command = bytes(frames[1])
    rest = frames[2:]
    if command == DATA:
        if len(rest) < 2:
            raise MalformedSession("DATA without its seq and ack")
        seq = _read_number(rest[0], "seq")
        if seq == 0:
            raise MalformedSession("DATA numbered 0 (numbers start at 1)")
        return Data(seq, _read_number(rest[1], "ack"), tuple(bytes(f) for f in rest[2:]))
    if command == HELLO:
        if len(rest) != 3:
            raise MalformedSession(f"HELLO has {len(rest)} frames after the command, not 3")
        if len(rest[0]) != SESSION_ID_BYTES:
            raise MalformedSession(f"a session id is {SESSION_ID_BYTES} bytes, not {len(rest[0])}")
        return Hello(bytes(rest[0]), _read_number(rest[1], "ack"), _read_number(rest[2], "since"))
    if command == WELCOME:
        if len(rest) != 2:
            raise MalformedSession(f"WELCOME has {len(rest)} frames after the command, not 2")
        return Welcome(_read_number(rest[0], "ack"), bool(_read_number(rest[1], "new")))
    if command == PING_OK:
        if len(rest) != 2:
            raise MalformedSession(f"PING-OK has {len(rest)} frames after the command, not 2")
        return PingOk(_read_number(rest[0], "ack"), _read_number(rest[1], "sent"))
    if command == UNKNOWN:
        if rest:
            raise MalformedSession("UNKNOWN carries frames")
        return Unknown()
    kind = _ACK_ONLY.get(command)
    if kind is None:
        raise MalformedSession(f"unknown command {command[:16]!r}")
    if len(rest) != 1:
        raise MalformedSession(f"{command.decode()} has {len(rest)} frames after the command, not 1")
    return kind(_read_number(rest[0], "ack"))
