"""The session protocol's messages: frames in, typed commands out.

Each message is ``SESS01``, a command frame and its fields; numbers are 8-byte big-endian::

    HELLO    session id (16 bytes), ack, since,  client → server: attach; *since*: its last DATA
             epoch, max bytes, max frames        it no longer holds; *epoch*: the one *ack* is of
    WELCOME  ack, epoch, max bytes, max frames   attached; a new *epoch* (the server forgot the
                                                 session) numbers afresh
    DATA     seq, ack, payload frames...         either way
    SKIP     seq, ack                            either way: DATA *seq* is over the receiver's limits
    ACK      ack                                 either way
    PING     ack                                 client → server, when idle
    PING-OK  ack, sent                           *sent*: the last DATA the server numbered
    UNKNOWN                                      no such session, or messages lost: say HELLO
    REFUSED  reason (UTF-8)                      the server holds all the sessions it may

*ack* is the last DATA received in order; every message carries it.  *max
bytes* and *max frames* are the payload a side takes in one DATA (0: not
said).  DATA is numbered from 1 each way, across any number of connections.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

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
REFUSED = b"REFUSED"
SKIP = b"SKIP"
#: the longest reason a REFUSED carries, in bytes
MAX_REASON_BYTES = 255


class MalformedSession(ProtocolError):
    """A message that is not of the session protocol (the reason says why)."""


@attrs.frozen
class Hello:
    session: bytes
    ack: int
    since: int = 0
    epoch: int = 0
    maxBytes: int = 0
    maxFrames: int = 0


@attrs.frozen
class Welcome:
    ack: int
    #: the server's incarnation of the session (random, never 0)
    epoch: int = 1
    maxBytes: int = 0
    maxFrames: int = 0


@attrs.frozen
class Data:
    seq: int
    ack: int
    payload: tuple[bytes, ...]


@attrs.frozen
class Skip:
    """DATA *seq* is not sent: its payload is over the receiver's limits."""

    seq: int
    ack: int


@attrs.frozen
class Ack:
    ack: int


@attrs.frozen
class Ping:
    ack: int


@attrs.frozen
class PingOk:
    ack: int
    sent: int = 0


@attrs.frozen
class Unknown:
    pass


@attrs.frozen
class Refused:
    reason: str


Message = Union[Hello, Welcome, Data, Skip, Ack, Ping, PingOk, Unknown, Refused]

_NAMES = {Ack: ACK, Ping: PING}


def _number(value: int) -> bytes:
    return value.to_bytes(8, "big")


def encode(message: Message) -> list[bytes]:
    """The frames of *message*."""
    if isinstance(message, Data):
        return [PROTOCOL, DATA, _number(message.seq), _number(message.ack), *message.payload]
    if isinstance(message, Hello):
        return [PROTOCOL, HELLO, message.session, _number(message.ack), _number(message.since),
                _number(message.epoch), _number(message.maxBytes), _number(message.maxFrames)]
    if isinstance(message, Welcome):
        return [PROTOCOL, WELCOME, _number(message.ack), _number(message.epoch),
                _number(message.maxBytes), _number(message.maxFrames)]
    if isinstance(message, Skip):
        return [PROTOCOL, SKIP, _number(message.seq), _number(message.ack)]
    if isinstance(message, Unknown):
        return [PROTOCOL, UNKNOWN]
    if isinstance(message, Refused):
        return [PROTOCOL, REFUSED,
                message.reason.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore")
                .encode("utf-8")]
    if isinstance(message, PingOk):
        return [PROTOCOL, PING_OK, _number(message.ack), _number(message.sent)]
    return [PROTOCOL, _NAMES[type(message)], _number(message.ack)]


def _read_number(frame: bytes, what: str) -> int:
    if len(frame) != 8:
        raise MalformedSession(f"{what} is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def _limits(frames: Sequence[bytes]) -> tuple[int, int]:
    """The limits a HELLO or WELCOME says (none: 0, 0)."""
    if not frames:
        return 0, 0
    return _read_number(frames[0], "max bytes"), _read_number(frames[1], "max frames")


def _seq(frame: bytes, command: str) -> int:
    seq = _read_number(frame, "seq")
    if seq == 0:
        raise MalformedSession(f"{command} numbered 0 (numbers start at 1)")
    return seq


def _hello(rest: Sequence[bytes]) -> Hello:
    if len(rest[0]) != SESSION_ID_BYTES:
        raise MalformedSession(f"a session id is {SESSION_ID_BYTES} bytes, not {len(rest[0])}")
    return Hello(bytes(rest[0]), _read_number(rest[1], "ack"), _read_number(rest[2], "since"),
                 _read_number(rest[3], "epoch"), *_limits(rest[4:]))


def _welcome(rest: Sequence[bytes]) -> Welcome:
    epoch = _read_number(rest[1], "epoch")
    if epoch == 0:
        raise MalformedSession("WELCOME with epoch 0")
    return Welcome(_read_number(rest[0], "ack"), epoch, *_limits(rest[2:]))


def _refused(rest: Sequence[bytes]) -> Refused:
    if len(rest[0]) > MAX_REASON_BYTES:
        raise MalformedSession(f"REFUSED carries a reason of at most {MAX_REASON_BYTES} bytes")
    return Refused(bytes(rest[0]).decode("utf-8", "replace"))


#: each command's reader and the frame counts it takes after the command (DATA: two or more)
_READERS: dict[bytes, tuple[Callable[[Sequence[bytes]], Message], tuple[int, ...]]] = {
    DATA: (lambda rest: Data(_seq(rest[0], "DATA"), _read_number(rest[1], "ack"),
                             tuple(bytes(f) for f in rest[2:])), ()),
    HELLO: (_hello, (4, 6)),
    WELCOME: (_welcome, (2, 4)),
    SKIP: (lambda rest: Skip(_seq(rest[0], "SKIP"), _read_number(rest[1], "ack")), (2,)),
    ACK: (lambda rest: Ack(_read_number(rest[0], "ack")), (1,)),
    PING: (lambda rest: Ping(_read_number(rest[0], "ack")), (1,)),
    PING_OK: (lambda rest: PingOk(_read_number(rest[0], "ack"), _read_number(rest[1], "sent")),
              (2,)),
    UNKNOWN: (lambda rest: Unknown(), (0,)),
    REFUSED: (_refused, (1,)),
}


def decode(frames: Sequence[bytes]) -> Message:
    """The message in *frames*; :class:`MalformedSession` for anything else."""
    if len(frames) < 2 or frames[0] != PROTOCOL:
        raise MalformedSession(f"not a session message (first frame "
                               f"{bytes(frames[0][:16]) if frames else b''!r}, not {PROTOCOL!r})")
    command = bytes(frames[1])
    reader = _READERS.get(command)
    if reader is None:
        raise MalformedSession(f"unknown command {command[:16]!r}")
    read, counts = reader
    rest = frames[2:]
    if len(rest) not in counts and (counts or len(rest) < 2):
        raise MalformedSession(f"{command.decode()} has {len(rest)} frames after the command, "
                               f"not {counts[-1] if counts else 'at least 2'}")
    return read(rest)
