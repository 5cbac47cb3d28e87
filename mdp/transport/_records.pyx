# cython: language_level=3
"""Stream records (``mdp/transport/framing.py``) encoded and split in C
(optional).

A record's frames each cost the Python code a length unpacked through
``struct``, a slice of a memoryview and a ``bytes`` made of it; here they
cost a loop over the buffer.
:func:`decode_payload` and :func:`encode_record` do exactly what the
functions of the same names in ``framing`` do, errors and their messages
included, for ``bytes``; given anything else they answer None and the
caller does it in Python.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

from mdp.errors import ProtocolError, RecordTooLarge


cdef inline Py_ssize_t _length(const unsigned char *at) noexcept:
    return (<Py_ssize_t>at[0] << 24) | (<Py_ssize_t>at[1] << 16) | (<Py_ssize_t>at[2] << 8) | at[3]


cdef inline void _put(unsigned char *at, Py_ssize_t value) noexcept:
    at[0] = (value >> 24) & 0xFF
    at[1] = (value >> 16) & 0xFF
    at[2] = (value >> 8) & 0xFF
    at[3] = value & 0xFF


def decode_payload(object buffer, Py_ssize_t start, Py_ssize_t end, Py_ssize_t maxFrames,
                   Py_ssize_t maxBytes):
    """The frames of the payload ``buffer[start:end]`` (*buffer*: ``bytes``;
    None for anything else), as ``framing.decode_payload`` with
    ``Limits(maxMessageBytes=maxBytes, maxFrames=maxFrames)``."""
    if type(buffer) is not bytes or start < 0 or end > PyBytes_GET_SIZE(buffer):
        return None
    cdef const unsigned char *data = <const unsigned char *>PyBytes_AS_STRING(buffer)
    cdef list frames = []
    cdef Py_ssize_t offset = start, size, count = 0
    while offset < end:
        if count == maxFrames:
            raise RecordTooLarge(f"record holds more than {maxFrames} frames")
        if end - offset < 4:
            raise ProtocolError("truncated frame length in stream record")
        size = _length(data + offset)
        offset += 4
        if size > end - offset:
            raise ProtocolError(f"frame of {size} bytes overruns its record ({end - offset} left)")
        frames.append(PyBytes_FromStringAndSize(<const char *>data + offset, size))
        count += 1
        offset += size
    cdef Py_ssize_t content = (end - start) - 4 * count
    if content > maxBytes:
        raise RecordTooLarge(
            f"record holds {content} bytes of frames, over the limit of {maxBytes}")
    return frames


def encode_record(list frames):
    """One whole record (length prefix included) holding *frames*, as
    ``framing.encode_record``; None if a frame is not ``bytes``, or the
    record would be longer than its 32-bit length can say (the caller's
    ``struct`` then raises as it always did)."""
    cdef Py_ssize_t size = 0, length
    cdef object frame
    for frame in frames:
        if type(frame) is not bytes:
            return None
        size += 4 + PyBytes_GET_SIZE(frame)
    if size > 0xFFFFFFFF:
        return None
    cdef bytes record = PyBytes_FromStringAndSize(NULL, 4 + size)
    cdef unsigned char *out = <unsigned char *>PyBytes_AS_STRING(record)
    _put(out, size)
    out += 4
    for frame in frames:
        length = PyBytes_GET_SIZE(frame)
        _put(out, length)
        memcpy(out + 4, PyBytes_AS_STRING(frame), length)
        out += 4 + length
    return record
