"""The Titanic Service Protocol (ZeroMQ RFC 9) as pure functions, no I/O: ``titanic.request``,
``titanic.reply`` and ``titanic.close``, each answered with a status frame first (docs/titanic.md,
"The protocol"); a malformed body, or a failing store, is answered ``500`` and a message."""

from __future__ import annotations

import uuid
from typing import Sequence

from mdp.errors import ProtocolError, TitanicError

REQUEST = b"titanic.request"
REPLY = b"titanic.reply"
CLOSE = b"titanic.close"
SERVICES = (REQUEST, REPLY, CLOSE)

OK = b"200"
PENDING = b"300"
UNKNOWN = b"400"
FAILED = b"500"

#: the third frame of a refusal, saying which limit: too large, the store full
TOO_LARGE = b"413"
STORE_FULL = b"507"

#: longest service name a stored request may name (MDP's own bound)
MAX_SERVICE_NAME = 255


class MalformedTitanicRequest(ProtocolError):
    """A Titanic request body that breaks the protocol (answered ``500``)."""


class TitanicRefused(TitanicError):
    """A request refused at one of Titanic's limits, not stored: *status*, message, *code*."""

    status = FAILED
    code = b""


class TitanicRequestTooLarge(TitanicRefused):
    """A request over Titanic's per-request size limit (``400``: the caller's mistake)."""

    status = UNKNOWN
    code = TOO_LARGE


class TitanicStoreFull(TitanicRefused):
    """Titanic's store is at its size limit: submit again once replies are collected or purged."""

    code = STORE_FULL


REFUSALS = {cls.code: cls for cls in (TitanicRequestTooLarge, TitanicStoreFull)}


def refused(error: TitanicRefused) -> list[bytes]:
    """The reply refusing a request for *error*."""
    return [error.status, str(error).encode("utf-8", "replace"), error.code]


def parse_request(body: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """``titanic.request``: the service to call and the request frames."""
    if len(body) < 2:
        raise MalformedTitanicRequest("titanic.request needs a service name and at least one "
                                      "request frame")
    service = bytes(body[0])
    if not service or len(service) > MAX_SERVICE_NAME:
        raise MalformedTitanicRequest(f"service name of {len(service)} bytes (1 to "
                                      f"{MAX_SERVICE_NAME})")
    if not service.isascii() or not service.decode("ascii").isprintable():
        raise MalformedTitanicRequest(f"service name {service!r} is not printable ASCII")
    if service.startswith(b"titanic."):
        raise MalformedTitanicRequest(f"{service.decode('ascii')} is Titanic's own service")
    if service.startswith(b"mmi."):
        raise MalformedTitanicRequest(f"{service.decode('ascii')} is answered by the broker at "
                                      f"once; call it directly")
    return service, [bytes(f) for f in body[1:]]


def parse_id(body: Sequence[bytes], service: bytes) -> str:
    """``titanic.reply`` / ``titanic.close``: the request id, as canonical text."""
    if len(body) != 1:
        raise MalformedTitanicRequest(f"{service.decode('ascii')} takes one frame, the request "
                                      f"id; got {len(body)}")
    try:
        text = bytes(body[0]).decode("ascii")
        parsed = uuid.UUID(text)
    except (UnicodeDecodeError, ValueError):
        raise MalformedTitanicRequest(f"{bytes(body[0])[:64]!r} is not a request id (a UUID)") from None
    if str(parsed) != text:  # lowercase, as Titanic gives them out
        raise MalformedTitanicRequest(f"{text!r} is not a request id in canonical text form "
                                      "(8-4-4-4-12 lowercase hex)")
    return str(parsed)


def failed(reason: str) -> list[bytes]:
    """The ``500`` reply saying *reason*."""
    return [FAILED, reason.encode("utf-8", "replace")]
