"""MDP/0.2 wire codec (ZeroMQ RFC 18): frames to typed commands and back, as pure functions over
``bytes`` frames without the ROUTER routing-id frame.

Dialects (docs/mdp.md): ``"rfc"`` is RFC 18; ``"majortomo"`` puts an empty frame before the header,
gives MDP/Client commands the worker codes and sends PARTIAL and FINAL without a service frame
(decoded with ``service == b""``)."""

from __future__ import annotations

import functools
import re
from typing import Optional, Sequence, Union

import attrs

from mdp.errors import ProtocolError
from mdp.machine import action_type

# every pattern shares error replies
from mdp.messages import ERROR_MARKER as ERROR_MARKER
from mdp.messages import STATUS_BAD_REQUEST as STATUS_BAD_REQUEST
from mdp.messages import STATUS_FORBIDDEN as STATUS_FORBIDDEN
from mdp.messages import STATUS_OVERLOADED as STATUS_OVERLOADED
from mdp.messages import STATUS_TOO_LARGE as STATUS_TOO_LARGE
from mdp.messages import STATUS_UNAVAILABLE as STATUS_UNAVAILABLE
from mdp.messages import STATUS_WORKER_ERROR as STATUS_WORKER_ERROR
from mdp.messages import error_body as error_body
from mdp.messages import parse_error_body as parse_error_body

CLIENT_HEADER = b"MDPC02"
WORKER_HEADER = b"MDPW02"

RFC = "rfc"
MAJORTOMO = "majortomo"
DIALECTS = (RFC, MAJORTOMO)

# MDP/Client command bytes (RFC dialect)
C_REQUEST = b"\x01"
C_PARTIAL = b"\x02"
C_FINAL = b"\x03"
#: extension (mdp.majordomo.extension): the client gives up its request to a service
C_CANCEL = b"\x04"

# MDP/Worker command bytes
W_READY = b"\x01"
W_REQUEST = b"\x02"
W_PARTIAL = b"\x03"
W_FINAL = b"\x04"
W_HEARTBEAT = b"\x05"
W_DISCONNECT = b"\x06"
#: extension: the broker tells a worker that declared it to give up a request
W_CANCEL = b"\x07"

#: What a client or worker asks, on a relay hop, of a ZeroMQ broker to learn
#: whether it relays (mdp.transport.zmqchannels): any answer says it does
#: (``mmi.binarystar``: a passive broker of a pair answers it too)
RELAY_PROBE = [CLIENT_HEADER, C_REQUEST, b"mmi.binarystar", b""]

#: Body of the PARTIAL that says a streamed reply starts over on another worker
RESTART_MARKER = b"\x00MDP-RESTART"

#: Longest service name accepted; the RFC sets none, 255 keeps tables sane.
MAX_SERVICE_LENGTH = 255

Frames = list[bytes]

#: a frozen command class with its fields
_command_class = functools.partial(action_type, __name__, frozen=True)


#: MDP/Client REQUEST (client to broker); PARTIAL, zero or more per request, and
#: FINAL, exactly one (broker to client)
ClientRequest = _command_class("ClientRequest", "service", "body")
ClientPartial = _command_class("ClientPartial", "service", "body")
ClientFinal = _command_class("ClientFinal", "service", "body")
#: MDP/Worker READY: a worker registers for one service
Ready = _command_class("Ready", "service")
#: MDP/Worker REQUEST (broker to worker); PARTIAL and FINAL, its reply (worker to broker)
WorkerRequest = _command_class("WorkerRequest", "client", "body")
WorkerPartial = _command_class("WorkerPartial", "client", "body")
WorkerFinal = _command_class("WorkerFinal", "client", "body")
#: MDP/Worker HEARTBEAT and DISCONNECT, both directions
Heartbeat = _command_class("Heartbeat")
Disconnect = _command_class("Disconnect")
#: the extension's CANCEL: a client's of its request to *service*; the broker's to a worker
#: of the request it holds for *client* (docs/mdp.md)
ClientCancel = _command_class("ClientCancel", "service")
WorkerCancel = _command_class("WorkerCancel", "client")

Command = Union[ClientRequest, ClientPartial, ClientFinal, Ready, WorkerRequest, WorkerPartial,
                WorkerFinal, Heartbeat, Disconnect, ClientCancel, WorkerCancel]

HEARTBEAT = Heartbeat()
DISCONNECT = Disconnect()

