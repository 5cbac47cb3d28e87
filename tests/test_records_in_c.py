"""Stream records encoded and split in C (``mdp/transport/_records.pyx``)
exactly as ``mdp/transport/framing.py`` does it in Python: the same frames,
the same errors with the same messages, for any payload (hypothesis)."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp import _compiled
from mdp.errors import ProtocolError
from mdp.policy import Limits
from mdp.transport import framing

C = framing._inC
needs_c = pytest.mark.skipif(
    C is None, reason="mdp.transport._records is not built here (test_compiled: CI builds it)")


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return "ok", call()
    except ProtocolError as e:  # RecordTooLarge too
        return type(e), str(e)


def in_python(call: Callable[[], Any]) -> Any:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(framing, "_inC", None)
        return outcome(call)


frames = st.lists(st.binary(max_size=40), max_size=8)


@needs_c
@settings(max_examples=400, deadline=None)
@given(message=frames, junk=st.binary(max_size=12), cut=st.integers(0, 400),
       lead=st.binary(max_size=5), maxFrames=st.integers(1, 9), maxBytes=st.integers(0, 300))
def test_a_payload_splits_as_in_python(message: list[bytes], junk: bytes, cut: int, lead: bytes,
                                       maxFrames: int, maxBytes: int) -> None:
    # a payload as written, then cut short or followed by junk: every error path
    payload = framing.encode_record(message)[4:]
    for data in (payload, payload[:cut], payload + junk):
        buffer = lead + data + b"tail"
        # (what decode_payload reads of a Limits, below what Limits allows)
        limits = SimpleNamespace(maxMessageBytes=maxBytes, maxFrames=maxFrames)

        def split(buffer: bytes = buffer, data: bytes = data, limits: Any = limits) -> Any:
            return framing.decode_payload(buffer, len(lead), len(lead) + len(data), limits)

        assert outcome(split) == in_python(split)


@needs_c
@settings(max_examples=200, deadline=None)
@given(message=frames)
def test_a_record_encodes_as_in_python(message: list[bytes]) -> None:
    record = framing.encode_record(message)
    assert type(record) is bytes
    assert ("ok", record) == in_python(lambda: framing.encode_record(message))
    assert framing.RecordDecoder().feed(record) == [message]


@needs_c
def test_what_is_not_bytes_is_left_to_python() -> None:
    assert C.decode_payload(bytearray(b"\0\0\0\1x"), 0, 5, 8, 100) is None
    assert C.decode_payload(b"\0\0\0\1x", 0, 6, 8, 100) is None  # past the end
    assert C.encode_record([b"a", memoryview(b"b")]) is None
    # and Python does it
    assert framing.decode_payload(bytearray(b"\0\0\0\1x"), 0, 5, Limits()) == [b"x"]
    assert framing.encode_record([b"a", memoryview(b"b")]) == (
        struct.pack(">I", 10) + b"\0\0\0\1a\0\0\0\1b")


def test_the_module_is_used_only_where_it_is_built_and_current() -> None:
    status = _compiled.status()["mdp.transport._records"]
    assert (C is not None) == (status == "compiled")
