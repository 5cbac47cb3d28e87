"""The SP request/reply header, pure: backtraces, ids, nng URLs.

A request carries a *backtrace* of 32-bit big-endian words, newest first: each
device pushes the id of the channel it came on; the REQ's request id, top bit
set, is at the bottom::

    request = *hop-id  request-id  payload      ; hop-id < 2^31 <= request-id

A reply carries it back, each hop popping its word.  Over :data:`DEFAULT_MAX_HOPS`
hops a request is dropped: 7 hop words pass, 8 do not, as with nng.
"""

from __future__ import annotations

import itertools
import re
import struct
from typing import Iterator

from mdp.errors import ProtocolError, TransportError

DEFAULT_MAX_HOPS = 8  # most hops a request may take (nng's default ``NNG_OPT_MAXTTL``)
BOTTOM = 0x80000000
ID_MASK = 0x7FFFFFFF

_word = struct.Struct(">I")
word = _word.pack  # a 32-bit word of the backtrace


def split_backtrace(message: bytes, maxHops: int = DEFAULT_MAX_HOPS) -> tuple[bytes, bytes]:
    """``(backtrace, payload)`` of a request; :class:`ProtocolError` without a request id,
    or over *maxHops* hops."""
    offset = 0
    while True:
        if len(message) - offset < 4:
            raise ProtocolError("SP request without a request id (no bottom-of-stack word)")
        (value,) = _word.unpack_from(message, offset)
        offset += 4
        if value & BOTTOM:
            return message[:offset], message[offset:]
        if offset // 4 >= maxHops:
            raise ProtocolError(f"SP request over {maxHops} hops")


def pop_word(message: bytes) -> tuple[int, bytes]:
    """The first word of a reply, and the rest."""
    if len(message) < 4:
        raise ProtocolError(f"SP reply of {len(message)} bytes has no backtrace")
    return _word.unpack_from(message, 0)[0], message[4:]


def id_sequence(start: int) -> Iterator[int]:
    """31-bit ids from *start*, +1 each, wrapping to 0."""
    return (n & ID_MASK for n in itertools.count(start))


_URL = re.compile(r"^(?P<kind>tcp|tcp4|tcp6)://(?P<host>\[[^\]]*\]|[^:/]*):(?P<port>\d+)$")


def endpoint_of(url: str, listen: bool) -> str:
    """A Twisted endpoint string for an nng URL (``tcp://HOST:PORT``); other strings
    are Twisted endpoints already."""
    if "://" not in url:
        return url
    match = _URL.match(url)
    if not match:
        raise TransportError(f"bad SP URL {url!r}: nng URLs here are tcp://HOST:PORT")
    host, port = match.group("host"), int(match.group("port"))
    if port > 65535:
        raise TransportError(f"bad SP URL {url!r}: port {port} is out of range")
    kind = "tcp6" if host.startswith("[") else "tcp"
    host = host.strip("[]").replace(":", "\\:")  # (an IPv6 address, escaped for Twisted)
    if listen:
        return f"{kind}:{port}" if host in ("", "*") else f"{kind}:{port}:interface={host}"
    if host in ("", "*"):
        raise TransportError(f"bad SP URL {url!r}: a dialer needs a host")
    return f"{kind}:host={host}:port={port}"