_CLIENT_TYPES = {
    RFC: {C_REQUEST: ClientRequest, C_PARTIAL: ClientPartial, C_FINAL: ClientFinal,
          C_CANCEL: ClientCancel},
    MAJORTOMO: {b"\x02": ClientRequest, b"\x03": ClientPartial, b"\x04": ClientFinal},
}
_CLIENT_CODES = {dialect: {kind: code for code, kind in table.items()}
                 for dialect, table in _CLIENT_TYPES.items()}
_WORKER_TYPES = {W_READY: Ready, W_REQUEST: WorkerRequest, W_PARTIAL: WorkerPartial,
                 W_FINAL: WorkerFinal, W_HEARTBEAT: Heartbeat, W_DISCONNECT: Disconnect,
                 W_CANCEL: WorkerCancel}
#: how many frames a worker command without a body takes
_WORKER_FRAMES = {Ready: 3, Heartbeat: 2, Disconnect: 2, WorkerCancel: 3}
#: a command's name in the RFC: REQUEST, READY, ...
_NAMES = {kind: kind.__name__.removeprefix("Client").removeprefix("Worker").upper()
          for kind in (*_CLIENT_CODES[RFC], *_WORKER_TYPES.values())}


_PRINTABLE_NAME = re.compile(rb"[\x20-\x7e]{1,%d}\Z" % MAX_SERVICE_LENGTH).match


def validate_service(service: bytes) -> bytes:
    """Return *service* if it is a non-empty printable ASCII name, else raise."""
    if _PRINTABLE_NAME(service) is not None:
        return service
    if not service:
        raise ProtocolError("empty service name")
    if len(service) > MAX_SERVICE_LENGTH:
        raise ProtocolError(f"service name is {len(service)} bytes, longer than {MAX_SERVICE_LENGTH}")
    byte = next(b for b in service if b < 0x20 or b > 0x7E)
    raise ProtocolError(f"service name {service!r} holds non-printable byte 0x{byte:02x}")


def api_service_name(service: object) -> bytes:
    """A caller's service name as wire bytes: ``TypeError`` for a type other than
    ``str``/``bytes``, ``ValueError`` for a name MDP cannot carry."""
    if not isinstance(service, (bytes, str)):
        raise TypeError(f"a service name is bytes or str, not {type(service).__name__}")
    if isinstance(service, str) and not service.isascii():
        raise ValueError(f"service name {service!r} is not ASCII")
    try:
        return validate_service(service.encode("ascii") if isinstance(service, str) else bytes(service))
    except ProtocolError as e:
        raise ValueError(str(e)) from None


