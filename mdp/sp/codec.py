"""The SP request/reply header, pure: backtraces, ids, nng URLs.

A request travels with a *backtrace* in front of its payload: 32-bit
big-endian words, the newest first.  Every REP hop (a device) pushes the id of
the channel the request came on (top bit clear); the originating REQ put the
request id at the bottom of the stack (top bit set)::

    request = *hop-id  request-id  payload      ; hop-id < 2^31 <= request-id

A reply carries the same backtrace back; each hop pops its word to learn where
to send it.  A request reaching its REP has taken one hop more than it has hop
words; nng drops one over :data:`DEFAULT_MAX_HOPS` hops (its
``NNG_OPT_MAXTTL``): 7 hop words pass, 8 do not, as with nng.
"""

from __future__ import annotations

import re
import struct

from mdp.errors import ProtocolError, TransportError

#: Most hops a request may take (nng's default ``NNG_OPT_MAXTTL``).
DEFAULT_MAX_HOPS = 8
#: The bit that marks the bottom of the stack (the request id).
BOTTOM = 0x80000000
ID_MASK = 0x7FFFFFFF

_word = struct.Struct(">I")


def word(value: int) -> bytes:
    return _word.pack(value)


def split_backtrace(message: bytes, maxHops: int = DEFAULT_MAX_HOPS) -> tuple[bytes, bytes]:
    """``(backtrace, payload)`` of a request: the backtrace is every hop word
    and the request id.  :class:`ProtocolError` if the stack has no bottom
    word, or *maxHops* hop words or more above it (over *maxHops* hops)."""
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
    """The first word of a reply and the rest (a device learns the channel
    to send it on; a REQ its request id)."""
    if len(message) < 4:
        raise ProtocolError(f"SP reply of {len(message)} bytes has no backtrace")
    return _word.unpack_from(message, 0)[0], message[4:]


class IdSequence:
    """31-bit ids from *start*, +1 each, wrapping to 0 after 2^31-1 (SP's
    channel ids; with the top bit set, its request ids)."""

    def __init__(self, start: int) -> None:
        self.value = start & ID_MASK

    def next(self) -> int:
        value = self.value
        self.value = (value + 1) & ID_MASK
        return value


_URL = re.compile(r"^(?P<kind>tcp|tcp4|tcp6)://(?P<host>\[[^\]]*\]|[^:/]*):(?P<port>\d+)$")


def endpoint_of(url: str, listen: bool) -> str:
    """A Twisted endpoint string for an nng URL (``tcp://127.0.0.1:5555``,
    ``tcp://*:0`` or ``tcp://127.0.0.1:0`` to let the OS pick a port); a
    string that is not an nng URL is taken as a Twisted endpoint already."""
    if "://" not in url:
        return url
    match = _URL.match(url)
    if not match:
        raise TransportError(f"bad SP URL {url!r}: nng URLs here are tcp://HOST:PORT")
    host, port = match.group("host"), int(match.group("port"))
    if port > 65535:
        raise TransportError(f"bad SP URL {url!r}: port {port} is out of range")
    v6 = host.startswith("[")
    host = host.strip("[]")
    if listen:
        kind = "tcp6" if v6 else "tcp"
        if host in ("", "*"):
            return f"{kind}:{port}"
        return f"{kind}:{port}:interface={host.replace(':', chr(92) + ':')}"
    if host in ("", "*"):
        raise TransportError(f"bad SP URL {url!r}: a dialer needs a host")
    if v6:
        return f"tcp6:host={host.replace(':', chr(92) + ':')}:port={port}"
    return f"tcp:host={host}:port={port}"
