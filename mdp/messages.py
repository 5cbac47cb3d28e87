"""What every pattern agrees on about message bodies: frames from a caller's arguments, and error
replies.  MDP/0.2 and Freelance have no error command: a failed request gets a reply of three frames,
``[ERROR_MARKER, status code (ASCII digits), UTF-8 message]`` (the marker starts with a NUL byte); our
clients raise the :class:`~mdp.errors.RemoteError` subclass for the code."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from mdp import errors

ERROR_MARKER = b"\x00MDP-ERROR"
STATUS_WORKER_ERROR = b"500"
STATUS_UNAVAILABLE = b"503"
STATUS_OVERLOADED = b"429"
STATUS_TOO_LARGE = b"413"
STATUS_FORBIDDEN = b"403"
STATUS_BAD_REQUEST = b"400"
STATUS_CANCELLED = b"499"
STATUS_DEADLINE = b"504"

def text(name: bytes) -> str:
    """A service name as text for logs and metric labels (``echo``, not ``b'echo'``)."""
    return name.decode("utf-8", "backslashreplace")


_ERRORS: dict[bytes, type[errors.RemoteError]] = {
    STATUS_WORKER_ERROR: errors.WorkerError, STATUS_UNAVAILABLE: errors.ServiceUnavailable,
    STATUS_OVERLOADED: errors.ServiceOverloaded, STATUS_TOO_LARGE: errors.MessageTooLarge,
    STATUS_FORBIDDEN: errors.Forbidden, STATUS_CANCELLED: errors.RequestCancelled,
    STATUS_DEADLINE: errors.DeadlineExceeded}

Frame = Union[bytes, str]


def error_body(code: bytes, message: str) -> list[bytes]:
    return [ERROR_MARKER, code, message.encode("utf-8", "replace")]


def parse_error_body(body: Sequence[bytes]) -> Optional[tuple[bytes, str]]:
    """``(code, message)`` if *body* is an error reply, else ``None``."""
    if len(body) == 3 and body[0] == ERROR_MARKER:
        return bytes(body[1]), bytes(body[2]).decode("utf-8", "replace")
    return None


def remote_error(service: bytes, body: Sequence[bytes]) -> Optional[errors.RemoteError]:
    """The typed exception an error reply stands for, or ``None``."""
    parsed = parse_error_body(body)
    return None if parsed is None else _ERRORS.get(parsed[0], errors.RemoteError)(service, *parsed)


def request_frames(frames: Sequence[Frame], empty: bool = False) -> list[bytes]:
    """Normalise request body frames (``str`` is UTF-8 encoded): ``TypeError``
    for another type, ``ValueError`` for none unless *empty*."""
    body = [f if type(f) is bytes else as_frame(f, f"request frame {i}") for i, f in enumerate(frames)]
    if not body and not empty:
        raise ValueError("a request needs at least one body frame")
    return body


def bytes_frames(frames: Sequence[object]) -> list[bytes]:
    """*frames* as a list, each checked to be ``bytes`` (``TypeError`` otherwise)."""
    for frame in frames:
        if not isinstance(frame, bytes):
            raise TypeError(f"a frame is bytes, not {type(frame).__name__}: {frame!r}")
    return list(frames)  # type: ignore[arg-type]


def as_frame(item: object, what: str) -> bytes:
    """*item* as ``bytes`` (a ``str`` UTF-8 encoded): ``TypeError`` naming it *what* for another type."""
    if isinstance(item, str):
        try:
            return item.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (os.fsdecode of bad bytes)
            raise TypeError(f"{what} must be encodable as UTF-8: {e}") from None
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise TypeError(f"{what} is {type(item).__name__}, not bytes or str")


# --- relayed peers (docs/mdp.md, "Relayed peers"): a ZeroMQ connection's peers behind relay hops,
# each known by a key that begins as no routing id does (libzmq's are 5 bytes, a peer's not 0-led)
RELAYED = b"\x00\x00\x00"


def relayed_peer(routingId: bytes, hop: bytes) -> bytes:
    """The key of the peer behind relay *hop* of the connection *routingId*."""
    return RELAYED + bytes((len(routingId),)) + routingId + hop


def is_relayed(peer: object) -> bool:
    return type(peer) is bytes and len(peer) > 5 and peer[:3] == RELAYED


def relay_hop(peer: object) -> bytes:
    """A relayed peer's hop (``b""`` for any other peer)."""
    return peer[peer[3] + 4:] if is_relayed(peer) else b""  # type: ignore[index]


def routing_id(peer: bytes) -> bytes:
    """The connection's routing id of *peer*, relayed or not."""
    return peer[4:peer[3] + 4] if is_relayed(peer) else peer


def envelope(peer: bytes, frames: list[Any]) -> list[Any]:
    """The message for *peer* as a ROUTER sends it: its routing id, then a relayed peer's hop."""
    if len(peer) > 5 and peer[:3] == RELAYED:
        end = peer[3] + 4
        return [peer[4:end], peer[end:], *frames]
    return [peer, *frames]
