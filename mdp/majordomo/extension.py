"""The request-context extension of MDP/0.2 (docs/mdp.md, "Deadlines, cancellation and
trace context"), as pure functions: a worker declares it by asking ``mmi.extensions`` before
its READY, a client learns from the answer whether the broker takes it; only then does a
request carry a **context frame** (its remaining time, a W3C trace context) and may be
**cancelled**.  An RFC 18 peer never sees any of it."""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Sequence

from mdp.errors import ProtocolError

# the statuses of a request given up: its caller cancelled it; its deadline passed
from mdp.messages import STATUS_CANCELLED as STATUS_CANCELLED
from mdp.messages import STATUS_DEADLINE as STATUS_DEADLINE

#: what a broker that takes the extension answers ``mmi.extensions`` with, after ``200``
FEATURES = b"deadline cancel trace"
#: a request body's first frame, when it carries a context: this marker, then fields
CONTEXT_MARKER = b"\x00MDP-CTX"
#: the MMI service a client asks (and a worker, before READY, to declare that it takes them)
MMI_EXTENSIONS = b"mmi.extensions"
#: that request, as a client or a worker sends it
ASK_EXTENSIONS = [b"MDPC02", b"\x01", MMI_EXTENSIONS, b""]

#: longest context frame taken; longest ``tracestate`` (W3C: up to 512 characters)
MAX_CONTEXT_BYTES = 1024
MAX_TRACESTATE = 512
#: longest remaining time, in milliseconds (a week)
MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000

_NAME = re.compile(rb"[a-z][a-z0-9-]{0,31}\Z").match
_VALUE = re.compile(rb"[\x21-\x7e][\x20-\x7e]{0,511}\Z").match
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}\Z").match


class RequestContext(NamedTuple):
    """What a request carries besides its body: *deadline* (milliseconds left when it was
    sent, or None), *traceparent* and *tracestate* (W3C Trace Context, or None)."""

    deadline: Optional[int] = None
    traceparent: Optional[bytes] = None
    tracestate: Optional[bytes] = None


def has_context(body: Sequence[bytes]) -> bool:
    """The body starts with a context frame (checked cheaply: its marker)."""
    if not body:
        return False
    first = body[0]
    if type(first) is not bytes:  # (a buffer kept uncopied)
        first = bytes(memoryview(first)[:8])
    return first.startswith(CONTEXT_MARKER)


def encode_context(context: RequestContext) -> bytes:
    """The context frame of *context* (``ValueError`` for a field out of range)."""
    deadline, traceparent, tracestate = context
    frame = CONTEXT_MARKER
    if deadline is not None:
        if not 1 <= deadline <= MAX_DEADLINE_MS:
            raise ValueError(f"a deadline is 1 to {MAX_DEADLINE_MS} ms, not {deadline}")
        frame += b"\ndeadline=%d" % deadline
    if traceparent is not None:
        frame += b"\ntraceparent=" + traceparent
    if tracestate is not None:
        frame += b"\ntracestate=" + tracestate
    if len(frame) > MAX_CONTEXT_BYTES:
        raise ValueError(f"a context frame is at most {MAX_CONTEXT_BYTES} bytes, not {len(frame)}")
    return frame


def decode_context(frame: bytes) -> RequestContext:
    """A context frame's fields (unknown names are skipped); :class:`ProtocolError` names
    what is wrong with a malformed one."""
    frame = bytes(frame)
    if len(frame) > MAX_CONTEXT_BYTES:
        raise ProtocolError(f"context frame of {len(frame)} bytes (at most {MAX_CONTEXT_BYTES})")
    lines = frame.split(b"\n")
    if lines[0] != CONTEXT_MARKER:
        raise ProtocolError("context frame without its marker")
    deadline = traceparent = tracestate = None
    for line in lines[1:]:
        name, equals, value = line.partition(b"=")
        if name == b"deadline":
            deadline = _deadline(value)
        elif not equals or _NAME(name) is None or _VALUE(value) is None:
            raise ProtocolError(f"malformed context field {line[:40]!r}")
        elif name == b"traceparent":
            traceparent = _traceparent(value)
        elif name == b"tracestate":
            tracestate = value
    return RequestContext(deadline, traceparent, tracestate)


def _deadline(value: bytes) -> int:
    if not (value.isdigit() and value[:1] != b"0" and len(value) <= 10
            and int(value) <= MAX_DEADLINE_MS):
        raise ProtocolError(f"deadline {value[:20]!r}: 1 to {MAX_DEADLINE_MS} milliseconds")
    return int(value)


def _traceparent(value: bytes) -> bytes:
    match = _TRACEPARENT(value)
    if match is None or set(match.group(1)) == {0x30} or set(match.group(2)) == {0x30}:
        raise ProtocolError(f"malformed traceparent {value[:60]!r}")
    return value


def split_context(body: Sequence[bytes]) -> tuple[Optional[RequestContext], list[bytes]]:
    """``(context or None, the rest of the body)``; :class:`ProtocolError` for a malformed
    context frame or none left after it."""
    if not has_context(body):
        return None, list(body)
    if len(body) < 2:
        raise ProtocolError("a context frame and no body")
    return decode_context(body[0]), list(body[1:])


def takes_extensions(reply: Sequence[bytes]) -> bool:
    """An ``mmi.extensions`` FINAL body says the broker takes deadlines and cancellation."""
    return len(reply) == 2 and reply[0] == b"200" and b"deadline" in bytes(reply[1]).split()
