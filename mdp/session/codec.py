"""The session protocol's messages: ``SESS01``, a command frame and its fields, numbers 8-byte
big-endian (docs/sessions.md tables them).  *ack*, in every message, is the last DATA received
in order; *max bytes* and *max frames* are the payload a side takes in one DATA (0: not said).
DATA is numbered from 1 each way, across any number of connections."""


from __future__ import annotations

import functools
from typing import Any, Sequence, Union

import attrs

from mdp.errors import ProtocolError
from mdp.machine import action_type

PROTOCOL = b"SESS01"
SESSION_ID_BYTES = 16

HELLO, WELCOME, DATA, ACK, PING, PING_OK, UNKNOWN, REFUSED, SKIP = (
    b"HELLO", b"WELCOME", b"DATA", b"ACK", b"PING", b"PING-OK", b"UNKNOWN", b"REFUSED", b"SKIP")
MAX_REASON_BYTES = 255  # the longest reason a REFUSED carries, in bytes


class MalformedSession(ProtocolError):
    """A message that is not of the session protocol (the reason says why)."""


_message = functools.partial(action_type, __name__, frozen=True)
#: client → server: attach; *since*: its last DATA it no longer holds; *epoch*: that of *ack*
Hello = _message("Hello", "session", "ack", since=0, epoch=0, maxBytes=0, maxFrames=0)
#: attached; a new *epoch* (random, never 0: the server forgot the session) numbers afresh
Welcome = _message("Welcome", "ack", epoch=1, maxBytes=0, maxFrames=0)
Data = _message("Data", "seq", "ack", "payload")
Skip = _message("Skip", "seq", "ack")  # DATA *seq* not sent: over the receiver's limits
Ack = _message("Ack", "ack")
Ping = _message("Ping", "ack")
PingOk = _message("PingOk", "ack", sent=0)  # *sent*: the last DATA the server numbered
Unknown = _message("Unknown")  # no such session, or messages lost: say HELLO
Refused = _message("Refused", "reason")  # the server holds all the sessions it may

Message = Union[Hello, Welcome, Data, Skip, Ack, Ping, PingOk, Unknown, Refused]

_COMMANDS: dict[type, bytes] = {Hello: HELLO, Welcome: WELCOME, Data: DATA, Skip: SKIP, Ack: ACK,
                                Ping: PING, PingOk: PING_OK, Unknown: UNKNOWN, Refused: REFUSED}
#: each command's message class and its fields, in their frames' order
_FIELDS = {command: (kind, tuple(field.name for field in attrs.fields(kind)))
           for kind, command in _COMMANDS.items()}
_SAID = {"maxBytes": "max bytes", "maxFrames": "max frames"}  # a field's name in an error


def _number(value: int) -> bytes:
    return value.to_bytes(8, "big")


def encode(message: Message) -> list[bytes]:
    if type(message) is Data:
        return [PROTOCOL, DATA, _number(message.seq), _number(message.ack), *message.payload]
    frames = [PROTOCOL, _COMMANDS[type(message)]]
    for value in attrs.astuple(message, recurse=False):
        if isinstance(value, str):  # a REFUSED's reason, cut between characters
            value = value.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore").encode()
        frames.append(value if isinstance(value, bytes) else _number(value))
    return frames


def _read(name: str, frame: bytes) -> Any:
    if name == "session":
        if len(frame) != SESSION_ID_BYTES:
            raise MalformedSession(f"a session id is {SESSION_ID_BYTES} bytes, not {len(frame)}")
        return bytes(frame)
    if name == "reason":
        if len(frame) > MAX_REASON_BYTES:
            raise MalformedSession(f"REFUSED carries a reason of at most {MAX_REASON_BYTES} bytes")
        return bytes(frame).decode("utf-8", "replace")
    if len(frame) != 8:
        raise MalformedSession(f"{_SAID.get(name, name)} is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def decode(frames: Sequence[bytes]) -> Message:
    """The message in *frames*; :class:`MalformedSession` for anything else."""
    if len(frames) < 2 or frames[0] != PROTOCOL:
        raise MalformedSession(f"not a session message (first frame "
                               f"{bytes(frames[0][:16]) if frames else b''!r}, not {PROTOCOL!r})")
    command = bytes(frames[1])
    if (entry := _FIELDS.get(command)) is None:
        raise MalformedSession(f"unknown command {command[:16]!r}")
    kind, names = entry
    rest, payload = frames[2:], ()
    if kind is Data:
        if len(rest) < 2:
            raise MalformedSession(f"DATA has {len(rest)} frames after the command, not at least 2")
        names, rest, payload = names[:2], rest[:2], (tuple(bytes(f) for f in rest[2:]),)
    # a HELLO or WELCOME without its limits (another make) says none
    elif len(rest) != len(names) and not (names[-1:] == ("maxFrames",) and len(rest) == len(names) - 2):
        raise MalformedSession(f"{command.decode()} has {len(rest)} frames after the command, "
                               f"not {len(names)}")
    message = kind(*map(_read, names, rest), *payload)
    if getattr(message, "seq", 1) == 0:
        raise MalformedSession(f"{command.decode()} numbered 0 (numbers start at 1)")
    if kind is Welcome and message.epoch == 0:
        raise MalformedSession("WELCOME with epoch 0")
    return message
