"""A handler's reply, normalised to frames (``mdp.handlers.reply_frames``):
every kind of reply a handler may give, the common ones (a list of ``bytes``,
``bytes``) through a short path, with the same answers and errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdp.handlers import reply_frames

frame = st.one_of(st.binary(max_size=8), st.text(max_size=8),
                  st.binary(max_size=8).map(bytearray), st.binary(max_size=8).map(memoryview))


def expected(value: Any) -> list[bytes]:
    """What the documentation says: ``bytes``/``str`` (UTF-8) or a list of
    them, ``None`` or ``[]`` one empty frame."""
    if value is None:
        return [b""]
    items = [value] if isinstance(value, (bytes, bytearray, memoryview, str)) else list(value)
    frames = [item.encode() if isinstance(item, str) else bytes(item) for item in items]
    return frames or [b""]


@given(st.one_of(st.none(), frame, st.lists(frame, max_size=4), st.lists(st.binary(), max_size=4),
                 st.lists(frame, max_size=4).map(tuple)))
def test_a_reply_becomes_the_frames_it_says(value: Any) -> None:
    got = reply_frames(value)
    assert got == expected(value)
    assert all(type(f) is bytes for f in got)
    assert got is not value  # the handler's own list is left to it


@pytest.mark.parametrize("value", [[b"a", 1], [None], 3, [b"a", [b"b"]], {b"a": b"b"}, {b"a"},
                                   "caf\udce9", [b"a", "caf\udce9"]])
def test_anything_else_is_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        reply_frames(value)