def check_dialect(dialect: str) -> str:
    """Return *dialect* if it is one we speak, else raise ``ValueError``."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown MDP dialect {dialect!r}; choose one of {DIALECTS}")
    return dialect


def split(frames: Sequence[bytes]) -> tuple[str, Sequence[bytes]]:
    """``(dialect, frames)`` of an incoming message, frames from the header on."""
    if len(frames) > 1 and frames[0] == b"":
        return MAJORTOMO, frames[1:]
    return RFC, frames


def expect(frames: Sequence[bytes], dialect: str, header: Optional[bytes] = None) -> Sequence[bytes]:
    """Frames from the header on, for a peer that knows its *dialect* (and, given,
    the *header* its side receives); the other dialect's framing, or another
    header, is a :class:`~mdp.errors.ProtocolError` naming the mismatch."""
    found, rest = split(frames)
    if found != dialect:
        raise ProtocolError(f"message framed for the {found} dialect, expected {dialect} "
                            "(is the peer configured with the same dialect?)")
    if header is not None and (not rest or rest[0] != header):
        raise ProtocolError(f"missing {header.decode()} header")
    return rest


Parsed = tuple[type, bytes, Sequence[bytes]]


def parse(frames: Sequence[bytes], dialect: str = RFC) -> Parsed:
    """Check one MDP/0.2 message from its header without building the command:
    ``(command class, address, body)``, the address being the service name (client
    command, READY), the client envelope (worker REQUEST, PARTIAL, FINAL) or ``b""``."""
    if not frames:
        raise ProtocolError("empty message")
    header = frames[0]
    if header == WORKER_HEADER:
        return _parse_worker(frames)
    if header == CLIENT_HEADER:
        return _parse_client(frames, dialect)
    raise ProtocolError(f"unknown protocol header {bytes(header[:16])!r}")


def decode(frames: Sequence[bytes], dialect: str = RFC) -> Command:
    """Decode one MDP/0.2 message from its header (:func:`parse`, as a command)."""
    kind, address, body = parse(frames, dialect)
    if kind is Heartbeat or kind is Disconnect:
        return HEARTBEAT if kind is Heartbeat else DISCONNECT
    if kind is Ready or kind is ClientCancel or kind is WorkerCancel:
        return kind(address)
    return kind(address, list(body))


def _parse_client(frames: Sequence[bytes], dialect: str) -> Parsed:
    count = len(frames)
    if count < 2:
        raise ProtocolError("MDPC02 message has no command frame")
    kind = _CLIENT_TYPES[dialect].get(frames[1])
    if kind is None:
        raise ProtocolError(f"unknown MDP/Client command {bytes(frames[1][:8])!r} ({dialect} dialect)")
    if kind is ClientCancel:
        if count != 3:
            raise ProtocolError(f"MDP/Client CANCEL takes 3 frames, got {count}")
        return kind, validate_service(frames[2]), ()
    if dialect == MAJORTOMO and kind is not ClientRequest:
        if count < 3:
            raise ProtocolError(f"MDP/Client {_NAMES[kind]} needs at least 3 frames in the "
                                f"majortomo dialect, got {count} (missing body)")
        return kind, b"", frames[2:]
    if count < 4:
        what = "service name" if count < 3 else "body"
        raise ProtocolError(f"MDP/Client {_NAMES[kind]} needs at least 4 frames, got {count} "
                            f"(missing {what})")
    return kind, validate_service(frames[2]), frames[3:]


def _parse_worker(frames: Sequence[bytes]) -> Parsed:
    count = len(frames)
    if count < 2:
        raise ProtocolError("MDPW02 message has no command frame")
    kind = _WORKER_TYPES.get(frames[1])
    if kind is None:
        raise ProtocolError(f"unknown MDP/Worker command {bytes(frames[1][:8])!r}")
    expected = _WORKER_FRAMES.get(kind)
    if expected is None:  # REQUEST, PARTIAL, FINAL: an envelope and a body
        if count < 5:
            raise ProtocolError(f"MDP/Worker {_NAMES[kind]} needs at least 5 frames, got {count}")
        if frames[3] != b"":
            raise ProtocolError(f"MDP/Worker {_NAMES[kind]}: frame 3 must be the empty envelope delimiter")
        return kind, frames[2], frames[4:]
    if count != expected:
        raise ProtocolError(f"MDP/Worker {_NAMES[kind]} takes {expected} frames, got {count}")
    if kind is Ready:
        return kind, validate_service(frames[2]), ()
    return kind, (frames[2] if kind is WorkerCancel else b""), ()


_WORKER_CODES = {kind: code for code, kind in _WORKER_TYPES.items()}


def encode(command: Command, dialect: str = RFC) -> Frames:
    """Encode *command* to frames in *dialect* (see the module docstring)."""
    kind = type(command)
    if kind is ClientPartial or kind is ClientFinal:
        return encode_client_reply(command.service, command.body, kind is ClientFinal, dialect)
    if kind is ClientRequest:
        frames = [CLIENT_HEADER, _CLIENT_CODES[dialect][kind], command.service, *command.body]
    elif kind is ClientCancel:
        frames = [CLIENT_HEADER, C_CANCEL, command.service]
    elif kind in _WORKER_FRAMES:  # READY, HEARTBEAT, DISCONNECT
        frames = [WORKER_HEADER, _WORKER_CODES[kind], *attrs.astuple(command)]
    elif kind in _WORKER_CODES:  # REQUEST, PARTIAL, FINAL
        return encode_worker(_WORKER_CODES[kind], command.client, command.body, dialect)
    else:
        raise TypeError(f"not an MDP command: {command!r}")
    return frames if dialect == RFC else [b"", *frames]


def encode_worker(code: bytes, client: bytes, body: Sequence[bytes], dialect: str = RFC) -> Frames:
    """A worker REQUEST, PARTIAL or FINAL (*code*) as :func:`encode` gives it (hot path)."""
    if dialect == RFC:
        return [WORKER_HEADER, code, client, b"", *body]
    return [b"", WORKER_HEADER, code, client, b"", *body]


def encode_client_reply(service: bytes, body: Sequence[bytes], final: bool, dialect: str = RFC) -> Frames:
    """``encode(ClientFinal or ClientPartial(service, body), dialect)`` (hot path)."""
    if dialect == RFC:
        return [CLIENT_HEADER, C_FINAL if final else C_PARTIAL, service, *body]
    code = _CLIENT_CODES[dialect][ClientFinal if final else ClientPartial]
    return [b"", CLIENT_HEADER, code, *body]  # majortomo replies carry no service name
